//! The state machine: who may call, what an outcome changes, and the
//! transitions.
//!
//! Deciding whether a call may go is lock-free: one atomic load of the packed
//! [`Word`], plus a second load while open, and a clock read only once the
//! [cool-down timer](super::cool_down) has fired. Transitions are
//! rare and take the `control` lock, which makes their side effects (the
//! open-until instant, clearing the window, events) happen exactly once and
//! in order; the new state is published last, so a caller that sees it also
//! sees everything it depends on.

use std::num::NonZeroU64;
use std::sync::Weak;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_core::{Name, Rejected};
use parking_lot::Mutex;
use tokio::sync::broadcast;

use super::cool_down::{self, CoolDown};
use super::reason::Reason;
use super::state::Word;
use super::telemetry::Telemetry;
use super::window::{Sample, Tally, Window};
use super::{BreakerMetrics, CircuitBreakerConfig, Outcome, State, StateTransition};

/// The permission a call was let through with: its kind in the low byte
/// (never zero), the generation above. One aligned word, so that
/// `Result<Ticket, ProbeAt>` comes back in two registers and a permit
/// moves as three words; the hot path never copies a [`Rejected`] around,
/// which is built only when refusing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ticket(NonZeroU64);

/// A refusal before it becomes a [`Rejected`]: when a probe will be let
/// through, in nanoseconds since the breaker's `base`.
#[derive(Debug, Clone, Copy)]
pub(super) struct ProbeAt(u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TicketKind {
    Closed = 1,
    Probe = 2,
    Disabled = 3,
}

impl Ticket {
    fn new(generation: u32, kind: TicketKind) -> Self {
        let bits = u64::from(generation) << 8 | kind as u64;
        Self(NonZeroU64::new(bits).unwrap_or(NonZeroU64::MIN))
    }

    fn generation(self) -> u32 {
        (self.0.get() >> 8) as u32
    }

    fn kind(self) -> TicketKind {
        match self.0.get() & 0xFF {
            2 => TicketKind::Probe,
            3 => TicketKind::Disabled,
            _ => TicketKind::Closed,
        }
    }

    pub(super) fn is_probe(self) -> bool {
        self.kind() == TicketKind::Probe
    }
}

/// The configuration in the form the hot path reads.
#[derive(Debug)]
struct Limits {
    failure_rate: f64,
    slow_rate: f64,
    slow_after: Option<Duration>,
    minimum_calls: u64,
    consecutive: Option<u32>,
    probes: u16,
    open_duration: Duration,
    max_open_duration: Duration,
    jitter: f64,
    max_wait_in_half_open: Option<Duration>,
}

/// What transitions need, behind the transition lock.
#[derive(Debug)]
struct Control {
    /// Probes failed since the breaker last closed: the open duration's exponent.
    reopened: u32,
    rng: Option<fastrand::Rng>,
    /// The timer of the current open state, if one is armed.
    cool_down: Option<CoolDown>,
}

#[derive(Debug)]
pub(super) struct Inner {
    word: AtomicU64,
    /// Nanoseconds since `base`: while open, when probing may start; while
    /// half-open, when unanswered probes count as failed.
    deadline: AtomicU64,
    consecutive: AtomicU32,
    base: Instant,
    limits: Limits,
    window: Window,
    control: Mutex<Control>,
    telemetry: Telemetry,
    config: CircuitBreakerConfig,
    /// For the cool-down timer's waker, which must not keep the breaker alive.
    this: Weak<Inner>,
}

impl Inner {
    pub(super) fn new(config: CircuitBreakerConfig, name: Name, this: Weak<Inner>) -> Self {
        let limits = Limits {
            failure_rate: config.failure_rate_threshold,
            slow_rate: config.slow_call_rate_threshold,
            slow_after: config.slow_call_duration_threshold,
            minimum_calls: u64::from(config.minimum_calls),
            consecutive: config.consecutive_failures,
            probes: u16::try_from(config.permitted_calls_in_half_open)
                .unwrap_or(u16::MAX)
                .max(1),
            open_duration: config.open_duration,
            max_open_duration: config.max_open_duration,
            jitter: config.open_duration_jitter,
            max_wait_in_half_open: config.max_wait_in_half_open,
        };
        Self {
            word: AtomicU64::new(Word::new(State::Closed, 0).0),
            deadline: AtomicU64::new(0),
            consecutive: AtomicU32::new(0),
            base: clock::now(),
            window: Window::new(config.sliding_window),
            control: Mutex::new(Control {
                reopened: 0,
                rng: config.seed.map(fastrand::Rng::with_seed),
                cool_down: None,
            }),
            telemetry: Telemetry::new(name),
            limits,
            config,
            this,
        }
    }

    pub(super) fn name(&self) -> &Name {
        self.telemetry.name()
    }

    pub(super) fn config(&self) -> &CircuitBreakerConfig {
        &self.config
    }

    pub(super) fn state(&self) -> State {
        self.load().state()
    }

    pub(super) fn subscribe(&self) -> broadcast::Receiver<StateTransition> {
        self.telemetry.subscribe()
    }

    #[cfg(test)]
    pub(super) fn cooling(&self) -> bool {
        self.load().cooling()
    }

    /// What a transition to half-open racing a refusal leaves it to read.
    #[cfg(test)]
    pub(super) fn forget_deadline(&self) {
        self.deadline.store(u64::MAX, Release);
    }

    #[inline]
    fn load(&self) -> Word {
        Word(self.word.load(Acquire))
    }

    fn nanos_at(&self, at: Instant) -> u64 {
        nanos(at.saturating_duration_since(self.base))
    }

    fn instant_at(&self, nanos: u64) -> Instant {
        later(self.base, Duration::from_nanos(nanos))
    }

    /// Asks to make a call. Lock-free unless this caller is the one that
    /// moves the breaker from open to half-open.
    #[inline]
    pub(super) fn acquire(&self) -> Result<Ticket, ProbeAt> {
        loop {
            let word = self.load();
            let decided = match word.state() {
                State::Closed => Some(Ok(self.ticket(word.generation(), TicketKind::Closed))),
                State::Open if word.cooling() => {
                    Some(Err(self.probe_at(self.deadline.load(Acquire))))
                }
                State::Open => self.acquire_while_open(word),
                State::HalfOpen => self.acquire_probe(word),
                State::Disabled => Some(Ok(self.ticket(word.generation(), TicketKind::Disabled))),
                State::ForcedOpen => Some(Err(self.probe_after(self.limits.open_duration))),
            };
            if let Some(decided) = decided {
                return decided;
            }
        }
    }

    #[inline]
    fn ticket(&self, generation: u32, kind: TicketKind) -> Ticket {
        Ticket::new(generation, kind)
    }

    /// When a call starts, in nanoseconds since `base`; only read when slow
    /// calls are measured.
    #[inline]
    pub(super) fn started(&self) -> u64 {
        match self.limits.slow_after {
            Some(_) => self.nanos_at(clock::now()),
            None => 0,
        }
    }

    #[inline]
    pub(super) fn refuse(&self, probe_at: ProbeAt) -> Rejected {
        self.telemetry.rejected(self.instant_at(probe_at.0))
    }

    /// The refusal's probe time for the deadline `until`, which has none
    /// (`u64::MAX`) while half-open without a wait limit: then the open
    /// duration is the hint. A cooling breaker's refusal can meet that
    /// too, when a move to half-open races its read of the deadline.
    #[inline]
    fn probe_at(&self, until: u64) -> ProbeAt {
        match until {
            u64::MAX => self.probe_after(self.limits.open_duration),
            until => ProbeAt(until),
        }
    }

    /// A refusal whose probe time is only a hint (forced open, or every
    /// probe in flight): `wait` from now.
    #[cold]
    fn probe_after(&self, wait: Duration) -> ProbeAt {
        ProbeAt(self.nanos_at(clock::now()).saturating_add(nanos(wait)))
    }

    /// `None` means the state changed under us: look again.
    fn acquire_while_open(&self, seen: Word) -> Option<Result<Ticket, ProbeAt>> {
        let now = self.nanos_at(clock::now());
        let until = self.deadline.load(Acquire);
        if now < until {
            return Some(Err(self.probe_at(until)));
        }
        let next = self.transition_if(seen, State::HalfOpen, &Reason::CoolDownElapsed)?;
        Some(Ok(self.ticket(next.generation(), TicketKind::Probe)))
    }

    /// A probe slot is claimed by compare-and-swap on the same word that holds
    /// the state, so no interleaving can let more than the permitted number in.
    fn acquire_probe(&self, seen: Word) -> Option<Result<Ticket, ProbeAt>> {
        if seen.issued() < self.limits.probes {
            let claimed = seen.with_issued(seen.issued() + 1);
            let won = self
                .word
                .compare_exchange(seen.0, claimed.0, AcqRel, Acquire)
                .is_ok();
            return won.then(|| Ok(self.ticket(seen.generation(), TicketKind::Probe)));
        }
        let now = self.nanos_at(clock::now());
        let until = self.deadline.load(Acquire);
        if now < until {
            return Some(Err(self.probe_at(until)));
        }
        self.transition_if(seen, State::Open, &Reason::ProbesUnanswered);
        None
    }

    /// Records how a permitted call went.
    #[inline]
    pub(super) fn complete(&self, ticket: Ticket, started: u64, outcome: Outcome) {
        let success = outcome == Outcome::Success && ticket.kind() != TicketKind::Probe;
        if !(success && self.success_changes_nothing()) {
            self.settle(ticket, started, outcome);
        }
    }

    /// A success that is not a probe, with no duration to measure, no run
    /// of failures to end and a window already full of successes, would
    /// record nothing new: the healthy steady state stops here, inlined into
    /// the caller, having only read shared memory.
    #[inline]
    fn success_changes_nothing(&self) -> bool {
        self.limits.slow_after.is_none()
            && self.window.all_succeeded()
            && self.consecutive.load(Relaxed) == 0
    }

    #[inline(never)]
    fn settle(&self, ticket: Ticket, started: u64, outcome: Outcome) {
        match outcome {
            Outcome::Ignored => {
                self.telemetry.ignored();
                return self.abandon(ticket);
            }
            Outcome::Failure => self.telemetry.failure(),
            Outcome::Success => {}
        }
        let failed = outcome == Outcome::Failure;
        match ticket.kind() {
            TicketKind::Probe => self.complete_probe(ticket, started, failed),
            TicketKind::Closed | TicketKind::Disabled => {
                self.complete_closed(ticket, started, failed)
            }
        }
    }

    /// A permitted call ended without an outcome (cancelled, or ignored): a
    /// probe gives its slot back, so that half-open cannot wedge.
    #[inline]
    pub(super) fn abandon(&self, ticket: Ticket) {
        if ticket.kind() != TicketKind::Probe {
            return;
        }
        let mut seen = self.load();
        while seen.state() == State::HalfOpen
            && seen.generation() == ticket.generation()
            && seen.issued() > seen.succeeded()
        {
            let released = seen.with_issued(seen.issued() - 1);
            match self
                .word
                .compare_exchange(seen.0, released.0, AcqRel, Acquire)
            {
                Ok(_) => return,
                Err(now) => seen = Word(now),
            }
        }
    }

    #[inline]
    fn complete_closed(&self, ticket: Ticket, started: u64, failed: bool) {
        let seen = self.load();
        if seen.generation() != ticket.generation() {
            return;
        }
        let timed = self.window.is_timed() || self.limits.slow_after.is_some();
        let now = if timed {
            self.nanos_at(clock::now())
        } else {
            0
        };
        let sample = Sample {
            failed,
            slow: self.is_slow(started, now),
        };
        let tally = self.window.record(sample, now / 1_000_000_000);
        let run = self.count_run(failed);
        if ticket.kind() == TicketKind::Disabled {
            return;
        }
        let consecutive = self
            .limits
            .consecutive
            .filter(|limit| run >= *limit)
            .map(|_| Reason::Consecutive(run));
        if let Some(why) = consecutive.or_else(|| tally.and_then(|t| self.rates_exceeded(t))) {
            self.transition_if(seen, State::Open, &why);
        }
    }

    /// Counts failures in a row; a success only writes when it ends a run.
    #[inline]
    fn count_run(&self, failed: bool) -> u32 {
        if failed {
            return self.consecutive.fetch_add(1, AcqRel).saturating_add(1);
        }
        if self.consecutive.load(Relaxed) != 0 {
            self.consecutive.store(0, Relaxed);
        }
        0
    }

    /// `started` and `now` are nanoseconds since `base`, read only when slow
    /// calls are measured.
    fn is_slow(&self, started: u64, now: u64) -> bool {
        self.limits
            .slow_after
            .is_some_and(|limit| now.saturating_sub(started) >= nanos(limit))
    }

    fn rates_exceeded(&self, tally: Tally) -> Option<Reason> {
        if tally.calls < self.limits.minimum_calls {
            return None;
        }
        let calls = tally.calls as f64;
        if tally.failures as f64 * 100.0 >= self.limits.failure_rate * calls {
            return Some(Reason::FailureRate(tally));
        }
        (tally.slow as f64 * 100.0 >= self.limits.slow_rate * calls)
            .then_some(Reason::SlowRate(tally))
    }

    /// One bad probe reopens; the breaker closes only when every permitted
    /// probe succeeded. Never average here.
    fn complete_probe(&self, ticket: Ticket, started: u64, failed: bool) {
        let slow = self.is_slow(started, self.started());
        let mut control = self.control.lock();
        let current = self.load();
        if current.state() != State::HalfOpen || current.generation() != ticket.generation() {
            return;
        }
        if failed || slow {
            let why = if failed {
                Reason::ProbeFailed
            } else {
                Reason::ProbeSlow
            };
            self.enter(&mut control, current, State::Open, &why);
            return;
        }
        let succeeded = self.count_probe_success(current);
        if succeeded >= self.limits.probes {
            self.enter(
                &mut control,
                self.load(),
                State::Closed,
                &Reason::ProbesSucceeded(succeeded),
            );
        }
    }

    /// Only probe counts can change while the transition lock is held.
    fn count_probe_success(&self, mut seen: Word) -> u16 {
        loop {
            let next = seen.with_succeeded(seen.succeeded().saturating_add(1));
            match self.word.compare_exchange(seen.0, next.0, AcqRel, Acquire) {
                Ok(_) => return next.succeeded(),
                Err(now) => seen = Word(now),
            }
        }
    }

    /// Moves to `to` if the breaker is still in the state `seen` showed.
    #[cold]
    fn transition_if(&self, seen: Word, to: State, why: &Reason) -> Option<Word> {
        let mut control = self.control.lock();
        let current = self.load();
        current
            .same_epoch(seen)
            .then(|| self.enter(&mut control, current, to, why))
    }

    /// An operator's transition: always applies (reset also from closed, to
    /// clear the window), except forcing a state the breaker is already in.
    #[cold]
    pub(super) fn force(&self, to: State, why: &'static str) {
        let mut control = self.control.lock();
        let current = self.load();
        if current.state() != to || to == State::Closed {
            self.enter(&mut control, current, to, &Reason::Operator(why));
        }
    }

    #[cold]
    fn enter(&self, control: &mut Control, from: Word, to: State, why: &Reason) -> Word {
        let at = clock::now();
        let now = self.nanos_at(at);
        let mut open_for = None;
        match to {
            State::Open => {
                if from.state() == State::HalfOpen {
                    control.reopened = control.reopened.saturating_add(1);
                }
                let open = self.open_duration(control);
                self.deadline
                    .store(now.saturating_add(nanos(open)), Release);
                open_for = Some(open);
            }
            State::HalfOpen => {
                let give_up = self
                    .limits
                    .max_wait_in_half_open
                    .map_or(u64::MAX, |w| now.saturating_add(nanos(w)));
                self.deadline.store(give_up, Release);
            }
            State::Closed => {
                self.window.clear();
                self.consecutive.store(0, Release);
                control.reopened = 0;
            }
            State::ForcedOpen | State::Disabled => {}
        }
        // The caller that opens half-open holds its first probe.
        let probes = u16::from(to == State::HalfOpen);
        let cooling = open_for.is_some_and(cool_down::can_arm);
        let next = Word::new(to, from.next_generation())
            .with_issued(probes)
            .with_cooling(cooling);
        self.word.store(next.0, Release);
        // Armed only once the word is published, so that a timer firing at
        // once finds the state it was armed for.
        control.cool_down = match open_for {
            Some(open) if cooling => cool_down::arm(self.this.clone(), next, later(at, open), open),
            _ => None,
        };
        if from.state() != to {
            self.telemetry.transition(from.state(), to, at, why);
        }
        next
    }

    /// The cool-down timer of the open state `armed` fired: refusals read
    /// the clock again, so the first call once the cool-down is over probes.
    pub(super) fn cool_down_over(&self, armed: Word) {
        let mut seen = self.load();
        while seen.same_epoch(armed) && seen.cooling() {
            let cleared = seen.with_cooling(false);
            match self
                .word
                .compare_exchange(seen.0, cleared.0, AcqRel, Acquire)
            {
                Ok(_) => return,
                Err(now) => seen = Word(now),
            }
        }
    }

    /// `min(open_duration × 2^reopened, max_open_duration) × (1 ± jitter)`.
    fn open_duration(&self, control: &mut Control) -> Duration {
        let exponent = i32::try_from(control.reopened.min(64)).unwrap_or(64);
        let doubled = self.limits.open_duration.as_secs_f64() * 2f64.powi(exponent);
        let capped = doubled.min(self.limits.max_open_duration.as_secs_f64());
        let jitter = self.limits.jitter;
        let spread = match &mut control.rng {
            _ if jitter == 0.0 => 0.0,
            Some(rng) => jitter * (2.0 * rng.f64() - 1.0),
            None => jitter * (2.0 * fastrand::f64() - 1.0),
        };
        Duration::try_from_secs_f64(capped * (1.0 + spread))
            .unwrap_or(self.limits.max_open_duration)
    }

    pub(super) fn metrics(&self) -> BreakerMetrics {
        let word = self.load();
        let now = self.nanos_at(clock::now());
        let tally = self.window.tally(now / 1_000_000_000);
        let evaluated =
            tally.calls >= self.limits.minimum_calls && !matches!(self.window, Window::Off);
        let rate = |n: u64| evaluated.then(|| n as f64 * 100.0 / tally.calls as f64);
        let until = self.deadline.load(Acquire);
        BreakerMetrics {
            state: word.state(),
            failure_rate: rate(tally.failures),
            slow_call_rate: rate(tally.slow),
            buffered_calls: tally.calls,
            failed_calls: tally.failures,
            slow_calls: tally.slow,
            consecutive_failures: self.consecutive.load(Relaxed),
            probes_in_flight: match word.state() {
                State::HalfOpen => word.issued().saturating_sub(word.succeeded()),
                _ => 0,
            },
            retry_after: (word.state() == State::Open)
                .then(|| Duration::from_nanos(until.saturating_sub(now))),
        }
    }
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// `at + wait`, saturating at a century instead of overflowing.
fn later(at: Instant, wait: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 86_400);
    at + wait.min(CENTURY)
}
