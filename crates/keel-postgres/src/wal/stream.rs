//! The task that streams the slot into the feed and confirms what the
//! relay finished.

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent};
use tokio::sync::watch;

use super::Shared;
use super::pgoutput::{self, Change, OutboxColumns};

/// How long the task waits before reconnecting after the stream failed.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// Streams until `shutdown` turns true, reconnecting after failures.
pub(super) async fn run(
    shared: Arc<Shared>,
    config: ReplicationConfig,
    mut confirm: watch::Receiver<u64>,
    mut shutdown: watch::Receiver<bool>,
) {
    while !*shutdown.borrow() {
        shared.feed.lock().restart();
        let result = tokio::select! {
            result = stream(&shared, config.clone(), &mut confirm) => result,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        if let Err(error) = result {
            metrics::counter!("keel_outbox_wal_stream_failures_total").increment(1);
            tracing::warn!(slot = %shared.options.slot, %error,
                "the outbox's WAL stream failed; the sweep carries the outbox until it is back");
        }
        tokio::select! {
            () = tokio::time::sleep(RECONNECT_AFTER) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn stream(
    shared: &Shared,
    config: ReplicationConfig,
    confirm: &mut watch::Receiver<u64>,
) -> Result<(), BoxError> {
    let mut client = ReplicationClient::connect(config).await?;
    tracing::info!(slot = %shared.options.slot, "streaming the outbox from its replication slot");
    let mut reader = Reader::default();
    loop {
        tokio::select! {
            event = client.recv() => match event? {
                Some(event) => reader.read(shared, event)?,
                None => return Err("the server ended the replication stream".into()),
            },
            changed = confirm.changed() => {
                changed?;
                client.update_applied_lsn(Lsn::from_u64(*confirm.borrow_and_update()));
            }
        }
    }
}

/// What the stream has told so far: the outbox table's columns.
#[derive(Default)]
struct Reader {
    outbox: Option<(u32, OutboxColumns)>,
}

impl Reader {
    /// Reads one event; a position that may be confirmed goes out through
    /// [`Shared::confirm`], as the relay's do.
    fn read(&mut self, shared: &Shared, event: ReplicationEvent) -> Result<(), BoxError> {
        match event {
            ReplicationEvent::XLogData { data, .. } => {
                self.change(shared, pgoutput::decode(data)?)?
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                let (rows, confirmable) = shared.feed.lock().commit(end_lsn.as_u64());
                if rows > 0 {
                    metrics::counter!("keel_outbox_wal_rows_total").increment(rows as u64);
                    shared.wake();
                }
                shared.confirm(confirmable);
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                let idle = shared.feed.lock().idle_at(wal_end.as_u64());
                shared.confirm(idle);
            }
            _ => {}
        }
        Ok(())
    }

    fn change(&mut self, shared: &Shared, change: Change) -> Result<(), BoxError> {
        match change {
            Change::Relation(relation)
                if relation.schema == shared.schema && relation.table == "keel_outbox" =>
            {
                self.outbox = Some((relation.oid, OutboxColumns::of(&relation)?));
            }
            Change::Insert { oid, values } => match &self.outbox {
                Some((outbox, columns)) if *outbox == oid => {
                    shared.feed.lock().insert(columns.row(&values)?);
                }
                Some(_) => {}
                None => return Err("an insert before the outbox table's columns".into()),
            },
            _ => {}
        }
        Ok(())
    }
}
