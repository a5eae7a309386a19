//! The configuration file as written: every section deserialized, nothing checked.

use std::collections::BTreeMap;

use serde::Deserialize;
use tollgate_core::policy::RawPolicy;

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
    /// The durable spend ledger.
    pub ledger: Option<RawLedger>,
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
    /// Agent operations.
    #[serde(default)]
    pub operations: RawOperations,
    /// Requests made idempotent by an `Idempotency-Key` header.
    #[serde(default)]
    pub idempotency: RawIdempotency,
    /// The Prometheus metrics.
    #[serde(default)]
    pub metrics: RawMetrics,
    /// `[log]`
    #[serde(default)]
    pub log: super::RawLog,
    /// `[otlp]`: OpenTelemetry export, off when absent.
    pub otlp: Option<super::RawOtlp>,
    /// Kill switches that hold whatever the store holds.
    #[serde(default)]
    pub kill: Vec<RawKill>,
    /// Alerts (budget thresholds, exhausted budgets, kill switches, store loss) to webhooks.
    #[serde(default)]
    pub alerts: RawAlerts,
}

/// `[alerts]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawAlerts {
    /// Events waiting for delivery at most (default 1,000; past it new ones are dropped and
    /// counted).
    pub queue: Option<usize>,
    /// Attempts per delivery (default 5, backing off from 0.5 s to 30 s).
    pub attempts: Option<u32>,
    /// Where events go.
    #[serde(default)]
    pub webhooks: Vec<RawWebhook>,
}

/// `[[alerts.webhooks]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWebhook {
    /// The URL (`http://` or `https://`).
    pub url: Option<String>,
    /// An environment variable holding the URL instead (a Slack webhook URL is a secret).
    pub url_env: Option<String>,
    /// `json` (default: the event as an object) or `slack` (`{"text": …}`).
    pub format: Option<String>,
}

/// `[remote_content]`: files and documents named by URL or file id, whose content the
/// upstream fetches and bills but the body does not hold.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawRemoteContent {
    /// Input tokens admitted for each such item: default 32,000, at most 10,000,000.
    pub tokens_per_item: Option<u64>,
    /// Input tokens admitted for each earlier audio answer named by id (chat's assistant
    /// `audio`), at most 10,000,000; unset (the default), such a request is refused.
    pub audio_tokens_per_reference: Option<u64>,
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

/// `[operations]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawOperations {
    /// The request header that names a request's operation (default `x-tollgate-operation`).
    pub header: Option<String>,
}

/// `[idempotency]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawIdempotency {
    /// How long an answered request's response is kept for its key's later uses (default
    /// `24h`, from 1 s to 7 days).
    pub keep: Option<String>,
    /// How long an unanswered claim holds its key (default `10m`, from 1 s to 1 day): an
    /// instance that stops mid-request lets go of its keys then.
    pub in_flight: Option<String>,
    /// The largest response kept (default 1 MiB, at most 16 MiB): a larger answer's key keeps
    /// only that it was answered.
    pub max_response_bytes: Option<usize>,
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
    /// Tokens that manage one tenant's keys and read its usage only.
    #[serde(default)]
    pub tenants: Vec<RawTenantToken>,
}

/// `[[admin.tenants]]`: a token of one tenant's own.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTenantToken {
    /// The tenant it manages.
    pub tenant: String,
    /// Environment variable holding the token.
    pub token_env: Option<String>,
    /// File holding the token; give this or `token_env`.
    pub token_file: Option<String>,
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
    /// The most tokens one file-search result holds: your vector stores' largest
    /// `max_chunk_size_tokens` (default 800, OpenAI's default chunking; from 100 to 4096).
    pub file_search_chunk_tokens: Option<u64>,
}

/// `[records]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawRecords {
    /// `-` for standard output, or a file to append to; absent: no records.
    pub path: Option<String>,
    /// An environment variable holding a secret (at least 16 bytes) that keys the digests a
    /// record keeps of client-chosen values (HMAC-SHA-256), so that they cannot be guessed
    /// back from a list of likely values.
    pub digest_key_env: Option<String>,
}

/// `[server]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    /// Listen address (default `127.0.0.1:8080`).
    pub listen: Option<String>,
    /// Largest request body; larger ones get 413 before they are read (default 1 MiB).
    pub max_body_bytes: Option<u64>,
    /// Counts of long texts kept across requests, per tenant, so that an agent's history is
    /// counted once (default 262,144 in all; 0: none kept).
    pub count_memo_entries: Option<u64>,
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
    /// For `rediss://`: a PEM file of the CA certificates the server's certificate must chain to
    /// (default: Mozilla's roots, compiled in).
    pub ca_file: Option<String>,
    /// The environment variable holding the ACL user, over the URL's.
    pub username_env: Option<String>,
    /// The environment variable holding the password, over the URL's.
    pub password_env: Option<String>,
    /// Leased slices: admission without a round trip for busy scopes (`docs/redis.md`); on by
    /// default for Redis.
    pub slices: Option<RawSlices>,
}

/// `[store.slices]`: an instance on Redis leases slices of busy scopes and admits against them
/// (on by default).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawSlices {
    /// Whether an instance on Redis leases slices (default true; false: every request is
    /// admitted by Redis, one call each).
    pub enabled: Option<bool>,
    /// Admissions of one plan shape per second after which its scopes are sliced (default 16).
    pub hot_after: Option<u32>,
    /// A grant takes at most 1/divisor of what a scope has free (default 4).
    pub divisor: Option<u64>,
    /// How old this instance's copy of the kill switches may be (default 1 s).
    pub kill_bound: Option<String>,
    /// How often slices are reported, renewed, grown and given back (default 100 ms).
    pub tick: Option<String>,
    /// How long a slice lives in the store without an order (default twice the lease time).
    pub ttl: Option<String>,
}

/// `[ledger]`: the durable spend ledger in PostgreSQL.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawLedger {
    /// `postgres://user:password@host:port/db`.
    pub url: Option<String>,
    /// The environment variable holding the URL, instead of `url`.
    pub url_env: Option<String>,
    /// Endings waiting to be written at most before new admissions are refused (default 100,000).
    pub buffer: Option<usize>,
    /// Endings written in one transaction at most (default 1,000).
    pub batch: Option<usize>,
    /// How often waiting endings are written (default 200 ms).
    pub flush_every: Option<String>,
    /// When the buffer is full: `refuse` new admissions (default) or `drop` endings (counted).
    pub on_full: Option<String>,
    /// The file that keeps endings not written when the process stops (default
    /// `tollgate-ledger.spool` in the working directory), written at the next start.
    pub spool: Option<String>,
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
    /// Body fields the gateway does not know that this upstream may receive all the same,
    /// declared by the operator to cost nothing (each API's known fields and their costs are in
    /// `docs/requests.md`, "What a request costs"; any other field is refused).
    #[serde(default)]
    pub free_fields: Vec<String>,
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
    /// Its priority class (one of `[policy.classes]`); default: its tenant's, else `standard`.
    pub class: Option<String>,
    /// What it may do: `proxy` (default), `reservations` or `both`.
    pub uses: Option<String>,
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
