//! Time-ordered identifiers.
//!
//! Keel names events, jobs, sagas and deliveries with UUIDv7: unique without
//! coordination, and sorted by creation time, so they index well as primary
//! keys and read naturally in logs.

pub use uuid::Uuid;

/// A new UUIDv7: 48 bits of Unix milliseconds, then random bits.
///
/// ```
/// let a = keel_core::id::new_id();
/// let b = keel_core::id::new_id();
/// assert_ne!(a, b);
/// assert_eq!(a.get_version_num(), 7);
/// ```
pub fn new_id() -> Uuid {
    Uuid::now_v7()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_created_later_sort_later() {
        let ids: Vec<Uuid> = (0..1000).map(|_| new_id()).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(
            ids, sorted,
            "uuid::now_v7 keeps a per-process monotonic counter"
        );
    }
}
