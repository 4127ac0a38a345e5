//! What the in-process shop tests share: the shop on SQLite and the embedded
//! broker, in a directory of the test's own.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use keel::shop::{System, SystemConfig, SystemHandle};
use keel_messaging::broker::Broker;
use keel_sqlite::{SqliteBroker, SqliteStore};

/// Starts the shop with the default configuration on two files in `dir`.
pub async fn start_embedded(dir: &std::path::Path) -> SystemHandle<SqliteStore> {
    let store = SqliteStore::open(dir.join("keel.db"))
        .await
        .expect("open the store");
    let broker: Arc<dyn Broker> = Arc::new(
        SqliteBroker::open(dir.join("broker.db"))
            .await
            .expect("open the broker"),
    );
    System::start(store, broker, SystemConfig::default(), |_| {
        Ok(axum::Router::new())
    })
    .await
    .expect("start the shop")
}
