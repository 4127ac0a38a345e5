//! An invariant checker for consumer groups: per-key order, one holder at a
//! time, nothing lost, nothing acked twice.

use std::collections::{HashMap, HashSet};

use keel_store::broker::Message;

/// Watches one consumer group and records every way it breaks the broker
/// contract.
///
/// Tell it what was published ([`published`](Self::published)), every
/// delivery as it arrives ([`delivered`](Self::delivered)), and every settle
/// *before* sending it ([`settling`](Self::settling)); once the broker
/// confirms the settle, the next message of the key may legitimately arrive,
/// so marking it first is what keeps the checker free of false alarms. It
/// is not internally synchronized: share it behind a mutex.
///
/// ```
/// use keel_store::broker::Message;
/// use keel_testkit::broker_suite::OrderChecker;
///
/// let mut checker = OrderChecker::new();
/// let first = Message::new("1", "t", "order-7", "placed");
/// let second = Message::new("2", "t", "order-7", "paid");
/// checker.published(&first);
/// checker.published(&second);
/// checker.delivered(0, &second); // too early: "1" is not acked yet
/// assert_eq!(checker.violations().len(), 1);
/// ```
#[derive(Debug, Default)]
pub struct OrderChecker {
    /// Message id → (key, position within the key).
    positions: HashMap<String, (String, usize)>,
    /// Key → how many messages of it were published.
    published_per_key: HashMap<String, usize>,
    /// Key → positions acked, in the order the acks were sent.
    acked_per_key: HashMap<String, Vec<usize>>,
    acked: HashSet<String>,
    /// Message id → the consumer holding it.
    in_flight: HashMap<String, usize>,
    deliveries: usize,
    violations: Vec<String>,
}

impl OrderChecker {
    /// An empty checker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a published message; per key, publish order is the order of
    /// these calls. A repeated id is ignored (publisher dedupe).
    pub fn published(&mut self, message: &Message) {
        if self.positions.contains_key(&message.id) {
            return;
        }
        let count = self
            .published_per_key
            .entry(message.key.clone())
            .or_default();
        self.positions
            .insert(message.id.clone(), (message.key.clone(), *count));
        *count += 1;
    }

    /// Records that `consumer` received `message`, checking that it was
    /// published, is not acked, is held by no one else, and that every
    /// earlier message of its key is acked.
    pub fn delivered(&mut self, consumer: usize, message: &Message) {
        self.deliveries += 1;
        let Some((key, position)) = self.positions.get(&message.id).cloned() else {
            self.violations
                .push(format!("{} was delivered but never published", message.id));
            return;
        };
        if self.acked.contains(&message.id) {
            self.violations
                .push(format!("{} was delivered again after its ack", message.id));
        }
        if let Some(holder) = self.in_flight.insert(message.id.clone(), consumer) {
            self.violations.push(format!(
                "{} was delivered to consumer {consumer} while consumer {holder} held it",
                message.id
            ));
        }
        let acked_before = self
            .acked_per_key
            .get(&key)
            .map_or(0, |acked| acked.iter().filter(|&&p| p < position).count());
        if acked_before < position {
            self.violations.push(format!(
                "{} (#{position} of key {key}) was delivered while {} earlier message(s) of its key were unacked",
                message.id,
                position - acked_before
            ));
        }
    }

    /// Records that the holder is about to settle `message`: acked (or
    /// terminated) when `done`, released (nacked) otherwise. Call before the
    /// settle is sent.
    pub fn settling(&mut self, message: &Message, done: bool) {
        self.in_flight.remove(&message.id);
        if !done {
            return;
        }
        if !self.acked.insert(message.id.clone()) {
            self.violations
                .push(format!("{} was acked twice", message.id));
            return;
        }
        if let Some((key, position)) = self.positions.get(&message.id) {
            self.acked_per_key
                .entry(key.clone())
                .or_default()
                .push(*position);
        }
    }

    /// Records a failure seen by a consumer (a settle refused, say).
    pub fn violation(&mut self, what: impl Into<String>) {
        self.violations.push(what.into());
    }

    /// How many published messages are acked.
    pub fn acked_count(&self) -> usize {
        self.acked.len()
    }

    /// How many deliveries were recorded, redeliveries included.
    pub fn delivery_count(&self) -> usize {
        self.deliveries
    }

    /// Everything that went wrong so far.
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// The final verdict: no violations, every published message acked, and
    /// each key's acks in publish order.
    pub fn verify(&self) -> Result<(), String> {
        let mut problems = self.violations.clone();
        let lost: Vec<&String> = self
            .positions
            .keys()
            .filter(|id| !self.acked.contains(*id))
            .collect();
        if !lost.is_empty() {
            let mut lost = lost;
            lost.sort();
            problems.push(format!(
                "{} message(s) never acked, e.g. {:?}",
                lost.len(),
                &lost[..lost.len().min(5)]
            ));
        }
        for (key, acked) in &self.acked_per_key {
            if acked.windows(2).any(|w| w[0] > w[1]) {
                problems.push(format!("key {key} was acked out of order: {acked:?}"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("\n"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(id: &str, key: &str) -> Message {
        Message::new(id, "t", key, "x")
    }

    #[test]
    fn a_clean_run_verifies() {
        let mut checker = OrderChecker::new();
        let (a1, a2, b1) = (msg("a1", "a"), msg("a2", "a"), msg("b1", "b"));
        for m in [&a1, &a2, &b1] {
            checker.published(m);
        }
        checker.delivered(0, &a1);
        checker.delivered(1, &b1);
        checker.settling(&a1, false); // nacked
        checker.delivered(1, &a1);
        checker.settling(&a1, true);
        checker.delivered(0, &a2);
        checker.settling(&a2, true);
        checker.settling(&b1, true);
        assert_eq!(checker.verify(), Ok(()));
        assert_eq!(checker.delivery_count(), 4);
    }

    #[test]
    fn catches_double_holders_out_of_order_lost_and_double_acks() {
        let mut checker = OrderChecker::new();
        let (a1, a2) = (msg("a1", "a"), msg("a2", "a"));
        checker.published(&a1);
        checker.published(&a2);
        checker.delivered(0, &a1);
        checker.delivered(1, &a1);
        checker.delivered(1, &a2);
        checker.settling(&a2, true);
        checker.settling(&a2, true);
        let verdict = checker.verify().expect_err("broken");
        for expected in [
            "while consumer 0 held it",
            "were unacked",
            "acked twice",
            "never acked",
        ] {
            assert!(
                verdict.contains(expected),
                "missing {expected:?} in {verdict}"
            );
        }
    }
}
