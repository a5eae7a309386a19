//! What any instance needs to book a reservation's ending in the spend ledger, kept in the
//! shared store beside the reservation: the request's identity and counts, from which the
//! instance that ends it plans it again (its budget cells and price), and the store's time of
//! the admission. Kept only when a ledger is configured and the store is shared.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tollgate_core::{Dimension, Finish, Identity, Keeper, RequestFacts, StoreError, Usage};

use crate::gateway::Gateway;

/// How long the note outlives the reservation's lease: an ending after it is not booked here
/// (the store's expiry books it).
const OUTLIVES: Duration = Duration::from_secs(3600);

/// The note of one reservation.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Kept {
    /// The identity's values, by dimension name.
    dims: Vec<(String, String)>,
    input: u64,
    max_output: Option<u64>,
    price_tier: Option<String>,
    class: Option<String>,
    /// The store's time of the admission (the periods it reserved in).
    admitted_ms: u64,
    /// The lease's lifetime, for the note's.
    ttl_ms: u64,
}

fn name(id: &str) -> String {
    format!("res:{id}")
}

fn lifetime(ttl_ms: u64) -> Duration {
    Duration::from_millis(ttl_ms.saturating_mul(2)).saturating_add(OUTLIVES)
}

/// Keeps the note of reservation `facts` (admitted at `admitted_ms`, living `ttl_ms` without
/// renewal) when its ending may be booked elsewhere. A failure is logged: only the ledger's
/// row of an ending elsewhere depends on it.
pub(super) async fn keep(gw: &Gateway, facts: &RequestFacts, admitted_ms: u64, ttl_ms: u64) {
    if gw.books.is_none() || !gw.store.is_shared() {
        return;
    }
    let dims = Dimension::ALL
        .iter()
        .filter_map(|d| {
            facts
                .identity
                .get(*d)
                .map(|v| (d.as_str().to_owned(), v.to_owned()))
        })
        .collect();
    let kept = Kept {
        dims,
        input: facts.input_tokens,
        max_output: facts.max_output_tokens,
        price_tier: facts.price_tier.clone(),
        class: facts.class.clone(),
        admitted_ms,
        ttl_ms,
    };
    let Ok(text) = serde_json::to_string(&kept) else {
        return;
    };
    let id = &facts.request_id;
    if let Err(e) = gw.store.put_text(&name(id), &text, lifetime(ttl_ms)).await {
        tracing::warn!(reservation = %id, error = %e, "the reservation's booking note was not kept: an ending on another instance will not reach the ledger");
    }
}

/// Keeps the note of `id` one lease longer (a renewal).
pub(super) async fn renewed(gw: &Gateway, id: &str) {
    if gw.books.is_none() || !gw.store.is_shared() {
        return;
    }
    if let Ok(Some(text)) = gw.store.text(&name(id)).await {
        if let Ok(k) = serde_json::from_str::<Kept>(&text) {
            let _ = gw
                .store
                .put_text(&name(id), &text, lifetime(k.ttl_ms))
                .await;
        }
    }
}

/// Books in the ledger the ending of reservation `id`, made by another instance, as the store
/// took it (`finish`, with `usage`).
pub(super) async fn book(
    gw: &Gateway,
    id: &str,
    ending: &'static str,
    finish: &Result<Finish, StoreError>,
    usage: Usage,
) {
    let Some(books) = &gw.books else {
        return;
    };
    if !matches!(finish, Ok(Finish::Done { .. })) {
        return;
    }
    let kept = match gw.store.text(&name(id)).await {
        Ok(Some(text)) => serde_json::from_str::<Kept>(&text).ok(),
        _ => None,
    };
    let Some(k) = kept else {
        tracing::warn!(reservation = %id, "no booking note for a reservation ended here: its ending is not in the ledger");
        return;
    };
    let mut identity = Identity::default();
    for (d, v) in &k.dims {
        if let Some(d) = Dimension::parse(d) {
            identity = identity.with(d, v.clone());
        }
    }
    let facts = RequestFacts {
        request_id: id.to_owned(),
        identity,
        input_tokens: k.input,
        max_output_tokens: k.max_output,
        cache_write_tokens: 0,
        fingerprint: None,
        tool_call_repeats: 0,
        extra_output_tokens: 0,
        price_tier: k.price_tier,
        class: k.class,
        metered: tollgate_core::Metered::default(),
    };
    let cfg = gw.config();
    let Ok((p, _)) = crate::path::plans(&cfg.policy, &facts) else {
        tracing::warn!(reservation = %id, "the policy no longer plans this reservation: its ending is not in the ledger");
        return;
    };
    let id_of = &facts.identity;
    let who = crate::books::Who {
        tenant: id_of.tenant.clone(),
        key: id_of.key.clone(),
        model: id_of.model.clone(),
        user: id_of
            .user
            .as_deref()
            .map(|u| crate::records::digest(cfg.records_key.as_deref(), u)),
    };
    books
        .booking(&p, who, k.admitted_ms)
        .book(id, ending, finish, Some(usage));
}
