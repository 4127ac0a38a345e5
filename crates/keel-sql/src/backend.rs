//! A store the core can run on: its pools, its transaction, its wake-ups.

use std::future::Future;
use std::ops::DerefMut;

use keel_store::StoreError;

use crate::dialect::{Dialect, Exec, Value};

/// The sqlx database of a backend.
pub type Db<B> = <<B as SqlBackend>::Dialect as Dialect>::Db;
/// The row of a backend.
pub type Row<B> = <<B as SqlBackend>::Dialect as Dialect>::Row;
/// The transaction of a backend, the one the user's business SQL runs in.
pub type Tx<B> = <B as SqlBackend>::Tx;
/// The connection of a backend's database.
pub type Conn<B> = <Db<B> as sqlx::Database>::Connection;

/// What a wake-up announces to workers in other processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// A saga was created or saved.
    Sagas,
    /// Webhook deliveries were queued.
    Webhooks,
}

/// A backend store: where the core's statements run.
///
/// A backend with one writer (SQLite) hands out different pools for writes
/// and for reads outside a transaction; one that takes concurrent writers
/// (PostgreSQL) hands out its one pool for both.
pub trait SqlBackend: Send + Sync + 'static {
    /// The database's dialect.
    type Dialect: Dialect;

    /// The transaction handed to users: the database's own
    /// (`sqlx::Transaction`), or a backend's handle over one (SQLite's
    /// group-committed write). Either way it lends its connection, so
    /// `query.execute(&mut *tx)` runs the user's SQL in it.
    type Tx: DerefMut<Target = Conn<Self>> + Send + 'static;

    /// The pool for writes outside a transaction.
    fn writer(&self) -> &sqlx::Pool<Db<Self>>;

    /// The pool for reads outside a transaction.
    fn reader(&self) -> &sqlx::Pool<Db<Self>>;

    /// The channel that wakes other processes' workers (see
    /// [`Dialect::signalling`]); `None` where wake-ups are in-process.
    fn wake_channel(&self, wake: Wake) -> Option<&str> {
        let _ = wake;
        None
    }

    /// Begins one of the store's own transactions (the backend's `begin`:
    /// SQLite's `BEGIN IMMEDIATE` on its writer).
    fn begin_own(&self) -> impl Future<Output = Result<Tx<Self>, StoreError>> + Send;

    /// Commits one of the store's own transactions; where the backend can
    /// ask what became of a lost `COMMIT` (PostgreSQL), it does, instead of
    /// answering [`StoreError::OutcomeUnknown`].
    fn commit_own(&self, tx: Tx<Self>) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls back one of the store's own transactions.
    fn rollback_own(&self, tx: Tx<Self>) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Runs one write statement outside a transaction, atomic as any
    /// single statement is (a backend may rely on that: SQLite runs it
    /// without a savepoint); returns the rows it changed.
    fn write<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [Value<'a>],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a {
        async move {
            Self::Dialect::execute(Exec::Pool(self.writer()), sql, params)
                .await
                .map_err(Self::Dialect::autocommit_write_error)
        }
    }

    /// Runs one write statement outside a transaction and returns its
    /// first row (a statement ending in `RETURNING ...`).
    fn write_optional<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [Value<'a>],
    ) -> impl Future<Output = Result<Option<Row<Self>>, StoreError>> + Send + 'a {
        async move {
            Self::Dialect::fetch_optional(Exec::Pool(self.writer()), sql, params)
                .await
                .map_err(Self::Dialect::autocommit_write_error)
        }
    }

    /// Reads every row outside a transaction.
    fn read_all<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [Value<'a>],
    ) -> impl Future<Output = Result<Vec<Row<Self>>, StoreError>> + Send + 'a {
        Self::Dialect::fetch_all(Exec::Pool(self.reader()), sql, params)
    }

    /// Reads the first row outside a transaction.
    fn read_optional<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [Value<'a>],
    ) -> impl Future<Output = Result<Option<Row<Self>>, StoreError>> + Send + 'a {
        Self::Dialect::fetch_optional(Exec::Pool(self.reader()), sql, params)
    }
}

/// `statement` (a write ending in `RETURNING ...`) and its parameters,
/// extended to wake other processes' workers for `wake` where `store` has a
/// channel for it: the channel is bound as the next parameter
/// ([`Dialect::signalling`]). Unchanged where wake-ups are in-process.
pub fn signalled<'a, B: SqlBackend>(
    store: &'a B,
    wake: Wake,
    statement: &str,
    mut params: Vec<Value<'a>>,
) -> (String, Vec<Value<'a>>) {
    match store.wake_channel(wake) {
        Some(channel) => {
            params.push(channel.into());
            let placeholder = format!("${}", params.len());
            (B::Dialect::signalling(statement, &placeholder), params)
        }
        None => (statement.to_owned(), params),
    }
}

/// What a conditional write that changed nothing means: `Ok(false)` if the
/// row with `id` in `table` exists (the write's condition refused it),
/// [`StoreError::NotFound`] naming `what` if it does not.
pub async fn refused_or_missing<D: Dialect>(
    on: Exec<'_, D>,
    table: &str,
    id: Value<'_>,
    what: impl FnOnce() -> String,
) -> Result<bool, StoreError> {
    let sql = format!("SELECT id FROM {table} WHERE id = $1");
    match D::fetch_optional(on, &sql, &[id]).await? {
        Some(_) => Ok(false),
        None => Err(StoreError::NotFound(what())),
    }
}

/// Connections `pool` could hand out right now without waiting: the idle
/// ones and those not opened yet. For readiness (pool exhaustion); reads no
/// database.
pub fn connections_free<DB: sqlx::Database>(pool: &sqlx::Pool<DB>) -> usize {
    let unopened = pool
        .options()
        .get_max_connections()
        .saturating_sub(pool.size());
    pool.num_idle() + unopened as usize
}
