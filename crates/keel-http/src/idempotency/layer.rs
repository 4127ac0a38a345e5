//! [`IdempotencyLayer`]: wraps a service in [`Idempotency`].

use std::sync::Arc;

use keel_store::IdempotencyStore;
use tower_layer::Layer;

use super::options::{IdempotencyOptions, InvalidIdempotencyOptions};
use super::service::Idempotency;

/// Applies the Idempotency-Key protocol to the services it wraps, storing
/// keys and responses in `S`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer<S> {
    store: S,
    options: Arc<IdempotencyOptions>,
}

impl<S: IdempotencyStore> IdempotencyLayer<S> {
    /// A layer with the default [`IdempotencyOptions`].
    pub fn new(store: S) -> Self {
        Self {
            store,
            options: Arc::new(IdempotencyOptions::new()),
        }
    }

    /// A layer with `options`, refused if they cannot work.
    pub fn with_options(
        store: S,
        options: IdempotencyOptions,
    ) -> Result<Self, InvalidIdempotencyOptions> {
        options.validate()?;
        Ok(Self {
            store,
            options: Arc::new(options),
        })
    }

    /// The store keys are kept in.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The options.
    pub fn options(&self) -> &IdempotencyOptions {
        &self.options
    }
}

impl<S: IdempotencyStore, I> Layer<I> for IdempotencyLayer<S> {
    type Service = Idempotency<I, S>;

    fn layer(&self, inner: I) -> Self::Service {
        Idempotency::from_parts(inner, self.store.clone(), Arc::clone(&self.options))
    }
}
