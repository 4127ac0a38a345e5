//! Load shedding as tower middleware.

use tower_layer::Layer;

use super::LoadShed;
use crate::slots::SlotService;

/// Applies a [`LoadShed`] policy to a tower service. Every service it makes
/// shares the policy's slots and queue.
#[derive(Debug, Clone)]
pub struct LoadShedLayer {
    shed: LoadShed,
}

impl LoadShedLayer {
    /// A layer sharing `shed`.
    pub fn new(shed: LoadShed) -> Self {
        Self { shed }
    }
}

impl<S> Layer<S> for LoadShedLayer {
    type Service = LoadShedService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LoadShedService::new(inner, self.shed.clone())
    }
}

/// A tower service whose calls run in a [`LoadShed`] policy's slots.
///
/// The slot is taken in `poll_ready`, queueing there while the queue has
/// room. Shed calls do not wait: `poll_ready` is ready and the call fails
/// with a boxed [`Rejected::Overloaded`](keel_core::Rejected::Overloaded)
/// (or `DeadlineExceeded` if the deadline passed while queued).
pub type LoadShedService<S> = SlotService<S, LoadShed>;
