use std::sync::atomic::AtomicU32;

use tokio::sync::mpsc;

use super::cache::{ReplyCache, StoredReply};
use super::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use keel_core::{BoxError, Classify, ErrorClass};
use keel_policy::retry::Backoff;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::broker::{
    Broker, BrokerError, Delivery, Message, SubscribeOptions, Subscription, header,
};

use crate::broker::DeliveryControl;

/// One consumer per topic, redelivery on nack, and a log of publishes
/// and acks so tests can check their order.
#[derive(Default)]
struct MemoryBroker {
    topics: Mutex<HashMap<String, Queue>>,
    log: Arc<Mutex<Vec<String>>>,
}

type Item = (Message, u32);

struct Queue {
    tx: mpsc::UnboundedSender<Item>,
    rx: Option<mpsc::UnboundedReceiver<Item>>,
}

impl MemoryBroker {
    fn sender(&self, topic: &str) -> mpsc::UnboundedSender<Item> {
        let mut topics = self.topics.lock();
        topics
            .entry(topic.to_owned())
            .or_insert_with(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                Queue { tx, rx: Some(rx) }
            })
            .tx
            .clone()
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().clone()
    }
}

#[async_trait]
impl Broker for MemoryBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        for m in messages {
            self.log.lock().push(format!("publish {}", m.topic));
            let _ = self.sender(&m.topic).send((m.clone(), 1));
        }
        Ok(())
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        let tx = self.sender(&options.topic);
        let rx = self
            .topics
            .lock()
            .get_mut(&options.topic)
            .and_then(|q| q.rx.take())
            .ok_or_else(|| BrokerError::Invalid("one subscriber per topic".into()))?;
        Ok(Box::new(MemorySubscription {
            tx,
            rx,
            log: self.log.clone(),
        }))
    }
}

struct MemorySubscription {
    tx: mpsc::UnboundedSender<Item>,
    rx: mpsc::UnboundedReceiver<Item>,
    log: Arc<Mutex<Vec<String>>>,
}

#[async_trait]
impl Subscription for MemorySubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        let mut out = Vec::new();
        if let Ok(Some(first)) = tokio::time::timeout(wait, self.rx.recv()).await {
            out.push(first);
            while out.len() < max {
                match self.rx.try_recv() {
                    Ok(item) => out.push(item),
                    Err(_) => break,
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|(message, count)| {
                let control = MemoryControl {
                    tx: self.tx.clone(),
                    item: (message.clone(), count),
                    log: self.log.clone(),
                };
                Delivery::new(message, count, Box::new(control))
            })
            .collect())
    }
}

struct MemoryControl {
    tx: mpsc::UnboundedSender<Item>,
    item: Item,
    log: Arc<Mutex<Vec<String>>>,
}

#[async_trait]
impl DeliveryControl for MemoryControl {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.log.lock().push(format!("ack {}", self.item.0.topic));
        Ok(())
    }
    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.log.lock().push(format!("nack {}", self.item.0.topic));
        let tx = self.tx.clone();
        let (message, count) = self.item.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tx.send((message, count + 1));
        });
        Ok(())
    }
    async fn extend(&self, _lease: Duration) -> Result<(), BrokerError> {
        Ok(())
    }
    async fn terminate(&self) -> Result<(), BrokerError> {
        self.log
            .lock()
            .push(format!("terminate {}", self.item.0.topic));
        Ok(())
    }
}

async fn requester(broker: &Arc<MemoryBroker>) -> Requester {
    let listener = Requester::builder(broker.clone())
        .reply_topic("_reply.test")
        .build()
        .await
        .unwrap();
    let requester = listener.requester();
    tokio::spawn(listener.run(std::future::pending()));
    requester
}

fn responder<H: RequestHandler>(broker: &Arc<MemoryBroker>, handler: H) -> Responder<H> {
    let responder = Responder::builder(broker.clone(), SubscribeOptions::new("quote", "pricing"))
        .backoff(
            Backoff::exponential(Duration::from_millis(10), 2.0, Duration::from_millis(100))
                .unwrap(),
        )
        .build(handler);
    tokio::spawn(responder.clone().run(std::future::pending()));
    responder
}

fn counting(calls: Arc<AtomicU32>) -> impl RequestHandler {
    move |req: IncomingRequest| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            Ok::<_, BoxError>(Bytes::from(format!(
                "{}#{n}",
                String::from_utf8_lossy(req.payload())
            )))
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_reply_reaches_its_caller_and_the_request_is_acked_after_it() {
    let broker = Arc::new(MemoryBroker::default());
    let calls = Arc::new(AtomicU32::new(0));
    responder(&broker, counting(calls.clone()));
    let requester = requester(&broker).await;
    let reply = requester
        .call(Request::new("quote", "sku-1"))
        .await
        .unwrap();
    assert_eq!(reply.payload, Bytes::from("sku-1#1"));
    assert_eq!(requester.pending(), 0);
    let log = broker.log();
    let published = log.iter().position(|l| l == "publish _reply.test").unwrap();
    let acked = log.iter().position(|l| l == "ack quote").unwrap();
    assert!(
        published < acked,
        "reply published before the request is acked: {log:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_repeated_request_gets_the_first_reply_without_redoing_work() {
    let broker = Arc::new(MemoryBroker::default());
    let calls = Arc::new(AtomicU32::new(0));
    responder(&broker, counting(calls.clone()));
    let requester = requester(&broker).await;
    let first = requester
        .call(Request::new("quote", "sku-1").request_id("req-7"))
        .await
        .unwrap();
    let again = requester
        .call(Request::new("quote", "sku-1").request_id("req-7"))
        .await
        .unwrap();
    assert_eq!(first.payload, again.payload);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
}

#[tokio::test(start_paused = true)]
async fn timeouts_and_cancellations_leave_no_pending_entry_and_late_replies_are_discarded() {
    let broker = Arc::new(MemoryBroker::default());
    let requester = requester(&broker).await;
    // Nobody answers: the call times out.
    let err = requester
        .call(Request::new("quote", "x").timeout(Duration::from_millis(300)))
        .await
        .unwrap_err();
    assert!(matches!(err, RequestError::Timeout { .. }), "{err}");
    assert_eq!(err.class(), ErrorClass::OutcomeUnknown);
    assert_eq!(requester.pending(), 0, "timed-out entry removed");

    // A caller that gives up (drops the future) removes its entry too.
    let call = requester.call(Request::new("quote", "y").timeout(Duration::from_secs(60)));
    assert!(
        tokio::time::timeout(Duration::from_millis(50), call)
            .await
            .is_err()
    );
    assert_eq!(requester.pending(), 0, "cancelled entry removed");

    // The responder finally answers both: late replies, discarded.
    let mut requests = broker
        .subscribe(SubscribeOptions::new("quote", "late"))
        .await
        .unwrap();
    let late = requests
        .receive(10, Duration::from_millis(10))
        .await
        .unwrap();
    assert_eq!(late.len(), 2);
    for d in late {
        let corr = d.message.header(header::CORRELATION_ID).unwrap().to_owned();
        let reply = Message::new(format!("r-{corr}"), "_reply.test", corr.clone(), "late")
            .with_header(header::CORRELATION_ID, corr);
        broker.publish(&[reply]).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(requester.pending(), 0);
}

#[tokio::test(start_paused = true)]
async fn expired_requests_are_dropped_without_running_the_handler() {
    let broker = Arc::new(MemoryBroker::default());
    let calls = Arc::new(AtomicU32::new(0));
    let responder = Responder::builder(broker.clone(), SubscribeOptions::new("quote", "p"))
        .build(counting(calls.clone()));
    let past = keel_core::clock::unix_millis() - 1_000;
    let request = Message::new("m-1", "quote", "k", "x")
        .with_header(header::REPLY_TO, "_reply.x")
        .with_header(header::CORRELATION_ID, "c-1")
        .with_header(header::DEADLINE, past.to_string());
    broker.publish(&[request]).await.unwrap();
    let mut sub = broker
        .subscribe(SubscribeOptions::new("quote", "p"))
        .await
        .unwrap();
    let d = sub
        .receive(1, Duration::from_millis(10))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(responder.handle(&d).await.unwrap(), Handled::Expired);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(broker.log().contains(&"ack quote".to_owned()));
}

#[tokio::test(start_paused = true)]
async fn malformed_requests_are_rejected_not_redelivered() {
    let broker = Arc::new(MemoryBroker::default());
    let responder = Responder::builder(broker.clone(), SubscribeOptions::new("quote", "p"))
        .build(counting(Arc::new(AtomicU32::new(0))));
    broker
        .publish(&[Message::new("m-1", "quote", "k", "x")])
        .await
        .unwrap();
    let mut sub = broker
        .subscribe(SubscribeOptions::new("quote", "p"))
        .await
        .unwrap();
    let d = sub
        .receive(1, Duration::from_millis(10))
        .await
        .unwrap()
        .remove(0);
    let handled = responder.handle(&d).await.unwrap();
    assert!(
        matches!(handled, Handled::Rejected(ref r) if r.contains("reply-to")),
        "{handled:?}"
    );
    assert!(broker.log().contains(&"terminate quote".to_owned()));
}

#[tokio::test(start_paused = true)]
async fn transient_failures_are_retried_and_permanent_ones_refused() {
    let broker = Arc::new(MemoryBroker::default());
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    responder(&broker, move |req: IncomingRequest| {
        let c = c.clone();
        async move {
            let n = c.fetch_add(1, Ordering::SeqCst);
            match req.payload().as_ref() {
                b"flaky" if n == 0 => Err(keel_core::Classified::retryable("busy").into()),
                b"bad" => Err::<Bytes, BoxError>("no such sku".into()),
                _ => Ok(Bytes::from_static(b"ok")),
            }
        }
    });
    let requester = requester(&broker).await;
    let reply = requester
        .call(Request::new("quote", "flaky"))
        .await
        .unwrap();
    assert_eq!(reply.payload, Bytes::from_static(b"ok"));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let err = requester
        .call(Request::new("quote", "bad"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, RequestError::Refused { ref reason, .. } if reason.contains("no such sku")),
        "{err}"
    );
    assert_eq!(requester.pending(), 0);
}

#[tokio::test(start_paused = true)]
async fn calls_fail_fast_once_the_listener_is_gone() {
    let broker = Arc::new(MemoryBroker::default());
    let listener = Requester::builder(broker.clone()).build().await.unwrap();
    let requester = listener.requester();
    assert!(requester.reply_topic().starts_with(REPLY_TOPIC_PREFIX));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(listener.run(async move {
        let _ = stopped.await;
    }));
    let waiting = tokio::spawn({
        let requester = requester.clone();
        async move {
            requester
                .call(Request::new("quote", "x").timeout(Duration::from_secs(60)))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(requester.pending(), 1);
    stop.send(()).unwrap();
    task.await.unwrap();
    assert!(matches!(
        waiting.await.unwrap(),
        Err(RequestError::NotListening)
    ));
    assert!(matches!(
        requester.call(Request::new("quote", "x")).await,
        Err(RequestError::NotListening)
    ));
    assert_eq!(requester.pending(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_reply_cache_is_bounded_by_count_and_age() {
    let cache = ReplyCache::new(Duration::from_secs(10), 2);
    let reply = |s: &'static str| StoredReply {
        status: STATUS_OK,
        payload: Bytes::from_static(s.as_bytes()),
    };
    cache.insert("a", reply("1"));
    cache.insert("b", reply("2"));
    cache.insert("c", reply("3"));
    assert_eq!(cache.len(), 2);
    assert!(cache.get("a").is_none(), "oldest evicted by count");
    tokio::time::advance(Duration::from_secs(11)).await;
    assert!(cache.get("c").is_none(), "evicted by age");
    assert_eq!(cache.len(), 0);
}
