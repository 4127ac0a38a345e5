//! The writer's commit gate: while a batch is open, nothing on the writer's
//! connection commits but the batch's own `COMMIT`.
//!
//! A logical transaction lends its caller the writer's connection. If a
//! statement in it makes SQLite roll the batch's physical transaction back
//! (an `OR ROLLBACK` conflict, a full disk, an I/O error) and the caller
//! carries on, its next statements find no transaction open and run in
//! autocommit: each commits at once, while the caller will be told that
//! nothing committed. PostgreSQL refuses statements in an aborted
//! transaction (`25P02`); SQLite has no such state, so the gate makes one. A
//! commit hook on the connection turns every commit into a rollback while a
//! batch is open and not committing: such a statement fails
//! (`SQLITE_CONSTRAINT_COMMITHOOK`) and leaves nothing behind.
//!
//! The hook reads one atomic, on the connection's thread, when a write
//! transaction commits: no round trip, nothing on the read path. It is
//! installed on the connections of the writer pool the store opens (one
//! connection); a store on a pool of yours ([`SqliteStore::from_pool`]) has
//! none, since the gate is one per store and your pool may have several
//! connections.
//!
//! [`SqliteStore::from_pool`]: super::SqliteStore::from_pool

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use sqlx::sqlite::{SqliteConnection, SqlitePoolOptions};

/// No batch is open: anything may commit.
const OPEN: u8 = 0;
/// A batch is open: only its `COMMIT` may.
const SHUT: u8 = 1;
/// The batch's `COMMIT` is under way.
const COMMITTING: u8 = 2;

/// The gate one store's writer connection commits through.
#[derive(Debug, Clone, Default)]
pub(crate) struct CommitGate(Arc<AtomicU8>);

impl CommitGate {
    /// `options` with the gate's hook installed on every connection.
    pub(crate) fn install_on(&self, options: SqlitePoolOptions) -> SqlitePoolOptions {
        let gate = self.clone();
        options.after_connect(move |conn, _meta| {
            let gate = gate.clone();
            Box::pin(async move { gate.hook(conn).await })
        })
    }

    async fn hook(self, conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
        let mut handle = conn.lock_handle().await?;
        handle.set_commit_hook(move || self.0.load(Ordering::Acquire) != SHUT);
        Ok(())
    }

    /// Shuts the gate for a batch that just began; it opens again when the
    /// returned guard is dropped, however the batch ends.
    pub(crate) fn shut(&self) -> ShutGate {
        self.0.store(SHUT, Ordering::Release);
        ShutGate(self.clone())
    }
}

/// The gate, shut for one batch.
#[derive(Debug)]
pub(crate) struct ShutGate(CommitGate);

impl ShutGate {
    /// Lets the batch's own `COMMIT` through.
    pub(crate) fn commit_next(&self) {
        (self.0).0.store(COMMITTING, Ordering::Release);
    }
}

impl Drop for ShutGate {
    fn drop(&mut self) {
        (self.0).0.store(OPEN, Ordering::Release);
    }
}
