//! Idempotency keys: who holds each, with what digest, and the response kept once it was
//! answered. Bounded in count and in the bytes of kept responses; an entry leaves when its time
//! is up (an unanswered claim after its in-flight time, an answer after its keep time), swept a
//! few at a time by each call.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::clock::Millis;
use crate::store::{KeyClaim, KeyUse};

/// Most keys held at once.
pub const MAX_KEYS: usize = 100_000;
/// Most bytes of kept responses at once.
pub const MAX_KEPT_BYTES: usize = 256 << 20;
/// Expired entries taken out per call.
const SWEEP_PER_CALL: usize = 64;

#[derive(Debug)]
struct Entry {
    digest: Box<str>,
    owner: Box<str>,
    /// `None` while unanswered.
    response: Option<Box<[u8]>>,
    expires_at: Millis,
}

/// The keys, and their entries in order of expiry.
#[derive(Debug)]
pub(super) struct Keys {
    map: HashMap<Arc<str>, Entry>,
    by_expiry: BTreeSet<(Millis, Arc<str>)>,
    kept_bytes: usize,
    /// [`MAX_KEPT_BYTES`] (smaller in tests).
    max_kept: usize,
}

impl Default for Keys {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            by_expiry: BTreeSet::new(),
            kept_bytes: 0,
            max_kept: MAX_KEPT_BYTES,
        }
    }
}

impl Keys {
    /// [`crate::Store::claim_key`] at `now`.
    pub(super) fn claim(&mut self, k: KeyUse<'_>, now: Millis) -> KeyClaim {
        self.sweep(now);
        if let Some(e) = self.map.get(k.key) {
            return match &e.response {
                _ if *e.digest != *k.digest => KeyClaim::Conflict,
                None => KeyClaim::InFlight,
                Some(r) => KeyClaim::Answered(r.to_vec()),
            };
        }
        if self.map.len() >= MAX_KEYS {
            return KeyClaim::NoRoom;
        }
        let key: Arc<str> = Arc::from(k.key);
        let expires_at = now.saturating_add(k.in_flight_ms);
        self.by_expiry.insert((expires_at, key.clone()));
        self.map.insert(
            key,
            Entry {
                digest: k.digest.into(),
                owner: k.request_id.into(),
                response: None,
                expires_at,
            },
        );
        KeyClaim::Claimed
    }

    /// [`crate::Store::end_claim`] at `now`. A response that does not fit in what is left of
    /// [`MAX_KEPT_BYTES`] is kept empty: the key still says it was answered, so a retry is not
    /// served (and charged) again.
    pub(super) fn end(
        &mut self,
        key: &str,
        request_id: &str,
        response: Option<&[u8]>,
        keep_ms: u64,
        now: Millis,
    ) {
        self.sweep(now);
        let Some((shared, e)) = self.map.get_key_value(key) else {
            return;
        };
        if *e.owner != *request_id || e.response.is_some() {
            return;
        }
        let shared = shared.clone();
        self.by_expiry.remove(&(e.expires_at, shared.clone()));
        let room = |r: &[u8]| self.kept_bytes.saturating_add(r.len()) <= self.max_kept;
        let kept = response.map(|r| if room(r) { r } else { &[][..] });
        match kept {
            Some(r) => {
                let expires_at = now.saturating_add(keep_ms);
                self.kept_bytes += r.len();
                self.by_expiry.insert((expires_at, shared.clone()));
                if let Some(e) = self.map.get_mut(&shared) {
                    e.response = Some(r.into());
                    e.expires_at = expires_at;
                }
            }
            None => {
                self.map.remove(&shared);
            }
        }
    }

    /// Takes out up to [`SWEEP_PER_CALL`] entries whose time is up.
    fn sweep(&mut self, now: Millis) {
        for _ in 0..SWEEP_PER_CALL {
            let Some(first) = self.by_expiry.first() else {
                return;
            };
            if first.0 > now {
                return;
            }
            let Some((_, key)) = self.by_expiry.pop_first() else {
                return;
            };
            if let Some(e) = self.map.remove(&key) {
                self.kept_bytes -= e.response.map_or(0, |r| r.len());
            }
        }
    }

    /// (keys held, bytes of kept responses).
    pub(super) fn footprint(&self) -> (usize, usize) {
        (self.map.len(), self.kept_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn use_of<'a>(key: &'a str, id: &'a str) -> KeyUse<'a> {
        KeyUse {
            key,
            digest: "d",
            request_id: id,
            in_flight_ms: 1_000,
        }
    }

    #[test]
    fn a_response_past_the_room_left_is_kept_empty_and_still_answers() {
        let mut k = Keys {
            max_kept: 10,
            ..Keys::default()
        };
        assert_eq!(k.claim(use_of("a", "r1"), 0), KeyClaim::Claimed);
        k.end("a", "r1", Some(b"123456"), 5_000, 0);
        assert_eq!(k.claim(use_of("b", "r2"), 0), KeyClaim::Claimed);
        k.end("b", "r2", Some(b"123456"), 5_000, 0);
        assert_eq!(
            k.claim(use_of("a", "r3"), 1),
            KeyClaim::Answered(b"123456".to_vec())
        );
        assert_eq!(
            k.claim(use_of("b", "r4"), 1),
            KeyClaim::Answered(Vec::new())
        );
        assert_eq!(k.footprint(), (2, 6));
        // Their time up, both go, and their bytes with them.
        assert_eq!(k.claim(use_of("c", "r5"), 5_001), KeyClaim::Claimed);
        assert_eq!(k.footprint(), (1, 0));
    }
}
