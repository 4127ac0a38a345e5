//! Request-reply over the embedded SQLite broker: replies reach the waiting
//! call, nothing leaks on timeout, late replies are discarded, expired
//! requests are not worked on, and a responder that crashes between its
//! reply and its ack does not do the work twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use keel_core::BoxError;
use keel_messaging::broker::{
    Broker, BrokerError, Delivery, DeliveryControl, Message, SubscribeOptions, Subscription, header,
};
use keel_messaging::reply::{
    Handled, IncomingRequest, Request, RequestError, RequestHandler, Requester, Responder,
};
use keel_sqlite::broker::SqliteBroker;
use tempfile::TempDir;
use tokio::sync::oneshot;

const TOPIC: &str = "pricing.quote";

async fn broker(dir: &TempDir) -> Arc<SqliteBroker> {
    Arc::new(
        SqliteBroker::open(dir.path().join("broker.db"))
            .await
            .unwrap(),
    )
}

/// Answers `<payload>#<n>`, counting how often it really worked.
fn counting(calls: Arc<AtomicU32>) -> impl RequestHandler {
    move |req: IncomingRequest| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let body = format!("{}#{n}", String::from_utf8_lossy(req.payload()));
            Ok::<_, BoxError>(Bytes::from(body))
        }
    }
}

/// Starts a responder; stop it by dropping the returned sender.
fn respond<H: RequestHandler>(broker: Arc<dyn Broker>, handler: H) -> oneshot::Sender<()> {
    let (stop, stopped) = oneshot::channel::<()>();
    let responder = Responder::builder(
        broker,
        SubscribeOptions::new(TOPIC, "pricing").lease(Duration::from_millis(300)),
    )
    .build(handler);
    tokio::spawn(responder.run(async move {
        let _ = stopped.await;
    }));
    stop
}

async fn requester(broker: Arc<dyn Broker>) -> Requester {
    let listener = Requester::builder(broker).build().await.unwrap();
    let requester = listener.requester();
    tokio::spawn(listener.run(std::future::pending()));
    requester
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_each_get_their_own_reply_and_leave_nothing_pending() {
    let dir = tempfile::tempdir().unwrap();
    let broker = broker(&dir).await;
    let calls = Arc::new(AtomicU32::new(0));
    let _responder = respond(broker.clone(), counting(calls.clone()));
    let requester = requester(broker.clone()).await;

    let mut tasks = Vec::new();
    for i in 0..20 {
        let requester = requester.clone();
        tasks.push(tokio::spawn(async move {
            let reply = requester
                .call(Request::new(TOPIC, format!("sku-{i}")).timeout(Duration::from_secs(10)))
                .await
                .unwrap();
            (i, reply)
        }));
    }
    for t in tasks {
        let (i, reply) = t.await.unwrap();
        let body = String::from_utf8(reply.payload.to_vec()).unwrap();
        assert!(body.starts_with(&format!("sku-{i}#")), "{body}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 20);
    assert_eq!(requester.pending(), 0);
}

#[tokio::test]
async fn a_timed_out_call_leaks_nothing_and_its_late_reply_is_discarded() {
    let dir = tempfile::tempdir().unwrap();
    let broker = broker(&dir).await;
    let requester = requester(broker.clone()).await;

    let err = requester
        .call(Request::new(TOPIC, "sku-1").timeout(Duration::from_millis(200)))
        .await
        .unwrap_err();
    assert!(matches!(err, RequestError::Timeout { .. }), "{err}");
    assert_eq!(requester.pending(), 0, "the timed-out entry is gone");

    // A slow responder answers after all: the reply arrives late.
    let mut spy = broker
        .subscribe(SubscribeOptions::new(TOPIC, "slow-responder"))
        .await
        .unwrap();
    let request = spy
        .receive(1, Duration::from_secs(5))
        .await
        .unwrap()
        .remove(0);
    let corr = request.message.header(header::CORRELATION_ID).unwrap();
    let reply_to = request.message.header(header::REPLY_TO).unwrap();
    assert_eq!(reply_to, requester.reply_topic());
    assert!(
        request.message.header(header::DEADLINE).is_some(),
        "the deadline travels"
    );
    let late = Message::new(format!("late-{corr}"), reply_to, corr, "too late")
        .with_header(header::CORRELATION_ID, corr);
    broker.publish(&[late]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(requester.pending(), 0);

    // The requester is still healthy.
    let calls = Arc::new(AtomicU32::new(0));
    let _responder = respond(broker.clone(), counting(calls.clone()));
    let reply = requester
        .call(Request::new(TOPIC, "sku-2").timeout(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(reply.payload.starts_with(b"sku-2#"));
}

#[tokio::test]
async fn an_expired_request_is_dropped_not_worked_on() {
    let dir = tempfile::tempdir().unwrap();
    let broker = broker(&dir).await;
    let requester = requester(broker.clone()).await;
    let _ = requester
        .call(Request::new(TOPIC, "sku-1").timeout(Duration::from_millis(100)))
        .await
        .unwrap_err();
    tokio::time::sleep(Duration::from_millis(50)).await;

    let calls = Arc::new(AtomicU32::new(0));
    let responder = Responder::builder(broker.clone(), SubscribeOptions::new(TOPIC, "pricing"))
        .build(counting(calls.clone()));
    let mut sub = broker
        .subscribe(SubscribeOptions::new(TOPIC, "pricing"))
        .await
        .unwrap();
    let delivery = sub
        .receive(1, Duration::from_secs(5))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(responder.handle(&delivery).await.unwrap(), Handled::Expired);
    assert_eq!(calls.load(Ordering::SeqCst), 0, "nobody waits for it");
    assert!(
        sub.receive(1, Duration::from_millis(200))
            .await
            .unwrap()
            .is_empty(),
        "acked: not redelivered"
    );
}

#[tokio::test]
async fn a_retried_request_gets_the_first_reply_even_from_another_process() {
    let dir = tempfile::tempdir().unwrap();
    let broker = broker(&dir).await;
    let calls = Arc::new(AtomicU32::new(0));
    let _responder = respond(broker.clone(), counting(calls.clone()));
    let first_process = requester(broker.clone()).await;
    let second_process = requester(broker.clone()).await;
    assert_ne!(first_process.reply_topic(), second_process.reply_topic());

    let request = Request::new(TOPIC, "sku-9")
        .request_id("quote-A-4471")
        .timeout(Duration::from_secs(10));
    let a = first_process.call(request.clone()).await.unwrap();
    let b = second_process.call(request).await.unwrap();
    assert_eq!(a.payload, Bytes::from("sku-9#1"));
    assert_eq!(b.payload, a.payload, "the stored reply, not a second quote");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

// --- a broker whose first ack of a request fails, like a crash between the
// --- reply and the ack -----------------------------------------------------

struct AckFailsOnce {
    inner: Arc<SqliteBroker>,
    armed: Arc<AtomicBool>,
    acks: Arc<AtomicU32>,
}

#[async_trait]
impl Broker for AckFailsOnce {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        self.inner.publish(messages).await
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        let intercept = options.topic == TOPIC;
        Ok(Box::new(AckFailsOnceSubscription {
            inner: self.inner.subscribe(options).await?,
            armed: intercept.then(|| self.armed.clone()),
            acks: self.acks.clone(),
        }))
    }
}

struct AckFailsOnceSubscription {
    inner: Box<dyn Subscription>,
    armed: Option<Arc<AtomicBool>>,
    acks: Arc<AtomicU32>,
}

#[async_trait]
impl Subscription for AckFailsOnceSubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        let Some(armed) = &self.armed else {
            return self.inner.receive(max, wait).await;
        };
        let deliveries = self.inner.receive(max, wait).await?;
        Ok(deliveries
            .into_iter()
            .map(|d| {
                let (message, count) = (d.message.clone(), d.delivery_count);
                let control = FailingAck {
                    inner: d,
                    armed: armed.clone(),
                    acks: self.acks.clone(),
                };
                Delivery::new(message, count, Box::new(control))
            })
            .collect())
    }
}

struct FailingAck {
    inner: Delivery,
    armed: Arc<AtomicBool>,
    acks: Arc<AtomicU32>,
}

#[async_trait]
impl DeliveryControl for FailingAck {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.acks.fetch_add(1, Ordering::SeqCst);
        if self.armed.swap(false, Ordering::SeqCst) {
            return Err(BrokerError::Unavailable(
                "the process died before the ack".into(),
            ));
        }
        self.inner.ack().await
    }
    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.inner.nack(delay).await
    }
    async fn extend(&self, lease: Duration) -> Result<(), BrokerError> {
        self.inner.extend_lease(lease).await
    }
    async fn terminate(&self) -> Result<(), BrokerError> {
        self.inner.terminate().await
    }
}

#[tokio::test]
async fn a_crash_between_reply_and_ack_redelivers_and_resends_without_redoing_work() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = broker(&dir).await;
    let acks = Arc::new(AtomicU32::new(0));
    let broker: Arc<dyn Broker> = Arc::new(AckFailsOnce {
        inner: sqlite,
        armed: Arc::new(AtomicBool::new(true)),
        acks: acks.clone(),
    });
    let calls = Arc::new(AtomicU32::new(0));
    let _responder = respond(broker.clone(), counting(calls.clone()));
    let requester = requester(broker.clone()).await;

    // Rule 2: the reply was published before the (failed) ack, so the
    // caller has its answer despite the crash.
    let reply = requester
        .call(Request::new(TOPIC, "sku-1").timeout(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(reply.payload, Bytes::from("sku-1#1"));

    // The unacked request comes back after its lease; rule 3: answered from
    // the stored reply, not worked on again.
    for _ in 0..100 {
        if acks.load(Ordering::SeqCst) >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        acks.load(Ordering::SeqCst),
        2,
        "redelivered once, then acked"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the work happened once");
    assert_eq!(requester.pending(), 0);
}

#[tokio::test]
async fn a_request_without_a_return_address_is_dead_lettered_with_the_reason() {
    use keel_messaging::store::{DeadLetterFilter, DeadLetterStore};
    let dir = tempfile::tempdir().unwrap();
    let broker = broker(&dir).await;
    let store = keel_sqlite::store::SqliteStore::open(dir.path().join("app.db"))
        .await
        .unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let responder = Responder::builder(broker.clone(), SubscribeOptions::new(TOPIC, "pricing"))
        .dead_letters(store.clone())
        .build(counting(calls.clone()));
    broker
        .publish(&[Message::new("m-1", TOPIC, "k", "no reply-to")])
        .await
        .unwrap();
    let mut sub = broker
        .subscribe(SubscribeOptions::new(TOPIC, "pricing"))
        .await
        .unwrap();
    let delivery = sub
        .receive(1, Duration::from_secs(5))
        .await
        .unwrap()
        .remove(0);
    let handled = responder.handle(&delivery).await.unwrap();
    assert!(
        matches!(handled, Handled::Rejected(ref r) if r.contains("reply-to")),
        "{handled:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    let letters = store
        .dead_letter_list(&DeadLetterFilter::default())
        .await
        .unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].error_kind, "malformed");
    assert_eq!(letters[0].message.id, "m-1");
    assert!(letters[0].attempts[0].error.contains("reply-to"));
    assert!(
        sub.receive(1, Duration::from_millis(200))
            .await
            .unwrap()
            .is_empty(),
        "terminated: never redelivered"
    );
}
