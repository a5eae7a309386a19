//! Wire encoding: a plan, a settlement or a release as the KEYS and ARGV of one item of a
//! batch call, in the layouts of [`crate::contract`], which the scripts read by the same names.

use tollgate_core::pipeline::{BudgetCheck, ConcurrencyCheck, Kind, Plan, RateCheck};
use tollgate_core::policy::Unit;
use tollgate_core::{Period, Usage};

pub use crate::strs::Strs;

use crate::contract::{
    Admit, BudgetScope, Check as CheckLayout, Finish, LeaseScope, RateScope, Shadow,
};

/// The keys and arguments of one script call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Invocation {
    /// KEYS.
    pub keys: Strs,
    /// ARGV.
    pub args: Strs,
}

impl Invocation {
    /// These keys and arguments (for the calls made now and then; an admission's and a
    /// settlement's are pushed one by one).
    pub fn of(keys: &[&str], args: &[&str]) -> Self {
        Self {
            keys: keys.iter().copied().collect(),
            args: args.iter().copied().collect(),
        }
    }
}

/// A period as the scripts take it at `now` (see [`Period::script_arg`]), and its label.
pub(crate) fn period_arg(p: Period, now: u64) -> (String, String) {
    (p.script_arg(now), p.label())
}

/// A number as an argument, written by `itoa`: the formatting machinery of `to_string` costs
/// several times as much per number.
pub(crate) fn num(n: impl itoa::Integer) -> String {
    itoa::Buffer::new().format(n).to_owned()
}

pub(crate) use crate::strs::key;

fn strs(items: usize) -> Strs {
    Strs::with_capacity(items)
}

/// The exact KEYS and ARGV of an admission, as one item of a batch call; `now` is the
/// caller's instant (ms), near which calendar periods' starts are given.
pub fn admit_invocation(prefix: &str, plan: &Plan, retention_ms: u64, now: u64) -> Invocation {
    let mut keys = strs(key_count(plan));
    let mut args = strs(admit_arg_count(plan));
    admit_args(prefix, plan, (retention_ms, now), &mut keys, &mut args);
    Invocation { keys, args }
}

/// How many keys a plan's admission names: its ticket's and one per scope.
fn key_count(plan: &Plan) -> usize {
    1 + scope_count(plan)
}

fn scope_count(plan: &Plan) -> usize {
    plan.scopes().count()
}

/// How many arguments [`admit_args`] pushes for `plan`: the header, the kill targets, then
/// each check's.
fn admit_arg_count(plan: &Plan) -> usize {
    Admit::LEN + plan.kill_targets.len() + check_arg_count(plan)
}

fn check_arg_count(plan: &Plan) -> usize {
    plan.checks
        .iter()
        .map(|c| {
            CheckLayout::LEN
                + match c.kind {
                    Kind::Count(_) | Kind::Peek(_) => RateScope::LEN,
                    Kind::Lease(_) => LeaseScope::LEN,
                    Kind::Reserve(_) => BudgetScope::LEN,
                    Kind::Verdict(_) => 0,
                }
        })
        .sum()
}

/// Pushes an admission's keys and arguments: the header by name, in the contract's order, then
/// the kill targets and the checks.
fn admit_args(
    prefix: &str,
    plan: &Plan,
    (retention_ms, now): (u64, u64),
    keys: &mut Strs,
    args: &mut Strs,
) {
    keys.push_key(prefix, "ts", &plan.request_id);
    let (price_in, price_cached, price_out) = plan
        .price
        .map_or((0, 0, 0), |p| (p.input, p.cached_input, p.output));
    let expired = &plan.expired_usage;
    for field in Admit::ALL {
        match field {
            Admit::Id => args.push(&plan.request_id),
            Admit::Ttl => args.push_num(plan.ttl_ms),
            Admit::Retention => args.push_num(retention_ms),
            Admit::NCheck => args.push_num(plan.checks.len()),
            Admit::PriceInput => args.push_num(price_in),
            Admit::PriceCached => args.push_num(price_cached),
            Admit::PriceOutput => args.push_num(price_out),
            Admit::ExpiredInput => args.push_num(expired.input_tokens),
            Admit::ExpiredCached => args.push_num(expired.cached_input_tokens),
            Admit::ExpiredOutput => args.push_num(expired.output_tokens),
            Admit::Size => args.push_num(plan.size()),
            Admit::NKill => args.push_num(plan.kill_targets.len()),
        }
    }
    args.extend(plan.kill_targets.iter());
    check_args(prefix, plan, now, keys, args);
}

/// A plan's checks, in its order, each as its kind and then its kind's layout.
fn check_args(prefix: &str, plan: &Plan, now: u64, keys: &mut Strs, args: &mut Strs) {
    for c in &plan.checks {
        for field in CheckLayout::ALL {
            match field {
                CheckLayout::Kind => args.push(match c.kind {
                    Kind::Count(_) if plan.attempt_counted => "k",
                    Kind::Count(_) => "r",
                    Kind::Peek(_) => "q",
                    Kind::Lease(_) => "l",
                    Kind::Reserve(_) => "b",
                    Kind::Verdict(_) => "v",
                }),
            }
        }
        match &c.kind {
            Kind::Count(r) | Kind::Peek(r) => rate_args(prefix, r, keys, args),
            Kind::Lease(l) => lease_args(prefix, l, keys, args),
            Kind::Reserve(b) => budget_args(prefix, plan, (b, now), keys, args),
            Kind::Verdict(_) => {}
        }
    }
}

fn rate_args(prefix: &str, r: &RateCheck, keys: &mut Strs, args: &mut Strs) {
    keys.push_key(prefix, "r", r.scope.id());
    for field in RateScope::ALL {
        match field {
            RateScope::Key => args.push_key(prefix, "r", r.scope.id()),
            RateScope::Limit => args.push_num(r.limit),
            RateScope::Window => args.push_num(r.window_ms),
        }
    }
}

fn lease_args(prefix: &str, c: &ConcurrencyCheck, keys: &mut Strs, args: &mut Strs) {
    keys.push_key(prefix, "l", c.scope.id());
    for field in LeaseScope::ALL {
        match field {
            LeaseScope::Key => args.push_key(prefix, "l", c.scope.id()),
            LeaseScope::Limit => args.push_num(c.limit),
        }
    }
}

fn budget_args(
    prefix: &str,
    plan: &Plan,
    (b, now): (&BudgetCheck, u64),
    keys: &mut Strs,
    args: &mut Strs,
) {
    keys.push_key(prefix, "b", b.scope.id());
    let (len, label) = period_arg(b.period, now);
    for field in BudgetScope::ALL {
        match field {
            BudgetScope::Key => args.push_key(prefix, "b", b.scope.id()),
            BudgetScope::Limit => args.push_num(b.limit),
            BudgetScope::Unit => match b.unit {
                Unit::Tokens => args.push("t"),
                // With the fees an abandoned request is charged (none: plain `m`).
                Unit::MicroUsd => match plan.expired_usage.fees {
                    0 => args.push("m"),
                    fees => args.push(&format!("m{fees}")),
                },
                // With what the round is charged when it ends without an answer.
                Unit::ToolCalls => {
                    args.push(&format!("c{}", plan.expired_usage.tool_calls));
                }
            },
            BudgetScope::PeriodLen => args.push(&len),
            BudgetScope::Label => args.push(&label),
            BudgetScope::Amount => args.push_num(b.amount),
            BudgetScope::Carry => args.push_num(b.carry_cap),
        }
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
    let mut args = strs(Finish::LEN);
    // Bounded before it is written: the script computes in doubles, and a number past 2^63
    // would be formatted negative there.
    let u = usage.unwrap_or_default().bounded();
    for field in Finish::ALL {
        match field {
            Finish::Id => args.push(id),
            Finish::Retention => args.push_num(retention_ms),
            Finish::Ending => args.push(ending),
            Finish::HasUsage => args.push_flag(usage.is_some()),
            Finish::Input => args.push_num(u.input_tokens),
            Finish::Cached => args.push_num(u.cached_input_tokens),
            Finish::Output => args.push_num(u.output_tokens),
            Finish::Write5m => args.push_num(u.cache_write_tokens),
            Finish::Write1h => args.push_num(u.cache_write_1h_tokens),
            Finish::ToolCalls => args.push_num(u.tool_calls),
            Finish::Fees => args.push_num(u.fees),
        }
    }
    let mut keys = strs(1);
    keys.push_key(prefix, "ts", id);
    Invocation { keys, args }
}

/// The KEYS and ARGV of an admission with its shadow plan (`admit_shadowed`): the number of the
/// request's arguments, the request's, then the shadow plan's header (its checks' number: its
/// holds go into the request's ticket) and checks.
pub(crate) fn admit_shadowed_invocation(
    prefix: &str,
    plan: &Plan,
    shadow: &Plan,
    retention_ms: u64,
    now: u64,
) -> Invocation {
    let s = shadow;
    let mut keys = strs(key_count(plan) + scope_count(s));
    let n = admit_arg_count(plan);
    let mut args = strs(1 + n + Shadow::LEN + check_arg_count(s));
    // The request's arguments are pushed after their count, not copied in behind it.
    args.push_num(n);
    admit_args(prefix, plan, (retention_ms, now), &mut keys, &mut args);
    for field in Shadow::ALL {
        match field {
            Shadow::NCheck => args.push_num(s.checks.len()),
        }
    }
    check_args(prefix, s, now, &mut keys, &mut args);
    Invocation { keys, args }
}
