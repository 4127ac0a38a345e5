//! One TCP link that misbehaves on demand.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Bytes read from one side at a time.
const CHUNK: usize = 16 * 1024;
/// Chunks in flight on the delay line of one direction.
const IN_FLIGHT: usize = 64;

/// What the network between the two ends does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Condition {
    /// Bytes pass as they come.
    #[default]
    Healthy,
    /// Every byte arrives this much later, in order.
    Latency(Duration),
    /// Nothing passes either way and nothing is refused: open connections
    /// hang, new ones are accepted and hang. What was sent meanwhile
    /// arrives after the black hole ends, as TCP's retransmission would
    /// deliver it, unless the client gave up first.
    BlackHole,
    /// Bytes pass, but a side's close reaches the other side this much
    /// later.
    SlowClose(Duration),
}

/// What a proxy has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted.
    pub connections: u64,
    /// Connections it reset.
    pub resets: u64,
    /// Bytes forwarded, both ways.
    pub bytes: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    resets: AtomicU64,
    bytes: AtomicU64,
}

struct Control {
    condition: watch::Sender<Condition>,
    /// Bumped to reset every open connection.
    resets: watch::Sender<u64>,
    counters: Counters,
}

/// A TCP proxy on loopback in front of one server. Dial [`addr`](Self::addr)
/// instead of the server; [`set`](Self::set) and [`reset`](Self::reset)
/// decide what the link does. Dropping it closes every connection.
pub struct FaultProxy {
    addr: SocketAddr,
    control: Arc<Control>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy on a free loopback port, forwarding to `upstream`.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let control = Arc::new(Control {
            condition: watch::Sender::new(Condition::Healthy),
            resets: watch::Sender::new(0),
            counters: Counters::default(),
        });
        let accept = tokio::spawn(accept(listener, upstream, control.clone()));
        Ok(Self {
            addr,
            control,
            accept,
        })
    }

    /// Where to connect instead of the server.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Makes the link behave so from now on, for open and new connections.
    pub fn set(&self, condition: Condition) {
        self.control.condition.send_replace(condition);
    }

    /// What the link does now.
    pub fn condition(&self) -> Condition {
        *self.control.condition.borrow()
    }

    /// Resets every open connection (an RST to both ends, mid-stream if
    /// bytes are in flight). New connections are not affected.
    pub fn reset(&self) {
        self.control.resets.send_modify(|n| *n += 1);
    }

    /// What the proxy has done so far.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.control.counters;
        ProxyStats {
            connections: c.connections.load(Ordering::Relaxed),
            resets: c.resets.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("condition", &self.condition())
            .field("stats", &self.stats())
            .finish()
    }
}

/// Accepts until aborted; the connections live in a set this task owns,
/// so aborting it ends them all.
async fn accept(listener: TcpListener, upstream: SocketAddr, control: Arc<Control>) {
    let mut links = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                control.counters.connections.fetch_add(1, Ordering::Relaxed);
                links.spawn(link(client, upstream, control.clone()));
            }
            Some(_) = links.join_next(), if !links.is_empty() => {}
        }
    }
}

/// Carries one connection both ways until both sides close, either side
/// fails, or the proxy resets it.
async fn link(client: TcpStream, upstream: SocketAddr, control: Arc<Control>) {
    let mut resets = control.resets.subscribe();
    let mut condition = control.condition.subscribe();
    // A black hole swallows the handshake too: dial only once it is over.
    if condition
        .wait_for(|c| *c != Condition::BlackHole)
        .await
        .is_err()
    {
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        abort(client);
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let carried = tokio::select! {
        carried = async {
            tokio::try_join!(
                pipe(&mut client_read, &mut server_write, &control),
                pipe(&mut server_read, &mut client_write, &control),
            )
        } => carried.map(|_| ()),
        _ = resets.changed() => {
            control.counters.resets.fetch_add(1, Ordering::Relaxed);
            Err(io::ErrorKind::ConnectionReset.into())
        }
    };
    if carried.is_err() {
        // One side failed or the proxy resets: both ends see a reset, as
        // they would if a middlebox dropped the connection's state.
        if let Ok(client) = client_read.reunite(client_write) {
            abort(client);
        }
        if let Ok(server) = server_read.reunite(server_write) {
            abort(server);
        }
    }
}

/// Closes with an RST rather than a FIN.
fn abort(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// One direction: a reader puts chunks on a delay line, a writer sends
/// each when it is due. Both hold still during a black hole.
async fn pipe(
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
    control: &Control,
) -> io::Result<()> {
    let (line, mut due) = mpsc::channel::<(Instant, Vec<u8>)>(IN_FLIGHT);
    let read = async move {
        let mut condition = control.condition.subscribe();
        loop {
            passable(&mut condition).await;
            let mut chunk = vec![0; CHUNK];
            let n = from.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            chunk.truncate(n);
            let now = *condition.borrow();
            let latency = match now {
                Condition::Latency(latency) => latency,
                _ => Duration::ZERO,
            };
            if line.send((Instant::now() + latency, chunk)).await.is_err() {
                return Ok(());
            }
        }
    };
    let write = async {
        let mut condition = control.condition.subscribe();
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            passable(&mut condition).await;
            to.write_all(&chunk).await?;
            control
                .counters
                .bytes
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        let closing = *condition.borrow();
        if let Condition::SlowClose(delay) = closing {
            tokio::time::sleep(delay).await;
        }
        to.shutdown().await
    };
    tokio::try_join!(read, write).map(|_| ())
}

/// Waits while the link is a black hole.
async fn passable(condition: &mut watch::Receiver<Condition>) {
    // The sender lives as long as the proxy's control block, which this
    // connection holds, so the wait ends only when the black hole does.
    let _ = condition.wait_for(|c| *c != Condition::BlackHole).await;
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// An echo server on loopback.
    pub(in crate::netfault) async fn echo() -> SocketAddr {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(stream: &mut TcpStream, msg: &[u8]) -> io::Result<Vec<u8>> {
        stream.write_all(msg).await?;
        let mut back = vec![0; msg.len()];
        stream.read_exact(&mut back).await?;
        Ok(back)
    }

    #[tokio::test]
    async fn a_healthy_link_carries_bytes_both_ways() {
        let proxy = FaultProxy::start(echo().await).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut stream, b"ping").await.unwrap(), b"ping");
        assert_eq!(proxy.stats().connections, 1);
        assert_eq!(proxy.stats().bytes, 8);
    }

    #[tokio::test]
    async fn latency_delays_every_byte_by_at_least_its_amount() {
        let proxy = FaultProxy::start(echo().await).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.set(Condition::Latency(Duration::from_millis(100)));
        let started = Instant::now();
        round_trip(&mut stream, b"slow").await.unwrap();
        // Once each way.
        assert!(started.elapsed() >= Duration::from_millis(200));
    }

    #[tokio::test]
    async fn a_black_hole_holds_bytes_until_it_ends_and_refuses_nothing() {
        let proxy = FaultProxy::start(echo().await).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.set(Condition::BlackHole);
        let mut fresh = TcpStream::connect(proxy.addr())
            .await
            .expect("a black hole accepts");
        let held = tokio::time::timeout(
            Duration::from_millis(300),
            round_trip(&mut stream, b"lost?"),
        )
        .await;
        assert!(held.is_err(), "nothing passes, and nothing fails");
        proxy.set(Condition::Healthy);
        let mut back = vec![0; 5];
        stream.read_exact(&mut back).await.unwrap();
        assert_eq!(back, b"lost?", "what was sent arrives afterwards");
        assert_eq!(round_trip(&mut fresh, b"new").await.unwrap(), b"new");
    }

    #[tokio::test]
    async fn a_reset_ends_open_connections_with_an_error_and_spares_new_ones() {
        let proxy = FaultProxy::start(echo().await).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut stream, b"up").await.unwrap();
        proxy.reset();
        let mut buf = [0; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("the reset arrives");
        assert_eq!(
            read.map_err(|e| e.kind()),
            Err(io::ErrorKind::ConnectionReset),
            "an RST, not a clean close"
        );
        assert_eq!(proxy.stats().resets, 1);
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut fresh, b"again").await.unwrap(), b"again");
    }

    #[tokio::test]
    async fn a_slow_close_delays_the_fin() {
        let proxy = FaultProxy::start(echo().await).await.unwrap();
        proxy.set(Condition::SlowClose(Duration::from_millis(200)));
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut stream, b"bye").await.unwrap();
        let started = Instant::now();
        stream.shutdown().await.unwrap();
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        // Once to the server, and the echo's close once back.
        assert!(started.elapsed() >= Duration::from_millis(400));
    }
}
