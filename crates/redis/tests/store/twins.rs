//! Each stateful control's Lua file against its Rust twin (`tollgate_core::controls`): both
//! run on the same generated cases, the Lua inside a real Redis, and must agree on every
//! verdict, every number they report and the state they leave.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tollgate_core::controls::{budget, concurrency, rate};
use tollgate_core::ledger::{Calendar, RateWindow};
use tollgate_core::policy::{AlertAt, Unit};
use tollgate_core::scope::ScopeKey;
use tollgate_core::{Dimension, Identity, Period};
use tollgate_testkit::redis_server::RedisServer;

const RATE: &str = include_str!("../../src/lua/controls/rate.lua");
const CONCURRENCY: &str = include_str!("../../src/lua/controls/concurrency.lua");
const BUDGET: &str = include_str!("../../src/lua/controls/budget.lua");

/// Generated batches per control; each batch is one script call with its cases.
const BATCHES: u32 = 24;

/// Runs `control`'s file followed by `harness` on `args`; the harness returns a flat list of
/// integers, formatted with `%d` so that nothing is lost to a conversion on the way back.
fn eval(server: &RedisServer, control: &str, harness: &str, args: &[String]) -> Vec<i64> {
    let script = format!("{control}\n{harness}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let out: Vec<String> = redis::cmd("EVAL")
            .arg(&script)
            .arg(0)
            .arg(args)
            .query_async(&mut conn)
            .await
            .unwrap();
        out.iter().map(|s| s.parse().unwrap()).collect()
    })
}

fn key() -> ScopeKey {
    ScopeKey::derive(
        "twin",
        &[Dimension::User],
        &Identity::default().with(Dimension::User, "u"),
    )
    .unwrap()
}

fn run<S: Strategy>(strategy: S, check: impl Fn(S::Value)) {
    let mut runner = TestRunner::new(Config {
        cases: BATCHES,
        ..Config::default()
    });
    runner
        .run(&strategy, |v| {
            check(v);
            Ok(())
        })
        .unwrap();
}

/// A window's state before an attempt: its start some whole windows before now's (or none),
/// its counts, now, the window's length and the limit.
fn rate_case() -> impl Strategy<Value = (u64, u64, u64, u64, u64, u64)> {
    (
        prop_oneof![
            Just(1_000u64),
            Just(60_000),
            Just(3_600_000),
            1u64..10_000_000
        ],
        0u64..4_000_000_000_000,
        prop_oneof![Just(0u64), Just(1), Just(2), 3u64..10],
        0u64..3_000,
        0u64..3_000,
        1u64..2_000,
    )
        .prop_map(|(window, now, back, current, previous, limit)| {
            let aligned = now - now % window;
            let start = aligned.saturating_sub(back * window);
            (start, current, previous, now, window, limit)
        })
}

/// The scripts' arguments of rate cases, six numbers each.
fn rate_args(cases: &[(u64, u64, u64, u64, u64, u64)]) -> Vec<String> {
    cases
        .iter()
        .flat_map(|&(s, c, p, now, win, lim)| [s, c, p, now, win, lim])
        .map(|n| n.to_string())
        .collect()
}

/// A rate case's check and window, as Rust holds them.
fn rate_window(
    (start, current, previous, _, window_ms, limit): (u64, u64, u64, u64, u64, u64),
) -> (rate::RateCheck, (u64, RateWindow)) {
    let check = rate::RateCheck {
        scope: key(),
        limit,
        window_ms,
    };
    let w = RateWindow {
        start,
        current,
        previous,
    };
    (check, (window_ms, w))
}

#[test]
fn rate_lua_counts_as_rust_does() {
    let server = RedisServer::start();
    let harness = r"
        local out = {}
        for i = 1, #ARGV, 6 do
          local w = {tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])}
          local now, window, limit = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
          local over, left, reset, retry = rate_count(w, now, window, limit)
          for _, x in ipairs({over and 1 or 0, left, reset, retry, w[1], w[2], w[3]}) do
            out[#out + 1] = string.format('%d', x)
          end
        end
        return out";
    run(prop::collection::vec(rate_case(), 64), |cases| {
        let lua = eval(&server, RATE, harness, &rate_args(&cases));
        for (i, &case) in cases.iter().enumerate() {
            let (check, mut w) = rate_window(case);
            let c = rate::count(&mut w, &check, case.3);
            let rust = [
                i64::from(c.over),
                c.remaining as i64,
                c.reset_after_ms as i64,
                c.retry_after_ms as i64,
                w.1.start as i64,
                w.1.current as i64,
                w.1.previous as i64,
            ];
            assert_eq!(lua[i * 7..i * 7 + 7], rust, "case {:?}", cases[i]);
        }
    });
}

/// A read of a window (`/v1/limits`): the same attempts left and reset as Rust's, and the
/// window unchanged on both sides.
#[test]
fn rate_lua_peeks_as_rust_does() {
    let server = RedisServer::start();
    let harness = r"
        local out = {}
        for i = 1, #ARGV, 6 do
          local w = {tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])}
          local now, window, limit = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
          local left, reset = rate_peek(w, now, window, limit)
          for _, x in ipairs({left, reset, w[1], w[2], w[3]}) do
            out[#out + 1] = string.format('%d', x)
          end
        end
        return out";
    run(prop::collection::vec(rate_case(), 64), |cases| {
        let lua = eval(&server, RATE, harness, &rate_args(&cases));
        for (i, &case) in cases.iter().enumerate() {
            let (check, w) = rate_window(case);
            let c = rate::peek(&w, &check, case.3);
            assert!(!c.over);
            let rust = [
                c.remaining as i64,
                c.reset_after_ms as i64,
                w.1.start as i64,
                w.1.current as i64,
                w.1.previous as i64,
            ];
            assert_eq!(lua[i * 5..i * 5 + 5], rust, "case {:?}", cases[i]);
        }
    });
}

#[test]
fn concurrency_lua_decides_as_rust_does() {
    let server = RedisServer::start();
    let harness = r"
        local out = {}
        for i = 1, #ARGV, 4 do
          local soonest = nil
          if ARGV[i + 2] ~= '' then soonest = tonumber(ARGV[i + 2]) end
          local left, wait = lease_verdict(tonumber(ARGV[i]), tonumber(ARGV[i + 1]), soonest, tonumber(ARGV[i + 3]))
          if left == nil then
            out[#out + 1], out[#out + 2] = '0', string.format('%d', wait)
          else
            out[#out + 1], out[#out + 2] = '1', string.format('%d', left)
          end
        end
        return out";
    let case = (
        0u64..40,
        1u64..40,
        prop::option::of(0u64..4_000),
        0u64..4_000,
    );
    run(prop::collection::vec(case, 64), |cases| {
        let args: Vec<String> = cases
            .iter()
            .flat_map(|&(held, limit, soonest, now)| {
                [
                    held.to_string(),
                    limit.to_string(),
                    soonest.map_or(String::new(), |s| s.to_string()),
                    now.to_string(),
                ]
            })
            .collect();
        let lua = eval(&server, CONCURRENCY, harness, &args);
        for (i, &(held, limit, soonest, now)) in cases.iter().enumerate() {
            let check = concurrency::ConcurrencyCheck {
                scope: key(),
                limit,
                kept_percent: 0,
            };
            let rust = match concurrency::check(concurrency::REASON, &check, held, soonest, now) {
                Ok(left) => [1, left as i64],
                Err(d) => [0, d.retry_after_ms.unwrap() as i64],
            };
            assert_eq!(lua[i * 2..i * 2 + 2], rust, "case {:?}", cases[i]);
        }
    });
}

#[test]
fn budget_lua_finds_periods_and_decides_as_rust_does() {
    let server = RedisServer::start();
    let harness = r"
        local out = {}
        for i = 1, #ARGV, 5 do
          local len, now = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
          local committed, amount, limit = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
          local id, start, stop = period_of(len, now)
          local fits, left, retry = budget_verdict(committed, amount, limit, stop, now)
          for _, x in ipairs({id, start, stop, fits and 1 or 0, left, retry or 0}) do
            out[#out + 1] = string.format('%d', x)
          end
        end
        return out";
    // Amounts and committed amounts at and around the limit as well as anywhere.
    let case = (
        prop_oneof![
            Just(0u64),
            Just(3_600_000),
            Just(86_400_000),
            1u64..1_000_000_000
        ],
        0u64..4_000_000_000_000,
        1u64..1_000_000_000_000,
        (0u64..4, 0u64..1_000_000_000_000),
        (0u64..4, 0u64..1_000_000_000),
    )
        .prop_map(|(len, now, limit, (cs, c), (a_s, a))| {
            let near = |sel: u64, any: u64| match sel {
                0 => limit,
                1 => limit + 1,
                2 => limit - 1,
                _ => any,
            };
            let amount = near(a_s, a);
            let committed = match cs {
                0 => limit.saturating_sub(amount),
                1 => limit.saturating_sub(amount) + 1,
                _ => c,
            };
            (len, now, committed, amount, limit)
        });
    run(prop::collection::vec(case, 64), |cases| {
        let args: Vec<String> = cases
            .iter()
            .flat_map(|&(len, now, committed, amount, limit)| [len, now, committed, amount, limit])
            .map(|n| n.to_string())
            .collect();
        let lua = eval(&server, BUDGET, harness, &args);
        for (i, &(len, now, committed, amount, limit)) in cases.iter().enumerate() {
            let period = if len == 0 {
                Period::CalendarMonth
            } else {
                Period::Fixed(len)
            };
            let (id, start, end) = period.at(now);
            let check = budget::BudgetCheck {
                scope: key(),
                limit,
                unit: Unit::Tokens,
                period,
                amount,
                alert_at: AlertAt::default(),
                carry_cap: 0,
            };
            let verdict = match budget::check(
                tollgate_core::Reason::BudgetLimit,
                0,
                &check,
                committed,
                (start, end),
                now,
            ) {
                Ok(q) => [1, q.remaining as i64, 0],
                Err(d) => [
                    0,
                    d.remaining as i64,
                    d.retry_after_ms.map_or(-1, |r| r as i64),
                ],
            };
            let rust = [
                id as i64,
                start as i64,
                end as i64,
                verdict[0],
                verdict[1],
                verdict[2],
            ];
            assert_eq!(lua[i * 6..i * 6 + 6], rust, "case {:?}", cases[i]);
        }
    });
}

/// A calendar period in a zone: the script, given the starts around the caller's instant,
/// finds the same period as Rust does at the store's instant, a clock up to six hours away from
/// the caller's (days, weeks, months, fiscal quarters and years, in zones with and without
/// daylight-saving time, across their changes).
#[test]
fn budget_lua_finds_calendar_periods_as_rust_does() {
    let server = RedisServer::start();
    let harness = r"
        local out = {}
        for i = 1, #ARGV, 2 do
          local id, start, stop = period_of(ARGV[i], tonumber(ARGV[i + 1]))
          for _, x in ipairs({id, start, stop}) do out[#out + 1] = string.format('%d', x) end
        end
        return out";
    let spec = (
        prop::sample::select(vec!["day", "week", "month", "quarter", "year"]),
        prop::sample::select(vec![
            "UTC",
            "Europe/Berlin",
            "America/New_York",
            "Australia/Lord_Howe",
            "Asia/Kolkata",
        ]),
        (1u8..=28, 0u16..1440, 0usize..12, 0usize..7),
    )
        .prop_map(|(every, zone, (day, minute, month, weekday))| {
            let time = format!("{:02}:{:02}", minute / 60, minute % 60);
            let months = [
                "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
            ];
            let days = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
            let starts = match every {
                "day" => time,
                "week" => format!("{} {time}", days[weekday]),
                "month" => format!("{day} {time}"),
                _ => format!("{} {day} {time}", months[month]),
            };
            Calendar::parse(every, Some(zone), Some(&starts)).unwrap_or_else(|e| panic!("{e}"))
        });
    // 2001 to 2060, and a store clock up to six hours either way.
    let case = (
        spec,
        978_307_200_000u64..2_871_763_200_000,
        -21_600_000i64..21_600_000,
    );
    run(prop::collection::vec(case, 32), |cases| {
        let args: Vec<String> = cases
            .iter()
            .flat_map(|(c, caller, skew)| {
                let store = caller.saturating_add_signed(*skew);
                [Period::Calendar(*c).script_arg(*caller), store.to_string()]
            })
            .collect();
        let lua = eval(&server, BUDGET, harness, &args);
        for (i, (c, caller, skew)) in cases.iter().enumerate() {
            let (id, start, end) = Period::Calendar(*c).at(caller.saturating_add_signed(*skew));
            let rust = [id, start, end].map(|n| n as i64);
            assert_eq!(
                lua[i * 3..i * 3 + 3],
                rust,
                "{} at {caller} {skew:+}",
                c.label()
            );
        }
    });
}

/// What a period carries over: the script's `carried` and Rust's agree, at the cap, at nothing
/// left and anywhere between.
#[test]
fn budget_lua_carries_over_as_rust_does() {
    let server = RedisServer::start();
    let harness = r"
        local out = {}
        for i = 1, #ARGV, 4 do
          local n = {}
          for j = 0, 3 do n[j] = tonumber(ARGV[i + j]) end
          out[#out + 1] = string.format('%d', carried(n[0], n[1], n[2], n[3]))
        end
        return out";
    let case = (
        prop_oneof![Just(0u64), 1u64..1_000_000_000_000],
        1u64..1_000_000_000_000,
        0u64..1_000_000_000_000,
        prop_oneof![Just(0u64), 0u64..3_000_000_000_000],
    );
    run(prop::collection::vec(case, 64), |cases| {
        let args: Vec<String> = cases
            .iter()
            .flat_map(|&(cap, limit, carry, committed)| [cap, limit, carry, committed])
            .map(|n| n.to_string())
            .collect();
        let lua = eval(&server, BUDGET, harness, &args);
        for (i, &(cap, limit, carry, committed)) in cases.iter().enumerate() {
            let rust = budget::carried(cap, limit, Some((carry, committed)));
            assert_eq!(lua[i], rust as i64, "{:?}", cases[i]);
        }
    });
}
