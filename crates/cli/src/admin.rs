//! `tollgate admin`: the admin API from a shell. Each subcommand is one call; the answer is a
//! table for people or, with `--format json`, the API's own JSON. Exit code 0 when the gateway
//! answered 2xx, 1 when it answered an error (its message is printed), 2 when it could not be
//! reached.

use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::cli::{AdminArgs, AdminCommand, Format};

/// Runs one admin subcommand.
pub async fn run(args: AdminArgs) -> anyhow::Result<ExitCode> {
    if let AdminCommand::InitStore { config: Some(path) } = &args.command {
        return init_directly(path).await;
    }
    let Some(url) = &args.url else {
        bail!("the admin listener's URL: give --url or set TOLLGATE_ADMIN_URL");
    };
    let token = std::env::var(&args.token_env)
        .with_context(|| format!("the admin token: ${} is not set", args.token_env))?;
    let base = url.trim_end_matches('/');
    let (method, path, body) = match &args.command {
        AdminCommand::Status => ("GET", "/admin/status".to_owned(), None),
        AdminCommand::Usage { scope, at } => {
            let at = at
                .as_ref()
                .map(|a| format!("&at={}", encode(a)))
                .unwrap_or_default();
            (
                "GET",
                format!("/admin/usage?scope={}{at}", encode(scope)),
                None,
            )
        }
        AdminCommand::Kill { target, reason } => (
            "POST",
            "/admin/kill".to_owned(),
            Some(json!({"target": target, "reason": reason})),
        ),
        AdminCommand::Lift { target } => {
            ("DELETE", format!("/admin/kill/{}", encode(target)), None)
        }
        AdminCommand::Reload => ("POST", "/admin/reload".to_owned(), None),
        AdminCommand::InitStore { .. } => ("POST", "/admin/store/init".to_owned(), None),
        AdminCommand::AcknowledgeLoss => ("POST", "/admin/store/acknowledge-loss".to_owned(), None),
        AdminCommand::Keys { command } => keys_call(command)?,
        AdminCommand::Limit { command } => limit_call(command),
    };
    let (status, answer) = call(method, &format!("{base}{path}"), &token, body).await?;
    let mut out = std::io::stdout();
    if !(200..300).contains(&status) {
        let message = answer["error"]["message"].as_str().unwrap_or("no message");
        let code = answer["error"]["code"].as_str().unwrap_or("");
        writeln!(std::io::stderr(), "error: {status} {code}: {message}")?;
        return Ok(ExitCode::from(1));
    }
    match args.format {
        Format::Json => writeln!(out, "{answer}")?,
        Format::Table => write!(out, "{}", table(&args.command, &answer))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `init-store --config FILE`: the store (and the ledger) the file names, initialised without
/// a gateway.
async fn init_directly(path: &std::path::Path) -> anyhow::Result<ExitCode> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let cfg = tollgate_gateway::GatewayConfig::from_toml(&text)
        .with_context(|| format!("in {}", path.display()))?;
    match tollgate_gateway::watch::init_store(&cfg).await {
        Ok(true) => writeln!(
            std::io::stdout(),
            "the store is initialised: admissions begin"
        )?,
        Ok(false) => writeln!(
            std::io::stdout(),
            "the store was initialised already: nothing changed"
        )?,
        Err(e) => {
            writeln!(std::io::stderr(), "error: {e}")?;
            return Ok(ExitCode::from(1));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The call of a `limit` subcommand.
fn limit_call(command: &crate::cli::LimitCommand) -> (&'static str, String, Option<Value>) {
    use crate::cli::LimitCommand;
    match command {
        LimitCommand::Set {
            value,
            control,
            limit,
            rule,
        } => {
            let mut body = json!({"value": value, "control": control, "limit": limit});
            if let Some(r) = rule {
                body["rule"] = json!(r);
            }
            ("PUT", "/admin/limits".to_owned(), Some(body))
        }
        LimitCommand::List => ("GET", "/admin/limits".to_owned(), None),
        LimitCommand::Clear {
            value,
            control,
            rule,
        } => {
            let rule = rule
                .as_ref()
                .map(|r| format!("&rule={}", encode(r)))
                .unwrap_or_default();
            (
                "DELETE",
                format!(
                    "/admin/limits?value={}&control={}{rule}",
                    encode(value),
                    encode(control)
                ),
                None,
            )
        }
    }
}

/// The call of a `keys` subcommand.
fn keys_call(
    command: &crate::cli::KeysCommand,
) -> anyhow::Result<(&'static str, String, Option<Value>)> {
    use crate::cli::KeysCommand;
    Ok(match command {
        KeysCommand::Create {
            tenant,
            name,
            user,
            allow_user,
            models,
            uses,
            expires_in,
            expires_at,
            metadata,
            limits,
        } => {
            let mut meta = serde_json::Map::new();
            for m in metadata {
                let Some((k, v)) = m.split_once('=') else {
                    bail!("--meta {m:?}: expected name=value");
                };
                meta.insert(k.to_owned(), Value::String(v.to_owned()));
            }
            let mut body = json!({"tenant": tenant, "allow_user": allow_user, "metadata": meta});
            for (k, v) in [
                ("name", name),
                ("user", user),
                ("uses", uses),
                ("expires_in", expires_in),
                ("expires_at", expires_at),
            ] {
                if let Some(v) = v {
                    body[k] = Value::String(v.clone());
                }
            }
            if !models.is_empty() {
                body["models"] = json!(models);
            }
            let mut own = serde_json::Map::new();
            for l in limits {
                let Some((control, limit)) = l.split_once('=') else {
                    bail!("--limit {l:?}: expected control=limit, e.g. requests=600");
                };
                own.insert(control.to_owned(), Value::String(limit.to_owned()));
            }
            if !own.is_empty() {
                body["limits"] = Value::Object(own);
            }
            ("POST", "/admin/keys".to_owned(), Some(body))
        }
        KeysCommand::List => ("GET", "/admin/keys".to_owned(), None),
        KeysCommand::Rotate { id, grace, from } => {
            let mut body = json!({});
            if let Some(g) = grace {
                body["grace"] = json!(g);
            }
            if let Some(v) = from {
                body["version"] = json!(v);
            }
            (
                "POST",
                format!("/admin/keys/{}/rotate", encode(id)),
                Some(body),
            )
        }
        KeysCommand::Revoke { id } => ("DELETE", format!("/admin/keys/{}", encode(id)), None),
    })
}

/// One call of the admin API: its status and JSON body.
async fn call(
    method: &str,
    url: &str,
    token: &str,
    body: Option<Value>,
) -> anyhow::Result<(u16, Value)> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("authorization", format!("Bearer {token}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .with_context(|| format!("the URL {url}"))?;
    let answer = tokio::time::timeout(std::time::Duration::from_secs(10), client.request(req))
        .await
        .context("the gateway did not answer within 10 s")?
        .with_context(|| format!("could not reach {url}"))?;
    let status = answer.status().as_u16();
    let bytes = answer.into_body().collect().await?.to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if v.is_null() && (200..300).contains(&status) {
        bail!("the gateway answered {status} without JSON");
    }
    Ok((status, v))
}

/// Percent-encodes what is not unreserved in a URL path or query part.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The answer as a table for people.
fn table(command: &AdminCommand, v: &Value) -> String {
    let mut s = String::new();
    let text = |v: &Value| match v {
        Value::String(t) => t.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    };
    match command {
        AdminCommand::Status => {
            for k in ["policy_version", "store", "in_flight"] {
                let _ = writeln!(s, "{:<16} {}", k.replace('_', " "), text(&v[k]));
            }
            let _ = writeln!(s, "\n{:<24} {:<20} {:<8} controls", "rule", "key", "mode");
            for r in v["rules"].as_array().into_iter().flatten() {
                let controls: Vec<String> = r["controls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(text)
                    .collect();
                let _ = writeln!(
                    s,
                    "{:<24} {:<20} {:<8} {}",
                    text(&r["name"]),
                    text(&r["key"]),
                    text(&r["mode"]),
                    controls.join(", ")
                );
            }
            let kills = v["kills"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            let _ = writeln!(
                s,
                "\nkill switches: {}",
                if kills.is_empty() { "none" } else { "" }
            );
            for k in kills {
                let origin = match (k["origin"].as_str(), k["file"].as_str()) {
                    (Some("configuration"), Some(f)) => format!("set in {f}"),
                    (Some("configuration"), None) => "set in the configuration".to_owned(),
                    _ => "set at run time".to_owned(),
                };
                let _ = writeln!(
                    s,
                    "  {:<30} {:<30} {origin}",
                    text(&k["target"]),
                    text(&k["reason"])
                );
            }
        }
        AdminCommand::Usage { .. } => {
            for k in [
                "scope",
                "source",
                "policy_version",
                "settled",
                "reserved",
                "leases",
                "concurrency_limit",
            ] {
                if !v[k].is_null() {
                    let _ = writeln!(s, "{:<18} {}", k.replace('_', " "), text(&v[k]));
                }
            }
            for (name, unit_of) in [("budget", None), ("tool_calls", Some("tool_calls"))] {
                let b = &v[name];
                if !b.is_object() {
                    continue;
                }
                let unit = match unit_of.or(b["unit"].as_str()) {
                    Some("micro_usd") => tollgate_core::Unit::MicroUsd,
                    Some("tool_calls") => tollgate_core::Unit::ToolCalls,
                    _ => tollgate_core::Unit::Tokens,
                };
                let label = name.replace('_', " ");
                for k in ["limit", "carried_over", "settled", "reserved", "remaining"] {
                    if let Some(n) = b[k].as_u64() {
                        let shown = tollgate_gateway::words::amount(n, unit);
                        let _ = writeln!(s, "{label} {k:<10} {shown}");
                    }
                }
                // By the store's clock, as the answer gives both instants.
                let at = (b["resets_at_ms"].as_u64(), v["now_ms"].as_u64());
                if let (Some(end), Some(now)) = at {
                    let shown = tollgate_gateway::words::reset_at(end, now);
                    let _ = writeln!(s, "{label} {:<10} {shown}", "resets");
                }
            }
        }
        AdminCommand::Kill { .. } | AdminCommand::Lift { .. } => {
            let state = if v["killed"] == true {
                "switched off"
            } else {
                "switched on again"
            };
            let _ = writeln!(s, "{} {state}", text(&v["target"]));
        }
        AdminCommand::Reload => {
            let _ = writeln!(s, "reloaded: policy version {}", text(&v["policy_version"]));
        }
        AdminCommand::InitStore { .. } => {
            let said = if v["initialised"] == true {
                "the store is initialised: admissions begin"
            } else {
                "the store was initialised already: nothing changed"
            };
            let _ = writeln!(s, "{said}");
        }
        AdminCommand::AcknowledgeLoss => {
            let _ = writeln!(
                s,
                "the loss is acknowledged: admissions resume from what the store holds now"
            );
        }
        AdminCommand::Keys { command } => crate::keys::table(&mut s, command, v),
        AdminCommand::Limit { command } => crate::keys::limits_table(&mut s, command, v),
    }
    s
}
