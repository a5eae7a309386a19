//! Virtual keys issued at run time (`/admin/keys`): created on one instance and served by every
//! instance sharing the store within a second; rotated with a grace period; revoked and expired
//! everywhere; kept only as digests; rebuilt from the spend ledger after a loss and restored
//! into a memory store at restart. Keys of the configuration file keep working beside them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::time::{Duration, Instant};

use common::instance::{Instance, flushall, redis_text, sim, until};
use serde_json::{Value, json};
use tollgate_testkit::pg_server::PgServer;
use tollgate_testkit::redis_server::RedisServer;

/// A rule that many requests stay within (a budget would be spent by the polling).
const RATE: &str =
    "[[policy.scopes]]\nkey = \"tenant\"\nrequests = { limit = 1000, window = \"1m\" }\n";

/// Creates a key of tenant `t` on `on` with `extra` fields: (id, secret).
async fn create(on: &Instance, t: &str, extra: Value) -> (String, String) {
    let mut body = json!({"tenant": t, "metadata": {"team": "search"}});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (status, v) = on.admin("POST", "/admin/keys", Some(body)).await;
    assert_eq!(status, 201, "{v}");
    let id = v["key"]["id"].as_str().unwrap().to_owned();
    let secret = v["secret"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("tg-") && secret.len() == 51, "{secret}");
    (id, secret)
}

/// How long until `secret` gets `status` on `on` (10 s at most).
async fn takes(on: &Instance, secret: &str, status: u16) -> Duration {
    let start = Instant::now();
    until("the key's state to reach the instance", async || {
        on.ask_with(secret).await.0 == status
    })
    .await;
    start.elapsed()
}

/// Two instances on one Redis: a key created on one is served by the other within the refresh
/// bound; rotation keeps the old secret for its grace; revocation and expiry stop a key on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::print_stderr)] // the two delays, for whoever runs it
async fn issued_keys_reach_every_instance_and_stop_everywhere() {
    let (sim, redis) = (sim().await, RedisServer::start());
    let a = Instance::start_with(&sim, &redis_text(&redis), RATE).await;
    assert_eq!(a.admin("POST", "/admin/store/init", None).await.0, 200);
    let b = Instance::start_with(&sim, &redis_text(&redis), RATE).await;

    let (id, secret) = create(&a, "acme", json!({"name": "search-bot"})).await;
    assert_eq!(a.ask_with(&secret).await.0, 200, "served where it was made");
    let reached = takes(&b, &secret, 200).await;
    assert!(reached < Duration::from_secs(3), "{reached:?}");
    // Its requests count against its tenant, whose key of the file still works.
    assert_eq!(b.ask("acme").await.0, 200);
    let (_, listed) = b.admin("GET", "/admin/keys", None).await;
    let k = &listed["keys"][0];
    assert_eq!(
        (k["id"].as_str(), k["tenant"].as_str()),
        (Some(id.as_str()), Some("acme"))
    );
    assert_eq!(k["metadata"]["team"], "search");
    assert!(!listed.to_string().contains(&secret), "no secret listed");

    // Rotation: the new secret works at once, the old one through the grace period.
    let (status, v) = b
        .admin(
            "POST",
            &format!("/admin/keys/{id}/rotate"),
            Some(json!({"grace": "1h"})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let fresh = v["secret"].as_str().unwrap().to_owned();
    assert_eq!(
        v["key"]["id"].as_str(),
        Some(id.as_str()),
        "the same key, a new secret"
    );
    takes(&a, &fresh, 200).await;
    assert_eq!(
        a.ask_with(&secret).await.0,
        200,
        "the old secret in its grace"
    );
    // A rotation without grace stops the old secrets on both instances.
    let (status, v) = a
        .admin(
            "POST",
            &format!("/admin/keys/{id}/rotate"),
            Some(json!({"grace": "0s"})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let last = v["secret"].as_str().unwrap().to_owned();
    for gw in [&a, &b] {
        takes(gw, &fresh, 401).await;
        takes(gw, &secret, 401).await;
        takes(gw, &last, 200).await;
    }

    // Revocation: stopped on the other instance within the bound.
    let (status, _) = b.admin("DELETE", &format!("/admin/keys/{id}"), None).await;
    assert_eq!(status, 200);
    let stopped = takes(&a, &last, 401).await;
    assert!(stopped < Duration::from_secs(3), "{stopped:?}");
    eprintln!(
        "issued on one instance, served by the other after {reached:?}; revoked, refused after {stopped:?}"
    );
    // Again: the same answer, nothing changed.
    let (status, again) = b.admin("DELETE", &format!("/admin/keys/{id}"), None).await;
    assert_eq!(status, 200, "{again}");
    let (_, first) = a.admin("DELETE", &format!("/admin/keys/{id}"), None).await;
    assert_eq!(again["revoked_at_ms"], first["revoked_at_ms"]);
    let (status, v) = b
        .admin("DELETE", "/admin/keys/vk_0000000000000000", None)
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("key_not_found"))
    );

    // Expiry: at its instant, on both.
    let (_, short) = create(&a, "beta", json!({"expires_in": "1500ms"})).await;
    takes(&b, &short, 200).await;
    let refused = async |gw: &Instance| gw.ask_with(&short).await.0 == 401;
    let bound = Duration::from_millis(2_500);
    tollgate_testkit::wait::until_within("the key refused at its instant", bound, async || {
        refused(&a).await && refused(&b).await
    })
    .await;
    // Kept only as digests.
    let out = redis.cli().args(["hgetall", "hs:keys"]).output().unwrap();
    let held = String::from_utf8_lossy(&out.stdout);
    assert!(held.contains("beta") && !held.contains(&short), "{held}");
}

/// With a spend ledger, issued keys outlive the store: a Redis that forgets gets them back
/// with its books, and a memory store restarted gets them back before its first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issued_keys_are_rebuilt_from_the_ledger() {
    let (sim, redis, pg) = (sim().await, RedisServer::start(), PgServer::start());
    let ledger = format!("[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n", pg.url());
    let on_redis = Instance::start(&sim, &format!("{}{ledger}", redis_text(&redis))).await;
    let (_, secret) = create(&on_redis, "acme", json!({})).await;
    assert_eq!(on_redis.ask_with(&secret).await.0, 200);
    flushall(&redis);
    until("the keys written back by the rebuild", async || {
        common::instance::redis_has(&redis, "hs:keys")
    })
    .await;
    takes(&on_redis, &secret, 200).await;
    on_redis.stop().await;

    // A memory store with the same ledger: restarted, the key works from the first request.
    let first = Instance::start(&sim, &ledger).await;
    let (_, kept) = create(&first, "gamma", json!({})).await;
    first.stop().await;
    let second = Instance::start(&sim, &ledger).await;
    assert_eq!(second.ask_with(&kept).await.0, 200);
    assert_eq!(second.ask_with(&secret).await.0, 200);
    let rows = tollgate_ledger::Ledger::open(tollgate_ledger::Settings::new(pg.url()))
        .await
        .unwrap()
        .key_records()
        .await
        .unwrap();
    assert_eq!(rows.len(), 2);
    let digest = tollgate_gateway::keys::digest(&secret);
    assert!(rows.iter().any(|(_, _, r)| r.contains(&digest)));
    assert!(rows.iter().all(|(_, _, r)| !r.contains(&secret)));
}

/// What an operator may get wrong is refused with a 400 that names it, and nothing is issued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_key_request_names_its_fault() {
    let sim = sim().await;
    let gw = Instance::start(&sim, "").await;
    let cases = [
        (json!({}), "tenant"),
        (json!({"tenant": ""}), "tenant is empty"),
        (json!({"tenant": "acme", "colour": "red"}), "colour"),
        (json!({"tenant": "acme", "models": ["gpt-9"]}), "gpt-9"),
        (
            json!({"tenant": "acme", "expires_in": "soon"}),
            "expires_in",
        ),
        (
            json!({"tenant": "acme", "expires_at": "2001-01-01T00:00:00Z"}),
            "expire",
        ),
        (
            json!({"tenant": "acme", "expires_in": "1d", "expires_at": "2099-01-01T00:00:00Z"}),
            "not both",
        ),
        (json!({"tenant": "a\u{7}b"}), "control"),
        (json!({"tenant": "x".repeat(200)}), "128 bytes"),
    ];
    for (body, says) in cases {
        let (status, v) = gw.admin("POST", "/admin/keys", Some(body.clone())).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["code"], "invalid_key_request", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    let (status, v) = gw
        .admin(
            "POST",
            "/admin/keys/vk_0000/rotate",
            Some(json!({"grace": "1m"})),
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("key_not_found"))
    );
    let (_, listed) = gw.admin("GET", "/admin/keys", None).await;
    assert_eq!(listed["keys"], json!([]));
}

/// A tenant's own admin token manages that tenant's keys and reads its usage, and nothing else:
/// another tenant's keys are not listed, found or issued, and the operator's calls are 403.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_token_manages_its_own_tenant_only() {
    let sim = sim().await;
    let dir = tempfile::tempdir().unwrap();
    let acme_token = "acme-admin-token-0123456789";
    std::fs::write(dir.path().join("acme"), acme_token).unwrap();
    let text = format!(
        "[[admin.tenants]]\ntenant = \"acme\"\ntoken_file = \"{}\"\n",
        dir.path().join("acme").display()
    );
    let gw = Instance::start_with(&sim, &text, common::instance::BUDGET).await;
    let acme = |method: &'static str, path: String, body: Option<Value>| {
        let gw = &gw;
        async move { gw.admin_as(acme_token, method, &path, body).await }
    };
    let (status, v) = acme(
        "POST",
        "/admin/keys".into(),
        Some(json!({"tenant": "acme"})),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    let own = v["key"]["id"].as_str().unwrap().to_owned();
    assert_eq!(gw.ask_with(v["secret"].as_str().unwrap()).await.0, 200);
    let (status, v) = acme(
        "POST",
        "/admin/keys".into(),
        Some(json!({"tenant": "beta"})),
    )
    .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (403, Some("admin_scope_forbidden"))
    );
    let (beta, _) = create(&gw, "beta", json!({})).await;
    let (_, listed) = acme("GET", "/admin/keys".into(), None).await;
    let ids: Vec<&str> = listed["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [own.as_str()]);
    let (status, _) = acme("DELETE", format!("/admin/keys/{beta}"), None).await;
    assert_eq!(status, 404, "another tenant's key is not found");
    assert_eq!(
        acme(
            "POST",
            format!("/admin/keys/{beta}/rotate"),
            Some(json!({}))
        )
        .await
        .0,
        404
    );
    let (status, v) = acme(
        "GET",
        "/admin/usage?scope=tenant%7Ctenant%3Aacme".into(),
        None,
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, _) = acme(
        "GET",
        "/admin/usage?scope=tenant%7Ctenant%3Abeta".into(),
        None,
    )
    .await;
    assert_eq!(status, 403);
    for (method, path) in [
        ("GET", "/admin/status"),
        ("POST", "/admin/reload"),
        ("GET", "/admin/kill"),
    ] {
        let (status, v) = acme(method, path.into(), None).await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (403, Some("admin_scope_forbidden")),
            "{path}"
        );
    }
    assert_eq!(
        acme("DELETE", format!("/admin/keys/{own}"), None).await.0,
        200
    );
    // The operator's token still does everything.
    assert_eq!(
        gw.admin("DELETE", &format!("/admin/keys/{beta}"), None)
            .await
            .0,
        200
    );
}

/// A key created with limits of its own gets them on the rule keyed on `key`, in place of the
/// rule's; a limit that cannot be set refuses the creation; revoked, its limits go with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_issued_with_limits_of_its_own() {
    let sim = sim().await;
    let scopes = "[[policy.scopes]]\nname = \"per-key\"\nkey = \"key\"\n\
                  requests = { limit = 100, window = \"1m\" }\n";
    let gw = Instance::start_with(&sim, "", scopes).await;
    let (id, tight) = create(&gw, "acme", json!({"limits": {"requests": 3}})).await;
    let (_, plain) = create(&gw, "acme", json!({})).await;
    for _ in 0..3 {
        assert_eq!(gw.ask_with(&tight).await.0, 200);
    }
    assert_eq!(
        gw.ask_with(&tight).await,
        (429, "request_rate_limit".into())
    );
    for _ in 0..5 {
        assert_eq!(gw.ask_with(&plain).await.0, 200);
    }
    let (_, listed) = gw.admin("GET", "/admin/limits", None).await;
    assert_eq!(listed["limits"][0]["scope"], format!("per-key|key:{id}"));
    let (status, v) = gw
        .admin(
            "POST",
            "/admin/keys",
            Some(json!({"tenant": "acme", "limits": {"budget": "5USD"}})),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limits.budget"),
        "{v}"
    );
    let (_, keys) = gw.admin("GET", "/admin/keys", None).await;
    assert_eq!(
        keys["keys"].as_array().unwrap().len(),
        2,
        "nothing issued for the refusal"
    );
    assert_eq!(
        gw.admin("DELETE", &format!("/admin/keys/{id}"), None)
            .await
            .0,
        200
    );
    let (_, listed) = gw.admin("GET", "/admin/limits", None).await;
    assert_eq!(listed["limits"], json!([]));
}
