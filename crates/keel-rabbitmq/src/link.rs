//! The connection to RabbitMQ, made again when it breaks.

use std::sync::Arc;

use keel_store::broker::BrokerError;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use crate::error::Within;

/// One AMQP connection shared by a broker's publishes, subscriptions and
/// checks. lapin does not reconnect by itself: whoever finds the
/// connection closed opens the next one, and channels of the dead one fail
/// their users, who open new ones here.
#[derive(Debug)]
pub(crate) struct Link {
    url: String,
    connection: Mutex<Option<Arc<Connection>>>,
}

impl Link {
    pub(crate) fn new(url: String) -> Self {
        Self {
            url,
            connection: Mutex::new(None),
        }
    }

    /// The live connection, connecting first if there is none.
    pub(crate) async fn connection(&self) -> Result<Arc<Connection>, BrokerError> {
        let mut slot = self.connection.lock().await;
        if let Some(connection) = slot.as_ref()
            && connection.status().connected()
        {
            return Ok(connection.clone());
        }
        let properties = ConnectionProperties::default()
            .with_connection_name("keel".into())
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current());
        let connection = Arc::new(Connection::connect(&self.url, properties).within().await?);
        *slot = Some(connection.clone());
        Ok(connection)
    }

    /// A new channel on the live connection.
    pub(crate) async fn channel(&self) -> Result<Channel, BrokerError> {
        let connection = self.connection().await?;
        connection.create_channel().within().await
    }
}
