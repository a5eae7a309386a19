//! `tollgate whatif --records FILE --policy NEW.toml`: the recorded requests replayed under
//! another policy on the memory store and their recorded clock (`tollgate_core::whatif`), as
//! tables or JSON, with a progress bar on standard error when it is a terminal.

use std::io::{BufRead, Write};
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use tollgate_core::whatif::{self, RecordLine};
use tollgate_core::{ManualClock, MemoryStore, Policy};

use crate::cli::Format;

/// A bar over `len` units when standard error is a terminal (hidden otherwise).
fn bar(len: u64, what: &'static str) -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::new(len);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} ({eta} left)")
    {
        b.set_style(style.progress_chars("=> "));
    }
    b.set_message(what);
    b
}

/// The policy of `path`: a bare policy file, or a gateway configuration's `[policy]`.
pub(crate) fn load_policy(path: &Path) -> anyhow::Result<Policy> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let context = || format!("in {}", path.display());
    let table: toml::Table = toml::from_str(&text).with_context(context)?;
    // A gateway configuration: its `[policy]` alone (the rest, the admin token's variable
    // included, is not needed to replay).
    if let Some(p) = table.get("policy") {
        let raw: tollgate_core::policy::RawPolicy = p.clone().try_into().with_context(context)?;
        return Policy::validate(raw, "policy").with_context(context);
    }
    Policy::from_toml(&text).with_context(context)
}

/// Reads the records of `path`, one JSON object per line (blank lines skipped); a line that is
/// not a record is an error naming it.
fn read_records(path: &Path) -> anyhow::Result<Vec<RecordLine>> {
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let progress = bar(size, "reading");
    let mut records = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        progress.inc(line.len() as u64 + 1);
        if line.trim().is_empty() {
            continue;
        }
        let rec: RecordLine = serde_json::from_str(&line)
            .with_context(|| format!("{} line {}: not a decision record", path.display(), i + 1))?;
        records.push(rec);
    }
    progress.finish_and_clear();
    Ok(records)
}

/// `tollgate whatif`.
pub async fn run(records: &Path, policy: &Path, format: Format) -> anyhow::Result<ExitCode> {
    let policy = load_policy(policy)?;
    let records = read_records(records)?;
    let progress = bar(records.len() as u64, "replaying");
    let start = records.iter().map(|r| r.ts_ms).min().unwrap_or(0);
    let clock = ManualClock::new(start);
    let store = MemoryStore::with_clock(clock.clone());
    let report = whatif::whatif(records, &policy, &store, &clock, |n| {
        progress.set_position(n);
    })
    .await?;
    progress.finish_and_clear();
    let mut out = std::io::stdout();
    match format {
        Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?,
        Format::Table => write!(out, "{}", whatif::table(&report))?,
    }
    Ok(ExitCode::SUCCESS)
}
