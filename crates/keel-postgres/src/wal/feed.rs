//! The rows the WAL stream delivered and the relay has not finished, and
//! how far the slot may be confirmed.
//!
//! The slot's position may move past a transaction only once every outbox
//! row it inserted is finished: published (the broker acknowledged it),
//! parked, or left to the table (a row whose key waits behind a parked
//! row). Until then a restart streams the transaction again, so nothing the
//! broker has not acknowledged is lost.

use std::collections::{HashMap, HashSet, VecDeque};

use keel_store::PendingOutbox;

/// A committed transaction whose rows are not all finished.
#[derive(Debug)]
struct Committed {
    seq: u64,
    end_lsn: u64,
    unfinished: usize,
}

#[derive(Debug, Default)]
pub(crate) struct Feed {
    /// Rows inserted by the transaction being streamed (not committed yet).
    open: Vec<PendingOutbox>,
    /// Committed rows waiting for a claim, in commit order, with their
    /// transaction's sequence number.
    pending: VecDeque<(u64, PendingOutbox)>,
    /// Rows claimed by the relay and not finished.
    claimed: HashMap<i64, (u64, PendingOutbox)>,
    committed: VecDeque<Committed>,
    next_seq: u64,
    /// Rows the sweep published before the stream delivered them: finished
    /// on arrival instead of published twice.
    swept: HashSet<i64>,
}

/// The most swept ids remembered: a row swept but never streamed (inserted
/// before the slot existed, or replayed after parking) is not kept forever;
/// forgetting one costs at most a duplicate, which consumers absorb.
const SWEPT_REMEMBERED: usize = 65_536;

impl Feed {
    /// A row of the transaction being streamed.
    pub(crate) fn insert(&mut self, row: PendingOutbox) {
        self.open.push(row);
    }

    /// The streamed transaction committed, ending at `end_lsn`. Returns how
    /// many outbox rows it brought, and the position the slot may now be
    /// confirmed to, if it moved.
    pub(crate) fn commit(&mut self, end_lsn: u64) -> (usize, Option<u64>) {
        let rows = std::mem::take(&mut self.open);
        let seq = self.next_seq;
        self.next_seq += 1;
        let count = rows.len();
        self.committed.push_back(Committed {
            seq,
            end_lsn,
            unfinished: count,
        });
        self.pending.extend(rows.into_iter().map(|row| (seq, row)));
        (count, self.confirmable())
    }

    /// The server's WAL position on an idle stream: confirmable when no
    /// transaction is in progress or unfinished.
    pub(crate) fn idle_at(&self, wal_end: u64) -> Option<u64> {
        (self.open.is_empty() && self.committed.is_empty()).then_some(wal_end)
    }

    /// Up to `limit` rows, oldest commit first. Rows whose key is in `held`
    /// (a parked row of that key waits) are finished here: they stay
    /// unpublished in the table, where the sweep finds them once the
    /// parked row is replayed.
    pub(crate) fn claim(&mut self, limit: usize, held: &HashSet<String>) -> Vec<PendingOutbox> {
        let mut claimed = Vec::new();
        while claimed.len() < limit {
            let Some((seq, row)) = self.pending.pop_front() else {
                break;
            };
            if self.swept.remove(&row.id) || held.contains(&row.record.partition_key) {
                self.finish_in(seq);
                continue;
            }
            self.claimed.insert(row.id, (seq, row.clone()));
            claimed.push(row);
        }
        claimed
    }

    /// Rows the sweep published: not to be published again when streamed.
    pub(crate) fn swept(&mut self, ids: &[i64]) {
        if self.swept.len() + ids.len() > SWEPT_REMEMBERED {
            self.swept.clear();
        }
        self.swept.extend(ids);
    }

    /// Whether the relay claimed `id` from this feed.
    pub(crate) fn owns(&self, id: i64) -> bool {
        self.claimed.contains_key(&id)
    }

    /// Claimed rows done with (published or parked). Returns the position
    /// the slot may now be confirmed to, if it moved.
    pub(crate) fn finish(&mut self, ids: &[i64]) -> Option<u64> {
        for id in ids {
            if let Some((seq, _)) = self.claimed.remove(id) {
                self.finish_in(seq);
            }
        }
        self.confirmable()
    }

    /// Claimed rows given back unpublished: claimed again first, in the
    /// order they were committed.
    pub(crate) fn release(&mut self, ids: &[i64]) {
        let mut back: Vec<(u64, PendingOutbox)> = ids
            .iter()
            .filter_map(|id| self.claimed.remove(id))
            .collect();
        back.sort_by_key(|(seq, row)| (*seq, row.id));
        for entry in back.into_iter().rev() {
            self.pending.push_front(entry);
        }
    }

    /// The stream restarts from the slot's confirmed position, which
    /// delivers every unfinished transaction again: forget them.
    pub(crate) fn restart(&mut self) {
        *self = Self {
            next_seq: self.next_seq,
            swept: std::mem::take(&mut self.swept),
            ..Self::default()
        };
    }

    /// Rows delivered and not finished.
    pub(crate) fn unfinished(&self) -> usize {
        self.committed.iter().map(|c| c.unfinished).sum()
    }

    fn finish_in(&mut self, seq: u64) {
        if let Some(txn) = self.committed.iter_mut().find(|c| c.seq == seq) {
            txn.unfinished = txn.unfinished.saturating_sub(1);
        }
    }

    /// The position the slot may be confirmed to, if it moved since the
    /// last time this was asked (a claim can finish rows too).
    pub(crate) fn confirmable(&mut self) -> Option<u64> {
        let mut upto = None;
        while self.committed.front().is_some_and(|c| c.unfinished == 0) {
            upto = self.committed.pop_front().map(|c| c.end_lsn);
        }
        upto
    }
}

#[cfg(test)]
mod tests {
    use keel_store::OutboxRecord;

    use super::*;

    fn row(id: i64, key: &str) -> PendingOutbox {
        PendingOutbox {
            id,
            record: OutboxRecord {
                event_id: format!("e-{id}"),
                topic: "t".to_owned(),
                partition_key: key.to_owned(),
                headers: Default::default(),
                payload: Default::default(),
            },
            created_at: chrono::DateTime::UNIX_EPOCH,
            attempts: 0,
        }
    }

    fn ids(rows: &[PendingOutbox]) -> Vec<i64> {
        rows.iter().map(|r| r.id).collect()
    }

    #[test]
    fn the_slot_moves_past_a_transaction_only_when_all_its_rows_are_finished() {
        let mut feed = Feed::default();
        let none = HashSet::new();
        feed.insert(row(8, "a"));
        feed.insert(row(9, "b"));
        assert_eq!(feed.commit(100), (2, None));
        feed.insert(row(7, "c"));
        assert_eq!(feed.commit(200), (1, None));
        assert_eq!(feed.idle_at(300), None);

        let claimed = feed.claim(10, &none);
        assert_eq!(ids(&claimed), [8, 9, 7], "commit order, not id order");
        assert_eq!(
            feed.finish(&[7]),
            None,
            "an earlier transaction is unfinished"
        );
        assert_eq!(feed.finish(&[8]), None);
        assert_eq!(feed.finish(&[9]), Some(200));
        assert_eq!(feed.idle_at(300), Some(300));
        assert_eq!(feed.unfinished(), 0);
    }

    #[test]
    fn released_rows_come_back_first_and_held_keys_are_left_to_the_table() {
        let mut feed = Feed::default();
        for (id, key) in [(1, "a"), (2, "b"), (3, "a")] {
            feed.insert(row(id, key));
        }
        feed.commit(10);
        let claimed = feed.claim(2, &HashSet::new());
        assert_eq!(ids(&claimed), [1, 2]);
        feed.release(&[2, 1]);
        let held: HashSet<String> = ["a".to_owned()].into();
        let claimed = feed.claim(10, &held);
        assert_eq!(ids(&claimed), [2], "rows of the held key stay in the table");
        assert_eq!(feed.finish(&[2]), Some(10));
    }

    #[test]
    fn rows_the_sweep_published_are_finished_when_they_stream_in() {
        let mut feed = Feed::default();
        feed.swept(&[1]);
        feed.insert(row(1, "a"));
        feed.insert(row(2, "a"));
        feed.commit(9);
        assert_eq!(ids(&feed.claim(10, &HashSet::new())), [2]);
        assert_eq!(feed.finish(&[2]), Some(9));

        feed.swept(&[3]);
        feed.insert(row(3, "b"));
        assert_eq!(feed.commit(10), (1, None));
        assert!(feed.claim(10, &HashSet::new()).is_empty());
        assert_eq!(
            feed.confirmable(),
            Some(10),
            "a claim finished the transaction"
        );
    }

    #[test]
    fn empty_transactions_confirm_at_once_and_a_restart_forgets_the_rest() {
        let mut feed = Feed::default();
        assert_eq!(feed.commit(5), (0, Some(5)));
        feed.insert(row(1, "a"));
        feed.commit(6);
        let _ = feed.claim(1, &HashSet::new());
        feed.restart();
        assert_eq!(
            feed.finish(&[1]),
            None,
            "a finish after a restart is ignored"
        );
        assert_eq!(feed.unfinished(), 0);
        assert_eq!(feed.idle_at(7), Some(7));
    }
}
