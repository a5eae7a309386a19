//! Where a scope lives when the store has shards: each shard's key prefix, the shard of an id,
//! a plan's part in one shard, and what an instance remembers of the requests it admitted.

use std::sync::Arc;

use tollgate_core::Deny;
use tollgate_core::pipeline::Plan;

/// Wraps a prefix in a hash tag (cluster mode): every key then lives in one slot.
pub(crate) fn tagged(prefix: &str) -> String {
    if prefix.starts_with('{') && prefix.ends_with('}') {
        prefix.to_owned()
    } else {
        format!("{{{prefix}}}")
    }
}

/// The key prefix of each shard: the prefix itself when there is one shard (tagged in a
/// cluster), else `{prefix.N}` for shard N.
pub(crate) fn shard_prefixes(prefix: &str, shards: u16) -> Arc<[String]> {
    if shards <= 1 {
        return Arc::from(vec![prefix.to_owned()]);
    }
    let inner = prefix.trim_start_matches('{').trim_end_matches('}');
    (0..shards).map(|i| format!("{{{inner}.{i}}}")).collect()
}

/// The shard of a scope (or request) id: FNV-1a, stable across versions and instances.
pub(crate) fn shard_of(id: &str, shards: usize) -> usize {
    let h = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    usize::try_from(h % shards.max(1) as u64).unwrap_or(0)
}

/// One shard's share of a request's plan, and where its checks sit in the whole plan.
pub(crate) struct Part {
    pub(crate) shard: usize,
    pub(crate) plan: Plan,
    /// Each check's place in the whole plan.
    pub(crate) places: Vec<usize>,
    /// Each reservation's rank among the whole plan's (the order of the charges).
    pub(crate) reserves: Vec<usize>,
}

impl Part {
    /// Where a refusal of this part ranks among all the request's: the refusing check's place
    /// in the whole plan (a single-shard store reports the first in the plan's order).
    pub(crate) fn rank(&self, d: &Deny) -> usize {
        self.plan
            .checks
            .iter()
            .position(|c| c.reason == d.reason && c.scope().is_none_or(|s| *s == d.scope))
            .and_then(|p| self.places.get(p).copied())
            .unwrap_or(0)
    }
}

/// What this instance remembers of a request it admitted on a sharded store: the shards
/// holding its parts, with the plan positions of each part's budgets (for the charges' order).
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    pub(crate) expires_at: u64,
    pub(crate) parts: Vec<(usize, Vec<usize>)>,
}

/// Requests admitted here on a sharded store, by id, until they end. A request missing here
/// (admitted elsewhere, or forgotten) is looked for in every shard.
#[derive(Debug, Default)]
pub(crate) struct Admissions {
    pub(crate) map: std::collections::HashMap<String, Admission>,
    /// Size after the last pruning; the next one runs at twice that.
    pub(crate) pruned_at: usize,
}
