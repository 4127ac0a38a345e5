//! What a claim check must do, on every object store it runs on: a local
//! directory and S3 (moto's S3 server, started by `scripts/services.sh`).
//! One set of behaviours, each run against both.

#![cfg(feature = "claim-check-s3")]

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use keel_messaging::claim_check::{ClaimCheck, ClaimCheckError, ClaimHolder};
use keel_testkit::services::{self, ServerLock, Service};

/// A claim check on a fresh, empty place of its own, and what keeps that
/// place alive.
struct Place {
    claims: ClaimCheck,
    /// Makes another claim check on the same place (a consumer elsewhere).
    reopen: Box<dyn Fn() -> ClaimCheck + Send + Sync>,
    _dir: Option<tempfile::TempDir>,
    _server: Option<ServerLock>,
}

fn local() -> Option<Place> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("claims");
    let reopen_path = path.clone();
    Some(Place {
        claims: ClaimCheck::local(&path).unwrap(),
        reopen: Box::new(move || ClaimCheck::local(&reopen_path).unwrap()),
        _dir: Some(dir),
        _server: None,
    })
}

fn s3() -> Option<Place> {
    s3_holding(ServerLock::shared(Service::S3))
}

fn s3_holding(lock: ServerLock) -> Option<Place> {
    let endpoint = services::s3_url()?;
    let url = format!("s3://keel-test/{}", keel_core::id::new_id().simple());
    let open = move || {
        ClaimCheck::s3(
            &url,
            [
                ("aws_endpoint", endpoint.as_str()),
                ("aws_allow_http", "true"),
                ("aws_region", "us-east-1"),
                ("aws_access_key_id", "keel"),
                ("aws_secret_access_key", "keel"),
            ],
        )
        .unwrap()
    };
    Some(Place {
        claims: open(),
        reopen: Box::new(open),
        _dir: None,
        _server: Some(lock),
    })
}

/// One `#[tokio::test]` per behaviour and store.
macro_rules! on_every_store {
    ($($behaviour:ident),* $(,)?) => {
        mod local_dir {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $behaviour() {
                    if let Some(place) = super::local() {
                        super::$behaviour(place).await;
                    }
                }
            )*
        }
        mod s3 {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $behaviour() {
                    if let Some(place) = super::s3() {
                        super::$behaviour(place).await;
                    }
                }
            )*
        }
    };
}

on_every_store!(
    a_claim_comes_back_verified_from_another_claim_check,
    a_large_payload_goes_up_in_parts_and_comes_back_whole,
    a_changed_or_missing_object_is_refused,
    a_sweep_deletes_only_old_objects_nobody_holds,
);

fn payload(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect::<Vec<_>>(),
    )
}

/// Content-addressed and idempotent: the same bytes give the same claim;
/// a claim check elsewhere on the same store fetches it.
async fn a_claim_comes_back_verified_from_another_claim_check(place: Place) {
    let bytes = payload(300_000, 1);
    let claim = place.claims.put(bytes.clone()).await.unwrap();
    assert_eq!(place.claims.put(bytes.clone()).await.unwrap(), claim);
    assert_eq!(claim.size_bytes, 300_000);
    let consumer = (place.reopen)();
    assert_eq!(consumer.fetch(&claim).await.unwrap(), bytes);
}

/// Past the threshold the upload is multipart (three parts here), and the
/// object is the payload, byte for byte.
async fn a_large_payload_goes_up_in_parts_and_comes_back_whole(place: Place) {
    let claims = place.claims.with_multipart_threshold(6 << 20);
    let bytes = payload(12 << 20, 2);
    let claim = claims.put(bytes.clone()).await.unwrap();
    assert_eq!(claim.size_bytes, 12 << 20);
    let fetched = (place.reopen)().fetch(&claim).await.unwrap();
    assert!(fetched == bytes, "the object differs from the payload");
}

/// An object replaced after the claim was made is refused; a deleted one
/// is `Missing`, never an empty payload.
async fn a_changed_or_missing_object_is_refused(place: Place) {
    let claim = place.claims.put(payload(1000, 3)).await.unwrap();
    let path = place.claims.object_of(&claim).unwrap();
    place
        .claims
        .store()
        .put(&path, payload(1000, 4).into())
        .await
        .unwrap();
    assert!(matches!(
        place.claims.fetch(&claim).await,
        Err(ClaimCheckError::HashMismatch { .. })
    ));
    place.claims.delete(&claim).await.unwrap();
    assert!(matches!(
        place.claims.fetch(&claim).await,
        Err(ClaimCheckError::Missing { .. })
    ));
}

struct Holds(HashSet<String>);

#[async_trait]
impl ClaimHolder for Holds {
    async fn held(&self) -> Result<HashSet<String>, ClaimCheckError> {
        Ok(self.0.clone())
    }
}

/// Young objects stay; old ones go unless a holder still claims them.
async fn a_sweep_deletes_only_old_objects_nobody_holds(place: Place) {
    let held = place.claims.put(payload(100, 5)).await.unwrap();
    let orphan = place.claims.put(payload(100, 6)).await.unwrap();
    let claims = place
        .claims
        .keeping(Arc::new(Holds(HashSet::from([held.sha256.clone()]))));
    let an_hour = chrono::Duration::hours(1);
    let now = keel_core::clock::utc_now();
    assert_eq!(claims.sweep(now - an_hour).await.unwrap(), 0, "all young");
    assert_eq!(claims.sweep(now + an_hour).await.unwrap(), 1, "the orphan");
    assert!(claims.fetch(&held).await.is_ok());
    assert!(matches!(
        claims.fetch(&orphan).await,
        Err(ClaimCheckError::Missing { .. })
    ));
}

/// A store that is down fails the put within the bounded retries, not
/// after object_store's default three minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_s3_fails_a_put_in_seconds_not_minutes() {
    let Some(place) = s3_holding(ServerLock::exclusive(Service::S3)) else {
        return;
    };
    let before = place.claims.put(payload(1000, 7)).await.unwrap();
    services::stop(Service::S3).expect("stop the S3 server");
    let started = keel_core::clock::now();
    let failed = place.claims.put(payload(1000, 8)).await;
    let took = started.elapsed();
    services::start(Service::S3).expect("start the S3 server");
    assert!(
        matches!(failed, Err(ClaimCheckError::Store(_))),
        "{failed:?}"
    );
    assert!(took < std::time::Duration::from_secs(20), "took {took:?}");
    // moto keeps its objects in memory: a restart empties it, as a bucket
    // whose lifecycle rule ran would be. The claim is then `Missing`.
    assert!(matches!(
        place.claims.fetch(&before).await,
        Err(ClaimCheckError::Missing { .. })
    ));
}
