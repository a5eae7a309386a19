//! `/v1/reservations`: code that calls the provider itself reserves before the call and settles
//! after it, in the same books as proxied requests, on any instance sharing the store.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::instance::{Instance, redis_text, request as call, sim};
use serde_json::{Value, json};
use tollgate_testkit::redis_server::RedisServer;

const EDGE: &str = "sk-edge";

fn budget(tokens: u64) -> String {
    format!(
        "[[policy.scopes]]\nname = \"tenant\"\nkey = \"tenant\"\n\
         budget = {{ tokens = {tokens}, period = \"day\" }}\n"
    )
}

fn chat(max_tokens: u64) -> Value {
    json!({"model": "gpt-4o", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Write a haiku about tollgates."}]})
}

async fn reserve(on: &Instance, secret: &str, body: Value) -> (u16, Value) {
    let asked = json!({"endpoint": "/v1/chat/completions", "body": body});
    call(on.addr, "POST", "/v1/reservations", secret, Some(asked)).await
}

async fn settle(on: &Instance, id: &str, body: Value) -> (u16, Value) {
    let path = format!("/v1/reservations/{id}/settle");
    call(on.addr, "POST", &path, EDGE, Some(body)).await
}

/// The tenant budget's (used, reserved), read as acme's key holder reads it.
async fn books(on: &Instance) -> (u64, u64) {
    let (status, v) = call(on.addr, "GET", "/v1/limits", "sk-acme", None).await;
    assert_eq!(status, 200, "{v}");
    let row = v["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == "tenant" && r["control"] == "budget")
        .unwrap_or_else(|| panic!("no budget in {v}"))
        .clone();
    (
        row["used"].as_u64().unwrap(),
        row["reserved"].as_u64().unwrap(),
    )
}

/// What one reservation of `chat(100)` holds, read from an instance of its own.
async fn one_reservation() -> u64 {
    let sim = sim().await;
    let on = Instance::start_with(&sim, "", &budget(1_000_000)).await;
    let (status, v) = reserve(&on, EDGE, chat(100)).await;
    assert_eq!(status, 201, "{v}");
    on.stop().await;
    v["reserved_tokens"].as_u64().unwrap()
}

/// Ten reservations at once, from two instances sharing Redis (and from one on the memory
/// store), against a budget with room for three: exactly three are admitted, the others get
/// the proxy's refusal, and nothing is overspent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_reservations_admit_exactly_what_fits() {
    let each = one_reservation().await;
    let scopes = budget(each * 3 + each / 2);
    let (sim, redis) = (sim().await, RedisServer::start());
    let a = Instance::start_with(&sim, &redis_text(&redis), &scopes).await;
    assert_eq!(a.admin("POST", "/admin/store/init", None).await.0, 200);
    let b = Instance::start_with(&sim, &redis_text(&redis), &scopes).await;
    let memory = Instance::start_with(&sim, "", &scopes).await;
    for on in [[&a, &b], [&memory, &memory]] {
        let asks = (0..10).map(|i| reserve(on[i % 2], EDGE, chat(100)));
        let answers = futures_util::future::join_all(asks).await;
        let admitted: Vec<&Value> = answers
            .iter()
            .filter(|(s, _)| *s == 201)
            .map(|(_, v)| v)
            .collect();
        assert_eq!(admitted.len(), 3, "{answers:?}");
        for (status, v) in answers.iter().filter(|(s, _)| *s != 201) {
            assert_eq!(
                (*status, v["error"]["code"].as_str()),
                (429, Some("budget_limit"))
            );
        }
        let (used, reserved) = books(on[0]).await;
        assert_eq!((used, reserved), (0, each * 3));
        for v in admitted {
            assert_eq!(v["body"]["max_tokens"], 100, "the body to send: {v}");
            assert!(v["expires_at"].as_str().unwrap().ends_with('Z'), "{v}");
        }
    }
    for on in [a, b, memory] {
        on.stop().await;
    }
}

/// A reservation never settled is charged in full when its lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_reservation_is_charged_in_full_when_its_lease_ends() {
    let sim = sim().await;
    let scopes = format!("reservation_ttl = \"1s\"\n{}", budget(100_000));
    let on = Instance::start_with(&sim, "", &scopes).await;
    let (status, v) = reserve(&on, EDGE, chat(100)).await;
    assert_eq!(status, 201, "{v}");
    let each = v["reserved_tokens"].as_u64().unwrap();
    assert_eq!(books(&on).await, (0, each));
    // A renewal gives it one lifetime more, from now.
    let renew = format!("/v1/reservations/{}/renew", v["id"].as_str().unwrap());
    let (status, renewed) = call(on.addr, "POST", &renew, EDGE, None).await;
    assert_eq!(status, 200, "{renewed}");
    assert!(
        renewed["expires_at_ms"].as_u64() >= v["expires_at_ms"].as_u64(),
        "{renewed}"
    );
    let charged = tollgate_testkit::wait::poll(std::time::Duration::from_secs(5), async || {
        match books(&on).await {
            (used, 0) if used > 0 => Ok(used),
            other => Err(format!("not expired yet: {other:?}")),
        }
    })
    .await;
    assert_eq!(charged, each);
    let id = v["id"].as_str().unwrap();
    let (status, late) = settle(&on, id, json!({"prompt_tokens": 1, "completion_tokens": 1})).await;
    assert_eq!(
        (status, late["error"]["code"].as_str()),
        (409, Some("reservation_expired"))
    );
    assert_eq!(
        books(&on).await,
        (each, 0),
        "a late settlement changes nothing"
    );
    let (status, late) = call(on.addr, "POST", &renew, EDGE, None).await;
    assert_eq!(
        (status, late["error"]["code"].as_str()),
        (404, Some("reservation_not_found"))
    );
    on.stop().await;
}

/// On both stores, a reservation and a proxied request draw on one budget: while the
/// reservation holds it, the proxied request is refused; released, it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_and_a_proxied_request_share_one_budget() {
    let each = one_reservation().await;
    let scopes = budget(each + 10);
    let (sim, redis) = (sim().await, RedisServer::start());
    let shared = Instance::start_with(&sim, &redis_text(&redis), &scopes).await;
    assert_eq!(shared.admin("POST", "/admin/store/init", None).await.0, 200);
    let memory = Instance::start_with(&sim, "", &scopes).await;
    for on in [&shared, &memory] {
        let (status, v) = reserve(on, EDGE, chat(100)).await;
        assert_eq!(status, 201, "{v}");
        assert_eq!(on.ask("acme").await, (429, "budget_limit".into()));
        let path = format!("/v1/reservations/{}", v["id"].as_str().unwrap());
        let (status, gone) = call(on.addr, "DELETE", &path, EDGE, None).await;
        assert_eq!(
            (status, &gone["status"]),
            (200, &json!("released")),
            "{gone}"
        );
        assert_eq!(books(on).await, (0, 0), "a release charges nothing");
        assert_eq!(on.ask("acme").await.0, 200);
    }
    shared.stop().await;
    memory.stop().await;
}

/// A settlement reads usage in each shape the provider gives it, is idempotent, refuses what
/// it cannot read (the reservation stays open), and charges one above its reservation in full,
/// flagged; on Redis another instance settles what one reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settlements_are_read_checked_and_idempotent() {
    let (sim, redis) = (sim().await, RedisServer::start());
    let a = Instance::start_with(&sim, &redis_text(&redis), &budget(100_000)).await;
    assert_eq!(a.admin("POST", "/admin/store/init", None).await.0, 200);
    let b = Instance::start_with(&sim, &redis_text(&redis), &budget(100_000)).await;

    let (_, r) = reserve(&a, EDGE, chat(100)).await;
    let id = r["id"].as_str().unwrap();
    for bad in [json!({}), json!({"usage": {"prompt_tokens": "ten"}})] {
        let (status, v) = settle(&a, id, bad.clone()).await;
        assert_eq!(status, 400, "{bad}: {v}");
    }
    let final_response = json!({"id": "chatcmpl-1", "object": "chat.completion",
        "usage": {"prompt_tokens": 17, "completion_tokens": 12, "total_tokens": 29}});
    let (status, first) = settle(&a, id, final_response.clone()).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["status"], "settled");
    assert_eq!(first["over_reservation"], false);
    let (status, again) = settle(&a, id, final_response).await;
    assert_eq!((status, &again), (200, &first), "a settlement sent again");
    assert_eq!(books(&a).await, (29, 0));

    // Above the reservation: charged in full, flagged.
    let (_, r) = reserve(&a, EDGE, chat(10)).await;
    let (status, over) = settle(
        &a,
        r["id"].as_str().unwrap(),
        json!({"prompt_tokens": 17, "completion_tokens": 500}),
    )
    .await;
    assert_eq!(
        (status, &over["over_reservation"]),
        (200, &json!(true)),
        "{over}"
    );
    assert_eq!(books(&a).await, (29 + 517, 0));

    // Reserved on one instance, settled on the other, from the stream's last chunk.
    let (_, r) = reserve(&a, EDGE, chat(100)).await;
    let chunk = json!({"object": "chat.completion.chunk", "choices": [],
        "usage": {"prompt_tokens": 17, "completion_tokens": 3}});
    let (status, v) = settle(&b, r["id"].as_str().unwrap(), chunk).await;
    assert_eq!((status, &v["status"]), (200, &json!("settled")), "{v}");
    assert_eq!(books(&b).await, (29 + 517 + 20, 0));
    a.stop().await;
    b.stop().await;
}

/// Keys are held to their `uses`, a reservation to the key that made it, and a request the
/// gateway cannot price or reserve for is refused as the proxy refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_held_to_their_uses_and_their_reservations() {
    let sim = sim().await;
    let on = Instance::start_with(&sim, "", &budget(100_000)).await;
    let (status, v) = reserve(&on, "sk-acme", chat(10)).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (403, Some("key_not_allowed"))
    );
    let r = common::post(
        on.addr,
        "/v1/chat/completions",
        &[("authorization", format!("Bearer {EDGE}"))],
        chat(10).to_string(),
    )
    .await;
    assert_eq!((r.status, r.code()), (403, "key_not_allowed".into()));

    let (status, r) = reserve(&on, EDGE, chat(10)).await;
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap();
    let path = format!("/v1/reservations/{id}/settle");
    let usage = json!({"prompt_tokens": 1, "completion_tokens": 1});
    let (status, v) = call(on.addr, "POST", &path, "sk-beta", Some(usage.clone())).await;
    assert_eq!(status, 403, "beta may not make or end reservations: {v}");
    let forged = format!(
        "{}{}",
        &id[..id.len() - 1],
        if id.ends_with('0') { '1' } else { '0' }
    );
    let (status, v) = settle(&on, &forged, usage).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("reservation_not_found"))
    );

    // Counts stated instead of a body: reserved as stated, checked as a body's would be.
    let stated = json!({"endpoint": "/v1/chat/completions", "model": "gpt-4o",
        "input_tokens": 1200, "max_output_tokens": 300});
    let (status, s) = call(on.addr, "POST", "/v1/reservations", EDGE, Some(stated)).await;
    assert_eq!(status, 201, "{s}");
    assert_eq!(
        (&s["reserved_tokens"], &s["body"]),
        (&json!(1500), &Value::Null),
        "{s}"
    );
    let path = format!("/v1/reservations/{}", s["id"].as_str().unwrap());
    assert_eq!(call(on.addr, "DELETE", &path, EDGE, None).await.0, 200);
    for bad in [
        json!({"endpoint": "/v1/chat/completions", "model": "gpt-4o", "input_tokens": 10}),
        json!({"endpoint": "/v1/chat/completions", "body": chat(10), "model": "gpt-4o",
            "input_tokens": 10, "max_output_tokens": 10}),
        json!({"endpoint": "/v1/chat/completions", "model": "gpt-4o",
            "input_tokens": 1_000_000_000u64, "max_output_tokens": 10}),
        json!({"endpoint": "/v1/chat/completions", "model": "gpt-4o",
            "input_tokens": -1, "max_output_tokens": 10}),
        json!({"endpoint": "/v1/chat/completions", "model": "no-such-model",
            "input_tokens": 10, "max_output_tokens": 10}),
    ] {
        let (status, v) = call(on.addr, "POST", "/v1/reservations", EDGE, Some(bad.clone())).await;
        assert!(matches!(status, 400 | 404), "{bad}: {status} {v}");
    }
    let asked = json!({"endpoint": "/v1/images/generations", "body": chat(10)});
    let (status, v) = call(on.addr, "POST", "/v1/reservations", EDGE, Some(asked)).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("endpoint")),
        "{v}"
    );
    let asked = json!({"endpoint": "/v1/chat/completions", "body": chat(10), "extra": 1});
    let (status, _) = call(on.addr, "POST", "/v1/reservations", EDGE, Some(asked)).await;
    assert_eq!(status, 400);
    let mut odd = chat(10);
    odd["unheard_of_field"] = json!(true);
    let (status, v) = reserve(&on, EDGE, odd).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (400, Some("unknown_parameter")),
        "{v}"
    );

    // A key issued at run time may be allowed both.
    let (status, issued) = on
        .admin(
            "POST",
            "/admin/keys",
            Some(json!({"tenant": "beta", "uses": "both"})),
        )
        .await;
    assert_eq!(status, 201, "{issued}");
    assert_eq!(issued["key"]["uses"], "both", "{issued}");
    let secret = issued["secret"].as_str().unwrap();
    assert_eq!(reserve(&on, secret, chat(10)).await.0, 201);
    assert_eq!(on.ask_with(secret).await.0, 200);
    let (status, v) = on
        .admin(
            "POST",
            "/admin/kill",
            Some(json!({"target": "tenant:acme", "reason": "paused"})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = reserve(&on, EDGE, chat(10)).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("kill_switch"))
    );
    let (status, v) = on.admin("DELETE", "/admin/kill/tenant:acme", None).await;
    assert_eq!(status, 200, "{v}");
    // What was refused holds nothing; the open reservation still does.
    assert_eq!(
        books(&on).await,
        (0, r["reserved_tokens"].as_u64().unwrap())
    );
    on.stop().await;
}

/// With a spend ledger, a reservation settled or released on an instance that did not make it
/// is booked all the same: its ending reaches the ledger with what the store charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ending_on_another_instance_reaches_the_ledger() {
    use tollgate_ledger::{By, Ledger, Settings};
    let (sim, redis, pg) = (
        sim().await,
        RedisServer::start(),
        tollgate_testkit::pg_server::PgServer::start(),
    );
    let text = format!(
        "{}[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n",
        redis_text(&redis),
        pg.url()
    );
    let a = Instance::start_with(&sim, &text, &budget(100_000)).await;
    let b = Instance::start_with(&sim, &text, &budget(100_000)).await;
    let (_, settled) = reserve(&a, EDGE, chat(100)).await;
    let (_, released) = reserve(&a, EDGE, chat(100)).await;
    let usage = json!({"prompt_tokens": 17, "completion_tokens": 12});
    let (status, v) = settle(&b, settled["id"].as_str().unwrap(), usage).await;
    assert_eq!(status, 200, "{v}");
    let path = format!("/v1/reservations/{}", released["id"].as_str().unwrap());
    assert_eq!(call(b.addr, "DELETE", &path, EDGE, None).await.0, 200);
    let ledger = Ledger::open(Settings::new(pg.url())).await.unwrap();
    let now = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    tollgate_testkit::wait::until("both endings in the ledger", async || {
        let spent = ledger
            .spend(By::Tenant, now - 60_000, now + 60_000)
            .await
            .unwrap();
        let acme = spent.iter().find(|r| r.group == "acme");
        let totals = ledger.current_totals(now).await.unwrap();
        let kept = totals
            .iter()
            .find(|t| t.scope == "tenant|tenant:acme")
            .map_or(0, |t| t.amount);
        acme.is_some_and(|r| r.requests == 2) && kept == 29
    })
    .await;
    a.stop().await;
    b.stop().await;
}

/// A store that does not answer while a reservation ends never gets a 503, which would say
/// nothing changed: the instance that made it retries the ending (202 pending), another may
/// have had it taken (500); sent again, the ending tells what the store did, charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ending_the_store_does_not_answer_is_never_a_503() {
    let (sim, redis) = (sim().await, RedisServer::start());
    let a = Instance::start_with(&sim, &redis_text(&redis), &budget(100_000)).await;
    assert_eq!(a.admin("POST", "/admin/store/init", None).await.0, 200);
    let b = Instance::start_with(&sim, &redis_text(&redis), &budget(100_000)).await;
    let (_, here) = reserve(&a, EDGE, chat(100)).await;
    let (_, there) = reserve(&a, EDGE, chat(100)).await;
    let usage = json!({"prompt_tokens": 17, "completion_tokens": 12});
    // Longer than the instances' call timeout (2 s): the commands wait, then run.
    redis.cli_run(&["CLIENT", "PAUSE", "4000", "ALL"]);
    let ((s1, v1), (s2, v2)) = tokio::join!(
        settle(&a, here["id"].as_str().unwrap(), usage.clone()),
        settle(&b, there["id"].as_str().unwrap(), usage.clone()),
    );
    assert_eq!((s1, &v1["status"]), (202, &json!("pending")), "{v1}");
    assert_eq!(
        (s2, v2["error"]["code"].as_str()),
        (500, Some("reservation_outcome_unknown")),
        "{v2}"
    );
    tollgate_testkit::wait::until("the pause ends and both endings are taken", async || {
        // Read only once the store answers again.
        call(a.addr, "GET", "/v1/limits", "sk-acme", None).await.0 == 200
            && books(&a).await == (58, 0)
    })
    .await;
    for (on, r) in [(&a, &here), (&b, &there)] {
        let (status, v) = settle(on, r["id"].as_str().unwrap(), usage.clone()).await;
        assert_eq!(
            (status, &v["status"]),
            (200, &json!("already_settled")),
            "{v}"
        );
    }
    assert_eq!(books(&b).await, (58, 0), "each charged once");
    a.stop().await;
    b.stop().await;
}
