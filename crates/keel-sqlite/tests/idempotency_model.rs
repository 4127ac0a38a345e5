//! The idempotency store (SQLite) against a reference model, on sequences
//! of requests proptest generates: new requests and duplicates (the same
//! key with the same or another fingerprint), a client retrying after its
//! reply was lost, holders that renew, complete, release, or die holding
//! the key, holders that wake up after losing it, pruning, and the clock
//! jumping by anything from nothing to half an hour.
//!
//! The model is the contract of `IdempotencyStore`, per (principal, key):
//!
//! - absent: a request starts it, in flight under the request's owner
//!   token, locked until its `locked_until` (never past its expiry);
//! - at or past its expiry a key is absent, whatever it was (it starts
//!   afresh, even with another fingerprint; pruning only deletes it);
//! - another fingerprint is a mismatch, in flight or completed, locked or
//!   not;
//! - in flight with its lock passed: a request with the same fingerprint
//!   takes it over (its owner presumed dead); locked, it is in flight;
//! - completed: the response its owner stored is replayed, byte for byte;
//! - renew, complete and release act only for the current owner: a holder
//!   that lost the key (taken over, released, completed, pruned) is told so
//!   (renew `false`, complete `NotFound`) and changes nothing.
//!
//! Every response carries its owner's token, so a replay shows which
//! execution answered: a retry after a lost reply must get the first
//! execution's response, never a second execution.
//!
//! Time: the store compares the instants it keeps with the wall clock, so a
//! clock jump is made by moving every stored instant back by the jump. The
//! model counts whole minutes from an anchor set 30 s before the case
//! starts, so the few milliseconds the case itself takes can never tip a
//! comparison.
//!
//! Failing cases are persisted by proptest next to this file and replayed
//! first on the next run.

use std::collections::BTreeMap;

use bytes::Bytes;
use chrono::{DateTime, TimeDelta, Utc};
use keel_sqlite::store::SqliteStore;
use keel_store::StoreError;
use keel_store::{IdempotencyBegin, IdempotencyClaim, IdempotencyStore, StoredResponse};
use proptest::prelude::*;

const PRINCIPALS: [&str; 2] = ["alice", "bob"];
const KEYS: [&str; 2] = ["k0", "k1"];
const FINGERPRINTS: [&str; 2] = ["fp-a", "fp-b"];

/// A request: principal, key and fingerprint, as indices.
type Request = (usize, usize, usize);

#[derive(Debug, Clone)]
enum Op {
    /// A request arrives, locking the key for `lock` minutes and keeping
    /// it for `ttl`.
    Begin { req: Request, lock: u32, ttl: u32 },
    /// A client sends an earlier request again (its reply was lost, or it
    /// timed out waiting): same key, same fingerprint, a new attempt.
    Retry { nth: usize, lock: u32, ttl: u32 },
    /// The holder at this index (modulo how many there are) acts.
    Hold(usize, Act),
    /// The clock moves, in minutes.
    Advance(u32),
    /// The prune job runs.
    Prune,
}

/// What a request that started does next. A holder keeps acting after it
/// lost the key (a pause longer than its lock), as a real one would.
#[derive(Debug, Clone, Copy)]
enum Act {
    /// Extends its lock by this many minutes.
    Renew(u32),
    /// Stores its response.
    Complete,
    /// Failed in a way the client may retry.
    Release,
    /// Dies: it never renews or settles again.
    Crash,
}

fn request() -> impl Strategy<Value = Request> {
    (0..PRINCIPALS.len(), 0..KEYS.len(), 0..FINGERPRINTS.len())
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        2 => (0_u32..4).prop_map(Act::Renew),
        3 => Just(Act::Complete),
        1 => Just(Act::Release),
        1 => Just(Act::Crash),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (request(), 0_u32..4, 0_u32..7).prop_map(|(req, lock, ttl)| Op::Begin { req, lock, ttl }),
        3 => (any::<usize>(), 0_u32..4, 0_u32..7).prop_map(|(nth, lock, ttl)| Op::Retry { nth, lock, ttl }),
        7 => (any::<usize>(), act()).prop_map(|(i, act)| Op::Hold(i, act)),
        2 => prop_oneof![0_u32..3, Just(5_u32), 10_u32..30].prop_map(Op::Advance),
        1 => Just(Op::Prune),
    ]
}

/// What a key stands for in the model; instants in minutes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    InFlight {
        fp: usize,
        owner: String,
        locked_until: u32,
        expires_at: u32,
    },
    Completed {
        fp: usize,
        owner: String,
        expires_at: u32,
    },
}

impl Entry {
    fn fp(&self) -> usize {
        match self {
            Self::InFlight { fp, .. } | Self::Completed { fp, .. } => *fp,
        }
    }

    fn expires_at(&self) -> u32 {
        match self {
            Self::InFlight { expires_at, .. } | Self::Completed { expires_at, .. } => *expires_at,
        }
    }
}

/// An answer to a begin, with a replay named by the owner that stored it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Started,
    InFlight,
    Replay(String),
    Mismatch,
}

#[derive(Default)]
struct Model {
    now: u32,
    keys: BTreeMap<(usize, usize), Entry>,
}

impl Model {
    /// The entry for a key, unless it has expired (then it is as absent).
    fn live(&mut self, key: (usize, usize)) -> Option<&mut Entry> {
        let now = self.now;
        self.keys.get_mut(&key).filter(|e| e.expires_at() > now)
    }

    fn begin(&mut self, req: Request, owner: &str, lock: u32, ttl: u32) -> Answer {
        let (key, fp) = ((req.0, req.1), req.2);
        let now = self.now;
        let answer = match self.live(key) {
            None => Answer::Started,
            Some(e) if e.fp() != fp => Answer::Mismatch,
            Some(Entry::Completed { owner, .. }) => Answer::Replay(owner.clone()),
            Some(Entry::InFlight { locked_until, .. }) if *locked_until > now => Answer::InFlight,
            // Abandoned by its holder: taken over.
            Some(Entry::InFlight { .. }) => Answer::Started,
        };
        if answer == Answer::Started {
            let expires_at = now + ttl;
            let entry = Entry::InFlight {
                fp,
                owner: owner.to_owned(),
                locked_until: (now + lock).min(expires_at),
                expires_at,
            };
            self.keys.insert(key, entry);
        }
        answer
    }

    /// The key's entry if `owner` holds it in flight (expired or not: only
    /// pruning or a takeover removes a holder).
    fn held(&mut self, key: (usize, usize), owner: &str) -> Option<&mut Entry> {
        self.keys
            .get_mut(&key)
            .filter(|e| matches!(e, Entry::InFlight { owner: o, .. } if o == owner))
    }

    fn renew(&mut self, key: (usize, usize), owner: &str, lock: u32) -> bool {
        let until = self.now + lock;
        match self.held(key, owner) {
            Some(Entry::InFlight {
                locked_until,
                expires_at,
                ..
            }) => {
                *locked_until = until.min(*expires_at);
                true
            }
            _ => false,
        }
    }

    fn complete(&mut self, key: (usize, usize), owner: &str) -> bool {
        let Some(Entry::InFlight { fp, expires_at, .. }) = self.held(key, owner).cloned() else {
            return false;
        };
        let done = Entry::Completed {
            fp,
            owner: owner.to_owned(),
            expires_at,
        };
        self.keys.insert(key, done);
        true
    }

    fn release(&mut self, key: (usize, usize), owner: &str) {
        if self.held(key, owner).is_some() {
            self.keys.remove(&key);
        }
    }

    fn prune(&mut self) -> u64 {
        let now = self.now;
        let before = self.keys.len();
        self.keys.retain(|_, e| e.expires_at() > now);
        (before - self.keys.len()) as u64
    }
}

/// A request that started and may still act on its key.
#[derive(Debug, Clone)]
struct Holder {
    req: Request,
    owner: String,
}

/// The store, the clock and the requests the environment has sent.
struct World {
    store: SqliteStore,
    anchor: DateTime<Utc>,
    holders: Vec<Holder>,
    sent: Vec<Request>,
    owners: u32,
}

impl World {
    async fn new() -> Self {
        let store = SqliteStore::open_in_memory().await.expect("store");
        let now = keel_core::clock::utc_now();
        let ms = DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now);
        Self {
            store,
            anchor: ms - TimeDelta::seconds(30),
            holders: Vec::new(),
            sent: Vec::new(),
            owners: 0,
        }
    }

    /// Model minute `at` as the store sees it now: every stored instant
    /// was moved back by the jumps since, so "now" is always the anchor.
    fn instant(&self, model: &Model, at: u32) -> DateTime<Utc> {
        self.anchor + TimeDelta::minutes(i64::from(at) - i64::from(model.now))
    }

    async fn jump(&self, minutes: u32) {
        let ms = i64::from(minutes) * 60_000;
        sqlx::query(
            "UPDATE keel_idempotency SET locked_until = locked_until - ?1,
                    expires_at = expires_at - ?1, created_at = created_at - ?1",
        )
        .bind(ms)
        .execute(self.store.pool())
        .await
        .expect("clock jump");
    }
}

fn response(owner: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("x-owner".into(), owner.into())],
        body: Bytes::from(format!("done by {owner}")),
    }
}

/// The real answer in the model's terms; a replay must be exactly the
/// response its owner stored.
fn answer(real: IdempotencyBegin) -> Result<Answer, TestCaseError> {
    Ok(match real {
        IdempotencyBegin::Started => Answer::Started,
        IdempotencyBegin::InFlight => Answer::InFlight,
        IdempotencyBegin::Mismatch => Answer::Mismatch,
        IdempotencyBegin::Completed(stored) => {
            let owner = stored.headers[0].1.clone();
            prop_assert_eq!(
                &stored,
                &response(&owner),
                "a replay is the stored response"
            );
            Answer::Replay(owner)
        }
    })
}

async fn begin(
    w: &mut World,
    m: &mut Model,
    req: Request,
    lock: u32,
    ttl: u32,
) -> Result<(), TestCaseError> {
    w.owners += 1;
    let owner = format!("owner-{}", w.owners);
    let claim = IdempotencyClaim {
        principal: PRINCIPALS[req.0],
        key: KEYS[req.1],
        fingerprint: FINGERPRINTS[req.2],
        owner: &owner,
        locked_until: w.instant(m, m.now + lock),
        expires_at: w.instant(m, m.now + ttl),
    };
    let real = answer(w.store.idempotency_begin(&claim).await.expect("begin"))?;
    let expected = m.begin(req, &owner, lock, ttl);
    prop_assert_eq!(&real, &expected, "begin {:?} as {}", req, owner);
    w.sent.push(req);
    if real == Answer::Started {
        w.holders.push(Holder { req, owner });
    }
    Ok(())
}

async fn hold(w: &mut World, m: &mut Model, i: usize, act: Act) -> Result<(), TestCaseError> {
    if w.holders.is_empty() {
        return Ok(());
    }
    let i = i % w.holders.len();
    let Holder { req, owner } = w.holders[i].clone();
    let (principal, key) = (PRINCIPALS[req.0], KEYS[req.1]);
    let model_key = (req.0, req.1);
    match act {
        Act::Renew(lock) => {
            let until = w.instant(m, m.now + lock);
            let real = w
                .store
                .idempotency_renew(principal, key, &owner, until)
                .await;
            let real = real.expect("renew");
            prop_assert_eq!(real, m.renew(model_key, &owner, lock), "renew by {}", owner);
        }
        Act::Complete => {
            let real = w
                .store
                .idempotency_complete(principal, key, &owner, &response(&owner))
                .await;
            let done = m.complete(model_key, &owner);
            prop_assert!(
                matches!(
                    (&real, done),
                    (Ok(()), true) | (Err(StoreError::NotFound(_)), false)
                ),
                "complete by {}: store said {:?}, model {}",
                owner,
                real,
                done
            );
        }
        Act::Release => {
            let real = w.store.idempotency_release(principal, key, &owner).await;
            prop_assert!(real.is_ok(), "release by {}: {:?}", owner, real);
            m.release(model_key, &owner);
        }
        Act::Crash => {
            w.holders.remove(i);
        }
    }
    Ok(())
}

async fn step(w: &mut World, m: &mut Model, op: Op) -> Result<(), TestCaseError> {
    match op {
        Op::Begin { req, lock, ttl } => begin(w, m, req, lock, ttl).await?,
        Op::Retry { nth, lock, ttl } if !w.sent.is_empty() => {
            let req = w.sent[nth % w.sent.len()];
            begin(w, m, req, lock, ttl).await?;
        }
        Op::Retry { .. } => {}
        Op::Hold(i, act) => hold(w, m, i, act).await?,
        Op::Advance(minutes) => {
            w.jump(minutes).await;
            m.now += minutes;
        }
        Op::Prune => {
            let now = w.instant(m, m.now);
            let real = w.store.idempotency_prune(now, 1_000).await.expect("prune");
            prop_assert_eq!(real, m.prune(), "keys pruned");
        }
    }
    Ok(())
}

async fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut world = World::new().await;
    let mut model = Model::default();
    for (n, op) in ops.into_iter().enumerate() {
        let what = format!("{op:?}");
        step(&mut world, &mut model, op)
            .await
            .map_err(|e| TestCaseError::fail(format!("step {n} ({what}): {e}")))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_idempotency_store_answers_what_its_model_answers(
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(run(ops))?;
    }
}
