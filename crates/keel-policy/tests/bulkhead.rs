//! Behaviour of the bulkhead: the cap on concurrent calls, the bounded wait
//! queue, per-tenant isolation in bounded memory, and honest counts.
#![cfg(feature = "bulkhead")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use keel_core::{BoxError, Deadline, PolicyError, Rejected};
use keel_policy::bulkhead::{
    Bulkhead, BulkheadLayer, BulkheadStats, KeyedBulkhead, KeyedBulkheadLayer,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::advance;
use tower::{Layer, Service, ServiceExt, service_fn};

type Outcome = Result<u32, PolicyError<std::io::Error>>;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Lets spawned tasks run until they block.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

/// Starts a call that holds its slot until the sender fires; counts it as a
/// call that reached the dependency.
fn hold(
    bulkhead: &Bulkhead,
    reached: &Arc<AtomicUsize>,
) -> (JoinHandle<Outcome>, oneshot::Sender<()>) {
    let (release, released) = oneshot::channel::<()>();
    let bulkhead = bulkhead.clone();
    let reached = Arc::clone(reached);
    let task = tokio::spawn(async move {
        bulkhead
            .call(|| async move {
                reached.fetch_add(1, Ordering::SeqCst);
                let _ = released.await;
                Ok(1)
            })
            .await
    });
    (task, release)
}

fn is_full(outcome: &Outcome) -> bool {
    matches!(
        outcome,
        Err(PolicyError::Rejected(Rejected::BulkheadFull { .. }))
    )
}

#[tokio::test(start_paused = true)]
async fn the_call_beyond_the_limit_is_refused_while_the_limit_is_busy() {
    let bulkhead = Bulkhead::builder("db").max_concurrent(3).build().unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let held: Vec<_> = (0..3).map(|_| hold(&bulkhead, &reached)).collect();
    settle().await;
    assert_eq!(reached.load(Ordering::SeqCst), 3);

    let (fourth, _release) = hold(&bulkhead, &reached);
    assert!(is_full(&fourth.await.unwrap()));
    assert_eq!(
        reached.load(Ordering::SeqCst),
        3,
        "the refused call never reached the dependency"
    );
    assert_eq!(bulkhead.stats().active, 3);

    for (task, release) in held {
        release.send(()).unwrap();
        assert_eq!(task.await.unwrap().unwrap(), 1);
    }
    assert_eq!(bulkhead.stats().available, 3);
    let (again, release) = hold(&bulkhead, &reached);
    release.send(()).unwrap();
    assert_eq!(
        again.await.unwrap().unwrap(),
        1,
        "freed slots admit calls again"
    );
}

#[tokio::test(start_paused = true)]
async fn a_queued_call_is_admitted_when_a_slot_frees() {
    let bulkhead = Bulkhead::builder("db")
        .max_concurrent(1)
        .max_waiting(1)
        .max_wait(ms(500))
        .build()
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let (first, release_first) = hold(&bulkhead, &reached);
    settle().await;
    let (queued, release_queued) = hold(&bulkhead, &reached);
    settle().await;
    assert_eq!(bulkhead.stats().waiting, 1);
    assert_eq!(
        reached.load(Ordering::SeqCst),
        1,
        "the queued call waits, it does not run"
    );

    advance(ms(300)).await;
    release_first.send(()).unwrap();
    first.await.unwrap().unwrap();
    settle().await;
    assert_eq!(reached.load(Ordering::SeqCst), 2);
    assert_eq!(bulkhead.stats().waiting, 0);
    release_queued.send(()).unwrap();
    assert_eq!(queued.await.unwrap().unwrap(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_call_that_waits_longer_than_max_wait_is_refused() {
    let bulkhead = Bulkhead::builder("db")
        .max_concurrent(1)
        .max_waiting(4)
        .max_wait(ms(100))
        .build()
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let (_first, _release_first) = hold(&bulkhead, &reached);
    settle().await;
    let started = keel_core::clock::now();
    let (queued, _release) = hold(&bulkhead, &reached);
    assert!(is_full(&queued.await.unwrap()));
    assert_eq!(keel_core::clock::now() - started, ms(100));
    assert_eq!(reached.load(Ordering::SeqCst), 1);
    let stats = bulkhead.stats();
    assert_eq!((stats.rejected, stats.waiting), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_refuses_at_once() {
    let bulkhead = Bulkhead::builder("db")
        .max_concurrent(1)
        .max_waiting(1)
        .max_wait(ms(100))
        .build()
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let (_first, _r1) = hold(&bulkhead, &reached);
    settle().await;
    let (_queued, _r2) = hold(&bulkhead, &reached);
    settle().await;
    let started = keel_core::clock::now();
    let (third, _r3) = hold(&bulkhead, &reached);
    assert!(is_full(&third.await.unwrap()));
    assert_eq!(
        keel_core::clock::now(),
        started,
        "no waiting when the queue is full"
    );
}

#[tokio::test(start_paused = true)]
async fn the_deadline_bounds_the_wait() {
    let bulkhead = Bulkhead::builder("db")
        .max_concurrent(1)
        .max_waiting(1)
        .max_wait(ms(1000))
        .build()
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let (_first, _r1) = hold(&bulkhead, &reached);
    settle().await;
    let started = keel_core::clock::now();
    let outcome = Deadline::after(ms(50))
        .scope(bulkhead.call(|| async { Ok::<_, std::io::Error>(2) }))
        .await;
    assert!(matches!(
        outcome,
        Err(PolicyError::Rejected(Rejected::DeadlineExceeded))
    ));
    assert_eq!(keel_core::clock::now() - started, ms(50));
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_waiter_gives_back_its_place_in_the_queue() {
    let bulkhead = Bulkhead::builder("db")
        .max_concurrent(1)
        .max_waiting(1)
        .max_wait(ms(1000))
        .build()
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let (_first, _r1) = hold(&bulkhead, &reached);
    settle().await;
    let (waiter, _r2) = hold(&bulkhead, &reached);
    settle().await;
    assert_eq!(bulkhead.stats().waiting, 1);
    waiter.abort();
    settle().await;
    assert_eq!(bulkhead.stats().waiting, 0);
    let (_next, _r3) = hold(&bulkhead, &reached);
    settle().await;
    assert_eq!(bulkhead.stats().waiting, 1, "the freed place is usable");
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_call_gives_back_its_slot() {
    let bulkhead = Bulkhead::builder("db").max_concurrent(1).build().unwrap();
    let mut call = Box::pin(bulkhead.call(std::future::pending::<Result<u32, std::io::Error>>));
    assert!((&mut call).now_or_never().is_none());
    assert_eq!(bulkhead.stats().active, 1);
    drop(call);
    assert_eq!(bulkhead.stats().active, 0);
    let outcome: Outcome = bulkhead.call(|| async { Ok(3) }).await;
    assert_eq!(outcome.unwrap(), 3);
}

#[tokio::test(start_paused = true)]
async fn one_tenant_saturating_its_compartment_does_not_affect_another() {
    let per_tenant: KeyedBulkhead<&'static str> = Bulkhead::builder("api")
        .max_concurrent(2)
        .build_keyed()
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..2 {
        let (release, released) = oneshot::channel::<()>();
        let bulkhead = per_tenant.clone();
        held.push(release);
        tokio::spawn(async move {
            bulkhead
                .call(&"noisy", || async move {
                    let _ = released.await;
                    Ok::<_, std::io::Error>(())
                })
                .await
        });
    }
    settle().await;
    let noisy = per_tenant
        .call(&"noisy", || async { Ok::<_, std::io::Error>(()) })
        .await;
    assert!(matches!(
        noisy,
        Err(PolicyError::Rejected(Rejected::BulkheadFull { .. }))
    ));
    let quiet = per_tenant
        .call(&"quiet", || async { Ok::<_, std::io::Error>(7) })
        .await;
    assert_eq!(quiet.unwrap(), 7, "the quiet tenant keeps its own slots");
    assert_eq!(per_tenant.stats(&"noisy").unwrap().rejected, 1);
    assert_eq!(per_tenant.stats(&"quiet").unwrap().accepted, 1);
}

#[tokio::test(start_paused = true)]
async fn endless_distinct_keys_never_grow_memory_past_max_keys() {
    let per_tenant: KeyedBulkhead<u64> = Bulkhead::builder("api")
        .max_concurrent(1)
        .max_keys(100)
        .build_keyed()
        .unwrap();
    // Keys whose calls complete are idle and get evicted.
    for key in 0..100_000u64 {
        let ok = per_tenant
            .call(&key, || async { Ok::<_, std::io::Error>(()) })
            .await;
        assert!(ok.is_ok());
        assert!(per_tenant.len() <= 100);
    }

    // When every tracked key is busy, new keys share the overflow compartment
    // and cannot take the tracked ones' slots.
    per_tenant.evict_idle();
    let mut releases = Vec::new();
    for key in 0..100u64 {
        let (release, released) = oneshot::channel::<()>();
        releases.push(release);
        let bulkhead = per_tenant.clone();
        tokio::spawn(async move {
            bulkhead
                .call(&key, || async move {
                    let _ = released.await;
                    Ok::<_, std::io::Error>(())
                })
                .await
        });
    }
    settle().await;
    assert_eq!(per_tenant.len(), 100);
    let (release, released) = oneshot::channel::<()>();
    let bulkhead = per_tenant.clone();
    let attacker = tokio::spawn(async move {
        bulkhead
            .call(&1_000_000, || async move {
                let _ = released.await;
                Ok::<_, std::io::Error>(())
            })
            .await
    });
    settle().await;
    for key in 1_000_001..1_001_000u64 {
        let refused = per_tenant
            .call(&key, || async { Ok::<_, std::io::Error>(()) })
            .await;
        assert!(matches!(
            refused,
            Err(PolicyError::Rejected(Rejected::BulkheadFull { .. }))
        ));
    }
    assert_eq!(per_tenant.len(), 100);
    assert_eq!(per_tenant.overflow_stats().rejected, 999);
    release.send(()).unwrap();
    attacker.await.unwrap().unwrap();
    drop(releases);
    settle().await;
    assert_eq!(per_tenant.evict_idle(), 100);
    assert!(per_tenant.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_contention_the_cap_holds_and_no_waiter_is_forgotten() {
    let bulkhead = Bulkhead::builder("db")
        .max_concurrent(3)
        .max_waiting(1_000)
        .max_wait(Duration::from_secs(60))
        .build()
        .unwrap();
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let calls: Vec<_> = (0..500)
        .map(|_| {
            let (bulkhead, running, peak) =
                (bulkhead.clone(), Arc::clone(&running), Arc::clone(&peak));
            tokio::spawn(async move {
                bulkhead
                    .call(|| async move {
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
    // A lost wakeup would leave a waiter until max_wait and fail it.
    for call in calls {
        call.await.unwrap().unwrap();
    }
    assert!(peak.load(Ordering::SeqCst) <= 3);
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.accepted, stats.rejected, stats.active, stats.waiting),
        (500, 0, 0, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn the_counts_add_up() {
    let bulkhead = Bulkhead::builder("db")
        .max_concurrent(2)
        .max_waiting(1)
        .max_wait(ms(100))
        .build()
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let (a, ra) = hold(&bulkhead, &reached);
    let (b, rb) = hold(&bulkhead, &reached);
    settle().await;
    let (c, rc) = hold(&bulkhead, &reached);
    settle().await;
    let (d, _rd) = hold(&bulkhead, &reached);
    settle().await;
    assert_eq!(
        bulkhead.stats(),
        BulkheadStats {
            total: 4,
            accepted: 2,
            rejected: 1,
            active: 2,
            available: 0,
            waiting: 1
        }
    );
    assert!(is_full(&d.await.unwrap()));
    ra.send(()).unwrap();
    a.await.unwrap().unwrap();
    settle().await;
    assert_eq!(
        bulkhead.stats(),
        BulkheadStats {
            total: 4,
            accepted: 3,
            rejected: 1,
            active: 2,
            available: 0,
            waiting: 0
        }
    );
    rb.send(()).unwrap();
    rc.send(()).unwrap();
    b.await.unwrap().unwrap();
    c.await.unwrap().unwrap();
    let stats = bulkhead.stats();
    assert_eq!((stats.active, stats.available), (0, 2));
    assert_eq!(
        stats.total,
        stats.accepted + stats.rejected + stats.waiting as u64
    );
    assert_eq!(reached.load(Ordering::SeqCst) as u64, stats.accepted);
}

#[tokio::test(start_paused = true)]
async fn the_tower_service_refuses_when_full_and_waits_when_allowed() {
    let bulkhead = Bulkhead::builder("svc")
        .max_concurrent(1)
        .max_waiting(1)
        .max_wait(ms(100))
        .build()
        .unwrap();
    let (mock, mut handle) = tower_test::mock::pair::<u32, u32>();
    let mut first = BulkheadLayer::new(bulkhead.clone()).layer(mock.clone());
    let mut second = BulkheadLayer::new(bulkhead.clone()).layer(mock.clone());
    let mut third = BulkheadLayer::new(bulkhead.clone()).layer(mock);

    let response = first.ready().await.unwrap().call(1);
    assert_eq!(bulkhead.stats().active, 1);

    // The second waits in poll_ready; the third finds the queue full.
    let mut second_ready = tokio_test::task::spawn(second.ready());
    assert!(second_ready.poll().is_pending());
    assert_eq!(bulkhead.stats().waiting, 1);
    let refused = third.ready().await.unwrap().call(3).await.unwrap_err();
    assert!(matches!(
        refused.downcast_ref::<Rejected>(),
        Some(Rejected::BulkheadFull { .. })
    ));

    let (request, send) = handle.next_request().await.unwrap();
    assert_eq!(request, 1);
    send.send_response(10);
    assert_eq!(response.await.unwrap(), 10);
    assert!(
        second_ready.poll().is_ready(),
        "the slot went to the waiting service"
    );
    drop(second_ready);
    assert_eq!(bulkhead.stats().active, 1);
    let second_response = second.call(2);
    let (request, send) = handle.next_request().await.unwrap();
    assert_eq!(request, 2);
    send.send_response(20);
    assert_eq!(second_response.await.unwrap(), 20);
    assert_eq!(
        bulkhead.stats().active,
        0,
        "the slot is freed with the response"
    );
}

#[tokio::test(start_paused = true)]
async fn the_keyed_tower_service_isolates_tenants() {
    let per_tenant: KeyedBulkhead<&'static str> = Bulkhead::builder("api")
        .max_concurrent(1)
        .build_keyed()
        .unwrap();
    let (mock, mut handle) = tower_test::mock::pair::<(&'static str, u32), u32>();
    let tenant_of = |req: &(&'static str, u32)| req.0;
    let mut service = KeyedBulkheadLayer::new(per_tenant.clone(), tenant_of).layer(mock);

    let held = service.ready().await.unwrap().call(("noisy", 1));
    let refused = service
        .ready()
        .await
        .unwrap()
        .call(("noisy", 2))
        .await
        .unwrap_err();
    assert!(matches!(
        refused.downcast_ref::<Rejected>(),
        Some(Rejected::BulkheadFull { .. })
    ));
    let quiet = service.ready().await.unwrap().call(("quiet", 3));
    for _ in 0..2 {
        let (request, send) = handle.next_request().await.unwrap();
        send.send_response(request.1 * 10);
    }
    assert_eq!(held.await.unwrap(), 10);
    assert_eq!(quiet.await.unwrap(), 30);
    assert_eq!(per_tenant.stats(&"noisy").unwrap().active, 0);
}

#[tokio::test(start_paused = true)]
async fn the_tower_service_passes_inner_errors_through() {
    let bulkhead = Bulkhead::builder("svc").build().unwrap();
    let mut service = BulkheadLayer::new(bulkhead.clone()).layer(service_fn(|_: ()| async {
        Err::<(), _>(std::io::Error::other("boom"))
    }));
    let err: BoxError = service.ready().await.unwrap().call(()).await.unwrap_err();
    assert!(err.downcast_ref::<std::io::Error>().is_some());
    assert_eq!(bulkhead.stats().active, 0);
}

proptest::proptest! {
    #[test]
    fn the_counts_track_every_admission_and_refusal(
        max in 1usize..5,
        ops in proptest::collection::vec(proptest::bool::weighted(0.6), 0..100),
    ) {
        let bulkhead = Bulkhead::builder("db").max_concurrent(max).build().unwrap();
        let mut held = Vec::new();
        let (mut admitted, mut refused) = (0u64, 0u64);
        for start in ops {
            if start {
                let mut call = Box::pin(bulkhead.call(std::future::pending::<Result<(), std::io::Error>>));
                match (&mut call).now_or_never() {
                    None => {
                        admitted += 1;
                        held.push(call);
                    }
                    Some(outcome) => {
                        proptest::prop_assert!(outcome.is_err());
                        refused += 1;
                    }
                }
            } else {
                held.pop();
            }
            let stats = bulkhead.stats();
            proptest::prop_assert!(stats.active <= max);
            proptest::prop_assert_eq!(stats.active, held.len());
            proptest::prop_assert_eq!(stats.active + stats.available, max);
            proptest::prop_assert_eq!((stats.accepted, stats.rejected), (admitted, refused));
            proptest::prop_assert_eq!(stats.total, admitted + refused);
        }
    }
}

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations_in;

#[test]
fn the_happy_path_does_not_allocate() {
    let bulkhead = Bulkhead::builder("db").build().unwrap();
    let keyed: KeyedBulkhead<u64> = Bulkhead::builder("api").build_keyed().unwrap();
    let mut service = BulkheadLayer::new(bulkhead.clone()).layer(service_fn(|x: u32| async move {
        Ok::<_, std::io::Error>(x)
    }));
    let mut keyed_service = KeyedBulkheadLayer::new(keyed.clone(), |x: &u32| u64::from(*x)).layer(
        service_fn(|x: u32| async move { Ok::<_, std::io::Error>(x) }),
    );
    let warm = keyed
        .call(&1, || async { Ok::<_, std::io::Error>(1) })
        .now_or_never();
    assert!(warm.is_some());
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let n = allocations_in(|| {
        for _ in 0..100 {
            let out = bulkhead
                .call(|| async { Ok::<_, std::io::Error>(1) })
                .now_or_never();
            assert!(matches!(out, Some(Ok(1))));
            let out = keyed
                .call(&1, || async { Ok::<_, std::io::Error>(1) })
                .now_or_never();
            assert!(matches!(out, Some(Ok(1))));
            assert!(service.poll_ready(&mut cx).is_ready());
            assert!(matches!(service.call(1).now_or_never(), Some(Ok(1))));
            assert!(keyed_service.poll_ready(&mut cx).is_ready());
            assert!(matches!(keyed_service.call(1).now_or_never(), Some(Ok(1))));
        }
    });
    assert_eq!(n, 0);
}
