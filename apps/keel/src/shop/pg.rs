//! The shop's business tables on PostgreSQL, in the store's own schema:
//! PostgreSQL's part of [`ShopBackend`] (the SQL itself is `sql.rs`).
//!
//! Several `keel serve` processes share one database, so the schema is
//! created under an advisory lock, and an action and the compensation that
//! tombstones its key take the same transaction-scoped advisory lock on
//! that key first, so a late action either lands before the undo (and is
//! undone) or sees the tombstone (and is refused), never slips between.
//! Ids are compared with the `C` collation, so keyset pages sort exactly as
//! on SQLite.

use keel_messaging::StoreError;
use keel_messaging::store::Store;
use keel_postgres::PgStore;
use keel_postgres::store::PgDialect;
use keel_sql::Dialect;

use super::sql::{ShopBackend, ShopTypes, shop_schema};

/// The advisory lock key serializing `migrate_shop` across processes
/// (per schema: it is hashed with the schema name).
const MIGRATE_LOCK: &str = "keel-shop-migrate";

impl ShopBackend for PgStore {
    const TYPES: ShopTypes = ShopTypes {
        key: r#"TEXT COLLATE "C""#,
        seq: "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
        int: "BIGINT",
        flag: "BOOLEAN",
    };

    fn shop_connections_free(&self) -> usize {
        PgStore::connections_free(self)
    }

    /// `CREATE ... IF NOT EXISTS` alone races between processes starting
    /// at once, hence the advisory lock.
    async fn create_shop_tables(&self) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext(current_schema() || $1))")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        let schema = shop_schema(&Self::TYPES);
        for statement in schema.split(';').filter(|s| !s.trim().is_empty()) {
            sqlx::query(statement).execute(&mut *tx).await.map_err(db)?;
        }
        self.commit_resolved(tx).await
    }

    /// A transaction-scoped advisory lock on the key.
    async fn lock_key(
        &self,
        tx: &mut keel_sql::backend::Tx<Self>,
        key: &str,
    ) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('keel-shop-key:' || $1))")
            .bind(key)
            .execute(&mut **tx)
            .await
            .map_err(db)?;
        Ok(())
    }
}

fn db(err: sqlx::Error) -> StoreError {
    <PgDialect as Dialect>::error(err)
}
