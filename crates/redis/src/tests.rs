use super::*;
use crate::decode::{decision, finish_reply};
use crate::encode::{admit_shadowed_invocation, finish_invocation, num};
use crate::shards::Admission;
use redis::Value;
use std::sync::Arc;
use tollgate_core::{
    Decision, Dimension, Identity, Policy, Reason, RequestFacts, StoreError, plan,
};

/// Request `req-1` of user alice of tenant acme: 40 tokens in, at most 60 out, on gpt-4o.
fn alice() -> RequestFacts {
    RequestFacts {
        request_id: "req-1".into(),
        identity: Identity::default()
            .with(Dimension::User, "alice")
            .with(Dimension::Tenant, "acme")
            .with(Dimension::Model, "gpt-4o"),
        input_tokens: 40,
        max_output_tokens: Some(60),
        ..RequestFacts::default()
    }
}

/// The exact KEYS and ARGV of a typical admission (one scope with every control), alone in a
/// batch call and then next to a settlement.
#[test]
fn admit_sends_exactly_these_arguments() {
    let policy = Policy::from_toml(
        r#"
        expired_reservation_charge = "input"
        [prices."gpt-4o"]
        input = 2500000
        output = 10000000
        [[scopes]]
        key = "user"
        requests = { limit = 5, window = "1m" }
        input_tokens = 100
        concurrency = { limit = 2, lease_ttl = "30s" }
        budget = { tokens = 300, period = "day" }
        [[scopes]]
        key = "tenant"
        budget = { micro_usd = 5000000, period = "month" }
        "#,
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let facts = alice();
    let p = plan(&policy, &facts).unwrap_or_else(|e| unreachable!("{e}"));
    let item = admit_invocation("tg", &p, 3_600_000, 0);
    let inv = batch_invocation("tg", 0, 3_600_000, true, [("a", &item)]);
    assert_eq!(
        inv.keys,
        [
            "tg:x",
            "tg:clock",
            "tg:kill",
            "tg:marker",
            "tg:lost",
            "tg:seq",
            "tg:ts:req-1",
            "tg:r:user|tenant:acme/user:alice",
            "tg:l:user|tenant:acme/user:alice",
            "tg:b:user|tenant:acme/user:alice",
            "tg:b:tenant|tenant:acme"
        ]
    );
    assert_eq!(
        inv.args,
        [
            "tg",
            "0",
            "3600000",
            // The marker has been seen.
            "1",
            "a",
            "40",
            "req-1",
            "30000",
            "3600000",
            // Four checks.
            "4",
            "2500000",
            "2500000",
            "10000000",
            "40",
            "0",
            "0",
            // Its size: 40 input and 60 output tokens.
            "100",
            "5",
            "all",
            "tenant:acme",
            "model:gpt-4o",
            "user:alice",
            "provider:gpt-4o",
            // Each check: its kind, then its kind's layout.
            "r",
            "tg:r:user|tenant:acme/user:alice",
            "5",
            "60000",
            "l",
            "tg:l:user|tenant:acme/user:alice",
            "2",
            "b",
            "tg:b:user|tenant:acme/user:alice",
            "300",
            "t",
            "86400000",
            "fixed:86400000",
            "100",
            // Nothing carried over, in either budget.
            "0",
            "b",
            // 40 x 2.5 + 60 x 10 = 700 micro-USD.
            "tg:b:tenant|tenant:acme",
            "5000000",
            "m",
            "0",
            "month",
            "700",
            "0",
        ]
    );
    // A settlement's usage: input, cached input, output, then the prompt-cache writes for five
    // minutes and for one hour.
    let usage = tollgate_core::Usage {
        input_tokens: 40,
        cached_input_tokens: 0,
        output_tokens: 25,
        cache_write_tokens: 7,
        cache_write_1h_tokens: 3,
        tool_calls: 2,
        fees: 0,
    };
    let settle = finish_invocation("tg", "req-0", 3_600_000, Some(usage), "settled");
    let both = batch_invocation("tg", 0, 3_600_000, true, [("f", &settle), ("a", &item)]);
    assert_eq!(both.keys.to_vec()[6..7], ["tg:ts:req-0"]);
    assert_eq!(both.keys.to_vec()[7..], inv.keys.to_vec()[6..]);
    assert_eq!(
        both.args.to_vec()[4..17],
        [
            "f", "11", "req-0", "3600000", "settled", "1", "40", "0", "25", "7", "3", "2", "0"
        ]
    );
    assert_eq!(both.args.to_vec()[17..], inv.args.to_vec()[4..]);
}

/// An admission with its shadow plan: the request's argument count, its arguments exactly as
/// alone, then the shadow plan's header and scopes; its keys after the request's.
#[test]
fn a_shadowed_admission_carries_the_request_then_its_shadow() {
    let policy = Policy::from_toml(
        r#"
        [[scopes]]
        key = "user"
        requests = { limit = 5, window = "1m" }
        concurrency = { limit = 2, lease_ttl = "30s" }
        budget = { tokens = 300, period = "day" }
        tool_calls = { limit = 9, period = "day" }
        loops = { max_identical = 3, window = "1m" }
        [[scopes]]
        name = "trial"
        key = "user"
        mode = "shadow"
        requests = { limit = 1, window = "1s" }
        budget = { tokens = 50, period = "day" }
        "#,
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let facts = RequestFacts {
        fingerprint: Some(7),
        ..alice()
    };
    let (p, shadow) = tollgate_core::plans(&policy, &facts).unwrap_or_else(|e| unreachable!("{e}"));
    let shadow = shadow
        .unwrap_or_else(|e| unreachable!("{e}"))
        .unwrap_or_else(|| unreachable!("a shadow rule applies"));
    assert!(p.counts().any(|(_, r, _)| r == Reason::LoopDetected) && p.kill_targets.len() == 5);
    let alone = admit_invocation("tg", &p, 3_600_000, 0);
    let both = admit_shadowed_invocation("tg", &p, &shadow, 3_600_000, 0);
    let n = alone.args.len();
    assert_eq!(both.args.get(0), Some(num(n).as_str()));
    assert_eq!(both.args.to_vec()[1..=n], alone.args.to_vec()[..]);
    assert_eq!(
        both.args.to_vec()[n + 1..],
        [
            // Two checks: a count, then a reservation, each its kind first.
            "2",
            "r",
            "tg:r:trial|tenant:acme/user:alice",
            "1",
            "1000",
            "b",
            "tg:b:trial|tenant:acme/user:alice",
            "50",
            "t",
            "86400000",
            "fixed:86400000",
            "100",
            // Nothing carried over.
            "0",
        ]
    );
    assert_eq!(
        both.keys.to_vec()[..alone.keys.len()],
        alone.keys.to_vec()[..]
    );
    assert_eq!(
        both.keys.to_vec()[alone.keys.len()..],
        [
            "tg:r:trial|tenant:acme/user:alice",
            "tg:b:trial|tenant:acme/user:alice"
        ]
    );
}

/// A sharded store forgets remembered admissions long past their expiry once it holds many:
/// memory stays bounded when callers never settle (settling a forgotten one asks every shard).
#[tokio::test]
async fn remembered_admissions_are_pruned() {
    let mut cfg = RedisConfig::new("redis://127.0.0.1:1/");
    cfg.shards = 4;
    cfg.retention_ms = 1_000;
    let clock = tollgate_core::ManualClock::new(1_000_000);
    let store = RedisStore::connect(cfg)
        .await
        .unwrap_or_else(|e| unreachable!("{e}"))
        .with_clock(Arc::new(clock.clone()));
    let admission = |expires_at| Admission {
        expires_at,
        parts: vec![(0, vec![0])],
    };
    for i in 0..5_000 {
        store.remember(&format!("old{i}"), admission(1_000_000));
    }
    clock.advance(10_000);
    for i in 0..5_000 {
        store.remember(&format!("new{i}"), admission(1_020_000));
    }
    let m = store
        .admissions
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    assert!(
        m.map.keys().all(|k| k.starts_with("new")),
        "old ones pruned"
    );
    assert_eq!(m.map.len(), 5_000);
}

/// The files of the ledger, in the order the build script assembles them.
const LEDGER_SOURCES: [&str; 6] = [
    include_str!("lua/common.lua"),
    include_str!("lua/seq.lua"),
    include_str!("lua/controls/rate.lua"),
    include_str!("lua/controls/concurrency.lua"),
    include_str!("lua/controls/budget.lua"),
    include_str!("lua/ledger.lua"),
];

/// The reply kinds and reason codes the scripts write are exactly those the Rust side names, and
/// the decoder reads each kind it names.
#[test]
fn script_replies_are_the_named_ones() {
    let sources = [
        LEDGER_SOURCES.concat().leak() as &str,
        include_str!("lua/slices.lua"),
        include_str!("lua/batch.lua"),
        include_str!("lua/renew.lua"),
        include_str!("lua/usage.lua"),
        include_str!("lua/sweep.lua"),
        include_str!("lua/keys.lua"),
        include_str!("lua/records.lua"),
    ];
    let mut kinds = std::collections::BTreeSet::new();
    for line in sources.iter().flat_map(|s| s.lines()) {
        let code = line.split("--").next().unwrap_or("");
        // A refusal is made by `deny(reason, ...)`, in the contract's `deny` layout.
        if code.contains("local function deny(") {
            kinds.insert("deny".to_owned());
        }
        // A reply with named fields is made by setting its `kind` field first.
        if code.contains(".kind + 1]") {
            if let Some((_, value)) = code.split_once(" = '") {
                kinds.insert(value.split('\'').next().unwrap_or("").to_owned());
            }
        }
        for (i, _) in code.match_indices("{'") {
            let rest = &code[i + 2..];
            let Some(end) = rest.find('\'') else { continue };
            kinds.insert(rest[..end].to_owned());
        }
    }
    let named: std::collections::BTreeSet<String> = ADMIT_REPLIES
        .iter()
        .chain(&FINISH_REPLIES)
        .chain(&RENEW_REPLIES)
        .chain(&OTHER_REPLIES)
        .chain(&crate::SHADOW_REPLIES)
        .chain(&crate::KEY_REPLIES)
        .chain(&crate::RECORD_REPLIES)
        .chain(&crate::SLICE_REPLIES)
        .chain(&crate::SLICE_TICKETS)
        .map(|k| (*k).to_owned())
        .collect();
    assert_eq!(kinds, named);
    // The scripts know the checks' kinds, never the controls: no reason is named in them.
    for reason in tollgate_core::Reason::ALL {
        for line in sources.iter().flat_map(|s| s.lines()) {
            let code = line.split("--").next().unwrap_or("");
            assert!(
                !code.contains(reason.code()),
                "a script names {reason}: {line}"
            );
        }
    }

    // Each named kind is read: none is "unknown" to the decoder.
    let plan = tollgate_core::plan(
        &tollgate_core::Policy::from_toml(
            "[[scopes]]\nkey = \"user\"\nrequests = { limit = 1, window = \"1m\" }\n\
             concurrency = { limit = 1 }\nbudget = { tokens = 10, period = \"day\" }\n\
             tool_calls = { limit = 5, period = \"1h\" }\n\
             loops = { max_identical = 2, window = \"1m\" }\n",
        )
        .unwrap(),
        &tollgate_core::RequestFacts {
            request_id: "r".into(),
            identity: tollgate_core::Identity::default().with(tollgate_core::Dimension::User, "u"),
            input_tokens: 1,
            max_output_tokens: Some(1),
            fingerprint: Some(1),
            ..RequestFacts::default()
        },
    )
    .unwrap();
    let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
    for kind in ADMIT_REPLIES {
        let mut reply = vec![bulk(kind)];
        match kind {
            "deny" => reply.push(Value::Int(0)),
            "killed" => reply.extend([bulk("all"), bulk("why")]),
            _ => {}
        }
        reply.extend((0..8).map(|_| Value::Int(1)));
        if let Err(StoreError::Protocol(e)) = decision(&plan, reply) {
            assert!(!e.contains("unknown"), "{kind}: {e}");
        }
    }
    // A refusal names its check by its place, and the decision carries that check's reason; a
    // place the plan does not have is the scripts' fault, never a refusal.
    for (i, check) in plan.checks.iter().enumerate() {
        let mut reply = vec![bulk("deny"), Value::Int(i as i64)];
        reply.extend((0..3).map(|_| Value::Int(1)));
        match decision(&plan, reply) {
            Ok(Decision::Deny(d)) => assert_eq!(d.reason, check.reason),
            other => panic!("{check:?}: {other:?}"),
        }
    }
    for place in [plan.checks.len() as i64, -1] {
        let mut reply = vec![bulk("deny"), Value::Int(place)];
        reply.extend((0..3).map(|_| Value::Int(1)));
        assert!(matches!(
            decision(&plan, reply),
            Err(StoreError::Protocol(_))
        ));
    }
    for kind in FINISH_REPLIES {
        let reply = vec![bulk(kind), bulk("settled")];
        if let Err(StoreError::Protocol(e)) = finish_reply(reply) {
            assert!(!e.contains("unknown"), "{kind}: {e}");
        }
    }
}

/// The schema the scripts write as the marker is the one the Rust side checks: the build wrote
/// it into the library, and no script keeps a schema of its own.
#[test]
fn the_scripts_write_the_schema_the_store_checks() {
    let library = include_str!(concat!(env!("OUT_DIR"), "/library.lua"));
    assert!(
        library.contains(&format!("local SCHEMA = '{}'\n", crate::SCHEMA)),
        "the library's SCHEMA is not {}",
        crate::SCHEMA
    );
    assert_eq!(library.matches("local SCHEMA =").count(), 1);
    assert!(!library.contains("@schema"));
}

/// Every field of the argument contract is read by the scripts under its name: the table has
/// no field the Lua side ignores (a field the Lua names and the table lacks fails the build).
#[test]
fn every_contract_field_is_read_by_name() {
    let sources = [
        LEDGER_SOURCES.concat(),
        include_str!("lua/batch.lua").to_owned(),
        include_str!("lua/renew.lua").to_owned(),
        include_str!("lua/slices.lua").to_owned(),
    ]
    .concat();
    for (layout, fields) in crate::contract::LAYOUTS {
        for field in *fields {
            let name = format!("@{layout}.{field}");
            assert!(sources.contains(&name), "{name} is not read by the scripts");
        }
    }
}
