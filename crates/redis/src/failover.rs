//! The store reads its primary's replication history ([`crate::history`]) and writes a loss
//! down when the history was cut short of what this instance saw.

use tollgate_core::StoreError;

use crate::conn::{Conn, no_answer, unavailable};
use crate::history::{Seen, cut_short, parse};
use crate::store::RedisStore;

impl RedisStore {
    /// Reads the primary's history; when it was cut short of what this instance saw in the
    /// store's current `epoch`, writes the loss down on every shard (the cause, and the marker
    /// removed, as the scripts do) and answers true. A server that does not answer `INFO`, or a
    /// cluster, is not read.
    pub(crate) async fn check_history(&self, epoch: Option<String>) -> Result<bool, StoreError> {
        let Conn::Single(conn) = &self.conn else {
            return Ok(false);
        };
        let Some(epoch) = epoch else {
            return Ok(false);
        };
        let mut conn = conn.clone();
        let timeout = self.config.call_timeout;
        let info = tokio::time::timeout(
            timeout,
            redis::cmd("INFO")
                .arg("replication")
                .query_async::<String>(&mut conn),
        )
        .await
        .map_err(|_| no_answer(timeout))?;
        let Some(now) = info.ok().as_deref().and_then(parse) else {
            return Ok(false);
        };
        let cut = {
            let Ok(mut seen) = self.history.lock() else {
                return Ok(false);
            };
            let cut = seen
                .as_ref()
                .filter(|s| s.epoch == epoch)
                .and_then(|s| cut_short(s, &now));
            let offset = match seen.as_ref() {
                Some(s) if s.id == now.id && s.epoch == epoch => s.offset.max(now.offset),
                _ => now.offset,
            };
            *seen = Some(Seen {
                id: now.id.clone(),
                offset,
                epoch,
            });
            cut
        };
        let Some(why) = cut else {
            return Ok(false);
        };
        for p in self.shards.iter() {
            let mut pipe = redis::pipe();
            pipe.atomic()
                .cmd("SET")
                .arg(format!("{p}:lost"))
                .arg(&why)
                .ignore()
                .cmd("DEL")
                .arg(format!("{p}:marker"))
                .ignore();
            tokio::time::timeout(timeout, pipe.query_async::<()>(&mut conn))
                .await
                .map_err(|_| no_answer(timeout))?
                .map_err(unavailable)?;
        }
        for m in self.markers.iter() {
            m.found(&why);
        }
        Ok(true)
    }
}
