//! The bulkhead as tower middleware.

use std::fmt;
use std::hash::Hash;
use std::task::{Context, Poll};

use keel_core::BoxError;
use tower_layer::Layer;
use tower_service::Service;

use super::{Bulkhead, KeyedBulkhead, ResponseFuture};
use crate::slots::SlotService;

/// Applies a [`Bulkhead`] to a tower service. Every service it makes shares
/// the bulkhead's slots.
#[derive(Debug, Clone)]
pub struct BulkheadLayer {
    bulkhead: Bulkhead,
}

impl BulkheadLayer {
    /// A layer sharing `bulkhead`.
    pub fn new(bulkhead: Bulkhead) -> Self {
        Self { bulkhead }
    }
}

impl<S> Layer<S> for BulkheadLayer {
    type Service = BulkheadService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BulkheadService::new(inner, self.bulkhead.clone())
    }
}

/// A tower service whose calls run in a [`Bulkhead`]'s slots.
///
/// The slot is taken in `poll_ready` (waiting there if the bulkhead allows
/// waiting), so a full bulkhead answers at once: `poll_ready` is ready and
/// the call fails with a boxed [`Rejected::BulkheadFull`](keel_core::Rejected::BulkheadFull).
pub type BulkheadService<S> = SlotService<S, Bulkhead>;

/// Applies a [`KeyedBulkhead`] to a tower service, with the key (tenant,
/// user, route) taken from each request by `key_of`.
///
/// The keyed services never wait: a request whose compartment is full is
/// refused at once with a boxed [`Rejected::BulkheadFull`](keel_core::Rejected::BulkheadFull), so a noisy
/// tenant gets fast `503`s instead of holding connections. (Waiting, if
/// configured, applies to [`KeyedBulkhead::call`].)
pub struct KeyedBulkheadLayer<K, F> {
    bulkhead: KeyedBulkhead<K>,
    key_of: F,
}

impl<K, F> KeyedBulkheadLayer<K, F> {
    /// A layer giving each key `key_of(&request)` its compartment of
    /// `bulkhead`.
    pub fn new(bulkhead: KeyedBulkhead<K>, key_of: F) -> Self {
        Self { bulkhead, key_of }
    }
}

impl<K, F: Clone> Clone for KeyedBulkheadLayer<K, F> {
    fn clone(&self) -> Self {
        Self::new(self.bulkhead.clone(), self.key_of.clone())
    }
}

impl<K, F> fmt::Debug for KeyedBulkheadLayer<K, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedBulkheadLayer")
            .field("bulkhead", &self.bulkhead)
            .finish_non_exhaustive()
    }
}

impl<S, K, F: Clone> Layer<S> for KeyedBulkheadLayer<K, F> {
    type Service = KeyedBulkheadService<S, K, F>;

    fn layer(&self, inner: S) -> Self::Service {
        KeyedBulkheadService {
            inner,
            bulkhead: self.bulkhead.clone(),
            key_of: self.key_of.clone(),
        }
    }
}

/// A tower service whose calls run in their key's compartment of a
/// [`KeyedBulkhead`]; see [`KeyedBulkheadLayer`].
pub struct KeyedBulkheadService<S, K, F> {
    inner: S,
    bulkhead: KeyedBulkhead<K>,
    key_of: F,
}

impl<S, K, F> KeyedBulkheadService<S, K, F> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, K, F, Req> Service<Req> for KeyedBulkheadService<S, K, F>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    K: Hash + Eq + Clone,
    F: Fn(&Req) -> K,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let key = (self.key_of)(&req);
        match self.bulkhead.try_enter_owned(&key) {
            Ok(slot) => ResponseFuture::admitted(self.inner.call(req), slot),
            Err(rejected) => ResponseFuture::refused(rejected),
        }
    }
}

impl<S: Clone, K, F: Clone> Clone for KeyedBulkheadService<S, K, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            bulkhead: self.bulkhead.clone(),
            key_of: self.key_of.clone(),
        }
    }
}

impl<S: fmt::Debug, K, F> fmt::Debug for KeyedBulkheadService<S, K, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedBulkheadService")
            .field("inner", &self.inner)
            .field("bulkhead", &self.bulkhead)
            .finish_non_exhaustive()
    }
}
