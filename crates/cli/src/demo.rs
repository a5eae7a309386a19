//! `tollgate serve --demo`: the gateway with a built-in configuration in front of a simulated
//! upstream, so that a new user can see 200s turn into 429s with `curl` at once.

use std::net::SocketAddr;

/// The demo key (its hash is in the demo configuration).
pub const DEMO_KEY: &str = "sk-tollgate-demo";

/// The demo's key of priority class `critical`.
pub const VIP_KEY: &str = "sk-tollgate-demo-vip";

/// The demo's key for code that calls the provider itself: reservations only.
pub const EDGE_KEY: &str = "sk-tollgate-demo-edge";

/// The demo configuration: tight limits per key so that refusals come quickly, and an admin
/// listener on a free port whose token is in `token_file`.
pub fn config(upstream: &str, token_file: &std::path::Path) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:8080"

[admin]
listen = "127.0.0.1:0"
token_file = {token_file:?}

[[upstreams]]
name = "simulator"
base_url = "{upstream}"
models = ["gpt-4o", "gpt-4o-mini", "text-embedding-3-small", "claude-sonnet-4"]

[[keys]]
name = "demo"
hash = "{hash}"
tenant = "demo"
allow_user = true

[[keys]]
name = "demo-vip"
hash = "{vip_hash}"
tenant = "demo"
class = "critical"

[[keys]]
name = "demo-edge"
hash = "{edge_hash}"
tenant = "edge"
uses = "reservations"

[queue]
max_wait = "5s"
per_key = 4
global = 16

[policy]
version = "demo-1"

[policy.classes.critical]
weight = 3

# gpt-4o-mini and text-embedding-3-small are priced by the pinned catalog
# (`tollgate prices gpt-4o-mini`); these are the demo's own, over it.
[policy.prices."gpt-4o"]
input = 2500000
output = 10000000
file_search = 2500

[policy.prices."claude-sonnet-4"]
input = 3000000
output = 15000000

[[policy.scopes]]
name = "per-key"
key = "key"
requests = {{ limit = 5, window = "1m" }}
input_tokens = 4000
output_tokens = {{ max = 256, mode = "clamp", default = 64 }}
request_cost = "$0.003"
concurrency = {{ limit = 3, lease_ttl = "1m" }}
budget = {{ micro_usd = 10000, period = "day" }}
degrade = {{ at = "1%", models = {{ "gpt-4o" = "gpt-4o-mini" }} }}

[[policy.scopes]]
name = "per-model"
key = "model"
concurrency = {{ limit = 4, lease_ttl = "1m" }}
reserve = {{ critical = "50%" }}

[[policy.scopes]]
name = "tenant-daily"
key = "tenant"
budget = {{ tokens = 300, period = "day" }}
"#,
        hash = tollgate_gateway::hash_key(DEMO_KEY),
        vip_hash = tollgate_gateway::hash_key(VIP_KEY),
        edge_hash = tollgate_gateway::hash_key(EDGE_KEY),
        token_file = token_file.display().to_string(),
    )
}

/// A fresh admin token for the demo, written to a file of its own: (the token, the file).
pub fn admin_token() -> std::io::Result<(String, std::path::PathBuf)> {
    use std::hash::{BuildHasher, RandomState};
    let token: String = (0..2)
        .map(|i| {
            format!(
                "{:016x}",
                RandomState::new().hash_one((std::process::id(), i))
            )
        })
        .collect();
    let file = std::env::temp_dir().join(format!("tollgate-demo-{}.token", std::process::id()));
    std::fs::write(&file, &token)?;
    Ok((token, file))
}

/// What to try, printed at start; `admin` is the admin listener and its token.
pub fn banner(addr: SocketAddr, upstream: &str, (admin, token): (SocketAddr, &str)) -> String {
    format!(
        r#"Tollgate demo
  gateway:   http://{addr}   (OpenAI: /v1/chat/completions, /v1/responses, /v1/embeddings,
                               /v1/models; Anthropic: /v1/messages)
  upstream:  {upstream}   (simulated model, 16 tokens per answer)
  API key:   {DEMO_KEY}   (class standard; {VIP_KEY} is of class critical)
  limits:    5 requests/min and 3 at once per key; 4 at once per model, 2 of them kept for
             class critical; output clamped to 256; one request at most $0.003;
             $0.01/day per key, gpt-4o going to gpt-4o-mini past 1% of it;
             300 tokens/day per tenant
  admin:     http://{admin}   (token: {token})
  status:    http://{admin}/admin/ui   (a browser asks: any user name, the token as password)

Try:
  curl -s http://{addr}/v1/chat/completions -H 'authorization: Bearer {DEMO_KEY}' \
    -H 'content-type: application/json' \
    -d '{{"model":"gpt-4o","max_tokens":100,"messages":[{{"role":"user","content":"Hello!"}}]}}'

  Or through OpenAI's Responses API (a follow-up with previous_response_id is counted with the
  conversation the upstream bills it for):
  curl -s http://{addr}/v1/responses -H 'authorization: Bearer {DEMO_KEY}' \
    -H 'content-type: application/json' \
    -d '{{"model":"gpt-4o","max_output_tokens":100,"input":"Hello!"}}'

  Or as Anthropic's clients do:
  curl -s http://{addr}/v1/messages -H 'x-api-key: {DEMO_KEY}' \
    -H 'anthropic-version: 2023-06-01' -H 'content-type: application/json' \
    -d '{{"model":"claude-sonnet-4","max_tokens":100,"messages":[{{"role":"user","content":"Hello!"}}]}}'

  Send six requests: the sixth answer is 429 request_rate_limit with Retry-After.
  The budget: each request reserves its input and its whole cap until its answer settles at
  what it used (about 25 tokens here). Send this three times: the third finds less than the
  265 tokens it reserves left of the day's 300, and gets 429 budget_limit, x-should-retry: false.
  curl -s http://{addr}/v1/chat/completions -H 'authorization: Bearer {DEMO_KEY}' \
    -H 'content-type: application/json' \
    -d '{{"model":"gpt-4o","max_tokens":256,"messages":[{{"role":"user","content":"Hello!"}}]}}'
  Add -i to see the RateLimit and x-ratelimit-* headers. From the second, gpt-4o's answers come
  from gpt-4o-mini, charged at its price, with x-tollgate-degraded-from: gpt-4o: past 1% of
  its $0.01 a day, the key's gpt-4o requests are degraded to the cheaper model.

  Priority classes: what each key may use (the call is not counted in the key's rate). The demo key may
  hold 2 of gpt-4o's 4 slots (a third request in flight waits up to 5 s in the queue, then
  gets 429 capacity_reserved); the VIP key may hold all 4, and in the queue it is served three
  turns for each of the demo key's one.
  curl -s 'http://{addr}/v1/limits?model=gpt-4o' -H 'authorization: Bearer {VIP_KEY}'

  The cost cap: one request's input and maximum output, at its model's price, may cost at
  most $0.003. At claude-sonnet-4's $15 per million output tokens, 256 of them cost more, and
  the request gets 400 request_cost_limit with its cost in dollars (at gpt-4o's $10, it fits):
  curl -s http://{addr}/v1/messages -H 'x-api-key: {VIP_KEY}' \
    -H 'anthropic-version: 2023-06-01' -H 'content-type: application/json' \
    -d '{{"model":"claude-sonnet-4","max_tokens":256,"messages":[{{"role":"user","content":"Hello!"}}]}}'

  Code that calls the provider itself (an edge function) reserves first, sends the body it
  gets back (its output cap written in), then settles with the provider's usage; the same
  rules and budgets apply ({EDGE_KEY} may only make reservations, for tenant edge):
  curl -s http://{addr}/v1/reservations -H 'authorization: Bearer {EDGE_KEY}' \
    -H 'content-type: application/json' \
    -d '{{"endpoint":"/v1/chat/completions","body":{{"model":"gpt-4o-mini","max_tokens":50,"messages":[{{"role":"user","content":"Hi"}}]}}}}'
  curl -s http://{addr}/v1/reservations/<its id>/settle -H 'authorization: Bearer {EDGE_KEY}' \
    -H 'content-type: application/json' -d '{{"prompt_tokens":8,"completion_tokens":20}}'

  Switch the tenant off on every instance, look, and switch it on again:
  curl -s -u admin:{token} http://{admin}/admin/kill -H 'content-type: application/json' \
    -d '{{"target":"tenant:demo","reason":"trying the kill switch"}}'
  curl -s -u admin:{token} http://{admin}/admin/status
  curl -s -u admin:{token} -X DELETE http://{admin}/admin/kill/tenant:demo
  Metrics: curl -s -u admin:{token} http://{admin}/metrics
  Ctrl-C stops it (in-flight requests finish first).
"#
    )
}
