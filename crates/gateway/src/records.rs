//! Decision records: one JSON line per request, to standard output or a file, written by a
//! background task so that a slow disk never holds up a request. The records hold ids, scopes,
//! numbers and codes only (`tollgate_core::record::DecisionRecord` has no field for text).

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::mpsc;
use tollgate_core::record::DecisionRecord;

/// Where records go. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RecordSink {
    tx: mpsc::Sender<DecisionRecord>,
    dropped: Arc<AtomicU64>,
}

impl RecordSink {
    /// Writes to `path` (`-` for standard output), appending.
    pub fn open(path: &str) -> std::io::Result<Self> {
        let mut out: Box<dyn Write + Send> = if path == "-" {
            Box::new(std::io::stdout())
        } else {
            Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?,
            )
        };
        let (tx, mut rx) = mpsc::channel::<DecisionRecord>(16_384);
        tokio::task::spawn_blocking(move || {
            while let Some(r) = rx.blocking_recv() {
                let _ = writeln!(out, "{}", r.to_json_line());
                if rx.is_empty() {
                    let _ = out.flush();
                }
            }
            let _ = out.flush();
        });
        Ok(Self {
            tx,
            dropped: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Sends a record; when the writer is behind, the record is dropped and counted.
    pub fn emit(&self, r: DecisionRecord) {
        if self.tx.try_send(r).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            crate::faults::RECORDS_DROPPED.fail(
                &"the writer is behind",
                "decision records are dropped (counted in tollgate_records_dropped)",
            );
        } else {
            crate::faults::RECORDS_DROPPED.ok();
        }
    }

    /// Records dropped because the writer was behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// The text a record keeps of a value a client chose (end user, operation, network): the first
/// 16 bytes, in hex, of its HMAC-SHA-256 under `key` (`[records] digest_key_env`), or without
/// a key of its SHA-256 behind a fixed prefix. Equal values give equal digests, so a scope keyed
/// on them groups the same requests; the value itself is not kept, and with a key it cannot be
/// found again by hashing likely values.
pub fn digest(key: Option<&[u8]>, value: &str) -> String {
    use hmac::{KeyInit, Mac};
    use sha2::{Digest, Sha256};
    let bytes: Vec<u8> = match key.map(hmac::Hmac::<Sha256>::new_from_slice) {
        Some(Ok(mut mac)) => {
            mac.update(value.as_bytes());
            mac.finalize().into_bytes().to_vec()
        }
        _ => {
            let mut h = Sha256::new();
            h.update(b"tollgate-record\0");
            h.update(value.as_bytes());
            h.finalize().to_vec()
        }
    };
    crate::config::hex(bytes.get(..16).unwrap_or(&bytes))
}

#[cfg(test)]
mod tests {
    use super::digest;

    #[test]
    fn digests_are_stable_and_keyed() {
        let plain = digest(None, "alice@example.com");
        assert_eq!(plain.len(), 32);
        assert_eq!(plain, digest(None, "alice@example.com"));
        assert_ne!(plain, digest(None, "bob@example.com"));
        let a = digest(Some(b"0123456789abcdef"), "alice@example.com");
        assert_eq!(a, digest(Some(b"0123456789abcdef"), "alice@example.com"));
        assert_ne!(a, plain, "a key changes the digest");
        assert_ne!(a, digest(Some(b"another-key-0123"), "alice@example.com"));
    }
}
