//! A three-node JetStream cluster on loopback, streams with three replicas,
//! and nodes killed (`SIGKILL`) and restarted, or partitioned away from the
//! other two and healed, while messages are published and consumed: every
//! message a publish acknowledged is delivered, each key's messages in the
//! order they were published, and nothing the publisher did not send. A
//! single-replica stream could not promise this once its one node's disk is
//! gone; R3 loses nothing while a majority lives.
//!
//! Every route between two nodes runs through a fault proxy
//! (`keel_testkit::netfault`), one per direction: a partition black-holes
//! every route of one node (its bytes neither arrive nor are refused, as a
//! cut cable does) while its clients still reach it. The nodes advertise no
//! route address of their own, so no node learns a way around the proxies.
//!
//! The test runs its own nats-servers (the binary `scripts/services.sh`
//! installs), so it never disturbs the shared test server.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_nats::{NatsBroker, NatsBrokerOptions};
use keel_store::broker::{Broker, Message, SubscribeOptions};
use keel_testkit::netfault::{Condition, FaultProxy};
use keel_testkit::services;

const NODES: usize = 3;
const KEYS: u64 = 12;
const MESSAGES: u64 = 240;

/// One node's fault in a seeded run: each node has one, in a seeded order.
#[derive(Debug, Clone, Copy)]
struct Turn {
    node: usize,
    /// The batch before which the fault starts.
    at: usize,
    /// A kill: the batch before which the node restarts.
    restart_at: usize,
    /// A partition: how long it lasts (on the clock, not on progress: a
    /// publisher whose node is cut off makes none until it heals). Longer
    /// than a JetStream leader takes to notice it lost its followers.
    partition: Duration,
}

/// The turns of `seed`: every node once, in a seeded order, each within
/// its third of the batches.
fn turns(seed: u64, batches: usize) -> Vec<Turn> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut order: Vec<usize> = (0..NODES).collect();
    rng.shuffle(&mut order);
    let share = batches / NODES;
    order
        .into_iter()
        .enumerate()
        .map(|(turn, node)| {
            let at = turn * share + rng.usize(1..share / 2);
            Turn {
                node,
                at,
                restart_at: at + rng.usize(1..share / 2),
                partition: Duration::from_millis(rng.u64(3_000..9_000)),
            }
        })
        .collect()
}

/// One node of the cluster: its ports, its store, its process.
struct Node {
    name: String,
    client_port: u16,
    cluster_port: u16,
    monitor_port: u16,
    store: PathBuf,
    process: Option<Child>,
    /// The proxies this node dials to reach each other node's routes:
    /// (that node, its proxy).
    routes: Vec<(usize, FaultProxy)>,
}

struct Cluster {
    binary: PathBuf,
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    async fn new(binary: PathBuf) -> Self {
        let dir = tempfile::tempdir().expect("a directory");
        let cluster_ports: Vec<u16> = (0..NODES).map(|_| services::free_port()).collect();
        let mut nodes = Vec::new();
        for i in 0..NODES {
            let mut routes = Vec::new();
            for (j, port) in cluster_ports.iter().enumerate().filter(|(j, _)| *j != i) {
                let upstream = ([127, 0, 0, 1], *port).into();
                routes.push((j, FaultProxy::start(upstream).await.expect("a route proxy")));
            }
            nodes.push(Node {
                name: format!("n{i}"),
                client_port: services::free_port(),
                cluster_port: cluster_ports[i],
                monitor_port: services::free_port(),
                store: dir.path().join(format!("n{i}")),
                process: None,
                routes,
            });
        }
        let mut cluster = Self {
            binary,
            nodes,
            _dir: dir,
        };
        for i in 0..NODES {
            cluster.start(i);
        }
        cluster
    }

    /// Black-holes every route to and from node `k`.
    fn partition(&self, k: usize) {
        self.set_routes(k, Condition::BlackHole);
    }

    /// Node `k`'s routes pass again (what they held back arrives).
    fn heal(&self, k: usize) {
        self.set_routes(k, Condition::Healthy);
    }

    fn set_routes(&self, k: usize, condition: Condition) {
        for (i, node) in self.nodes.iter().enumerate() {
            for (j, proxy) in &node.routes {
                if i == k || *j == k {
                    proxy.set(condition);
                }
            }
        }
    }

    /// The client URL naming every node, so the client fails over.
    fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn start(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let routes = node
            .routes
            .iter()
            .map(|(_, proxy)| format!("nats://{}", proxy.addr()))
            .collect::<Vec<_>>()
            .join(",");
        let log = std::fs::File::create(node.store.with_extension("log")).expect("log file");
        let child = Command::new(&self.binary)
            .args(["-a", "127.0.0.1", "-p", &node.client_port.to_string()])
            .args(["-m", &node.monitor_port.to_string()])
            .args(["--server_name", &node.name, "--cluster_name", "keel"])
            .args([
                "--cluster",
                &format!("nats://127.0.0.1:{}", node.cluster_port),
            ])
            // Gossip would hand the others this node's own route address,
            // around the proxies: advertise one that refuses.
            .args(["--cluster_advertise", "127.0.0.1:1"])
            .args(["--routes", &routes, "-js", "-sd"])
            .arg(&node.store)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start nats-server");
        node.process = Some(child);
    }

    /// `SIGKILL`: the node's process dies with whatever it had not written.
    fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].process.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until every node says it is healthy, JetStream caught up
    /// (`/healthz`): the next kill then takes one node of three, never a
    /// second before the first is back.
    async fn wait_healthy(&self) {
        for node in &self.nodes {
            let port = node.monitor_port;
            let healthy = tokio::time::timeout(Duration::from_secs(60), async move {
                while !healthz(port).await {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
            assert!(
                healthy.is_ok(),
                "node {} not healthy within 60 s",
                node.name
            );
        }
    }

    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.nodes[i].store.with_extension("log")).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..NODES {
            self.kill(i);
        }
    }
}

/// Whether the node monitored on `port` answers `/healthz` with `200`.
async fn healthz(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let request = "GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if conn.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer).await;
    answer.starts_with(b"HTTP/1.0 200") || answer.starts_with(b"HTTP/1.1 200")
}

fn message(n: u64) -> Message {
    Message::new(
        format!("m{n}"),
        "orders",
        format!("k{}", n % KEYS),
        n.to_string(),
    )
}

/// Publishes `messages` until the cluster acknowledges them, as the outbox
/// relay does (the same ids again: JetStream drops the duplicates).
async fn publish_until_acked(broker: &NatsBroker, messages: &[Message]) -> u32 {
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    for attempt in 0.. {
        match broker.publish(messages).await {
            Ok(()) => return attempt,
            Err(error) => {
                assert!(
                    tokio::time::Instant::now() < until,
                    "not acknowledged in 60 s: {error}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    unreachable!()
}

/// Opens a broker on the cluster once JetStream has a leader: the first
/// publish of a fresh cluster waits for the meta group's election.
async fn open(url: &str) -> NatsBroker {
    let options = NatsBrokerOptions::new()
        .stream_prefix("cluster")
        .replicas(NODES)
        .request_timeout(Duration::from_secs(2));
    for attempt in 0.. {
        match options.clone().open(url).await {
            Ok(broker) => return broker,
            Err(error) => {
                assert!(attempt < 100, "the cluster never came up: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    unreachable!()
}

/// Receives until every id in `expected` was delivered (acking each), at
/// most 60 s; returns each key's delivered payloads in delivery order of
/// first deliveries, and every id delivered.
async fn consume(
    broker: &NatsBroker,
    expected: &BTreeSet<String>,
) -> (HashMap<String, Vec<u64>>, BTreeSet<String>) {
    let mut sub = None;
    for attempt in 0..100 {
        let options = SubscribeOptions::new("orders", "g").lease(Duration::from_secs(5));
        match broker.subscribe(options).await {
            Ok(subscribed) => {
                sub = Some(subscribed);
                break;
            }
            Err(error) if attempt == 99 => panic!("subscribe: {error}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let mut sub = sub.expect("subscribed");
    let mut order: HashMap<String, Vec<u64>> = HashMap::new();
    let mut seen = BTreeSet::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    while !expected.is_subset(&seen) && tokio::time::Instant::now() < until {
        let Ok(batch) = sub.receive(32, Duration::from_millis(500)).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        for delivery in batch {
            let id = delivery.message.id.clone();
            if seen.insert(id) {
                let n: u64 = std::str::from_utf8(&delivery.message.payload)
                    .expect("payload")
                    .parse()
                    .expect("a number");
                order
                    .entry(delivery.message.key.clone())
                    .or_default()
                    .push(n);
            }
            let _ = delivery.ack().await;
        }
    }
    (order, seen)
}

/// The batches the publisher sends, four messages each.
fn batches() -> Vec<Vec<Message>> {
    (0..MESSAGES)
        .collect::<Vec<_>>()
        .chunks(4)
        .map(|chunk| chunk.iter().copied().map(message).collect())
        .collect()
}

/// A cluster of fresh nodes and a broker on it (R3, nothing to warn of).
async fn cluster_and_broker() -> Option<(Cluster, NatsBroker)> {
    let cluster = Cluster::new(services::nats_server_binary()?).await;
    let broker = open(&cluster.url()).await;
    assert!(
        broker.durability_warnings().is_empty(),
        "{:?}",
        broker.durability_warnings()
    );
    Some((cluster, broker))
}

/// Every acknowledged message delivered, nothing else, each key in the
/// order it was published.
async fn assert_delivered_in_order(
    cluster: &Cluster,
    broker: &NatsBroker,
    acked: &BTreeSet<String>,
) {
    let (order, seen) = consume(broker, acked).await;
    let missing: Vec<_> = acked.difference(&seen).collect();
    assert!(
        missing.is_empty(),
        "acknowledged but never delivered: {missing:?}\n{}",
        (0..NODES)
            .map(|i| cluster.log(i))
            .collect::<Vec<_>>()
            .join("\n---\n")
    );
    let unexpected: Vec<_> = seen.difference(acked).collect();
    assert!(
        unexpected.is_empty(),
        "delivered, never sent: {unexpected:?}"
    );
    let published: BTreeMap<String, Vec<u64>> =
        (0..MESSAGES).fold(BTreeMap::new(), |mut keys, n| {
            keys.entry(format!("k{}", n % KEYS))
                .or_insert_with(Vec::new)
                .push(n);
            keys
        });
    for (key, sent) in &published {
        assert_eq!(order.get(key), Some(sent), "key {key} out of order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_nodes_of_a_three_replica_cluster_lose_and_reorder_nothing() {
    for seed in keel_testkit::seeds::fault_seeds(1..=1) {
        let Some((mut cluster, broker)) = cluster_and_broker().await else {
            return;
        };
        let (mut acked, mut retries) = (BTreeSet::new(), 0);
        let batches = batches();
        // The client's own node, a stream's leader, the meta leader,
        // whichever they are: each is killed in its turn.
        let turns = turns(seed, batches.len());
        for (b, batch) in batches.iter().enumerate() {
            for turn in &turns {
                if turn.at == b {
                    cluster.wait_healthy().await;
                    cluster.kill(turn.node);
                }
                if turn.restart_at == b {
                    cluster.start(turn.node);
                }
            }
            retries += publish_until_acked(&broker, batch).await;
            acked.extend(batch.iter().map(|m| m.id.clone()));
        }
        assert_delivered_in_order(&cluster, &broker, &acked).await;
        eprintln!(
            "fault run: cluster kills seed {seed}: {MESSAGES} messages acknowledged and \
             delivered in key order across {NODES} kills ({turns:?}); {retries} publishes retried"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_nodes_of_a_three_replica_cluster_lose_and_reorder_nothing() {
    for seed in keel_testkit::seeds::fault_seeds(1..=1) {
        let Some((cluster, broker)) = cluster_and_broker().await else {
            return;
        };
        let batches = batches();
        let turns = turns(seed, batches.len());
        let published = AtomicUsize::new(0);
        let partitions = async {
            for turn in &turns {
                while published.load(Ordering::Relaxed) < turn.at {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                cluster.wait_healthy().await;
                cluster.partition(turn.node);
                tokio::time::sleep(turn.partition).await;
                cluster.heal(turn.node);
            }
        };
        let publishing = async {
            let (mut acked, mut retries) = (BTreeSet::new(), 0);
            for batch in &batches {
                retries += publish_until_acked(&broker, batch).await;
                acked.extend(batch.iter().map(|m| m.id.clone()));
                published.fetch_add(1, Ordering::Relaxed);
            }
            (acked, retries)
        };
        let ((acked, retries), ()) = tokio::join!(publishing, partitions);
        assert_delivered_in_order(&cluster, &broker, &acked).await;
        eprintln!(
            "fault run: cluster partitions seed {seed}: {MESSAGES} messages acknowledged and \
             delivered in key order across {NODES} partitions ({turns:?}); \
             {retries} publishes retried"
        );
    }
}
