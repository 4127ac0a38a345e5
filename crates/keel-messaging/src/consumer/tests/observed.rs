//! What the consumer shows and what it costs the store: its metrics, its
//! logs, its errors' text, and the store calls it makes (and skips).

use std::num::NonZeroU32;
use std::sync::Arc;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use parking_lot::Mutex;

use super::*;

/// The `attempt` of every "message retried repeatedly" warning.
#[derive(Clone, Default)]
struct RepeatWarnings(Arc<Mutex<Vec<u64>>>);

#[derive(Default)]
struct Fields {
    message: String,
    attempt: Option<u64>,
}

impl tracing::field::Visit for Fields {
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == "attempt" {
            self.attempt = Some(value);
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for RepeatWarnings {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() == tracing::Level::WARN
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if fields.message == "message retried repeatedly" {
            self.0.lock().extend(fields.attempt);
        }
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// Installs a recorder for this test's process (nextest runs each test in
/// its own).
fn record_metrics() -> Snapshotter {
    let recorder = DebuggingRecorder::new();
    let snapshots = recorder.snapshotter();
    recorder.install().unwrap();
    snapshots
}

/// Each series of counter `name`: its labels as `key=value`, and its value.
fn counted(snapshots: &Snapshotter, name: &str) -> Vec<(Vec<String>, DebugValue)> {
    snapshots
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == name)
        .map(|(key, _, _, value)| {
            let labels = key.key().labels();
            (
                labels
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect(),
                value,
            )
        })
        .collect()
}

/// The values of counter `name`'s series.
fn values(snapshots: &Snapshotter, name: &str) -> Vec<DebugValue> {
    counted(snapshots, name)
        .into_iter()
        .map(|(_, v)| v)
        .collect()
}

fn failing_group(error: fn() -> HandlerError) -> Group<MemTx> {
    Group::new(TOPIC, GROUP).on_fn(ChargeRequested::TYPE, move |_tx: &mut MemTx, _env| {
        Box::pin(async move { Err(error()) })
    })
}

/// Alert on the nth try instead of discovering the loop from a
/// DLQ alarm. Attempts past the third are warned about, with their number.
#[tokio::test(start_paused = true)]
async fn attempts_past_the_third_are_warned_about_with_their_number() {
    let _serial = serial();
    let warnings = RepeatWarnings::default();
    let _logs = tracing::subscriber::set_default(warnings.clone());
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("W-1", 1))]).await;
    let consumer = builder(&store, &broker)
        .max_deliveries(NonZeroU32::new(5).unwrap())
        .group(failing_group(|| HandlerError::retryable("still down")))
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.letters().len(), 1);
    assert_eq!(*warnings.0.lock(), [4, 5]);
}

/// A closure over the raw envelope is the handler: its error decides the
/// outcome, and its text is what the dead letter says.
#[tokio::test(start_paused = true)]
async fn a_raw_handlers_error_is_its_outcome_and_its_dead_letters_reason() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("R-1", 1))]).await;
    let consumer = builder(&store, &broker)
        .group(failing_group(|| {
            HandlerError::permanent("card number has 15 digits")
        }))
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    let letters = store.letters();
    assert_eq!(letters.len(), 1, "dead-lettered, not acked as applied");
    assert_eq!(letters[0].error_kind, kind::PERMANENT);
    assert!(letters[0].attempts[0].error.contains("15 digits"));
    assert!(store.ledger().is_empty());
}

#[tokio::test(start_paused = true)]
async fn dead_letters_are_counted_under_their_kind() {
    let _serial = serial();
    let snapshots = record_metrics();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("K-1", 1))]).await;
    let consumer = builder(&store, &broker)
        .group(failing_group(|| HandlerError::permanent("refused")))
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(
        counted(&snapshots, "keel_consumer_dead_lettered_total"),
        [(
            vec![
                format!("topic={TOPIC}"),
                format!("group={GROUP}"),
                format!("kind={}", kind::PERMANENT)
            ],
            DebugValue::Counter(1)
        )]
    );
}

/// A message applied on its first delivery has no failures to forget: no
/// store write for them. A duplicate's transaction is rolled back at once,
/// not left to a drop.
#[tokio::test(start_paused = true)]
async fn the_store_sees_no_needless_writes_and_duplicates_are_rolled_back() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, copies(&charge("S-1", 1), 2)).await;
    let consumer = builder(&store, &broker)
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.ledger(), ["S-1:1"]);
    assert_eq!(
        store.failure_clears(),
        0,
        "nothing failed: nothing to clear"
    );
    assert_eq!(store.rollbacks(), 1, "the duplicate's transaction");
}

/// A duplicate is acked only once the rollback that found its inbox row
/// answers: a failed rollback means the row may not be durable (SQLite's
/// batch did not commit), so the delivery is retried, not acked.
#[tokio::test(start_paused = true)]
async fn a_duplicate_whose_rollback_fails_is_retried_not_acked() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    store.fail_next_rollbacks(1);
    publish(&broker, copies(&charge("S-1", 1), 2)).await;
    let consumer = builder(&store, &broker)
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.ledger(), ["S-1:1"]);
    assert_eq!(store.rollbacks(), 2, "the duplicate's two deliveries");
    assert_eq!(broker.delivery_counts(TOPIC, GROUP), [1, 2]);
}

#[test]
fn handlers_and_their_errors_describe_themselves() {
    let error = HandlerError::retryable(std::io::Error::other("connection refused"));
    assert_eq!(error.to_string(), "connection refused");
    let debug = format!("{error:?}");
    assert!(
        debug.starts_with("HandlerError") && debug.contains("connection refused"),
        "{debug}"
    );
    let raw = handler_fn(|_tx: &mut MemTx, _env| Box::pin(async { Ok(()) }));
    assert_eq!(format!("{raw:?}"), "HandlerFn");
    let typed = event_fn(|_tx: &mut MemTx, _ev: ChargeRequested, _env| Box::pin(async { Ok(()) }));
    assert!(format!("{typed:?}").contains("ChargeRequested"));
}

/// The last attempt reaches the dead letter even when recording it failed,
/// though an earlier attempt failed with the same words.
#[tokio::test(start_paused = true)]
async fn a_dead_letter_keeps_a_last_attempt_the_store_failed_to_record() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("H-1", 1))]).await;
    let (hiccup, calls) = (store.clone(), Arc::new(AtomicU32::new(0)));
    let group =
        Group::new(TOPIC, GROUP).on_fn(ChargeRequested::TYPE, move |_tx: &mut MemTx, _env| {
            // The first failure is recorded; recording the second fails.
            let second = calls.fetch_add(1, Ordering::Relaxed) == 1;
            hiccup.refuse_failure_records(second);
            Box::pin(async move { Err(HandlerError::retryable("boom")) })
        });
    let consumer = builder(&store, &broker)
        .max_deliveries(NonZeroU32::new(2).unwrap())
        .group(group)
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    let letters = store.letters();
    assert_eq!(letters.len(), 1);
    let attempts: Vec<_> = letters[0]
        .attempts
        .iter()
        .map(|a| (a.attempt, a.error.as_str()))
        .collect();
    assert_eq!(attempts, [(1, "boom"), (2, "boom")]);
}

/// A binary-mode CloudEvent (attributes in `ce-*` headers, the data as the
/// body) is read and applied like a structured one.
#[tokio::test(start_paused = true)]
async fn a_binary_mode_event_is_applied() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let env = charge("B-1", 42);
    let mut msg = message(&env);
    let (headers, body) = env.to_binary().unwrap();
    msg.headers.extend(headers);
    msg.payload = body.into();
    publish(&broker, [msg]).await;
    let consumer = builder(&store, &broker)
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.ledger(), ["B-1:42"]);
    assert!(store.letters().is_empty());
}

/// Without `ce-specversion`, a body that is not a structured CloudEvent is
/// dead-lettered with what is wrong with its JSON, not with a complaint
/// about missing binary-mode headers.
#[tokio::test(start_paused = true)]
async fn a_broken_structured_event_is_dead_lettered_with_its_json_error() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let mut msg = message(&charge("J-1", 1));
    msg.payload = "{\"specversion\": \"1.0\", \"id\": ".into();
    publish(&broker, [msg]).await;
    let consumer = builder(&store, &broker)
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    let letters = store.letters();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].error_kind, kind::MALFORMED);
    let why = &letters[0].attempts[0].error;
    assert!(why.contains("EOF") && !why.contains("binary-mode"), "{why}");
}

/// The inbox key is the `event-id` header when it has one (a replay keeps
/// it), else the envelope's id: an empty header is no id.
#[tokio::test(start_paused = true)]
async fn the_inbox_key_is_the_event_id_header_unless_it_is_empty() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    let with_header = |order: &str, event_id: &str| {
        let mut msg = message(&charge(order, 1));
        msg.headers.insert(
            crate::broker::header::EVENT_ID.to_owned(),
            event_id.to_owned(),
        );
        msg
    };
    let messages = [
        with_header("E-1", "same-event"),
        with_header("E-2", "same-event"),
        with_header("E-3", ""),
        with_header("E-4", ""),
    ];
    publish(&broker, messages).await;
    let consumer = builder(&store, &broker)
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    let mut ledger = store.ledger();
    ledger.sort();
    assert_eq!(
        ledger,
        ["E-1:1", "E-3:1", "E-4:1"],
        "E-2 shares E-1's event id; E-3 and E-4 have their own envelope ids"
    );
}

/// The inbox is pruned in batches until a batch comes back short: exactly
/// two full batches of old rows take three calls and are all counted; the
/// recent rows stay.
#[tokio::test]
async fn inbox_pruning_deletes_every_old_row_in_batches_and_counts_them() {
    let snapshots = record_metrics();
    let store = MemStore::default();
    let now = clock::utc_now();
    store.add_inbox_rows(
        GROUP,
        2 * crate::consumer::process::INBOX_PRUNE_BATCH,
        now - chrono::Duration::days(8),
    );
    store.add_inbox_rows(GROUP, 5, now);
    let processor = Processor {
        store: store.clone(),
        options: ConsumerOptions::default(),
    };
    let week = Duration::from_secs(7 * 24 * 3600);
    let counted = || values(&snapshots, "keel_consumer_inbox_pruned_total");
    let empty = Processor {
        store: MemStore::default(),
        options: ConsumerOptions::default(),
    };
    assert_eq!(empty.prune_inbox(week).await.unwrap(), 0);
    assert_eq!(counted(), [], "a prune that finds nothing says nothing");
    assert_eq!(processor.prune_inbox(week).await.unwrap(), 2_000);
    assert_eq!(store.inbox_len(), 5);
    assert_eq!(processor.prune_inbox(week).await.unwrap(), 0);
    assert_eq!(counted(), [DebugValue::Counter(2_000)]);
}

/// A running consumer prunes its inbox by itself.
#[tokio::test(start_paused = true)]
async fn a_running_consumer_prunes_old_inbox_rows() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    store.add_inbox_rows(GROUP, 3, clock::utc_now() - chrono::Duration::days(8));
    let consumer = builder(&store, &broker)
        .inbox_retention(Some(Duration::from_secs(7 * 24 * 3600)))
        .group(ledger_group())
        .build()
        .unwrap();
    run_until(consumer, || store.inbox_len() == 0).await;
}

/// The lease is extended every third of it while the handler runs, the
/// first time a third in, not at once: a 950 ms handler under a 300 ms
/// lease gets 9 extensions.
#[tokio::test(start_paused = true)]
async fn the_lease_is_first_extended_a_third_of_a_lease_in() {
    let _serial = serial();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("SLOW", 1))]).await;
    let consumer = builder(&store, &broker)
        .lease(Duration::from_millis(300))
        .group(slow_group(Duration::from_millis(950)))
        .build()
        .unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(broker.extensions(), 9);
}

/// An ack that finds its lease gone is counted: the message comes back, and
/// the inbox keeps its effect to one.
#[tokio::test(start_paused = true)]
async fn a_lost_lease_at_the_ack_is_counted_and_the_redelivery_deduped() {
    let _serial = serial();
    let snapshots = record_metrics();
    let (store, broker) = (MemStore::default(), MemBroker::default());
    publish(&broker, [message(&charge("L-1", 1))]).await;
    let lose = broker.clone();
    let group = Group::new(TOPIC, GROUP).on_event(move |tx: &mut MemTx, ev: ChargeRequested, _| {
        lose.lose_leases();
        Box::pin(async move {
            tx.effects.push(ev.order);
            Ok(())
        })
    });
    let consumer = builder(&store, &broker).group(group).build().unwrap();
    run_until(consumer, || broker.all_done(TOPIC, GROUP)).await;
    assert_eq!(store.ledger(), ["L-1"]);
    assert_eq!(broker.delivery_counts(TOPIC, GROUP), [2]);
    assert_eq!(
        values(&snapshots, "keel_consumer_lease_lost_total"),
        [DebugValue::Counter(1)]
    );
}
