//! One PostgreSQL connection, made on first use and made again after it breaks.

use std::sync::Arc;

use tokio_postgres::{Client, NoTls};

use crate::LedgerError;

pub(crate) struct Conn {
    url: String,
    client: tokio::sync::Mutex<Option<Arc<Client>>>,
}

impl Conn {
    pub(crate) fn new(url: String) -> Self {
        Self {
            url,
            client: tokio::sync::Mutex::new(None),
        }
    }

    /// The connection, made again when there is none or it closed. The connection's own task
    /// runs in the caller's runtime.
    pub(crate) async fn get(&self) -> Result<Arc<Client>, LedgerError> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let connect = tokio_postgres::connect(&self.url, NoTls);
        let (client, connection) = tokio::time::timeout(std::time::Duration::from_secs(5), connect)
            .await
            .map_err(|_| LedgerError("no connection to PostgreSQL within 5 s".into()))??;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %e, "ledger connection closed");
            }
        });
        let client = Arc::new(client);
        *slot = Some(client.clone());
        Ok(client)
    }

    /// A statement failed: the error, as the ledger reports it (a closed connection is made
    /// again on next use).
    pub(crate) fn failed(&self, e: tokio_postgres::Error) -> LedgerError {
        LedgerError::from(e)
    }
}
