//! The transactional outbox.
//!
//! Appending and claiming are where the databases really differ, so those
//! two are the backend's ([`OutboxBackend`]): SQLite appends with multi-row
//! `INSERT`s and claims with one `UPDATE ... RETURNING` on its single
//! writer; PostgreSQL appends with one `INSERT ... SELECT FROM UNNEST` that
//! also notifies the relays of every process, and claims under an advisory
//! lock so that per-key order holds across relays. Everything else is here,
//! once: the lease arithmetic, marks and releases of any number of ids in
//! one statement, parking, pruning and the statistics.
//!
//! The claim always scans the unpublished rows from the lowest id through a
//! partial index that holds only those rows, and keeps no high-water mark:
//! a row that commits after a higher id (identity values are handed out at
//! `INSERT`, not at `COMMIT`) is claimed by the first claim after it
//! commits.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_store::StoreError;
use keel_store::{
    OutboxRecord, OutboxStats, ParkedFilter, ParkedOutbox, PendingOutbox, PublishedOutbox,
};

use crate::backend::{Row, SqlBackend, Tx};
use crate::dialect::{Dialect, Exec, SqlRow, Value};
use crate::error::{corrupt, sql_limit, to_u64};
use crate::filter::Filter;
use crate::retry::{bounded_delete_sql, delete_batch, retry, write};

/// The columns a claim returns, in [`OutboxBackend::claim_rows`].
pub const PENDING_COLUMNS: &str =
    "id, event_id, topic, partition_key, headers, payload, created_at, attempts";

/// A parked row with the count of unpublished rows of its key behind it.
const PARKED_COLUMNS: &str = "\
o.id, o.event_id, o.topic, o.partition_key, o.headers, o.payload, o.created_at, o.attempts,
o.parked_at, o.last_error,
(SELECT COUNT(*) FROM keel_outbox e
  WHERE e.partition_key = o.partition_key AND e.published_at IS NULL AND e.id > o.id) AS held_back";

/// Counts only what is not parked, and the parked apart.
pub const STATS_SQL: &str = "\
SELECT COALESCE(SUM(CASE WHEN parked_at IS NULL THEN 1 ELSE 0 END), 0) AS unpublished,
       MIN(CASE WHEN parked_at IS NULL THEN created_at END) AS oldest,
       COALESCE(SUM(CASE WHEN parked_at IS NOT NULL THEN 1 ELSE 0 END), 0) AS parked
  FROM keel_outbox WHERE published_at IS NULL";

const PUBLISHED_SQL: &str = "\
SELECT id, event_id, published_at FROM keel_outbox
 WHERE published_at IS NOT NULL AND id > $1
 ORDER BY id LIMIT $2";

const PARK_SQL: &str = "\
UPDATE keel_outbox SET claimed_by = NULL, claimed_until = NULL, attempts = attempts + 1,
       last_error = $2, parked_at = $3
 WHERE id = $1 AND published_at IS NULL AND parked_at IS NULL";

const UNPARK_SQL: &str = "\
UPDATE keel_outbox SET parked_at = NULL, attempts = 0, last_error = NULL
 WHERE id = $1 AND published_at IS NULL AND parked_at IS NOT NULL";

const DISCARD_SQL: &str =
    "DELETE FROM keel_outbox WHERE id = $1 AND published_at IS NULL AND parked_at IS NOT NULL";

/// What only the backend knows how to do with its outbox.
pub trait OutboxBackend: SqlBackend {
    /// Inserts `records`, all created at `created_at`, in `tx`, and wakes
    /// the relays that must learn of them at commit.
    fn append_rows<'a>(
        &'a self,
        tx: &'a mut Tx<Self>,
        records: &'a [OutboxRecord],
        created_at: DateTime<Utc>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// Leases up to `limit` unpublished rows to `relay` until `until`,
    /// lowest id first, given the time `now`, and returns them with
    /// [`PENDING_COLUMNS`]. A row is claimable when it is not parked,
    /// nobody holds a live lease on it but `relay`, and no earlier
    /// unpublished row of its key is parked or leased by another relay
    /// (which would publish it first only by luck).
    fn claim_rows<'a>(
        &'a self,
        relay: &'a str,
        until: DateTime<Utc>,
        now: DateTime<Utc>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Row<Self>>, StoreError>> + Send + 'a;
}

/// [`OutboxStore::outbox_append`](keel_store::OutboxStore::outbox_append).
pub async fn append<B: OutboxBackend>(
    store: &B,
    tx: &mut Tx<B>,
    records: &[OutboxRecord],
) -> Result<(), StoreError> {
    if records.is_empty() {
        return Ok(());
    }
    store.append_rows(tx, records, B::Dialect::now()).await
}

/// [`OutboxStore::outbox_claim`](keel_store::OutboxStore::outbox_claim).
pub async fn claim<B: OutboxBackend>(
    store: &B,
    relay: &str,
    limit: usize,
    lease: Duration,
) -> Result<Vec<PendingOutbox>, StoreError> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    let lease = chrono::Duration::from_std(lease).unwrap_or(chrono::Duration::MAX);
    // An unknown outcome needs no resolving: the rows are leased to this
    // relay or to nobody, and its next claim takes its own leases back.
    let rows = retry::<B::Dialect, _, _, _>("outbox_claim", || {
        let now = B::Dialect::now();
        let until = now
            .checked_add_signed(lease)
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        store.claim_rows(relay, until, now, limit)
    })
    .await?;
    let mut claimed = rows
        .iter()
        .map(pending_from_row::<B::Dialect>)
        .collect::<Result<Vec<_>, _>>()?;
    // RETURNING does not promise an order.
    claimed.sort_unstable_by_key(|p| p.id);
    if !claimed.is_empty() {
        tracing::trace!(relay, claimed = claimed.len(), "outbox rows claimed");
    }
    Ok(claimed)
}

/// Runs `SET <set> WHERE id is one of ids AND published_at IS NULL <and>`,
/// with `extra` bound after the ids (from `$2`).
async fn update_unpublished<B: SqlBackend>(
    store: &B,
    what: &'static str,
    set: &str,
    and: &str,
    ids: &[i64],
    extra: &[Value<'_>],
) -> Result<(), StoreError> {
    if ids.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "UPDATE keel_outbox SET {set} WHERE {} AND published_at IS NULL{and}",
        B::Dialect::any_of("id", "$1")
    );
    let mut params = vec![Value::Ids(ids)];
    params.extend_from_slice(extra);
    write(store, what, &sql, &params).await?;
    Ok(())
}

/// Only the rows the relay bound as `$2` still claims: one slower than its
/// lease must not free its successor's claim.
const CLAIMED_BY_RELAY: &str = " AND claimed_by = $2";

/// [`OutboxStore::outbox_mark_published`](keel_store::OutboxStore::outbox_mark_published).
pub async fn mark_published<B: SqlBackend>(store: &B, ids: &[i64]) -> Result<(), StoreError> {
    let set = "published_at = $2, claimed_by = NULL, claimed_until = NULL";
    let now = [B::Dialect::now().into()];
    update_unpublished(store, "outbox_mark_published", set, "", ids, &now).await
}

/// [`OutboxStore::outbox_release`](keel_store::OutboxStore::outbox_release).
pub async fn release<B: SqlBackend>(store: &B, relay: &str, ids: &[i64]) -> Result<(), StoreError> {
    let set = "claimed_by = NULL, claimed_until = NULL";
    let relay = [relay.into()];
    update_unpublished(store, "outbox_release", set, CLAIMED_BY_RELAY, ids, &relay).await
}

/// [`OutboxStore::outbox_release_failed`](keel_store::OutboxStore::outbox_release_failed).
pub async fn release_failed<B: SqlBackend>(
    store: &B,
    relay: &str,
    ids: &[i64],
    error: &str,
) -> Result<(), StoreError> {
    let set = "claimed_by = NULL, claimed_until = NULL, attempts = attempts + 1, last_error = $3";
    let extra = [relay.into(), error.into()];
    update_unpublished(
        store,
        "outbox_release_failed",
        set,
        CLAIMED_BY_RELAY,
        ids,
        &extra,
    )
    .await
}

/// The prune statement: a bounded batch of published rows.
pub fn prune_sql<D: Dialect>() -> String {
    bounded_delete_sql::<D>("keel_outbox", "id", "published_at < $1", "published_at")
}

/// [`OutboxStore::outbox_prune`](keel_store::OutboxStore::outbox_prune).
pub async fn prune<B: SqlBackend>(
    store: &B,
    before: DateTime<Utc>,
    batch: usize,
) -> Result<u64, StoreError> {
    let sql = prune_sql::<B::Dialect>();
    delete_batch(store, "outbox_prune", &sql, before.into(), batch).await
}

/// [`OutboxStore::outbox_archive`](keel_store::OutboxStore::outbox_archive):
/// one transaction copies a bounded batch of published rows into
/// `keel_outbox_archive` and deletes from the outbox exactly the rows the
/// archive holds, so a row is never in neither table. A retried batch
/// whose `COMMIT` was lost finds its rows archived already (`ON CONFLICT
/// DO NOTHING`) and deletes what is left of them.
pub async fn archive<B: SqlBackend>(
    store: &B,
    before: DateTime<Utc>,
    batch: usize,
) -> Result<u64, StoreError> {
    if batch == 0 {
        return Ok(0);
    }
    let copy = format!(
        "INSERT INTO keel_outbox_archive
           (id, event_id, topic, partition_key, headers, payload, created_at, published_at, archived_at)
         SELECT id, event_id, topic, partition_key, headers, payload, created_at, published_at, $3
           FROM keel_outbox WHERE id IN (
             SELECT id FROM keel_outbox WHERE published_at < $1
              ORDER BY published_at LIMIT $2{})
         ON CONFLICT (id) DO NOTHING",
        B::Dialect::skip_locked(None)
    );
    const DELETE_ARCHIVED: &str = "\
DELETE FROM keel_outbox
 WHERE published_at < $1
   AND EXISTS (SELECT 1 FROM keel_outbox_archive a WHERE a.id = keel_outbox.id)";
    retry::<B::Dialect, _, _, _>("outbox_archive", || async {
        let mut tx = store.begin_own().await?;
        let params = [
            before.into(),
            sql_limit(batch).into(),
            B::Dialect::now().into(),
        ];
        B::Dialect::execute(Exec::Tx(&mut tx), &copy, &params).await?;
        let moved =
            B::Dialect::execute(Exec::Tx(&mut tx), DELETE_ARCHIVED, &[before.into()]).await?;
        store.commit_own(tx).await?;
        Ok(moved)
    })
    .await
}

/// [`OutboxAdminStore::outbox_archived`](keel_store::OutboxAdminStore::outbox_archived).
pub async fn archived<B: SqlBackend>(
    store: &B,
    after: i64,
    limit: usize,
) -> Result<Vec<PublishedOutbox>, StoreError> {
    const ARCHIVED_SQL: &str = "\
SELECT id, event_id, published_at FROM keel_outbox_archive WHERE id > $1 ORDER BY id LIMIT $2";
    let rows = store
        .read_all(ARCHIVED_SQL, &[after.into(), sql_limit(limit).into()])
        .await?;
    rows.iter().map(published_row::<B::Dialect>).collect()
}

fn published_row<D: Dialect>(row: &D::Row) -> Result<PublishedOutbox, StoreError> {
    Ok(PublishedOutbox {
        id: row.int("id")?,
        event_id: row.text("event_id")?,
        published_at: row.time("published_at")?,
    })
}

/// [`OutboxStore::outbox_stats`](keel_store::OutboxStore::outbox_stats).
pub async fn stats<B: SqlBackend>(store: &B) -> Result<OutboxStats, StoreError> {
    let row = store
        .read_optional(STATS_SQL, &[])
        .await?
        .ok_or_else(|| corrupt(B::Dialect::NAME, "outbox stats", "no row"))?;
    let age = row.time_opt("oldest")?.map(|created| {
        (keel_core::clock::utc_now() - created)
            .to_std()
            .unwrap_or_default()
    });
    Ok(OutboxStats {
        unpublished: to_u64("outbox count", row.int("unpublished")?)?,
        oldest_unpublished_age: age,
        parked: to_u64("parked count", row.int("parked")?)?,
    })
}

/// [`OutboxAdminStore::outbox_published`](keel_store::OutboxAdminStore::outbox_published).
pub async fn published<B: SqlBackend>(
    store: &B,
    after: i64,
    limit: usize,
) -> Result<Vec<PublishedOutbox>, StoreError> {
    let rows = store
        .read_all(PUBLISHED_SQL, &[after.into(), sql_limit(limit).into()])
        .await?;
    rows.iter().map(published_row::<B::Dialect>).collect()
}

/// [`OutboxStore::outbox_park`](keel_store::OutboxStore::outbox_park).
pub async fn park<B: SqlBackend>(store: &B, id: i64, error: &str) -> Result<bool, StoreError> {
    let params = [id.into(), error.into(), B::Dialect::now().into()];
    Ok(write(store, "outbox_park", PARK_SQL, &params).await? > 0)
}

/// [`OutboxAdminStore::outbox_parked`](keel_store::OutboxAdminStore::outbox_parked).
pub async fn parked<B: SqlBackend>(
    store: &B,
    filter: &ParkedFilter,
) -> Result<Vec<ParkedOutbox>, StoreError> {
    let mut conditions = Filter::new();
    conditions.and("o.topic =", filter.topic.as_deref());
    let limit = conditions.param(sql_limit(filter.limit.unwrap_or(100)));
    let sql = parked_sql(&conditions, &limit);
    let rows = store.read_all(&sql, conditions.params()).await?;
    rows.iter().map(parked_from_row::<B::Dialect>).collect()
}

/// [`OutboxAdminStore::outbox_parked_get`](keel_store::OutboxAdminStore::outbox_parked_get).
pub async fn parked_get<B: SqlBackend>(
    store: &B,
    id: i64,
) -> Result<Option<ParkedOutbox>, StoreError> {
    let mut conditions = Filter::new();
    conditions.and("o.id =", Some(id));
    let sql = parked_sql(&conditions, "1");
    let row = store.read_optional(&sql, conditions.params()).await?;
    row.as_ref().map(parked_from_row::<B::Dialect>).transpose()
}

fn parked_sql(conditions: &Filter<'_>, limit: &str) -> String {
    let filter = conditions.where_clause().replacen("WHERE", "AND", 1);
    format!(
        "SELECT {PARKED_COLUMNS} FROM keel_outbox o
          WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL {filter}
          ORDER BY o.id LIMIT {limit}"
    )
}

/// [`OutboxAdminStore::outbox_unpark`](keel_store::OutboxAdminStore::outbox_unpark).
pub async fn unpark<B: SqlBackend>(store: &B, id: i64) -> Result<bool, StoreError> {
    Ok(write(store, "outbox_unpark", UNPARK_SQL, &[id.into()]).await? > 0)
}

/// [`OutboxAdminStore::outbox_discard`](keel_store::OutboxAdminStore::outbox_discard).
pub async fn discard<B: SqlBackend>(store: &B, id: i64) -> Result<bool, StoreError> {
    Ok(write(store, "outbox_discard", DISCARD_SQL, &[id.into()]).await? > 0)
}

fn pending_from_row<D: Dialect>(row: &D::Row) -> Result<PendingOutbox, StoreError> {
    let headers = row.json("headers")?;
    Ok(PendingOutbox {
        id: row.int("id")?,
        record: OutboxRecord {
            event_id: row.text("event_id")?,
            topic: row.text("topic")?,
            partition_key: row.text("partition_key")?,
            headers: serde_json::from_str(&headers).map_err(|e| corrupt(D::NAME, "headers", e))?,
            payload: Bytes::from(row.bytes("payload")?),
        },
        created_at: row.time("created_at")?,
        attempts: u32::try_from(row.int("attempts")?).unwrap_or(0),
    })
}

fn parked_from_row<D: Dialect>(row: &D::Row) -> Result<ParkedOutbox, StoreError> {
    let pending = pending_from_row::<D>(row)?;
    Ok(ParkedOutbox {
        id: pending.id,
        record: pending.record,
        created_at: pending.created_at,
        parked_at: row.time("parked_at")?,
        attempts: pending.attempts,
        last_error: row.text_opt("last_error")?.unwrap_or_default(),
        held_back: to_u64("held back", row.int("held_back")?)?,
    })
}

/// Implements [`OutboxStore`](keel_store::OutboxStore) and
/// [`OutboxAdminStore`](keel_store::OutboxAdminStore) for an
/// [`OutboxBackend`].
#[macro_export]
macro_rules! outbox_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::OutboxStore for $store {
            async fn outbox_append(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                records: &[$crate::__private::store::OutboxRecord],
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::outbox::append(self, tx, records).await
            }
            async fn outbox_claim(
                &self,
                relay: &str,
                limit: usize,
                lease: ::std::time::Duration,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::PendingOutbox>,
                $crate::__private::StoreError,
            > {
                $crate::outbox::claim(self, relay, limit, lease).await
            }
            async fn outbox_mark_published(
                &self,
                ids: &[i64],
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::outbox::mark_published(self, ids).await
            }
            async fn outbox_release(
                &self,
                relay: &str,
                ids: &[i64],
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::outbox::release(self, relay, ids).await
            }
            async fn outbox_prune(
                &self,
                before: $crate::__private::DateTime<$crate::__private::Utc>,
                batch: usize,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::outbox::prune(self, before, batch).await
            }
            async fn outbox_archive(
                &self,
                before: $crate::__private::DateTime<$crate::__private::Utc>,
                batch: usize,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::outbox::archive(self, before, batch).await
            }
            async fn outbox_stats(
                &self,
            ) -> ::std::result::Result<
                $crate::__private::store::OutboxStats,
                $crate::__private::StoreError,
            > {
                $crate::outbox::stats(self).await
            }
            async fn outbox_release_failed(
                &self,
                relay: &str,
                ids: &[i64],
                error: &str,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::outbox::release_failed(self, relay, ids, error).await
            }
            async fn outbox_park(
                &self,
                id: i64,
                error: &str,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::outbox::park(self, id, error).await
            }
        }

        #[$crate::__private::async_trait]
        impl $crate::__private::store::OutboxAdminStore for $store {
            async fn outbox_published(
                &self,
                after: i64,
                limit: usize,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::PublishedOutbox>,
                $crate::__private::StoreError,
            > {
                $crate::outbox::published(self, after, limit).await
            }
            async fn outbox_archived(
                &self,
                after: i64,
                limit: usize,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::PublishedOutbox>,
                $crate::__private::StoreError,
            > {
                $crate::outbox::archived(self, after, limit).await
            }
            async fn outbox_parked(
                &self,
                filter: &$crate::__private::store::ParkedFilter,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::ParkedOutbox>,
                $crate::__private::StoreError,
            > {
                $crate::outbox::parked(self, filter).await
            }
            async fn outbox_parked_get(
                &self,
                id: i64,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::ParkedOutbox>,
                $crate::__private::StoreError,
            > {
                $crate::outbox::parked_get(self, id).await
            }
            async fn outbox_unpark(
                &self,
                id: i64,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::outbox::unpark(self, id).await
            }
            async fn outbox_discard(
                &self,
                id: i64,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::outbox::discard(self, id).await
            }
        }
    };
}
