//! The election conformance suite: what every `keel_store::Election`
//! must do, written once and run against each backend (etcd, and leases on
//! SQLite, PostgreSQL and Redis).
//!
//! Run it with [`election_conformance_tests!`](crate::election_conformance_tests),
//! giving an async expression that makes an election no other test uses,
//! with a lease of about 2 s.

use std::time::Duration;

use keel_messaging::fence::{FenceGate, FencingToken};
use keel_store::Election;

/// How long a campaign is watched to show that it waits.
const WAITS: Duration = Duration::from_millis(500);

/// The most a dead leader's lease may take to run out, for the backends
/// the suite runs with (a 2 s lease, renewed every third of it).
const REPLACED_WITHIN: Duration = Duration::from_secs(8);

/// One leader at a time; after it resigns the next leads at once, with a
/// higher token, and a fence then refuses the old leader's writes.
pub async fn one_leader_at_a_time_each_next_with_a_higher_token<E: Election>(election: &E) {
    let first = election.campaign("pod-a").await.expect("pod-a campaigns");
    assert!(first.is_leader());
    let contender = election.clone();
    let second = tokio::spawn(async move { contender.campaign("pod-b").await });
    tokio::time::sleep(WAITS).await;
    assert!(!second.is_finished(), "pod-b waits while pod-a leads");

    let fence = FenceGate::new();
    let first_token = FencingToken::new(first.token());
    fence.admit(first_token).expect("the leader writes");
    first.resign().await.expect("resign");
    let second = tokio::time::timeout(REPLACED_WITHIN, second)
        .await
        .expect("pod-b leads soon after the resignation")
        .expect("task")
        .expect("pod-b campaigns");
    assert!(second.token() > first_token.get(), "tokens grow");
    fence
        .admit(FencingToken::new(second.token()))
        .expect("the new leader writes");
    assert!(
        fence.admit(first_token).is_err(),
        "the old leader's write is refused"
    );
    second.resign().await.expect("resign");
}

/// A leader that dies without resigning is replaced once its lease runs
/// out, and not before: it keeps leadership while it lives.
pub async fn a_dead_leader_is_replaced_once_its_lease_runs_out<E: Election>(election: &E) {
    let first = election.campaign("pod-a").await.expect("pod-a campaigns");
    let first_token = first.token();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        first.is_leader(),
        "renewed: still the leader past one lease"
    );
    drop(first); // the process dies: no resignation, no renewal
    let second = tokio::time::timeout(REPLACED_WITHIN, election.campaign("pod-b"))
        .await
        .expect("replaced within the lease's life")
        .expect("pod-b campaigns");
    assert!(second.token() > first_token);
    second.resign().await.expect("resign");
}

/// Campaigns racing for a free election: exactly one leads.
pub async fn racing_campaigns_elect_one<E: Election>(election: &E) {
    let racers: Vec<_> = (0..4)
        .map(|n| {
            let election = election.clone();
            tokio::spawn(async move { election.campaign(&format!("pod-{n}")).await })
        })
        .collect();
    tokio::time::sleep(WAITS * 2).await;
    let finished = racers.iter().filter(|r| r.is_finished()).count();
    assert_eq!(finished, 1, "one campaign won, the others wait");
    for racer in racers {
        racer.abort();
    }
}

/// A gate on the election ([`LeaseGate::leading`]) is open on one process
/// at a time; when the open one's process goes, another opens within the
/// lease's life, and the two are never open at once.
///
/// [`LeaseGate::leading`]: keel_messaging::lease::LeaseGate::leading
pub async fn a_leading_gate_is_open_on_one_process_at_a_time<E: Election>(election: &E) {
    use keel_messaging::lease::LeaseGate;

    let mut gates = [
        Some(LeaseGate::leading(election.clone(), "pod-a")),
        Some(LeaseGate::leading(election.clone(), "pod-b")),
    ];
    let first = wait_for_one_open(&gates).await;
    gates[first] = None; // its process dies
    let second = wait_for_one_open(&gates).await;
    assert_ne!(first, second, "the other process took over");
}

/// Polls until exactly one gate is open; never two.
async fn wait_for_one_open(gates: &[Option<keel_messaging::lease::LeaseGate>]) -> usize {
    let give_up = tokio::time::Instant::now() + REPLACED_WITHIN;
    loop {
        let mut open = Vec::new();
        for (i, gate) in gates.iter().enumerate() {
            if let Some(gate) = gate
                && gate.holds().await
            {
                open.push(i);
            }
        }
        assert!(open.len() <= 1, "two gates open at once: {open:?}");
        if let [one] = open[..] {
            return one;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "no gate opened within {REPLACED_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Expands into one `#[tokio::test]` per behaviour, each against the
/// election `$make` (an async expression yielding an election or a
/// [`Fixture`](crate::store_suite::Fixture)) makes.
#[macro_export]
macro_rules! election_conformance_tests {
    ($make:expr) => {
        $crate::election_conformance_tests!(@tests $make;
            one_leader_at_a_time_each_next_with_a_higher_token,
            a_dead_leader_is_replaced_once_its_lease_runs_out,
            racing_campaigns_elect_one,
            a_leading_gate_is_open_on_one_process_at_a_time,
        );
    };
    (@tests $make:expr; $($test:ident),* $(,)?) => {
        mod election_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let fixture = $crate::store_suite::Fixture::from($make.await);
                    $crate::election_suite::$test(fixture.store()).await;
                }
            )*
        }
    };
}
