//! Fault episodes drawn from a seed.

use std::fmt;
use std::time::Duration;

/// What an episode does to the links in its scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Every byte arrives this much later, for the episode.
    Latency(Duration),
    /// Every open connection is reset, once.
    Reset,
    /// Nothing passes and nothing is refused, for the episode.
    BlackHole,
    /// Closes reach the other side this much later, for the episode.
    SlowClose(Duration),
}

/// Which links an episode hits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// One process's link to one service.
    Link {
        /// The process.
        process: String,
        /// The service.
        service: String,
    },
    /// Every process's link to this service.
    Service(String),
    /// Every link of this process: with [`Fault::BlackHole`], a partition
    /// of that process while the others go on.
    Process(String),
}

impl Scope {
    /// Whether the link from `process` to `service` is in this scope.
    pub fn covers(&self, process: &str, service: &str) -> bool {
        match self {
            Self::Link {
                process: p,
                service: s,
            } => p == process && s == service,
            Self::Service(s) => s == service,
            Self::Process(p) => p == process,
        }
    }
}

/// One fault, when it starts (from the start of the run) and how long it
/// lasts; the links heal when it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Episode {
    /// When it starts.
    pub at: Duration,
    /// Which links it hits.
    pub scope: Scope,
    /// What it does.
    pub fault: Fault,
    /// How long it lasts (zero for a reset).
    pub lasting: Duration,
}

/// Episodes in time order, one at a time, drawn from a seed: the same seed
/// gives the same schedule, so a failing run is replayed by its seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// The seed it was drawn from.
    pub seed: u64,
    /// The episodes, in time order, never overlapping.
    pub episodes: Vec<Episode>,
}

impl Schedule {
    /// Draws episodes for links between `processes` and `services` until
    /// `span` has passed: latency of 5–150 ms, resets, black holes of
    /// 0.3–3 s on a link or a service, slow closes, and partitions of one
    /// process lasting 1–12 s (long enough, at the top, for that process's
    /// 10 s locks to be taken over by another). A gap of 0.2–1.5 s of
    /// health separates episodes.
    pub fn draw(seed: u64, processes: &[&str], services: &[&str], span: Duration) -> Self {
        assert!(!processes.is_empty() && !services.is_empty());
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut episodes = Vec::new();
        let mut at = millis(&mut rng, 200, 1_000);
        while at < span {
            let episode = episode(&mut rng, at, processes, services);
            at += episode.lasting + millis(&mut rng, 200, 1_500);
            episodes.push(episode);
        }
        Self { seed, episodes }
    }

    /// When the last episode has ended.
    pub fn span(&self) -> Duration {
        self.episodes
            .last()
            .map_or(Duration::ZERO, |e| e.at + e.lasting)
    }
}

fn episode(
    rng: &mut fastrand::Rng,
    at: Duration,
    processes: &[&str],
    services: &[&str],
) -> Episode {
    let process = processes[rng.usize(..processes.len())].to_owned();
    let service = services[rng.usize(..services.len())].to_owned();
    let scope = if rng.bool() {
        Scope::Link {
            process: process.clone(),
            service,
        }
    } else {
        Scope::Service(service)
    };
    let (scope, fault, lasting) = match rng.u8(0..11) {
        0..=2 => (
            scope,
            Fault::Latency(millis(rng, 5, 150)),
            millis(rng, 500, 3_000),
        ),
        3..=5 => (scope, Fault::Reset, Duration::ZERO),
        6..=7 => (scope, Fault::BlackHole, millis(rng, 300, 3_000)),
        8 => (
            scope,
            Fault::SlowClose(millis(rng, 100, 2_000)),
            millis(rng, 1_000, 3_000),
        ),
        _ => (
            Scope::Process(process),
            Fault::BlackHole,
            millis(rng, 1_000, 12_000),
        ),
    };
    Episode {
        at,
        scope,
        fault,
        lasting,
    }
}

fn millis(rng: &mut fastrand::Rng, from: u64, to: u64) -> Duration {
    Duration::from_millis(rng.u64(from..to))
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Link { process, service } => write!(f, "{process} → {service}"),
            Self::Service(service) => write!(f, "every link to {service}"),
            Self::Process(process) => write!(f, "every link of {process}"),
        }
    }
}

impl fmt::Display for Episode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = self.at.as_secs_f64();
        let lasting = self.lasting.as_secs_f64();
        match (self.fault, &self.scope) {
            (Fault::Reset, scope) => write!(f, "{at:.1} s: reset {scope}"),
            (Fault::BlackHole, Scope::Process(p)) => {
                write!(f, "{at:.1} s: partition {p} for {lasting:.1} s")
            }
            (Fault::BlackHole, scope) => {
                write!(f, "{at:.1} s: black-hole {scope} for {lasting:.1} s")
            }
            (Fault::Latency(d), scope) => write!(
                f,
                "{at:.1} s: {} ms latency on {scope} for {lasting:.1} s",
                d.as_millis()
            ),
            (Fault::SlowClose(d), scope) => write!(
                f,
                "{at:.1} s: closes {} ms late on {scope} for {lasting:.1} s",
                d.as_millis()
            ),
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed {}:", self.seed)?;
        for episode in &self.episodes {
            write!(f, "\n  {episode}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROCESSES: [&str; 2] = ["a", "b"];
    const SERVICES: [&str; 2] = ["postgres", "nats"];

    #[test]
    fn a_seed_replays_its_schedule_and_another_seed_differs() {
        let span = Duration::from_secs(20);
        let draw = |seed| Schedule::draw(seed, &PROCESSES, &SERVICES, span);
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn episodes_never_overlap_and_start_within_the_span() {
        for seed in 0..200 {
            let span = Duration::from_secs(15);
            let schedule = Schedule::draw(seed, &PROCESSES, &SERVICES, span);
            assert!(!schedule.episodes.is_empty());
            for pair in schedule.episodes.windows(2) {
                assert!(pair[0].at + pair[0].lasting < pair[1].at, "{schedule}");
            }
            assert!(schedule.episodes.iter().all(|e| e.at < span));
        }
    }

    #[test]
    fn over_many_seeds_every_kind_of_fault_is_drawn() {
        let episodes: Vec<Episode> = (0..50)
            .flat_map(|seed| {
                Schedule::draw(seed, &PROCESSES, &SERVICES, Duration::from_secs(15)).episodes
            })
            .collect();
        let any = |f: &dyn Fn(&Episode) -> bool| episodes.iter().any(f);
        assert!(any(&|e| matches!(e.fault, Fault::Latency(_))));
        assert!(any(&|e| e.fault == Fault::Reset));
        assert!(any(
            &|e| e.fault == Fault::BlackHole && !matches!(e.scope, Scope::Process(_))
        ));
        assert!(any(&|e| matches!(e.fault, Fault::SlowClose(_))));
        assert!(any(&|e| e.fault == Fault::BlackHole
            && matches!(e.scope, Scope::Process(_))
            && e.lasting > Duration::from_secs(10)));
    }

    #[test]
    fn a_partition_covers_one_process_only() {
        let scope = Scope::Process("a".into());
        assert!(scope.covers("a", "postgres") && scope.covers("a", "nats"));
        assert!(!scope.covers("b", "postgres"));
        let link = Scope::Link {
            process: "b".into(),
            service: "nats".into(),
        };
        assert!(link.covers("b", "nats") && !link.covers("b", "postgres"));
        assert!(Scope::Service("nats".into()).covers("a", "nats"));
    }
}
