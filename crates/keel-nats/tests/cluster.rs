//! A three-node JetStream cluster on loopback, streams with three replicas,
//! and nodes killed (`SIGKILL`) and restarted while messages are published
//! and consumed: every message a publish acknowledged is delivered, each
//! key's messages in the order they were published, and nothing the
//! publisher did not send. A single-replica stream could not promise this
//! once its one node's disk is gone; R3 loses nothing while a majority
//! lives.
//!
//! The test runs its own nats-servers (the binary `scripts/services.sh`
//! installs), so it never disturbs the shared test server.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use keel_messaging::broker::{Broker, Message, SubscribeOptions};
use keel_nats::{NatsBroker, NatsBrokerOptions};
use keel_testkit::services;

const NODES: usize = 3;
const KEYS: u64 = 12;
const MESSAGES: u64 = 240;

/// One node of the cluster: its ports, its store, its process.
struct Node {
    name: String,
    client_port: u16,
    cluster_port: u16,
    monitor_port: u16,
    store: PathBuf,
    process: Option<Child>,
}

struct Cluster {
    binary: PathBuf,
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    fn new(binary: PathBuf) -> Self {
        let dir = tempfile::tempdir().expect("a directory");
        let nodes = (0..NODES)
            .map(|i| Node {
                name: format!("n{i}"),
                client_port: services::free_port(),
                cluster_port: services::free_port(),
                monitor_port: services::free_port(),
                store: dir.path().join(format!("n{i}")),
                process: None,
            })
            .collect();
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

    /// Every node's port that `port` picks, as NATS URLs separated by
    /// commas.
    fn urls(&self, port: impl Fn(&Node) -> u16) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", port(n)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The client URL naming every node, so the client fails over.
    fn url(&self) -> String {
        self.urls(|n| n.client_port)
    }

    fn start(&mut self, i: usize) {
        let routes = self.urls(|n| n.cluster_port);
        let node = &mut self.nodes[i];
        let log = std::fs::File::create(node.store.with_extension("log")).expect("log file");
        let child = Command::new(&self.binary)
            .args(["-a", "127.0.0.1", "-p", &node.client_port.to_string()])
            .args(["-m", &node.monitor_port.to_string()])
            .args(["--server_name", &node.name, "--cluster_name", "keel"])
            .args([
                "--cluster",
                &format!("nats://127.0.0.1:{}", node.cluster_port),
            ])
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_nodes_of_a_three_replica_cluster_lose_and_reorder_nothing() {
    let Some(binary) = services::nats_server_binary() else {
        return;
    };
    let mut cluster = Cluster::new(binary);
    let broker = open(&cluster.url()).await;
    assert!(
        broker.durability_warnings().is_empty(),
        "{:?}",
        broker.durability_warnings()
    );

    let (mut acked, mut retries) = (BTreeSet::new(), 0);
    let batches: Vec<Vec<Message>> = (0..MESSAGES)
        .collect::<Vec<_>>()
        .chunks(4)
        .map(|chunk| chunk.iter().copied().map(message).collect())
        .collect();
    // Each node in turn is killed a quarter of the way into its share of
    // the batches, and restarted halfway: the client's own node, a
    // stream's leader, the meta leader, whichever they are.
    let per_node = batches.len() / NODES;
    for (b, batch) in batches.iter().enumerate() {
        let (node, into) = (b / per_node, b % per_node);
        if node < NODES && into == per_node / 4 {
            cluster.wait_healthy().await;
            cluster.kill(node);
        }
        if node < NODES && into == per_node / 2 {
            cluster.start(node);
        }
        retries += publish_until_acked(&broker, batch).await;
        acked.extend(batch.iter().map(|m| m.id.clone()));
    }

    let (order, seen) = consume(&broker, &acked).await;
    let missing: Vec<_> = acked.difference(&seen).collect();
    assert!(
        missing.is_empty(),
        "acknowledged but never delivered: {missing:?}\n{}",
        (0..NODES)
            .map(|i| cluster.log(i))
            .collect::<Vec<_>>()
            .join("\n---\n")
    );
    let unexpected: Vec<_> = seen.difference(&acked).collect();
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
    eprintln!(
        "cluster: {MESSAGES} messages acknowledged and delivered in key order across {NODES} \
         kills; {retries} publishes retried"
    );
}
