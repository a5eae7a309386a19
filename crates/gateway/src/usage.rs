//! The usage of one scope as a person reads it (`/v1/limits`, `/admin/usage`, the status page).

use tollgate_core::policy::BudgetLimit;
use tollgate_core::{ScopeUsage, Store, StoreError};

/// The usage of `scope_id` in `store`, with its budget's period and limit in force when it has
/// one: a budget that carries over shows what a period no admission has started will carry,
/// as its first admission counts it.
pub(crate) async fn of<S: Store>(
    store: &S,
    scope_id: &str,
    budget: Option<(BudgetLimit, u64)>,
) -> Result<ScopeUsage, StoreError> {
    match budget {
        Some((b, limit)) if b.carry_cap > 0 => {
            store
                .usage_carrying(scope_id, b.period, (b.carry_cap, limit))
                .await
        }
        b => store.usage(scope_id, b.map(|(b, _)| b.period)).await,
    }
}
