//! The conformance cases of what a store keeps beyond admission ([`Keeper`]): a settled total
//! restored from a spend ledger counts against its budget exactly as a settlement does, and the
//! store's state after it is initialised is kept, on every store.

use tollgate_core::{Keeper, Reason, StoreState};

use super::{BUDGET_300, DAY, budget_of, reason, setup};
use crate::{Harness, T0, facts, policy};

const SCOPE: &str = "user|tenant:acme/user:u";

/// 250 of the day's 300 restored (a rebuild): 50 are left, for this day only; the next day's
/// budget is whole.
pub async fn a_restored_total_counts_against_its_budget<H: Harness>(h: &H) {
    let p = policy(BUDGET_300);
    let (s, clock) = setup(h).await;
    let (day, start, end) = DAY.at(T0);
    let field = format!("{}@{day}", DAY.label());
    s.restore_settled(SCOPE, (DAY, day, &field), end, 250)
        .await
        .unwrap_or_else(|e| panic!("restore: {e}"));
    assert_eq!(budget_of(&s, SCOPE, DAY).await, (250, 0));
    assert_eq!(
        reason(&s, &p, facts("a", "u", 30, 30)).await,
        Some(Reason::BudgetLimit)
    );
    assert_eq!(reason(&s, &p, facts("b", "u", 20, 30)).await, None);
    clock.advance(end - start);
    assert_eq!(reason(&s, &p, facts("c", "u", 100, 200)).await, None);
}

/// A store initialised and written to reads as kept, and answers its ping.
pub async fn an_initialised_store_reads_as_kept<H: Harness>(h: &H) {
    let p = policy(BUDGET_300);
    let (s, _) = setup(h).await;
    s.initialise()
        .await
        .unwrap_or_else(|e| panic!("initialise: {e}"));
    assert_eq!(reason(&s, &p, facts("a", "u", 10, 10)).await, None);
    assert_eq!(
        s.state().await.unwrap_or_else(|e| panic!("state: {e}")),
        StoreState::Kept
    );
    assert!(s.loss_cause().is_none());
    s.ping().await.unwrap_or_else(|e| panic!("ping: {e}"));
}

/// A text kept for every instance reads back on a shared store (the same store: what another
/// instance would read); a store of one process keeps none.
pub async fn a_kept_text_reads_back_where_the_store_is_shared<H: Harness>(h: &H) {
    let (s, _) = setup(h).await;
    let ttl = std::time::Duration::from_secs(60);
    let text = r#"{"tenant":"acme","model":"gpt-4o"}"#;
    s.put_text("res:a", text, ttl)
        .await
        .unwrap_or_else(|e| panic!("put_text: {e}"));
    let read = s
        .text("res:a")
        .await
        .unwrap_or_else(|e| panic!("text: {e}"));
    if s.is_shared() {
        assert_eq!(read.as_deref(), Some(text));
        assert_eq!(s.text("res:b").await.ok().flatten(), None);
    } else {
        assert_eq!(read, None);
    }
}
