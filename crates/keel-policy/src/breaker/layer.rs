//! The tower layer and service.

use std::task::{Context, Poll};

use keel_core::BoxError;
use tower_layer::Layer;
use tower_service::Service;

use super::CircuitBreaker;
use super::classify::{Answered, ClassifyResponse};
use super::future::ResponseFuture;

/// Puts a [`CircuitBreaker`] in front of a service.
///
/// Errors are judged by their class ([`Outcome::from_class`](super::Outcome::from_class));
/// responses by the layer's [`ClassifyResponse`], by default [`Answered`]
/// (every response is a success). For an HTTP client, whose `500` is an
/// `Ok`, use [`classify_response`](Self::classify_response) with
/// `HttpStatus`, or `CircuitBreaker::http_layer` (both feature `http`).
#[derive(Debug, Clone)]
pub struct CircuitBreakerLayer<C = Answered> {
    breaker: CircuitBreaker,
    classify: C,
}

impl CircuitBreakerLayer {
    /// A layer sharing `breaker` (and its state) with every service it
    /// wraps, counting every response as a success.
    pub fn new(breaker: CircuitBreaker) -> Self {
        Self {
            breaker,
            classify: Answered,
        }
    }
}

impl<C> CircuitBreakerLayer<C> {
    /// Judges responses with `classify` instead: a response it calls a
    /// [`Failure`](super::Outcome::Failure) counts against the dependency
    /// like an error would (and the response is still returned to the
    /// caller); one it calls [`Ignored`](super::Outcome::Ignored) is not
    /// recorded.
    ///
    /// ```
    /// use keel_policy::breaker::{CircuitBreaker, Outcome};
    ///
    /// let breaker = CircuitBreaker::builder("search").build().unwrap();
    /// // A service answering `Result<String, _>` where "busy" means overloaded.
    /// let layer = breaker.layer().classify_response(|body: &String| {
    ///     if body == "busy" { Outcome::Failure } else { Outcome::Success }
    /// });
    /// # let _ = layer;
    /// ```
    pub fn classify_response<D>(self, classify: D) -> CircuitBreakerLayer<D> {
        CircuitBreakerLayer {
            breaker: self.breaker,
            classify,
        }
    }

    /// The breaker.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }
}

impl<S, C: Clone> Layer<S> for CircuitBreakerLayer<C> {
    type Service = CircuitBreakerService<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        CircuitBreakerService {
            inner,
            breaker: self.breaker.clone(),
            classify: self.classify.clone(),
        }
    }
}

/// A service guarded by a [`CircuitBreaker`].
///
/// `poll_ready` only asks the inner service: permission is taken in `call`,
/// which answers a refused request with a ready future failing with a boxed
/// [`Rejected::CircuitOpen`](keel_core::Rejected::CircuitOpen). Taking it in
/// `poll_ready` would hold a half-open probe slot for a request that may
/// never be made.
#[derive(Debug, Clone)]
pub struct CircuitBreakerService<S, C = Answered> {
    inner: S,
    breaker: CircuitBreaker,
    classify: C,
}

impl<S> CircuitBreakerService<S> {
    /// Wraps `inner` with `breaker`, counting every response as a success.
    pub fn new(inner: S, breaker: CircuitBreaker) -> Self {
        Self {
            inner,
            breaker,
            classify: Answered,
        }
    }
}

impl<S, C> CircuitBreakerService<S, C> {
    /// The breaker.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    keel_core::inner_service_accessors!(inner: S);
}

impl<S, C, Req> Service<Req> for CircuitBreakerService<S, C>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    C: ClassifyResponse<S::Response> + Clone,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, C>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        match self.breaker.try_acquire_owned() {
            Ok(permit) => {
                ResponseFuture::called(self.inner.call(request), permit, self.classify.clone())
            }
            Err(rejected) => ResponseFuture::rejected(rejected),
        }
    }
}
