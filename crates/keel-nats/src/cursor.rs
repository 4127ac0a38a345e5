//! Key cursors: per group and key, the stream sequence of the last message
//! the group finished (acked or terminated).
//!
//! JetStream orders a stream but has no per-key head-of-line blocking, and a
//! consumer's `max_ack_pending` counts all subjects together (a per-subject
//! limit, nats-server issue 4273, is not in any release). So Keel keeps the
//! per-key position itself, in a JetStream key-value bucket: a delivery is
//! handed to the application only when it is the first message of its key
//! (subject) after the cursor. Only one member of a group holds a given
//! message at a time (JetStream's ack wait), so only one holds a key's head.
//!
//! A finish moves the cursor *before* the JetStream ack: if the process dies
//! in between, the redelivered message is at or behind the cursor and is
//! acked without being handed out again (its effect committed, the caller
//! said so by acking). Moves are compare-and-set on the entry's revision and
//! only ever forward.
//!
//! A first delivery (JetStream's delivery count 1) cannot be finished yet,
//! so its head check needs no cursor read when the cached cursor already
//! shows it is the head: with no round trip at all when the message's
//! verified predecessor (see [`crate::predecessor`]) is at or behind it,
//! else with one direct get. Either way, an ack is one bucket write.
//! Resetting a group therefore means deleting both its consumer and its
//! cursors (`<topic>.<group>.>` in the bucket).

use std::time::Duration;

use async_nats::jetstream::kv::{self, CreateErrorKind, UpdateErrorKind};
use bytes::Bytes;
use keel_store::broker::BrokerError;
use parking_lot::Mutex;

use crate::error::unavailable;
use crate::recent::Recent;

/// A group's key cursors on one topic, with a local cache of each key's
/// cursor and the bucket revision it was read or written at (`None`: the
/// key has no entry yet, as far as we know).
pub(crate) struct Cursors {
    store: kv::Store,
    cache: Mutex<Recent<Known>>,
}

/// How many keys a generation of the cursor cache holds. A forgotten key
/// costs extra round trips to the bucket on its next head check or finish.
const CACHED: usize = 16_384;

/// A cached cursor and the revision of its entry, if it has one.
#[derive(Debug, Clone, Copy)]
struct Known {
    cursor: u64,
    revision: Option<u64>,
}

impl Cursors {
    /// The cursor bucket named `bucket`, created if missing.
    pub(crate) async fn open(
        context: &async_nats::jetstream::Context,
        bucket: &str,
        retention: Duration,
        file_storage: bool,
        replicas: usize,
    ) -> Result<kv::Store, BrokerError> {
        if let Ok(store) = context.get_key_value(bucket).await {
            return Ok(store);
        }
        let config = kv::Config {
            bucket: bucket.to_owned(),
            description: "Keel: per group and key, the last finished stream sequence".to_owned(),
            history: 1,
            max_age: retention,
            num_replicas: replicas,
            storage: if file_storage {
                async_nats::jetstream::stream::StorageType::File
            } else {
                async_nats::jetstream::stream::StorageType::Memory
            },
            ..kv::Config::default()
        };
        match context.create_key_value(config).await {
            Ok(store) => Ok(store),
            // Someone else created it in between.
            Err(_) => context
                .get_key_value(bucket)
                .await
                .map_err(|e| unavailable("opening the key-cursor bucket", e)),
        }
    }

    /// Cursors read through `store`.
    pub(crate) fn new(store: kv::Store) -> Self {
        Self {
            store,
            cache: Mutex::new(Recent::new(CACHED)),
        }
    }

    /// The cached cursor of `key` (0 when unknown); never below what this
    /// process last saw, possibly below the bucket's.
    pub(crate) fn cached(&self, key: &str) -> u64 {
        self.cache.lock().get(key).map_or(0, |known| known.cursor)
    }

    /// The cursor of `key`, read from the bucket.
    pub(crate) async fn fresh(&self, key: &str) -> Result<u64, BrokerError> {
        let known = self.read(key).await?;
        self.remember(key, known);
        Ok(known.cursor)
    }

    /// Moves `key`'s cursor forward to `sequence` (never backwards): one
    /// compare-and-set write when the cache is current, a read and a retry
    /// when someone else wrote in between.
    pub(crate) async fn advance(&self, key: &str, sequence: u64) -> Result<(), BrokerError> {
        let mut known = self.cache.lock().get(key).unwrap_or(Known {
            cursor: 0,
            revision: None,
        });
        for _ in 0..16 {
            if known.cursor >= sequence {
                return Ok(());
            }
            let outcome = match known.revision {
                Some(revision) => self
                    .store
                    .update(key, encode(sequence), revision)
                    .await
                    .map_err(|e| {
                        (
                            e.kind() == UpdateErrorKind::WrongLastRevision,
                            e.to_string(),
                        )
                    }),
                None => self
                    .store
                    .create(key, encode(sequence))
                    .await
                    .map_err(|e| (e.kind() == CreateErrorKind::AlreadyExists, e.to_string())),
            };
            match outcome {
                Ok(revision) => {
                    self.remember(
                        key,
                        Known {
                            cursor: sequence,
                            revision: Some(revision),
                        },
                    );
                    return Ok(());
                }
                // Someone moved it meanwhile (or the cache was stale): read again.
                Err((true, _)) => {
                    known = self.read(key).await?;
                    self.remember(key, known);
                }
                Err((false, error)) => return Err(unavailable("moving a key cursor", error)),
            }
        }
        Err(unavailable(
            "moving a key cursor",
            "too many concurrent updates",
        ))
    }

    fn remember(&self, key: &str, known: Known) {
        let mut cache = self.cache.lock();
        if cache.get(key).is_none_or(|old| old.cursor <= known.cursor) {
            cache.insert(key, known);
        }
    }

    async fn read(&self, key: &str) -> Result<Known, BrokerError> {
        let entry = self
            .store
            .entry(key)
            .await
            .map_err(|e| unavailable("reading a key cursor", e))?;
        Ok(match entry {
            Some(entry) if entry.operation == kv::Operation::Put => Known {
                cursor: decode(&entry.value),
                revision: Some(entry.revision),
            },
            // A deleted entry: `create` works on it again.
            _ => Known {
                cursor: 0,
                revision: None,
            },
        })
    }
}

fn encode(sequence: u64) -> Bytes {
    Bytes::from(sequence.to_string())
}

fn decode(value: &[u8]) -> u64 {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}
