//! What an instance asks of a shared store for its slices, and what it gets back: one atomic
//! call ([`SliceSource::exchange`]) that reports, returns, renews and takes slices of many
//! scopes at once.
//!
//! Every order but a rate take is idempotent: a lease or budget order names the slice's total
//! (slots, amount, settled so far), not a change, so an order whose answer was lost can be sent
//! again. A rate order counts attempts ahead and gives unused ones back; the layer never sends a
//! give-back twice (one lost on the way leaves attempts counted that were not made: a refusal a
//! little early, never an overshoot).

use std::future::Future;
use std::sync::Arc;

use crate::clock::Millis;
use crate::ledger::{Period, RateWindow};
use crate::policy::Unit;
use crate::store::{Store, StoreError};

/// A store that lends slices of its scopes' limits (the `tollgate-slices` crate).
pub trait SliceSource: Store {
    /// Applies `ex`'s orders in order, in one atomic step, and answers one [`Granted`] per
    /// order. [`StoreError::StateLost`] when the store has forgotten its state.
    fn exchange(&self, ex: &Exchange)
    -> impl Future<Output = Result<Exchanged, StoreError>> + Send;
}

/// A shared store is a slice source.
impl<S: SliceSource + ?Sized> SliceSource for Arc<S> {
    fn exchange(
        &self,
        ex: &Exchange,
    ) -> impl Future<Output = Result<Exchanged, StoreError>> + Send {
        (**self).exchange(ex)
    }
}

/// One call's orders.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exchange {
    /// Applied in order.
    pub orders: Vec<Order>,
    /// A grant takes at most this share of what a scope has free: `free / divisor`, rounded
    /// down (at least 1).
    pub divisor: u64,
    /// Whether to answer the kill switches as well.
    pub kills: bool,
}

/// One scope's slice to take, report, renew or give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Order {
    /// Attempts of a rate scope.
    Rate(RateOrder),
    /// Concurrency slots.
    Lease(LeaseOrder),
    /// An amount of a budget in one period.
    Budget(BudgetOrder),
}

/// Gives back `back` attempts counted ahead in the window that started at `back_start` (in
/// that window, or as the previous one after it rolled once; older windows no longer count),
/// then counts up to `take` more attempts ahead in the current window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateOrder {
    /// The scope's storage id.
    pub scope: Arc<str>,
    /// Attempts per window.
    pub limit: u64,
    /// Window, ms.
    pub window_ms: u64,
    /// Attempts wanted.
    pub take: u64,
    /// Attempts to give back.
    pub back: u64,
    /// The start of the window they were counted in.
    pub back_start: Millis,
}

/// Sets the slots a slice holds in a concurrency scope: fewer are given back at once, more are
/// taken as far as [`Exchange::divisor`] allows. The slice's slots expire `ttl_ms` after its
/// last order, as a lease does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseOrder {
    /// The slice's id (unique across instances; never a request's).
    pub slice: Arc<str>,
    /// The scope's storage id.
    pub scope: Arc<str>,
    /// Leases at once.
    pub limit: u64,
    /// Slots the slice should hold.
    pub slots: u64,
    /// How long they live without another order.
    pub ttl_ms: u64,
    /// The slice is new: made when the store does not hold it (otherwise a slice the store no
    /// longer holds, because it expired, answers [`Granted::Gone`]).
    pub create: bool,
}

/// Reports what a slice's requests were charged and sets what it holds, in one budget period:
/// `settled` is the slice's whole settled amount so far (the store charges what it had not been
/// told), then the reservation is set to `amount` (less is given back at once; more is taken as
/// far as [`Exchange::divisor`] allows, and only in the period containing now). A scope past
/// its limit (charges beyond reservations take it there) keeps no more of the slice than
/// `keep`. The slice expires `ttl_ms` after its last order and is then charged its whole
/// reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetOrder {
    /// The slice's id.
    pub slice: Arc<str>,
    /// The scope's storage id.
    pub scope: Arc<str>,
    /// Budget per period.
    pub limit: u64,
    /// Its unit.
    pub unit: Unit,
    /// Its period.
    pub period: Period,
    /// The period the slice is of.
    pub period_id: u64,
    /// The reservation wanted after the report.
    pub amount: u64,
    /// What the reservation must hold after the report, whatever the limit: the reservations of
    /// requests admitted against the slice and still in flight (a request charged beyond its
    /// reservation can leave the slice short of them, as a settlement beyond its reservation
    /// takes a store past its limit).
    pub keep: u64,
    /// Settled by the slice's requests so far, in all.
    pub settled: u64,
    /// How long it lives without another order.
    pub ttl_ms: u64,
    /// The slice is new (see [`LeaseOrder::create`]).
    pub create: bool,
}

/// The answer to one order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granted {
    /// Attempts counted ahead for the slice, and the scope's window after them.
    Rate {
        /// Attempts granted.
        granted: u64,
        /// The window, with every instance's attempts.
        window: RateWindow,
    },
    /// The slots the slice holds now, and the leases held in the scope in all.
    Lease {
        /// The slice's slots.
        slots: u64,
        /// Every lease of the scope, the slice's included.
        held: u64,
    },
    /// What the slice holds now, and the period's settled + reserved in all.
    Budget {
        /// The slice's reservation.
        amount: u64,
        /// Settled + reserved in the scope's period, the slice's included.
        committed: u64,
    },
    /// The store no longer holds the slice (it expired and was charged in full).
    Gone,
}

/// The answer to an [`Exchange`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchanged {
    /// The store's time of the call (which never goes back).
    pub now: Millis,
    /// The store's clock at the call, before it was kept from going back: where the store's
    /// time will be as its clock moves on.
    pub clock: Millis,
    /// The kill switches, when asked for.
    pub kills: Option<Vec<(String, String)>>,
    /// One per order, in order.
    pub granted: Vec<Granted>,
}

/// `free / divisor`, at least 1 while anything is free: what one grant may take.
pub fn share(free: u64, divisor: u64) -> u64 {
    if free == 0 {
        0
    } else {
        (free / divisor.max(1)).max(1)
    }
}
