//! The links between processes and services, and a schedule played on them.

use std::io;
use std::net::SocketAddr;

use super::{Condition, Episode, Fault, FaultProxy, ProxyStats, Schedule, Scope};

/// One proxy per (process, service) link, so a fault can hit one link, one
/// service for everyone, or every link of one process.
#[derive(Debug, Default)]
pub struct Network {
    links: Vec<Link>,
}

#[derive(Debug)]
struct Link {
    process: String,
    service: String,
    proxy: FaultProxy,
}

impl Network {
    /// Adds the link from `process` to the `service` at `upstream`, and
    /// returns the address `process` should dial instead.
    pub async fn link(
        &mut self,
        process: &str,
        service: &str,
        upstream: SocketAddr,
    ) -> io::Result<SocketAddr> {
        let proxy = FaultProxy::start(upstream).await?;
        let addr = proxy.addr();
        self.links.push(Link {
            process: process.to_owned(),
            service: service.to_owned(),
            proxy,
        });
        Ok(addr)
    }

    /// Plays `schedule` from now: each episode starts at its time and its
    /// links heal when it ends. Returns after the last episode.
    pub async fn play(&self, schedule: &Schedule) {
        let start = tokio::time::Instant::now();
        for episode in &schedule.episodes {
            tokio::time::sleep_until(start + episode.at).await;
            self.begin(episode);
            tokio::time::sleep(episode.lasting).await;
            self.heal();
        }
    }

    /// Every link healthy again.
    pub fn heal(&self) {
        for link in &self.links {
            link.proxy.set(Condition::Healthy);
        }
    }

    /// What each link's proxy has done: (process, service, stats).
    pub fn stats(&self) -> Vec<(String, String, ProxyStats)> {
        self.links
            .iter()
            .map(|l| (l.process.clone(), l.service.clone(), l.proxy.stats()))
            .collect()
    }

    fn begin(&self, episode: &Episode) {
        for link in self.covered(&episode.scope) {
            match episode.fault {
                Fault::Reset => link.proxy.reset(),
                Fault::Latency(d) => link.proxy.set(Condition::Latency(d)),
                Fault::BlackHole => link.proxy.set(Condition::BlackHole),
                Fault::SlowClose(d) => link.proxy.set(Condition::SlowClose(d)),
            }
        }
    }

    fn covered<'a>(&'a self, scope: &'a Scope) -> impl Iterator<Item = &'a Link> + 'a {
        self.links
            .iter()
            .filter(move |l| scope.covers(&l.process, &l.service))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::super::proxy::tests::echo;
    use super::*;

    async fn answers(addr: SocketAddr) -> bool {
        let exchange = async {
            let mut stream = TcpStream::connect(addr).await?;
            stream.write_all(b"?").await?;
            stream.read_exact(&mut [0]).await
        };
        matches!(
            tokio::time::timeout(Duration::from_millis(200), exchange).await,
            Ok(Ok(_))
        )
    }

    #[tokio::test]
    async fn a_partition_cuts_one_process_off_and_heals_when_it_ends() {
        let (pg, nats) = (echo().await, echo().await);
        let mut network = Network::default();
        let a_pg = network.link("a", "postgres", pg).await.unwrap();
        let a_nats = network.link("a", "nats", nats).await.unwrap();
        let b_pg = network.link("b", "postgres", pg).await.unwrap();
        let partition = Schedule {
            seed: 0,
            episodes: vec![Episode {
                at: Duration::ZERO,
                scope: Scope::Process("a".into()),
                fault: Fault::BlackHole,
                lasting: Duration::from_millis(600),
            }],
        };
        let play = network.play(&partition);
        let probe = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            (
                answers(a_pg).await,
                answers(a_nats).await,
                answers(b_pg).await,
            )
        };
        let ((), during) = tokio::join!(play, probe);
        assert_eq!(during, (false, false, true), "a cut off, b not");
        assert!(answers(a_pg).await && answers(a_nats).await, "healed");
        let stats = network.stats();
        assert!(stats.iter().all(|(_, _, s)| s.connections >= 1));
    }
}
