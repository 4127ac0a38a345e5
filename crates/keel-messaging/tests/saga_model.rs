//! The saga orchestrator (on SQLite) against a reference model of its
//! state machine, on definitions and environments proptest generates.
//! The environment may do everything the real world does to a call: answer
//! it, fail it (retryable, permanent), refuse it before it leaves (with or
//! without a `Retry-After`), time out after its effect or before it, or
//! stall mid-call, effect done or not, after which the process dies (a
//! crash between the claim and the outcome) or wakes up late and delivers
//! a stale outcome after another orchestrator took over. The clock jumps
//! past backoffs, leases, the forward budget and the saga's deadline, and
//! an operator retries stuck sagas. Every drive reloads the saga from the
//! store, so a crash is a reload from the persisted record.
//!
//! The model is the machine as `saga/machine.rs` documents it, in whole
//! minutes: attempts counted at the claim (a refusal gives its attempt
//! back); an action's claim marks it maybe applied, which an unknown
//! outcome keeps and compensation honours; a step before the pivot that
//! keeps failing (or fails for good) turns the saga back, compensating in
//! reverse the compensable steps below it (this one too if it may have
//! happened); at or past the pivot (the pivot once it may have happened)
//! the saga only goes forward until its budget is spent, then is stuck;
//! a compensation that keeps failing is stuck; the deadline turns the
//! saga back before the pivot and no longer applies past it; an outcome for
//! a claim that is no longer the saga's latest version changes nothing.
//!
//! Besides the record after every step, the ledger of the environment must
//! show: every call carried its step's derived key; a step was compensated
//! only if its action was sent; no action was sent after a compensation,
//! and compensations ran in reverse order; nothing was compensated once the
//! pivot's effect happened; and when the environment answers and an
//! operator retries what is stuck, the saga ends completed (every effect
//! happened, none undone) or compensated (every effect undone, none at or
//! past the pivot).
//!
//! The model found a saga that no operator could finish: parked by its
//! deadline past the pivot, it was parked again at once when retried.
//! `past_the_pivot_a_passed_deadline_lets_the_saga_go_forward` keeps the
//! case; past the pivot the deadline no longer applies.
//!
//! Time: the orchestrator reads the wall clock, so a clock jump moves every
//! stored instant back. Every duration is whole minutes, so the
//! milliseconds the case takes can never tip a comparison. Calls time out
//! after a minute of real time, which no case lasts.
//!
//! Failing cases are persisted by proptest next to this file and replayed
//! first on the next run.

use std::sync::Arc;
use std::time::Duration;

use keel_messaging::saga::{Backoff, Jitter, SagaDefinition, SagaError, SagaOrchestrator, Step};
use keel_messaging::store::{SagaRecord, SagaStatus, SagaStore, Store};
use keel_sqlite::store::SqliteStore;
use proptest::prelude::*;
use tokio::task::JoinHandle;

const ID: &str = "saga-1";
const NAMES: [&str; 4] = ["charge", "reserve", "ship", "notify"];
const MINUTE: Duration = Duration::from_secs(60);
/// A stuck saga's next attempt: a century ahead, never by the clock.
const FAR: u32 = u32::MAX / 2;

#[path = "saga_model/env.rs"]
mod env;
#[path = "saga_model/model.rs"]
mod model;
use env::Env;
use model::{Call, Def, Model, Outcome};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Ok,
    Retryable,
    Permanent,
    /// A policy refused it before it left, asking to wait these minutes.
    Refused(Option<u32>),
    /// Timed out, after its effect or before it.
    TimedOut {
        applied: bool,
    },
    /// Stalls mid-call, after its effect or before it, until resumed.
    Stall {
        applied: bool,
    },
}

impl Answer {
    fn applies(self) -> bool {
        matches!(
            self,
            Self::Ok | Self::TimedOut { applied: true } | Self::Stall { applied: true }
        )
    }

    /// What a call whose effect happened can still say: not that nothing
    /// happened.
    fn after_effect(self) -> Self {
        match self {
            Self::Retryable | Self::Permanent => Self::TimedOut { applied: true },
            other => other,
        }
    }

    fn outcome(self) -> Outcome {
        match self {
            Self::Ok => Outcome::Done,
            Self::Retryable => Outcome::Retryable,
            Self::Permanent => Outcome::Permanent,
            Self::Refused(after) => Outcome::Refused(after),
            Self::TimedOut { .. } | Self::Stall { .. } => Outcome::Unknown,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// An orchestrator drives the saga; its calls get these answers, then
    /// refusals.
    Drive(Vec<Answer>),
    /// The stalled call returns this; its orchestrator goes on.
    Resume(Answer),
    /// The process of the stalled call dies.
    Kill,
    /// The clock moves, in minutes.
    Advance(u32),
    /// An operator retries the saga.
    OperatorRetry,
}

fn answer() -> impl Strategy<Value = Answer> {
    prop_oneof![
        5 => Just(Answer::Ok),
        2 => Just(Answer::Retryable),
        1 => Just(Answer::Permanent),
        1 => proptest::option::of(1_u32..4).prop_map(Answer::Refused),
        2 => any::<bool>().prop_map(|applied| Answer::TimedOut { applied }),
        1 => any::<bool>().prop_map(|applied| Answer::Stall { applied }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let resume = prop_oneof![
        Just(Answer::Ok),
        Just(Answer::Retryable),
        Just(Answer::Permanent),
        any::<bool>().prop_map(|applied| Answer::TimedOut { applied }),
    ];
    prop_oneof![
        6 => proptest::collection::vec(answer(), 0..5).prop_map(Op::Drive),
        1 => resume.prop_map(Op::Resume),
        1 => Just(Op::Kill),
        3 => prop_oneof![1_u32..3, 3_u32..8].prop_map(Op::Advance),
        1 => Just(Op::OperatorRetry),
    ]
}

fn def() -> impl Strategy<Value = Def> {
    let n = 2_usize..=NAMES.len();
    n.prop_flat_map(|n| {
        (
            proptest::option::of(0..n),
            proptest::collection::vec(proptest::bool::weighted(0.8), n),
            proptest::collection::vec(1_u32..=3, n),
            (1_u32..=3, 0_u32..=4, proptest::option::of(2_u32..=10)),
        )
            .prop_map(move |(pivot, mut compensable, max_attempts, rest)| {
                if let Some(p) = pivot {
                    compensable[p] = false;
                }
                let (stuck_after, budget, deadline) = rest;
                Def {
                    n,
                    pivot,
                    compensable,
                    max_attempts,
                    stuck_after,
                    budget,
                    deadline,
                }
            })
    })
}

fn definition(def: &Def, env: &Arc<Env>) -> SagaDefinition<()> {
    let backoff = Backoff::exponential(MINUTE, 2.0, MINUTE * 4).expect("backoff");
    let mut builder = SagaDefinition::builder("model")
        .backoff(backoff.with_jitter(Jitter::None).expect("no jitter"))
        .stuck_after(def.stuck_after)
        .forward_budget(MINUTE * def.budget)
        .refusal_wait(MINUTE);
    if let Some(d) = def.deadline {
        builder = builder.deadline(MINUTE * d);
    }
    for i in 0..def.n {
        let step = step(env, i, def);
        builder = if def.pivot == Some(i) {
            builder.pivot(step)
        } else {
            builder.step(step)
        };
    }
    builder.build().expect("a valid saga")
}

fn step(env: &Arc<Env>, i: usize, def: &Def) -> Step<()> {
    let run = |env: &Arc<Env>, call: Call| {
        let env = env.clone();
        move |ctx: keel_messaging::saga::StepContext<()>| {
            let env = env.clone();
            async move { env.call(call, ctx.idempotency_key()).await }
        }
    };
    // The step timeout is the lease's half: a real minute no case lasts.
    let step = Step::new(NAMES[i], run(env, Call::Action(i)))
        .timeout(MINUTE)
        .max_attempts(def.max_attempts[i]);
    if def.compensable[i] {
        step.compensate_with(run(env, Call::Undo(i)))
    } else {
        step
    }
}

type Driving = JoinHandle<Result<SagaRecord, SagaError>>;

struct World {
    store: SqliteStore,
    env: Arc<Env>,
    orch: SagaOrchestrator<SqliteStore>,
    straggler: Option<Driving>,
}

impl World {
    async fn new(def: &Def) -> Self {
        let store = SqliteStore::open_in_memory().await.expect("store");
        let env = Arc::new(Env::default());
        let saga = definition(def, &env);
        let orch = SagaOrchestrator::builder(store.clone())
            .saga(&saga)
            .lease_grace(MINUTE)
            .build()
            .expect("orchestrator");
        let mut tx = store.begin().await.expect("begin");
        orch.start(&mut tx, &saga, ID, &()).await.expect("start");
        store.commit(tx).await.expect("commit");
        Self {
            store,
            env,
            orch,
            straggler: None,
        }
    }

    /// Drives the saga until it rests, or until a call stalls.
    async fn drive(&mut self, answers: Vec<Answer>) {
        *self.env.answers.lock() = answers.into();
        let orch = self.orch.clone();
        let mut task = tokio::spawn(async move { orch.drive(ID).await });
        tokio::select! {
            done = &mut task => {
                done.expect("drive task").expect("drive");
            }
            () = self.env.stalled.notified() => self.straggler = Some(task),
        }
    }

    async fn resume(&mut self, answer: Answer) {
        let Some(task) = self.straggler.take() else {
            return;
        };
        self.env.answers.lock().clear();
        let resume = self.env.resume.lock().take().expect("a stalled call");
        resume.send(answer).expect("the call waits");
        task.await.expect("drive task").expect("drive");
    }

    async fn kill(&mut self) {
        if let Some(task) = self.straggler.take() {
            task.abort();
            let _ = task.await;
        }
        self.env.resume.lock().take();
    }

    async fn jump(&self, minutes: u32) {
        let ms = i64::from(minutes) * 60_000;
        sqlx::query(
            "UPDATE keel_sagas SET next_attempt_at = next_attempt_at - ?1,
                    created_at = created_at - ?1, updated_at = updated_at - ?1,
                    first_attempt_at = first_attempt_at - ?1",
        )
        .bind(ms)
        .execute(self.store.pool())
        .await
        .expect("clock jump");
    }

    async fn retry(&self) -> bool {
        match self.orch.retry(ID).await {
            Ok(_) => true,
            Err(SagaError::NotStuck { .. }) => false,
            Err(e) => panic!("operator retry: {e}"),
        }
    }
}

async fn step_op(w: &mut World, m: &mut Model, op: Op) -> Result<(), TestCaseError> {
    // A process woken after a jump would save instants the jump did not
    // move (see `straggler_is_off_clock`): it dies instead.
    let op = match op {
        Op::Resume(_) if m.straggler_is_off_clock() => Op::Kill,
        other => other,
    };
    match op {
        Op::Drive(answers) => {
            // One stalled call at a time: a second stalls as a timeout.
            let answers: Vec<Answer> = answers
                .into_iter()
                .map(|a| match a {
                    Answer::Stall { applied } if m.straggler.is_some() => {
                        Answer::TimedOut { applied }
                    }
                    other => other,
                })
                .collect();
            m.drive(&mut answers.clone().into());
            w.drive(answers).await;
        }
        Op::Kill => {
            m.straggler = None;
            w.kill().await;
        }
        Op::Resume(answer) if w.straggler.is_some() => {
            m.resume(answer);
            w.resume(answer).await;
        }
        Op::Resume(_) => {}
        Op::Advance(minutes) => {
            w.jump(minutes).await;
            m.advance(minutes);
        }
        Op::OperatorRetry => prop_assert_eq!(w.retry().await, m.retry(), "operator retry"),
    }
    compare(w, m).await
}

async fn compare(w: &World, m: &Model) -> Result<(), TestCaseError> {
    let real = w.store.saga_get(ID).await.expect("get").expect("the saga");
    let got = (
        real.status,
        real.step as usize,
        real.attempts,
        real.outcome_unknown,
        real.first_attempt_at.is_some(),
    );
    let r = &m.rec;
    let expected = (r.status, r.step, r.attempts, r.unknown, r.first.is_some());
    prop_assert_eq!(
        got,
        expected,
        "(status, step, attempts, maybe applied, attempted): {:?}",
        real.last_error
    );
    Ok(())
}

/// The environment answers every call from now on, and an operator
/// retries what is stuck: the saga must end.
async fn finish(w: &mut World, m: &mut Model) -> Result<(), TestCaseError> {
    step_op(w, m, Op::Kill).await?;
    for _ in 0..40 {
        if m.rec.status.is_terminal() {
            break;
        }
        if m.rec.status == SagaStatus::Stuck {
            step_op(w, m, Op::OperatorRetry).await?;
        } else if m.rec.next > m.now {
            step_op(w, m, Op::Advance(m.rec.next - m.now)).await?;
        }
        step_op(w, m, Op::Drive(vec![Answer::Ok; 12])).await?;
    }
    prop_assert!(
        m.rec.status.is_terminal(),
        "the saga did not end: {:?}",
        m.rec
    );
    ledger(w, m)
}

/// What the dependencies saw.
fn ledger(w: &World, m: &Model) -> Result<(), TestCaseError> {
    let env = &w.env;
    prop_assert!(
        env.wrong_keys.lock().is_empty(),
        "keys {:?}",
        env.wrong_keys.lock()
    );
    let sent = env.sent.lock().clone();
    let effects = env.effects.lock().clone();
    let mut undoing: Option<usize> = None;
    for (n, call) in sent.iter().enumerate() {
        match *call {
            Call::Action(i) => prop_assert!(undoing.is_none(), "action {} after an undo", i),
            Call::Undo(j) => {
                prop_assert!(
                    undoing.is_none_or(|u| j <= u),
                    "undo {} after {:?}",
                    j,
                    undoing
                );
                prop_assert!(
                    sent[..n].contains(&Call::Action(j)),
                    "undo {} never sent",
                    j
                );
                undoing = Some(j);
            }
        }
    }
    if let Some(p) = m.def.pivot
        && effects.contains(&Call::Action(p))
    {
        prop_assert!(undoing.is_none(), "compensated after the pivot happened");
    }
    let happened = |i: usize| effects.contains(&Call::Action(i));
    match m.rec.status {
        SagaStatus::Completed => {
            prop_assert!((0..m.def.n).all(happened), "completed: {:?}", effects);
            prop_assert!(undoing.is_none(), "completed after compensating");
        }
        SagaStatus::Compensated => {
            let from = m.def.pivot.unwrap_or(m.def.n);
            prop_assert!(!(from..m.def.n).any(happened), "{:?}", effects);
            for j in (0..from).filter(|&j| m.def.compensable[j] && happened(j)) {
                prop_assert!(effects.contains(&Call::Undo(j)), "{} not undone", j);
            }
        }
        _ => {}
    }
    Ok(())
}

async fn run(def: Def, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut world = World::new(&def).await;
    let mut model = Model::new(def);
    for (n, op) in ops.into_iter().enumerate() {
        let what = format!("{op:?}");
        step_op(&mut world, &mut model, op)
            .await
            .map_err(|e| TestCaseError::fail(format!("step {n} ({what}): {e}")))?;
    }
    finish(&mut world, &mut model).await
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    #[test]
    fn the_saga_moves_as_its_model_does_and_always_ends(
        def in def(),
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        runtime().block_on(run(def, ops))?;
    }
}

/// The saga deadline passes at the step after the pivot. It used to park
/// the saga for an operator, whose retry then met the passed deadline and
/// parked it again without a call: no operator action could finish it
/// (cancel is refused past the pivot). Past the pivot the deadline no
/// longer applies: the saga goes forward.
#[test]
fn past_the_pivot_a_passed_deadline_lets_the_saga_go_forward() {
    let def = Def {
        n: 3,
        pivot: Some(1),
        compensable: vec![true, false, false],
        max_attempts: vec![1; 3],
        stuck_after: 1,
        budget: 4,
        deadline: Some(2),
    };
    runtime().block_on(async {
        let mut w = World::new(&def).await;
        w.drive(vec![Answer::Ok, Answer::Ok]).await; // charge, ship (the pivot)
        w.jump(2).await;
        w.drive(vec![Answer::Ok]).await;
        let after = w.store.saga_get(ID).await.unwrap().unwrap();
        assert_eq!(
            after.status,
            SagaStatus::Completed,
            "{:?}",
            after.last_error
        );
    });
}
