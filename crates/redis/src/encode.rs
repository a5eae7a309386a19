//! Wire encoding: a plan, a settlement or a release as the KEYS and ARGV of one item of a
//! batch call, in the layout `common_v7.lua` reads.

use tollgate_core::pipeline::Plan;
use tollgate_core::policy::Unit;
use tollgate_core::{Period, Usage};

/// The keys and arguments of one script call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// KEYS.
    pub keys: Vec<String>,
    /// ARGV.
    pub args: Vec<String>,
}

pub(crate) fn usage_args(u: &Usage) -> [String; 3] {
    [
        num(u.input_tokens),
        num(u.cached_input_tokens),
        num(u.output_tokens),
    ]
}

pub(crate) fn period_arg(p: Period) -> (u64, String) {
    match p {
        Period::Fixed(len) => (len, p.label()),
        Period::CalendarMonth => (0, p.label()),
    }
}

/// A number as an argument, written by `itoa`: an admission has some twenty, and the formatting
/// machinery of `to_string` costs several times as much per number.
pub(crate) fn num(n: impl itoa::Integer) -> String {
    itoa::Buffer::new().format(n).to_owned()
}

/// `{prefix}:{kind}:{id}`, made in one allocation of the right size: every per-request and
/// per-scope key (`docs/redis.md` lists the kinds) is made here.
pub(crate) fn key(prefix: &str, kind: &str, id: &str) -> String {
    let mut k = String::with_capacity(prefix.len() + kind.len() + id.len() + 2);
    k.push_str(prefix);
    k.push(':');
    k.push_str(kind);
    k.push(':');
    k.push_str(id);
    k
}

/// The exact KEYS and ARGV of an admission, as one item of a batch call.
pub fn admit_invocation(prefix: &str, plan: &Plan, retention_ms: u64) -> Invocation {
    let mut keys = Vec::with_capacity(
        1 + plan.rate.len() + plan.repeats.len() + plan.concurrency.len() + plan.budget.len(),
    );
    keys.push(key(prefix, "ts", &plan.request_id));
    let price = plan
        .price
        .map_or([0, 0, 0], |p| [p.input, p.cached_input, p.output]);
    let mut args = Vec::with_capacity(
        16 + plan.kill_targets.len()
            + 3 * (plan.rate.len() + plan.repeats.len())
            + 2 * plan.concurrency.len()
            + 6 * plan.budget.len(),
    );
    args.extend([
        plan.request_id.clone(),
        num(plan.ttl_ms),
        num(retention_ms),
        flag(plan.token_verdict.is_some()),
        num(plan.rate.len()),
        num(plan.concurrency.len()),
        num(plan.budget.len()),
    ]);
    args.extend(price.map(num));
    args.extend(usage_args(&plan.expired_usage));
    args.push(num(plan.kill_targets.len()));
    args.push(num(plan.repeats.len()));
    args.push(flag(plan.loop_verdict.is_some()));
    args.extend(plan.kill_targets.iter().map(str::to_owned));
    scope_args(prefix, plan, &mut keys, &mut args);
    Invocation { keys, args }
}

fn flag(on: bool) -> String {
    if on { "1" } else { "0" }.to_owned()
}

/// A plan's scopes, each with its limits, in the layout `admit_one` reads after the header.
fn scope_args(prefix: &str, plan: &Plan, keys: &mut Vec<String>, args: &mut Vec<String>) {
    for r in plan.rate.iter().chain(&plan.repeats) {
        let k = key(prefix, "r", r.scope.id());
        keys.push(k.clone());
        args.extend([k, num(r.limit), num(r.window_ms)]);
    }
    for c in &plan.concurrency {
        let k = key(prefix, "l", c.scope.id());
        keys.push(k.clone());
        args.extend([k, num(c.limit)]);
    }
    for b in &plan.budget {
        let k = key(prefix, "b", b.scope.id());
        keys.push(k.clone());
        let (len, label) = period_arg(b.period);
        let unit = match b.unit {
            Unit::Tokens => "t".to_owned(),
            Unit::MicroUsd => "m".to_owned(),
            // With what the round is charged when it ends without an answer.
            Unit::ToolCalls => format!("c{}", plan.expired_usage.tool_calls),
        };
        args.extend([k, num(b.limit), unit, num(len), label, num(b.amount)]);
    }
}

/// The KEYS and ARGV of a settlement or release, as one item of a batch call.
pub(crate) fn finish_invocation(
    prefix: &str,
    id: &str,
    retention_ms: u64,
    usage: Option<Usage>,
    ending: &str,
) -> Invocation {
    let mut args = vec![
        id.to_owned(),
        num(retention_ms),
        ending.to_owned(),
        if usage.is_some() { "1" } else { "0" }.to_owned(),
    ];
    // Bounded before it is written: the script computes in doubles, and a number past 2^63
    // would be formatted negative there.
    let u = usage.unwrap_or_default().bounded();
    args.extend(usage_args(&u));
    args.extend([
        num(u.cache_write_tokens),
        num(u.cache_write_1h_tokens),
        num(u.tool_calls),
    ]);
    Invocation {
        keys: vec![key(prefix, "ts", id)],
        args,
    }
}

/// The KEYS and ARGV of an admission with its shadow plan (`admit_shadowed`): the number of the
/// request's arguments, the request's, then the shadow plan's header (its verdicts and counts:
/// its holds go into the request's ticket) and scopes.
pub(crate) fn admit_shadowed_invocation(
    prefix: &str,
    plan: &Plan,
    shadow: &Plan,
    retention_ms: u64,
) -> Invocation {
    let Invocation { mut keys, args } = admit_invocation(prefix, plan, retention_ms);
    let s = shadow;
    let mut all = Vec::with_capacity(
        7 + args.len()
            + 3 * (s.rate.len() + s.repeats.len())
            + 2 * s.concurrency.len()
            + 6 * s.budget.len(),
    );
    all.push(num(args.len()));
    all.extend(args);
    all.extend([
        flag(s.token_verdict.is_some()),
        num(s.rate.len()),
        num(s.concurrency.len()),
        num(s.budget.len()),
        num(s.repeats.len()),
        flag(s.loop_verdict.is_some()),
    ]);
    scope_args(prefix, s, &mut keys, &mut all);
    Invocation { keys, args: all }
}
