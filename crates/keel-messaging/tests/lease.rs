//! Leader election on a real SQLite store: one leader at a time, a higher
//! token for each new one, the leader's work stopped the moment its lease is
//! lost, and a released lease taken over at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_messaging::fence::FencingToken;
use keel_messaging::lease::{LeaderElection, LeaseLock};
use keel_messaging::store::Store;
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

/// Hands the lease `name` to `holder` under the next token, keeping its
/// expiry; returns the new token.
async fn steal(store: &SqliteStore, name: &str, holder: &str) -> u64 {
    let mut tx = store.begin().await.unwrap();
    let token: i64 = sqlx::query_scalar(
        "UPDATE keel_leases SET holder = $1, token = token + 1 WHERE name = $2 RETURNING token",
    )
    .bind(holder)
    .bind(name)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    store.commit(tx).await.unwrap();
    u64::try_from(token).unwrap()
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

    // The lease passes to another holder while the leader is not looking
    // (as after a long pause and another process's clock calling it
    // expired): its work stops at its next renewal, and the new holder's
    // token is higher. The hand-over is one statement: a release followed
    // by an acquire would leave a gap that the leader's own renewal or the
    // other campaigner may fill first, as a real one would.
    let thief = steal(&store, "leader", "pod-c").await;
    assert!(thief > u64::from(a_token));
    keel_testkit::eventually("the old leader's work to stop", TTL, || async {
        leaders.now.load(Ordering::SeqCst) == 0
    })
    .await;

    // pod-c never renews: its lease runs out and a campaigner takes over.
    let (_, next) = next_term(&mut terms).await;
    assert!(u64::from(next) > thief, "tokens only grow");
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
