//! The ledger against a PostgreSQL of the test's own.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use tollgate_ledger::{By, Charge, Entry, Ledger, Settings};
use tollgate_testkit::pg_server::PgServer;

const DAY: i64 = 86_400_000;
const T0: i64 = 1_767_225_600_000;

fn entry(id: &str, tenant: &str, tokens: i64, at: i64) -> Entry {
    Entry {
        request_id: id.into(),
        ending: "settled",
        at_ms: at,
        tenant: Some(tenant.into()),
        model: Some("gpt-4o-mini".into()),
        input_tokens: tokens / 2,
        output_tokens: tokens - tokens / 2,
        cost_micro_usd: Some(tokens * 3),
        charges: vec![Charge {
            scope: format!("tenants|tenant:{tenant}"),
            label: "day".into(),
            period_ms: DAY,
            period_id: at / DAY,
            period_start_ms: at / DAY * DAY,
            period_end_ms: (at / DAY + 1) * DAY,
            unit: "tokens",
            amount: tokens,
        }],
        ..Entry::default()
    }
}

#[tokio::test]
async fn endings_are_written_once_and_summed_per_period() {
    let pg = PgServer::start();
    let mut s = Settings::new(pg.url());
    s.flush_every = Duration::from_millis(20);
    // Opened twice: the second run of the migrations changes nothing.
    let _ = Ledger::open(s.clone()).await.unwrap();
    let ledger = Ledger::open(s).await.unwrap();
    ledger.spawn_writer(None);
    for (i, t) in [10, 20, 30].iter().enumerate() {
        assert!(ledger.append(entry(&format!("r{i}"), "acme", *t, T0 + 1000)));
    }
    // A repeated ending of r0 with another amount, and yesterday's request.
    assert!(ledger.append(entry("r0", "acme", 999, T0 + 2000)));
    assert!(ledger.append(entry("old", "acme", 7, T0 - 1000)));
    assert!(ledger.append(entry("b1", "beta", 5, T0 + 3000)));
    assert!(ledger.flush(Duration::from_secs(10)).await);
    assert_eq!(ledger.counts().await.unwrap(), (5, 5));
    let totals = ledger.current_totals(T0 + 5000).await.unwrap();
    let got: Vec<(String, i64)> = totals.iter().map(|t| (t.scope.clone(), t.amount)).collect();
    assert_eq!(
        got,
        vec![
            ("tenants|tenant:acme".to_owned(), 60),
            ("tenants|tenant:beta".to_owned(), 5)
        ]
    );
    assert_eq!(
        ledger
            .total("tenants|tenant:acme", "day", (T0 - 1000) / DAY)
            .await
            .unwrap(),
        7
    );
    let spend = ledger.spend(By::Tenant, T0, T0 + DAY).await.unwrap();
    assert_eq!(spend.len(), 2);
    assert_eq!(
        (
            spend[0].group.as_str(),
            spend[0].requests,
            spend[0].cost_micro_usd
        ),
        ("acme", 3, 180)
    );
    let days = ledger.spend(By::Day, T0 - DAY, T0 + DAY).await.unwrap();
    let names: Vec<&str> = days.iter().map(|d| d.group.as_str()).collect();
    assert_eq!(names, vec!["2026-01-01", "2025-12-31"]);

    ledger
        .set_kill("tenant:acme", Some("card declined"), T0)
        .await
        .unwrap();
    ledger.set_kill("all", Some("incident"), T0).await.unwrap();
    ledger.set_kill("all", None, T0).await.unwrap();
    assert_eq!(
        ledger.kills().await.unwrap(),
        vec![("tenant:acme".to_owned(), "card declined".to_owned())]
    );
}

/// PostgreSQL goes down with endings buffered: they stay buffered, the failed batches are put
/// back and retried, and once it is back every one is written, once.
#[tokio::test]
async fn nothing_buffered_is_lost_while_postgres_is_down() {
    let pg = PgServer::start();
    let mut s = Settings::new(pg.url());
    s.flush_every = Duration::from_millis(20);
    s.batch = 7;
    let ledger = Ledger::open(s).await.unwrap();
    ledger.spawn_writer(None);
    pg.stop();
    for i in 0..50 {
        ledger.append(entry(&format!("d{i}"), "acme", 1, T0));
    }
    assert!(
        !ledger.flush(Duration::from_millis(500)).await,
        "nothing can be written"
    );
    assert_eq!(ledger.buffered(), 50);
    pg.restart();
    assert!(ledger.flush(Duration::from_secs(20)).await);
    assert_eq!(ledger.counts().await.unwrap(), (50, 50));
    assert_eq!(ledger.written(), 50);
}

/// A batch holding an id the ledger already has (an expiry two instances read, a batch written
/// again after its commit went unconfirmed): the other endings of the batch are written, the
/// id's first ending and its charges stand.
#[tokio::test]
async fn a_batch_repeating_a_written_id_writes_the_rest() {
    let pg = PgServer::start();
    let mut s = Settings::new(pg.url());
    s.flush_every = Duration::from_millis(20);
    let ledger = Ledger::open(s).await.unwrap();
    ledger.spawn_writer(None);
    assert!(ledger.append(entry("first", "acme", 10, T0)));
    assert!(ledger.flush(Duration::from_secs(10)).await);
    for (id, tokens) in [("new-1", 1), ("first", 500), ("new-2", 2)] {
        assert!(ledger.append(entry(id, "acme", tokens, T0 + 1)));
    }
    assert!(ledger.flush(Duration::from_secs(10)).await);
    assert_eq!(ledger.counts().await.unwrap(), (3, 3));
    assert_eq!(
        ledger
            .total("tenants|tenant:acme", "day", T0 / DAY)
            .await
            .unwrap(),
        13
    );
    assert_eq!(ledger.written(), 4);
}

/// A URL is read as the client reads it: a host, or a Unix socket's directory percent-encoded
/// as the host (libpq's form); anything else is refused with the parser's words.
#[test]
fn urls_are_read_as_the_client_reads_them() {
    for ok in [
        "postgres://tollgate@db.internal:5432/tollgate",
        "postgresql://tollgate:secret@127.0.0.1/tollgate",
        "postgres://tollgate@%2Fvar%2Frun%2Fpostgresql:5432/tollgate",
    ] {
        assert_eq!(tollgate_ledger::check_url(ok), Ok(()), "{ok}");
    }
    for bad in [
        "mysql://db/tollgate",
        "postgres://tollgate@db:notaport/tollgate",
        "db.internal:5432",
    ] {
        assert!(tollgate_ledger::check_url(bad).is_err(), "{bad}");
    }
}

/// A key's record changes only from the version it holds: one of two changes from the same
/// version is written, the other finds the version the first wrote.
#[tokio::test]
async fn a_key_record_is_a_compare_and_set() {
    use tollgate_ledger::Swap;
    let pg = PgServer::start();
    let ledger = Ledger::open(Settings::new(pg.url())).await.unwrap();
    assert_eq!(ledger.key_record("vk_a").await.unwrap(), None);
    assert_eq!(
        ledger
            .swap_key("vk_a", 0, (1, "{\"v\":1}"), 1)
            .await
            .unwrap(),
        Swap::Done
    );
    assert_eq!(
        ledger
            .swap_key("vk_a", 0, (1, "{\"v\":9}"), 1)
            .await
            .unwrap(),
        Swap::Changed(1)
    );
    assert_eq!(
        ledger
            .swap_key("vk_a", 1, (2, "{\"v\":2}"), 2)
            .await
            .unwrap(),
        Swap::Done
    );
    assert_eq!(
        ledger
            .swap_key("vk_a", 1, (2, "{\"v\":3}"), 3)
            .await
            .unwrap(),
        Swap::Changed(2)
    );
    assert_eq!(
        ledger.key_record("vk_a").await.unwrap(),
        Some((2, "{\"v\":2}".to_owned()))
    );
    assert_eq!(
        ledger.key_records().await.unwrap(),
        vec![("vk_a".to_owned(), 2, "{\"v\":2}".to_owned())]
    );
}

/// Keys kept by the digest of each secret (before records by id) are carried over by the
/// migration: one record per key, the current secret's fields, every secret with a rotated
/// one's grace as its end.
#[tokio::test]
async fn keys_kept_by_digest_are_carried_over_into_records() {
    let pg = PgServer::start();
    let (client, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(
            "CREATE TABLE tollgate_migrations (version int PRIMARY KEY, \
             applied_at timestamptz NOT NULL DEFAULT now());
             INSERT INTO tollgate_migrations (version) VALUES (1), (2), (3), (4);
             CREATE TABLE tollgate_keys (digest text PRIMARY KEY, record text NOT NULL, \
             at_ms bigint NOT NULL);",
        )
        .await
        .unwrap();
    let rows = [
        (
            "d1",
            r#"{"id":"vk_a","name":"a","tenant":"acme","created_at_ms":10,"expires_at_ms":500,"rotated":true}"#,
        ),
        (
            "d2",
            r#"{"id":"vk_a","name":"a","tenant":"acme","created_at_ms":20,"metadata":{"team":"x"}}"#,
        ),
        (
            "d3",
            r#"{"id":"vk_b","name":"b","tenant":"beta","created_at_ms":30}"#,
        ),
    ];
    for (d, r) in rows {
        client
            .execute("INSERT INTO tollgate_keys VALUES ($1, $2, 7)", &[&d, &r])
            .await
            .unwrap();
    }
    let ledger = Ledger::open(Settings::new(pg.url())).await.unwrap();
    let records = ledger.key_records().await.unwrap();
    assert_eq!(records.len(), 2);
    let a: serde_json::Value = serde_json::from_str(&records[0].2).unwrap();
    assert_eq!((records[0].0.as_str(), records[0].1), ("vk_a", 1));
    assert_eq!(a["tenant"], "acme");
    assert_eq!(a["metadata"]["team"], "x");
    assert_eq!(a["created_at_ms"], 20);
    assert!(
        a.get("rotated").is_none() && a.get("expires_at_ms").is_none(),
        "{a}"
    );
    let mut secrets = a["secrets"].as_array().unwrap().clone();
    secrets.sort_by_key(|s| s["digest"].as_str().unwrap().to_owned());
    assert_eq!(
        serde_json::Value::Array(secrets),
        serde_json::json!([
            {"digest": "d1", "since_ms": 10, "until_ms": 500},
            {"digest": "d2", "since_ms": 20}
        ])
    );
    let b: serde_json::Value = serde_json::from_str(&records[1].2).unwrap();
    assert_eq!(
        b["secrets"],
        serde_json::json!([{"digest": "d3", "since_ms": 30}])
    );
    let gone = client
        .query_one("SELECT to_regclass('tollgate_keys') IS NULL", &[])
        .await
        .unwrap();
    assert!(gone.get::<_, bool>(0));
}
