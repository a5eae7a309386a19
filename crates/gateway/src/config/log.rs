//! `[log]`: how the run-time log is written. The binary installs it; the library only logs.

use serde::Deserialize;

use super::ConfigError;

/// `[log]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    /// `text` (default: lines for a person, coloured on a terminal) or `json` (one object a
    /// line, for a log collector).
    pub format: Option<String>,
    /// What is logged, in `RUST_LOG`'s syntax (default `info`); `RUST_LOG`, when set, wins.
    pub filter: Option<String>,
}

/// How the run-time log is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    /// One JSON object a line rather than text.
    pub json: bool,
    /// The filter, in `RUST_LOG`'s syntax.
    pub filter: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            json: false,
            filter: "info".to_owned(),
        }
    }
}

/// `[log]`, checked.
pub(super) fn log(raw: &RawLog) -> Result<LogConfig, ConfigError> {
    let json = match raw.format.as_deref() {
        None | Some("text") => false,
        Some("json") => true,
        Some(other) => {
            return Err(super::err(
                "log.format",
                format!("unknown format {other:?}; expected \"text\" or \"json\""),
            ));
        }
    };
    let filter = raw.filter.clone().unwrap_or_else(|| "info".to_owned());
    if filter.trim().is_empty() {
        return Err(super::err("log.filter", "must not be empty"));
    }
    Ok(LogConfig { json, filter })
}
