//! Unit tests of the pieces without a server: cursors, origins, the byte
//! queue, the notifier's table.

use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::notifier::{LocalNotifier, Notifier};
use super::options::{RealtimeOptions, normalise_origin};
use super::queue::{Pop, Push, SendQueue};
use super::reject::{RealtimeRejection, parse_cursor};
use super::{InvalidRealtimeOptions, StreamId};

fn stream(id: &str) -> StreamId {
    StreamId::new(id).expect("valid stream id")
}

#[test]
fn cursors_are_bounded_non_negative_numbers() {
    assert_eq!(parse_cursor("after", "0"), Ok(0));
    assert_eq!(parse_cursor("after", "42"), Ok(42));
    assert_eq!(parse_cursor("after", "9223372036854775807"), Ok(i64::MAX));
    for bad in [
        "",
        "-1",
        "+1",
        "1.5",
        "abc",
        " 1",
        "9223372036854775808",
        "000000000000000000001",
    ] {
        let err = parse_cursor("after", bad).expect_err(bad);
        assert!(
            matches!(err, RealtimeRejection::InvalidCursor { .. }),
            "{bad}"
        );
        assert_eq!(err.status(), 400);
    }
    let long = "9".repeat(10_000);
    let RealtimeRejection::InvalidCursor { shown, .. } =
        parse_cursor("after", &long).expect_err("long")
    else {
        unreachable!()
    };
    assert!(shown.len() < 30, "the echo is truncated");
}

#[test]
fn stream_ids_are_checked() {
    assert!(StreamId::new("user:42").is_ok());
    assert!(StreamId::new("").is_err());
    assert!(StreamId::new("a\nb").is_err());
    assert!(StreamId::new("x".repeat(256)).is_err());
    assert!(StreamId::new("x".repeat(255)).is_ok());
}

#[test]
fn origins_are_normalised_and_checked() {
    assert_eq!(
        normalise_origin("https://Shop.Example").as_deref(),
        Some("https://shop.example")
    );
    assert_eq!(
        normalise_origin("http://localhost:3000/").as_deref(),
        Some("http://localhost:3000")
    );
    for bad in [
        "shop.example",
        "https://shop.example/path",
        "https://u@shop.example",
        "null",
        "",
    ] {
        assert_eq!(normalise_origin(bad), None, "{bad}");
    }
    let err = RealtimeOptions::new()
        .allowed_origins(["https://shop.example/app"])
        .validate()
        .expect_err("a path is not an origin");
    assert!(matches!(err, InvalidRealtimeOptions::Origin(_)));
}

#[test]
fn options_refuse_zero_and_inverted_ranges() {
    let zero = RealtimeOptions::new()
        .poll_timeout(Duration::ZERO)
        .validate();
    assert_eq!(
        zero.err(),
        Some(InvalidRealtimeOptions::Zero("poll_timeout"))
    );
    let buffer = RealtimeOptions::new().max_buffered(0).validate();
    assert_eq!(
        buffer.err(),
        Some(InvalidRealtimeOptions::Zero("max_buffered"))
    );
    let retry = RealtimeOptions::new()
        .retry(Duration::from_secs(9), Duration::from_secs(2))
        .validate();
    assert!(matches!(
        retry,
        Err(InvalidRealtimeOptions::RetryRange { .. })
    ));
    let protocol = RealtimeOptions::new().subprotocol("a b").validate();
    assert!(matches!(
        protocol,
        Err(InvalidRealtimeOptions::Subprotocol(_))
    ));
}

fn poll<T>(receiver: &mut super::queue::Receiver<T>) -> Poll<Pop<T>> {
    receiver.poll_pop(&mut Context::from_waker(Waker::noop()))
}

#[test]
fn queue_is_bounded_in_bytes_but_takes_one_oversized_item() {
    let (queue, mut receiver) = SendQueue::new(10);
    assert_eq!(queue.try_push("huge", 50), Push::Queued, "alone, it fits");
    assert_eq!(queue.try_push("x", 1), Push::Full);
    assert_eq!(poll(&mut receiver), Poll::Ready(Pop::Item("huge")));
    assert_eq!(queue.try_push("a", 6), Push::Queued);
    assert_eq!(queue.try_push("b", 4), Push::Queued, "exactly at the limit");
    assert_eq!(queue.try_push("c", 1), Push::Full, "one byte over");
    assert_eq!(queue.buffered(), 10);
    queue.close(Some(("last", 100)));
    assert_eq!(queue.try_push("d", 1), Push::Gone, "closed");
    assert_eq!(poll(&mut receiver), Poll::Ready(Pop::Item("a")));
    assert_eq!(poll(&mut receiver), Poll::Ready(Pop::Item("b")));
    assert_eq!(poll(&mut receiver), Poll::Ready(Pop::Item("last")));
    assert_eq!(poll(&mut receiver), Poll::Ready(Pop::End));
}

#[test]
fn abort_drops_what_is_queued() {
    let (queue, mut receiver) = SendQueue::new(100);
    assert_eq!(queue.try_push(1, 10), Push::Queued);
    assert_eq!(queue.try_push(2, 10), Push::Queued);
    queue.abort(Some((9, 1)));
    assert_eq!(poll(&mut receiver), Poll::Ready(Pop::Item(9)));
    assert_eq!(poll(&mut receiver), Poll::Ready(Pop::Aborted));
    assert!(
        poll(&mut SendQueue::<u8>::new(1).1).is_pending(),
        "open and empty"
    );
}

#[tokio::test]
async fn dropping_the_receiver_tells_the_producer() {
    let (queue, receiver) = SendQueue::new(4);
    assert_eq!(queue.try_push(1, 4), Push::Queued);
    assert!(!queue.is_gone());
    drop(receiver);
    tokio::time::timeout(Duration::from_secs(1), queue.gone())
        .await
        .expect("gone resolves");
    queue.room().await; // resolves too: nobody will ever take anything
    assert_eq!(queue.try_push(2, 1), Push::Gone);
    assert_eq!(queue.buffered(), 0, "the memory is released at once");
}

#[tokio::test]
async fn notifier_keeps_only_streams_with_subscribers() {
    let notifier = LocalNotifier::new();
    let alice = stream("user:alice");
    notifier.notify(&alice, 1); // nobody listens: dropped, nothing stored
    assert_eq!(notifier.streams(), 0);

    let mut first = notifier.subscribe(&alice);
    let second = notifier.subscribe(&alice);
    let _bob = notifier.subscribe(&stream("user:bob"));
    assert_eq!(notifier.streams(), 2);

    notifier.notify(&alice, 7);
    notifier.notify(&alice, 5); // out of order: the maximum stays
    assert_eq!(first.wait_beyond(0).await, 7);
    assert_eq!(first.wait_beyond(6).await, 7, "already announced: at once");
    let pending = tokio::time::timeout(Duration::from_millis(20), first.wait_beyond(7)).await;
    assert!(pending.is_err(), "nothing beyond 7 yet");

    drop(first);
    assert_eq!(notifier.streams(), 2, "alice still has a subscriber");
    drop(second);
    assert_eq!(
        notifier.streams(),
        1,
        "alice's entry is gone with her last subscriber"
    );

    let mut again = notifier.subscribe(&alice);
    assert_eq!(again.latest(), 0, "a fresh entry");
    notifier.notify(&alice, 8);
    assert_eq!(again.wait_beyond(7).await, 8);
}

mod log {
    use std::num::{NonZeroU64, NonZeroUsize};
    use std::time::Duration;

    use keel_sqlite::SqliteStore;
    use keel_store::Store;
    use serde_json::json;
    use tokio::sync::watch;

    use super::stream;
    use crate::{AppendError, EventLog, Retention};

    async fn log() -> (EventLog<SqliteStore>, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(dir.path().join("keel.db"))
            .await
            .expect("open store");
        (EventLog::new(store), dir)
    }

    #[tokio::test]
    async fn event_types_that_would_break_sse_framing_are_refused() {
        let (log, _dir) = log().await;
        let alice = stream("user:alice");
        let long = "t".repeat(129);
        for bad in ["", "a\nb", "a\rb", long.as_str()] {
            let err = log.publish(&alice, bad, &json!(1)).await.expect_err(bad);
            assert!(matches!(err, AppendError::InvalidEventType(_)), "{bad:?}");
        }
        assert_eq!(
            log.publish(&alice, "order.placed", &json!(1))
                .await
                .expect("ok"),
            1
        );
    }

    #[tokio::test]
    async fn only_committed_events_wake_subscribers() {
        let (log, _dir) = log().await;
        let alice = stream("user:alice");
        let mut subscription = log.subscribe(&alice);

        let mut tx = log.store().begin().await.expect("begin");
        let appended = log
            .append(&mut tx, &alice, "note", &json!(1))
            .await
            .expect("append");
        assert_eq!(appended.seq(), 1);
        log.store().rollback(tx).await.expect("rollback");
        let woken =
            tokio::time::timeout(Duration::from_millis(50), subscription.wait_beyond(0)).await;
        assert!(woken.is_err(), "a rolled-back event wakes nobody");

        let mut tx = log.store().begin().await.expect("begin");
        let appended = log
            .append(&mut tx, &alice, "note", &json!(2))
            .await
            .expect("append");
        log.commit(tx, [appended]).await.expect("commit");
        assert_eq!(
            subscription.wait_beyond(0).await,
            1,
            "the seq is reused: no hole"
        );
        assert_eq!(log.last_seq(&alice).await.expect("last"), 1);
    }

    #[tokio::test]
    async fn the_retention_task_trims_in_batches_until_drained() {
        let (log, _dir) = log().await;
        let alice = stream("user:alice");
        for n in 1..=7 {
            log.publish(&alice, "note", &json!(n))
                .await
                .expect("publish");
        }
        let retention = Retention::new()
            .max_age(None)
            .keep_last(NonZeroU64::new(2))
            .batch(NonZeroUsize::new(2).expect("non-zero"))
            .interval(Duration::from_millis(20));
        let (drain, drain_rx) = watch::channel(false);
        let task = tokio::spawn({
            let log = log.clone();
            async move { log.run_retention(retention, drain_rx).await }
        });
        let mut left = Vec::new();
        for _ in 0..100 {
            left = log.read_after(&alice, 0, 100).await.expect("read");
            if left.len() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(left.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![6, 7]);
        drain.send_replace(true);
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("the task ends on drain")
            .expect("task");

        // Age retention: everything is older than "now minus zero".
        let by_age = Retention::new()
            .keep_last(None)
            .max_age(Some(Duration::ZERO));
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(log.trim(&by_age).await.expect("trim"), 2);
    }
}
