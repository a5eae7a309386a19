//! `tollgate admin keys` and `tollgate admin limit`: the answers of `/admin/keys` and
//! `/admin/limits` as tables for people.

use std::fmt::Write as _;

use serde_json::Value;

use crate::cli::{KeysCommand, LimitCommand};

/// The answer to `command` as lines for a person.
pub fn table(s: &mut String, command: &KeysCommand, v: &Value) {
    let instant = |ms: &Value| {
        ms.as_u64()
            .map_or("never".to_owned(), tollgate_gateway::words::instant_ms)
    };
    match command {
        KeysCommand::Create { .. } | KeysCommand::Rotate { .. } => {
            let k = &v["key"];
            let _ = writeln!(s, "id       {}", text(&k["id"]));
            let _ = writeln!(s, "tenant   {}", text(&k["tenant"]));
            let _ = writeln!(s, "expires  {}", instant(&k["expires_at_ms"]));
            let _ = writeln!(s, "secret   {}", text(&v["secret"]));
            let _ = writeln!(
                s,
                "\nThe secret is shown this once: only its digest is kept."
            );
            if matches!(command, KeysCommand::Rotate { .. }) {
                let _ = writeln!(
                    s,
                    "The old secret works until its grace period ends (`keys list` shows when)."
                );
            }
        }
        KeysCommand::List => {
            let _ = writeln!(
                s,
                "{:<20} {:<16} {:<16} {:<12} {:<26} {:<7} state",
                "id", "name", "tenant", "user", "expires", "version"
            );
            for k in v["keys"].as_array().into_iter().flatten() {
                let grace = k["secrets"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s["until_ms"].as_u64())
                    .max();
                let state = grace.map_or("active".to_owned(), |u| {
                    format!(
                        "rotated, old secret until {}",
                        tollgate_gateway::words::instant_ms(u)
                    )
                });
                let _ = writeln!(
                    s,
                    "{:<20} {:<16} {:<16} {:<12} {:<26} {:<7} {state}",
                    text(&k["id"]),
                    text(&k["name"]),
                    text(&k["tenant"]),
                    text(&k["user"]),
                    instant(&k["expires_at_ms"]),
                    text(&k["version"]),
                );
            }
        }
        KeysCommand::Revoke { .. } => {
            let _ = writeln!(s, "{} revoked", text(&v["id"]));
        }
    }
}

/// The answer to a `limit` command as lines for a person.
pub fn limits_table(s: &mut String, command: &LimitCommand, v: &Value) {
    match command {
        LimitCommand::Set { .. } => {
            let l = &v["limit"];
            let _ = writeln!(
                s,
                "{} {}: {} (the rule's own: {}), revision {}",
                text(&l["scope"]),
                text(&l["control"]),
                text(&v["limit_shown"]),
                text(&v["default_shown"]),
                text(&l["revision"])
            );
        }
        LimitCommand::List => {
            let _ = writeln!(
                s,
                "{:<40} {:<12} {:>14} revision",
                "scope", "control", "limit"
            );
            for l in v["limits"].as_array().into_iter().flatten() {
                let _ = writeln!(
                    s,
                    "{:<40} {:<12} {:<32} {}",
                    text(&l["scope"]),
                    text(&l["control"]),
                    text(&l["limit_shown"]),
                    text(&l["revision"])
                );
            }
        }
        LimitCommand::Clear { .. } => {
            let _ = writeln!(
                s,
                "{} {}: the rule's own limit again",
                text(&v["scope"]),
                text(&v["control"])
            );
        }
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::String(t) => t.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}
