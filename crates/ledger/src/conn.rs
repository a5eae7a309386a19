//! One PostgreSQL connection, made on first use and made again after it breaks.

use std::sync::Arc;

use tokio::sync::{Mutex, MutexGuard};
use tokio_postgres::{Client, NoTls};

use crate::LedgerError;

pub(crate) struct Conn {
    url: String,
    client: Mutex<Option<Arc<Client>>>,
}

/// The connection, held by one caller until dropped: what a transaction of explicit `BEGIN`
/// and `COMMIT` needs, since every statement sent on a connection between the two is part of
/// it.
pub(crate) struct Exclusive<'a> {
    _held: MutexGuard<'a, Option<Arc<Client>>>,
    client: Arc<Client>,
}

impl std::ops::Deref for Exclusive<'_> {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Conn {
    pub(crate) fn new(url: String) -> Self {
        Self {
            url,
            client: Mutex::new(None),
        }
    }

    /// The connection, made again when there is none or it closed. The connection's own task
    /// runs in the caller's runtime.
    pub(crate) async fn get(&self) -> Result<Arc<Client>, LedgerError> {
        let mut slot = self.client.lock().await;
        self.ready(&mut slot).await
    }

    /// The connection, for this caller alone until the value is dropped. A connection lent by
    /// [`Conn::get`] may still be in use: one `Conn` serves either callers of `get` or of
    /// `exclusive`, never both.
    pub(crate) async fn exclusive(&self) -> Result<Exclusive<'_>, LedgerError> {
        let mut slot = self.client.lock().await;
        let client = self.ready(&mut slot).await?;
        Ok(Exclusive {
            _held: slot,
            client,
        })
    }

    async fn ready(&self, slot: &mut Option<Arc<Client>>) -> Result<Arc<Client>, LedgerError> {
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
