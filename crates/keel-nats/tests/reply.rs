//! Request-reply over core NATS: a round trip, a typed timeout, deadline
//! propagation, and what happens without a responder or past the deadline.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{ServerLock, unique_prefix};
use keel_core::{Deadline, clock};
use keel_nats::{NatsRequester, NatsResponder, ReplyError};
use keel_store::broker::header;

struct Fixture {
    client: async_nats::Client,
    subject: String,
    _lock: ServerLock,
}

async fn fixture() -> Option<Fixture> {
    let url = keel_testkit::services::nats_url()?;
    let lock = ServerLock::shared().await;
    let client = async_nats::connect(url).await.expect("connect");
    Some(Fixture {
        client,
        subject: format!("{}.quote", unique_prefix()),
        _lock: lock,
    })
}

/// Starts a responder whose handler is `handler`, and waits until it
/// listens.
async fn respond<H, Fut>(fixture: &Fixture, handler: H)
where
    H: Fn(keel_nats::NatsRequest) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = Result<Bytes, std::io::Error>> + Send + 'static,
{
    let responder =
        NatsResponder::new(fixture.client.clone(), fixture.subject.clone()).queue_group("pricing");
    tokio::spawn(responder.run(handler, std::future::pending()));
    let requester = NatsRequester::new(fixture.client.clone());
    let deadline = clock::now() + Duration::from_secs(5);
    while let Err(ReplyError::NoResponders(_)) = requester
        .call_with(&fixture.subject, Bytes::new(), &Default::default(), None)
        .await
    {
        assert!(clock::now() < deadline, "the responder never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_gets_its_reply_with_the_correlation_id() {
    let Some(fixture) = fixture().await else {
        return;
    };
    respond(&fixture, |req| async move {
        Ok(Bytes::from(format!(
            "quote for {}",
            String::from_utf8_lossy(&req.payload)
        )))
    })
    .await;
    let reply = NatsRequester::new(fixture.client.clone())
        .call(&fixture.subject, Bytes::from("sku-1"))
        .await
        .expect("a reply");
    assert_eq!(reply.payload, Bytes::from("quote for sku-1"));
    assert!(reply.headers.contains_key(header::CORRELATION_ID));
    assert_eq!(
        reply.headers.get("reply-status").map(String::as_str),
        Some("ok")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_responder_is_a_typed_timeout() {
    let Some(fixture) = fixture().await else {
        return;
    };
    respond(&fixture, |req| async move {
        if !req.payload.is_empty() {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        Ok(Bytes::new())
    })
    .await;
    let started = clock::now();
    let outcome = NatsRequester::new(fixture.client.clone())
        .timeout(Duration::from_millis(300))
        .call(&fixture.subject, Bytes::from("slow"))
        .await;
    assert!(
        matches!(outcome, Err(ReplyError::Timeout(_))),
        "got {outcome:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited past the timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callers_deadline_reaches_the_handler() {
    let Some(fixture) = fixture().await else {
        return;
    };
    respond(&fixture, |req| async move {
        let header = req
            .headers
            .get(header::DEADLINE)
            .cloned()
            .unwrap_or_default();
        let inside = Deadline::current().map(|d| d.to_unix_millis()).unwrap_or(0);
        Ok(Bytes::from(format!("{header} {inside}")))
    })
    .await;
    let requester = NatsRequester::new(fixture.client.clone()).timeout(Duration::from_secs(10));
    let deadline = Deadline::after(Duration::from_millis(800));
    let reply = deadline
        .scope(requester.call(&fixture.subject, Bytes::from("x")))
        .await
        .expect("a reply");
    let text = String::from_utf8(reply.payload.to_vec()).expect("utf-8");
    let (sent, inside) = text.split_once(' ').expect("two numbers");
    let expected = deadline.to_unix_millis();
    let sent: u64 = sent.parse().expect("the deadline header");
    let inside: u64 = inside.parse().expect("the handler's deadline");
    assert!(
        sent.abs_diff(expected) <= 5,
        "the caller's 800 ms deadline, not the 10 s timeout, travels ({sent} vs {expected})"
    );
    assert!(inside.abs_diff(expected) <= 5, "the handler runs inside it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_responder_and_refusals_are_typed() {
    let Some(fixture) = fixture().await else {
        return;
    };
    let requester = NatsRequester::new(fixture.client.clone());
    let outcome = requester.call(&fixture.subject, Bytes::from("x")).await;
    assert!(
        matches!(outcome, Err(ReplyError::NoResponders(_))),
        "got {outcome:?}"
    );
    respond(&fixture, |req| async move {
        if req.payload.is_empty() {
            Ok(Bytes::new())
        } else {
            Err(std::io::Error::other("out of stock"))
        }
    })
    .await;
    let outcome = requester.call(&fixture.subject, Bytes::from("x")).await;
    match outcome {
        Err(ReplyError::Refused(reason)) => assert_eq!(reason, "out of stock"),
        other => panic!("got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_deadline_is_not_worked_on() {
    let Some(fixture) = fixture().await else {
        return;
    };
    let worked = Arc::new(AtomicBool::new(false));
    let flag = worked.clone();
    respond(&fixture, move |req| {
        let flag = flag.clone();
        async move {
            if !req.payload.is_empty() {
                flag.store(true, Ordering::SeqCst);
            }
            Ok(Bytes::new())
        }
    })
    .await;
    let mut headers = async_nats::HeaderMap::new();
    let past = Deadline::from_unix_millis(keel_core::clock::unix_millis() - 1_000);
    headers.insert(header::DEADLINE, past.to_header_value().as_str());
    let request = async_nats::client::Request::new()
        .payload(Bytes::from("late"))
        .headers(headers)
        .timeout(Some(Duration::from_millis(500)));
    let outcome = fixture
        .client
        .send_request(fixture.subject.clone(), request)
        .await;
    assert!(outcome.is_err(), "an expired request got a reply");
    assert!(!worked.load(Ordering::SeqCst), "the handler ran anyway");
}
