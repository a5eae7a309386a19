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
        }
    }

    /// Records dropped because the writer was behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// The text a record keeps of a value a client chose (end user, operation, network): the first
/// 16 bytes of its SHA-256, in hex. Equal values give equal digests, so a scope keyed on them
/// groups the same requests; the value itself is not kept.
pub fn digest(value: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"tollgate-record\0");
    h.update(value.as_bytes());
    h.finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}
