//! The few `pgoutput` messages the WAL relay reads: a table's columns
//! (`Relation`) and its new rows (`Insert`), in binary format.
//!
//! pgoutput sends a `Relation` before the first change of a table in a
//! session (and again after its schema changes), so rows are decoded by
//! column name, whatever order a migration left the columns in.

use bytes::{Buf, Bytes};
use chrono::{DateTime, TimeZone, Utc};
use keel_store::broker::Headers;
use keel_store::{OutboxRecord, PendingOutbox};

/// A message the stream could not read: the relay stops streaming and the
/// polling sweep carries the outbox until it reconnects.
#[derive(Debug, thiserror::Error)]
#[error("unreadable pgoutput message: {0}")]
pub(crate) struct DecodeError(String);

fn err(what: impl Into<String>) -> DecodeError {
    DecodeError(what.into())
}

/// One decoded message, as far as the relay cares.
#[derive(Debug, PartialEq)]
pub(crate) enum Change {
    /// A table's columns: `oid`, its schema and name, its column names.
    Relation(Relation),
    /// A new row of table `oid`: each column's value (`None` for NULL).
    Insert {
        oid: u32,
        values: Vec<Option<Bytes>>,
    },
    /// Anything else (types, origins, truncates, updates of other tables).
    Other,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Relation {
    pub(crate) oid: u32,
    pub(crate) schema: String,
    pub(crate) table: String,
    pub(crate) columns: Vec<String>,
}

pub(crate) fn decode(mut data: Bytes) -> Result<Change, DecodeError> {
    need(&data, 1)?;
    match data.get_u8() {
        b'R' => relation(data).map(Change::Relation),
        b'I' => insert(data),
        _ => Ok(Change::Other),
    }
}

fn need(data: &Bytes, n: usize) -> Result<(), DecodeError> {
    if data.remaining() < n {
        return Err(err(format!(
            "{n} more bytes expected, {} left",
            data.remaining()
        )));
    }
    Ok(())
}

fn cstring(data: &mut Bytes) -> Result<String, DecodeError> {
    let end = data
        .iter()
        .position(|b| *b == 0)
        .ok_or_else(|| err("unterminated string"))?;
    let text = data.split_to(end);
    data.advance(1);
    String::from_utf8(text.to_vec()).map_err(|e| err(e.to_string()))
}

fn relation(mut data: Bytes) -> Result<Relation, DecodeError> {
    need(&data, 4)?;
    let oid = data.get_u32();
    let schema = cstring(&mut data)?;
    let table = cstring(&mut data)?;
    need(&data, 3)?;
    data.advance(1); // replica identity setting
    let count = data.get_u16();
    let mut columns = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        need(&data, 1)?;
        data.advance(1); // flags (part of the key)
        columns.push(cstring(&mut data)?);
        need(&data, 8)?;
        data.advance(8); // type oid, type modifier
    }
    Ok(Relation {
        oid,
        schema,
        table,
        columns,
    })
}

fn insert(mut data: Bytes) -> Result<Change, DecodeError> {
    need(&data, 7)?;
    let oid = data.get_u32();
    if data.get_u8() != b'N' {
        return Err(err("an insert without its new tuple"));
    }
    let count = data.get_u16();
    let mut values = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        need(&data, 1)?;
        match data.get_u8() {
            b'n' | b'u' => values.push(None),
            b'b' | b't' => {
                need(&data, 4)?;
                let len = data.get_u32() as usize;
                need(&data, len)?;
                values.push(Some(data.split_to(len)));
            }
            kind => return Err(err(format!("unknown column kind {kind}"))),
        }
    }
    Ok(Change::Insert { oid, values })
}

/// Where each column the relay reads sits in the outbox table's rows.
#[derive(Debug, Clone)]
pub(crate) struct OutboxColumns {
    id: usize,
    event_id: usize,
    topic: usize,
    partition_key: usize,
    headers: usize,
    payload: usize,
    created_at: usize,
}

impl OutboxColumns {
    pub(crate) fn of(relation: &Relation) -> Result<Self, DecodeError> {
        let at = |name: &str| {
            relation
                .columns
                .iter()
                .position(|c| c == name)
                .ok_or_else(|| err(format!("the outbox table has no column {name}")))
        };
        Ok(Self {
            id: at("id")?,
            event_id: at("event_id")?,
            topic: at("topic")?,
            partition_key: at("partition_key")?,
            headers: at("headers")?,
            payload: at("payload")?,
            created_at: at("created_at")?,
        })
    }

    /// The row as the relay claims it (binary format: `bigint` big-endian,
    /// `text` as UTF-8, `jsonb` with its version byte, `bytea` raw,
    /// `timestamptz` as microseconds since 2000-01-01 UTC).
    pub(crate) fn row(&self, values: &[Option<Bytes>]) -> Result<PendingOutbox, DecodeError> {
        let value = |i: usize| {
            values
                .get(i)
                .and_then(Option::as_ref)
                .ok_or_else(|| err(format!("outbox column {i} is missing or NULL")))
        };
        let text = |i: usize| String::from_utf8(value(i)?.to_vec()).map_err(|e| err(e.to_string()));
        let id = be_i64(value(self.id)?)?;
        let headers = value(self.headers)?;
        let headers: Headers = match headers.split_first() {
            Some((1, json)) => serde_json::from_slice(json).map_err(|e| err(e.to_string()))?,
            _ => return Err(err("outbox headers are not jsonb version 1")),
        };
        Ok(PendingOutbox {
            id,
            record: OutboxRecord {
                event_id: text(self.event_id)?,
                topic: text(self.topic)?,
                partition_key: text(self.partition_key)?,
                headers,
                payload: value(self.payload)?.clone(),
            },
            created_at: timestamp(be_i64(value(self.created_at)?)?)?,
            attempts: 0,
        })
    }
}

fn be_i64(bytes: &Bytes) -> Result<i64, DecodeError> {
    let array: [u8; 8] = bytes[..]
        .try_into()
        .map_err(|_| err(format!("an 8-byte integer of {} bytes", bytes.len())))?;
    Ok(i64::from_be_bytes(array))
}

/// PostgreSQL's epoch, 2000-01-01 UTC, in Unix microseconds.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

fn timestamp(pg_micros: i64) -> Result<DateTime<Utc>, DecodeError> {
    pg_micros
        .checked_add(PG_EPOCH_UNIX_MICROS)
        .and_then(|unix| Utc.timestamp_micros(unix).single())
        .ok_or_else(|| err(format!("timestamp {pg_micros} out of range")))
}

#[cfg(test)]
mod tests {
    use bytes::{BufMut, BytesMut};

    use super::*;

    const COLUMNS: [&str; 7] = [
        "id",
        "event_id",
        "topic",
        "partition_key",
        "headers",
        "payload",
        "created_at",
    ];

    fn relation_message() -> Bytes {
        let mut m = BytesMut::new();
        m.put_u8(b'R');
        m.put_u32(16_384);
        m.put_slice(b"keel\0keel_outbox\0");
        m.put_u8(b'd');
        m.put_u16(COLUMNS.len() as u16);
        for name in COLUMNS {
            m.put_u8(0);
            m.put_slice(name.as_bytes());
            m.put_u8(0);
            m.put_u32(25);
            m.put_i32(-1);
        }
        m.freeze()
    }

    fn insert_message(values: &[Option<&[u8]>]) -> Bytes {
        let mut m = BytesMut::new();
        m.put_u8(b'I');
        m.put_u32(16_384);
        m.put_u8(b'N');
        m.put_u16(values.len() as u16);
        for value in values {
            match value {
                None => m.put_u8(b'n'),
                Some(bytes) => {
                    m.put_u8(b'b');
                    m.put_u32(bytes.len() as u32);
                    m.put_slice(bytes);
                }
            }
        }
        m.freeze()
    }

    #[test]
    fn an_outbox_insert_decodes_into_the_row_the_relay_claims() {
        let Change::Relation(relation) = decode(relation_message()).unwrap() else {
            panic!("a relation");
        };
        assert_eq!(
            (relation.schema.as_str(), relation.table.as_str()),
            ("keel", "keel_outbox")
        );
        let columns = OutboxColumns::of(&relation).unwrap();
        let created = 86_400_000_000_i64; // 2000-01-02
        let headers = b"\x01{\"event-id\": \"e-1\"}";
        let insert = insert_message(&[
            Some(&7_i64.to_be_bytes()),
            Some(b"e-1"),
            Some(b"orders"),
            Some(b"order-1"),
            Some(headers),
            Some(b"\x00\xffbody"),
            Some(&created.to_be_bytes()),
        ]);
        let Change::Insert { oid, values } = decode(insert).unwrap() else {
            panic!("an insert");
        };
        assert_eq!(oid, 16_384);
        let row = columns.row(&values).unwrap();
        assert_eq!(row.id, 7);
        assert_eq!(row.record.event_id, "e-1");
        assert_eq!(row.record.topic, "orders");
        assert_eq!(row.record.partition_key, "order-1");
        assert_eq!(row.record.headers["event-id"], "e-1");
        assert_eq!(&row.record.payload[..], b"\x00\xffbody");
        assert_eq!(row.created_at.to_rfc3339(), "2000-01-02T00:00:00+00:00");
    }

    #[test]
    fn truncated_and_malformed_messages_are_errors_not_panics() {
        let whole = relation_message();
        for cut in 1..whole.len() {
            assert!(decode(whole.slice(..cut)).is_err(), "cut at {cut}");
        }
        let insert = insert_message(&[Some(b"short")]);
        let Change::Insert { values, .. } = decode(insert.clone()).unwrap() else {
            panic!("an insert");
        };
        let Change::Relation(relation) = decode(relation_message()).unwrap() else {
            panic!("a relation");
        };
        assert!(OutboxColumns::of(&relation).unwrap().row(&values).is_err());
        for cut in 1..insert.len() {
            assert!(decode(insert.slice(..cut)).is_err(), "cut at {cut}");
        }
        assert_eq!(
            decode(Bytes::from_static(b"Yanything")).unwrap(),
            Change::Other
        );
        assert!(decode(Bytes::new()).is_err());
    }
}
