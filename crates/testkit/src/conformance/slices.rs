//! Slice orders ([`SliceSource::exchange`]), exactly: what each store grants, holds, reports,
//! gives back and expires. Run against every store that lends slices, so that the slice layer's
//! local admission rests on the same arithmetic everywhere (a store that answered wrongly would
//! otherwise go unnoticed: the layer falls back to per-request admission on any error).

use std::sync::Arc;

use tollgate_core::exchange::{
    BudgetOrder, Exchange, Exchanged, Granted, LeaseOrder, Order, RateOrder,
};
use tollgate_core::ledger::RateWindow;
use tollgate_core::{ManualClock, Period, SliceSource, Unit};

use super::{DAY, budget_of, leases_of};
use crate::T0;

/// Makes fresh stores that lend slices.
pub trait SliceHarness: Send + Sync {
    /// The store under test.
    type S: SliceSource;
    /// A clean store whose time is `clock`.
    fn store(&self, clock: ManualClock) -> impl std::future::Future<Output = Self::S> + Send;
}

async fn ex<S: SliceSource>(s: &S, divisor: u64, orders: Vec<Order>) -> Exchanged {
    s.exchange(&Exchange {
        orders,
        divisor,
        kills: true,
    })
    .await
    .unwrap_or_else(|e| panic!("exchange: {e}"))
}

fn one(e: &Exchanged) -> Granted {
    *e.granted.first().unwrap_or_else(|| panic!("no answer"))
}

fn rate(take: u64, back: u64, back_start: u64) -> Order {
    Order::Rate(RateOrder {
        scope: Arc::from("r|x"),
        limit: 10,
        window_ms: 10_000,
        take,
        back,
        back_start,
    })
}

fn lease(slice: &str, slots: u64, ttl_ms: u64, create: bool) -> Order {
    Order::Lease(LeaseOrder {
        slice: Arc::from(slice),
        scope: Arc::from("l|x"),
        limit: 10,
        slots,
        ttl_ms,
        create,
    })
}

#[allow(clippy::too_many_arguments)]
fn budget(
    slice: &str,
    pid: u64,
    amount: u64,
    keep: u64,
    settled: u64,
    ttl_ms: u64,
    create: bool,
) -> Order {
    Order::Budget(BudgetOrder {
        slice: Arc::from(slice),
        scope: Arc::from("b|x"),
        limit: 1000,
        unit: Unit::Tokens,
        period: DAY,
        period_id: pid,
        amount,
        keep,
        settled,
        ttl_ms,
        create,
    })
}

fn window(start: u64, current: u64, previous: u64) -> RateWindow {
    RateWindow {
        start,
        current,
        previous,
    }
}

/// Rate: attempts are counted ahead, a share of what is free at a time; unused ones go back to
/// their window, or to it as the previous one after it rolled.
pub async fn rate_orders_count_ahead_and_give_back<H: SliceHarness>(h: &H) {
    let clock = ManualClock::new(T0 + 2_000);
    let s = h.store(clock.clone()).await;
    let e = ex(&s, 2, vec![rate(8, 0, 0)]).await;
    assert_eq!((e.now, e.clock), (T0 + 2_000, T0 + 2_000));
    assert_eq!(e.kills, Some(vec![]));
    assert_eq!(
        one(&e),
        Granted::Rate {
            granted: 5,
            window: window(T0, 5, 0)
        }
    );
    let e = ex(&s, 2, vec![rate(8, 0, 0)]).await;
    assert_eq!(
        one(&e),
        Granted::Rate {
            granted: 2,
            window: window(T0, 7, 0)
        }
    );
    let e = ex(&s, 2, vec![rate(0, 3, T0)]).await;
    assert_eq!(
        one(&e),
        Granted::Rate {
            granted: 0,
            window: window(T0, 4, 0)
        }
    );
    // The next window: what goes back to the old one lowers the previous count.
    clock.advance(10_000);
    let e = ex(&s, 2, vec![rate(1, 2, T0)]).await;
    assert_eq!(
        one(&e),
        Granted::Rate {
            granted: 1,
            window: window(T0 + 10_000, 1, 2)
        }
    );
    // A window two back no longer counts: nothing to give back to.
    clock.advance(20_000);
    let e = ex(&s, 2, vec![rate(0, 5, T0)]).await;
    assert_eq!(
        one(&e),
        Granted::Rate {
            granted: 0,
            window: window(T0 + 30_000, 0, 0)
        }
    );
}

/// Slots: taken a share of what is free at a time, held as leases the store counts, renewed by
/// each order, given back by setting fewer, ended at none; an ended or expired slice is gone,
/// and its slots come back when it expires.
pub async fn lease_orders_hold_renew_and_give_back<H: SliceHarness>(h: &H) {
    let clock = ManualClock::new(T0);
    let s = h.store(clock.clone()).await;
    let e = ex(&s, 2, vec![lease("~s:t:1", 8, 1_000, true)]).await;
    assert_eq!(one(&e), Granted::Lease { slots: 5, held: 5 });
    assert_eq!(leases_of(&s, "l|x").await, 5);
    // Renewed: still held past its first lifetime.
    clock.advance(800);
    let e = ex(&s, 2, vec![lease("~s:t:1", 8, 1_000, false)]).await;
    assert_eq!(one(&e), Granted::Lease { slots: 7, held: 7 });
    clock.advance(800);
    assert_eq!(leases_of(&s, "l|x").await, 7);
    let e = ex(&s, 2, vec![lease("~s:t:1", 2, 1_000, false)]).await;
    assert_eq!(one(&e), Granted::Lease { slots: 2, held: 2 });
    let e = ex(&s, 2, vec![lease("~s:t:1", 0, 1_000, false)]).await;
    assert_eq!(one(&e), Granted::Lease { slots: 0, held: 0 });
    let e = ex(&s, 2, vec![lease("~s:t:1", 3, 1_000, false)]).await;
    assert_eq!(one(&e), Granted::Gone);
    // A second slice, left to expire: its slots come back, and it is gone.
    let e = ex(&s, 2, vec![lease("~s:t:2", 3, 1_000, true)]).await;
    assert_eq!(one(&e), Granted::Lease { slots: 3, held: 3 });
    clock.advance(1_001);
    assert_eq!(leases_of(&s, "l|x").await, 0);
    let e = ex(&s, 2, vec![lease("~s:t:2", 3, 1_000, true)]).await;
    assert_eq!(one(&e), Granted::Gone);
}

/// Budget: a share of what is free at a time; settlements reported by their total (an order
/// sent twice charges once, beyond the reservation if need be); what must stay reserved stays,
/// past the limit if need be; less given back at once; no more taken in a period that has
/// ended; an expired slice charged in full.
pub async fn budget_orders_report_keep_and_expire<H: SliceHarness>(h: &H) {
    let clock = ManualClock::new(T0);
    let s = h.store(clock.clone()).await;
    let pid = T0 / 86_400_000;
    // Past the day's end.
    const LONG: u64 = 2 * 86_400_000;
    let e = ex(&s, 2, vec![budget("~s:t:b", pid, 800, 0, 0, LONG, true)]).await;
    assert_eq!(
        one(&e),
        Granted::Budget {
            amount: 500,
            committed: 500
        }
    );
    // 100 settled; 300 wanted: 200 given back.
    let e = ex(&s, 2, vec![budget("~s:t:b", pid, 300, 0, 100, LONG, false)]).await;
    assert_eq!(
        one(&e),
        Granted::Budget {
            amount: 300,
            committed: 400
        }
    );
    let e = ex(&s, 2, vec![budget("~s:t:b", pid, 300, 0, 100, LONG, false)]).await;
    assert_eq!(
        one(&e),
        Granted::Budget {
            amount: 300,
            committed: 400
        },
        "sent twice"
    );
    assert_eq!(budget_of(&s, "b|x", DAY).await, (100, 300));
    // 500 more settled than held: charged in full, and 250 of reservations in flight kept.
    let e = ex(
        &s,
        2,
        vec![budget("~s:t:b", pid, 250, 250, 900, LONG, false)],
    )
    .await;
    assert_eq!(
        one(&e),
        Granted::Budget {
            amount: 250,
            committed: 1150
        }
    );
    assert_eq!(budget_of(&s, "b|x", DAY).await, (900, 250));
    // Nothing free: no more, however much wanted.
    let e = ex(
        &s,
        2,
        vec![budget("~s:t:b", pid, 900, 250, 900, LONG, false)],
    )
    .await;
    assert_eq!(
        one(&e),
        Granted::Budget {
            amount: 250,
            committed: 1150
        }
    );
    // Another slice, in the next day, left to expire: charged its whole reservation.
    clock.set(T0 + 86_400_000);
    let next = pid + 1;
    let e = ex(&s, 4, vec![budget("~s:t:c", next, 100, 0, 0, 1_000, true)]).await;
    assert_eq!(
        one(&e),
        Granted::Budget {
            amount: 100,
            committed: 100
        }
    );
    // The old day's slice: it may shrink and report, never grow; and, its day past the limit,
    // it keeps only what it must (none here): 150 of its 200 go back.
    let e = ex(&s, 2, vec![budget("~s:t:b", pid, 600, 0, 950, LONG, false)]).await;
    assert_eq!(
        one(&e),
        Granted::Budget {
            amount: 50,
            committed: 1000
        }
    );
    clock.advance(1_001);
    assert_eq!(
        budget_of(&s, "b|x", Period::Fixed(86_400_000)).await,
        (100, 0)
    );
    let e = ex(&s, 2, vec![budget("~s:t:c", next, 100, 0, 0, 1_000, false)]).await;
    assert_eq!(one(&e), Granted::Gone);
}

/// Expands to one `#[tokio::test]` per slice-order case, each with a fresh harness from `$make`.
#[macro_export]
macro_rules! slice_conformance_tests {
    ($make:expr) => {
        $crate::slice_conformance_tests!(@cases $make;
            rate_orders_count_ahead_and_give_back, lease_orders_hold_renew_and_give_back,
            budget_orders_report_keep_and_expire);
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $case() {
                let h = $make;
                $crate::conformance::slices::$case(&h).await;
            }
        )*
    };
}
