//! Gateway configuration, in three steps: the file parsed raw ([`raw`]), each section checked by
//! a pure function into types that cannot hold invalid values (`validate`), and what needs the
//! outside world (environment variables, files, TLS clients, tokenizer files) done in a step of
//! its own (`resolve`). Every error names the field at fault.

mod admin;
mod check;
mod keys;
mod log;
mod otlp;
mod raw;
mod resolve;
mod stores;
mod validate;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tollgate_core::{Policy, PolicyError, Reason};

pub use log::{LogConfig, RawLog};
pub use otlp::{OtlpConfig, OtlpProtocol, RawOtlp};
pub use raw::*;

use crate::upstream::UpstreamClient;

/// A configuration that failed: the dotted path of the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    /// Dotted path of the field, e.g. `upstreams[0].api_key_env`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl From<PolicyError> for ConfigError {
    fn from(e: PolicyError) -> Self {
        Self {
            path: e.path,
            message: e.message,
        }
    }
}

/// An error about `field`.
fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        path: field.into(),
        message: message.into(),
    }
}

/// `[idempotency]`, checked.
#[derive(Debug, Clone, Copy)]
pub struct IdempotencyConfig {
    /// How long an answered request's response is kept.
    pub keep: Duration,
    /// How long an unanswered claim holds its key.
    pub in_flight: Duration,
    /// The largest response kept.
    pub max_response_bytes: usize,
}

impl GatewayConfig {
    /// Parses, validates and resolves a TOML configuration.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| err("config", e.to_string()))?;
        Self::validate(raw)
    }

    /// Validates a raw configuration, then resolves what it names outside itself.
    pub fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        resolve::resolve(validate::check(raw)?)
    }
}

/// Alerts and where they go.
#[derive(Debug, Clone, Default)]
pub struct AlertsConfig {
    /// Events waiting for delivery at most.
    pub queue: usize,
    /// Attempts per delivery.
    pub attempts: u32,
    /// Where events go (resolved: URLs read, clients built).
    pub webhooks: Vec<Webhook>,
}

/// A body format of a webhook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WebhookFormat {
    /// The event as a JSON object.
    Json,
    /// `{"text": …}`, as Slack's incoming webhooks (and Mattermost, Discord's `/slack`) take.
    Slack,
}

/// A webhook.
#[derive(Debug, Clone)]
pub struct Webhook {
    /// Where to post.
    pub url: axum::http::Uri,
    /// The body.
    pub format: WebhookFormat,
    /// Its client (Mozilla's roots).
    pub client: crate::upstream::UpstreamClient,
}

/// Where and how often metrics are served.
#[derive(Debug, Clone)]
pub struct MetricsConfig {
    /// The metrics listener, if any.
    pub listen: Option<SocketAddr>,
    /// How often budget figures are refreshed.
    pub refresh: Duration,
}

/// The admin API's settings.
#[derive(Debug, Clone)]
pub struct AdminConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// The bearer token.
    pub token: String,
    /// Tokens of one tenant each (`[[admin.tenants]]`): (tenant, token). They manage that
    /// tenant's keys and read its usage, nothing else.
    pub tenants: Vec<(String, String)>,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// Body limit.
    pub max_body_bytes: usize,
    /// Counts of long texts kept across requests, in all (see [`crate::memo`]).
    pub count_memo_entries: usize,
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
    /// Input tokens admitted per earlier audio answer named by id; `None`: refused.
    pub remote_audio_tokens: Option<u64>,
    /// `anthropic-beta` values clients may send.
    pub anthropic_betas: Vec<String>,
    /// The request header that names a request's agent operation.
    pub operation_header: axum::http::HeaderName,
    /// Idempotency keys.
    pub idempotency: IdempotencyConfig,
    /// Metrics.
    pub metrics: MetricsConfig,
    /// The run-time log.
    pub log: LogConfig,
    /// OpenTelemetry export, when configured.
    pub otlp: Option<OtlpConfig>,
    /// Kill switches of the file: (target, reason).
    pub kills: Vec<(String, String)>,
    /// Alerts.
    pub alerts: AlertsConfig,
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
    /// The spend ledger.
    pub ledger: Option<LedgerConfig>,
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
    /// The key of the records' digests (resolved from `[records] digest_key_env`).
    pub records_key: Option<std::sync::Arc<[u8]>>,
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
        /// Leased slices, when configured.
        slices: Option<Box<tollgate_slices::SliceConfig>>,
        /// TLS trust and credentials (resolved from `ca_file`, `username_env`, `password_env`).
        access: RedisAccess,
    },
}

/// How a Redis is reached beyond its URL: a CA for `rediss://`, and an ACL user and password
/// over the URL's. The password is never shown.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RedisAccess {
    /// The CA certificates (PEM) the server's certificate must chain to.
    pub ca_pem: Option<Vec<u8>>,
    /// The ACL user.
    pub username: Option<String>,
    /// The password.
    pub password: Option<String>,
}

impl std::fmt::Debug for RedisAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisAccess")
            .field("ca_pem", &self.ca_pem.is_some())
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "…"))
            .finish()
    }
}

/// `[ledger]`, checked.
#[derive(Clone)]
pub struct LedgerConfig {
    /// The URL, or (until resolved) the variable holding it.
    pub url: Result<String, String>,
    /// Endings buffered at most.
    pub buffer: usize,
    /// Endings per transaction at most.
    pub batch: usize,
    /// How often the buffer is written.
    pub flush_every: Duration,
    /// What a full buffer does.
    pub on_full: tollgate_ledger::OnFull,
    /// Where endings not written at shutdown are kept for the next start.
    pub spool: std::path::PathBuf,
}

impl std::fmt::Debug for LedgerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerConfig")
            .field("buffer", &self.buffer)
            .field("batch", &self.batch)
            .field("flush_every", &self.flush_every)
            .field("on_full", &self.on_full)
            .finish_non_exhaustive()
    }
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
    /// Body fields outside the gateway's lists that the operator declared free of cost here.
    pub free_fields: Vec<String>,
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
    /// Its priority class, when it names one (else its tenant's).
    pub class: Option<String>,
    /// What it may do: call through the proxy, make reservations, or both.
    pub uses: Uses,
}

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Uses {
    /// Requests through the proxy only (the default).
    #[default]
    Proxy,
    /// Reservations only (`/v1/reservations`): code that calls the provider itself.
    Reservations,
    /// Both.
    Both,
}

impl Uses {
    /// Whether requests through the proxy are allowed.
    pub fn proxy(self) -> bool {
        matches!(self, Uses::Proxy | Uses::Both)
    }

    /// Whether it is the default (the proxy only).
    pub fn is_proxy(&self) -> bool {
        *self == Uses::Proxy
    }

    /// Whether reservations are allowed.
    pub fn reservations(self) -> bool {
        matches!(self, Uses::Reservations | Uses::Both)
    }
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

/// `sha256:<hex>` of an API key.
pub fn hash_key(key: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(key.as_bytes());
    format!("sha256:{}", hex(&digest))
}

/// Bytes in lowercase hex. Digests of keys and record fields are written on every request:
/// digit by digit, not with a `format!` per byte.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_key_hashes_to_its_sha256_in_lowercase_hex() {
        // The digests of "test" and "" as published for SHA-256.
        assert_eq!(
            super::hash_key("test"),
            "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        );
        assert_eq!(
            super::hash_key(""),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
