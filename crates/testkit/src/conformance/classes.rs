//! The conformance case of reserved capacity: a share of a scope's concurrency kept for a
//! priority class. The check is concurrency's lease with a smaller limit for the classes
//! without a claim, so every store decides it with no code of its own.

use tollgate_core::{Decision, Policy, Reason, Store};

use super::{admit, setup};
use crate::{Harness, facts, policy};

const POLICY: &str = r#"
[classes.critical]
weight = 4
tenants = ["ops"]

[[scopes]]
key = "model"
concurrency = { limit = 5 }
reserve = { critical = "40%" }
"#;

/// Request `id` of tenant `tenant`, its key naming `class` when given.
async fn ask<S: Store>(s: &S, p: &Policy, id: &str, tenant: &str, class: Option<&str>) -> Decision {
    let mut f = facts(id, "u", 10, 10);
    f.identity.tenant = Some(tenant.to_owned());
    f.class = class.map(str::to_owned);
    admit(s, p, f).await
}

fn refused(d: &Decision) -> Option<(Reason, u64)> {
    d.deny().map(|d| (d.reason, d.limit))
}

/// Two of five slots are kept for `critical` (40%): other classes hold three at most, counted
/// with every class's leases; `critical` (by its tenant, or by its key) may take all five, and
/// the reserve opens to the rest only when leases end.
pub async fn a_reserve_keeps_its_share_for_its_class<H: Harness>(h: &H) {
    let (s, _) = setup(h).await;
    let p = policy(POLICY);
    for id in ["s1", "s2", "s3"] {
        assert_eq!(refused(&ask(&s, &p, id, "acme", None).await), None, "{id}");
    }
    let d = ask(&s, &p, "s4", "acme", None).await;
    assert_eq!(refused(&d), Some((Reason::CapacityReserved, 3)), "{d:?}");
    // Critical by its tenant, then by its key's class (its tenant is acme's).
    assert_eq!(refused(&ask(&s, &p, "c1", "ops", None).await), None);
    assert_eq!(
        refused(&ask(&s, &p, "c2", "acme", Some("critical")).await),
        None
    );
    let d = ask(&s, &p, "c3", "ops", None).await;
    assert_eq!(refused(&d), Some((Reason::ConcurrencyLimit, 5)), "{d:?}");
    // A critical lease ended: four in flight, still over standard's three.
    s.release("c1", None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let d = ask(&s, &p, "s5", "acme", None).await;
    assert_eq!(refused(&d), Some((Reason::CapacityReserved, 3)), "{d:?}");
    // Two standard leases ended: two in flight, and standard takes a slot again.
    for id in ["s1", "s2"] {
        s.release(id, None).await.unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(refused(&ask(&s, &p, "s6", "acme", None).await), None);
}
