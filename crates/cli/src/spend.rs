//! `tollgate spend`: the ledger's endings in a time range, summed by one dimension.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, bail};
use tollgate_ledger::{By, Ledger, Settings, SpendRow};

use crate::cli::{ReportFormat, SpendBy};

pub(crate) async fn run(
    ledger: Option<String>,
    ledger_env: Option<String>,
    by: SpendBy,
    from: &str,
    to: &str,
    format: ReportFormat,
) -> anyhow::Result<ExitCode> {
    let url = match (ledger, ledger_env) {
        (Some(u), _) => u,
        (None, Some(var)) => std::env::var(&var).with_context(|| format!("{var} is not set"))?,
        (None, None) => bail!("give --ledger or --ledger-env"),
    };
    let (from_ms, to_ms) = (instant(from, "--from")?, instant(to, "--to")?);
    if from_ms >= to_ms {
        bail!("--from must come before --to");
    }
    let ledger = Ledger::open(Settings::new(url)).await?;
    let by = match by {
        SpendBy::Tenant => By::Tenant,
        SpendBy::Key => By::Key,
        SpendBy::Model => By::Model,
        SpendBy::User => By::User,
        SpendBy::Day => By::Day,
    };
    let rows = ledger.spend(by, from_ms, to_ms).await?;
    let mut out = std::io::stdout().lock();
    match format {
        ReportFormat::Json => {
            let rows: Vec<serde_json::Value> = rows.iter().map(json).collect();
            writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?;
        }
        ReportFormat::Csv => {
            writeln!(
                out,
                "group,requests,input_tokens,output_tokens,tool_calls,cost_usd"
            )?;
            for r in &rows {
                writeln!(
                    out,
                    "{},{},{},{},{},{}",
                    csv_field(&r.group),
                    r.requests,
                    r.input_tokens,
                    r.output_tokens,
                    r.tool_calls,
                    usd(r.cost_micro_usd)
                )?;
            }
        }
        ReportFormat::Table => table(&mut out, &rows)?,
    }
    Ok(ExitCode::SUCCESS)
}

fn json(r: &SpendRow) -> serde_json::Value {
    serde_json::json!({"group": r.group, "requests": r.requests, "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens, "tool_calls": r.tool_calls,
        "cost_micro_usd": r.cost_micro_usd})
}

fn table(out: &mut impl Write, rows: &[SpendRow]) -> std::io::Result<()> {
    let w = rows
        .iter()
        .map(|r| r.group.chars().count())
        .max()
        .unwrap_or(0)
        .max(5);
    writeln!(
        out,
        "{:<w$}  {:>9}  {:>13}  {:>13}  {:>10}  {:>14}",
        "group", "requests", "input tokens", "output tokens", "tool calls", "cost (USD)"
    )?;
    for r in rows {
        writeln!(
            out,
            "{:<w$}  {:>9}  {:>13}  {:>13}  {:>10}  {:>14}",
            r.group,
            r.requests,
            r.input_tokens,
            r.output_tokens,
            r.tool_calls,
            usd(r.cost_micro_usd)
        )?;
    }
    Ok(())
}

/// Micro-USD as dollars with six decimals.
fn usd(micro: i64) -> String {
    let sign = if micro < 0 { "-" } else { "" };
    let m = micro.unsigned_abs();
    format!("{sign}{}.{:06}", m / 1_000_000, m % 1_000_000)
}

/// A CSV field, quoted when it holds a comma, a quote or a line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

/// A UTC day (`2026-12-01`, its start) or time, in ms since the epoch.
fn instant(text: &str, flag: &str) -> anyhow::Result<i64> {
    let full = if text.len() == 10 {
        format!("{text}T00:00:00Z")
    } else {
        text.to_owned()
    };
    let t = humantime::parse_rfc3339_weak(full.trim_end_matches('Z')).with_context(|| {
        format!("{flag} {text:?}: give a UTC day or time (2026-12-01, 2026-12-01T08:00:00Z)")
    })?;
    let ms = t
        .duration_since(std::time::UNIX_EPOCH)
        .context("before 1970")?
        .as_millis();
    Ok(i64::try_from(ms)?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn days_and_times_and_money() {
        assert_eq!(instant("2026-01-01", "--from").unwrap(), 1_767_225_600_000);
        assert_eq!(
            instant("2026-01-01T01:00:00Z", "--from").unwrap(),
            1_767_229_200_000
        );
        assert!(instant("yesterday", "--from").is_err());
        assert_eq!(usd(1_234_567), "1.234567");
        assert_eq!(usd(42), "0.000042");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
    }
}
