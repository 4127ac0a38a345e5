//! The fault schedule: which failpoint crashes the system after how many
//! accepted orders, and when the payments service misbehaves.
//!
//! It is a pure function of the seed (and of the run's size), so a failing
//! run is replayed by passing its seed again. Crashes are placed by
//! progress (accepted orders), not wall time: on a slow machine the same
//! seed still crashes the system at the same point of the workload, while
//! work is in flight for the armed component to trip over.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::shop::services::PaymentsFaults;

/// Every crash point in keel-messaging between two durable steps: the
/// relay's, the consumer's and the saga orchestrator's.
pub const FAILPOINTS: [&str; 11] = [
    "relay-after-claim",
    "relay-after-publish",
    "relay-after-mark",
    "consumer-after-inbox",
    "consumer-after-handler",
    "consumer-after-commit",
    "consumer-after-ack",
    "consumer-after-dead-letter",
    "keel-saga-after-claim",
    "keel-saga-after-step",
    "keel-saga-after-compensation",
];

/// The failpoint that only fires when a message is dead-lettered: the run
/// sends a poison order when it arms it.
pub const DEAD_LETTER_FAILPOINT: &str = "consumer-after-dead-letter";

/// The failpoint that only fires when a saga compensates: the run sends an
/// order that must be refunded when it arms it, since the workload's own
/// compensations (payment outages, rare stock) may all be over by then.
pub const COMPENSATION_FAILPOINT: &str = "keel-saga-after-compensation";

/// How slow a slow payments answer is: longer than the caller's attempt
/// timeout, so every slow call times out and is retried.
const SLOW_DELAY: Duration = Duration::from_millis(600);

/// A schedule that cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A failpoint name that keel-messaging does not have.
    #[error("unknown failpoint `{0}`; the failpoints are: {list}", list = FAILPOINTS.join(", "))]
    UnknownFailpoint(String),
    /// Crashes were asked for a run of no orders.
    #[error("a run with crashes needs at least one order")]
    NoOrders,
}

impl keel_core::Classify for ScheduleError {
    fn class(&self) -> keel_core::ErrorClass {
        keel_core::ErrorClass::Permanent
    }
}

/// A crash: once `after_orders` orders are accepted, `failpoint` is armed
/// (it fires once); when it fires the whole system is restarted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Crash {
    /// Accepted orders before the failpoint is armed.
    pub after_orders: u64,
    /// The failpoint.
    pub failpoint: String,
}

/// A payments outage in one incarnation of the system (the first is 0,
/// each restart starts the next): from its `after_captures`-th capture on,
/// payments answers `503` for `fail_for`, then answers too slowly for
/// `slow_for`, then captures and answers too late for half as long, then
/// captures and answers `500` for half as long, then recovers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PaymentsOutage {
    /// Which incarnation (0 = before the first crash).
    pub incarnation: u32,
    /// Healthy captures in that incarnation before the outage.
    pub after_captures: u64,
    /// Milliseconds of `503`.
    pub fail_ms: u64,
    /// Milliseconds of answers slower than the attempt timeout.
    pub slow_ms: u64,
}

impl PaymentsOutage {
    /// The payments service's configuration for this outage.
    pub fn faults(&self) -> PaymentsFaults {
        PaymentsFaults {
            start_after: Some(self.after_captures),
            fail_for: Duration::from_millis(self.fail_ms),
            slow_for: Duration::from_millis(self.slow_ms),
            slow_delay: SLOW_DELAY,
            // Derived, not drawn: the seeds' schedules stay as they were.
            late_for: Duration::from_millis(self.slow_ms / 2),
            error_for: Duration::from_millis(self.slow_ms / 2),
        }
    }
}

/// A broker outage: once `after_orders` orders are accepted, for `for_ms`
/// milliseconds a share of publishes and receives fails and a share is
/// delayed (see [`BROKER_ABORT_PERCENT`] and [`BROKER_DELAY`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BrokerOutage {
    /// Accepted orders before the outage begins.
    pub after_orders: u64,
    /// How long it lasts, in milliseconds.
    pub for_ms: u64,
}

/// The share of broker calls failed during an outage.
pub const BROKER_ABORT_PERCENT: f64 = 30.0;
/// The share of broker calls delayed during an outage.
pub const BROKER_DELAY_PERCENT: f64 = 30.0;
/// How long a delayed broker call waits.
pub const BROKER_DELAY: Duration = Duration::from_millis(150);

impl fmt::Display for BrokerOutage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "after order {:>5}: broker outage for {} ms ({BROKER_ABORT_PERCENT} % of publishes and \
             receives fail, {BROKER_DELAY_PERCENT} % wait {} ms)",
            self.after_orders,
            self.for_ms,
            BROKER_DELAY.as_millis()
        )
    }
}

/// The whole plan of a chaos run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Schedule {
    /// The seed it was derived from.
    pub seed: u64,
    /// Crashes, by ascending `after_orders`.
    pub crashes: Vec<Crash>,
    /// Payments outages, by incarnation.
    pub payments: Vec<PaymentsOutage>,
    /// Broker outages, by ascending `after_orders`.
    pub broker: Vec<BrokerOutage>,
}

impl Schedule {
    /// Derives the schedule for a run of `orders` orders with `crashes`
    /// crashes. The failpoints are `failpoints` in that order (repeated as
    /// needed) when given, otherwise a seeded shuffle of [`FAILPOINTS`]
    /// (each used once before any repeats).
    pub fn new(
        seed: u64,
        orders: u64,
        crashes: u32,
        failpoints: &[String],
    ) -> Result<Self, ScheduleError> {
        if let Some(unknown) = failpoints
            .iter()
            .find(|f| !FAILPOINTS.contains(&f.as_str()))
        {
            return Err(ScheduleError::UnknownFailpoint(unknown.clone()));
        }
        if crashes > 0 && orders == 0 {
            return Err(ScheduleError::NoOrders);
        }
        let mut rng = fastrand::Rng::with_seed(seed);
        let pool: Vec<String> = if failpoints.is_empty() {
            let mut all: Vec<String> = FAILPOINTS.iter().map(|f| (*f).to_owned()).collect();
            rng.shuffle(&mut all);
            all
        } else {
            failpoints.to_vec()
        };
        // Crashes land between 10 % and 85 % of the workload, so there is
        // traffic in flight for the armed component to trip over.
        let low = (orders / 10).max(1).min(orders);
        let high = (orders * 85 / 100).max(low);
        let mut offsets: Vec<u64> = (0..crashes).map(|_| rng.u64(low..=high)).collect();
        offsets.sort_unstable();
        let crashes_planned: Vec<Crash> = offsets
            .into_iter()
            .zip(pool.iter().cycle())
            .map(|(after_orders, failpoint)| Crash {
                after_orders,
                failpoint: failpoint.clone(),
            })
            .collect();
        let per_incarnation = orders / (u64::from(crashes) + 1);
        let mut payments = Vec::new();
        for incarnation in 0..=crashes {
            if incarnation > 0 && !rng.bool() {
                continue;
            }
            payments.push(PaymentsOutage {
                incarnation,
                after_captures: rng.u64(5..=(per_incarnation / 2).max(5)),
                fail_ms: rng.u64(200..=800),
                slow_ms: rng.u64(200..=800),
            });
        }
        let outages = (crashes / 2).max(1);
        let mut broker: Vec<BrokerOutage> = (0..outages)
            .filter(|_| orders > 0)
            .map(|_| BrokerOutage {
                after_orders: rng.u64((orders / 20).max(1)..=(orders * 9 / 10).max(1)),
                for_ms: rng.u64(300..=1_500),
            })
            .collect();
        broker.sort_by_key(|b| b.after_orders);
        Ok(Self {
            seed,
            crashes: crashes_planned,
            payments,
            broker,
        })
    }

    /// The payments faults of incarnation `incarnation`.
    pub fn payments_faults(&self, incarnation: u32) -> PaymentsFaults {
        self.payments
            .iter()
            .find(|p| p.incarnation == incarnation)
            .map_or_else(PaymentsFaults::none, PaymentsOutage::faults)
    }

    /// One line per fault, in the order they happen: each payments outage
    /// right after the restart that begins its incarnation.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let mut payments = self.payments.iter().peekable();
        let mut broker = self.broker.iter().peekable();
        for incarnation in 0..=self.crashes.len() {
            let n = u32::try_from(incarnation).unwrap_or(u32::MAX);
            while let Some(outage) = payments.next_if(|o| o.incarnation == n) {
                lines.push(outage.to_string());
            }
            let crash = self.crashes.get(incarnation);
            let before_crash =
                |b: &&BrokerOutage| crash.is_none_or(|c| b.after_orders < c.after_orders);
            while let Some(outage) = broker.next_if(before_crash) {
                lines.push(outage.to_string());
            }
            if let Some(crash) = crash {
                lines.push(format!("{crash} (restart #{})", incarnation + 1));
            }
        }
        lines
    }
}

impl fmt::Display for Crash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "after order {:>5}: crash at {}, restart on the same files",
            self.after_orders, self.failpoint
        )
    }
}

impl fmt::Display for PaymentsOutage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "incarnation {}, capture {:>3}: payments 503 for {} ms, then slower than the timeout for {} ms, \
             then applied and answered late for {} ms, then applied and answered 500 for {} ms",
            self.incarnation,
            self.after_captures,
            self.fail_ms,
            self.slow_ms,
            self.slow_ms / 2,
            self.slow_ms / 2
        )
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "fault schedule (seed {}):", self.seed)?;
        for line in self.lines() {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        for seed in [0, 1, 42, u64::MAX] {
            let a = Schedule::new(seed, 500, 6, &[]).unwrap();
            let b = Schedule::new(seed, 500, 6, &[]).unwrap();
            assert_eq!(a, b);
            assert_eq!(a.to_string(), b.to_string());
            assert!(!a.broker.is_empty());
        }
    }

    #[test]
    fn different_seeds_give_different_schedules() {
        let schedules: Vec<Schedule> = (0..20)
            .map(|seed| Schedule::new(seed, 500, 6, &[]).unwrap())
            .collect();
        for (i, a) in schedules.iter().enumerate() {
            for b in &schedules[i + 1..] {
                assert_ne!(a.crashes, b.crashes, "seeds {} and {}", a.seed, b.seed);
            }
        }
    }

    #[test]
    fn crashes_are_ordered_inside_the_workload_and_cover_distinct_failpoints() {
        let s = Schedule::new(9, 500, 11, &[]).unwrap();
        assert_eq!(s.crashes.len(), 11);
        assert!(
            s.crashes
                .windows(2)
                .all(|w| w[0].after_orders <= w[1].after_orders)
        );
        assert!(
            s.crashes
                .iter()
                .all(|c| (50..=425).contains(&c.after_orders))
        );
        let mut names: Vec<&str> = s.crashes.iter().map(|c| c.failpoint.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(
            names.len(),
            FAILPOINTS.len(),
            "each failpoint once before repeats"
        );
    }

    #[test]
    fn given_failpoints_are_used_in_order() {
        let wanted = vec![
            "relay-after-publish".to_owned(),
            "consumer-after-ack".to_owned(),
        ];
        let s = Schedule::new(3, 100, 3, &wanted).unwrap();
        let used: Vec<&str> = s.crashes.iter().map(|c| c.failpoint.as_str()).collect();
        assert_eq!(
            used,
            [
                "relay-after-publish",
                "consumer-after-ack",
                "relay-after-publish"
            ]
        );
    }

    #[test]
    fn unknown_failpoints_and_empty_runs_are_refused() {
        assert_eq!(
            Schedule::new(1, 100, 1, &["relay-after-lunch".to_owned()]),
            Err(ScheduleError::UnknownFailpoint("relay-after-lunch".into()))
        );
        assert_eq!(Schedule::new(1, 0, 1, &[]), Err(ScheduleError::NoOrders));
        assert!(Schedule::new(1, 0, 0, &[]).unwrap().crashes.is_empty());
    }

    #[test]
    fn the_first_incarnation_always_has_a_payments_outage() {
        for seed in 0..50 {
            let s = Schedule::new(seed, 500, 4, &[]).unwrap();
            assert_eq!(s.payments.first().map(|p| p.incarnation), Some(0));
            assert!(s.payments_faults(0).start_after.is_some());
            assert!(s.payments.iter().all(|p| p.incarnation <= 4));
        }
    }

    #[test]
    fn the_printed_schedule_has_one_line_per_fault() {
        let s = Schedule::new(42, 500, 3, &[]).unwrap();
        assert_eq!(
            s.lines().len(),
            s.crashes.len() + s.payments.len() + s.broker.len()
        );
        assert!(s.to_string().starts_with("fault schedule (seed 42):"));
    }
}
