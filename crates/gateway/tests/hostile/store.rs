//! A store loss that an instance could hide: each test is an attack on the books through a store
//! that forgets, over real sockets, with a Redis (and, where the ledger is the evidence, a
//! PostgreSQL) of the test's own. An instance that finds an empty store never writes a fresh
//! marker over a loss: it decides from the ledger's rows or waits for an operator; running
//! instances notice a loss while idle; a Redis that may evict holds nothing that would reopen.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::instance::{Instance, flushall, redis_has, redis_text, sim, until};
use serde_json::json;
use tollgate_core::Keeper as _;
use tollgate_gateway::GatewayConfig;
use tollgate_ledger::{Ledger, Settings};
use tollgate_testkit::failover::Failover;
use tollgate_testkit::pg_server::PgServer;
use tollgate_testkit::redis_server::RedisServer;

/// Waits for the kill switch to reach the ledger at `url`, and answers the ledger.
async fn kill_in_ledger(url: String) -> Ledger {
    let ledger = Ledger::open(Settings::new(url)).await.unwrap();
    until("the kill switch in the ledger", async || {
        !ledger.kills().await.unwrap().is_empty()
    })
    .await;
    ledger
}

/// Without a ledger, an empty store cannot be told from one that forgot while no instance ran:
/// a new instance refuses (503 `store_uninitialised`) instead of writing a fresh marker over
/// the loss, until an operator declares it new with `init-store`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_does_not_hide_a_loss() {
    let (sim, redis) = (sim().await, RedisServer::start());
    let first = Instance::start(&sim, &redis_text(&redis)).await;
    // A new deployment is initialised by its operator, then served.
    assert_eq!(first.ask("acme").await, (503, "store_uninitialised".into()));
    assert_eq!(first.store_state().await, "uninitialised");
    let (status, v) = first.admin("POST", "/admin/store/init", None).await;
    assert_eq!((status, &v["initialised"]), (200, &json!(true)), "{v}");
    let (status, v) = first.admin("POST", "/admin/store/init", None).await;
    assert_eq!((status, &v["initialised"]), (200, &json!(false)), "{v}");
    first.spend_and_kill().await;
    first.stop().await;

    // Every instance is down when the store forgets; a new one starts.
    flushall(&redis);
    let second = Instance::start(&sim, &redis_text(&redis)).await;
    for t in ["acme", "gamma", "beta"] {
        assert_eq!(
            second.ask(t).await,
            (503, "store_uninitialised".into()),
            "{t}"
        );
    }
    assert!(!redis_has(&redis, "hs:marker"), "no marker was written");
    assert_eq!(second.store_state().await, "uninitialised");
    // The operator decides: the store is declared new, and admissions begin from it.
    let (status, v) = second.admin("POST", "/admin/store/init", None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(second.ask("acme").await.0, 200);
}

/// A running instance notices a loss while idle (no request reaches it) and writes it down, so
/// that an instance started afterwards refuses with the loss (503 `store_state_lost`), not as
/// a store that may be new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_instance_writes_a_loss_down() {
    let (sim, redis) = (sim().await, RedisServer::start());
    let first = Instance::start(&sim, &redis_text(&redis)).await;
    assert_eq!(first.admin("POST", "/admin/store/init", None).await.0, 200);
    first.spend_and_kill().await;
    flushall(&redis);
    until("the idle instance writing the loss down", async || {
        redis_has(&redis, "hs:lost")
    })
    .await;
    let second = Instance::start(&sim, &redis_text(&redis)).await;
    for t in ["acme", "gamma"] {
        assert_eq!(second.ask(t).await, (503, "store_state_lost".into()), "{t}");
    }
    assert_eq!(first.store_state().await, "lost");
    assert_eq!(second.store_state().await, "lost");
    // Initialising over a written-down loss is refused: it is acknowledged instead.
    let (status, v) = second.admin("POST", "/admin/store/init", None).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("store_state_lost"))
    );
    let (status, _) = second
        .admin("POST", "/admin/store/acknowledge-loss", None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(first.ask("acme").await.0, 200);
}

/// With a spend ledger, the ledger's rows are the evidence: an instance that starts on a store
/// that forgot while every instance was down rebuilds it (the spent budget and the kill switch
/// hold), and one that starts a new deployment (an empty ledger) initialises it by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_rebuilds_a_forgetful_store_from_the_ledger() {
    let (sim, redis, pg) = (sim().await, RedisServer::start(), PgServer::start());
    let text = format!(
        "{}[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n",
        redis_text(&redis),
        pg.url()
    );
    let first = Instance::start(&sim, &text).await;
    // A new deployment: served from the first request.
    first.spend_and_kill().await;
    let ledger = kill_in_ledger(pg.url()).await;
    first.stop().await;
    assert!(
        ledger.counts().await.unwrap().1 > 0,
        "charges in the ledger"
    );

    flushall(&redis);
    let second = Instance::start(&sim, &text).await;
    let mut seen = Vec::new();
    until("the budget refusing again", async || {
        let r = second.ask("acme").await;
        assert_ne!(r.0, 200, "a spent budget reopened after {seen:?}");
        seen.push(r.clone());
        r == (429, "budget_limit".into())
    })
    .await;
    assert!(
        seen.iter()
            .all(|r| r.1 == "store_state_lost" || r.1 == "budget_limit"),
        "{seen:?}"
    );
    assert_eq!(second.ask("gamma").await, (503, "kill_switch".into()));
    assert_eq!(second.ask("beta").await.0, 200);
    // Initialising a store whose ledger holds books is refused.
    let (status, v) = second.admin("POST", "/admin/store/init", None).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("store_has_books"))
    );
}

/// The memory store starts empty with every process: with a spend ledger, a restart restores
/// its books before the first request, so a spent budget and a kill switch hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_store_restarts_with_its_books() {
    let (sim, pg) = (sim().await, PgServer::start());
    let text = format!("[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n", pg.url());
    let first = Instance::start(&sim, &text).await;
    first.spend_and_kill().await;
    kill_in_ledger(pg.url()).await;
    first.stop().await;

    let second = Instance::start(&sim, &text).await;
    assert_eq!(second.ask("acme").await, (429, "budget_limit".into()));
    assert_eq!(second.ask("gamma").await, (503, "kill_switch".into()));
    assert_eq!(second.ask("beta").await.0, 200);
}

/// A Redis that may evict keys holds no budget and no kill switch: a policy with a budget is
/// refused with `allow_eviction`, and a kill switch set at run time is refused (409) while one
/// in the configuration file still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_is_refused_where_it_would_reopen() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let evicting = format!("{}allow_eviction = true\n", redis_text(&redis));
    let budget = format!(
        "{evicting}[policy]\n[[policy.scopes]]\nkey = \"tenant\"\n\
         budget = {{ tokens = 300, period = \"day\" }}\n"
    );
    let e = GatewayConfig::from_toml(&budget).unwrap_err().to_string();
    assert!(
        e.contains("store.allow_eviction") && e.contains("budget"),
        "{e}"
    );

    let sim = sim().await;
    let text =
        format!("{evicting}[[kill]]\ntarget = \"tenant:beta\"\nreason = \"held in the file\"\n");
    let scopes =
        "[[policy.scopes]]\nkey = \"tenant\"\nrequests = { limit = 100, window = \"1m\" }\n";
    let gw = Instance::start_with(&sim, &text, scopes).await;
    assert_eq!(gw.admin("POST", "/admin/store/init", None).await.0, 200);
    let (status, v) = gw
        .admin(
            "POST",
            "/admin/kill",
            Some(json!({"target": "tenant:acme", "reason": "x"})),
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("kill_switch_needs_a_store_that_keeps"))
    );
    assert_eq!(gw.ask("acme").await.0, 200);
    assert_eq!(gw.ask("beta").await, (503, "kill_switch".into()));
}

/// Two versions must not share a prefix: an instance that finds another schema in the marker
/// (here `1`, what builds before the schema was written left) refuses to start, saying why,
/// and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_version_on_the_prefix_is_refused_at_start() {
    let redis = RedisServer::start();
    let out = redis
        .cli()
        .args(["set", "hs:marker", "1"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = format!(
        "{}[[upstreams]]\nname = \"up\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"gpt-4o\"]\n",
        redis_text(&redis)
    );
    let config = GatewayConfig::from_toml(&text).unwrap();
    let store = tollgate_gateway::start_store(&config).await.unwrap();
    let gw = tollgate_gateway::Gateway::new(config, store.clone());
    let e = tollgate_gateway::prepare(&gw)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("another version") && e.contains("\"1\"") && e.contains(tollgate_redis::SCHEMA),
        "{e}"
    );
    let e = store.initialise().await.unwrap_err().to_string();
    assert!(e.contains("another version"), "{e}");
    let out = redis.cli().args(["get", "hs:marker"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1");
}

/// What a failover run leaves to check: acme's budget spent, gamma switched off and a key of
/// beta's revoked, all after the replica stopped receiving writes (unless it `caught_up` first),
/// then the primary lost and the replica promoted. Answers the key's secret.
async fn spend_then_fail_over(
    store: &mut Failover,
    first: &Instance,
    second: &Instance,
    caught_up: bool,
) -> String {
    let (status, v) = first
        .admin("POST", "/admin/keys", Some(json!({"tenant": "beta"})))
        .await;
    assert_eq!(status, 201, "{v}");
    let (id, secret) = (
        v["key"]["id"].as_str().unwrap(),
        v["secret"].as_str().unwrap(),
    );
    // Both instances admit before the lag: each has seen the store's sequence.
    assert_eq!(first.ask("acme").await.0, 200);
    until("the key on the second instance", async || {
        second.ask_with(secret).await.0 == 200
    })
    .await;
    store.catch_up();
    if !caught_up {
        store.lag();
    }
    first.spend_and_kill().await;
    let (status, v) = first
        .admin("DELETE", &format!("/admin/keys/{id}"), None)
        .await;
    assert_eq!(status, 200, "{v}");
    until("the revocation on the second instance", async || {
        second.ask_with(secret).await.0 == 401
    })
    .await;
    if caught_up {
        store.catch_up();
    }
    store.fail_over();
    secret.to_owned()
}

/// `t`'s answer once the store answers again after the failover (its link turned).
async fn answer(on: &Instance, t: &str) -> (u16, String) {
    let mut r = on.ask(t).await;
    until("the promoted replica answering", async || {
        r = on.ask(t).await;
        r.1 != "store_unavailable"
    })
    .await;
    r
}

fn failover_text(store: &Failover, ledger: Option<&PgServer>) -> String {
    let ledger = ledger.map_or_else(String::new, |pg| {
        format!("[ledger]\nurl = \"{}\"\nflush_every = \"20ms\"\n", pg.url())
    });
    format!(
        "[store]\nurl = \"{}\"\nprefix = \"hs\"\ncall_timeout = \"2s\"\n{ledger}",
        store.url()
    )
}

/// A failover to a replica that lagged, without a ledger: the promoted replica holds the
/// marker but not the last writes (the spent budget, the kill switch, the revocation). Each
/// instance's write sequence is ahead of the store's: the store is lost, admissions are refused
/// (503 `store_state_lost`) on both instances, the operator is told why (`/admin/status`, the
/// loss's cause with both sequences; a metric), and nothing the replica forgot is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_replica_that_lagged_is_a_loss() {
    let (sim, mut store) = (sim().await, Failover::start().await);
    let text = failover_text(&store, None);
    let first = Instance::start(&sim, &text).await;
    assert_eq!(first.admin("POST", "/admin/store/init", None).await.0, 200);
    let second = Instance::start(&sim, &text).await;
    let secret = spend_then_fail_over(&mut store, &first, &second, false).await;
    for on in [&first, &second] {
        for (who, r) in [
            ("acme", answer(on, "acme").await),
            ("gamma", on.ask("gamma").await),
        ] {
            assert_eq!(r, (503, "store_state_lost".into()), "{who}");
        }
        // Each instance keeps the revocation it knew: a lower version is not news.
        assert_eq!(on.ask_with(&secret).await.0, 401, "the revoked key");
    }
    let (status, v) = second.admin("GET", "/admin/status", None).await;
    assert_eq!((status, v["store"].as_str()), (200, Some("lost")), "{v}");
    let cause = v["store_loss"].as_str().unwrap_or_default();
    assert!(cause.contains("behind"), "{v}");
    let metrics = second.metrics().await;
    assert!(
        metrics.lines().any(
            |l| l.starts_with("tollgate_store_losses_total{cause=\"behind\"} ")
                && !l.ends_with(" 0")
        ),
        "{metrics}"
    );
    // The operator acknowledges: served from what the store holds, as documented.
    let (status, _) = first
        .admin("POST", "/admin/store/acknowledge-loss", None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(second.ask("acme").await.0, 200);
}

/// The same failover with a spend ledger: the store is rebuilt from it. The spent budget stays
/// spent, the kill switch and the revocation hold, on both instances; the upstream is never
/// asked for more than the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_replica_that_lagged_is_rebuilt_from_the_ledger() {
    let (sim, mut store, pg) = (sim().await, Failover::start().await, PgServer::start());
    let text = failover_text(&store, Some(&pg));
    let first = Instance::start(&sim, &text).await;
    let second = Instance::start(&sim, &text).await;
    let secret = spend_then_fail_over(&mut store, &first, &second, false).await;
    let served = sim.stats().completed;
    for on in [&first, &second] {
        until("the budget refusing again", async || {
            let r = on.ask("acme").await;
            assert_ne!(r.0, 200, "a spent budget reopened");
            r == (429, "budget_limit".into())
        })
        .await;
        assert_eq!(on.ask("gamma").await, (503, "kill_switch".into()));
        assert_eq!(on.ask_with(&secret).await.0, 401, "the revoked key");
        assert_eq!(on.store_state().await, "ok");
    }
    assert_eq!(
        sim.stats().completed,
        served,
        "nothing sent upstream past the budget"
    );
}

/// The control: the replica caught up before the failover (`WAIT`), so nothing was lost and
/// nothing is refused for it; the budget, the kill switch and the revocation hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_replica_that_caught_up_loses_nothing() {
    let (sim, mut store) = (sim().await, Failover::start().await);
    let text = failover_text(&store, None);
    let first = Instance::start(&sim, &text).await;
    assert_eq!(first.admin("POST", "/admin/store/init", None).await.0, 200);
    let second = Instance::start(&sim, &text).await;
    let secret = spend_then_fail_over(&mut store, &first, &second, true).await;
    for on in [&first, &second] {
        assert_eq!(answer(on, "acme").await, (429, "budget_limit".into()));
        assert_eq!(on.ask("gamma").await, (503, "kill_switch".into()));
        assert_eq!(on.ask_with(&secret).await.0, 401, "the revoked key");
        assert_eq!(on.store_state().await, "ok");
    }
}

/// The store goes back in time while every instance is down: the one that starts next takes
/// what the ones before it saw of the store's write sequence from the ledger, finds the store
/// behind it, and rebuilds it; the spent budget and the kill switch hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_went_back_while_no_instance_ran_is_noticed_at_start() {
    let (sim, mut store, pg) = (sim().await, Failover::start().await, PgServer::start());
    let text = failover_text(&store, Some(&pg));
    let first = Instance::start(&sim, &text).await;
    assert_eq!(first.ask("acme").await.0, 200);
    store.catch_up();
    store.lag();
    first.spend_and_kill().await;
    let ledger = kill_in_ledger(pg.url()).await;
    let primary: u64 = store
        .primary
        .cli_run(&["HGET", "hs:seq", "n"])
        .parse()
        .unwrap();
    until("the instance's mark in the ledger", async || {
        let marks = ledger.store_marks().await.unwrap();
        marks.first().is_some_and(|m| m.2 >= primary)
    })
    .await;
    first.stop().await;
    store.fail_over();
    let second = Instance::start(&sim, &text).await;
    until("the budget refusing again", async || {
        let r = answer(&second, "acme").await;
        assert_ne!(r.0, 200, "a spent budget reopened");
        r == (429, "budget_limit".into())
    })
    .await;
    assert_eq!(second.ask("gamma").await, (503, "kill_switch".into()));
}

/// A kill switch, a key and a limit wait for the replica to confirm them: while it is frozen
/// (linked, acknowledging nothing), each change is made on the primary and answered 500 with
/// a code that says so (`store_not_replicated`, `key_change_unknown`, `limit_change_unknown`)
/// within the call timeout, rather than 200 or a 503 that would say nothing changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_no_replica_confirms_is_said_so() {
    let (sim, store) = (sim().await, Failover::start().await);
    let gw = Instance::start(&sim, &failover_text(&store, None)).await;
    assert_eq!(gw.admin("POST", "/admin/store/init", None).await.0, 200);
    let kill = |t: &str| json!({"target": format!("tenant:{t}"), "reason": "runaway"});
    assert_eq!(
        gw.admin("POST", "/admin/kill", Some(kill("gamma"))).await.0,
        200
    );
    store.freeze_replica(true);
    let started = std::time::Instant::now();
    let (status, v) = gw.admin("POST", "/admin/kill", Some(kill("beta"))).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (500, Some("store_not_replicated")),
        "{v}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(gw.ask("beta").await, (503, "kill_switch".into()), "made");
    let (status, v) = gw
        .admin("POST", "/admin/keys", Some(json!({"tenant": "acme"})))
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (500, Some("key_change_unknown")),
        "{v}"
    );
    let limit = json!({"value": "tenant:acme", "control": "budget", "limit": 100});
    let (status, v) = gw.admin("PUT", "/admin/limits", Some(limit)).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (500, Some("limit_change_unknown")),
        "{v}"
    );
    store.freeze_replica(false);
    let (status, v) = gw.admin("DELETE", "/admin/kill/tenant:beta", None).await;
    assert_eq!(status, 200, "{v}");
}

/// Writes the scripts' sequence does not count (a kept idempotent answer, a note; played here
/// by a key written straight to the primary) are covered by the replication history: an
/// instance that read the primary's history past them finds the promoted replica's copy cut
/// short at its next reading of the store's state, and the store lost, with that cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_history_cut_short_is_a_loss() {
    let (sim, mut store) = (sim().await, Failover::start().await);
    // Without slices, whose upkeep writes on its own tick: after the settlement below, nothing
    // moves the sequence, so only the history can tell what the replica missed.
    let text = failover_text(&store, None) + "[store.slices]\nenabled = false\n";
    let gw = Instance::start(&sim, &text).await;
    assert_eq!(gw.admin("POST", "/admin/store/init", None).await.0, 200);
    assert_eq!(gw.ask("acme").await.0, 200);
    // Its settlement written before the replica is caught up.
    until("the request settled", async || {
        let (_, v) = gw
            .admin("GET", "/admin/usage?scope=tenant%7Ctenant%3Aacme", None)
            .await;
        v["reserved"] == 0 && v["settled"].as_u64().unwrap_or(0) > 0
    })
    .await;
    store.catch_up();
    store.lag();
    store
        .primary
        .cli_run(&["SET", "hs:n:ctx:kept", "an answer the replica never got"]);
    // The status reads the store's state, and its history with it.
    assert_eq!(gw.store_state().await, "ok");
    store.fail_over();
    // The next reading of the store's state (the watch's, within a second; here the status's)
    // finds the history cut short.
    let mut state = String::new();
    until("the promoted replica answering", async || {
        state = gw.store_state().await;
        state != "unreachable"
    })
    .await;
    assert_eq!(state, "lost");
    assert_eq!(gw.ask("acme").await, (503, "store_state_lost".into()));
    let (_, v) = gw.admin("GET", "/admin/status", None).await;
    let cause = v["store_loss"].as_str().unwrap_or_default();
    assert!(cause.contains("replication history"), "{v}");
}
