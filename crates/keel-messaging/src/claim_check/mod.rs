//! Claim check: a large payload goes to an object store, and the message
//! carries only a claim to it (where it is, how big, and its SHA-256).
//!
//! Never put a 40 MB document on the broker. Big messages are slow to
//! publish, fill the broker's log and replicas, copy sensitive bytes into
//! every consumer's logs, and trip the envelope's size limit (100 KiB by
//! default). So the producer writes the bytes to an object store
//! ([`object_store`]: S3, GCS, Azure, or a local directory by default) and
//! publishes a [`Claim`]; the consumer fetches the bytes with it and
//! **verifies** them: a claim carries the size and SHA-256 of what was
//! written, so an object replaced, truncated or corrupted after the message
//! was sent is refused instead of silently processed.
//!
//! Objects are content-addressed (`claims/<sha256>`): putting the same bytes
//! twice (a producer retrying after a crash) writes one object, not two. The
//! price of the pattern: an object must outlive every message that claims
//! it, so keep objects at least as long as the topic's retention and its
//! dead letters. [`ClaimCheck::sweep`] (or [`ClaimCheck::run_sweeper`]) deletes
//! objects not written for longer than that lifetime: a put of the same
//! bytes rewrites the object, so an object still being claimed by new
//! messages stays young. Age alone is not enough for a dead letter, which
//! may wait for a replay far longer than any lifetime: register its
//! holders with [`ClaimCheck::keeping`] (`DeadLetters` is one), and the
//! sweep keeps every object a pending dead letter claims.
//!
//! For envelopes, [`ClaimCheck::check_in`] swaps oversized `data` for a
//! claim (and sets the CloudEvents `dataref` extension to its location);
//! [`ClaimCheck::check_out`] swaps it back after verifying it.
//!
//! ```
//! use bytes::Bytes;
//! use keel_messaging::claim_check::ClaimCheck;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let dir = tempfile::tempdir().unwrap();
//! let claims = ClaimCheck::local(dir.path()).unwrap();
//! let claim = claims.put(Bytes::from(vec![7u8; 1 << 20])).await.unwrap();
//! assert_eq!(claim.size_bytes, 1 << 20);
//! // The claim is what travels: {"location": "file:///…/claims/…", "sizeBytes": 1048576, "sha256": "…"}
//! let bytes = claims.fetch(&claim).await.unwrap();
//! assert_eq!(bytes.len(), 1 << 20);
//! # });
//! ```

use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::TryStreamExt;

use bytes::Bytes;
use keel_core::{Classify, ErrorClass};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, WriteMultipart};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::broker::MessageRetention;
use crate::envelope::{DEFAULT_MAX_SIZE, Envelope, EnvelopeError};

mod holders;
#[cfg(feature = "claim-check-s3")]
mod s3;

pub use holders::{ClaimHolder, MAX_PENDING_SCAN};

/// Payloads larger than this are uploaded in parts by default: 8 MiB. One
/// request for a 40 MB document is one slow request that a blip restarts
/// from the first byte; parts are sent concurrently and retried alone.
pub const DEFAULT_MULTIPART_THRESHOLD: usize = 8 << 20;

/// The size of each part but the last: 5 MiB, S3's smallest.
const MULTIPART_PART_SIZE: usize = 5 << 20;

/// The CloudEvents extension attribute that marks an envelope whose `data`
/// is a [`Claim`]: the location of the real payload (the CloudEvents
/// `dataref` extension).
pub const DATAREF: &str = "dataref";

/// The default folder for claimed objects inside the store.
pub const DEFAULT_PREFIX: &str = "claims";

/// A claim to a payload in an object store: what a message carries instead
/// of the payload itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Claim {
    /// Where the payload is, e.g. `s3://bucket/claims/<sha256>` or
    /// `file:///var/lib/app/claims/<sha256>`.
    pub location: String,
    /// The payload's exact size.
    pub size_bytes: u64,
    /// The payload's SHA-256, lowercase hex.
    pub sha256: String,
}

/// A claim check could not be written or honoured.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimCheckError {
    /// The claimed object does not exist.
    #[error(
        "the claimed object at `{location}` does not exist: it was deleted or expired before the \
         message was consumed; keep claimed objects at least as long as the topic's retention"
    )]
    Missing {
        /// The claim's location.
        location: String,
    },
    /// The object's size differs from the claim's.
    #[error(
        "claim check refused `{location}`: the claim says {expected} bytes but the object has \
         {actual}; it was changed or truncated after the message was sent"
    )]
    SizeMismatch {
        /// The claim's location.
        location: String,
        /// The size in the claim.
        expected: u64,
        /// The size found.
        actual: u64,
    },
    /// The object's SHA-256 differs from the claim's.
    #[error(
        "claim check refused `{location}`: its SHA-256 is {actual}, not the claimed {expected}; \
         the object was changed after the message was sent"
    )]
    HashMismatch {
        /// The claim's location.
        location: String,
        /// The hash in the claim.
        expected: String,
        /// The hash found.
        actual: String,
    },
    /// The claim points into another store.
    #[error(
        "claim location `{location}` is not in this claim check's store (`{base}`); \
         fetch it with a ClaimCheck configured for that store"
    )]
    ForeignLocation {
        /// The claim's location.
        location: String,
        /// This claim check's base location.
        base: String,
    },
    /// A claim, location or prefix that cannot be read.
    #[error("invalid claim check: {0}")]
    Invalid(String),
    /// The envelope could not be encoded or decoded, or is too large even
    /// with its data claimed.
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    /// The object store failed (network, permissions, disk).
    #[error("object store failed: {0}")]
    Store(#[source] object_store::Error),
}

impl Classify for ClaimCheckError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Store(_) => ErrorClass::Retryable,
            _ => ErrorClass::Permanent,
        }
    }
}

/// Puts payloads in an object store and fetches them back, verified.
/// Cheap to clone.
#[derive(Clone)]
pub struct ClaimCheck {
    store: Arc<dyn ObjectStore>,
    base: String,
    prefix: ObjectPath,
    inline_limit: usize,
    multipart_threshold: usize,
    holders: Vec<Arc<dyn ClaimHolder>>,
    min_lifetime: MinLifetime,
}

/// The youngest an object may be and still be swept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MinLifetime {
    /// No floor: the caller's cut-off decides.
    None,
    /// Objects younger than this are kept, whatever the cut-off.
    At(chrono::Duration),
    /// Messages are kept forever: no object is ever old enough.
    Forever,
}

impl std::fmt::Debug for ClaimCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimCheck")
            .field("store", &self.store)
            .field("base", &self.base)
            .field("prefix", &self.prefix)
            .field("inline_limit", &self.inline_limit)
            .field("multipart_threshold", &self.multipart_threshold)
            .field("holders", &self.holders.len())
            .field("min_lifetime", &self.min_lifetime)
            .finish()
    }
}

impl ClaimCheck {
    /// A claim check over `store`, whose objects are named
    /// `<base>/<prefix>/<sha256>` in claims (`base` is how consumers know the
    /// store, e.g. `s3://my-bucket`).
    pub fn new(store: Arc<dyn ObjectStore>, base: impl Into<String>) -> Self {
        Self {
            store,
            base: base.into().trim_end_matches('/').to_owned(),
            prefix: ObjectPath::from(DEFAULT_PREFIX),
            inline_limit: DEFAULT_MAX_SIZE,
            multipart_threshold: DEFAULT_MULTIPART_THRESHOLD,
            holders: Vec::new(),
            min_lifetime: MinLifetime::None,
        }
    }

    /// A claim check over a local directory (created if missing): the
    /// default, needing no server.
    pub fn local(dir: impl AsRef<std::path::Path>) -> Result<Self, ClaimCheckError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| {
            ClaimCheckError::Invalid(format!("cannot create `{}`: {e}", dir.display()))
        })?;
        let dir = std::fs::canonicalize(dir).map_err(|e| {
            ClaimCheckError::Invalid(format!("cannot resolve `{}`: {e}", dir.display()))
        })?;
        let store = LocalFileSystem::new_with_prefix(&dir).map_err(ClaimCheckError::Store)?;
        let base = format!("file://{}", dir.display());
        Ok(Self::new(Arc::new(store), base))
    }

    /// Puts objects under `prefix` (default `claims`) instead.
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self, ClaimCheckError> {
        self.prefix = ObjectPath::parse(prefix)
            .map_err(|e| ClaimCheckError::Invalid(format!("prefix `{prefix}`: {e}")))?;
        Ok(self)
    }

    /// Envelopes whose structured-mode encoding is larger than `limit`
    /// bytes get their data claimed (default: the envelope size limit,
    /// 256 KiB).
    pub fn with_inline_limit(mut self, limit: usize) -> Self {
        self.inline_limit = limit;
        self
    }

    /// Uploads payloads larger than `bytes` in parts (default
    /// [`DEFAULT_MULTIPART_THRESHOLD`]). A part upload that fails leaves an
    /// incomplete upload on the store: give an S3 bucket a lifecycle rule
    /// that aborts them after a day.
    pub fn with_multipart_threshold(mut self, bytes: usize) -> Self {
        self.multipart_threshold = bytes;
        self
    }

    /// Never sweeps an object `holder` still claims (default: no holder,
    /// so age alone decides). Give it the service's `DeadLetters`, so a
    /// dead letter waiting for a replay keeps its payload.
    pub fn keeping(mut self, holder: Arc<dyn ClaimHolder>) -> Self {
        self.holders.push(holder);
        self
    }

    /// Never sweeps an object a message still on the broker may claim:
    /// every sweep keeps objects younger than `retention` (the broker's own,
    /// from [`Broker::retention`](crate::broker::Broker::retention)) plus
    /// `publish_delay`, the longest a claimed message may wait between the
    /// put and the broker storing it (the outbox's lag: a relay that was
    /// down). With [`MessageRetention::Forever`] nothing is swept by age;
    /// with `Unknown`, the sweep's cut-off alone decides.
    ///
    /// ```
    /// # use keel_messaging::claim_check::ClaimCheck;
    /// use std::time::Duration;
    /// use keel_messaging::broker::MessageRetention;
    ///
    /// # let dir = tempfile::tempdir().unwrap();
    /// // A 7-day topic: a claim stays fetchable for 7 days and 1 hour at least.
    /// let claims = ClaimCheck::local(dir.path())
    ///     .unwrap()
    ///     .outliving(MessageRetention::For(Duration::from_secs(7 * 86_400)), Duration::from_secs(3_600));
    /// ```
    pub fn outliving(mut self, retention: MessageRetention, publish_delay: Duration) -> Self {
        let floor = |age: Duration| {
            chrono::Duration::from_std(age.saturating_add(publish_delay))
                .map_or(MinLifetime::Forever, MinLifetime::At)
        };
        self.min_lifetime = match retention {
            MessageRetention::For(age) => floor(age),
            MessageRetention::Forever => MinLifetime::Forever,
            _ => MinLifetime::None,
        };
        self
    }

    /// The object store.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Writes `bytes` and returns the claim to them. Idempotent: the same
    /// bytes always give the same claim and object.
    pub async fn put(&self, bytes: Bytes) -> Result<Claim, ClaimCheckError> {
        let sha256 = sha256_hex(&bytes);
        let path = self.prefix.child(sha256.as_str());
        let size_bytes = bytes.len() as u64;
        if bytes.len() > self.multipart_threshold {
            self.put_in_parts(&path, &bytes).await?;
        } else {
            self.store
                .put(&path, bytes.into())
                .await
                .map_err(ClaimCheckError::Store)?;
        }
        let claim = Claim {
            location: format!("{}/{}", self.base, path),
            size_bytes,
            sha256,
        };
        metrics::counter!("keel_claim_check_put_total").increment(1);
        metrics::counter!("keel_claim_check_put_bytes_total").increment(size_bytes);
        tracing::debug!(location = %claim.location, size_bytes, "payload checked in");
        Ok(claim)
    }

    /// Fetches the claimed bytes, refusing them unless their size and
    /// SHA-256 match the claim.
    pub async fn fetch(&self, claim: &Claim) -> Result<Bytes, ClaimCheckError> {
        let path = self.path_of(&claim.location)?;
        let bytes = match self.store.get(&path).await {
            Ok(got) => got.bytes().await,
            Err(e) => Err(e),
        }
        .map_err(|e| self.store_error(e, claim))?;
        verify(claim, &bytes).inspect_err(|e| {
            metrics::counter!("keel_claim_check_rejected_total", "reason" => rejection_reason(e))
                .increment(1);
            tracing::warn!(location = %claim.location, error = %e, "claim check refused");
        })?;
        Ok(bytes)
    }

    /// Deletes the claimed object. Content addressing means another
    /// message with identical bytes shares the object: delete only when no
    /// message can still claim it (usually: let a lifecycle rule expire it).
    pub async fn delete(&self, claim: &Claim) -> Result<(), ClaimCheckError> {
        let path = self.path_of(&claim.location)?;
        match self.store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(ClaimCheckError::Store(e)),
        }
    }

    /// Deletes the objects under this claim check's prefix last written
    /// before `cut_off` that no holder ([`keeping`](Self::keeping)) still
    /// claims; returns how many. Set the cut-off from the lifetime a claim
    /// must be fetchable: at least the topic's retention, which
    /// [`outliving`](Self::outliving) enforces whatever cut-off is given. A
    /// holder that cannot answer stops the sweep before anything is
    /// deleted.
    pub async fn sweep(&self, cut_off: DateTime<Utc>) -> Result<u64, ClaimCheckError> {
        let cut_off = match self.min_lifetime {
            MinLifetime::None => cut_off,
            MinLifetime::At(floor) => keel_core::clock::utc_now()
                .checked_sub_signed(floor)
                .map_or(DateTime::<Utc>::MIN_UTC, |youngest| cut_off.min(youngest)),
            MinLifetime::Forever => {
                tracing::debug!("the broker keeps messages forever: no claim is swept by age");
                return Ok(0);
            }
        };
        let mut held = std::collections::HashSet::new();
        for holder in &self.holders {
            held.extend(holder.held().await?);
        }
        let mut objects = self.store.list(Some(&self.prefix));
        let mut swept = 0;
        while let Some(object) = objects.try_next().await.map_err(ClaimCheckError::Store)? {
            let claimed = object
                .location
                .filename()
                .is_some_and(|sha256| held.contains(sha256));
            if object.last_modified >= cut_off || claimed {
                continue;
            }
            match self.store.delete(&object.location).await {
                Ok(()) => swept += 1,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(ClaimCheckError::Store(e)),
            }
        }
        metrics::counter!("keel_claim_check_swept_total").increment(swept);
        if swept > 0 {
            tracing::info!(swept, %cut_off, "claimed objects past their lifetime deleted");
        }
        Ok(swept)
    }

    /// Sweeps objects older than `lifetime` every `every` until `shutdown`
    /// completes. A failed sweep is logged and tried again next time.
    pub async fn run_sweeper(
        &self,
        lifetime: Duration,
        every: Duration,
        shutdown: impl Future<Output = ()>,
    ) {
        let lifetime = chrono::Duration::from_std(lifetime).unwrap_or(chrono::Duration::MAX);
        keel_core::clock::every(every, shutdown, || async {
            let cut_off = keel_core::clock::utc_now()
                .checked_sub_signed(lifetime)
                .unwrap_or(DateTime::<Utc>::MIN_UTC);
            if let Err(error) = self.sweep(cut_off).await {
                tracing::warn!(%error, "claim check sweep failed");
            }
        })
        .await;
    }

    /// The envelope, with its data moved to the object store if its
    /// encoding is over the inline limit: `data` becomes the [`Claim`] and
    /// the `dataref` extension its location. Small envelopes are returned
    /// unchanged.
    pub async fn check_in(&self, mut envelope: Envelope) -> Result<Envelope, ClaimCheckError> {
        match envelope.to_json_limited(self.inline_limit) {
            Ok(_) => return Ok(envelope),
            Err(EnvelopeError::TooLarge { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let data = envelope.data.take().unwrap_or(Value::Null);
        let bytes = serde_json::to_vec(&data).map_err(EnvelopeError::Data)?;
        let claim = self.put(Bytes::from(bytes)).await?;
        envelope
            .extensions
            .insert(DATAREF.to_owned(), Value::String(claim.location.clone()));
        envelope.data = Some(serde_json::to_value(&claim).map_err(EnvelopeError::Data)?);
        // Still too big (huge extensions): say so now, not at the broker.
        envelope.to_json_limited(self.inline_limit)?;
        Ok(envelope)
    }

    /// The envelope with its claimed data fetched, verified and put back;
    /// envelopes without a `dataref` are returned unchanged.
    pub async fn check_out(&self, mut envelope: Envelope) -> Result<Envelope, ClaimCheckError> {
        let Some(dataref) = envelope.extensions.get(DATAREF) else {
            return Ok(envelope);
        };
        let dataref = dataref.as_str().unwrap_or_default().to_owned();
        let claim: Claim = envelope
            .data_as()
            .map_err(|e| ClaimCheckError::Invalid(format!("the envelope's claim: {e}")))?;
        if claim.location != dataref {
            return Err(ClaimCheckError::Invalid(format!(
                "`dataref` `{dataref}` and the claim's location `{}` differ",
                claim.location
            )));
        }
        let bytes = self.fetch(&claim).await?;
        let data: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ClaimCheckError::Invalid(format!("claimed data is not JSON: {e}")))?;
        envelope.extensions.remove(DATAREF);
        envelope.data = Some(data);
        Ok(envelope)
    }

    /// Encodes an envelope in structured mode for publishing or the
    /// outbox, claiming its data first if it is over the inline limit.
    pub async fn encode(&self, envelope: Envelope) -> Result<Vec<u8>, ClaimCheckError> {
        let envelope = self.check_in(envelope).await?;
        Ok(envelope.to_json_limited(self.inline_limit)?)
    }

    /// Decodes a structured-mode envelope, fetching claimed data.
    pub async fn decode(&self, bytes: &[u8]) -> Result<Envelope, ClaimCheckError> {
        self.check_out(Envelope::from_json(bytes)?).await
    }

    /// The path in [`store`](Self::store) of the object `claim` names,
    /// for tools that inspect, copy or restore it. A claim from another
    /// store is [`ClaimCheckError::ForeignLocation`].
    pub fn object_of(&self, claim: &Claim) -> Result<ObjectPath, ClaimCheckError> {
        self.path_of(&claim.location)
    }

    async fn put_in_parts(&self, path: &ObjectPath, bytes: &[u8]) -> Result<(), ClaimCheckError> {
        let upload = (self.store.put_multipart(path).await).map_err(ClaimCheckError::Store)?;
        let mut parts = WriteMultipart::new_with_chunk_size(upload, MULTIPART_PART_SIZE);
        parts.write(bytes);
        parts.finish().await.map_err(ClaimCheckError::Store)?;
        metrics::counter!("keel_claim_check_multipart_total").increment(1);
        Ok(())
    }

    fn path_of(&self, location: &str) -> Result<ObjectPath, ClaimCheckError> {
        let key = location
            .strip_prefix(self.base.as_str())
            .and_then(|rest| rest.strip_prefix('/'))
            .ok_or_else(|| ClaimCheckError::ForeignLocation {
                location: location.to_owned(),
                base: self.base.clone(),
            })?;
        ObjectPath::parse(key)
            .map_err(|e| ClaimCheckError::Invalid(format!("location `{location}`: {e}")))
    }

    fn store_error(&self, err: object_store::Error, claim: &Claim) -> ClaimCheckError {
        match err {
            object_store::Error::NotFound { .. } => {
                metrics::counter!("keel_claim_check_rejected_total", "reason" => "missing")
                    .increment(1);
                ClaimCheckError::Missing {
                    location: claim.location.clone(),
                }
            }
            other => ClaimCheckError::Store(other),
        }
    }
}

/// Checks `bytes` against a claim's size and SHA-256.
pub fn verify(claim: &Claim, bytes: &[u8]) -> Result<(), ClaimCheckError> {
    let actual_size = bytes.len() as u64;
    if actual_size != claim.size_bytes {
        return Err(ClaimCheckError::SizeMismatch {
            location: claim.location.clone(),
            expected: claim.size_bytes,
            actual: actual_size,
        });
    }
    let actual = sha256_hex(bytes);
    if !actual.eq_ignore_ascii_case(&claim.sha256) {
        return Err(ClaimCheckError::HashMismatch {
            location: claim.location.clone(),
            expected: claim.sha256.clone(),
            actual,
        });
    }
    Ok(())
}

fn rejection_reason(err: &ClaimCheckError) -> &'static str {
    match err {
        ClaimCheckError::SizeMismatch { .. } => "size_mismatch",
        ClaimCheckError::HashMismatch { .. } => "hash_mismatch",
        _ => "other",
    }
}

/// Lowercase hex SHA-256 of `bytes`.
fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(64);
    for b in digest {
        let _ = write!(out, "{b:02x}");
    }
    out
}

#[cfg(test)]
mod tests;
