//! Pure validation, one function per section: no environment, no files, no clients. What needs
//! them is left, named, for [`super::resolve`].

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue};
use tollgate_core::Policy;
use tollgate_tokens::{Counting, Encoding};

use super::check::duration;
use super::{
    ConfigError, GatewayConfig, IdempotencyConfig, MetricsConfig, QueueConfig, RawAnthropic,
    RawConfig, RawIdempotency, RawKill, RawMetrics, RawOperations, RawQueue, RawRemoteContent,
    RawResponses, RawServer, RawUpstream, RawUpstreamTools, StreamBounds, err,
};
use crate::upstream_tools::UpstreamTools;

/// A configuration checked, with what it names outside itself still to resolve.
pub(super) struct Checked {
    /// Everything but the upstreams' clients and keys, the tokenizer files and the admin token:
    /// `upstreams` is empty, `counter` the default and `admin` unset until resolved.
    pub config: GatewayConfig,
    pub upstreams: Vec<UpstreamSpec>,
    pub tokenizers: Vec<(String, TokenizerSpec)>,
    pub admin: Option<super::admin::AdminSpec>,
    pub webhooks: Vec<WebhookSpec>,
    /// `[records] digest_key_env`, read when resolved.
    pub records_key_env: Option<String>,
    /// The Redis store's CA file and credentials, read when resolved.
    pub store_access: super::stores::AccessSpec,
}

/// A webhook, checked: its URL (or the variable holding it) and format.
pub(super) struct WebhookSpec {
    pub url: Result<axum::http::Uri, String>,
    pub format: super::WebhookFormat,
    pub field: String,
}

/// An upstream, checked.
pub(super) struct UpstreamSpec {
    /// `upstreams[i]`, for errors.
    pub field: String,
    pub name: String,
    /// Without a trailing slash.
    pub base_url: String,
    /// The environment variable that holds its API key.
    pub api_key_env: Option<String>,
    pub ca_file: Option<String>,
    pub proxy: Option<String>,
    pub free_fields: Vec<String>,
}

/// How a model's tokens are counted: known now, or a tokenizer file to load.
pub(super) enum TokenizerSpec {
    Known(Counting),
    File(String),
}

/// Checks every section of `raw`.
pub(super) fn check(raw: RawConfig) -> Result<Checked, ConfigError> {
    let s = server(&raw.server)?;
    let conns = connection_bounds(&raw.server)?;
    let policy = Policy::validate(raw.policy, "policy")?;
    let (upstreams, models) = upstreams(raw.upstreams, &policy)?;
    let keys = super::keys::keys(raw.keys, &models, &policy.classes)?;
    let (unknown_context_tokens, context_ttl) = responses(&raw.responses)?;
    validate_betas(&raw.anthropic)?;
    let config = GatewayConfig {
        listen: s.listen,
        max_body_bytes: s.max_body_bytes,
        count_memo_entries: s.count_memo_entries,
        header_timeout: s.header_timeout,
        body_timeout: s.body_timeout,
        upstream_timeout: s.upstream_timeout,
        drain_timeout: s.drain_timeout,
        max_connections: s.max_connections,
        trusted_proxies: s.trusted_proxies,
        max_output_tokens: s.max_output_tokens,
        stream: conns.stream,
        cancel_grace: conns.cancel_grace,
        idle_timeout: conns.idle_timeout,
        max_connections_per_ip: conns.per_ip,
        http2_max_streams: conns.http2_max_streams,
        remote_tokens_per_item: remote_content(&raw.remote_content)?,
        remote_audio_tokens: remote_audio(&raw.remote_content)?,
        anthropic_betas: raw.anthropic.betas,
        operation_header: operation_header(&raw.operations)?,
        idempotency: idempotency(&raw.idempotency)?,
        metrics: metrics(&raw.metrics)?,
        log: super::log::log(&raw.log)?,
        otlp: super::otlp::otlp(raw.otlp.as_ref())?,
        kills: kills(&raw.kill)?,
        alerts: super::AlertsConfig {
            queue: bounded(raw.alerts.queue, 1000, 1..=100_000, "alerts.queue")?,
            attempts: bounded(
                raw.alerts.attempts.map(|a| a as usize),
                5,
                1..=20,
                "alerts.attempts",
            )? as u32,
            webhooks: Vec::new(),
        },
        counter: tollgate_tokens::TokenCounter::default(),
        unknown_context_tokens,
        context_ttl,
        upstream_tools: upstream_tools(&raw.upstream_tools)?,
        store: super::stores::store(&raw.store)?,
        ledger: raw.ledger.as_ref().map(super::stores::ledger).transpose()?,
        upstreams: Vec::new(),
        models,
        keys,
        policy,
        queue: raw.queue.as_ref().map(queue).transpose()?,
        records: raw.records.path,
        records_key: None,
        admin: None,
    };
    super::check::eviction(&config)?;
    Ok(Checked {
        config,
        upstreams,
        tokenizers: tokenizers(&raw.tokenizers)?,
        admin: raw.admin.as_ref().map(super::admin::admin).transpose()?,
        webhooks: webhooks(&raw.alerts.webhooks)?,
        records_key_env: raw.records.digest_key_env.clone(),
        store_access: super::stores::access(&raw.store)?,
    })
}

fn bounded(
    v: Option<usize>,
    default: usize,
    range: std::ops::RangeInclusive<usize>,
    field: &str,
) -> Result<usize, ConfigError> {
    let v = v.unwrap_or(default);
    if !range.contains(&v) {
        return Err(err(
            field,
            format!("must be from {} to {}", range.start(), range.end()),
        ));
    }
    Ok(v)
}

/// `[[alerts.webhooks]]`: a URL or the variable holding it (read when resolved), a format.
fn webhooks(raw: &[super::raw::RawWebhook]) -> Result<Vec<WebhookSpec>, ConfigError> {
    raw.iter()
        .enumerate()
        .map(|(i, w)| {
            let field = format!("alerts.webhooks[{i}]");
            let format = match w.format.as_deref() {
                None | Some("json") => super::WebhookFormat::Json,
                Some("slack") => super::WebhookFormat::Slack,
                Some(f) => {
                    return Err(err(
                        format!("{field}.format"),
                        format!("unknown format {f:?}; expected \"json\" or \"slack\""),
                    ));
                }
            };
            let url = match (&w.url, &w.url_env) {
                (Some(u), None) => Ok(webhook_url(u).map_err(|e| err(format!("{field}.url"), e))?),
                (None, Some(var)) => Err(var.clone()),
                _ => return Err(err(&field, "give exactly one of url or url_env")),
            };
            Ok(WebhookSpec { url, format, field })
        })
        .collect()
}

/// A webhook's URL: `http://` or `https://`, with a host.
pub(super) fn webhook_url(u: &str) -> Result<axum::http::Uri, String> {
    let uri: axum::http::Uri = u.parse().map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return Err("expected an http:// or https:// URL".into());
    }
    Ok(uri)
}

/// `[server]`'s listener, body and timeouts.
struct Server {
    listen: SocketAddr,
    max_body_bytes: usize,
    count_memo_entries: usize,
    header_timeout: Duration,
    body_timeout: Duration,
    upstream_timeout: Duration,
    drain_timeout: Duration,
    max_connections: usize,
    trusted_proxies: Vec<IpAddr>,
    max_output_tokens: u64,
}

fn server(s: &RawServer) -> Result<Server, ConfigError> {
    let listen: SocketAddr = s
        .listen
        .as_deref()
        .unwrap_or("127.0.0.1:8080")
        .parse()
        .map_err(|e| err("server.listen", format!("{e}")))?;
    let max_body_bytes = usize::try_from(s.max_body_bytes.unwrap_or(1 << 20)).unwrap_or(usize::MAX);
    if max_body_bytes == 0 {
        return Err(err("server.max_body_bytes", "must be greater than 0"));
    }
    let mut trusted_proxies = Vec::new();
    for (i, p) in s.trusted_proxies.iter().enumerate() {
        trusted_proxies.push(
            p.parse()
                .map_err(|e| err(format!("server.trusted_proxies[{i}]"), format!("{e}")))?,
        );
    }
    let secs = Duration::from_secs;
    Ok(Server {
        listen,
        max_body_bytes,
        count_memo_entries: usize::try_from(s.count_memo_entries.unwrap_or(1 << 18))
            .unwrap_or(usize::MAX),
        header_timeout: duration(&s.header_timeout, secs(10), "server.header_timeout")?,
        body_timeout: duration(&s.body_timeout, secs(30), "server.body_timeout")?,
        upstream_timeout: duration(&s.upstream_timeout, secs(120), "server.upstream_timeout")?,
        drain_timeout: duration(&s.drain_timeout, secs(25), "server.drain_timeout")?,
        max_connections: usize::try_from(s.max_connections.unwrap_or(1024)).unwrap_or(usize::MAX),
        trusted_proxies,
        max_output_tokens: s.max_output_tokens.unwrap_or(1_000_000),
    })
}

/// `[server]`'s bounds on client connections and upstream streams.
struct ConnectionBounds {
    idle_timeout: Duration,
    per_ip: usize,
    http2_max_streams: Option<u32>,
    stream: StreamBounds,
    cancel_grace: Duration,
}

fn connection_bounds(s: &RawServer) -> Result<ConnectionBounds, ConfigError> {
    let per_ip = match s.max_connections_per_ip.unwrap_or(64) {
        0 => {
            return Err(err(
                "server.max_connections_per_ip",
                "must be greater than 0",
            ));
        }
        n => usize::try_from(n).unwrap_or(usize::MAX),
    };
    let http2_max_streams = match (s.http2, s.http2_max_streams) {
        (false, Some(_)) => {
            return Err(err(
                "server.http2_max_streams",
                "applies only with http2 = true",
            ));
        }
        (false, None) => None,
        (true, n) => match n.unwrap_or(32) {
            n @ 1..=1024 => Some(n),
            _ => return Err(err("server.http2_max_streams", "must be from 1 to 1024")),
        },
    };
    let max_event_bytes = s.max_event_bytes.unwrap_or(8 << 20);
    if max_event_bytes < 1024 {
        return Err(err("server.max_event_bytes", "must be at least 1024"));
    }
    let secs = Duration::from_secs;
    let stream = StreamBounds {
        idle: duration(
            &s.stream_idle_timeout,
            secs(60),
            "server.stream_idle_timeout",
        )?,
        max_duration: duration(
            &s.stream_max_duration,
            secs(1800),
            "server.stream_max_duration",
        )?,
        max_event_bytes: usize::try_from(max_event_bytes).unwrap_or(usize::MAX),
    };
    Ok(ConnectionBounds {
        idle_timeout: duration(&s.idle_timeout, secs(30), "server.idle_timeout")?,
        per_ip,
        http2_max_streams,
        stream,
        cancel_grace: duration(&s.cancel_grace, secs(2), "server.cancel_grace")?,
    })
}

/// The upstreams, and which serves each model.
fn upstreams(
    raw: Vec<RawUpstream>,
    policy: &Policy,
) -> Result<(Vec<UpstreamSpec>, BTreeMap<String, usize>), ConfigError> {
    let money = policy.scopes.iter().any(|r| r.limits_money());
    let mut upstreams = Vec::new();
    let mut models = BTreeMap::new();
    for (i, u) in raw.into_iter().enumerate() {
        let field = format!("upstreams[{i}]");
        if !(u.base_url.starts_with("http://") || u.base_url.starts_with("https://")) {
            return Err(err(
                format!("{field}.base_url"),
                "must start with http:// or https://",
            ));
        }
        super::check::url(&format!("{field}.base_url"), &u.base_url, &u.base_url)?;
        for (name, set) in [
            ("ca_file", u.ca_file.is_some()),
            ("proxy", u.proxy.is_some()),
        ] {
            if set && !u.base_url.starts_with("https://") {
                return Err(err(
                    format!("{field}.{name}"),
                    "applies only to an https:// base_url",
                ));
            }
        }
        for (j, m) in u.models.iter().enumerate() {
            if models.insert(m.clone(), i).is_some() {
                return Err(err(
                    format!("{field}.models[{j}]"),
                    format!("model {m:?} is served twice"),
                ));
            }
            if money && policy.prices.price(m, None).is_none() {
                return Err(err(
                    format!("{field}.models[{j}]"),
                    format!("model {m:?} has no price, and the policy has a money limit"),
                ));
            }
        }
        upstreams.push(UpstreamSpec {
            field,
            name: u.name,
            base_url: u.base_url.trim_end_matches('/').to_owned(),
            api_key_env: u.api_key_env,
            ca_file: u.ca_file,
            proxy: u.proxy,
            free_fields: u.free_fields,
        });
    }
    degrades(policy, &models, money)?;
    Ok((upstreams, models))
}

/// Each model a rule degrades to is served, and priced where money is limited.
fn degrades(
    policy: &Policy,
    models: &BTreeMap<String, usize>,
    money: bool,
) -> Result<(), ConfigError> {
    for (i, rule) in policy.scopes.iter().enumerate() {
        let Some(d) = &rule.degrade else { continue };
        for (from, to) in &d.models {
            let field = format!("policy.scopes[{i}].degrade.models.{from}");
            if !models.contains_key(to) {
                return Err(err(field, format!("model {to:?} is served by no upstream")));
            }
            if money && policy.prices.price(to, None).is_none() {
                return Err(err(
                    field,
                    format!("model {to:?} has no price, and the policy has a money limit"),
                ));
            }
        }
    }
    Ok(())
}

fn queue(q: &RawQueue) -> Result<QueueConfig, ConfigError> {
    Ok(QueueConfig {
        max_wait: duration(&Some(q.max_wait.clone()), Duration::ZERO, "queue.max_wait")?,
        per_key: usize::try_from(q.per_key).unwrap_or(usize::MAX),
        global: usize::try_from(q.global).unwrap_or(usize::MAX),
    })
}

fn tokenizers(raw: &BTreeMap<String, String>) -> Result<Vec<(String, TokenizerSpec)>, ConfigError> {
    let mut specs = Vec::new();
    for (model, rule) in raw {
        let spec = match rule.as_str() {
            "estimate" => TokenizerSpec::Known(Counting::Estimate),
            "utf8_bytes" => TokenizerSpec::Known(Counting::Bytes),
            name if Encoding::parse(name).is_some() => match Encoding::parse(name) {
                Some(e) => TokenizerSpec::Known(Counting::Exact(e)),
                None => return Err(err(format!("tokenizers.{model:?}"), "encoding")),
            },
            file if file.ends_with(".json") => TokenizerSpec::File(file.to_owned()),
            other => {
                return Err(err(
                    format!("tokenizers.{model:?}"),
                    format!(
                        "expected o200k_base, cl100k_base, utf8_bytes, estimate or a tokenizer.json path, \
                         got {other:?}"
                    ),
                ));
            }
        };
        specs.push((model.clone(), spec));
    }
    Ok(specs)
}

/// `[responses]`: the input assumed for unknown kept context, and how long it is kept.
fn responses(raw: &RawResponses) -> Result<(u64, Duration), ConfigError> {
    let unknown = raw.unknown_context_tokens.unwrap_or(128_000);
    if unknown > 10_000_000 {
        return Err(err(
            "responses.unknown_context_tokens",
            "must be at most 10000000",
        ));
    }
    let ttl = duration(
        &raw.context_ttl,
        Duration::from_secs(86_400),
        "responses.context_ttl",
    )?;
    if !(Duration::from_secs(60)..=Duration::from_secs(30 * 86_400)).contains(&ttl) {
        return Err(err(
            "responses.context_ttl",
            "must be from 1 minute to 30 days",
        ));
    }
    Ok((unknown, ttl))
}

fn upstream_tools(raw: &RawUpstreamTools) -> Result<UpstreamTools, ConfigError> {
    let d = UpstreamTools::default();
    let within = |v: Option<u64>, default: u64, (lo, hi): (u64, u64), field: &str| {
        let v = v.unwrap_or(default);
        let path = format!("upstream_tools.{field}");
        (lo..=hi)
            .contains(&v)
            .then_some(v)
            .ok_or_else(|| err(path, format!("must be from {lo} to {hi}")))
    };
    Ok(UpstreamTools {
        tokens_per_call: within(
            raw.tokens_per_call,
            d.tokens_per_call,
            (0, 1_000_000),
            "tokens_per_call",
        )?,
        max_calls: within(raw.max_calls, d.max_calls, (1, 100), "max_calls")?,
        // OpenAI's static chunking takes 100 to 4,096 tokens a chunk.
        file_search_chunk_tokens: within(
            raw.file_search_chunk_tokens,
            d.file_search_chunk_tokens,
            (100, 4096),
            "file_search_chunk_tokens",
        )?,
    })
}

fn remote_content(raw: &RawRemoteContent) -> Result<u64, ConfigError> {
    let n = raw.tokens_per_item.unwrap_or(32_000);
    if n > 10_000_000 {
        return Err(err(
            "remote_content.tokens_per_item",
            "must be at most 10000000",
        ));
    }
    Ok(n)
}

fn remote_audio(raw: &RawRemoteContent) -> Result<Option<u64>, ConfigError> {
    match raw.audio_tokens_per_reference {
        Some(n) if n > 10_000_000 => Err(err(
            "remote_content.audio_tokens_per_reference",
            "must be at most 10000000",
        )),
        n => Ok(n),
    }
}

fn validate_betas(raw: &RawAnthropic) -> Result<(), ConfigError> {
    for (i, b) in raw.betas.iter().enumerate() {
        if b.is_empty() || b.contains(',') || HeaderValue::from_str(b).is_err() {
            return Err(err(
                format!("anthropic.betas[{i}]"),
                "one beta name, without commas",
            ));
        }
    }
    Ok(())
}

/// Headers the gateway reads for itself, which cannot also name an operation.
const OWN_HEADERS: [&str; 9] = [
    "authorization",
    "x-api-key",
    "content-type",
    "content-length",
    "host",
    "x-tollgate-user",
    "anthropic-version",
    "anthropic-beta",
    "idempotency-key",
];

fn idempotency(raw: &RawIdempotency) -> Result<IdempotencyConfig, ConfigError> {
    let within = |d: Duration, field: &str, max: Duration, what: &str| {
        if d < Duration::from_secs(1) || d > max {
            return Err(err(field, format!("must be from 1s to {what}")));
        }
        Ok(d)
    };
    let keep = duration(&raw.keep, Duration::from_secs(86_400), "idempotency.keep")?;
    let in_flight = duration(
        &raw.in_flight,
        Duration::from_secs(600),
        "idempotency.in_flight",
    )?;
    let max_response_bytes = raw.max_response_bytes.unwrap_or(1 << 20);
    if max_response_bytes > 16 << 20 {
        return Err(err(
            "idempotency.max_response_bytes",
            "must be at most 16 MiB",
        ));
    }
    Ok(IdempotencyConfig {
        keep: within(
            keep,
            "idempotency.keep",
            Duration::from_secs(7 * 86_400),
            "7 days",
        )?,
        in_flight: within(
            in_flight,
            "idempotency.in_flight",
            Duration::from_secs(86_400),
            "1 day",
        )?,
        max_response_bytes,
    })
}

fn operation_header(raw: &RawOperations) -> Result<HeaderName, ConfigError> {
    let name = raw.header.as_deref().unwrap_or("x-tollgate-operation");
    let header = HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).map_err(|_| {
        err(
            "operations.header",
            format!("{name:?} is not a header name"),
        )
    })?;
    if OWN_HEADERS.contains(&header.as_str()) {
        return Err(err(
            "operations.header",
            format!("{name:?} is a header the gateway reads for something else"),
        ));
    }
    Ok(header)
}

fn kills(raw: &[RawKill]) -> Result<Vec<(String, String)>, ConfigError> {
    let mut kills = Vec::new();
    for (i, k) in raw.iter().enumerate() {
        let known = k.target == "all"
            || ["tenant:", "key:", "model:", "user:"]
                .iter()
                .any(|p| k.target.strip_prefix(p).is_some_and(|v| !v.is_empty()));
        if !known {
            return Err(err(
                format!("kill[{i}].target"),
                "expected all, tenant:<id>, key:<id>, model:<name> or user:<id>",
            ));
        }
        kills.push((k.target.clone(), k.reason.clone()));
    }
    Ok(kills)
}

fn metrics(raw: &RawMetrics) -> Result<MetricsConfig, ConfigError> {
    let refresh = duration(&raw.refresh, Duration::from_secs(10), "metrics.refresh")?;
    if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&refresh) {
        return Err(err("metrics.refresh", "must be from 1 second to 1 hour"));
    }
    Ok(MetricsConfig {
        listen: raw
            .listen
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e| err("metrics.listen", format!("{e}")))?,
        refresh,
    })
}
