//! A failure as a value, up to the edge. [`ApiError`] says what happened (its class and code)
//! and holds what its words and headers are made from, in no API's format: a refusal's words
//! are made from its decision, its headers from its advice, and a field named by a control is
//! named by the dialect. Each dialect renders it in one place (`Dialect::error_response`); the
//! admin API, the limits and the layer answer in OpenAI's format ([`ApiError::openai_body`]).

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tollgate_core::{Deny, Quota, Unit};

use super::class::Class;
use super::{put, put_retry_after, quota_headers};

/// A failure as a value, up to the edge.
#[derive(Debug)]
pub struct ApiError {
    /// What kind of failure it is: the status and each format's `type` follow from it.
    pub class: Class,
    /// Tollgate's code for it (`code` in every format).
    pub code: String,
    /// What its message is made from.
    pub words: Words,
    /// The field at fault, if one is.
    pub param: Option<Param>,
    /// What its headers are made from.
    pub advice: Advice,
}

/// What an error's message is made from.
#[derive(Debug)]
pub enum Words {
    /// Said when the error was made, from its names and numbers: the same in every API.
    Said(String),
    /// A control's refusal: each number in its unit, and the wait as words and an instant.
    Denied(Box<Denied>),
    /// A kill switch on `target`, for `reason`.
    Killed {
        /// What is switched off.
        target: String,
        /// The operator's reason.
        reason: String,
    },
    /// A provider's own rate limit on `model`, held back for `wait_ms` more.
    Held {
        /// The model.
        model: String,
        /// What the provider said.
        reason: String,
        /// How long, from when the error was made.
        wait_ms: u64,
    },
}

/// A control's refusal, and what the request's count included.
#[derive(Debug)]
pub struct Denied {
    /// The decision.
    pub deny: Deny,
    /// The refusing budget's unit, if it is one.
    pub unit: Option<Unit>,
    /// What the input counted included besides the body: the earlier context the upstream
    /// keeps, what its tools may fetch, the documents named by reference.
    pub allowances: [u64; 3],
    /// Input tokens a money budget reserved at the one-hour cache-write price (0 when the
    /// refusing budget is not in money).
    pub cache_writes: u64,
}

/// The field an error names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Param {
    /// A field by the name the client sent.
    Field(String),
    /// The request's input (`messages` in Chat Completions): each dialect names it.
    Input,
    /// The request's output cap (`max_tokens` in Chat Completions): each dialect names it.
    OutputCap,
}

impl Param {
    /// Its name in Chat Completions, which the admin API and the layer use too.
    pub fn chat_name(&self) -> &str {
        match self {
            Param::Field(f) => f,
            Param::Input => "messages",
            Param::OutputCap => "max_tokens",
        }
    }
}

/// What an error's headers are made from.
#[derive(Debug, Default)]
pub struct Advice {
    /// How long to wait before a retry, in ms, as sent (`retry-after`, `retry-after-ms`).
    pub retry_after_ms: Option<u64>,
    /// Whether a retry cannot help (`x-should-retry: false`).
    pub no_retry: bool,
    /// The cause (`x-tollgate-reason`) and the scope it holds for (`x-tollgate-scope`).
    pub cause: Option<(&'static str, String)>,
    /// The refusing limit, stated as for an admitted request: its quota, rule and unit.
    pub limit: Option<(Quota, String, Option<Unit>)>,
}

impl ApiError {
    /// A new error, its message said now.
    pub fn new(class: Class, code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            class,
            code: code.into(),
            words: Words::Said(message.into()),
            param: None,
            advice: Advice::default(),
        }
    }

    /// 400 invalid request.
    pub fn invalid(code: &str, message: impl Into<String>) -> Self {
        Self::new(super::Class::Client(super::Fault::Invalid), code, message)
    }

    /// The HTTP status: chosen from the class, here only.
    pub fn status(&self) -> StatusCode {
        self.class.status()
    }

    /// With the field a client named.
    #[must_use]
    pub fn param(mut self, p: impl Into<String>) -> Self {
        self.param = Some(Param::Field(p.into()));
        self
    }

    /// With a wait before a retry, in ms.
    #[must_use]
    pub fn retry_after(mut self, ms: u64) -> Self {
        self.advice.retry_after_ms = Some(ms);
        self
    }

    /// Saying that a retry cannot help.
    #[must_use]
    pub fn no_retry(mut self) -> Self {
        self.advice.no_retry = true;
        self
    }

    /// What the error says, made now.
    pub fn message(&self) -> String {
        match &self.words {
            Words::Said(s) => s.clone(),
            Words::Denied(d) => d.words(),
            Words::Killed { target, reason } => {
                format!("Requests for {target} are switched off: {reason}")
            }
            Words::Held {
                model,
                reason,
                wait_ms,
            } => format!(
                "The provider's rate limit for model {model} is reached ({reason}); nothing was \
                 sent. Retry {}.",
                super::in_words(*wait_ms)
            ),
        }
    }

    /// The error's headers, the same in every format.
    pub fn headers(&self) -> HeaderMap {
        let a = &self.advice;
        let mut h = HeaderMap::new();
        if let Some((cause, scope)) = &a.cause {
            put(&mut h, "x-tollgate-reason", cause);
            put(&mut h, "x-tollgate-scope", scope);
        }
        if let Some((quota, rule, unit)) = &a.limit {
            quota_headers(&mut h, std::slice::from_ref(quota), |_| rule, |_| *unit);
        }
        if let Some(ms) = a.retry_after_ms {
            put_retry_after(&mut h, ms);
        }
        if a.no_retry {
            put(&mut h, "x-should-retry", "false");
        }
        h
    }

    /// The body in OpenAI's format, `{"error": {"message", "type", "param", "code"}}`, with a
    /// control's field named by `name`.
    pub fn openai_body(&self, name: impl Fn(&Param) -> String) -> serde_json::Value {
        json!({"error": {
            "message": self.message(),
            "type": self.class.openai_type(),
            "param": self.param.as_ref().map(name),
            "code": self.code,
        }})
    }

    /// The response, with `body`.
    pub fn response_with(&self, body: serde_json::Value) -> Response {
        let mut r = (self.status(), axum::Json(body)).into_response();
        r.headers_mut().extend(self.headers());
        r
    }
}

/// OpenAI's format, the fields named as Chat Completions names them (the admin API, the limits,
/// the layer).
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.response_with(self.openai_body(|p| p.chat_name().to_owned()))
    }
}
