//! Fencing tokens: one monotonic counter per resource.

use async_trait::async_trait;

use super::{Store, StoreError};

/// Monotonic fencing tokens.
#[async_trait]
pub trait FenceStore: Store {
    /// The next token for `resource`: strictly greater than every token
    /// handed out before for it, across restarts.
    async fn fence_next(&self, resource: &str) -> Result<u64, StoreError>;
}
