//! [`ClaimHolder`]: who still needs a claimed object, whatever its age.

use std::collections::HashSet;

use async_trait::async_trait;

use super::{Claim, ClaimCheckError, DATAREF};
use crate::broker::Message;
use crate::dead_letter::DeadLetters;
use crate::envelope::Envelope;
use crate::store::{DeadLetterFilter, DeadLetterStatus, DeadLetterStore, OutboxStore};

/// The most pending dead letters one sweep reads. A store holding more
/// than this cannot be proven not to claim an object, so the sweep then
/// deletes nothing (and says so) rather than guess.
pub const MAX_PENDING_SCAN: usize = 100_000;

/// Something that may still fetch claimed objects: the sweeper keeps every
/// object a holder names, however long ago it was written.
#[async_trait]
pub trait ClaimHolder: Send + Sync {
    /// The SHA-256 (lowercase hex) of every object still claimed. An error
    /// stops the sweep: an object is deleted only when every holder has
    /// said it does not need it.
    async fn held(&self) -> Result<HashSet<String>, ClaimCheckError>;
}

/// Pending dead letters hold their claims: a replay republishes the
/// message, and its consumer fetches the object again. A replayed or
/// discarded letter holds nothing.
#[async_trait]
impl<S: DeadLetterStore + OutboxStore> ClaimHolder for DeadLetters<S> {
    async fn held(&self) -> Result<HashSet<String>, ClaimCheckError> {
        let filter = DeadLetterFilter {
            status: Some(DeadLetterStatus::Pending),
            limit: Some(MAX_PENDING_SCAN + 1),
            ..DeadLetterFilter::default()
        };
        let pending = self.list(&filter).await.map_err(|e| {
            ClaimCheckError::Invalid(format!("pending dead letters could not be read: {e}"))
        })?;
        if pending.len() > MAX_PENDING_SCAN {
            return Err(ClaimCheckError::Invalid(format!(
                "more than {MAX_PENDING_SCAN} pending dead letters: their claims cannot all be \
                 read, so nothing is swept; replay or discard some"
            )));
        }
        Ok(pending
            .iter()
            .filter_map(|letter| claimed_sha256(&letter.message))
            .collect())
    }
}

/// The SHA-256 the claim of a message's envelope names, if it carries one
/// (structured mode, or binary mode with a `ce-dataref` header).
fn claimed_sha256(message: &Message) -> Option<String> {
    let headers = message
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()));
    let envelope = Envelope::from_json(&message.payload)
        .or_else(|_| Envelope::from_binary(headers, &message.payload))
        .ok()?;
    envelope.extensions.get(DATAREF)?;
    let claim: Claim = envelope.data_as().ok()?;
    Some(claim.sha256.to_ascii_lowercase())
}
