//! What users write: a handler that applies one event inside a transaction.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::{BoxError, Classified, Classify, ErrorClass, Rejected};

use crate::broker::{BrokerError, Message};
use crate::envelope::{Envelope, EnvelopeError, Event};
use crate::store::StoreError;

/// The future a closure handler returns: `Box::pin(async move { ... })`.
pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// Facts about the delivery being handled, beyond the event itself.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeliveryInfo {
    /// The message as the broker delivered it (headers included).
    pub message: Message,
    /// How many times it has been delivered to this group, this time
    /// included. Knowing the attempt number lets you log, alert, or degrade
    /// on the nth try.
    pub delivery_count: u32,
    /// The id the inbox dedupes on (the `event-id` header).
    pub event_id: String,
    /// The consumer group (and inbox scope).
    pub group: String,
    /// What runs once the handler's transaction committed.
    pub(crate) committed: CommitWork,
}

impl DeliveryInfo {
    /// Runs `work` once the transaction the handler writes in has
    /// committed, and never if it does not (an error rolled it back, the
    /// commit failed, or its outcome is unknown): for what must not start
    /// before the effect is durable, such as handing a saga started in the
    /// transaction to its orchestrator
    /// (`SagaOrchestrator::start_claimed`). It runs before the delivery is
    /// acknowledged, on the consumer's task: keep it short.
    pub fn on_commit(&self, work: impl FnOnce() + Send + 'static) {
        self.committed.0.lock().push(Box::new(work));
    }
}

type Work = Box<dyn FnOnce() + Send>;

/// The work a handler left for after its commit.
#[derive(Clone, Default)]
pub(crate) struct CommitWork(std::sync::Arc<parking_lot::Mutex<Vec<Work>>>);

impl CommitWork {
    /// Runs the work left, once.
    pub(crate) fn run(&self) {
        let work = std::mem::take(&mut *self.0.lock());
        work.into_iter().for_each(|w| w());
    }

    /// Drops the work left: the transaction did not commit.
    pub(crate) fn discard(&self) {
        self.0.lock().clear();
    }
}

impl fmt::Debug for CommitWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CommitWork")
            .field(&self.0.lock().len())
            .finish()
    }
}

/// Applies one event. Everything it writes goes into `tx`, which also holds
/// the inbox row: the effect and the dedupe row commit together or not at
/// all. It must not commit `tx` itself.
///
/// Implement it for stateful handlers; wrap closures with [`handler_fn`] or
/// [`event_fn`].
#[async_trait]
pub trait Handler<Tx: Send>: Send + Sync + 'static {
    /// Handles `envelope`. An error rolls `tx` back; see [`HandlerError`]
    /// for what happens next.
    async fn handle(
        &self,
        tx: &mut Tx,
        envelope: &Envelope,
        info: &DeliveryInfo,
    ) -> Result<(), HandlerError>;
}

/// A handler made from a closure over the raw envelope; see [`handler_fn`].
pub struct HandlerFn<F> {
    f: F,
}

impl<F> fmt::Debug for HandlerFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HandlerFn")
    }
}

/// A handler from a closure taking the transaction and the envelope:
///
/// ```
/// use keel_messaging::consumer::{handler_fn, HandlerError};
/// # struct Tx;
/// let h = handler_fn(|_tx: &mut Tx, env| Box::pin(async move {
///     let total: i64 = env.data_as::<serde_json::Value>()?["totalMinor"].as_i64().unwrap_or(0);
///     // ... write the effect in the transaction ...
///     let _ = total;
///     Ok::<(), HandlerError>(())
/// }));
/// # let _ = h;
/// ```
pub fn handler_fn<Tx, F>(f: F) -> HandlerFn<F>
where
    Tx: Send + 'static,
    F: for<'a> Fn(&'a mut Tx, &'a Envelope) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    HandlerFn { f }
}

#[async_trait]
impl<Tx, F> Handler<Tx> for HandlerFn<F>
where
    Tx: Send + 'static,
    F: for<'a> Fn(&'a mut Tx, &'a Envelope) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    async fn handle(
        &self,
        tx: &mut Tx,
        envelope: &Envelope,
        _info: &DeliveryInfo,
    ) -> Result<(), HandlerError> {
        (self.f)(tx, envelope).await
    }
}

/// A handler made from a closure over a typed event; see [`event_fn`].
pub struct EventFn<E, F> {
    f: F,
    _event: PhantomData<fn() -> E>,
}

impl<E, F> fmt::Debug for EventFn<E, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventFn")
            .field("event", &std::any::type_name::<E>())
            .finish()
    }
}

/// A handler from a closure taking the transaction, the decoded event and
/// its envelope (for `version`, `occurred_at`, ...). Data that does not fit
/// `E` is dead-lettered as `malformed` without calling the closure; fields
/// `E` does not know are ignored (tolerant reader).
pub fn event_fn<Tx, E, F>(f: F) -> EventFn<E, F>
where
    Tx: Send + 'static,
    E: Event + Send + 'static,
    F: for<'a> Fn(&'a mut Tx, E, &'a Envelope) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    EventFn {
        f,
        _event: PhantomData,
    }
}

#[async_trait]
impl<Tx, E, F> Handler<Tx> for EventFn<E, F>
where
    Tx: Send + 'static,
    E: Event + Send + 'static,
    F: for<'a> Fn(&'a mut Tx, E, &'a Envelope) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    async fn handle(
        &self,
        tx: &mut Tx,
        envelope: &Envelope,
        _info: &DeliveryInfo,
    ) -> Result<(), HandlerError> {
        let event: E = envelope.data_as()?;
        (self.f)(tx, event, envelope).await
    }
}

/// What a failed handler wants done with the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Deliver it again later (after a backoff, or after `after` if the
    /// failing side said so), until the delivery limit.
    Retry {
        /// A `Retry-After` from the failing dependency, if it sent one.
        after: Option<Duration>,
    },
    /// It will never succeed: dead-letter it now.
    Permanent,
}

/// A handler failed. The transaction is rolled back, then the message is
/// retried or dead-lettered according to [`disposition`](Self::disposition).
///
/// `?` converts any error. Its class is read from its chain of causes: a
/// [`Classified`], a [`Rejected`], a [`StoreError`], a [`BrokerError`] or an
/// `std::io::Error` decides; an [`EnvelopeError`] (data that does not fit the
/// event type) is permanent. An error nobody classified is **retried**: the
/// transaction rolled back, so another attempt is safe, and the delivery
/// limit bounds the waste, while dead-lettering a transient failure nobody
/// recognised (a busy database, a dropped connection) would page a human for
/// nothing. Say [`HandlerError::permanent`] when you know better.
///
/// A dead letter is filed under a kind (`permanent`, `too_many_attempts`,
/// ...); [`with_kind`](Self::with_kind) files it under the handler's own
/// error type instead (`payment_declined`), which the dead-letter store
/// lists, counts and replays by.
pub struct HandlerError {
    disposition: Disposition,
    malformed: bool,
    kind: Option<&'static str>,
    source: BoxError,
}

impl HandlerError {
    /// A failure worth retrying.
    pub fn retryable(source: impl Into<BoxError>) -> Self {
        Self::with(Disposition::Retry { after: None }, source.into())
    }

    /// A failure worth retrying, but not before `after` (a dependency's
    /// `Retry-After`, a rate limit's reset): the next delivery waits for
    /// the longer of `after` and the backoff.
    pub fn retry_after(source: impl Into<BoxError>, after: Duration) -> Self {
        Self::with(Disposition::Retry { after: Some(after) }, source.into())
    }

    /// A failure that will never go away: dead-letter the message now.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        Self::with(Disposition::Permanent, source.into())
    }

    /// Any error, classified from its chain of causes (see the type docs).
    pub fn classify(source: impl Into<BoxError>) -> Self {
        let source = source.into();
        let disposition = disposition_of(source.as_ref());
        Self::with(disposition, source)
    }

    fn with(disposition: Disposition, source: BoxError) -> Self {
        let malformed = keel_core::error::find_cause::<EnvelopeError>(source.as_ref()).is_some();
        Self {
            disposition,
            malformed,
            kind: None,
            source,
        }
    }

    /// Files the message, if it is dead-lettered for this failure, under
    /// `kind`: the handler's own error type, in place of the runtime's
    /// `permanent` or `too_many_attempts`. A kind is 1 to 64 of `a-z`,
    /// `0-9`, `_`, `.` and `-`; any other is ignored (and logged), so a
    /// typo cannot make a letter unfindable.
    pub fn with_kind(mut self, kind: &'static str) -> Self {
        if is_kind(kind) {
            self.kind = Some(kind);
        } else {
            tracing::warn!(
                kind,
                "not a dead-letter kind (1 to 64 of a-z, 0-9, _ . -); ignored"
            );
        }
        self
    }

    /// The handler's own kind for this failure, if it gave one.
    pub fn kind(&self) -> Option<&'static str> {
        self.kind
    }

    /// Retry or dead-letter.
    pub fn disposition(&self) -> Disposition {
        self.disposition
    }

    /// Whether the event's data did not fit the handler's type.
    pub fn is_malformed(&self) -> bool {
        self.malformed
    }

    /// The underlying error.
    pub fn source(&self) -> &(dyn StdError + Send + Sync + 'static) {
        self.source.as_ref()
    }

    /// The error and all its causes, `outer: inner: root`.
    pub fn report(&self) -> String {
        keel_core::error::report(self.source.as_ref())
    }

    /// Converts into the underlying error.
    pub fn into_inner(self) -> BoxError {
        self.source
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("disposition", &self.disposition)
            .field("kind", &self.kind)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

// `HandlerError` deliberately does not implement `std::error::Error`, so
// that this blanket conversion (what makes `?` work) is coherent.
impl<E: StdError + Send + Sync + 'static> From<E> for HandlerError {
    fn from(err: E) -> Self {
        Self::classify(err)
    }
}

fn is_kind(kind: &str) -> bool {
    (1..=64).contains(&kind.len())
        && kind
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b))
}

/// The disposition of an error from the first cause whose class is known.
pub(crate) fn disposition_of(err: &(dyn StdError + 'static)) -> Disposition {
    for cause in keel_core::error::causes(err) {
        let known: Option<(ErrorClass, Option<Duration>)> =
            if let Some(e) = cause.downcast_ref::<Classified>() {
                Some((e.class(), None))
            } else if let Some(e) = cause.downcast_ref::<Rejected>() {
                Some((e.class(), e.retry_after()))
            } else if let Some(e) = cause.downcast_ref::<StoreError>() {
                Some((e.class(), None))
            } else if let Some(e) = cause.downcast_ref::<BrokerError>() {
                Some((e.class(), None))
            } else if cause.is::<EnvelopeError>() {
                Some((ErrorClass::Permanent, None))
            } else {
                cause
                    .downcast_ref::<std::io::Error>()
                    .map(|e| (e.class(), None))
            };
        if let Some((class, after)) = known {
            return match class {
                ErrorClass::Permanent => Disposition::Permanent,
                // Rolled back, so even an unknown outcome is safe to retry.
                _ => Disposition::Retry { after },
            };
        }
    }
    Disposition::Retry { after: None }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("something odd")]
    struct Unknown;

    // Paused, so that the open breaker's wait is read back exactly.
    #[tokio::test(start_paused = true)]
    async fn classification_follows_the_cause_chain() {
        let d = |e: HandlerError| e.disposition();
        assert_eq!(
            d(HandlerError::from(Unknown)),
            Disposition::Retry { after: None }
        );
        assert_eq!(
            d(Classified::permanent(Unknown).into()),
            Disposition::Permanent
        );
        assert_eq!(
            d(StoreError::Conflict("x".into()).into()),
            Disposition::Permanent
        );
        assert_eq!(
            d(StoreError::Unavailable(Box::new(Unknown)).into()),
            Disposition::Retry { after: None }
        );
        let open = Rejected::circuit_open("payments", Duration::from_secs(3));
        assert_eq!(
            d(open.into()),
            Disposition::Retry {
                after: Some(Duration::from_secs(3))
            }
        );
        let bad: HandlerError = EnvelopeError::Malformed("x".into()).into();
        assert!(bad.is_malformed());
        assert_eq!(bad.disposition(), Disposition::Permanent);
        assert_eq!(
            d(HandlerError::permanent("no such customer")),
            Disposition::Permanent
        );
    }
}
