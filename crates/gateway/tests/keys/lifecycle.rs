//! The key lifecycle's property test: random interleavings, on two instances sharing one Redis
//! and one PostgreSQL ledger, of create, rotate, revoke, expiry, and limits set and cleared by
//! the operator and by the tenant's token, with store flushes and held writes at random
//! points. Whatever each change answers, what was acknowledged holds:
//! - a secret whose revocation was acknowledged never serves again;
//! - an acknowledged rotation leaves at most one successor (once the graces given end);
//! - the tenant's limit in force is never above the operator's.
//!
//! The seed is printed; `TOLLGATE_SEED=n` replays one. Bounded: a fixed number of steps.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::instance::{Instance, flushall, redis_text, sim};
use serde_json::{Value, json};
use tollgate_testkit::pg_server::PgServer;
use tollgate_testkit::redis_server::RedisServer;

const STEPS: usize = 40;
const RULE_LIMIT: u64 = 100_000;
const TENANT_TOKEN: &str = "acme-admin-token-0123456789";

/// xorshift64*: a seeded, reproducible sequence.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Model {
    /// Every secret made, by key.
    secrets: BTreeMap<String, Vec<String>>,
    /// Keys whose revocation was acknowledged.
    revoked: BTreeSet<String>,
    /// Keys made to expire, and when (ms since the epoch, by this process's clock).
    expiring: BTreeMap<String, u64>,
    /// The operator's layer as acknowledged (`None`: the rule's).
    operator: Option<u64>,
    /// The operator's layers replaced, and when: another instance may hold one until its
    /// refresh reads the change.
    replaced: Vec<(std::time::Instant, Option<u64>)>,
}

impl Model {
    fn operator_set(&mut self, to: Option<u64>) {
        self.replaced
            .push((std::time::Instant::now(), self.operator));
        self.operator = to;
    }

    /// Whether `n` is above an operator's layer some instance may hold now.
    fn above_the_operator(&self, n: u64) -> bool {
        let fresh = tollgate_gateway::keys::REFRESH_EVERY * 2;
        std::iter::once(self.operator)
            .chain(
                self.replaced
                    .iter()
                    .filter(|(at, _)| at.elapsed() < fresh)
                    .map(|(_, o)| *o),
            )
            .any(|o| n > o.unwrap_or(RULE_LIMIT))
    }
}

fn now_ms() -> u64 {
    u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

fn acknowledged(status: u16, what: &str, v: &Value) -> bool {
    match status {
        200 | 201 => true,
        // Refused, and nothing changed: another change came first, the key ended, the store
        // was rebuilding or held the write past its timeout.
        404 | 409 | 503 => false,
        other => panic!("{what} answered {other}: {v}"),
    }
}

async fn limit_in_force(on: &Instance) -> Option<u64> {
    let r = common::get_with(
        on.addr,
        "/v1/limits",
        &[("authorization", "Bearer sk-acme".to_owned())],
    )
    .await;
    let v: Value = serde_json::from_slice(&r.body).ok()?;
    v["limits"]
        .as_array()?
        .iter()
        .find(|r| r["rule"] == "tenants" && r["control"] == "requests")?["limit"]
        .as_u64()
}

/// Checks the invariants on both instances (after the refresh bound).
async fn check(on: [&Instance; 2], m: &Model, end: bool) {
    common::instance::refreshed(&on).await;
    let now = now_ms();
    for gw in on {
        for (id, secrets) in &m.secrets {
            let mut working = 0;
            for s in secrets {
                let (status, _) = gw.ask_with(s).await;
                if m.revoked.contains(id) || m.expiring.get(id).is_some_and(|e| *e + 200 < now) {
                    assert_ne!(status, 200, "{id}: a revoked or expired key served");
                }
                working += usize::from(status == 200);
            }
            if end {
                assert!(working <= 1, "{id}: {working} secrets work");
            }
        }
        if let (Some(op), Some(in_force)) = (m.operator, limit_in_force(gw).await) {
            assert!(
                in_force <= op,
                "the tenant's limit {in_force} is above the operator's {op}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::print_stderr)] // the seed, to replay a failure
async fn the_key_lifecycle_keeps_its_invariants() {
    let seed = std::env::var("TOLLGATE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_ms() | 1);
    eprintln!("TOLLGATE_SEED={seed}");
    let mut rng = Rng(seed);
    let (sim, redis, pg) = (sim().await, RedisServer::start(), PgServer::start());
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("acme"), TENANT_TOKEN).unwrap();
    let text = format!(
        "{}[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n\
         [[admin.tenants]]\ntenant = \"acme\"\ntoken_file = \"{}\"\n",
        redis_text(&redis).replace("\"2s\"", "\"300ms\""),
        pg.url(),
        dir.path().join("acme").display()
    );
    let scopes = format!(
        "[[policy.scopes]]\nname = \"tenants\"\nkey = \"tenant\"\n\
         requests = {{ limit = {RULE_LIMIT}, window = \"1m\" }}\n"
    );
    let a = Instance::start_with(&sim, &text, &scopes).await;
    let b = Instance::start_with(&sim, &text, &scopes).await;
    let mut m = Model::default();
    for _ in 0..STEPS {
        let on = if rng.below(2) == 0 { &a } else { &b };
        let ids: Vec<String> = m.secrets.keys().cloned().collect();
        let pick = |rng: &mut Rng| {
            ids.get(rng.below(ids.len().max(1) as u64) as usize)
                .cloned()
        };
        // A held write: the store holds writes for longer than a call waits, from now.
        if rng.below(6) == 0 {
            redis.cli_run(&["client", "pause", "500", "write"]);
        }
        // Keys first: a change needs a key.
        let op = if ids.len() < 2 { 0 } else { rng.below(20) };
        match op {
            0..=3 => {
                let expiring = rng.below(3) == 0;
                let mut body = json!({"tenant": "acme"});
                if expiring {
                    body["expires_in"] = json!("1500ms");
                }
                let (status, v) = on.admin("POST", "/admin/keys", Some(body)).await;
                if acknowledged(status, "create", &v) {
                    let id = v["key"]["id"].as_str().unwrap().to_owned();
                    if expiring {
                        m.expiring.insert(id.clone(), now_ms() + 1500);
                    }
                    m.secrets
                        .entry(id)
                        .or_default()
                        .push(v["secret"].as_str().unwrap().to_owned());
                }
            }
            4..=8 => {
                let Some(id) = pick(&mut rng) else { continue };
                let grace = if rng.below(2) == 0 { "0s" } else { "1s" };
                let (status, v) = on
                    .admin(
                        "POST",
                        &format!("/admin/keys/{id}/rotate"),
                        Some(json!({"grace": grace})),
                    )
                    .await;
                if acknowledged(status, "rotate", &v) {
                    assert!(!m.revoked.contains(&id), "a revoked key was rotated: {v}");
                    let s = v["secret"].as_str().unwrap().to_owned();
                    m.secrets.entry(id).or_default().push(s);
                }
            }
            9 | 10 => {
                let Some(id) = pick(&mut rng) else { continue };
                let (status, v) = on.admin("DELETE", &format!("/admin/keys/{id}"), None).await;
                if acknowledged(status, "revoke", &v) {
                    m.revoked.insert(id);
                }
            }
            11..=14 => {
                let n = 1 + rng.below(RULE_LIMIT);
                let body = json!({"value": "tenant:acme", "control": "requests", "limit": n});
                if rng.below(2) == 0 {
                    let (status, v) = on.admin("PUT", "/admin/limits", Some(body)).await;
                    if acknowledged(status, "the operator's limit", &v) {
                        m.operator_set(Some(n));
                    }
                } else {
                    let (status, v) = on
                        .admin_as(TENANT_TOKEN, "PUT", "/admin/limits", Some(body))
                        .await;
                    if status == 403 {
                        assert!(m.above_the_operator(n), "{n}: {v}");
                    } else {
                        acknowledged(status, "the tenant's limit", &v);
                    }
                }
            }
            15..=17 => {
                let path = "/admin/limits?value=tenant:acme&control=requests";
                if rng.below(2) == 0 {
                    let (status, v) = on.admin("DELETE", path, None).await;
                    if acknowledged(status, "the operator's clear", &v) {
                        m.operator_set(None);
                    }
                } else {
                    let (status, v) = on.admin_as(TENANT_TOKEN, "DELETE", path, None).await;
                    acknowledged(status, "the tenant's clear", &v);
                }
            }
            _ => {
                flushall(&redis);
                // Half the time, the next changes meet the loss; else the rebuild.
                if rng.below(2) == 0 {
                    common::instance::until("the rebuild", async || a.ask("acme").await.0 == 200)
                        .await;
                }
            }
        }
        if rng.below(4) == 0 {
            check([&a, &b], &m, false).await;
        }
    }
    // Every grace given has ended; the store is rebuilt if it forgot.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    common::instance::until("the store's books", async || a.ask("acme").await.0 == 200).await;
    check([&a, &b], &m, true).await;
    eprintln!(
        "{} keys, {} secrets, {} revoked",
        m.secrets.len(),
        m.secrets.values().map(Vec::len).sum::<usize>(),
        m.revoked.len()
    );
}
