//! Whether a backend's embedded migrations have all been applied: what its
//! readiness probe asks the database.

use std::ops::RangeInclusive;

use keel_store::StoreError;

use crate::backend::SqlBackend;
use crate::dialect::{SqlRow, Value};

/// Fails unless every up-migration of `migrator` with a version in
/// `versions` (the backend's own range, apart from the broker's or the
/// user's) is recorded as applied in `_sqlx_migrations`.
pub async fn check_migrated<B: SqlBackend>(
    store: &B,
    migrator: &sqlx::migrate::Migrator,
    versions: RangeInclusive<i64>,
    what: &str,
) -> Result<(), StoreError> {
    let expected = migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .count();
    let sql = "SELECT COUNT(*) AS n FROM _sqlx_migrations \
               WHERE version BETWEEN $1 AND $2 AND success";
    let params: [Value<'_>; 2] = [(*versions.start()).into(), (*versions.end()).into()];
    let applied = match store.read_optional(sql, &params).await? {
        Some(row) => row.int("n")?,
        None => 0,
    };
    if usize::try_from(applied).unwrap_or(0) < expected {
        return Err(StoreError::other(format!(
            "{what} not migrated: {applied} of {expected} migrations applied"
        )));
    }
    Ok(())
}
