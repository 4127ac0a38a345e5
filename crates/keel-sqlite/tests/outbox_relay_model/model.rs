//! The reference model of the outbox: its rows in commit order, each
//! pending, published, parked or discarded, with its lease and attempts.

use super::Act;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    Pending,
    Published,
    Parked,
    Discarded,
}

#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) event: String,
    pub(crate) key: usize,
    pub(crate) state: State,
    /// The relay holding it, and until when (seconds).
    pub(crate) lease: Option<(usize, u64)>,
    pub(crate) attempts: u32,
}

impl Row {
    pub(crate) fn unpublished(&self) -> bool {
        matches!(self.state, State::Pending | State::Parked)
    }

    /// Whether another relay than `relay` holds a live lease on it.
    pub(crate) fn held_by_other(&self, relay: usize, now: u64) -> bool {
        self.lease
            .is_some_and(|(r, until)| r != relay && until > now)
    }
}

/// The rows in commit order (which is id order: SQLite has one writer).
#[derive(Default)]
pub(crate) struct Model {
    pub(crate) now: u64,
    pub(crate) rows: Vec<Row>,
}

impl Model {
    fn claimable(&self, i: usize, relay: usize) -> bool {
        let row = &self.rows[i];
        let blocks = |e: &Row| {
            e.key == row.key
                && e.unpublished()
                && (e.state == State::Parked || e.held_by_other(relay, self.now))
        };
        row.state == State::Pending
            && !row.held_by_other(relay, self.now)
            && !self.rows[..i].iter().any(blocks)
    }

    pub(crate) fn claim(&mut self, relay: usize, limit: usize, lease_secs: u64) -> Vec<usize> {
        let taken: Vec<usize> = (0..self.rows.len())
            .filter(|&i| self.claimable(i, relay))
            .take(limit)
            .collect();
        for &i in &taken {
            self.rows[i].lease = Some((relay, self.now + lease_secs));
        }
        taken
    }

    fn row(&mut self, event: &str) -> &mut Row {
        let found = self.rows.iter_mut().find(|r| r.event == event);
        found.expect("a row the model knows")
    }

    /// Mark (`SET ... WHERE unpublished`), or release or count a failure
    /// (`... AND claimed by relay`: a relay gives back only what it still
    /// holds, never its successor's claim).
    pub(crate) fn settle(&mut self, events: &[String], act: Act, relay: usize) {
        for event in events {
            let row = self.row(event);
            let releases = matches!(act, Act::Release | Act::ReleaseFailed);
            let held = row.lease.is_some_and(|(r, _)| r == relay);
            if !row.unpublished() || (releases && !held) {
                continue;
            }
            row.lease = None;
            match act {
                Act::Mark => row.state = State::Published,
                Act::ReleaseFailed => row.attempts += 1,
                _ => {}
            }
        }
    }

    pub(crate) fn park(&mut self, event: &str) -> bool {
        let row = self.row(event);
        let parked = row.state == State::Pending;
        if parked {
            *row = Row {
                state: State::Parked,
                lease: None,
                attempts: row.attempts + 1,
                ..row.clone()
            };
        }
        parked
    }

    /// Replays (`Some(Pending)`) or discards a parked row.
    pub(crate) fn operate(&mut self, event: &str, to: State) -> bool {
        let row = self.row(event);
        let parked = row.state == State::Parked;
        if parked {
            row.state = to;
            row.attempts = 0;
        }
        parked
    }

    pub(crate) fn count(&self, state: State) -> u64 {
        self.rows.iter().filter(|r| r.state == state).count() as u64
    }

    pub(crate) fn events_in(&self, state: State) -> Vec<String> {
        let rows = self.rows.iter().filter(|r| r.state == state);
        rows.map(|r| r.event.clone()).collect()
    }

    /// Each parked row with its attempts and the unpublished rows of its
    /// key behind it.
    pub(crate) fn parked(&self) -> Vec<(String, u32, u64)> {
        let behind = |i: usize| {
            let key = self.rows[i].key;
            let later = self.rows[i + 1..].iter();
            later.filter(|e| e.key == key && e.unpublished()).count() as u64
        };
        let parked = self.rows.iter().enumerate();
        let parked = parked.filter(|(_, r)| r.state == State::Parked);
        parked
            .map(|(i, r)| (r.event.clone(), r.attempts, behind(i)))
            .collect()
    }
}
