//! A tower service that balances requests over a fixed list of services.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use keel_core::error::classify;
use keel_core::{BoxError, Rejected};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::{Balancer, BalancerBuilder, EndpointSnapshot, Picked};
use crate::ConfigError;

/// Sends each request to one of several services, chosen by a [`Balancer`]
/// over their keys, and ejects services that keep failing.
///
/// This is a service, not a layer: like `tower::balance::p2c::Balance`, it
/// stands for many services at once. `poll_ready` picks an endpoint by power
/// of two choices and waits for it; if the chosen service is not ready,
/// another service in the pool that is ready is used instead. Responses
/// finish the pick: `Ok` is a success, errors are classified with
/// [`classify`] (a service answering HTTP 5xx as `Ok` must turn it into an
/// error below this layer for it to count). An inner `poll_ready` error is
/// returned as this service's error, as tower requires.
pub struct BalanceService<K, S> {
    balancer: Balancer<K>,
    services: Vec<S>,
    ready: Option<Result<Picked<K>, Rejected>>,
}

impl<K, S> BalanceService<K, S> {
    /// Balances over `services`, each with a key for logs and snapshots,
    /// using a balancer built from `builder`.
    pub fn new(
        builder: BalancerBuilder,
        services: impl IntoIterator<Item = (K, S)>,
    ) -> Result<Self, ConfigError> {
        let balancer = builder.build()?;
        let services = services
            .into_iter()
            .map(|(key, service)| {
                balancer.insert(key);
                service
            })
            .collect();
        Ok(Self {
            balancer,
            services,
            ready: None,
        })
    }

    /// What the balancer knows about each service now, by key.
    pub fn snapshot(&self) -> Vec<EndpointSnapshot<K>>
    where
        K: Clone,
    {
        self.balancer.snapshot()
    }

    /// The services, in the order given.
    pub fn get_ref(&self) -> &[S] {
        &self.services
    }

    /// The services, mutably.
    pub fn get_mut(&mut self) -> &mut [S] {
        &mut self.services
    }

    /// Unwraps the services.
    pub fn into_inner(self) -> Vec<S> {
        self.services
    }

    /// Polls the readiness of the service at `position`.
    fn poll_service<Req>(
        &mut self,
        position: usize,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), BoxError>>
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
    {
        match self.services.get_mut(position) {
            Some(service) => service.poll_ready(cx).map_err(Into::into),
            None => Poll::Pending,
        }
    }

    /// The chosen service was not ready: take any other ready one in the
    /// pool, starting after it.
    fn poll_any<Req>(&mut self, skip: usize, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>>
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
    {
        let n = self.services.len();
        for position in (1..n).map(|k| (skip + k) % n) {
            let Some(picked) = self.balancer.pick_at(position) else {
                continue;
            };
            match self.poll_service(position, cx) {
                Poll::Ready(Ok(())) => {
                    self.ready = Some(Ok(picked));
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Err(err)) => {
                    picked.failure(classify(err.as_ref()));
                    return Poll::Ready(Err(err));
                }
                Poll::Pending => picked.release(),
            }
        }
        Poll::Pending
    }
}

impl<K, S: fmt::Debug> fmt::Debug for BalanceService<K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BalanceService")
            .field("balancer", &self.balancer)
            .field("services", &self.services)
            .finish_non_exhaustive()
    }
}

impl<K, S, Req> Service<Req> for BalanceService<K, S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, K>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let picked = match self.ready.take() {
            Some(Ok(picked)) => picked,
            None => match self.balancer.pick() {
                Ok(picked) => picked,
                Err(rejected) => return self.ready_to_refuse(rejected),
            },
            Some(Err(rejected)) => return self.ready_to_refuse(rejected),
        };
        let position = picked.position();
        match self.poll_service(position, cx) {
            Poll::Ready(Ok(())) => {
                self.ready = Some(Ok(picked));
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(err)) => {
                picked.failure(classify(err.as_ref()));
                Poll::Ready(Err(err))
            }
            Poll::Pending => {
                picked.release();
                self.poll_any(position, cx)
            }
        }
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let refused = |rejected| ResponseFuture {
            state: State::Refused { rejected },
        };
        match self.ready.take() {
            Some(Ok(picked)) => match self.services.get_mut(picked.position()) {
                Some(service) => ResponseFuture {
                    state: State::Sent {
                        inner: service.call(req),
                        picked: Some(picked),
                    },
                },
                None => {
                    picked.release();
                    refused(self.balancer.no_endpoint())
                }
            },
            Some(Err(rejected)) => refused(rejected),
            // Called without `poll_ready`: nothing was chosen.
            None => refused(self.balancer.no_endpoint()),
        }
    }
}

impl<K, S> BalanceService<K, S> {
    /// With no endpoints, be ready and refuse the call, so callers get
    /// [`Rejected::NoEndpoint`] rather than waiting forever.
    fn ready_to_refuse(&mut self, rejected: Rejected) -> Poll<Result<(), BoxError>> {
        self.ready = Some(Err(rejected));
        Poll::Ready(Ok(()))
    }
}

pin_project! {
    /// The response future of a [`BalanceService`].
    pub struct ResponseFuture<F, K> {
        #[pin]
        state: State<F, K>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, K> {
        Sent { #[pin] inner: F, picked: Option<Picked<K>> },
        Refused { rejected: Rejected },
    }
}

impl<F, K, T, E> Future for ResponseFuture<F, K>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Refused { rejected } => Poll::Ready(Err(Box::new(rejected.clone()))),
            StateProj::Sent { inner, picked } => {
                let result = ready!(inner.poll(cx)).map_err(Into::into);
                if let Some(picked) = picked.take() {
                    match &result {
                        Ok(_) => picked.success(),
                        Err(err) => picked.failure(classify(err.as_ref())),
                    }
                }
                Poll::Ready(result)
            }
        }
    }
}
