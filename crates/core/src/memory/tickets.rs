//! In-flight tickets, in slots that are used again once their request ends, and in order of
//! expiry: one list per ticket lifetime (TTL).
//!
//! The store's time never goes backwards, so a ticket made or renewed now, `now + ttl`, expires
//! no earlier than every ticket of the same lifetime before it: appending keeps a list in order
//! of expiry, and the due tickets are at the heads. Inserting, removing and renewing are O(1),
//! where a tree ordered by expiry cost a search and a rebalancing at each end of a request; and a
//! slot keeps its holds' allocation for the next ticket, where a boxed ticket cost two
//! allocations per admission. A policy has one lifetime per concurrency scope (and one for
//! requests without a lease), so there are a handful of lists.

use super::{Blocks, Hold, Id};
use crate::clock::Millis;
use crate::ledger::Usage;
use crate::policy::Price;

/// No slot: the end of a list.
const NIL: u32 = u32::MAX;

/// What an admission holds until its request ends.
#[derive(Debug, Default)]
pub(super) struct Ticket {
    pub expires_at: Millis,
    pub ttl_ms: u64,
    /// Leases and reservations in one allocation, kept by the slot for the next ticket.
    pub holds: Vec<Hold>,
    pub price: Option<Price>,
    pub expired_usage: Usage,
}

#[derive(Debug, Default)]
struct Entry {
    /// The request's id, to end it when it expires.
    id: Id,
    ticket: Ticket,
    /// Its list, and its neighbours there (`NIL` at the ends).
    list: u32,
    prev: u32,
    next: u32,
}

/// The tickets of one lifetime, earliest expiry first.
#[derive(Debug)]
struct List {
    ttl_ms: u64,
    head: u32,
    tail: u32,
}

#[derive(Debug, Default)]
pub(super) struct Tickets {
    entries: Blocks<Entry>,
    /// Slots of ended tickets, to be used again (last ended, first used: its memory is warm).
    free: Vec<u32>,
    lists: Vec<List>,
    len: usize,
}

impl Tickets {
    /// Tickets in flight.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether [`Self::insert`] has a slot to give: below 2^32 - 1 tickets in flight.
    pub fn has_room(&self) -> bool {
        !self.free.is_empty() || self.entries.len() < NIL as usize
    }

    /// An empty holds vector for the next [`Self::insert`], with the allocation of the slot it
    /// will take when there is one.
    pub fn spare_holds(&mut self, n: usize) -> Vec<Hold> {
        let spare = self
            .free
            .last()
            .and_then(|&i| self.entries.get_mut(i as usize))
            .map(|e| std::mem::take(&mut e.ticket.holds))
            .unwrap_or_default();
        if spare.capacity() >= n {
            spare
        } else {
            Vec::with_capacity(n)
        }
    }

    /// Records a ticket and returns its slot; `None` beyond 2^32 - 1 tickets in flight.
    pub fn insert(&mut self, id: Id, ticket: Ticket) -> Option<u32> {
        let list = self.list(ticket.ttl_ms);
        let i = match self.free.pop() {
            Some(i) => {
                let e = self.entries.get_mut(i as usize)?;
                e.id = id;
                e.ticket = ticket;
                i
            }
            None => {
                let i = u32::try_from(self.entries.len())
                    .ok()
                    .filter(|&i| i != NIL)?;
                self.entries.push(Entry {
                    id,
                    ticket,
                    ..Entry::default()
                });
                i
            }
        };
        self.len += 1;
        self.append(i, list);
        Some(i)
    }

    pub fn get(&self, i: u32) -> Option<&Ticket> {
        Some(&self.entries.get(i as usize)?.ticket)
    }

    pub fn get_mut(&mut self, i: u32) -> Option<&mut Ticket> {
        Some(&mut self.entries.get_mut(i as usize)?.ticket)
    }

    /// The id and ticket of the earliest-expiring ticket due at `now`, if any.
    pub fn due(&self, now: Millis) -> Option<(u32, &Id, &Ticket)> {
        self.lists.iter().find_map(|l| {
            let e = self.entries.get(l.head as usize)?;
            (e.ticket.expires_at <= now).then_some((l.head, &e.id, &e.ticket))
        })
    }

    /// Ends the ticket at slot `i`: out of its list, its slot free (its holds' allocation kept).
    pub fn remove(&mut self, i: u32) {
        self.unlink(i);
        if let Some(e) = self.entries.get_mut(i as usize) {
            e.ticket.holds.clear();
            // An id longer than the inline size is shared: let it go now, not at the slot's reuse.
            e.id = Id::default();
        }
        self.free.push(i);
        self.len -= 1;
    }

    /// Gives the ticket at slot `i` its full lifetime again from `now`; returns its new expiry.
    pub fn renew(&mut self, i: u32, now: Millis) -> Option<Millis> {
        let e = self.entries.get_mut(i as usize)?;
        e.ticket.expires_at = now.saturating_add(e.ticket.ttl_ms);
        let (at, list) = (e.ticket.expires_at, e.list);
        self.unlink(i);
        self.append(i, list);
        Some(at)
    }

    /// The list of lifetime `ttl`: an empty one is given to it when it has none, so lists of
    /// lifetimes no longer in use are taken over, and there are never more lists than
    /// lifetimes in flight at once (plus one).
    fn list(&mut self, ttl: u64) -> u32 {
        let at = match self.lists.iter().position(|l| l.ttl_ms == ttl) {
            Some(at) => at,
            None => match self.lists.iter().position(|l| l.head == NIL) {
                Some(at) => {
                    if let Some(l) = self.lists.get_mut(at) {
                        l.ttl_ms = ttl;
                    }
                    at
                }
                None => {
                    self.lists.push(List {
                        ttl_ms: ttl,
                        head: NIL,
                        tail: NIL,
                    });
                    self.lists.len() - 1
                }
            },
        };
        // As many lists as slots at most: far below u32::MAX.
        at as u32
    }

    /// Appends slot `i` to list `list` (its expiry is the latest in it).
    fn append(&mut self, i: u32, list: u32) {
        let Some(l) = self.lists.get_mut(list as usize) else {
            return;
        };
        let tail = l.tail;
        l.tail = i;
        if tail == NIL {
            l.head = i;
        }
        if let Some(t) = self.entries.get_mut(tail as usize) {
            t.next = i;
        }
        if let Some(e) = self.entries.get_mut(i as usize) {
            e.list = list;
            e.prev = tail;
            e.next = NIL;
        }
    }

    fn unlink(&mut self, i: u32) {
        let Some(e) = self.entries.get_mut(i as usize) else {
            return;
        };
        let (prev, next, list) = (e.prev, e.next, e.list);
        e.prev = NIL;
        e.next = NIL;
        match self.entries.get_mut(prev as usize) {
            Some(p) => p.next = next,
            None => {
                if let Some(l) = self.lists.get_mut(list as usize) {
                    l.head = next;
                }
            }
        }
        match self.entries.get_mut(next as usize) {
            Some(n) => n.prev = prev,
            None => {
                if let Some(l) = self.lists.get_mut(list as usize) {
                    l.tail = prev;
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ticket(expires_at: Millis, ttl_ms: u64) -> Ticket {
        Ticket {
            expires_at,
            ttl_ms,
            ..Ticket::default()
        }
    }

    /// Drains every due ticket at `now`, earliest first within each lifetime.
    fn drain(t: &mut Tickets, now: Millis) -> Vec<String> {
        let mut out = Vec::new();
        while let Some((i, id, _)) = t.due(now) {
            out.push(id.to_string());
            t.remove(i);
        }
        out
    }

    /// Tickets of two lifetimes expire by their own lists, each in order; removed and renewed
    /// ones leave their place; slots are used again.
    #[test]
    fn lists_keep_expiry_order_through_removal_and_renewal() {
        let mut t = Tickets::default();
        let a = t.insert("a".into(), ticket(100, 100)).unwrap();
        let b = t.insert("b".into(), ticket(110, 100)).unwrap();
        let c = t.insert("c".into(), ticket(1_010, 1_000)).unwrap();
        let d = t.insert("d".into(), ticket(120, 100)).unwrap();
        assert_eq!(t.len(), 4);
        assert!(t.due(99).is_none());
        // b, from the middle of its list; then a renewed at 50 goes behind d.
        t.remove(b);
        assert_eq!(t.renew(a, 50), Some(150));
        assert_eq!(drain(&mut t, 130), vec!["d"]);
        assert_eq!(drain(&mut t, 1_000), vec!["a"]);
        // The freed slots are used again, last freed first.
        assert_eq!(t.insert("e".into(), ticket(1_100, 100)).unwrap(), a);
        assert_eq!(t.insert("f".into(), ticket(1_100, 100)).unwrap(), d);
        assert_eq!(t.insert("g".into(), ticket(1_100, 100)).unwrap(), b);
        assert_eq!(drain(&mut t, 1_100), vec!["e", "f", "g", "c"]);
        assert_eq!(t.len(), 0);
        assert!(t.due(u64::MAX).is_none());
        assert_eq!(t.get(c).map(|x| x.holds.len()), Some(0));
    }

    /// A slot's holds keep their allocation for the next ticket that takes it.
    #[test]
    fn a_freed_slot_lends_its_holds_allocation() {
        let mut t = Tickets::default();
        let mut first = ticket(10, 10);
        first.holds = Vec::with_capacity(8);
        let ptr = first.holds.as_ptr();
        let i = t.insert("a".into(), first).unwrap();
        t.remove(i);
        let spare = t.spare_holds(3);
        assert_eq!((spare.len(), spare.capacity(), spare.as_ptr()), (0, 8, ptr));
        assert!(
            t.spare_holds(3).capacity() >= 3,
            "a fresh one when none is spare"
        );
    }

    /// Lists of lifetimes that have gone are taken over by the next lifetime that comes.
    #[test]
    fn unused_lifetimes_are_taken_over() {
        let mut t = Tickets::default();
        for ttl in 1..=100 {
            let i = t.insert("x".into(), ticket(ttl, ttl)).unwrap();
            t.remove(i);
        }
        assert_eq!(t.lists.len(), 1);
    }
}
