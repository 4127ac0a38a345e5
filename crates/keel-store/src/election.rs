//! Leader election: one process of many leads, and every leader carries a
//! fencing token higher than all before it.

use async_trait::async_trait;

use crate::StoreError;

/// A won campaign: this process leads while [`is_leader`](Self::is_leader)
/// says so, by its own clock, which is never later than the backend's.
/// Dropping it stops renewing: the backend then ends the leadership when
/// its lease runs out.
#[async_trait]
pub trait Leadership: Send + Sync + std::fmt::Debug {
    /// Higher than every earlier leader's token in this election: give it
    /// to every write, and let the resource refuse older ones (a fence).
    fn token(&self) -> u64;

    /// Whether this process still leads. Once false it stays false: a
    /// leadership that lapsed is over even if the backend comes back.
    fn is_leader(&self) -> bool;

    /// Resolves when the leadership ends by this process's clock.
    async fn lost(&self);

    /// Ends the leadership now, so the next campaign wins at once.
    async fn resign(self: Box<Self>) -> Result<(), StoreError>;
}

/// One election: every process campaigning on it competes for one
/// leadership.
#[async_trait]
pub trait Election: Clone + Send + Sync + 'static {
    /// Campaigns as `holder` and returns once this process leads.
    /// Dropping the future gives the campaign up.
    async fn campaign(&self, holder: &str) -> Result<Box<dyn Leadership>, StoreError>;
}

/// When a leadership ends by its holder's clock, as the holder's renewals
/// move it, read by the [`Leadership`]. Made by [`leadership_deadline`].
#[derive(Debug, Clone)]
pub struct LeadershipDeadline(tokio::sync::watch::Receiver<keel_core::clock::Instant>);

/// Moves a [`LeadershipDeadline`]: each renewal that was answered extends
/// it, and once it has passed nothing extends it again.
#[derive(Debug)]
pub struct DeadlineRenewer(tokio::sync::watch::Sender<keel_core::clock::Instant>);

/// A deadline at `first` (the end of the grant that won the campaign) and
/// what moves it.
pub fn leadership_deadline(
    first: keel_core::clock::Instant,
) -> (DeadlineRenewer, LeadershipDeadline) {
    let (renewer, deadline) = tokio::sync::watch::channel(first);
    (DeadlineRenewer(renewer), LeadershipDeadline(deadline))
}

impl DeadlineRenewer {
    /// Moves the deadline to `until`, unless it has passed already (a
    /// lapsed leadership is over, whatever a late answer says); whether
    /// it moved.
    pub fn extend(&self, until: keel_core::clock::Instant) -> bool {
        self.0.send_if_modified(|current| {
            let live = keel_core::clock::now() < *current;
            if live {
                *current = until;
            }
            live
        })
    }

    /// Ends the leadership now.
    pub fn end(&self) {
        self.0.send_replace(keel_core::clock::now());
    }

    /// Whether the deadline has passed.
    pub fn has_passed(&self) -> bool {
        keel_core::clock::now() >= *self.0.borrow()
    }
}

impl LeadershipDeadline {
    /// Whether the leadership still runs.
    pub fn is_live(&self) -> bool {
        keel_core::clock::now() < *self.0.borrow()
    }

    /// Resolves when the deadline passes (at once if it has).
    pub async fn passed(&self) {
        let mut deadline = self.0.clone();
        loop {
            let until = *deadline.borrow_and_update();
            if keel_core::clock::now() >= until {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                changed = deadline.changed() => {
                    if changed.is_err() {
                        // Nothing moves it any more: wait out the last one.
                        let until = *deadline.borrow();
                        tokio::time::sleep_until(until).await;
                        return;
                    }
                }
            }
        }
    }
}
