//! A key's life under attack: two instances on one Redis, with and without a PostgreSQL
//! ledger, racing changes of one key, a store that forgets between them, and a store that holds
//! its writes past the call's timeout. What is acknowledged holds: a revoked secret never works
//! again, one of two racing changes wins and the other answers 409 `key_changed`, and an answer
//! of 503 means that nothing changed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::instance::{Instance, flushall, redis_has, redis_text, refreshed, sim, until};
use serde_json::{Value, json};
use tollgate_testkit::pg_server::PgServer;
use tollgate_testkit::redis_server::RedisServer;

const RATE: &str =
    "[[policy.scopes]]\nkey = \"tenant\"\nrequests = { limit = 100000, window = \"1m\" }\n";

async fn create(on: &Instance) -> (String, String) {
    let (status, v) = on
        .admin("POST", "/admin/keys", Some(json!({"tenant": "acme"})))
        .await;
    assert_eq!(status, 201, "{v}");
    (
        v["key"]["id"].as_str().unwrap().to_owned(),
        v["secret"].as_str().unwrap().to_owned(),
    )
}

async fn rotate(on: &Instance, id: &str, grace: &str) -> (u16, Value) {
    on.admin(
        "POST",
        &format!("/admin/keys/{id}/rotate"),
        Some(json!({"grace": grace})),
    )
    .await
}

async fn revoke(on: &Instance, id: &str) -> (u16, Value) {
    on.admin("DELETE", &format!("/admin/keys/{id}"), None).await
}

/// Every secret in `secrets` is refused by every instance, once each has read the keys afresh.
async fn refused_everywhere(on: &[&Instance], secrets: &[String]) {
    refreshed(on).await;
    for gw in on {
        for s in secrets {
            assert_eq!(gw.ask_with(s).await.0, 401, "{s} still works");
        }
    }
}

fn ledger_text(pg: &PgServer) -> String {
    format!("[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n", pg.url())
}

/// Two instances on one Redis and one ledger.
async fn pair(
    sim: &tollgate_testkit::sim::Sim,
    redis: &RedisServer,
    pg: &PgServer,
) -> (Instance, Instance) {
    let text = format!("{}{}", redis_text(redis), ledger_text(pg));
    let a = Instance::start_with(sim, &text, RATE).await;
    let b = Instance::start_with(sim, &text, RATE).await;
    (a, b)
}

/// A revocation and the rotations racing it, then a store that forgets: after the rebuild from
/// the ledger, no secret of a revoked key works on either instance, and a revoked key cannot
/// be rotated back to life (409 `key_changed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_key_stays_revoked_through_races_and_a_store_loss() {
    let (sim, redis, pg) = (sim().await, RedisServer::start(), PgServer::start());
    let (a, b) = pair(&sim, &redis, &pg).await;
    let mut secrets = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..6 {
        let (id, secret) = create(&a).await;
        secrets.push(secret);
        // The other instance rotates while this one revokes.
        let ((rs, rv), (vs, vv)) = tokio::join!(rotate(&b, &id, "1h"), revoke(&a, &id));
        assert_eq!(vs, 200, "the revocation always lands: {vv}");
        match rs {
            200 => secrets.push(rv["secret"].as_str().unwrap().to_owned()),
            409 => assert_eq!(rv["error"]["code"], "key_changed", "{rv}"),
            other => panic!("a rotation answered {other}: {rv}"),
        }
        ids.push(id);
    }
    refused_everywhere(&[&a, &b], &secrets).await;
    for id in &ids {
        let (status, v) = rotate(&a, id, "1h").await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (409, Some("key_changed")),
            "{v}"
        );
    }

    flushall(&redis);
    until("the keys written back by the rebuild", async || {
        redis_has(&redis, "hs:keys") && a.ask("acme").await.0 == 200
    })
    .await;
    refused_everywhere(&[&a, &b], &secrets).await;
    // Read from the ledger, not from an instance's memory: a third instance agrees.
    let c = Instance::start_with(
        &sim,
        &format!("{}{}", redis_text(&redis), ledger_text(&pg)),
        RATE,
    )
    .await;
    refused_everywhere(&[&c], &secrets).await;
    let (_, listed) = c.admin("GET", "/admin/keys", None).await;
    assert_eq!(listed["keys"], json!([]), "no revoked key is listed");
}

/// Two rotations of one key from the same version, on two instances: one wins, the other
/// answers 409 and changed nothing; exactly one new secret works. Without a version given,
/// rotations at once leave one successor too: the last, which ended the grace of the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_racing_rotations_one_wins() {
    let (sim, redis, pg) = (sim().await, RedisServer::start(), PgServer::start());
    let (a, b) = pair(&sim, &redis, &pg).await;
    let from = |v: u64| json!({"grace": "0s", "version": v});
    for _ in 0..3 {
        let (id, old) = create(&a).await;
        let path = format!("/admin/keys/{id}/rotate");
        let ((sa, va), (sb, vb)) = tokio::join!(
            a.admin("POST", &path, Some(from(1))),
            b.admin("POST", &path, Some(from(1)))
        );
        let mut statuses = [sa, sb];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 409], "{va} {vb}");
        let (won, lost) = if sa == 200 { (va, vb) } else { (vb, va) };
        assert_eq!(lost["error"]["code"], "key_changed", "{lost}");
        let fresh = won["secret"].as_str().unwrap().to_owned();
        refreshed(&[&a, &b]).await;
        for gw in [&a, &b] {
            assert_eq!(gw.ask_with(&fresh).await.0, 200);
            assert_eq!(gw.ask_with(&old).await.0, 401);
        }
        let (_, listed) = b.admin("GET", "/admin/keys", None).await;
        let key = listed["keys"]
            .as_array()
            .unwrap()
            .iter()
            .find(|k| k["id"] == id.as_str())
            .unwrap()
            .clone();
        assert_eq!(key["secrets"].as_array().unwrap().len(), 1, "{key}");
        assert_eq!(key["version"], 2, "{key}");

        // Unconditional, at once: whatever each answers, one successor works.
        let ((sa, va), (sb, vb)) = tokio::join!(rotate(&a, &id, "0s"), rotate(&b, &id, "0s"));
        let made: Vec<String> = [(sa, &va), (sb, &vb)]
            .iter()
            .filter(|(s, _)| *s == 200)
            .map(|(_, v)| v["secret"].as_str().unwrap().to_owned())
            .collect();
        assert!(!made.is_empty(), "{va} {vb}");
        refreshed(&[&a, &b]).await;
        let mut working = 0;
        for s in made.iter().chain([&fresh]) {
            working += usize::from(a.ask_with(s).await.0 == 200);
        }
        assert_eq!(working, 1, "{va} {vb}");
    }
}

/// A revocation asked while the store has forgotten, before the rebuild: 503 and nothing
/// changed (the key works once the store is rebuilt), or 200 and the key never works again;
/// never a 404 for a key that exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_during_a_store_loss_tells_the_truth() {
    let (sim, redis, pg) = (sim().await, RedisServer::start(), PgServer::start());
    let (a, b) = pair(&sim, &redis, &pg).await;
    let (id, secret) = create(&a).await;
    until("the key on the other instance", async || {
        b.ask_with(&secret).await.0 == 200
    })
    .await;
    // The instance has seen the store's marker: the loss is found at the change.
    assert_eq!(a.ask_with(&secret).await.0, 200);
    flushall(&redis);
    let (status, v) = revoke(&a, &id).await;
    until("the rebuild", async || a.ask("acme").await.0 == 200).await;
    refreshed(&[&a, &b]).await;
    match status {
        503 => {
            assert_eq!(v["error"]["code"], "store_unavailable", "{v}");
            assert_eq!(a.ask_with(&secret).await.0, 200, "nothing changed");
            assert_eq!(b.ask_with(&secret).await.0, 200, "nothing changed");
        }
        200 => refused_everywhere(&[&a, &b], std::slice::from_ref(&secret)).await,
        other => panic!("a revocation during a loss answered {other}: {v}"),
    }
}

/// A store that holds its writes (`CLIENT PAUSE WRITE`) past the call's timeout: a rotation
/// answers 503 and changed nothing (the old secret works, none other was made), even once the
/// held write reaches the store; without a ledger (the store is the truth) and with one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_means_nothing_changed() {
    let sim = sim().await;
    for with_ledger in [false, true] {
        let (redis, pg) = (RedisServer::start(), PgServer::start());
        let store = redis_text(&redis).replace("\"2s\"", "\"500ms\"");
        let text = if with_ledger {
            format!("{store}{}", ledger_text(&pg))
        } else {
            store
        };
        let gw = Instance::start_with(&sim, &text, RATE).await;
        if !with_ledger {
            assert_eq!(gw.admin("POST", "/admin/store/init", None).await.0, 200);
        }
        let (id, secret) = create(&gw).await;
        assert_eq!(gw.ask_with(&secret).await.0, 200);
        // Longer than the call's timeout (500 ms) and the read-back after it.
        redis.cli_run(&["client", "pause", "1500", "write"]);
        let (status, v) = rotate(&gw, &id, "0s").await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (503, Some("store_unavailable")),
            "ledger {with_ledger}: {v}"
        );
        assert!(v.get("secret").is_none());
        // The held write reaches the store when the pause ends, and changes nothing.
        redis.cli_run(&["client", "unpause"]);
        refreshed(&[&gw]).await;
        assert_eq!(gw.ask_with(&secret).await.0, 200, "ledger {with_ledger}");
        let (_, listed) = gw.admin("GET", "/admin/keys", None).await;
        assert_eq!(listed["keys"][0]["version"], 1, "{listed}");
        let (status, v) = rotate(&gw, &id, "0s").await;
        assert_eq!(status, 200, "{v}");
        gw.stop().await;
    }
}

const LAYERED: &str = "[[policy.scopes]]\nname = \"tenants\"\nkey = \"tenant\"\n\
    requests = { limit = 1000, window = \"1m\" }\n\
    [[policy.scopes]]\nname = \"keys\"\nkey = \"key\"\n\
    requests = { limit = 1000, window = \"1m\" }\n";

/// The request limit `secret` reads in `/v1/limits` for `rule`.
async fn in_force(on: &Instance, secret: &str, rule: &str) -> u64 {
    let r = common::get_with(
        on.addr,
        "/v1/limits",
        &[("authorization", format!("Bearer {secret}"))],
    )
    .await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    v["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == rule && r["control"] == "requests")
        .unwrap_or_else(|| panic!("no {rule} in {v}"))["limit"]
        .as_u64()
        .unwrap()
}

/// A tenant's token only tightens, by every route: a key's own limits above the limit in force
/// are refused 403 and nothing is issued; the operator's layer can be neither raised nor
/// cleared by the tenant, whose own layer stays under it; on the memory store and on Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_token_only_tightens() {
    let sim = sim().await;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let acme_token = "acme-admin-token-0123456789";
    std::fs::write(dir.path().join("acme"), acme_token).unwrap();
    let tenants = format!(
        "[[admin.tenants]]\ntenant = \"acme\"\ntoken_file = \"{}\"\n",
        dir.path().join("acme").display()
    );
    for store in [String::new(), redis_text(&redis)] {
        let gw = Instance::start_with(&sim, &format!("{store}{tenants}"), LAYERED).await;
        if !store.is_empty() {
            gw.admin("POST", "/admin/store/init", None).await;
        }
        let acme = |method: &'static str, path: &'static str, body: Option<Value>| {
            let gw = &gw;
            async move { gw.admin_as(acme_token, method, path, body).await }
        };
        let limit = |n: u64| json!({"value": "tenant:acme", "control": "requests", "limit": n});

        // A key's own limits: above the rule's, refused and nothing issued.
        let (status, v) = acme(
            "POST",
            "/admin/keys",
            Some(json!({"tenant": "acme", "limits": {"requests": 100_000}})),
        )
        .await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (403, Some("admin_scope_forbidden")),
            "{v}"
        );
        let (_, listed) = acme("GET", "/admin/keys", None).await;
        assert_eq!(listed["keys"], json!([]), "nothing was issued");
        let (status, v) = acme(
            "POST",
            "/admin/keys",
            Some(json!({"tenant": "acme", "limits": {"requests": 3}})),
        )
        .await;
        assert_eq!(status, 201, "{v}");
        let tight = v["secret"].as_str().unwrap().to_owned();
        for _ in 0..3 {
            assert_eq!(gw.ask_with(&tight).await.0, 200);
        }
        assert_eq!(
            gw.ask_with(&tight).await,
            (429, "request_rate_limit".into())
        );

        // The operator sets 50 for the tenant: the tenant can neither raise it (not even to the
        // rule's 1,000) nor clear it, nor write the operator's layer.
        let (status, v) = gw.admin("PUT", "/admin/limits", Some(limit(50))).await;
        assert_eq!(status, 200, "{v}");
        for n in [100, 1000] {
            let (status, v) = acme("PUT", "/admin/limits", Some(limit(n))).await;
            assert_eq!(
                (status, v["error"]["code"].as_str()),
                (403, Some("admin_scope_forbidden")),
                "{v}"
            );
        }
        let mut as_operator = limit(60);
        as_operator["layer"] = json!("operator");
        assert_eq!(acme("PUT", "/admin/limits", Some(as_operator)).await.0, 403);
        let (status, v) = acme(
            "DELETE",
            "/admin/limits?value=tenant:acme&control=requests",
            None,
        )
        .await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (404, Some("limit_not_set")),
            "{v}"
        );
        assert_eq!(in_force(&gw, "sk-acme", "tenants").await, 50);

        // Under it, the tenant tightens; the operator lowering its layer below the tenant's
        // wins, and the tenant clearing its own leaves the operator's.
        let (status, v) = acme("PUT", "/admin/limits", Some(limit(20))).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(in_force(&gw, "sk-acme", "tenants").await, 20);
        gw.admin("PUT", "/admin/limits", Some(limit(10))).await;
        assert_eq!(in_force(&gw, "sk-acme", "tenants").await, 10);
        let (status, _) = acme(
            "DELETE",
            "/admin/limits?value=tenant:acme&control=requests",
            None,
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(in_force(&gw, "sk-acme", "tenants").await, 10);
        gw.admin(
            "DELETE",
            "/admin/limits?value=tenant:acme&control=requests",
            None,
        )
        .await;
        assert_eq!(in_force(&gw, "sk-acme", "tenants").await, 1000);
        gw.stop().await;
    }
}

/// Setting a key's own limit is a change of the key: a rotation from the version before it is
/// 409. A revoked key's limits went with it, for good: setting one again is 409 `key_changed`,
/// and one for a key that was never issued is 404; nothing is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_keys_limits_stay_gone() {
    let sim = sim().await;
    let gw = Instance::start_with(&sim, "", LAYERED).await;
    let (id, _) = create(&gw).await;
    let body = |v: &str| json!({"value": format!("key:{v}"), "control": "requests", "limit": 5});
    assert_eq!(
        gw.admin("PUT", "/admin/limits", Some(body(&id))).await.0,
        200
    );
    let from_before = json!({"version": 1});
    let path = format!("/admin/keys/{id}/rotate");
    let (status, v) = gw.admin("POST", &path, Some(from_before)).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("key_changed")),
        "{v}"
    );
    assert_eq!(revoke(&gw, &id).await.0, 200);
    let (status, v) = gw.admin("PUT", "/admin/limits", Some(body(&id))).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("key_changed")),
        "{v}"
    );
    let (status, v) = gw
        .admin("PUT", "/admin/limits", Some(body("vk_0000000000000000")))
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("key_not_found")),
        "{v}"
    );
    let (_, listed) = gw.admin("GET", "/admin/limits", None).await;
    assert_eq!(listed["limits"], json!([]), "{listed}");
}
