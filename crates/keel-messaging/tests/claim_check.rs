//! The claim check over a local directory, with envelopes travelling through
//! the SQLite outbox and the embedded SQLite broker.

use std::time::Duration;

use keel_messaging::broker::{Broker, SubscribeOptions};
use keel_messaging::claim_check::{Claim, ClaimCheck, ClaimCheckError, DATAREF};
use keel_messaging::envelope::{Envelope, EnvelopeError, Event, EventMeta};
use keel_messaging::outbox::{Outbox, OutboxError};
use keel_messaging::store::{OutboxStore, Store};
use keel_sqlite::broker::SqliteBroker;
use keel_sqlite::store::SqliteStore;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DocumentUploaded {
    document_id: String,
    body: String,
}

impl Event for DocumentUploaded {
    const TYPE: &'static str = "docs.document.uploaded.v1";
    fn subject(&self) -> String {
        self.document_id.clone()
    }
}

fn big_document() -> DocumentUploaded {
    DocumentUploaded {
        document_id: "doc-40mb".into(),
        // 1 MiB is ten times over the 100 KiB limit.
        body: "x".repeat(1 << 20),
    }
}

fn file_of(claim: &Claim) -> std::path::PathBuf {
    claim
        .location
        .strip_prefix("file://")
        .expect("a local claim")
        .into()
}

#[tokio::test]
async fn a_large_event_travels_as_a_claim_and_comes_back_verified() {
    let dir = tempfile::tempdir().unwrap();
    let claims = ClaimCheck::local(dir.path().join("claims")).unwrap();
    let broker = SqliteBroker::open(dir.path().join("broker.db"))
        .await
        .unwrap();
    let doc = big_document();
    let env = Envelope::from_event("/services/docs", &doc, EventMeta::new(1)).unwrap();
    assert!(matches!(env.to_json(), Err(EnvelopeError::TooLarge { .. })));

    let bytes = claims.encode(env.clone()).await.unwrap();
    assert!(
        bytes.len() < 2048,
        "the message carries a claim, not the document"
    );
    let msg = keel_messaging::broker::Message::new(&env.id, "docs", "doc-40mb", bytes);
    broker.publish(&[msg]).await.unwrap();

    let mut sub = broker
        .subscribe(SubscribeOptions::new("docs", "indexer"))
        .await
        .unwrap();
    let delivered = sub.receive(1, Duration::from_secs(5)).await.unwrap();
    assert_eq!(delivered.len(), 1);
    let received = claims.decode(&delivered[0].message.payload).await.unwrap();
    delivered[0].ack().await.unwrap();
    assert_eq!(received, env, "the consumer sees the original event");
    assert_eq!(received.data_as::<DocumentUploaded>().unwrap(), doc);
}

#[tokio::test]
async fn the_outbox_takes_a_claimed_event_in_the_business_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let claims = ClaimCheck::local(dir.path().join("claims")).unwrap();
    let store = SqliteStore::open(dir.path().join("app.db")).await.unwrap();
    let outbox = Outbox::new(store.clone());
    let env = Envelope::from_event("/services/docs", &big_document(), EventMeta::new(1)).unwrap();

    let mut tx = store.begin().await.unwrap();
    let err = outbox.append(&mut tx, "docs", &env).await.unwrap_err();
    assert!(matches!(
        err,
        OutboxError::Envelope(EnvelopeError::TooLarge { .. })
    ));
    assert!(err.to_string().contains("claim check"));

    let claimed = claims.check_in(env.clone()).await.unwrap();
    assert!(claimed.extensions.contains_key(DATAREF));
    outbox.append(&mut tx, "docs", &claimed).await.unwrap();
    store.commit(tx).await.unwrap();

    let pending = store
        .outbox_claim("relay", 10, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].record.partition_key, "doc-40mb");
    let back = claims.decode(&pending[0].record.payload).await.unwrap();
    // The row carries the outbox's producer span; the rest is as given.
    assert!(back.trace_parent().is_some());
    assert_eq!(
        Envelope {
            traceparent: env.traceparent.clone(),
            ..back
        },
        env
    );
}

#[tokio::test]
async fn a_tampered_object_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let claims = ClaimCheck::local(dir.path().join("claims")).unwrap();
    let claim = claims
        .put(bytes::Bytes::from(vec![b'a'; 4096]))
        .await
        .unwrap();
    assert_eq!(claim.size_bytes, 4096);

    // Same size, different bytes.
    std::fs::write(file_of(&claim), vec![b'b'; 4096]).unwrap();
    let err = claims.fetch(&claim).await.unwrap_err();
    assert!(matches!(err, ClaimCheckError::HashMismatch { .. }), "{err}");

    // Truncated.
    std::fs::write(file_of(&claim), vec![b'a'; 100]).unwrap();
    let err = claims.fetch(&claim).await.unwrap_err();
    assert!(
        matches!(
            err,
            ClaimCheckError::SizeMismatch {
                expected: 4096,
                actual: 100,
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn a_missing_object_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let claims = ClaimCheck::local(dir.path().join("claims")).unwrap();
    let claim = claims
        .put(bytes::Bytes::from_static(b"soon gone"))
        .await
        .unwrap();
    std::fs::remove_file(file_of(&claim)).unwrap();
    let err = claims.fetch(&claim).await.unwrap_err();
    assert!(matches!(err, ClaimCheckError::Missing { .. }), "{err}");
    assert!(err.to_string().contains("retention"), "{err}");
    // Deleting what is already gone is fine.
    claims.delete(&claim).await.unwrap();
}

/// The sweeper once deleted claimed objects by age alone, so a dead letter
/// older than the lifetime could no longer be replayed: its payload was
/// gone. A pending dead letter now holds its object through any sweep;
/// once it is settled, the object goes at the next one.
#[tokio::test]
async fn a_sweep_keeps_what_a_pending_dead_letter_claims_until_it_is_settled() {
    use keel_messaging::dead_letter::DeadLetters;
    use keel_messaging::store::{DeadLetter, DeadLetterStatus, DeadLetterStore};

    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("app.db")).await.unwrap();
    let dead_letters = DeadLetters::new(store.clone());
    let claims = ClaimCheck::local(dir.path().join("claims"))
        .unwrap()
        .keeping(std::sync::Arc::new(dead_letters.clone()));

    let env = Envelope::from_event("/services/docs", &big_document(), EventMeta::new(1)).unwrap();
    let bytes = claims.encode(env.clone()).await.unwrap();
    let claim: Claim = Envelope::from_json(&bytes).unwrap().data_as().unwrap();
    let message = keel_messaging::broker::Message::new(&env.id, "docs", "doc-40mb", bytes);
    store
        .dead_letter_put(&DeadLetter {
            id: "dl-1".into(),
            message,
            group: "indexer".into(),
            error_kind: "poison".into(),
            attempts: Vec::new(),
            dead_at: keel_core::clock::utc_now(),
            status: DeadLetterStatus::Pending,
        })
        .await
        .unwrap();
    let orphan = claims
        .put(bytes::Bytes::from_static(b"claimed by nobody"))
        .await
        .unwrap();

    // Every object is past its lifetime.
    let cut_off = keel_core::clock::utc_now() + chrono::Duration::hours(1);
    assert_eq!(claims.sweep(cut_off).await.unwrap(), 1, "only the orphan");
    assert!(matches!(
        claims.fetch(&orphan).await,
        Err(ClaimCheckError::Missing { .. })
    ));
    assert_eq!(
        claims.fetch(&claim).await.unwrap().len() as u64,
        claim.size_bytes,
        "the dead letter can still be replayed"
    );

    dead_letters.discard("dl-1").await.unwrap();
    assert_eq!(claims.sweep(cut_off).await.unwrap(), 1, "settled: freed");
    assert!(matches!(
        claims.fetch(&claim).await,
        Err(ClaimCheckError::Missing { .. })
    ));
}
