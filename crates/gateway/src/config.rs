//! Gateway configuration: parsed raw from TOML, validated into types with errors that name the
//! field, like the policy it embeds.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::http::HeaderValue;
use serde::Deserialize;
use tollgate_core::policy::RawPolicy;
use tollgate_core::{Policy, PolicyError, Reason};

use crate::upstream::{Route, UpstreamClient};

fn err(path: impl Into<String>, message: impl Into<String>) -> PolicyError {
    PolicyError {
        path: path.into(),
        message: message.into(),
    }
}

/// The file as written.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Listener and limits.
    #[serde(default)]
    pub server: RawServer,
    /// Where counters live.
    #[serde(default)]
    pub store: RawStore,
    /// Upstream providers.
    #[serde(default)]
    pub upstreams: Vec<RawUpstream>,
    /// Virtual API keys.
    #[serde(default)]
    pub keys: Vec<RawKey>,
    /// The admission policy.
    #[serde(default)]
    pub policy: RawPolicy,
    /// Waiting for a concurrency slot.
    pub queue: Option<RawQueue>,
    /// Decision records.
    #[serde(default)]
    pub records: RawRecords,
    /// The admin API.
    pub admin: Option<RawAdmin>,
    /// OpenAI's Responses API.
    #[serde(default)]
    pub responses: RawResponses,
    /// Tools the upstream runs itself (web search and the like).
    #[serde(default)]
    pub upstream_tools: RawUpstreamTools,
    /// How models are counted: `o200k_base`, `cl100k_base`, `estimate`, or a `tokenizer.json`.
    #[serde(default)]
    pub tokenizers: BTreeMap<String, String>,
    /// Files and documents a request names by URL or file id.
    #[serde(default)]
    pub remote_content: RawRemoteContent,
    /// Anthropic's Messages API.
    #[serde(default)]
    pub anthropic: RawAnthropic,
    /// The Prometheus metrics.
    #[serde(default)]
    pub metrics: RawMetrics,
    /// Kill switches that hold whatever the store holds.
    #[serde(default)]
    pub kill: Vec<RawKill>,
}

/// `[remote_content]`: files and documents named by URL or file id, whose content the
/// upstream fetches and bills but the body does not hold.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawRemoteContent {
    /// Input tokens admitted for each such item: default 32,000, at most 10,000,000.
    pub tokens_per_item: Option<u64>,
}

/// `[anthropic]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawAnthropic {
    /// `anthropic-beta` values a client may send (default: none). A beta may add input the
    /// gateway never sees (the MCP connector, for one), so only those named here pass.
    #[serde(default)]
    pub betas: Vec<String>,
}

/// `[metrics]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    /// A listener of its own for `/metrics` and `/readyz`, without a token (e.g. a private
    /// `127.0.0.1:9090`); they are always on the admin listener too.
    pub listen: Option<String>,
    /// How often the budget figures a scrape shows are read from the store (default `10s`,
    /// from 1 s to 1 h): a scrape itself never calls the store.
    pub refresh: Option<String>,
}

/// Where and how often metrics are served.
#[derive(Debug, Clone)]
pub struct MetricsConfig {
    /// The metrics listener, if any.
    pub listen: Option<SocketAddr>,
    /// How often budget figures are refreshed.
    pub refresh: Duration,
}

/// `[admin]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    /// Its own listener, e.g. `127.0.0.1:8081`.
    pub listen: String,
    /// Environment variable holding the bearer token.
    pub token_env: Option<String>,
    /// File holding the bearer token (e.g. a mounted secret); give this or `token_env`.
    pub token_file: Option<String>,
}

/// The admin API's settings.
#[derive(Debug, Clone)]
pub struct AdminConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// The bearer token.
    pub token: String,
}

/// `[responses]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawResponses {
    /// Input tokens assumed for context the upstream keeps and this gateway has not seen (a
    /// `previous_response_id` or `conversation` it did not serve, `item_reference` items, a
    /// stored `prompt`): default 128,000, at most 10,000,000.
    pub unknown_context_tokens: Option<u64>,
    /// How long the Redis store keeps what a follow-up of a response carries (default `1d`,
    /// from 1 minute to 30 days, OpenAI's retention of a stored response). Each response
    /// kept costs Redis about 120 bytes.
    pub context_ttl: Option<String>,
}

/// `[upstream_tools]`: tools the upstream runs during a call, whose fetched input it bills (see
/// [`crate::upstream_tools`]).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawUpstreamTools {
    /// Input tokens admitted (checked against the input and total limits, reserved in budgets)
    /// for each call a request may make: default 8,000, at most 1,000,000.
    pub tokens_per_call: Option<u64>,
    /// The most calls a request may make, written into its body (`max_tool_calls`, Anthropic's
    /// `max_uses`): default 4, from 1 to 100.
    pub max_calls: Option<u64>,
}

/// `[records]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawRecords {
    /// `-` for standard output, or a file to append to; absent: no records.
    pub path: Option<String>,
}

/// `[server]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    /// Listen address (default `127.0.0.1:8080`).
    pub listen: Option<String>,
    /// Largest request body; larger ones get 413 before they are read (default 1 MiB).
    pub max_body_bytes: Option<u64>,
    /// Time allowed from accepting a connection to its first complete request head, first byte
    /// included (default 10 s).
    pub header_timeout: Option<String>,
    /// Time an open connection may sit between requests before the next head is complete
    /// (default 30 s).
    pub idle_timeout: Option<String>,
    /// Open connections from one client address at most (IPv6: one /64), default 64; trusted
    /// proxies are not limited by it.
    pub max_connections_per_ip: Option<u64>,
    /// Serve HTTP/2 (cleartext, prior knowledge or upgrade-free) as well as HTTP/1.1; default
    /// off: HTTP/1.1 only.
    #[serde(default)]
    pub http2: bool,
    /// With `http2`: streams at once on one connection (default 32, at most 1024).
    pub http2_max_streams: Option<u32>,
    /// Time allowed for a client to send its body (default 30 s).
    pub body_timeout: Option<String>,
    /// Time allowed for the upstream's response headers (default 120 s).
    pub upstream_timeout: Option<String>,
    /// Longest wait for the next event of an upstream stream; comments such as `: keep-alive`
    /// do not count as events (default 60 s).
    pub stream_idle_timeout: Option<String>,
    /// Longest an upstream stream may last (default 30 min).
    pub stream_max_duration: Option<String>,
    /// Largest event of an upstream stream, in bytes (default 8 MiB, at least 1 KiB).
    pub max_event_bytes: Option<u64>,
    /// How long a stream's lease is held after its client left and the upstream connection was
    /// closed, while the upstream may not have noticed yet (default 2 s).
    pub cancel_grace: Option<String>,
    /// On SIGTERM or SIGINT, how long requests under way may take to finish before they are
    /// cut off and released (default 25 s: inside the 30 s a Kubernetes pod is given).
    pub drain_timeout: Option<String>,
    /// Open client connections at most (default 1024).
    pub max_connections: Option<u64>,
    /// Proxies whose `X-Forwarded-For` is believed.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// The largest output cap a request may ask for (default 1,000,000); above it: 400.
    pub max_output_tokens: Option<u64>,
}

/// `[store]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    /// `memory` (default) or `redis://host:port/db`.
    pub url: Option<String>,
    /// Redis key prefix.
    pub prefix: Option<String>,
    /// Redis call timeout (default 250 ms).
    pub call_timeout: Option<String>,
    /// Redis Cluster seed nodes (`redis://…` each), instead of `url`.
    pub cluster: Option<Vec<String>>,
    /// Shards of the Redis key space (default 1; see `docs/redis.md`).
    pub shards: Option<u16>,
    /// How long finished request ids are remembered, so a late duplicate settlement is a
    /// no-op (default 1 h; at least 1 s).
    pub retention: Option<String>,
    /// Start even if Redis may evict keys (`maxmemory-policy` other than `noeviction`): an
    /// evicted budget or window reopens what it held (default false: refuse to start).
    #[serde(default)]
    pub allow_eviction: bool,
}

/// `[[kill]]`: a kill switch of the configuration file, which no store loss lifts.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKill {
    /// `all`, `tenant:<id>`, `key:<id>`, `model:<name>` or `user:<id>`.
    pub target: String,
    /// Shown to refused clients.
    pub reason: String,
}

/// `[[upstreams]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    /// Name.
    pub name: String,
    /// `http://host:port` or `https://host[:port]` (the `/v1/...` path is appended).
    pub base_url: String,
    /// Environment variable holding the upstream API key (never sent to clients).
    pub api_key_env: Option<String>,
    /// Models this upstream serves.
    pub models: Vec<String>,
    /// For an `https://` upstream: a PEM file of the CA certificates to trust instead of
    /// Mozilla's roots (a private CA, or a self-signed upstream).
    pub ca_file: Option<String>,
    /// For an `https://` upstream: `http://[user:password@]host:port` of an HTTP proxy to reach
    /// it through (a `CONNECT` tunnel; TLS runs end to end inside it).
    pub proxy: Option<String>,
}

/// `[[keys]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    /// A label for logs.
    pub name: Option<String>,
    /// `sha256:<hex>` of the key (`tollgate hash-key KEY`).
    pub hash: String,
    /// The tenant.
    pub tenant: String,
    /// A fixed end user for this key.
    pub user: Option<String>,
    /// Whether the end user may be named by the request (`user` field or `x-tollgate-user`).
    #[serde(default)]
    pub allow_user: bool,
    /// Models this key may use (default: all).
    pub models: Option<Vec<String>>,
    /// Controls this key is exempt from (reason codes), e.g. trusted internal traffic.
    #[serde(default)]
    pub exempt: Vec<String>,
}

/// `[queue]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawQueue {
    /// Longest wait for a concurrency slot.
    pub max_wait: String,
    /// Waiting requests per key at most.
    pub per_key: u64,
    /// Waiting requests in all at most.
    pub global: u64,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// Body limit.
    pub max_body_bytes: usize,
    /// Accept to first complete request head.
    pub header_timeout: Duration,
    /// Between requests on one connection.
    pub idle_timeout: Duration,
    /// Open connections per client address (IPv6 /64).
    pub max_connections_per_ip: usize,
    /// HTTP/2 served, with this many streams per connection.
    pub http2_max_streams: Option<u32>,
    /// Input tokens admitted per file or document named by URL or id.
    pub remote_tokens_per_item: u64,
    /// `anthropic-beta` values clients may send.
    pub anthropic_betas: Vec<String>,
    /// Metrics.
    pub metrics: MetricsConfig,
    /// Kill switches of the file: (target, reason).
    pub kills: Vec<(String, String)>,
    /// Body read timeout.
    pub body_timeout: Duration,
    /// Upstream response-header timeout.
    pub upstream_timeout: Duration,
    /// Bounds of upstream streams.
    pub stream: StreamBounds,
    /// A cancelled stream's lease is held this much longer.
    pub cancel_grace: Duration,
    /// How long requests under way may take to finish at shutdown.
    pub drain_timeout: Duration,
    /// Connection limit.
    pub max_connections: usize,
    /// Trusted proxy addresses.
    pub trusted_proxies: Vec<IpAddr>,
    /// Largest output cap accepted.
    pub max_output_tokens: u64,
    /// Store.
    pub store: StoreConfig,
    /// Upstreams.
    pub upstreams: Vec<Upstream>,
    /// Model → upstream index.
    pub models: BTreeMap<String, usize>,
    /// Key hash (hex) → key.
    pub keys: HashMap<String, KeyConfig>,
    /// Policy.
    pub policy: Policy,
    /// Queue.
    pub queue: Option<QueueConfig>,
    /// Decision records: `-` or a file path.
    pub records: Option<String>,
    /// The admin API.
    pub admin: Option<AdminConfig>,
    /// Token counting per model.
    pub counter: tollgate_tokens::TokenCounter,
    /// Responses API: input tokens assumed for upstream-kept context this gateway has not seen.
    pub unknown_context_tokens: u64,
    /// Responses API: how long the Redis store keeps what a follow-up carries.
    pub context_ttl: Duration,
    /// Tools the upstream runs: the input admitted per call, and the most calls.
    pub upstream_tools: crate::upstream_tools::UpstreamTools,
}

/// How long and how large an upstream stream may be; past a bound, the client gets an error
/// event, the usage metered so far is charged, and the lease is released.
#[derive(Debug, Clone, Copy)]
pub struct StreamBounds {
    /// Longest wait for the next event.
    pub idle: Duration,
    /// Longest stream.
    pub max_duration: Duration,
    /// Largest event.
    pub max_event_bytes: usize,
}

/// Where counters live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// In this process.
    Memory {
        /// How long finished request ids are remembered.
        retention: Duration,
    },
    /// Redis.
    Redis {
        /// URL.
        url: String,
        /// Key prefix.
        prefix: String,
        /// Call timeout.
        call_timeout: Duration,
        /// Cluster seed nodes, when a cluster.
        cluster: Option<Vec<String>>,
        /// Shards of the key space (1 to 1024).
        shards: u16,
        /// How long finished request ids are remembered.
        retention: Duration,
        /// Whether a server that may evict keys is accepted.
        allow_eviction: bool,
    },
}

/// An upstream.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// Name.
    pub name: String,
    /// Base URL without a trailing slash.
    pub base_url: String,
    /// The API key, read from the environment at start-up.
    pub api_key: Option<String>,
    /// Its client: a connection pool of its own and, for https, its trust anchors.
    pub client: UpstreamClient,
}

/// A virtual API key.
#[derive(Debug, Clone)]
pub struct KeyConfig {
    /// Label.
    pub name: String,
    /// Short hash used as the `key` dimension (never the key).
    pub key_id: String,
    /// Tenant.
    pub tenant: String,
    /// Fixed user.
    pub user: Option<String>,
    /// Whether requests may name the user.
    pub allow_user: bool,
    /// Allowed models (`None`: all).
    pub models: Option<Vec<String>>,
    /// Exempt controls.
    pub exempt: Vec<Reason>,
}

/// Queue limits.
#[derive(Debug, Clone, Copy)]
pub struct QueueConfig {
    /// Longest wait.
    pub max_wait: Duration,
    /// Per key.
    pub per_key: usize,
    /// In all.
    pub global: usize,
}

fn duration(v: &Option<String>, default: Duration, path: &str) -> Result<Duration, PolicyError> {
    match v {
        None => Ok(default),
        Some(s) => humantime::parse_duration(s)
            .map_err(|e| err(path, format!("invalid duration {s:?}: {e}"))),
    }
}

impl GatewayConfig {
    /// Parses and validates a TOML configuration.
    pub fn from_toml(text: &str) -> Result<Self, PolicyError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| err("config", e.to_string()))?;
        Self::validate(raw)
    }

    /// Validates a raw configuration.
    pub fn validate(raw: RawConfig) -> Result<Self, PolicyError> {
        let s = &raw.server;
        let listen: SocketAddr = s
            .listen
            .as_deref()
            .unwrap_or("127.0.0.1:8080")
            .parse()
            .map_err(|e| err("server.listen", format!("{e}")))?;
        let max_body_bytes =
            usize::try_from(s.max_body_bytes.unwrap_or(1 << 20)).unwrap_or(usize::MAX);
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
        let shards = match raw.store.shards {
            None => 1,
            Some(n @ 1..=1024) => n,
            Some(n) => {
                return Err(err(
                    "store.shards",
                    format!("{n} shards: give 1 to 1024 (every instance the same number)"),
                ));
            }
        };
        let retention = duration(
            &raw.store.retention,
            Duration::from_secs(3600),
            "store.retention",
        )?;
        if retention < Duration::from_secs(1) {
            return Err(err(
                "store.retention",
                "at least 1s: a settlement may arrive after the request's last byte",
            ));
        }
        let prefix = raw
            .store
            .prefix
            .clone()
            .unwrap_or_else(|| "tollgate".into());
        let call_timeout = duration(
            &raw.store.call_timeout,
            Duration::from_millis(250),
            "store.call_timeout",
        )?;
        let store = match raw.store.url.as_deref() {
            None | Some("memory") if raw.store.cluster.is_some() => StoreConfig::Redis {
                url: String::new(),
                prefix,
                call_timeout,
                cluster: raw.store.cluster.clone(),
                shards,
                retention,
                allow_eviction: raw.store.allow_eviction,
            },
            None | Some("memory") => StoreConfig::Memory { retention },
            Some(url) if url.starts_with("redis://") => StoreConfig::Redis {
                url: url.to_owned(),
                prefix,
                call_timeout,
                cluster: None,
                shards,
                retention,
                allow_eviction: raw.store.allow_eviction,
            },
            Some(other) => {
                return Err(err(
                    "store.url",
                    format!("expected \"memory\" or redis://…, got {other:?}"),
                ));
            }
        };
        let policy = Policy::validate(raw.policy, "policy")?;
        let money = policy.scopes.iter().any(|r| {
            r.budget
                .is_some_and(|b| b.unit == tollgate_core::Unit::MicroUsd)
        });
        let mut upstreams = Vec::new();
        let mut models = BTreeMap::new();
        for (i, u) in raw.upstreams.into_iter().enumerate() {
            let path = format!("upstreams[{i}]");
            if !(u.base_url.starts_with("http://") || u.base_url.starts_with("https://")) {
                return Err(err(
                    format!("{path}.base_url"),
                    "must start with http:// or https://",
                ));
            }
            for (field, set) in [
                ("ca_file", u.ca_file.is_some()),
                ("proxy", u.proxy.is_some()),
            ] {
                if set && !u.base_url.starts_with("https://") {
                    return Err(err(
                        format!("{path}.{field}"),
                        "applies only to an https:// base_url",
                    ));
                }
            }
            let client = UpstreamClient::new(Route {
                ca_file: u.ca_file.as_deref().map(std::path::Path::new),
                proxy: u.proxy.as_deref(),
            })
            .map_err(|(field, e)| err(format!("{path}.{field}"), e))?;
            let api_key = match &u.api_key_env {
                Some(var) => Some(std::env::var(var).map_err(|_| {
                    err(
                        format!("{path}.api_key_env"),
                        format!("environment variable {var} is not set"),
                    )
                })?),
                None => None,
            };
            for (j, m) in u.models.iter().enumerate() {
                if models.insert(m.clone(), i).is_some() {
                    return Err(err(
                        format!("{path}.models[{j}]"),
                        format!("model {m:?} is served twice"),
                    ));
                }
                if money && !policy.prices.contains_key(m) {
                    return Err(err(
                        format!("{path}.models[{j}]"),
                        format!("model {m:?} has no price, and the policy has a money budget"),
                    ));
                }
            }
            upstreams.push(Upstream {
                name: u.name,
                base_url: u.base_url.trim_end_matches('/').to_owned(),
                api_key,
                client,
            });
        }
        let mut keys = HashMap::new();
        for (i, k) in raw.keys.into_iter().enumerate() {
            let path = format!("keys[{i}]");
            let hex = k
                .hash
                .strip_prefix("sha256:")
                .filter(|h| h.len() == 64 && h.chars().all(|c| c.is_ascii_hexdigit()))
                .ok_or_else(|| {
                    err(
                        format!("{path}.hash"),
                        "expected sha256:<64 hex digits> (see `tollgate hash-key`)",
                    )
                })?
                .to_ascii_lowercase();
            let mut exempt = Vec::new();
            for (j, e) in k.exempt.iter().enumerate() {
                exempt.push(Reason::from_code(e).ok_or_else(|| {
                    err(
                        format!("{path}.exempt[{j}]"),
                        format!("unknown control {e:?}"),
                    )
                })?);
            }
            if let Some(ms) = &k.models {
                for (j, m) in ms.iter().enumerate() {
                    if !models.contains_key(m) {
                        return Err(err(
                            format!("{path}.models[{j}]"),
                            format!("no upstream serves {m:?}"),
                        ));
                    }
                }
            }
            let key = KeyConfig {
                name: k.name.unwrap_or_else(|| format!("key{i}")),
                key_id: hex[..16].to_owned(),
                tenant: k.tenant,
                user: k.user,
                allow_user: k.allow_user,
                models: k.models,
                exempt,
            };
            if keys.insert(hex, key).is_some() {
                return Err(err(format!("{path}.hash"), "the same key twice"));
            }
        }
        let queue = match raw.queue {
            Some(q) => Some(QueueConfig {
                max_wait: duration(&Some(q.max_wait), Duration::ZERO, "queue.max_wait")?,
                per_key: usize::try_from(q.per_key).unwrap_or(usize::MAX),
                global: usize::try_from(q.global).unwrap_or(usize::MAX),
            }),
            None => None,
        };
        let mut counter = tollgate_tokens::TokenCounter::default();
        for (model, rule) in &raw.tokenizers {
            let path = format!("tokenizers.{model:?}");
            let counting = match rule.as_str() {
                "estimate" => tollgate_tokens::Counting::Estimate,
                name if tollgate_tokens::Encoding::parse(name).is_some() => {
                    tollgate_tokens::Counting::Exact(
                        tollgate_tokens::Encoding::parse(name)
                            .ok_or_else(|| err(&path, "encoding"))?,
                    )
                }
                file if file.ends_with(".json") => {
                    tollgate_tokens::Counting::HuggingFace(std::sync::Arc::new(
                        tollgate_tokens::hf::HfTokenizer::from_file(file)
                            .map_err(|e| err(&path, e))?,
                    ))
                }
                other => {
                    return Err(err(
                        path,
                        format!(
                            "expected o200k_base, cl100k_base, estimate or a tokenizer.json path, got {other:?}"
                        ),
                    ));
                }
            };
            counter = counter.with_model(model.clone(), counting);
        }
        let unknown_context_tokens = raw.responses.unknown_context_tokens.unwrap_or(128_000);
        if unknown_context_tokens > 10_000_000 {
            return Err(err(
                "responses.unknown_context_tokens",
                "must be at most 10000000",
            ));
        }
        let context_ttl = duration(
            &raw.responses.context_ttl,
            Duration::from_secs(86_400),
            "responses.context_ttl",
        )?;
        if !(Duration::from_secs(60)..=Duration::from_secs(30 * 86_400)).contains(&context_ttl) {
            return Err(err(
                "responses.context_ttl",
                "must be from 1 minute to 30 days",
            ));
        }
        let defaults = crate::upstream_tools::UpstreamTools::default();
        let tools = &raw.upstream_tools;
        let tokens_per_call = tools.tokens_per_call.unwrap_or(defaults.tokens_per_call);
        if tokens_per_call > 1_000_000 {
            return Err(err(
                "upstream_tools.tokens_per_call",
                "must be at most 1000000",
            ));
        }
        let max_calls = tools.max_calls.unwrap_or(defaults.max_calls);
        if !(1..=100).contains(&max_calls) {
            return Err(err("upstream_tools.max_calls", "must be from 1 to 100"));
        }
        let remote_tokens_per_item = validate_remote_content(&raw.remote_content)?;
        validate_betas(&raw.anthropic)?;
        let kills = validate_kills(&raw.kill)?;
        let metrics = validate_metrics(&raw.metrics)?;
        let conns = ConnectionBounds::validate(s)?;
        Ok(Self {
            stream: conns.stream,
            cancel_grace: conns.cancel_grace,
            idle_timeout: conns.idle_timeout,
            max_connections_per_ip: conns.per_ip,
            http2_max_streams: conns.http2_max_streams,
            remote_tokens_per_item,
            anthropic_betas: raw.anthropic.betas.clone(),
            metrics,
            kills,
            counter,
            unknown_context_tokens,
            context_ttl,
            upstream_tools: crate::upstream_tools::UpstreamTools {
                tokens_per_call,
                max_calls,
            },
            listen,
            max_body_bytes,
            header_timeout: duration(
                &s.header_timeout,
                Duration::from_secs(10),
                "server.header_timeout",
            )?,
            body_timeout: duration(
                &s.body_timeout,
                Duration::from_secs(30),
                "server.body_timeout",
            )?,
            upstream_timeout: duration(
                &s.upstream_timeout,
                Duration::from_secs(120),
                "server.upstream_timeout",
            )?,
            drain_timeout: duration(
                &s.drain_timeout,
                Duration::from_secs(25),
                "server.drain_timeout",
            )?,
            max_connections: usize::try_from(s.max_connections.unwrap_or(1024))
                .unwrap_or(usize::MAX),
            trusted_proxies,
            max_output_tokens: s.max_output_tokens.unwrap_or(1_000_000),
            store,
            upstreams,
            models,
            keys,
            policy,
            queue,
            records: raw.records.path,
            admin: match raw.admin {
                Some(a) => {
                    let token = match (&a.token_env, &a.token_file) {
                        (Some(var), None) => std::env::var(var).map_err(|_| {
                            err(
                                "admin.token_env",
                                format!("environment variable {var} is not set"),
                            )
                        })?,
                        (None, Some(file)) => std::fs::read_to_string(file)
                            .map_err(|e| err("admin.token_file", format!("reading {file}: {e}")))?
                            .trim()
                            .to_owned(),
                        _ => {
                            return Err(err(
                                "admin",
                                "give exactly one of token_env or token_file",
                            ));
                        }
                    };
                    if token.len() < 16 {
                        return Err(err(
                            "admin",
                            "the admin token must be at least 16 characters",
                        ));
                    }
                    Some(AdminConfig {
                        listen: a
                            .listen
                            .parse()
                            .map_err(|e| err("admin.listen", format!("{e}")))?,
                        token,
                    })
                }
                None => None,
            },
        })
    }
}

fn validate_remote_content(raw: &RawRemoteContent) -> Result<u64, PolicyError> {
    let n = raw.tokens_per_item.unwrap_or(32_000);
    if n > 10_000_000 {
        return Err(err(
            "remote_content.tokens_per_item",
            "must be at most 10000000",
        ));
    }
    Ok(n)
}

fn validate_betas(raw: &RawAnthropic) -> Result<(), PolicyError> {
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

fn validate_kills(raw: &[RawKill]) -> Result<Vec<(String, String)>, PolicyError> {
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

fn validate_metrics(raw: &RawMetrics) -> Result<MetricsConfig, PolicyError> {
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

/// `[server]`'s bounds on client connections and upstream streams.
struct ConnectionBounds {
    idle_timeout: Duration,
    per_ip: usize,
    http2_max_streams: Option<u32>,
    stream: StreamBounds,
    cancel_grace: Duration,
}

impl ConnectionBounds {
    fn validate(s: &RawServer) -> Result<Self, PolicyError> {
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
        let stream = StreamBounds {
            idle: duration(
                &s.stream_idle_timeout,
                Duration::from_secs(60),
                "server.stream_idle_timeout",
            )?,
            max_duration: duration(
                &s.stream_max_duration,
                Duration::from_secs(1800),
                "server.stream_max_duration",
            )?,
            max_event_bytes: usize::try_from(max_event_bytes).unwrap_or(usize::MAX),
        };
        Ok(Self {
            idle_timeout: duration(
                &s.idle_timeout,
                Duration::from_secs(30),
                "server.idle_timeout",
            )?,
            per_ip,
            http2_max_streams,
            stream,
            cancel_grace: duration(
                &s.cancel_grace,
                Duration::from_secs(2),
                "server.cancel_grace",
            )?,
        })
    }
}

/// `sha256:<hex>` of an API key.
pub fn hash_key(key: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(key.as_bytes());
    let mut s = String::with_capacity(71);
    s.push_str("sha256:");
    for b in digest.iter() {
        s.push_str(&format!("{b:02x}"));
    }
    s
}
