//! One admission: the proxy and the embedded layer decide with the same code. Each case of a
//! table is sent through both, with the same facts (the layer's facts function counts the body
//! with the same tokenizer), and both must give the same status codes and error codes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tollgate_core::Keeper as _;

use axum::Router;
use axum::body::Body;
use axum::extract::Extension;
use axum::routing::post;
use http::Request;
use http_body_util::BodyExt;
use serde_json::json;
use tollgate_core::{Dimension, Identity, Policy, Reason, RequestFacts, Store, Usage};
use tollgate_gateway::GatewayConfig;
use tollgate_gateway::admission::{AdmissionHandle, AdmissionLayer};
use tollgate_gateway::store::AnyStore;
use tollgate_testkit::redis_server::RedisServer;
use tollgate_testkit::sim::{Sim, SimConfig};
use tollgate_tokens::{Format, TokenCounter};
use tower::ServiceExt;

const KEY: &str = "sk-test-one-admission";

/// What a case does to its store before its requests.
#[derive(Clone, Copy, PartialEq)]
enum Setup {
    None,
    /// The store switches the tenant off.
    StoreKill,
    /// The store (Redis) is down.
    StoreDown,
}

struct Case {
    name: &'static str,
    /// The policy, as `[policy]` of the gateway and as the layer's `Policy`.
    policy: &'static str,
    /// The key's exemptions.
    exempt: &'static [Reason],
    /// Kill switches of the configuration.
    kills: &'static [(&'static str, &'static str)],
    setup: Setup,
    /// (words of input, max_tokens) per request; `concurrent` sends them all at once.
    requests: &'static [(usize, u64)],
    concurrent: bool,
}

const CASES: &[Case] = &[
    Case {
        name: "request rate",
        policy: "[[scopes]]\nkey = \"tenant\"\nrequests = { limit = 2, window = \"1m\" }\n",
        exempt: &[],
        kills: &[],
        setup: Setup::None,
        requests: &[(2, 5), (2, 5), (2, 5)],
        concurrent: false,
    },
    Case {
        name: "input tokens",
        policy: "[[scopes]]\nkey = \"tenant\"\ninput_tokens = 20\n",
        exempt: &[],
        kills: &[],
        setup: Setup::None,
        requests: &[(2, 5), (60, 5)],
        concurrent: false,
    },
    Case {
        name: "output cap",
        policy: "[[scopes]]\nkey = \"tenant\"\noutput_tokens = { max = 50 }\n",
        exempt: &[],
        kills: &[],
        setup: Setup::None,
        requests: &[(2, 10), (2, 100)],
        concurrent: false,
    },
    Case {
        name: "total tokens",
        policy: "[[scopes]]\nkey = \"tenant\"\ntotal_tokens = 60\n",
        exempt: &[],
        kills: &[],
        setup: Setup::None,
        requests: &[(2, 10), (2, 100)],
        concurrent: false,
    },
    Case {
        name: "concurrency",
        policy: "[[scopes]]\nkey = \"tenant\"\nconcurrency = { limit = 1 }\n",
        exempt: &[],
        kills: &[],
        setup: Setup::None,
        requests: &[(2, 5), (2, 5)],
        concurrent: true,
    },
    Case {
        name: "budget",
        policy: "[[scopes]]\nkey = \"tenant\"\nbudget = { tokens = 100, period = \"day\" }\n",
        exempt: &[],
        kills: &[],
        setup: Setup::None,
        requests: &[(2, 50), (2, 200)],
        concurrent: false,
    },
    Case {
        name: "exempt from the rate",
        policy: "[[scopes]]\nkey = \"tenant\"\nrequests = { limit = 1, window = \"1m\" }\n\
                 input_tokens = 20\n",
        exempt: &[Reason::RequestRateLimit, Reason::InputTokenLimit],
        kills: &[],
        setup: Setup::None,
        requests: &[(2, 5), (2, 5), (60, 5)],
        concurrent: false,
    },
    Case {
        name: "configured kill switch",
        policy: "[[scopes]]\nkey = \"tenant\"\nrequests = { limit = 5, window = \"1m\" }\n",
        exempt: &[],
        kills: &[("tenant:acme", "maintenance")],
        setup: Setup::None,
        requests: &[(2, 5)],
        concurrent: false,
    },
    Case {
        name: "kill switch in the store",
        policy: "[[scopes]]\nkey = \"tenant\"\nrequests = { limit = 5, window = \"1m\" }\n",
        exempt: &[],
        kills: &[],
        setup: Setup::StoreKill,
        requests: &[(2, 5)],
        concurrent: false,
    },
    Case {
        name: "store down: closed",
        policy: "[[scopes]]\nkey = \"tenant\"\nrequests = { limit = 5, window = \"1m\" }\n",
        exempt: &[],
        kills: &[],
        setup: Setup::StoreDown,
        requests: &[(2, 5)],
        concurrent: false,
    },
    Case {
        name: "store down: open",
        policy: "fail_open = [\"request_rate_limit\", \"budget_limit\"]\n[[scopes]]\n\
                 key = \"tenant\"\nrequests = { limit = 5, window = \"1m\" }\n\
                 budget = { tokens = 100000, period = \"day\" }\n",
        exempt: &[],
        kills: &[],
        setup: Setup::StoreDown,
        requests: &[(2, 5)],
        concurrent: false,
    },
    Case {
        name: "store down: token limits still refuse",
        policy: "[[scopes]]\nkey = \"tenant\"\nrequests = { limit = 5, window = \"1m\" }\n\
                 input_tokens = 20\n",
        exempt: &[],
        kills: &[],
        setup: Setup::StoreDown,
        requests: &[(60, 5)],
        concurrent: false,
    },
];

fn body(words: usize, max_tokens: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "gpt-4o", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "word ".repeat(words)}]}))
    .unwrap()
}

/// The id the gateway gives the key: the first 16 hex digits of its hash.
fn key_id() -> String {
    tollgate_gateway::hash_key(KEY)
        .trim_start_matches("sha256:")
        .chars()
        .take(16)
        .collect()
}

fn config(case: &Case, store: &str, upstream: &str) -> String {
    let exempt: Vec<String> = case
        .exempt
        .iter()
        .map(|r| format!("\"{}\"", r.code()))
        .collect();
    let kills: String = case
        .kills
        .iter()
        .map(|(t, r)| format!("[[kill]]\ntarget = \"{t}\"\nreason = \"{r}\"\n"))
        .collect();
    format!(
        "{store}{kills}[[upstreams]]\nname = \"sim\"\nbase_url = \"{upstream}\"\n\
         models = [\"gpt-4o\"]\n[[keys]]\nname = \"acme\"\nhash = \"{}\"\ntenant = \"acme\"\n\
         exempt = [{}]\n[policy]\n{}",
        tollgate_gateway::hash_key(KEY),
        exempt.join(", "),
        case.policy.replace("[[scopes]]", "[[policy.scopes]]"),
    )
}

fn store_section(redis: Option<&RedisServer>) -> String {
    match redis {
        Some(r) => format!(
            "[store]\nurl = \"{}\"\nprefix = \"one\"\ncall_timeout = \"500ms\"\n",
            r.url()
        ),
        None => String::new(),
    }
}

async fn prepare(case: &Case, store: &AnyStore, redis: &mut Option<RedisServer>) {
    match case.setup {
        Setup::None => {}
        Setup::StoreKill => store
            .set_kill("tenant:acme", Some("maintenance"))
            .await
            .unwrap(),
        Setup::StoreDown => redis.as_mut().unwrap().kill(),
    }
}

/// (status, error code) per request, in order (sorted when sent at once).
type Answers = Vec<(u16, String)>;

async fn collect(
    case: &Case,
    send: impl Fn(Vec<u8>) -> futures_util::future::BoxFuture<'static, (u16, String)>,
) -> Answers {
    let mut answers = Vec::new();
    if case.concurrent {
        let all = case.requests.iter().map(|(w, m)| send(body(*w, *m)));
        answers = futures_util::future::join_all(all).await;
        answers.sort();
    } else {
        for (w, m) in case.requests {
            answers.push(send(body(*w, *m)).await);
        }
    }
    answers
}

async fn through_proxy(case: &Case) -> Answers {
    let sim = Sim::start(SimConfig {
        api_key: Some(common::SIM_KEY.into()),
        latency: Duration::from_millis(300),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let mut redis = (case.setup == Setup::StoreDown).then(RedisServer::start);
    let text = config(case, &store_section(redis.as_ref()), &sim.base_url());
    let (addr, store) = common::spawn_gateway(&text, common::SIM_KEY).await;
    prepare(case, &store, &mut redis).await;
    collect(case, |b| {
        Box::pin(async move {
            let auth = [("authorization", format!("Bearer {KEY}"))];
            let r = common::post(addr, "/v1/chat/completions", &auth, b).await;
            (r.status, r.code())
        })
    })
    .await
}

async fn through_layer(case: &Case) -> Answers {
    let mut redis = (case.setup == Setup::StoreDown).then(RedisServer::start);
    let text = config(case, &store_section(redis.as_ref()), "http://127.0.0.1:9");
    let cfg = GatewayConfig::from_toml(&text).unwrap();
    let store = tollgate_gateway::start_store(&cfg).await.unwrap();
    // A test's Redis is new: initialised as an operator would.
    store.initialise().await.unwrap();
    prepare(case, &store, &mut redis).await;
    let policy = Policy::from_toml(case.policy).unwrap();
    let n = Arc::new(AtomicU64::new(0));
    let counter = TokenCounter::default();
    let layer = AdmissionLayer::new(policy, store, move |_parts, body| {
        let count = counter
            .count(Format::ChatCompletions, body, None)
            .map_err(|e| panic!("{e}"))?;
        Ok(RequestFacts {
            request_id: format!("layer-{}", n.fetch_add(1, Ordering::SeqCst)),
            identity: Identity::default()
                .with(Dimension::Tenant, "acme")
                .with(Dimension::Key, key_id())
                .with(Dimension::Ip, "127.0.0.1")
                .with(Dimension::Model, count.model.clone()),
            input_tokens: count.input_tokens,
            max_output_tokens: count.max_output_tokens,
            ..RequestFacts::default()
        })
    })
    .exempt(case.exempt.iter().copied())
    .kills(
        case.kills
            .iter()
            .map(|(t, r)| ((*t).to_owned(), (*r).to_owned())),
    );
    let app = Router::new()
        .route(
            "/v1/chat/completions",
            post(|Extension(h): Extension<AdmissionHandle>| async move {
                // As long as the simulator takes to answer.
                tokio::time::sleep(Duration::from_millis(300)).await;
                h.settle(Usage {
                    input_tokens: 3,
                    output_tokens: 5,
                    ..Usage::default()
                })
                .await;
                "{}"
            }),
        )
        .layer(layer);
    collect(case, |b| {
        let app = app.clone();
        Box::pin(async move {
            let req = Request::post("/v1/chat/completions")
                .body(Body::from(b))
                .unwrap();
            let r = app.oneshot(req).await.unwrap();
            let status = r.status().as_u16();
            let bytes = r.into_body().collect().await.unwrap().to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            (status, v["error"]["code"].as_str().unwrap_or("").to_owned())
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_and_the_layer_decide_alike() {
    for case in CASES {
        let proxy = through_proxy(case).await;
        let layer = through_layer(case).await;
        assert_eq!(proxy, layer, "{}", case.name);
        // Each case refuses something or admits everything for a stated reason: neither side
        // may answer only 5xx of its own making.
        assert!(
            proxy.iter().all(|(s, _)| [200, 400, 429, 503].contains(s)),
            "{}: {proxy:?}",
            case.name
        );
    }
}

/// The table's answers are the ones each control gives: the comparison above would pass if
/// both sides were wrong alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_answers_as_each_control_says() {
    let expected: &[&[(u16, &str)]] = &[
        &[(200, ""), (200, ""), (429, "request_rate_limit")],
        &[(200, ""), (400, "input_token_limit")],
        &[(200, ""), (400, "output_token_limit")],
        &[(200, ""), (400, "total_token_limit")],
        &[(200, ""), (429, "concurrency_limit")],
        &[(200, ""), (429, "budget_limit")],
        &[(200, ""), (200, ""), (200, "")],
        &[(503, "kill_switch")],
        &[(503, "kill_switch")],
        &[(503, "store_unavailable")],
        &[(200, "")],
        &[(400, "input_token_limit")],
    ];
    assert_eq!(expected.len(), CASES.len());
    for (case, want) in CASES.iter().zip(expected) {
        let got = through_layer(case).await;
        let want: Answers = want.iter().map(|(s, c)| (*s, (*c).to_owned())).collect();
        assert_eq!(got, want, "{}", case.name);
    }
}

/// The layer over a store of the embedder's own type (here `Arc<MemoryStore>`, not `AnyStore`):
/// admitted, then refused by the rate, then settled in that store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_runs_over_any_store() {
    let store = Arc::new(tollgate_core::MemoryStore::new());
    let policy = Policy::from_toml(
        "[[scopes]]\nkey = \"user\"\nrequests = { limit = 1, window = \"1m\" }\n\
         budget = { tokens = 1000, period = \"day\" }\n",
    )
    .unwrap();
    let n = Arc::new(AtomicU64::new(0));
    let layer = AdmissionLayer::new(policy, store.clone(), move |_, _| {
        Ok(RequestFacts {
            request_id: format!("own-{}", n.fetch_add(1, Ordering::SeqCst)),
            identity: Identity::default().with(Dimension::User, "u"),
            input_tokens: 10,
            max_output_tokens: Some(20),
            ..RequestFacts::default()
        })
    });
    let app = Router::new()
        .route(
            "/",
            post(
                |Extension(h): Extension<AdmissionHandle<Arc<tollgate_core::MemoryStore>>>| async move {
                    h.settle(Usage {
                        input_tokens: 10,
                        output_tokens: 5,
                        ..Usage::default()
                    })
                    .await;
                    "ok"
                },
            ),
        )
        .layer(layer);
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let r = app
            .clone()
            .oneshot(Request::post("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [200, 429]);
    let u = store
        .usage(
            "user|user:u",
            Some(tollgate_core::Period::Fixed(86_400_000)),
        )
        .await
        .unwrap();
    assert_eq!((u.settled, u.reserved), (15, 0));
}

/// Every entry point decides with the same controls: a tenant switched off in the
/// configuration is refused alike by a small request, by a large one (whose rate is decided
/// before its body is counted) and by `/v1/limits`, and each refusal is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_entry_point_meets_the_configurations_kill_switch() {
    let case = Case {
        name: "killed in the configuration, at every entry point",
        policy: "[[scopes]]\nkey = \"tenant\"\nrequests = { limit = 100, window = \"1m\" }\n",
        exempt: &[],
        kills: &[("tenant:acme", "maintenance")],
        setup: Setup::None,
        requests: &[],
        concurrent: false,
    };
    let sim = Sim::start(SimConfig {
        api_key: Some(common::SIM_KEY.into()),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let text = config(&case, "", &sim.base_url());
    let (addr, _, metrics) = common::spawn_gateway_with_metrics(&text, common::SIM_KEY).await;
    let auth = [("authorization", format!("Bearer {KEY}"))];
    let small = common::post(addr, "/v1/chat/completions", &auth, body(2, 5)).await;
    // 20,000 words: past the size whose rate is decided before the body is counted.
    let large = common::post(addr, "/v1/chat/completions", &auth, body(20_000, 5)).await;
    let limits = common::get_with(addr, "/v1/limits", &auth).await;
    let answers: Vec<(u16, String)> = [&small, &large, &limits]
        .iter()
        .map(|r| (r.status, r.code()))
        .collect();
    assert_eq!(answers[0].1, "kill_switch", "{}: {answers:?}", case.name);
    assert!(
        answers.iter().all(|a| *a == answers[0]),
        "{}: {answers:?}",
        case.name
    );
    let sent: u64 = sim.stats().requests.values().sum();
    assert_eq!(sent, 0, "nothing reached the upstream");
    let scrape = String::from_utf8_lossy(&common::get(metrics, "/metrics").await.body).into_owned();
    let killed: f64 = scrape
        .lines()
        .find(|l| l.starts_with("tollgate_decisions_total{decision=\"kill_switch\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert_eq!(
        killed, 2.0,
        "the two requests' refusals, each once:\n{scrape}"
    );
}
