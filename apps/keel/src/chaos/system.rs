//! One incarnation of the shop on the run's files: started, stopped and
//! started again on the same store file, broker file and port, as a
//! supervisor restarts a crashed process.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use keel_sqlite::store::SqliteSynchronous;
use keel_sqlite::{SqliteBroker, SqliteBrokerOptions, SqliteStore};
use keel_store::broker::Broker;

use super::broker::{BrokerFaults, FaultyBroker};
use crate::demo::workload::Accepted;
use crate::shop::model::{DemoFault, Item, NewOrder};
use crate::shop::services::PaymentsFaults;
use crate::shop::{StartError, System, SystemConfig, SystemHandle};

/// The store and the broker of one incarnation, opened on the run's files.
struct Files {
    store: SqliteStore,
    broker: Arc<SqliteBroker>,
}

impl Files {
    async fn open(dir: &Path) -> anyhow::Result<Self> {
        let store = SqliteStore::options()
            .synchronous(SqliteSynchronous::Normal)
            .open(dir.join("keel.db"))
            .await?;
        let broker = SqliteBrokerOptions::new()
            .synchronous(SqliteSynchronous::Normal)
            .poll_interval(Duration::from_millis(20))
            .open(dir.join("broker.db"))
            .await?;
        Ok(Self {
            store,
            broker: Arc::new(broker),
        })
    }
}

/// One running incarnation of the system.
pub(super) struct Incarnation {
    pub(super) handle: SystemHandle<SqliteStore>,
    pub(super) broker: Arc<SqliteBroker>,
}

impl Incarnation {
    /// Starts the system on the run's files, on `listen` (port 0 the first
    /// time, the same port afterwards so clients find it again).
    pub(super) async fn start(
        dir: &Path,
        listen: SocketAddr,
        payments: PaymentsFaults,
        broker_faults: &BrokerFaults,
        first: bool,
    ) -> anyhow::Result<Self> {
        let files = Files::open(dir).await?;
        let mut config = SystemConfig {
            listen,
            demo_faults: true,
            payments_faults: payments,
            ..SystemConfig::default()
        };
        if !first {
            // Stock is seeded once: a restart must not refill it.
            config.stock = Vec::new();
        }
        let inner: Arc<dyn Broker> = Arc::clone(&files.broker) as Arc<dyn Broker>;
        let broker: Arc<dyn Broker> = Arc::new(FaultyBroker::new(inner, broker_faults.clone()));
        // The old incarnation's listener may take a moment to be released.
        let mut attempts = 0;
        let handle = loop {
            let started = System::start(
                files.store.clone(),
                Arc::clone(&broker),
                config.clone(),
                |_| Ok(axum::Router::new()),
            )
            .await;
            match started {
                Err(StartError::Io(e))
                    if e.kind() == std::io::ErrorKind::AddrInUse && attempts < 50 =>
                {
                    attempts += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => break other?,
            }
        };
        Ok(Self {
            handle,
            broker: files.broker,
        })
    }

    /// Stops everything and closes both files.
    pub(super) async fn stop(self) {
        let store = self.handle.store.clone();
        self.handle.shutdown().await;
        self.broker.close().await;
        store.close().await;
    }
}

/// Submits one poison order (the consumer dead-letters it) with the same
/// retries as the workload; the order the API accepted.
pub(super) async fn submit_poison(base_url: String, key: String) -> Option<Accepted> {
    let order = NewOrder {
        customer_id: "cust-poison".into(),
        currency: "USD".into(),
        items: vec![Item::new("tea", 1, 450)],
    };
    submit_extra(base_url, key, order, Some("dead-letter")).await
}

/// Submits one order whose saga must compensate: `rare-vinyl` is never in
/// stock, so the reservation after the capture is refused and the capture
/// refunded.
pub(super) async fn submit_refused(base_url: String, key: String) -> Option<Accepted> {
    let order = NewOrder {
        customer_id: "cust-refused".into(),
        currency: "USD".into(),
        items: vec![Item::new("tea", 1, 450), Item::new("rare-vinyl", 1, 2_500)],
    };
    submit_extra(base_url, key, order, None).await
}

/// Submits one order after the workload ended, so that a failpoint armed
/// late has work to fire on; every other one asks for a sku that runs out,
/// so compensations happen too.
pub(super) async fn submit_tail(base_url: String, key: String, n: u64) -> Option<Accepted> {
    let mut items = vec![Item::new("tea", 1, 450)];
    if n % 2 == 1 {
        items.push(Item::new("rare-teapot", 1, 8_900));
    }
    let order = NewOrder {
        customer_id: format!("cust-tail-{}", n % 5),
        currency: "USD".into(),
        items,
    };
    submit_extra(base_url, key, order, None).await
}

async fn submit_extra(
    base_url: String,
    key: String,
    order: NewOrder,
    fault: Option<&str>,
) -> Option<Accepted> {
    let client = reqwest::Client::new();
    for _ in 0..400 {
        let mut request = client
            .post(format!("{base_url}/orders"))
            .header("idempotency-key", &key)
            .json(&order);
        if let Some(fault) = fault {
            request = request.header(DemoFault::HEADER, fault);
        }
        if let Ok(response) = request.send().await {
            if response.status().as_u16() == 201 {
                let body: serde_json::Value = response.json().await.ok()?;
                return Some(Accepted {
                    key,
                    order_id: body["id"].as_str()?.to_owned(),
                    total_cents: body["totalCents"].as_i64()?,
                });
            }
            if response.status().is_client_error() && response.status().as_u16() != 409 {
                return None;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}
