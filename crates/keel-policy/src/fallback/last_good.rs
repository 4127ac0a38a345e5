//! The last good value, served when the dependency cannot answer, but
//! never older than an age bound.
//!
//! The classic fallback is "a cached price": the answer the dependency gave
//! last time. Two things make that safe. The age bound: a price from an
//! hour ago may be fine, one from last month is a bug that looks like an
//! answer, so past [`LastGoodBuilder::max_age`] the error goes through.
//! And honesty: the caller gets [`Answer::Stale`] with the value's age,
//! so it can tell its own caller ("prices as of 14:02") instead of
//! pretending. Which failures are covered is the [`Fallback`]'s business
//! (by [`ErrorClass`]; a `404` is never papered
//! over).
//!
//! Every call is counted in `keel_last_good_total{name, outcome}`:
//! `fresh` (the dependency answered), `stale` (the cache answered for it)
//! and `unavailable` (it failed with nothing young enough cached). The
//! fallback rate is `stale / (fresh + stale + unavailable)`.
//!
//! ```
//! use std::time::Duration;
//! use keel_policy::fallback::{Answer, LastGood};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let prices: LastGood<String, u32> = LastGood::builder("pricing")
//!     .max_age(Duration::from_secs(300))
//!     .build()?;
//! let up = prices.call("SKU-1".to_owned(), || async { Ok::<_, std::io::Error>(1999) }).await;
//! assert_eq!(up.unwrap(), Answer::Fresh(1999));
//! let down = prices
//!     .call("SKU-1".to_owned(), || async {
//!         Err(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "pricing is down"))
//!     })
//!     .await;
//! assert!(matches!(down.unwrap(), Answer::Stale { value: 1999, .. }));
//! # Ok::<_, keel_policy::ConfigError>(())
//! # }).unwrap();
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_core::{Classify, ErrorClass, Name};
use parking_lot::Mutex;

use super::Fallback;
use crate::ConfigError;

/// What [`LastGood::call`] answers: the dependency's value, or the cached
/// one and how old it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer<V> {
    /// The dependency answered just now.
    Fresh(V),
    /// The dependency failed; this is what it answered `age` ago.
    Stale {
        /// The last good value.
        value: V,
        /// Its age.
        age: Duration,
    },
}

impl<V> Answer<V> {
    /// The value, fresh or not.
    pub fn into_value(self) -> V {
        match self {
            Self::Fresh(value) | Self::Stale { value, .. } => value,
        }
    }

    /// The value's age if it came from the cache.
    pub fn staleness(&self) -> Option<Duration> {
        match self {
            Self::Fresh(_) => None,
            Self::Stale { age, .. } => Some(*age),
        }
    }
}

/// Builds a [`LastGood`]. Defaults: values serve for 5 minutes, at most
/// 10,000 keys, every class but `Permanent` is covered.
#[derive(Debug, Clone)]
#[must_use]
pub struct LastGoodBuilder {
    fallback: super::FallbackBuilder,
    max_age: Duration,
    capacity: usize,
}

impl LastGoodBuilder {
    /// The oldest value that may still be served (default 5 minutes).
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = age;
        self
    }

    /// The most keys remembered (default 10,000); past it the oldest
    /// value is forgotten first.
    pub fn capacity(mut self, keys: usize) -> Self {
        self.capacity = keys;
        self
    }

    /// The error classes the cache answers for (default: all but
    /// `Permanent`).
    pub fn classes(mut self, classes: impl IntoIterator<Item = ErrorClass>) -> Self {
        self.fallback = self.fallback.classes(classes);
        self
    }

    /// Validates the settings and builds the cache.
    pub fn build<K, V>(self) -> Result<LastGood<K, V>, ConfigError> {
        ConfigError::ensure(!self.max_age.is_zero(), "max_age", "must be above zero")?;
        ConfigError::ensure(self.capacity > 0, "capacity", "must be at least 1")?;
        let fallback = self.fallback.build()?;
        let name = fallback.name().to_string();
        let outcome = |outcome: &'static str| metrics::counter!("keel_last_good_total", "name" => name.clone(), "outcome" => outcome);
        Ok(LastGood {
            inner: Arc::new(Inner {
                counters: [outcome("fresh"), outcome("stale"), outcome("unavailable")],
                fallback,
                max_age: self.max_age,
                capacity: self.capacity,
                values: Mutex::new(HashMap::new()),
            }),
        })
    }
}

/// A fallback to the last good value per key; see the
/// [module docs](self). Cheap to clone: clones share the values.
pub struct LastGood<K, V> {
    inner: Arc<Inner<K, V>>,
}

struct Inner<K, V> {
    fallback: Fallback,
    max_age: Duration,
    capacity: usize,
    values: Mutex<HashMap<K, (V, Instant)>>,
    counters: [metrics::Counter; 3],
}

impl<K, V> Clone for LastGood<K, V> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K, V> std::fmt::Debug for LastGood<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LastGood")
            .field("name", self.inner.fallback.name())
            .field("max_age", &self.inner.max_age)
            .field("keys", &self.inner.values.lock().len())
            .finish_non_exhaustive()
    }
}

const FRESH: usize = 0;
const STALE: usize = 1;
const UNAVAILABLE: usize = 2;

impl LastGood<(), ()> {
    /// A builder named after the dependency (`pricing`).
    pub fn builder(name: impl Into<Name>) -> LastGoodBuilder {
        LastGoodBuilder {
            fallback: Fallback::builder(name),
            max_age: Duration::from_secs(300),
            capacity: 10_000,
        }
    }
}

impl<K, V> LastGood<K, V>
where
    K: Eq + Hash + Clone,
    V: Clone,
{
    /// Calls `f` for `key`. Its value is remembered and returned fresh;
    /// if it fails with a covered class and a value for `key` is younger
    /// than the age bound, that value is returned stale; otherwise the
    /// error is.
    pub async fn call<E, F, Fut>(&self, key: K, f: F) -> Result<Answer<V>, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<V, E>>,
        E: Classify,
    {
        let inner = &*self.inner;
        match f().await {
            Ok(value) => {
                self.remember(key, value.clone());
                inner.counters[FRESH].increment(1);
                Ok(Answer::Fresh(value))
            }
            Err(err) if inner.fallback.handles(err.class()) => match self.recall(&key) {
                Some((value, age)) => {
                    inner.fallback.should_serve(err.class());
                    inner.counters[STALE].increment(1);
                    Ok(Answer::Stale { value, age })
                }
                None => {
                    inner.counters[UNAVAILABLE].increment(1);
                    Err(err)
                }
            },
            Err(err) => Err(err),
        }
    }

    /// The value remembered for `key` and its age, if still young enough.
    pub fn recall(&self, key: &K) -> Option<(V, Duration)> {
        let values = self.inner.values.lock();
        let (value, at) = values.get(key)?;
        let age = clock::now().saturating_duration_since(*at);
        (age <= self.inner.max_age).then(|| (value.clone(), age))
    }

    fn remember(&self, key: K, value: V) {
        let now = clock::now();
        let mut values = self.inner.values.lock();
        if values.len() >= self.inner.capacity && !values.contains_key(&key) {
            let max_age = self.inner.max_age;
            values.retain(|_, (_, at)| now.saturating_duration_since(*at) <= max_age);
            if values.len() >= self.inner.capacity {
                let oldest = values
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| k.clone());
                if let Some(oldest) = oldest {
                    values.remove(&oldest);
                }
            }
        }
        values.insert(key, (value, now));
    }
}

#[cfg(test)]
mod tests;
