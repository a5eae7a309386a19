//! What the admin API refuses: kill switches that cannot be set or lifted, and stores that cannot
//! be initialised, each a 4xx in the API's error format.

use super::ApiError;
use super::class::{Class, Fault};

/// Lifting a kill switch that the configuration file sets: 409, naming the file.
pub fn kill_in_configuration(target: &str, file: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::Conflict),
        "kill_switch_in_configuration",
        format!(
            "{target} is switched off by a [[kill]] entry of {file}: remove it there and reload \
             (SIGHUP or POST /admin/reload)."
        ),
    )
}

/// Initialising a store whose spend ledger holds books: 409 (it forgot them; the gateway
/// rebuilds it from the ledger).
pub fn store_has_books() -> ApiError {
    ApiError::new(
        Class::Client(Fault::Conflict),
        "store_has_books",
        "The spend ledger holds books for this deployment, so an empty store forgot them rather \
         than being new: it is rebuilt from the ledger, not initialised.",
    )
}

/// Initialising a store whose loss is written down: 409 (a loss is acknowledged, not
/// initialised over).
pub fn init_over_loss() -> ApiError {
    ApiError::new(
        Class::Client(Fault::Conflict),
        "store_state_lost",
        "The store has lost its state, and the loss is written down: acknowledge it \
         (`tollgate admin acknowledge-loss`, POST /admin/store/acknowledge-loss) instead.",
    )
}

/// Setting a kill switch in a store that may evict it: 409.
pub fn kill_on_evicting_store() -> ApiError {
    ApiError::new(
        Class::Client(Fault::Conflict),
        "kill_switch_needs_a_store_that_keeps",
        "The store may evict keys ([store] allow_eviction = true), and an evicted kill switch \
         would let its target through again: set it as a [[kill]] entry of the configuration, \
         or use a Redis with maxmemory-policy noeviction.",
    )
}

/// Lifting a target that nothing switches off: 404, and no alert.
pub fn kill_not_set(target: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::NotFound),
        "kill_switch_not_set",
        format!("{target} is not switched off: there is nothing to lift."),
    )
}

/// A tenant's admin token used beyond its tenant: 403.
pub fn admin_scope_forbidden(tenant: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::Forbidden),
        "admin_scope_forbidden",
        format!(
            "This token manages the keys and reads the usage of tenant {tenant:?} only; the \
             operator's admin token does the rest."
        ),
    )
}
