//! What is wrong with a client's request: 4xx errors, each naming the field at fault, rendered
//! by the dialect of the API called.

use super::ApiError;
use super::class::{Class, Fault};

/// The longest piece of a client-chosen value quoted in an error message, in characters.
const SHOWN_CHARS: usize = 64;

/// A client-chosen value as shown in an error message: at most 64 characters.
pub fn shown(v: &str) -> String {
    let mut s: String = v.chars().take(SHOWN_CHARS).collect();
    if s.len() < v.len() {
        s.push('…');
    }
    s
}

/// A body that could not be read off the connection.
pub fn invalid_body(e: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(
        "invalid_body",
        format!("Could not read the request body: {e}"),
    )
}

/// A body that is not the JSON its API expects.
pub fn invalid_json(e: impl std::fmt::Display) -> ApiError {
    ApiError::invalid("invalid_json", e.to_string())
}

/// A body whose field `param` holds a value the API does not accept.
pub fn invalid_field(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid("invalid_value", message).param(param)
}

/// An output cap above `[limits] max_output_tokens`.
pub fn output_cap_too_large(field: &str, asked: u64, largest: u64) -> ApiError {
    invalid_field(
        field,
        format!("{field} {asked} is above the largest accepted, {largest}."),
    )
}

/// More choices than the gateway serves in one request.
pub fn too_many_choices(n: u64, largest: u64) -> ApiError {
    invalid_field(
        "n",
        format!("n = {n} is above the largest accepted, {largest}."),
    )
}

/// A granted cap too small to give each choice a token.
pub fn no_tokens_per_choice(cap: u64, choices: u64) -> ApiError {
    invalid_field(
        "n",
        format!("The output cap {cap} leaves no tokens for each of {choices} choices."),
    )
}

/// `user` that is not a string.
pub fn user_not_a_string() -> ApiError {
    ApiError::invalid("invalid_type", "user must be a string.").param("user")
}

/// `x-tollgate-user` that is not visible ASCII.
pub fn user_header_not_ascii() -> ApiError {
    invalid_field("user", "x-tollgate-user must be visible ASCII.")
}

/// An end-user id longer than `max` bytes.
pub fn user_too_long(len: usize, max: usize) -> ApiError {
    invalid_field(
        "user",
        format!("user is {len} bytes long; at most {max} are accepted."),
    )
}

/// An `anthropic-beta` value the configuration does not allow.
pub fn unsupported_beta(beta: &str) -> ApiError {
    ApiError::invalid(
        "unsupported_beta",
        format!(
            "The anthropic-beta value {:?} is not allowed by this gateway.",
            shown(beta)
        ),
    )
    .param("anthropic-beta")
}

/// A URL nothing is served on: 404.
pub fn unknown_url() -> ApiError {
    ApiError::new(
        Class::Client(Fault::NotFound),
        "unknown_url",
        "Unknown URL.",
    )
}

/// A usage query for a rule the policy does not have: 404.
pub fn unknown_scope(rule: &str, close: &[&str]) -> ApiError {
    let hint = match close {
        [] => String::new(),
        names => format!(" Did you mean {}?", names.join(", ")),
    };
    ApiError::new(
        Class::Client(Fault::NotFound),
        "unknown_scope",
        format!("No rule named {:?}.{hint}", shown(rule)),
    )
    .param("scope")
}

/// A rule's name given alone for a rule with dimensions: which of its scopes is not said.
pub fn scope_needs_key(rule: &str, dims: &str) -> ApiError {
    ApiError::invalid(
        "scope_needs_key",
        format!(
            "Rule {rule:?} has a scope per {dims}: name one as {rule}|<{dims} values>, e.g. \
             {rule}|tenant:acme for a rule keyed on tenant."
        ),
    )
    .param("scope")
}

/// An admin call without the admin token: 401.
pub fn admin_unauthorized() -> ApiError {
    ApiError::new(
        Class::Client(Fault::Unauthenticated),
        "invalid_admin_token",
        "Admin token required.",
    )
}

/// A kill switch for a target that is none of the known kinds.
pub fn invalid_kill_target() -> ApiError {
    invalid_field(
        "target",
        "target must be all, tenant:<id>, key:<id>, model:<name> or user:<id>",
    )
}

/// A configuration file that does not validate (a reload): the old one stays.
pub fn invalid_config(e: impl Into<String>) -> ApiError {
    ApiError::invalid("invalid_config", e)
}

/// `background: true` on the Responses API: its usage would come after settlement.
pub fn background_unsupported() -> ApiError {
    ApiError::invalid(
        "unsupported_parameter",
        "background responses are not served through this gateway: their usage is known only \
         after the call returns, so they could not be settled.",
    )
    .param("background")
}

/// `n` or `best_of` that is not a positive integer.
pub fn not_a_choice_count(field: &str) -> ApiError {
    invalid_field(field, format!("{field} must be a positive integer."))
}

/// An operation header that is not visible ASCII.
pub fn operation_not_ascii(header: &str) -> ApiError {
    invalid_field("operation", format!("{header} must be visible ASCII."))
}

/// An operation id that is empty or longer than `max` bytes.
pub fn operation_length(header: &str, len: usize, max: usize) -> ApiError {
    invalid_field(
        "operation",
        format!("{header} is {len} bytes long; 1 to {max} are accepted."),
    )
}

/// An `Idempotency-Key` that is not 1 to `max` bytes of visible ASCII.
pub fn idempotency_key_invalid(max: usize) -> ApiError {
    invalid_field(
        "Idempotency-Key",
        format!("The Idempotency-Key header must be 1 to {max} bytes of visible ASCII."),
    )
}

/// A key whose first request, with the same body, is still being answered.
pub fn idempotency_key_in_flight() -> ApiError {
    ApiError::new(
        Class::Client(Fault::Conflict),
        "idempotency_key_in_flight",
        "A request with this Idempotency-Key and the same body is still being answered; \
         retry to get its response. Nothing was admitted or charged for this one.",
    )
    .retry_after(1_000)
}

/// A key used before with another body (or on another endpoint).
pub fn idempotency_key_reused() -> ApiError {
    ApiError::new(
        Class::Client(Fault::Unprocessable),
        "idempotency_key_reused",
        "This Idempotency-Key was used with another request body; use a new key for a new \
         request.",
    )
    .param("Idempotency-Key")
}

/// A key whose request was answered, with a response too large to keep for replay.
pub fn idempotent_response_not_kept() -> ApiError {
    ApiError::new(
        Class::Client(Fault::Conflict),
        "idempotent_response_not_kept",
        "A request with this Idempotency-Key was answered, but its response was larger than \
         the gateway keeps for replay; it is not sent again, so that it is not charged twice.",
    )
    .no_retry()
}

/// A body field the gateway does not know the cost of: refused, named, so that a provider's new
/// feature cannot reach the bill unpriced.
pub fn unknown_field(field: &str) -> ApiError {
    ApiError::invalid(
        "unknown_parameter",
        format!(
            "Unrecognized request argument supplied: {field}. This gateway forwards only the fields \
             whose cost it knows; its operator can declare this one free of cost for the upstream \
             (free_fields)."
        ),
    )
    .param(field)
}

/// A body field whose cost the price table cannot state (audio output, server-side work).
pub fn unpriced_field(field: &str) -> ApiError {
    ApiError::invalid(
        "unpriced_parameter",
        format!(
            "{field} asks for output or work whose cost this gateway cannot state, so it is not \
             forwarded; its operator can declare it free of cost for the upstream (free_fields)."
        ),
    )
    .param(field)
}

/// An earlier audio answer named by id, with no allowance configured: its audio is billed
/// again as input and the body does not hold it.
pub fn audio_reference_unpriced() -> ApiError {
    ApiError::invalid(
        "unpriced_audio_reference",
        "An assistant message names an earlier audio answer by id; the upstream bills that audio \
         again as input, and this gateway cannot see its length. Send the audio's transcript \
         instead, or ask the operator to set [remote_content] audio_tokens_per_reference.",
    )
    .param("messages")
}

/// A request that may use what its model has no price for (a tool the upstream runs, audio
/// input) under a money budget: 400 `unpriced_use`.
pub fn unpriced_use(what: &str, model: &str) -> ApiError {
    ApiError::invalid(
        "unpriced_use",
        format!(
            "Model {model:?} has no price for {what} in this gateway's price table, and a money \
             budget applies: the request is refused rather than reserved at the wrong price."
        ),
    )
}

/// A service tier with no price for the model, under a money budget.
pub fn unpriced_tier(field: &str, tier: &str, model: &str) -> ApiError {
    ApiError::invalid(
        "unpriced_service_tier",
        format!(
            "The service tier {tier:?} has no price for model {model:?} in this gateway's price \
             table, and a money budget applies: the request is refused rather than reserved at \
             the wrong price."
        ),
    )
    .param(field)
}

/// A key that may not do what it asks: the proxy with a key for reservations only, or the
/// reverse (`uses` in its `[[keys]]` entry): 403.
pub fn key_not_for(what: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::Forbidden),
        "key_not_allowed",
        format!("This key may not be used for {what}: its `uses` setting does not allow it."),
    )
}

/// A reservation this key does not hold, or that has ended and been forgotten: 404.
pub fn reservation_not_found(id: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::NotFound),
        "reservation_not_found",
        format!(
            "No open reservation {} for this key: it was never made, was made by another key, \
             or has ended.",
            shown(id)
        ),
    )
}

/// A settlement without a usage the gateway can read: 400, and the reservation stays open.
pub fn usage_missing() -> ApiError {
    ApiError::invalid(
        "usage_missing",
        "The settlement holds no usage: send the provider's usage object, its final response, \
         or the stream chunk that carries usage. The reservation is still open; end it with \
         DELETE if the call was not made.",
    )
    .param("usage")
}

/// A settlement whose usage numbers are not token counts: 400, and the reservation stays
/// open.
pub fn usage_not_counts() -> ApiError {
    ApiError::invalid(
        "usage_invalid",
        "A usage number is not a token count (a whole number no larger than 2^53): the \
         reservation is still open.",
    )
    .param("usage")
}

/// A reservation whose lease ended before it was settled, renewed or released: it was charged
/// as the policy charges an expired request, and a settlement now changes nothing: 409.
pub fn reservation_expired(id: &str) -> ApiError {
    ApiError::new(
        Class::Client(Fault::Conflict),
        "reservation_expired",
        format!(
            "Reservation {} expired before it was settled or renewed: it was charged as the \
             policy charges an expired request (expired_reservation_charge, in full by \
             default). Renew a reservation before its expires_at.",
            shown(id)
        ),
    )
}

/// This instance holds as many open reservations as it may: 503, retry later.
pub fn reservations_full(max: usize) -> ApiError {
    ApiError::new(
        Class::Books,
        "reservations_full",
        format!(
            "This gateway instance holds {max} open reservations, as many as it may; nothing \
             was reserved. Retry later."
        ),
    )
    .retry_after(1_000)
}

/// An ending of a reservation sent to a store that did not answer in time: it may have been
/// taken. Not a 503, which says nothing changed: 500, to be sent again (endings are
/// idempotent).
pub fn reservation_outcome_unknown(id: &str) -> ApiError {
    ApiError::new(
        Class::Unknown,
        "reservation_outcome_unknown",
        format!(
            "The store did not answer in time about reservation {}: the ending may have been \
             taken. Send it again; endings are idempotent and the answer will say.",
            shown(id)
        ),
    )
}
