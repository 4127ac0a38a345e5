//! Behaviour of bounded queues and load shedding: never more buffered than
//! the bound, backpressure that resumes, expired work never done, and every
//! refusal counted.
#![cfg(feature = "shed")]

use keel_testkit::metrics::MetricsRecorder;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use keel_core::{BoxError, Classify, Deadline, ErrorClass, PolicyError, Rejected, clock};
use keel_policy::shed::{BoundedQueue, LoadShed, LoadShedLayer};
use proptest::prelude::*;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::advance;
use tower::{Layer, Service, ServiceExt, service_fn};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[test]
fn the_bound_comes_from_the_latency_target() {
    let seed: BoundedQueue<()> = BoundedQueue::builder("q").build().unwrap();
    assert_eq!(seed.capacity(), 64, "640 ms at 10 ms per item");
    let fast: BoundedQueue<()> = BoundedQueue::builder("q")
        .latency_target(ms(200), ms(2))
        .consumers(4)
        .build()
        .unwrap();
    assert_eq!(fast.capacity(), 400);
    let shed = LoadShed::builder("s")
        .max_in_flight(4)
        .latency_target(ms(100), ms(50))
        .build()
        .unwrap();
    assert_eq!(shed.stats().max_queued, 8);
}

#[tokio::test(start_paused = true)]
async fn a_blocked_put_resumes_when_space_frees() {
    let queue: BoundedQueue<u32> = BoundedQueue::builder("q").capacity(2).build().unwrap();
    queue.put(1).await.unwrap();
    queue.put(2).await.unwrap();
    let producer = {
        let queue = queue.clone();
        tokio::spawn(async move { queue.put(3).await })
    };
    settle().await;
    assert!(
        !producer.is_finished(),
        "a full queue makes the producer wait"
    );
    assert_eq!(queue.len(), 2);
    advance(ms(5_000)).await;
    assert!(
        !producer.is_finished(),
        "without a deadline it waits as long as it takes"
    );

    assert_eq!(queue.get().await, 1);
    producer.await.unwrap().unwrap();
    assert_eq!(queue.get().await, 2);
    assert_eq!(queue.get().await, 3);
    assert!(queue.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_put_waits_no_longer_than_its_deadline() {
    let queue: BoundedQueue<u32> = BoundedQueue::builder("q").capacity(1).build().unwrap();
    queue.put(1).await.unwrap();
    let started = clock::now();
    let refused = Deadline::after(ms(50))
        .scope(queue.put(2))
        .await
        .unwrap_err();
    assert_eq!(
        (refused.item, refused.rejected),
        (2, Rejected::DeadlineExceeded)
    );
    assert_eq!(clock::now() - started, ms(50));
    assert_eq!(queue.stats().expired, 1);
    assert_eq!(queue.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn expired_items_never_reach_the_consumer() {
    let queue: BoundedQueue<&str> = BoundedQueue::builder("q").capacity(8).build().unwrap();
    queue
        .put_until("stale", Some(Deadline::after(ms(10))))
        .await
        .unwrap();
    Deadline::after(ms(30))
        .scope(queue.put("also stale"))
        .await
        .unwrap();
    queue
        .put_until("fresh", Some(Deadline::after(ms(100))))
        .await
        .unwrap();
    queue.put("no deadline").await.unwrap();
    advance(ms(50)).await;

    assert_eq!(queue.get().await, "fresh");
    assert_eq!(queue.get().await, "no deadline");
    assert!(queue.try_get().is_none());
    let stats = queue.stats();
    assert_eq!((stats.expired, stats.len), (2, 0));
    // Dropping expired items freed their places.
    for i in 0..8 {
        queue
            .try_put_until("more", None)
            .unwrap_or_else(|_| panic!("place {i} is free"));
    }
}

#[tokio::test(start_paused = true)]
async fn the_shed_count_matches_the_refusals() {
    let queue: BoundedQueue<u32> = BoundedQueue::builder("q").capacity(4).build().unwrap();
    let mut refused = 0;
    for i in 0..10 {
        if let Err(refusal) = queue.try_put(i) {
            assert_eq!(refusal.item, i);
            assert_eq!(refusal.rejected.retry_after(), Some(Duration::from_secs(1)));
            assert!(matches!(refusal.rejected, Rejected::Overloaded { .. }));
            refused += 1;
        }
    }
    assert_eq!(refused, 6);
    assert_eq!(queue.stats().shed, 6);
    assert_eq!(queue.len(), 4);
}

#[tokio::test(start_paused = true)]
async fn every_item_reaches_exactly_one_of_several_consumers() {
    let queue: BoundedQueue<u32> = BoundedQueue::builder("q").capacity(4).build().unwrap();
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let consumers: Vec<JoinHandle<()>> = (0..3)
        .map(|_| {
            let (queue, seen) = (queue.clone(), Arc::clone(&seen));
            tokio::spawn(async move {
                loop {
                    let item = queue.get().await;
                    tokio::time::sleep(ms(u64::from(item % 3))).await;
                    seen.lock().push(item);
                }
            })
        })
        .collect();
    for i in 0..100 {
        queue.put(i).await.unwrap();
        assert!(queue.len() <= 4);
    }
    tokio::time::sleep(ms(100)).await;
    let mut seen = seen.lock().clone();
    seen.sort_unstable();
    assert_eq!(seen, (0..100).collect::<Vec<_>>());
    consumers.iter().for_each(JoinHandle::abort);
}

#[derive(Debug, Clone)]
enum Op {
    TryPut,
    PutNow,
    Get,
}

proptest! {
    #[test]
    fn never_more_than_the_capacity_is_buffered(
        capacity in 1usize..8,
        ops in proptest::collection::vec(prop_oneof![Just(Op::TryPut), Just(Op::PutNow), Just(Op::Get)], 0..200),
    ) {
        let queue: BoundedQueue<usize> = BoundedQueue::builder("q").capacity(capacity).build().unwrap();
        let (mut accepted, mut taken, mut shed) = (0usize, 0usize, 0u64);
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::TryPut => match queue.try_put(i) {
                    Ok(()) => accepted += 1,
                    Err(_) => shed += 1,
                },
                // A put that would block is abandoned; it must leave no trace.
                Op::PutNow => if let Some(Ok(())) = queue.put_until(i, None).now_or_never() {
                    accepted += 1;
                },
                Op::Get => if queue.try_get().is_some() {
                    taken += 1;
                },
            }
            prop_assert!(queue.len() <= capacity);
            prop_assert_eq!(queue.len(), accepted - taken);
            prop_assert_eq!(queue.stats().shed, shed);
        }
    }
}

type Outcome = Result<u32, PolicyError<std::io::Error>>;

fn hold(shed: &LoadShed, reached: &Arc<AtomicUsize>) -> (JoinHandle<Outcome>, oneshot::Sender<()>) {
    let (release, released) = oneshot::channel::<()>();
    let (shed, reached) = (shed.clone(), Arc::clone(reached));
    let task = tokio::spawn(async move {
        shed.call(|| async move {
            reached.fetch_add(1, Ordering::SeqCst);
            let _ = released.await;
            Ok(1)
        })
        .await
    });
    (task, release)
}

#[tokio::test(start_paused = true)]
async fn load_shed_queues_then_sheds_at_once_with_retry_after() {
    let shed = LoadShed::builder("api")
        .max_in_flight(2)
        .max_queued(1)
        .build()
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let (a, ra) = hold(&shed, &reached);
    let (_b, _rb) = hold(&shed, &reached);
    settle().await;
    let (queued, _rq) = hold(&shed, &reached);
    settle().await;
    assert_eq!((shed.stats().in_flight, shed.stats().queued), (2, 1));

    let started = clock::now();
    let refused: Outcome = shed.call(|| async { Ok(9) }).await;
    let Err(PolicyError::Rejected(rejected)) = refused else {
        panic!("expected a refusal")
    };
    assert!(matches!(rejected, Rejected::Overloaded { .. }));
    assert_eq!(rejected.retry_after(), Some(Duration::from_secs(1)));
    assert_eq!(clock::now(), started, "shed at once");
    assert_eq!(reached.load(Ordering::SeqCst), 2);

    ra.send(()).unwrap();
    a.await.unwrap().unwrap();
    settle().await;
    assert_eq!(
        reached.load(Ordering::SeqCst),
        3,
        "the queued call got the freed slot"
    );
    assert!(!queued.is_finished());
    assert_eq!(shed.stats().shed, 1);
}

#[tokio::test(start_paused = true)]
async fn a_queued_call_whose_deadline_passes_is_dropped_and_counted() {
    let shed = LoadShed::builder("api")
        .max_in_flight(1)
        .latency_target(ms(500), ms(10))
        .build()
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let (_a, _ra) = hold(&shed, &reached);
    settle().await;
    let started = clock::now();
    let outcome: Outcome = Deadline::after(ms(80))
        .scope(shed.call(|| async { Ok(2) }))
        .await;
    assert!(matches!(
        outcome,
        Err(PolicyError::Rejected(Rejected::DeadlineExceeded))
    ));
    assert_eq!(clock::now() - started, ms(80));
    assert_eq!(
        reached.load(Ordering::SeqCst),
        1,
        "the expired call never ran"
    );
    let stats = shed.stats();
    assert_eq!((stats.expired, stats.shed, stats.queued), (1, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_queued_call_waits_no_longer_than_the_latency_target() {
    let shed = LoadShed::builder("api")
        .max_in_flight(1)
        .latency_target(ms(100), ms(10))
        .build()
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let (_a, _ra) = hold(&shed, &reached);
    settle().await;
    let started = clock::now();
    let outcome: Outcome = shed.call(|| async { Ok(2) }).await;
    assert!(matches!(
        outcome,
        Err(PolicyError::Rejected(Rejected::Overloaded { .. }))
    ));
    assert_eq!(clock::now() - started, ms(100));
    assert_eq!(shed.stats().shed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_contention_in_flight_stays_capped_and_every_call_is_accounted_for() {
    let shed = LoadShed::builder("api")
        .max_in_flight(4)
        .max_queued(50)
        .latency_target(Duration::from_secs(60), ms(10))
        .build()
        .unwrap();
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let calls: Vec<_> = (0..400)
        .map(|_| {
            let (shed, running, peak) = (shed.clone(), Arc::clone(&running), Arc::clone(&peak));
            tokio::spawn(async move {
                shed.call(|| async move {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(())
                })
                .await
            })
        })
        .collect();
    let mut admitted = 0;
    for call in calls {
        match call.await.unwrap() {
            Ok(()) => admitted += 1,
            Err(err) => assert!(matches!(
                err,
                PolicyError::Rejected(Rejected::Overloaded { .. })
            )),
        }
    }
    assert!(peak.load(Ordering::SeqCst) <= 4);
    let stats = shed.stats();
    assert_eq!(
        admitted + stats.shed,
        400,
        "every call ran or was counted as shed"
    );
    assert_eq!((stats.in_flight, stats.queued), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn the_tower_service_sheds_with_a_classified_refusal() {
    let shed = LoadShed::builder("api")
        .max_in_flight(1)
        .max_queued(0)
        .build()
        .unwrap();
    let (mock, mut handle) = tower_test::mock::pair::<u32, u32>();
    let mut first = LoadShedLayer::new(shed.clone()).layer(mock.clone());
    let mut second = LoadShedLayer::new(shed.clone()).layer(mock);
    let response = first.ready().await.unwrap().call(1);
    let err: BoxError = second.ready().await.unwrap().call(2).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::Rejected);
    assert_eq!(err.retry_after(), Some(Duration::from_secs(1)));
    let (request, send) = handle.next_request().await.unwrap();
    assert_eq!(request, 1);
    send.send_response(10);
    assert_eq!(response.await.unwrap(), 10);
    assert_eq!(shed.stats().in_flight, 0);
    let third = second.ready().await.unwrap().call(3);
    assert!(third.now_or_never().is_none(), "admitted again");
}

#[tokio::test(start_paused = true)]
async fn shed_and_expired_work_is_counted_in_metrics() {
    let recorded = MetricsRecorder::new();
    let queue: BoundedQueue<u32> = metrics::with_local_recorder(&recorded, || {
        BoundedQueue::builder("q").capacity(2).build().unwrap()
    });
    for i in 0..5 {
        let _ = queue.try_put_until(i, Some(Deadline::after(ms(10))));
    }
    advance(ms(20)).await;
    assert!(queue.try_get().is_none(), "both queued items expired");
    assert_eq!(recorded.counter("keel_shed_total,name=q"), 3);
    assert_eq!(recorded.counter("keel_shed_expired_total,name=q"), 2);

    let shed = metrics::with_local_recorder(&recorded, || {
        LoadShed::builder("api")
            .max_in_flight(1)
            .max_queued(0)
            .build()
            .unwrap()
    });
    let mut held = Box::pin(shed.call(std::future::pending::<Result<(), std::io::Error>>));
    assert!((&mut held).now_or_never().is_none());
    assert!(
        shed.call(|| async { Ok::<_, std::io::Error>(()) })
            .await
            .is_err()
    );
    assert_eq!(
        recorded.counter("keel_shed_total,name=api"),
        1,
        "the load shed refusal is counted too, under its own name"
    );
}
#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations_in;

#[test]
fn the_happy_path_does_not_allocate() {
    let shed = LoadShed::builder("api").build().unwrap();
    let queue: BoundedQueue<u32> = BoundedQueue::builder("q").build().unwrap();
    let mut service = LoadShedLayer::new(shed.clone()).layer(service_fn(|x: u32| async move {
        Ok::<_, std::io::Error>(x)
    }));
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let n = allocations_in(|| {
        for i in 0..100 {
            let out = shed
                .call(|| async { Ok::<_, std::io::Error>(1) })
                .now_or_never();
            assert!(matches!(out, Some(Ok(1))));
            assert!(service.poll_ready(&mut cx).is_ready());
            assert!(matches!(service.call(1).now_or_never(), Some(Ok(1))));
            queue.try_put(i).unwrap();
            assert_eq!(queue.get().now_or_never(), Some(i));
        }
    });
    assert_eq!(n, 0);
}
