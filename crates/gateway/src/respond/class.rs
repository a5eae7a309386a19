//! What kind of failure an error is. A step says what happened, as a value; the HTTP status is
//! chosen from it here and nowhere else ([`Class::status`]), and each API format names it in
//! its own words ([`Class::openai_type`], [`Class::anthropic_type`]).

use axum::http::StatusCode;

/// What went wrong, as a step found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The request or its caller is at fault.
    Client(Fault),
    /// A control refused the request: a decision, not a fault.
    Refused(Refusal),
    /// The store or the spend ledger could not decide or keep what it must: nothing was sent.
    Books,
    /// The upstream failed the request.
    Upstream(Upstream),
    /// The gateway itself failed.
    Internal,
    /// A change was asked of the store and its outcome is not known: it may have been made.
    Unknown,
}

/// How a request or its caller is at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A field, a header or the body is not what the API takes.
    Invalid,
    /// No key, or one the gateway does not know.
    Unauthenticated,
    /// A key or token that may not do this.
    Forbidden,
    /// No such path, model, scope or record.
    NotFound,
    /// The state of things forbids it now (a key in use, a store with books).
    Conflict,
    /// The body is larger than the gateway takes.
    TooLarge,
    /// The body did not arrive in time.
    TooSlow,
    /// The same idempotency key with another body.
    Unprocessable,
}

/// How a control refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A limit that resets or frees up: rate, concurrency, tool calls, loops.
    Limit,
    /// A budget spent for its period.
    Quota,
    /// The request itself is larger than a token limit: sent again, it is refused again.
    TooLarge,
    /// An operator switched the request's scope off.
    Killed,
}

/// How the upstream failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upstream {
    /// Unreachable, or its answer unreadable.
    Failed,
    /// It did not answer in time.
    Timeout,
}

impl Class {
    /// The HTTP status of a failure of this class.
    pub fn status(self) -> StatusCode {
        match self {
            Class::Client(f) => match f {
                Fault::Invalid => StatusCode::BAD_REQUEST,
                Fault::Unauthenticated => StatusCode::UNAUTHORIZED,
                Fault::Forbidden => StatusCode::FORBIDDEN,
                Fault::NotFound => StatusCode::NOT_FOUND,
                Fault::Conflict => StatusCode::CONFLICT,
                Fault::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                Fault::TooSlow => StatusCode::REQUEST_TIMEOUT,
                Fault::Unprocessable => StatusCode::UNPROCESSABLE_ENTITY,
            },
            Class::Refused(Refusal::Limit | Refusal::Quota) => StatusCode::TOO_MANY_REQUESTS,
            Class::Refused(Refusal::TooLarge) => StatusCode::BAD_REQUEST,
            // Not a fault of the request, and not retryable until lifted (`x-should-retry`).
            Class::Refused(Refusal::Killed) | Class::Books => StatusCode::SERVICE_UNAVAILABLE,
            Class::Upstream(Upstream::Failed) => StatusCode::BAD_GATEWAY,
            Class::Upstream(Upstream::Timeout) => StatusCode::GATEWAY_TIMEOUT,
            Class::Internal | Class::Unknown => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The error's `type` in OpenAI's format, as OpenAI's API names its errors where it has
    /// the class (`service_unavailable` and `upstream_error` are the gateway's own).
    pub fn openai_type(self) -> &'static str {
        match self {
            Class::Client(_) | Class::Refused(Refusal::TooLarge) => "invalid_request_error",
            Class::Refused(Refusal::Limit) => "rate_limit_error",
            Class::Refused(Refusal::Quota) => "insufficient_quota",
            Class::Refused(Refusal::Killed) | Class::Books => "service_unavailable",
            Class::Upstream(_) => "upstream_error",
            Class::Internal => "server_error",
            Class::Unknown => "api_error",
        }
    }

    /// The error's `type` in Anthropic's format, as Anthropic's API names its errors.
    pub fn anthropic_type(self) -> &'static str {
        match self {
            Class::Client(Fault::Unauthenticated) => "authentication_error",
            Class::Client(Fault::Forbidden) => "permission_error",
            Class::Client(Fault::NotFound) => "not_found_error",
            Class::Client(Fault::TooLarge) => "request_too_large",
            Class::Refused(Refusal::Limit | Refusal::Quota) => "rate_limit_error",
            Class::Refused(Refusal::Killed)
            | Class::Books
            | Class::Upstream(_)
            | Class::Internal
            | Class::Unknown => "api_error",
            Class::Client(_) | Class::Refused(Refusal::TooLarge) => "invalid_request_error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every class has the status, the Anthropic type and the OpenAI type that `docs/apis.md`
    /// names.
    #[test]
    fn each_class_has_its_status_and_types() {
        use Fault::*;
        let table = [
            (
                Class::Client(Invalid),
                400,
                "invalid_request_error",
                "invalid_request_error",
            ),
            (
                Class::Client(Unauthenticated),
                401,
                "authentication_error",
                "invalid_request_error",
            ),
            (
                Class::Client(Forbidden),
                403,
                "permission_error",
                "invalid_request_error",
            ),
            (
                Class::Client(NotFound),
                404,
                "not_found_error",
                "invalid_request_error",
            ),
            (
                Class::Client(TooSlow),
                408,
                "invalid_request_error",
                "invalid_request_error",
            ),
            (
                Class::Client(Conflict),
                409,
                "invalid_request_error",
                "invalid_request_error",
            ),
            (
                Class::Client(TooLarge),
                413,
                "request_too_large",
                "invalid_request_error",
            ),
            (
                Class::Client(Unprocessable),
                422,
                "invalid_request_error",
                "invalid_request_error",
            ),
            (
                Class::Refused(Refusal::Limit),
                429,
                "rate_limit_error",
                "rate_limit_error",
            ),
            (
                Class::Refused(Refusal::Quota),
                429,
                "rate_limit_error",
                "insufficient_quota",
            ),
            (
                Class::Refused(Refusal::TooLarge),
                400,
                "invalid_request_error",
                "invalid_request_error",
            ),
            (
                Class::Refused(Refusal::Killed),
                503,
                "api_error",
                "service_unavailable",
            ),
            (Class::Books, 503, "api_error", "service_unavailable"),
            (
                Class::Upstream(Upstream::Failed),
                502,
                "api_error",
                "upstream_error",
            ),
            (
                Class::Upstream(Upstream::Timeout),
                504,
                "api_error",
                "upstream_error",
            ),
            (Class::Internal, 500, "api_error", "server_error"),
            (Class::Unknown, 500, "api_error", "api_error"),
        ];
        for (class, status, anthropic, openai) in table {
            assert_eq!(class.status().as_u16(), status, "{class:?}");
            assert_eq!(class.anthropic_type(), anthropic, "{class:?}");
            assert_eq!(class.openai_type(), openai, "{class:?}");
        }
    }
}
