//! The names of policies and dependencies (`"payments"`), interned.
//!
//! A name rides on every refusal a policy makes, and a refusal may be made
//! millions of times a second by every thread at once. A reference-counted
//! string would make each refusal write its count, one cache line that all
//! those threads fight over. An interned name is a pointer to a
//! `&'static str` stored once: copying it writes nothing shared, and
//! dropping it does nothing. It is one pointer wide rather than a (pointer,
//! length) pair because refusals are returned by value through every layer
//! of a pipeline: with it, `Rejected` is 32 bytes instead of 40, and the
//! breaker's happy path and open path measured 9.6 and 20.6 ns instead of
//! 19.3 and 33.6 (BENCHMARKS.md, *Circuit breaker*).
//!
//! Interning keeps each distinct name for the life of the process. Names are
//! configuration (one per policy or dependency), and each already labels
//! metrics that the metrics registry keeps as long, so this holds nothing
//! that was not held already. Do not make names from request data, for the
//! same reason you would not make metric labels from it.

use std::borrow::{Borrow, Cow};
use std::collections::HashMap;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, LazyLock};

use parking_lot::RwLock;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The name of a policy instance or dependency: copied, never counted,
/// one pointer wide (see the [module docs](self)).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Name(&'static &'static str);

static NAMES: LazyLock<RwLock<HashMap<&'static str, &'static &'static str>>> =
    LazyLock::new(Default::default);

impl Name {
    /// The name `name`, interned: the first use of a name stores it once.
    pub fn new(name: &str) -> Self {
        if let Some(known) = NAMES.read().get(name) {
            return Self(known);
        }
        let mut names = NAMES.write();
        match names.get(name) {
            Some(known) => Self(known),
            None => {
                let stored: &'static str = Box::leak(name.into());
                let slot: &'static &'static str = Box::leak(Box::new(stored));
                names.insert(stored, slot);
                Self(slot)
            }
        }
    }

    /// The name as a string that lives as long as the process.
    pub fn as_str(self) -> &'static str {
        self.0
    }
}

impl Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl From<&str> for Name {
    fn from(name: &str) -> Self {
        Self::new(name)
    }
}

impl From<&String> for Name {
    fn from(name: &String) -> Self {
        Self::new(name)
    }
}

impl From<String> for Name {
    fn from(name: String) -> Self {
        Self::new(&name)
    }
}

impl From<Box<str>> for Name {
    fn from(name: Box<str>) -> Self {
        Self::new(&name)
    }
}

impl From<Arc<str>> for Name {
    fn from(name: Arc<str>) -> Self {
        Self::new(&name)
    }
}

impl From<Cow<'_, str>> for Name {
    fn from(name: Cow<'_, str>) -> Self {
        Self::new(&name)
    }
}

impl From<Name> for String {
    fn from(name: Name) -> Self {
        name.as_str().to_owned()
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl Serialize for Name {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Cow::<'de, str>::deserialize(deserializer).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn a_name_and_a_refusal_carrying_it_stay_small() {
        assert_eq!(size_of::<Name>(), size_of::<usize>());
        assert!(size_of::<crate::Rejected>() <= 32);
    }

    #[test]
    fn a_name_is_stored_once_however_it_is_made() {
        let made = [
            Name::from("payments"),
            Name::from(String::from("payments")),
            Name::from(Arc::<str>::from("payments")),
            Name::new(&"payments-x"[..8]),
        ];
        for name in made {
            assert_eq!(name, made[0]);
            assert!(std::ptr::eq(name.as_str(), made[0].as_str()));
        }
        assert_ne!(Name::from("payments"), Name::from("pay"));
    }

    #[test]
    fn it_reads_and_prints_as_its_string() {
        let name = Name::from("stock");
        assert_eq!(name, "stock");
        assert_eq!(&*name, "stock");
        assert_eq!(name.to_string(), "stock");
        assert_eq!(format!("{name:?}"), "\"stock\"");
        let set: HashSet<Name> = [name].into();
        assert!(set.contains("stock"), "looked up by &str");
    }

    #[test]
    fn threads_naming_at_once_agree() {
        let names: Vec<Name> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| Name::from(String::from("raced"))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("named"))
                .collect()
        });
        assert!(
            names
                .iter()
                .all(|n| std::ptr::eq(n.as_str(), names[0].as_str()))
        );
    }
}
