//! The Redis store as a [`SliceSource`]: an instance's slice orders as one item (`S`) of a batch
//! call per shard, in the layout `slices_v1.lua` reads, and its answers.

use redis::Value;
use tollgate_core::ledger::RateWindow;
use tollgate_core::policy::Unit;
use tollgate_core::slices::{Exchange, Exchanged, Granted, Order};
use tollgate_core::{SliceSource, StoreError};

use crate::RedisStore;
use crate::batch::{is_lost, is_uninitialised};
use crate::decode::{int, items, text};
use crate::encode::{Invocation, period_arg};

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
    args.push_num(divisor.max(1));
    args.push_flag(kills);
    for o in orders {
        match o {
            Order::Rate(r) => {
                keys.push_key(prefix, "r", &r.scope);
                args.push("r");
                args.push_key(prefix, "r", &r.scope);
                for n in [r.limit, r.window_ms, r.take, r.back, r.back_start] {
                    args.push_num(n);
                }
            }
            Order::Lease(l) => {
                keys.push_key(prefix, "l", &l.scope);
                keys.push_key(prefix, "ts", &l.slice);
                args.push("l");
                args.push(&l.slice);
                args.push_key(prefix, "l", &l.scope);
                for n in [l.limit, l.slots, l.ttl_ms] {
                    args.push_num(n);
                }
                args.push_flag(l.create);
            }
            Order::Budget(b) => {
                keys.push_key(prefix, "b", &b.scope);
                keys.push_key(prefix, "ts", &b.slice);
                let (len, label) = period_arg(b.period);
                args.push("b");
                args.push(&b.slice);
                args.push_key(prefix, "b", &b.scope);
                args.push_num(b.limit);
                args.push(unit_arg(b.unit));
                args.push_num(len);
                args.push(&label);
                for n in [b.period_id, b.amount, b.keep, b.settled, b.ttl_ms] {
                    args.push_num(n);
                }
                args.push_flag(b.create);
            }
        }
    }
    keys.push(&format!("{prefix}:x"));
    inv
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
            granted: n(0)?,
            window: RateWindow {
                start: n(1)?,
                current: n(2)?,
                previous: n(3)?,
            },
        },
        Order::Lease(_) => Granted::Lease {
            slots: n(0)?,
            held: n(1)?,
        },
        Order::Budget(_) => Granted::Budget {
            amount: n(0)?,
            committed: n(1)?,
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
            let s = crate::shard_of(scope_of(o), shards);
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
