//! Leader election on a real SQLite store: one leader at a time, a higher
//! token for each new one, the leader's work stopped the moment its lease is
//! lost, and a released lease taken over at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_messaging::fence::FencingToken;
use keel_messaging::lease::{LeaderElection, LeaseLock};
use keel_messaging::store::LeaseStore;
use keel_sqlite::store::SqliteStore;
use tokio::sync::{mpsc, oneshot};

/// Long enough that a loaded machine's scheduling delays stay well inside
/// a third of it (the renewal period).
const TTL: Duration = Duration::from_secs(1);

/// Counts leaders working at once, and remembers the most ever.
#[derive(Default)]
struct Leaders {
    now: AtomicUsize,
    most: AtomicUsize,
}

struct Leading(Arc<Leaders>);

impl Leading {
    fn start(leaders: &Arc<Leaders>) -> Self {
        let n = leaders.now.fetch_add(1, Ordering::SeqCst) + 1;
        leaders.most.fetch_max(n, Ordering::SeqCst);
        Self(Arc::clone(leaders))
    }
}

impl Drop for Leading {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs an election for `holder`; reports each term's token on `terms`.
fn campaign(
    store: &SqliteStore,
    holder: &'static str,
    leaders: &Arc<Leaders>,
    terms: mpsc::UnboundedSender<(&'static str, FencingToken)>,
) -> oneshot::Sender<()> {
    let election = LeaderElection::new(LeaseLock::new(store.clone(), "leader", holder, TTL));
    let leaders = Arc::clone(leaders);
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        election
            .run(
                |lease| {
                    let (leaders, terms) = (Arc::clone(&leaders), terms.clone());
                    async move {
                        let _leading = Leading::start(&leaders);
                        let _ = terms.send((holder, lease.token()));
                        std::future::pending::<()>().await;
                    }
                },
                async move {
                    let _ = stopped.await;
                },
            )
            .await;
    });
    stop
}

async fn next_term(
    terms: &mut mpsc::UnboundedReceiver<(&'static str, FencingToken)>,
) -> (&'static str, FencingToken) {
    tokio::time::timeout(Duration::from_secs(5), terms.recv())
        .await
        .expect("a leader within 5 s")
        .expect("terms")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_and_a_lost_lease_stops_the_work() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("lease.db"))
        .await
        .unwrap();
    let leaders = Arc::new(Leaders::default());
    let (terms_tx, mut terms) = mpsc::unbounded_channel();

    let stop_a = campaign(&store, "pod-a", &leaders, terms_tx.clone());
    let (first, a_token) = next_term(&mut terms).await;
    assert_eq!(first, "pod-a");
    let stop_b = campaign(&store, "pod-b", &leaders, terms_tx.clone());
    // Several lease lengths: the leader renews, the other waits.
    tokio::time::sleep(TTL * 3).await;
    assert!(
        terms.try_recv().is_err(),
        "no second leader while the first renews"
    );

    // The lease is taken from under the leader (as after a long pause):
    // its work stops at its next renewal, and the new holder's token is
    // higher.
    assert!(
        store
            .lease_release("leader", "pod-a", a_token.into())
            .await
            .unwrap()
    );
    let thief = store
        .lease_acquire("leader", "pod-c", TTL)
        .await
        .unwrap()
        .expect("the released lease");
    assert!(thief.token > u64::from(a_token));
    keel_testkit::eventually("the old leader's work to stop", TTL, || async {
        leaders.now.load(Ordering::SeqCst) == 0
    })
    .await;

    // pod-c never renews: its lease runs out and a campaigner takes over.
    let (_, next) = next_term(&mut terms).await;
    assert!(u64::from(next) > thief.token, "tokens only grow");
    let _ = stop_a.send(());
    let _ = stop_b.send(());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        leaders.most.load(Ordering::SeqCst),
        1,
        "never two leaders at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_stops_hands_over_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("lease.db"))
        .await
        .unwrap();
    let leaders = Arc::new(Leaders::default());
    let (terms_tx, mut terms) = mpsc::unbounded_channel();
    let stop_a = campaign(&store, "pod-a", &leaders, terms_tx.clone());
    let (_, a_token) = next_term(&mut terms).await;
    let _stop_b = campaign(&store, "pod-b", &leaders, terms_tx);
    let _ = stop_a.send(());
    let (holder, b_token) = next_term(&mut terms).await;
    assert_eq!(holder, "pod-b");
    assert!(b_token > a_token);
}
