//! `tollgate spend` over a ledger of the test's own: exact sums per group, in every format.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::time::Duration;

use tollgate_ledger::{Entry, Ledger, Settings};
use tollgate_testkit::pg_server::PgServer;

/// 2026-01-01T00:00:00Z.
const T0: i64 = 1_767_225_600_000;

fn entry(id: &str, tenant: &str, model: &str, at: i64, input: i64, cost: i64) -> Entry {
    Entry {
        request_id: id.into(),
        ending: "settled",
        at_ms: at,
        tenant: Some(tenant.into()),
        model: Some(model.into()),
        input_tokens: input,
        output_tokens: 10,
        cost_micro_usd: Some(cost),
        ..Entry::default()
    }
}

fn spend(url: &str, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["spend", "--ledger", url])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn spend_sums_the_ledger_by_group_and_day() {
    let pg = PgServer::start();
    let ledger = Ledger::open(Settings::new(pg.url())).await.unwrap();
    ledger.spawn_writer(None);
    for e in [
        entry("a1", "acme", "gpt-4o", T0 + 10, 100, 1_500_000),
        entry("a2", "acme", "gpt-4o-mini", T0 + 20, 50, 250),
        entry("b1", "beta,inc", "gpt-4o", T0 + 30, 7, 40),
        // The next day: outside the first range.
        entry("a3", "acme", "gpt-4o", T0 + 86_400_000 + 5, 1, 1),
    ] {
        ledger.append(e);
    }
    assert!(ledger.flush(Duration::from_secs(10)).await);
    let url = pg.url();

    let csv = spend(
        &url,
        &[
            "--by",
            "tenant",
            "--from",
            "2026-01-01",
            "--to",
            "2026-01-02",
            "--format",
            "csv",
        ],
    );
    assert_eq!(
        csv,
        "group,requests,input_tokens,output_tokens,tool_calls,cost_usd\n\
         acme,2,150,20,0,1.500250\n\
         \"beta,inc\",1,7,10,0,0.000040\n"
    );
    let json: serde_json::Value = serde_json::from_str(&spend(
        &url,
        &[
            "--by",
            "day",
            "--from",
            "2026-01-01",
            "--to",
            "2026-01-03",
            "--format",
            "json",
        ],
    ))
    .unwrap();
    let days: Vec<(&str, i64)> = json
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["group"].as_str().unwrap(),
                r["requests"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(days, vec![("2026-01-01", 3), ("2026-01-02", 1)]);
    let table = spend(
        &url,
        &[
            "--by",
            "model",
            "--from",
            "2026-01-01",
            "--to",
            "2026-01-02",
        ],
    );
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(
        lines[1].starts_with("gpt-4o ") && lines[1].ends_with("1.500040"),
        "{table}"
    );
    assert!(
        lines[2].starts_with("gpt-4o-mini") && lines[2].ends_with("0.000250"),
        "{table}"
    );
}
