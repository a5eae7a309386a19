//! The Redis store as a [`SliceSource`]: an instance's slice orders as one item (`S`) of a batch
//! call per shard, in the layout `slices.lua` reads, and its answers.

use redis::Value;
use tollgate_core::exchange::{
    BudgetOrder as BudgetOrderOf, Exchange, Exchanged, Granted, LeaseOrder as LeaseOrderOf, Order,
    RateOrder as RateOrderOf,
};
use tollgate_core::ledger::RateWindow;
use tollgate_core::policy::Unit;
use tollgate_core::{SliceSource, StoreError};

use crate::batch::{is_lost, is_uninitialised};
use crate::contract::{
    BudgetGrant, BudgetOrder, LeaseGrant, LeaseOrder, RateGrant, RateOrder, SliceHeader,
};
use crate::decode::{int, items, text};
use crate::encode::{Invocation, Strs, period_arg};
use crate::store::RedisStore;

/// Every reply kind of a slice item: its own, and a slice the store no longer holds.
pub const SLICE_REPLIES: [&str; 2] = ["sliced", "gone"];
/// The kinds of slice tickets the scripts write (slots, budget), which the reply check of the
/// scripts' sources meets too.
pub const SLICE_TICKETS: [&str; 2] = ["~L", "~B"];

fn unit_arg(u: Unit) -> &'static str {
    match u {
        Unit::Tokens => "t",
        Unit::MicroUsd => "m",
        Unit::ToolCalls => "c",
    }
}

fn scope_of(o: &Order) -> &str {
    match o {
        Order::Rate(r) => &r.scope,
        Order::Lease(l) => &l.scope,
        Order::Budget(b) => &b.scope,
    }
}

/// The keys and arguments of one shard's slice item: `orders` in the given order.
pub fn slice_invocation(prefix: &str, divisor: u64, kills: bool, orders: &[&Order]) -> Invocation {
    let mut inv = Invocation::default();
    let (keys, args) = (&mut inv.keys, &mut inv.args);
    for field in SliceHeader::ALL {
        match field {
            SliceHeader::Divisor => args.push_num(divisor.max(1)),
            SliceHeader::Kills => args.push_flag(kills),
        }
    }
    for o in orders {
        match o {
            Order::Rate(r) => {
                keys.push_key(prefix, "r", &r.scope);
                args.push("r");
                rate_order(prefix, r, args);
            }
            Order::Lease(l) => {
                keys.push_key(prefix, "l", &l.scope);
                keys.push_key(prefix, "ts", &l.slice);
                args.push("l");
                lease_order(prefix, l, args);
            }
            Order::Budget(b) => {
                keys.push_key(prefix, "b", &b.scope);
                keys.push_key(prefix, "ts", &b.slice);
                args.push("b");
                budget_order(prefix, b, args);
            }
        }
    }
    keys.push(&format!("{prefix}:x"));
    inv
}

fn rate_order(prefix: &str, r: &RateOrderOf, args: &mut Strs) {
    for field in RateOrder::ALL {
        match field {
            RateOrder::Key => args.push_key(prefix, "r", &r.scope),
            RateOrder::Limit => args.push_num(r.limit),
            RateOrder::Window => args.push_num(r.window_ms),
            RateOrder::Take => args.push_num(r.take),
            RateOrder::Back => args.push_num(r.back),
            RateOrder::BackStart => args.push_num(r.back_start),
        }
    }
}

fn lease_order(prefix: &str, l: &LeaseOrderOf, args: &mut Strs) {
    for field in LeaseOrder::ALL {
        match field {
            LeaseOrder::Slice => args.push(&l.slice),
            LeaseOrder::Key => args.push_key(prefix, "l", &l.scope),
            LeaseOrder::Limit => args.push_num(l.limit),
            LeaseOrder::Slots => args.push_num(l.slots),
            LeaseOrder::Ttl => args.push_num(l.ttl_ms),
            LeaseOrder::Create => args.push_flag(l.create),
        }
    }
}

fn budget_order(prefix: &str, b: &BudgetOrderOf, args: &mut Strs) {
    // A calendar period's starts around its own: a slice is taken only in the period its
    // order names.
    let (len, label) = period_arg(b.period, b.period_id);
    for field in BudgetOrder::ALL {
        match field {
            BudgetOrder::Slice => args.push(&b.slice),
            BudgetOrder::Key => args.push_key(prefix, "b", &b.scope),
            BudgetOrder::Limit => args.push_num(b.limit),
            BudgetOrder::Unit => args.push(unit_arg(b.unit)),
            BudgetOrder::PeriodLen => args.push(&len),
            BudgetOrder::Label => args.push(&label),
            BudgetOrder::PeriodId => args.push_num(b.period_id),
            BudgetOrder::Amount => args.push_num(b.amount),
            BudgetOrder::Keep => args.push_num(b.keep),
            BudgetOrder::Settled => args.push_num(b.settled),
            BudgetOrder::Ttl => args.push_num(b.ttl_ms),
            BudgetOrder::Create => args.push_flag(b.create),
        }
    }
}

fn count(v: &Value) -> Result<u64, StoreError> {
    int(v).map(|n| n.max(0) as u64)
}

/// One order's answer, read as its kind.
fn granted(o: &Order, v: Value) -> Result<Granted, StoreError> {
    let a = items(v)?;
    if a.len() == 1 && a.first().map(text).transpose()?.as_deref() == Some("gone") {
        return Ok(Granted::Gone);
    }
    let n = |i: usize| {
        a.get(i)
            .ok_or_else(|| StoreError::Protocol(format!("short slice answer: {a:?}")))
            .and_then(count)
    };
    Ok(match o {
        Order::Rate(_) => Granted::Rate {
            granted: n(RateGrant::Granted.at())?,
            window: RateWindow {
                start: n(RateGrant::Start.at())?,
                current: n(RateGrant::Current.at())?,
                previous: n(RateGrant::Previous.at())?,
            },
        },
        Order::Lease(_) => Granted::Lease {
            slots: n(LeaseGrant::Slots.at())?,
            held: n(LeaseGrant::Held.at())?,
        },
        Order::Budget(_) => Granted::Budget {
            amount: n(BudgetGrant::Amount.at())?,
            committed: n(BudgetGrant::Committed.at())?,
        },
    })
}

/// A shard's answer: the store's time and clock, its kill switches, one answer per order.
struct Answer {
    now: u64,
    clock: u64,
    kills: Vec<(String, String)>,
    granted: Vec<Granted>,
}

fn answer(orders: &[&Order], reply: Vec<Value>) -> Result<Answer, StoreError> {
    let mut it = reply.into_iter();
    match it.next().map(|k| text(&k)).transpose()?.as_deref() {
        Some("sliced") => {}
        other => {
            return Err(StoreError::Protocol(format!(
                "unknown slice reply {other:?}"
            )));
        }
    }
    let mut next = || {
        it.next()
            .ok_or_else(|| StoreError::Protocol("short slice reply".into()))
    };
    let now = count(&next()?)?;
    let clock = count(&next()?)?;
    let flat = items(next()?)?;
    let mut kills = Vec::with_capacity(flat.len() / 2);
    for pair in flat.chunks(2) {
        if let [t, r] = pair {
            kills.push((text(t)?, text(r)?));
        }
    }
    let mut out = Vec::with_capacity(orders.len());
    for o in orders {
        out.push(granted(o, next()?)?);
    }
    Ok(Answer {
        now,
        clock,
        kills,
        granted: out,
    })
}

impl SliceSource for RedisStore {
    async fn exchange(&self, ex: &Exchange) -> Result<Exchanged, StoreError> {
        let shards = self.shard_count();
        let mut by_shard: Vec<Vec<(usize, &Order)>> = vec![Vec::new(); shards];
        for (i, o) in ex.orders.iter().enumerate() {
            let s = crate::shards::shard_of(scope_of(o), shards);
            if let Some(list) = by_shard.get_mut(s) {
                list.push((i, o));
            }
        }
        let mut granted: Vec<Option<Granted>> = vec![None; ex.orders.len()];
        let mut seen: Option<(u64, u64)> = None;
        let mut kills = None;
        for (shard, list) in by_shard.iter().enumerate() {
            // The kill switches are read from the first shard (every shard holds a copy).
            let ask = ex.kills && shard == 0;
            if list.is_empty() && !ask {
                continue;
            }
            let orders: Vec<&Order> = list.iter().map(|(_, o)| *o).collect();
            let inv = slice_invocation(self.prefix_of(shard), ex.divisor, ask, &orders);
            let reply = self.batched(shard, "S", inv).await?;
            if reply.len() == 1 {
                let only = Value::Array(reply.clone());
                if is_lost(&only) {
                    return Err(StoreError::StateLost);
                }
                if is_uninitialised(&only) {
                    return Err(StoreError::Uninitialised);
                }
            }
            let a = answer(&orders, reply)?;
            seen.get_or_insert((a.now, a.clock));
            if ask {
                kills = Some(a.kills);
            }
            for ((i, _), g) in list.iter().zip(a.granted) {
                if let Some(slot) = granted.get_mut(*i) {
                    *slot = Some(g);
                }
            }
        }
        let (now, clock) = match seen {
            Some(t) => t,
            None => return Err(StoreError::Protocol("an exchange of nothing".into())),
        };
        Ok(Exchanged {
            now,
            clock,
            kills,
            granted: granted
                .into_iter()
                .map(|g| g.ok_or_else(|| StoreError::Protocol("an order unanswered".into())))
                .collect::<Result<_, _>>()?,
        })
    }
}
