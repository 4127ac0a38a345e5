//! The shop's tables, written once for both backends.

/// The column types the backends spell differently in the shop's DDL.
#[derive(Debug, Clone, Copy)]
pub struct ShopTypes {
    /// A text key that sorts byte by byte (keyset pages must sort the same
    /// on every backend).
    pub key: &'static str,
    /// An increasing row number, the table's primary key.
    pub seq: &'static str,
    /// A 64-bit integer.
    pub int: &'static str,
    /// A boolean.
    pub flag: &'static str,
}

/// The shop's tables, in `types`.
pub fn shop_schema(types: &ShopTypes) -> String {
    let ShopTypes {
        key,
        seq,
        int,
        flag,
    } = types;
    format!(
        "CREATE TABLE IF NOT EXISTS shop_orders (
             id          {key} PRIMARY KEY,
             customer_id {key} NOT NULL,
             currency    TEXT NOT NULL,
             items       TEXT NOT NULL,
             total_cents {int} NOT NULL,
             status      TEXT NOT NULL,
             event_id    TEXT NOT NULL UNIQUE,
             demo_fault  TEXT,
             created_at  TEXT NOT NULL);
         CREATE INDEX IF NOT EXISTS shop_orders_customer ON shop_orders (customer_id, id);
         CREATE INDEX IF NOT EXISTS shop_orders_status ON shop_orders (status);
         CREATE TABLE IF NOT EXISTS shop_applied (
             seq      {seq},
             event_id TEXT NOT NULL,
             handler  TEXT NOT NULL);
         CREATE TABLE IF NOT EXISTS shop_stock (
             sku       TEXT PRIMARY KEY,
             available {int} NOT NULL CHECK (available >= 0));
         CREATE TABLE IF NOT EXISTS shop_effects (
             seq          {seq},
             idem_key     TEXT NOT NULL UNIQUE,
             order_id     TEXT NOT NULL,
             step         TEXT NOT NULL,
             compensation {flag} NOT NULL,
             amount_cents {int} NOT NULL,
             detail       TEXT NOT NULL DEFAULT '');
         CREATE INDEX IF NOT EXISTS shop_effects_order ON shop_effects (order_id, step);
         CREATE TABLE IF NOT EXISTS shop_tombstones (
             idem_key  TEXT PRIMARY KEY,
             undone_by TEXT NOT NULL);"
    )
}
