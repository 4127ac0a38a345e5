use super::*;
use object_store::memory::InMemory;
use serde_json::json;

fn in_memory() -> ClaimCheck {
    ClaimCheck::new(Arc::new(InMemory::new()), "memory://test")
}

#[tokio::test]
async fn round_trip_is_verified_and_content_addressed() {
    let claims = in_memory();
    let payload = Bytes::from_static(b"the quarterly report");
    let a = claims.put(payload.clone()).await.unwrap();
    let b = claims.put(payload.clone()).await.unwrap();
    assert_eq!(a, b, "same bytes, same claim");
    assert_eq!(a.size_bytes, payload.len() as u64);
    assert_eq!(a.sha256, sha256_hex(&payload));
    assert!(a.location.starts_with("memory://test/claims/"));
    assert_eq!(claims.fetch(&a).await.unwrap(), payload);
}

struct Unreachable;

#[async_trait::async_trait]
impl ClaimHolder for Unreachable {
    async fn held(&self) -> Result<std::collections::HashSet<String>, ClaimCheckError> {
        Err(ClaimCheckError::Invalid(
            "the dead-letter store is down".into(),
        ))
    }
}

#[tokio::test]
async fn a_holder_that_cannot_answer_stops_the_sweep_before_any_delete() {
    let claims = in_memory().keeping(Arc::new(Unreachable));
    let old = claims.put(Bytes::from_static(b"old report")).await.unwrap();
    let cut_off = keel_core::clock::utc_now() + chrono::Duration::hours(1);
    let err = claims.sweep(cut_off).await.unwrap_err();
    assert!(err.to_string().contains("down"), "{err}");
    assert!(claims.fetch(&old).await.is_ok(), "nothing was deleted");
}

#[tokio::test]
async fn a_sweep_deletes_what_was_not_written_since_the_cut_off() {
    let claims = in_memory();
    let old = claims.put(Bytes::from_static(b"old report")).await.unwrap();
    let reused = claims
        .put(Bytes::from_static(b"reused report"))
        .await
        .unwrap();
    let cut_off = keel_core::clock::utc_now() + chrono::Duration::milliseconds(1);
    tokio::time::sleep(Duration::from_millis(5)).await;
    // Claimed again after the cut-off: the put rewrites it, so it stays.
    claims
        .put(Bytes::from_static(b"reused report"))
        .await
        .unwrap();
    let outside = ObjectPath::from("elsewhere/keep-me");
    claims
        .store()
        .put(&outside, Bytes::from_static(b"x").into())
        .await
        .unwrap();
    assert_eq!(claims.sweep(cut_off).await.unwrap(), 1);
    assert!(matches!(
        claims.fetch(&old).await,
        Err(ClaimCheckError::Missing { .. })
    ));
    assert!(claims.fetch(&reused).await.is_ok());
    assert!(
        claims.store().head(&outside).await.is_ok(),
        "only its own prefix"
    );
    let nothing_old = keel_core::clock::utc_now() - chrono::Duration::hours(1);
    assert_eq!(claims.sweep(nothing_old).await.unwrap(), 0);
}

#[tokio::test]
async fn no_claim_is_swept_while_the_broker_may_still_hold_its_message() {
    use crate::broker::MessageRetention;

    // A cut-off in the future would sweep everything by age alone.
    let everything = || keel_core::clock::utc_now() + chrono::Duration::hours(1);
    let hour = Duration::from_secs(3_600);
    let day = MessageRetention::For(Duration::from_secs(86_400));
    let cases = [
        ("a day's retention", in_memory().outliving(day, hour), 0),
        (
            "kept forever",
            in_memory().outliving(MessageRetention::Forever, hour),
            0,
        ),
        (
            "retention unknown",
            in_memory().outliving(MessageRetention::Unknown, hour),
            1,
        ),
        (
            "retention and delay both past",
            in_memory().outliving(MessageRetention::For(Duration::ZERO), Duration::ZERO),
            1,
        ),
    ];
    for (case, claims, swept) in cases {
        let claim = claims.put(Bytes::from_static(b"report")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(claims.sweep(everything()).await.unwrap(), swept, "{case}");
        assert_eq!(claims.fetch(&claim).await.is_ok(), swept == 0, "{case}");
    }
}

#[test]
fn claim_serializes_like_the_seed() {
    let claim = Claim {
        location: "s3://b/k".into(),
        size_bytes: 3,
        sha256: "ab".into(),
    };
    assert_eq!(
        serde_json::to_value(&claim).unwrap(),
        json!({"location": "s3://b/k", "sizeBytes": 3, "sha256": "ab"})
    );
}

#[tokio::test]
async fn a_claim_with_the_wrong_size_or_hash_is_refused() {
    let claims = in_memory();
    let claim = claims.put(Bytes::from_static(b"abc")).await.unwrap();
    let mut lying = claim.clone();
    lying.size_bytes = 4;
    assert!(matches!(
        claims.fetch(&lying).await,
        Err(ClaimCheckError::SizeMismatch {
            expected: 4,
            actual: 3,
            ..
        })
    ));
    let mut lying = claim.clone();
    lying.sha256 = "0".repeat(64);
    let err = claims.fetch(&lying).await.unwrap_err();
    assert!(matches!(err, ClaimCheckError::HashMismatch { .. }));
    assert!(
        err.to_string()
            .contains("changed after the message was sent")
    );
}

#[tokio::test]
async fn foreign_and_malformed_locations_are_refused() {
    let claims = in_memory();
    let mut claim = claims.put(Bytes::from_static(b"abc")).await.unwrap();
    claim.location = "s3://elsewhere/claims/x".into();
    assert!(matches!(
        claims.fetch(&claim).await,
        Err(ClaimCheckError::ForeignLocation { .. })
    ));
    claim.location = "memory://test/claims/../../etc/passwd".into();
    assert!(matches!(
        claims.fetch(&claim).await,
        Err(ClaimCheckError::Invalid(_))
    ));
}

#[tokio::test]
async fn small_envelopes_stay_inline_and_large_ones_are_claimed() {
    let claims = in_memory().with_inline_limit(1024);
    let mut small = Envelope::new("/docs", "docs.uploaded.v1");
    small.data = Some(json!({"id": "d-1"}));
    assert_eq!(claims.check_in(small.clone()).await.unwrap(), small);

    let mut large = Envelope::new("/docs", "docs.uploaded.v1");
    large.subject = Some("d-2".into());
    large.data = Some(json!({"id": "d-2", "body": "x".repeat(10_000)}));
    let claimed = claims.check_in(large.clone()).await.unwrap();
    assert!(claimed.extensions.contains_key(DATAREF));
    assert!(claimed.to_json_limited(1024).is_ok());
    assert_eq!(claimed.subject.as_deref(), Some("d-2"), "routing survives");
    let bytes = claimed.to_json().unwrap();
    assert_eq!(claims.decode(&bytes).await.unwrap(), large);
}
