//! The topics this process has seen: their ids, and the wake-up signal
//! waiting receivers listen on.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use tokio::sync::Notify;

/// A topic known to this process.
#[derive(Debug)]
pub(super) struct Topic {
    /// The interned id (`keel_broker_topics.topic_id`).
    pub(super) id: i64,
    /// The topic's name.
    pub(super) name: Arc<str>,
    /// Woken when something may have become deliverable on the topic: a
    /// publish, an ack that unblocks a key, a nack.
    pub(super) changed: Notify,
}

/// Topic name to [`Topic`], filled as topics are first used. Only expiring
/// topics are ever deleted, once no group reads them; the process whose
/// sweep deletes one forgets it, and a subscribe that finds a cached entry
/// with another id replaces it. Another process may keep a deleted expiring
/// topic's id until then; a message it publishes there is never read, which
/// is what nobody reading the topic means anyway.
#[derive(Debug, Default)]
pub(super) struct TopicRegistry {
    by_name: RwLock<HashMap<Arc<str>, Arc<Topic>>>,
}

impl TopicRegistry {
    /// The topic, if this process has used it before.
    pub(super) fn get(&self, name: &str) -> Option<Arc<Topic>> {
        self.by_name
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// Forgets a topic (deleted, or found with another id).
    pub(super) fn remove(&self, name: &str) -> Option<Arc<Topic>> {
        self.by_name
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name)
    }

    /// Records a topic's id (after the row committed), keeping the first
    /// entry if two tasks raced.
    pub(super) fn insert(&self, name: &str, id: i64) -> Arc<Topic> {
        let mut by_name = self.by_name.write().unwrap_or_else(PoisonError::into_inner);
        let name: Arc<str> = Arc::from(name);
        by_name
            .entry(name.clone())
            .or_insert_with(|| {
                Arc::new(Topic {
                    id,
                    name,
                    changed: Notify::new(),
                })
            })
            .clone()
    }
}
