//! Endings that could not reach PostgreSQL before the process stopped, kept in a local file
//! (one JSON object a line) and buffered again at the next start: a shutdown during a ledger
//! outage loses none. Written twice is harmless: the ledger keeps one ending per request id.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{Charge, Entry, Ledger};

#[derive(Serialize, Deserialize)]
struct Line {
    request_id: String,
    ending: String,
    at_ms: i64,
    tenant: Option<String>,
    key_id: Option<String>,
    model: Option<String>,
    end_user: Option<String>,
    input_tokens: i64,
    cached_tokens: i64,
    output_tokens: i64,
    tool_calls: i64,
    cost_micro_usd: Option<i64>,
    charges: Vec<ChargeLine>,
    apply_to_store: bool,
}

#[derive(Serialize, Deserialize)]
struct ChargeLine {
    scope: String,
    label: String,
    period_ms: i64,
    period_id: i64,
    period_start_ms: i64,
    period_end_ms: i64,
    unit: String,
    amount: i64,
}

/// The ledger's own name for an ending or a unit read back from a file (`None`: not one).
fn known(s: &str, names: &[&'static str]) -> Option<&'static str> {
    names.iter().copied().find(|n| *n == s)
}

const ENDINGS: [&str; 4] = ["settled", "released", "expired", "unrecorded"];
const UNITS: [&str; 3] = ["tokens", "micro_usd", "tool_calls"];

impl From<&Entry> for Line {
    fn from(e: &Entry) -> Self {
        Line {
            request_id: e.request_id.clone(),
            ending: e.ending.to_owned(),
            at_ms: e.at_ms,
            tenant: e.tenant.clone(),
            key_id: e.key_id.clone(),
            model: e.model.clone(),
            end_user: e.end_user.clone(),
            input_tokens: e.input_tokens,
            cached_tokens: e.cached_tokens,
            output_tokens: e.output_tokens,
            tool_calls: e.tool_calls,
            cost_micro_usd: e.cost_micro_usd,
            charges: e
                .charges
                .iter()
                .map(|c| ChargeLine {
                    scope: c.scope.clone(),
                    label: c.label.clone(),
                    period_ms: c.period_ms,
                    period_id: c.period_id,
                    period_start_ms: c.period_start_ms,
                    period_end_ms: c.period_end_ms,
                    unit: c.unit.to_owned(),
                    amount: c.amount,
                })
                .collect(),
            apply_to_store: e.apply_to_store,
        }
    }
}

impl Line {
    fn entry(self) -> Option<Entry> {
        let mut charges = Vec::with_capacity(self.charges.len());
        for c in self.charges {
            charges.push(Charge {
                scope: c.scope,
                label: c.label,
                period_ms: c.period_ms,
                period_id: c.period_id,
                period_start_ms: c.period_start_ms,
                period_end_ms: c.period_end_ms,
                unit: known(&c.unit, &UNITS)?,
                amount: c.amount,
            });
        }
        Some(Entry {
            request_id: self.request_id,
            ending: known(&self.ending, &ENDINGS)?,
            at_ms: self.at_ms,
            tenant: self.tenant,
            key_id: self.key_id,
            model: self.model,
            end_user: self.end_user,
            input_tokens: self.input_tokens,
            cached_tokens: self.cached_tokens,
            output_tokens: self.output_tokens,
            tool_calls: self.tool_calls,
            cost_micro_usd: self.cost_micro_usd,
            charges,
            apply_to_store: self.apply_to_store,
        })
    }
}

/// Where a spool's endings wait while they are written again.
pub fn replaying(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".replaying");
    PathBuf::from(p)
}

impl Ledger {
    /// Takes every ending still waiting and appends it to `path`; how many.
    pub fn spool(&self, path: &Path) -> std::io::Result<usize> {
        let entries = self.take_all();
        if entries.is_empty() {
            return Ok(0);
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let mut text = String::new();
        for e in &entries {
            text.push_str(&serde_json::to_string(&Line::from(e)).map_err(std::io::Error::other)?);
            text.push('\n');
        }
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        Ok(entries.len())
    }

    /// Buffers the endings a spool at `path` holds (and those of an earlier start's replay that
    /// did not finish), moving them to [`replaying`]`(path)` until they are written: (endings
    /// buffered, lines that are not endings).
    pub fn unspool(&self, path: &Path) -> std::io::Result<(usize, usize)> {
        let pending = replaying(path);
        let (mut read, mut bad) = (Vec::new(), 0);
        for p in [&pending, &path.to_path_buf()] {
            let f = match std::fs::File::open(p) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for line in std::io::BufReader::new(f).lines() {
                let line = line?;
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str::<Line>(&line)
                    .ok()
                    .and_then(Line::entry)
                {
                    Some(e) => read.push(e),
                    None => bad += 1,
                }
            }
        }
        if read.is_empty() && bad == 0 {
            return Ok((0, 0));
        }
        // One file holds them all while they are written.
        let mut text = String::new();
        for e in &read {
            text.push_str(&serde_json::to_string(&Line::from(e)).map_err(std::io::Error::other)?);
            text.push('\n');
        }
        std::fs::write(&pending, text)?;
        let _ = std::fs::remove_file(path);
        let n = read.len();
        for e in read {
            self.append_always(e);
        }
        Ok((n, bad))
    }
}
