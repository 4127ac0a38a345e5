//! The idempotent consumer's inbox.
//!
//! Recording is `INSERT ... ON CONFLICT DO NOTHING` in the handler's own
//! transaction: the affected-row count says whether this handler saw the
//! event before. A plain `INSERT` would raise a unique violation instead,
//! which on PostgreSQL aborts the whole transaction, effect included. There
//! a concurrent duplicate waits for the first one's transaction: if that
//! commits, the duplicate sees the row and skips; if it rolls back, the
//! duplicate records the event and does the work.

use chrono::{DateTime, Utc};
use keel_store::StoreError;

use crate::backend::{SqlBackend, Tx};
use crate::dialect::{Dialect, Exec};
use crate::retry::{bounded_delete_sql, delete_batch};

const RECORD_SQL: &str = "\
INSERT INTO keel_inbox (event_id, handler, processed_at) VALUES ($1, $2, $3)
ON CONFLICT (event_id, handler) DO NOTHING";

/// [`InboxStore::inbox_record`](keel_store::InboxStore::inbox_record).
pub async fn record<B: SqlBackend>(
    tx: &mut Tx<B>,
    event_id: &str,
    handler: &str,
) -> Result<bool, StoreError> {
    let params = [event_id.into(), handler.into(), B::Dialect::now().into()];
    let inserted = B::Dialect::execute(Exec::Tx(tx), RECORD_SQL, &params).await?;
    Ok(inserted == 1)
}

/// [`InboxStore::inbox_prune`](keel_store::InboxStore::inbox_prune).
pub async fn prune<B: SqlBackend>(
    store: &B,
    before: DateTime<Utc>,
    batch: usize,
) -> Result<u64, StoreError> {
    let sql = bounded_delete_sql::<B::Dialect>(
        "keel_inbox",
        "event_id, handler",
        "processed_at < $1",
        "processed_at",
    );
    delete_batch(store, "inbox_prune", &sql, before.into(), batch).await
}

/// Implements [`InboxStore`](keel_store::InboxStore) for a
/// [`SqlBackend`] whose transaction is the core's [`Tx`].
#[macro_export]
macro_rules! inbox_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::InboxStore for $store {
            async fn inbox_record(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                event_id: &str,
                handler: &str,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::inbox::record::<Self>(tx, event_id, handler).await
            }

            async fn inbox_prune(
                &self,
                before: $crate::__private::DateTime<$crate::__private::Utc>,
                batch: usize,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::inbox::prune(self, before, batch).await
            }
        }
    };
}
