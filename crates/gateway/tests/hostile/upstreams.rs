//! Hostile upstreams and a store that fails: each test is an attack on the books, over real
//! sockets, with an upstream and a store of the test's own; where a store is involved it runs
//! on the memory store and on Redis. The books must stay true: nothing reported reaches them
//! unchecked, and no settlement is lost silently.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tollgate_core::Keeper as _;

use axum::Router;
use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use serde_json::{Value, json};
use tollgate_core::{Period, Store};
use tollgate_gateway::store::AnyStore;
use tollgate_testkit::faults::Link;
use tollgate_testkit::redis_server::RedisServer;

const KEY: &str = "sk-acme";
const DAY: Period = Period::Fixed(86_400_000);

/// What the scripted upstream answers: a JSON body, or an event stream sent in pieces.
#[derive(Clone)]
enum Answer {
    Json(Value),
    Events(Vec<String>),
    /// `chunk`, every `every`, `times` times: a stream that goes on (bounded, so the test's
    /// upstream stops by itself).
    Repeat(String, Duration, usize),
}

/// An upstream that answers every request with its script, after `delay`.
#[derive(Clone)]
struct Scripted {
    addr: SocketAddr,
    /// Requests that reached the upstream: a request counted here was admitted and forwarded.
    received: Arc<std::sync::atomic::AtomicUsize>,
}

impl Scripted {
    async fn start(answer: Answer, delay: Duration) -> Self {
        let answer = Arc::new(Mutex::new(answer));
        let a = answer.clone();
        let received = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = received.clone();
        let handler = move |_: HeaderMap, _: Bytes| {
            let a = a.clone();
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                tokio::time::sleep(delay).await;
                let answer = a.lock().unwrap().clone();
                match answer {
                    Answer::Json(v) => Response::builder()
                        .header("content-type", "application/json")
                        .body(Body::from(v.to_string()))
                        .unwrap(),
                    Answer::Repeat(chunk, every, times) => {
                        let chunks = futures_util::stream::unfold(0usize, move |i| {
                            let chunk = chunk.clone();
                            async move {
                                if i == times {
                                    return None;
                                }
                                tokio::time::sleep(every).await;
                                Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), i + 1))
                            }
                        });
                        Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(Body::from_stream(chunks))
                            .unwrap()
                    }
                    Answer::Events(events) => {
                        let chunks = futures_util::stream::iter(
                            events
                                .into_iter()
                                .map(|e| Ok::<_, std::io::Error>(Bytes::from(e))),
                        );
                        Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(Body::from_stream(chunks))
                            .unwrap()
                    }
                }
            }
        };
        let app = Router::new()
            .route("/v1/chat/completions", post(handler.clone()))
            .route("/v1/messages", post(handler));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, received }
    }

    fn received(&self) -> usize {
        self.received.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A gateway in front of `upstream`, on the memory store or a Redis server of its own (reached
/// at `redis_url` when given, e.g. through a [`Link`]).
async fn gateway(
    upstream: &Scripted,
    policy: &str,
    store: &str,
    records: Option<&std::path::Path>,
) -> (SocketAddr, AnyStore) {
    let records = records
        .map(|p| format!("[records]\npath = \"{}\"\n", p.display()))
        .unwrap_or_default();
    let text = format!(
        "{store}{records}\n[[upstreams]]\nname = \"up\"\nbase_url = \"http://{}\"\n\
         models = [\"gpt-4o\", \"claude-sonnet-4-5\"]\n\
         [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[policy]\n{policy}\n",
        upstream.addr,
        tollgate_gateway::hash_key(KEY),
    )
    .replace("[[scopes]]", "[[policy.scopes]]");
    common::spawn_gateway(&text, "unused").await
}

fn redis_store(url: &str, call_timeout: &str) -> String {
    format!("[store]\nurl = \"{url}\"\nprefix = \"hu\"\ncall_timeout = \"{call_timeout}\"\n")
}

async fn chat(addr: SocketAddr, stream: bool) -> common::Reply {
    let body = json!({"model": "gpt-4o", "max_tokens": 50, "stream": stream,
        "messages": [{"role": "user", "content": "Hello there!"}]});
    common::post(
        addr,
        "/v1/chat/completions",
        &[("authorization", format!("Bearer {KEY}"))],
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

/// The tenant's budget once nothing is held any more; fails after `within`.
async fn settled_when_idle(store: &AnyStore, within: Duration) -> u64 {
    tollgate_testkit::wait::poll(within, async || {
        let u = store.usage("tenant|tenant:acme", Some(DAY)).await.unwrap();
        if u.leases == 0 && u.reserved == 0 {
            return Ok(u.settled);
        }
        Err(format!("still held: {u:?}"))
    })
    .await
}

fn completion(usage: Value) -> Value {
    json!({"id": "c1", "object": "chat.completion", "model": "gpt-4o",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": usage})
}

const BUDGET: &str = r#"
[[scopes]]
key = "tenant"
concurrency = { limit = 4, lease_ttl = "1m" }
budget = { tokens = 1000, period = "day" }
"#;

// ---------------------------------------------------------------------------------------------
// Upstream numbers.

/// Absurd completion counts are clamped to the ledger's bound and charged (the budget is spent,
/// not reopened); numbers that are not counts charge the reservation. Each case is flagged in
/// its decision record.
async fn absurd_usage_numbers_cannot_open_a_budget(redis: bool) {
    let cases: [(Value, bool); 5] = [
        (json!(u64::MAX), true),
        (json!(1u64 << 63), true),
        (serde_json::from_str("1e30").unwrap(), true),
        (json!(-1), false),
        (json!("5"), false),
    ];
    for (n, huge) in cases {
        let upstream = Scripted::start(
            Answer::Json(completion(
                json!({"prompt_tokens": 10, "completion_tokens": n}),
            )),
            Duration::ZERO,
        )
        .await;
        let redis_server = redis.then(RedisServer::start);
        let store = redis_server
            .as_ref()
            .map(|r| redis_store(&r.url(), "2s"))
            .unwrap_or_default();
        let dir = tempfile::tempdir().unwrap();
        let records = dir.path().join("records.jsonl");
        let (addr, store) = gateway(&upstream, BUDGET, &store, Some(&records)).await;
        let r = chat(addr, false).await;
        assert_eq!(r.status, 200, "{n}: {:?}", r.body);
        let settled = settled_when_idle(&store, Duration::from_secs(3)).await;
        // Records are written off the request path: wait for the line.
        let line = || {
            tollgate_testkit::wait::at_most_blocking(
                Duration::from_secs(3),
                || std::fs::read_to_string(&records).unwrap_or_default(),
                |t| t.contains("\"ending\""),
            )
        };
        if huge {
            // Clamped, never wrapped: the whole budget is spent and stays spent.
            assert_eq!(settled, 10 + tollgate_core::ledger::MAX_USAGE_TOKENS, "{n}");
            let next = chat(addr, false).await;
            assert_eq!(
                (next.status, next.code().as_str()),
                (429, "budget_limit"),
                "{n}"
            );
            assert!(
                line().contains("\"over_reservation\":true"),
                "{n}: {}",
                line()
            );
        } else {
            // The reservation is charged: the counted input (3 + 1 + 3 + 3) and the cap.
            assert_eq!(settled, 10 + 50, "{n}");
            assert!(line().contains("\"usage_invalid\":true"), "{n}: {}", line());
        }
        drop(redis_server);
    }
}

/// Anthropic streams settle the cumulative input and cache counts of the last `message_delta`,
/// what Anthropic bills (here: server tools fetched 50,000 input tokens during the call).
async fn anthropic_streams_settle_the_last_message_delta(redis: bool) {
    let events = [
        json!({"type": "message_start", "message": {"id": "m1", "type": "message", "role": "assistant",
            "model": "claude-sonnet-4-5", "content": [],
            "usage": {"input_tokens": 15, "output_tokens": 1}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
            "usage": {"input_tokens": 50000, "cache_read_input_tokens": 100, "output_tokens": 10}}),
        json!({"type": "message_stop"}),
    ]
    .iter()
    .map(|e| format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap()))
    .collect();
    let upstream = Scripted::start(Answer::Events(events), Duration::ZERO).await;
    let redis_server = redis.then(RedisServer::start);
    let store = redis_server
        .as_ref()
        .map(|r| redis_store(&r.url(), "2s"))
        .unwrap_or_default();
    let policy = "[[scopes]]\nkey = \"tenant\"\nbudget = { tokens = 1000000, period = \"day\" }\n";
    let (addr, store) = gateway(&upstream, policy, &store, None).await;
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 50, "stream": true,
        "messages": [{"role": "user", "content": "search the web"}]});
    let r = common::post(
        addr,
        "/v1/messages",
        &[("x-api-key", KEY.to_owned())],
        serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let settled = settled_when_idle(&store, Duration::from_secs(3)).await;
    assert_eq!(settled, 50000 + 100 + 10);
    drop(redis_server);
}

// ---------------------------------------------------------------------------------------------
// Streams.

/// An upstream stream past a bound is ended with an error event in the API's format; the usage
/// metered so far is charged and the lease released, long before the lease's lifetime.
async fn streams_are_bounded(redis: bool) {
    let tok = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok\"}}]}\n\n";
    let cases = [
        // Only keep-alive comments: no event ever comes.
        (
            "stream_idle_timeout",
            Answer::Repeat(": keep-alive\n\n".into(), Duration::from_millis(50), 400),
        ),
        // Events that never stop.
        (
            "stream_max_duration",
            Answer::Repeat(tok.into(), Duration::from_millis(20), 1000),
        ),
        // An event that never ends.
        (
            "stream_event_too_large",
            Answer::Repeat(
                format!("data: {}", "x".repeat(4096)),
                Duration::from_millis(5),
                1000,
            ),
        ),
    ];
    let extra = "[server]\nstream_idle_timeout = \"500ms\"\nstream_max_duration = \"1s\"\nmax_event_bytes = 16384\n";
    for (code, answer) in cases {
        let upstream = Scripted::start(answer, Duration::ZERO).await;
        let redis_server = redis.then(RedisServer::start);
        let store = redis_server
            .as_ref()
            .map(|r| redis_store(&r.url(), "2s"))
            .unwrap_or_default();
        let (addr, store) = gateway(&upstream, BUDGET, &format!("{store}{extra}"), None).await;
        let start = Instant::now();
        let r = chat(addr, true).await;
        let text = String::from_utf8_lossy(&r.body).into_owned();
        assert!(
            text.contains(code),
            "{code}: {}",
            &text[text.len().saturating_sub(300)..]
        );
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{code}: {:?}",
            start.elapsed()
        );
        let settled = settled_when_idle(&store, Duration::from_secs(3)).await;
        // The counted input (10), and the output streamed before the cut.
        assert!(settled >= 10, "{code}: {settled}");
        if code == "stream_max_duration" {
            assert!(settled > 10, "the streamed output is charged: {settled}");
        }
        drop(redis_server);
    }
}

// ---------------------------------------------------------------------------------------------
// Clients that leave.

/// One client: sends `body` on a connection of its own and, when `leave_after` is set, closes
/// the socket that long after sending (mid-request); otherwise reads the whole answer.
async fn client(addr: SocketAddr, body: &[u8], leave_after: Option<Duration>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return;
    };
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        KEY,
        body.len()
    );
    if s.write_all(head.as_bytes()).await.is_err() || s.write_all(body).await.is_err() {
        return;
    }
    let mut sink = Vec::new();
    match leave_after {
        Some(after) => {
            let _ = tokio::time::timeout(after, s.read_to_end(&mut sink)).await;
        }
        None => {
            let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut sink)).await;
        }
    }
}

/// 600 requests, some streamed, with clients closing their sockets at random mid-request, in
/// front of an upstream that notices a closed connection only when it next writes: the
/// upstream never has more requests of the tenant under way than its concurrency limit, and,
/// for requests that are not streamed (which run to their end upstream), the books match what
/// the upstream reported.
async fn clients_that_leave_free_no_slot_early(redis: bool) {
    use tollgate_testkit::sim::SimConfig;
    let policy = r#"
[[scopes]]
key = "tenant"
requests = { limit = 100000, window = "1m" }
concurrency = { limit = 6, lease_ttl = "1m" }
budget = { tokens = 100000000, period = "day" }
"#;
    for streamed_share in [0u64, 40] {
        let sim = SimConfig {
            latency: Duration::from_millis(15),
            token_delay: Duration::from_millis(2),
            output_tokens: 16,
            ..SimConfig::default()
        };
        let (sim, redis_server, store_cfg) =
            common::upstream_and_store(redis, common::SIM_KEY, sim, "leave").await;
        let text = format!(
            "{store_cfg}[server]\ncancel_grace = \"100ms\"\n\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
             [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[policy]\n{policy}",
            sim.base_url(),
            tollgate_gateway::hash_key(KEY),
        )
        .replace("[[scopes]]", "[[policy.scopes]]");
        let env = common::Env::start(&text, common::SIM_KEY, sim, redis_server).await;
        let mut workers = Vec::new();
        for w in 0..30u64 {
            let addr = env.addr;
            workers.push(tokio::spawn(async move {
                // A small linear congruential generator: the same choices every run.
                let mut x = w.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                for _ in 0..20 {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let stream = (x >> 33) % 100 < streamed_share;
                    let leave = ((x >> 40) % 100 < 15).then(|| Duration::from_millis(5 + (x >> 50) % 40));
                    let body = serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": 16,
                        "stream": stream, "messages": [{"role": "user", "content": "Hello there!"}]}))
                    .unwrap();
                    client(addr, &body, leave).await;
                }
            }));
        }
        for w in workers {
            w.await.unwrap();
        }
        let most = env
            .sim
            .stats()
            .max_in_flight
            .values()
            .copied()
            .max()
            .unwrap_or(0);
        assert!(
            most <= 6,
            "the upstream saw {most} at once (streamed {streamed_share}%)"
        );
        assert!(most >= 2, "the run never overlapped: {most}");
        if streamed_share == 0 {
            // Every admitted request ran to its end upstream and settled what it reported.
            common::settled_as_the_upstream_served(&env).await;
        } else {
            common::tenant_usage_when(&env.store, "nothing held", |u| {
                u.leases == 0 && u.reserved == 0
            })
            .await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A store that fails.

/// Redis is cut off from the gateway while a settlement is due, then restored: the settlement
/// is retried until it lands, so the tenant is charged what the upstream reported (not the
/// reservation at expiry), and the lease is free long before its one-minute lifetime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_during_a_partition_lands_when_the_store_returns() {
    let upstream = Scripted::start(
        Answer::Json(completion(
            json!({"prompt_tokens": 10, "completion_tokens": 5}),
        )),
        Duration::from_millis(1000),
    )
    .await;
    let redis = RedisServer::start();
    let link = Link::to_socket(redis.socket().unwrap().to_owned()).await;
    let via_link = format!("redis://{}/", link.addr);
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    let (addr, _) = gateway(
        &upstream,
        BUDGET,
        &redis_store(&via_link, "250ms"),
        Some(&records),
    )
    .await;
    // The books as Redis has them, read past the link.
    let direct = tollgate_gateway::start_store(
        &tollgate_gateway::GatewayConfig::from_toml(&redis_store(&redis.url(), "2s")).unwrap(),
    )
    .await
    .unwrap();
    let request = tokio::spawn(async move { chat(addr, false).await });
    // Cut once the request is admitted and waiting on the upstream: once the upstream has it
    // (a lease seen in Redis is not enough; the admission's reply may still be on the link).
    common::instance::until("the request admitted", async || upstream.received() != 0).await;
    link.cut();
    let r = request.await.unwrap();
    assert_eq!(r.status, 200, "{:?}", r.body);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    link.restore();
    let start = Instant::now();
    let settled = settled_when_idle(&direct, Duration::from_secs(10)).await;
    assert_eq!(
        settled, 15,
        "charged the reported usage, not the reservation"
    );
    assert!(start.elapsed() < Duration::from_secs(10));
    // The record is written once the retry that landed has returned: a moment after the books
    // show it.
    let line = tollgate_testkit::wait::poll(Duration::from_secs(2), async || {
        let line = std::fs::read_to_string(&records).unwrap();
        match line.contains("\"ending\"") {
            true => Ok(line),
            false => Err(format!("no ending recorded: {line}")),
        }
    })
    .await;
    assert!(line.contains("\"ending\":\"settled\""), "{line}");
    assert!(line.contains("\"end_attempts\":"), "{line}");
}

/// A Redis that forgets (here `FLUSHALL`) is detected: a spent budget and a kill switch set in
/// the store do not reopen; the gate answers 503 `store_state_lost` until an operator
/// acknowledges the loss through the admin API, and a kill switch of the configuration file
/// holds throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_forgets_fails_closed_until_acknowledged() {
    let upstream = Scripted::start(
        Answer::Json(completion(
            json!({"prompt_tokens": 10, "completion_tokens": 50}),
        )),
        Duration::ZERO,
    )
    .await;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let token = "admin-token-0123456789";
    std::fs::write(dir.path().join("token"), token).unwrap();
    // Bound here and handed over: a port released and bound again may be taken in between.
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_addr = admin.local_addr().unwrap();
    let keys: String = [
        ("sk-acme", "acme"),
        ("sk-beta", "beta"),
        ("sk-gamma", "gamma"),
    ]
    .iter()
    .map(|(k, t)| {
        format!(
            "[[keys]]\nhash = \"{}\"\ntenant = \"{t}\"\n",
            tollgate_gateway::hash_key(k)
        )
    })
    .collect();
    let text = format!(
        "{}[admin]\nlisten = \"{admin_addr}\"\ntoken_file = \"{}\"\n\
         [[kill]]\ntarget = \"tenant:beta\"\nreason = \"held in the file\"\n\
         [[upstreams]]\nname = \"up\"\nbase_url = \"http://{}\"\nmodels = [\"gpt-4o\"]\n\
         {keys}[policy]\n[[policy.scopes]]\nkey = \"tenant\"\nbudget = {{ tokens = 100, period = \"day\" }}\n",
        redis_store(&redis.url(), "2s"),
        dir.path().join("token").display(),
        upstream.addr,
    );
    let config = tollgate_gateway::GatewayConfig::from_toml(&text).unwrap();
    let store = tollgate_gateway::start_store(&config).await.unwrap();
    // A test's Redis is new: initialised as an operator would.
    store.initialise().await.unwrap();
    let gw = tollgate_gateway::Gateway::new(config, store.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate_gateway::serve_bound(
        gw,
        listener,
        tollgate_gateway::Bound {
            admin: Some(admin),
            metrics: None,
        },
        std::future::pending(),
    ));
    let ask = |key: &'static str| async move {
        let body = json!({"model": "gpt-4o", "max_tokens": 50,
            "messages": [{"role": "user", "content": "Hello there!"}]});
        common::post(
            addr,
            "/v1/chat/completions",
            &[("authorization", format!("Bearer {key}"))],
            serde_json::to_vec(&body).unwrap(),
        )
        .await
    };
    let code = |r: &common::Reply| (r.status, r.code());
    // acme spends its budget; gamma is switched off in the store; beta in the file.
    assert_eq!(ask("sk-acme").await.status, 200);
    assert_eq!(code(&ask("sk-acme").await), (429, "budget_limit".into()));
    store
        .set_kill("tenant:gamma", Some("held in the store"))
        .await
        .unwrap();
    assert_eq!(code(&ask("sk-gamma").await), (503, "kill_switch".into()));
    assert_eq!(code(&ask("sk-beta").await), (503, "kill_switch".into()));
    // The store forgets.
    let out = redis.cli().args(["flushall"]).output().unwrap();
    assert!(out.status.success());
    let r = ask("sk-acme").await;
    assert_eq!(code(&r), (503, "store_state_lost".into()), "{:?}", r.body);
    assert_eq!(r.header("x-should-retry"), Some("false"));
    assert_eq!(
        code(&ask("sk-gamma").await),
        (503, "store_state_lost".into())
    );
    assert_eq!(code(&ask("sk-beta").await), (503, "kill_switch".into()));
    // An operator acknowledges the loss: admissions resume from what the store holds now, and
    // the file's kill switch still holds.
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<Bytes>>();
    let ack = hyper::Request::post(format!("http://{admin_addr}/admin/store/acknowledge-loss"))
        .header("authorization", format!("Bearer {token}"))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(client.request(ack).await.unwrap().status(), 200);
    assert_eq!(ask("sk-acme").await.status, 200);
    assert_eq!(code(&ask("sk-beta").await), (503, "kill_switch".into()));
}

/// A Redis that may evict keys is refused at start-up, unless the configuration accepts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_evicts_is_refused_unless_allowed() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let text = redis_store(&redis.url(), "2s");
    let config = tollgate_gateway::GatewayConfig::from_toml(&text).unwrap();
    let Err(e) = tollgate_gateway::start_store(&config).await else {
        panic!("a Redis that evicts was accepted");
    };
    assert!(e.to_string().contains("allkeys-lru"), "{e}");
    let allowed = format!("{text}allow_eviction = true\n");
    let config = tollgate_gateway::GatewayConfig::from_toml(&allowed).unwrap();
    let (_, warnings) = tollgate_gateway::start_store_with_warnings(&config)
        .await
        .unwrap();
    // The test's server keeps nothing on disk either: said.
    assert!(
        warnings.iter().any(|w| w.contains("nothing on disk")),
        "{warnings:?}"
    );
}

mod both {
    on_both_stores!(
        absurd_usage_numbers_cannot_open_a_budget,
        anthropic_streams_settle_the_last_message_delta,
        streams_are_bounded,
        clients_that_leave_free_no_slot_early
    );
}
