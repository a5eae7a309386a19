//! Decisions as values: an admission or a denial that names the control, the scope and when to
//! retry. HTTP status codes are chosen only at the edge.

use std::fmt;

use crate::clock::Millis;
use crate::scope::ScopeKey;

/// The six controls, then the two of agent operations, in the order they are checked. Their
/// strings are the reason codes used in logs, metrics, error bodies and replay output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// Attempts per sliding window.
    RequestRateLimit,
    /// Input tokens of one request.
    InputTokenLimit,
    /// Output-token cap of one request.
    OutputTokenLimit,
    /// Input + max output tokens of one request.
    TotalTokenLimit,
    /// The estimated cost of one request (input + max output at its price).
    RequestCostLimit,
    /// Unfinished requests at once.
    ConcurrencyLimit,
    /// Unfinished requests at once, of the slots a request's priority class may hold: the
    /// rest are kept for classes above it.
    CapacityReserved,
    /// Tokens or money per period.
    BudgetLimit,
    /// Tool calls per period (an agent operation's, usually): settled from the answers.
    ToolCallLimit,
    /// The same request repeated too often within a window, or the same tool call (name and
    /// arguments) repeated too often in a request's history.
    LoopDetected,
}

impl Reason {
    /// Every control in order.
    pub const ALL: [Reason; 10] = [
        Reason::RequestRateLimit,
        Reason::InputTokenLimit,
        Reason::OutputTokenLimit,
        Reason::TotalTokenLimit,
        Reason::RequestCostLimit,
        Reason::ConcurrencyLimit,
        Reason::CapacityReserved,
        Reason::BudgetLimit,
        Reason::ToolCallLimit,
        Reason::LoopDetected,
    ];

    /// The reason code.
    pub fn code(self) -> &'static str {
        match self {
            Reason::RequestRateLimit => "request_rate_limit",
            Reason::InputTokenLimit => "input_token_limit",
            Reason::OutputTokenLimit => "output_token_limit",
            Reason::TotalTokenLimit => "total_token_limit",
            Reason::RequestCostLimit => "request_cost_limit",
            Reason::ConcurrencyLimit => "concurrency_limit",
            Reason::CapacityReserved => "capacity_reserved",
            Reason::BudgetLimit => "budget_limit",
            Reason::ToolCallLimit => "tool_call_limit",
            Reason::LoopDetected => "loop_detected",
        }
    }

    /// Parses a reason code.
    pub fn from_code(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.code() == s)
    }

    /// What a client can do about this control's refusal.
    pub fn recourse(self) -> Recourse {
        match self {
            Reason::RequestRateLimit
            | Reason::ConcurrencyLimit
            | Reason::CapacityReserved
            | Reason::ToolCallLimit => Recourse::Wait,
            Reason::BudgetLimit => Recourse::Budget,
            Reason::InputTokenLimit
            | Reason::OutputTokenLimit
            | Reason::TotalTokenLimit
            | Reason::RequestCostLimit => Recourse::Shrink,
            Reason::LoopDetected => Recourse::Stop,
        }
    }

    /// The kind of limit the control sets, as a `RateLimit-Policy` name ends
    /// (`"<rule>-<kind>"`).
    pub fn limit_name(self) -> &'static str {
        match self {
            Reason::RequestRateLimit => "requests",
            Reason::InputTokenLimit => "input-tokens",
            Reason::OutputTokenLimit => "output-tokens",
            Reason::TotalTokenLimit => "total-tokens",
            Reason::RequestCostLimit => "request-cost",
            Reason::ConcurrencyLimit | Reason::CapacityReserved => "concurrency",
            Reason::BudgetLimit => "budget",
            Reason::ToolCallLimit => "tool-calls",
            Reason::LoopDetected => "loops",
        }
    }

    /// `n` in this control's unit, as a person reads it, money in dollars (a budget's amounts
    /// are in its scope's unit, which its refusal's edge knows; tokens here).
    pub fn amount(self, n: u64) -> String {
        let unit = match self {
            Reason::RequestRateLimit | Reason::LoopDetected => "requests",
            Reason::ConcurrencyLimit | Reason::CapacityReserved => "requests at once",
            Reason::ToolCallLimit => "tool calls",
            Reason::RequestCostLimit => return crate::ledger::dollars(n),
            Reason::InputTokenLimit
            | Reason::OutputTokenLimit
            | Reason::TotalTokenLimit
            | Reason::BudgetLimit => "tokens",
        };
        format!("{n} {unit}")
    }

    /// Whether the control's amount includes the request's input tokens (so that a refusal
    /// says how much of them the body itself does not hold).
    pub fn counts_input(self) -> bool {
        matches!(
            self,
            Reason::InputTokenLimit
                | Reason::TotalTokenLimit
                | Reason::RequestCostLimit
                | Reason::BudgetLimit
        )
    }

    /// Whether waiting can help. Token-size rejections are about the request itself, and a
    /// loop is not broken by sending it again later.
    pub fn is_retryable(self) -> bool {
        matches!(self.recourse(), Recourse::Wait | Recourse::Budget)
    }

    /// Whether the store decides it (and so whether it may fail open): all but the controls
    /// decided from the request alone.
    pub fn is_stateful(self) -> bool {
        self.recourse() != Recourse::Shrink
    }

    /// Whether an admission reports this control's state as a quota (`RateLimit` headers):
    /// the limits a client can wait on are the ones it plans against; a repeat counter of one
    /// request's own is not one.
    pub fn reports_quota(self) -> bool {
        self.is_retryable()
    }

    /// The control this reason is one of: a reserve refuses with a reason of its own, but its
    /// check is concurrency's lease, exempted and failed open with it.
    pub fn control(self) -> Reason {
        match self {
            Reason::CapacityReserved => Reason::ConcurrencyLimit,
            r => r,
        }
    }

    /// Position in the fixed order (0-based).
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// What a client can do about a refusal. Each API format's edge chooses its status and words
/// from it, so that a control's refusal is described by its reason alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recourse {
    /// Wait: the limit frees up or its window resets.
    Wait,
    /// Wait for the period to reset, or have the budget raised.
    Budget,
    /// Send a smaller request: sent again, it is refused again.
    Shrink,
    /// Stop: sending it again only repeats it.
    Stop,
}

impl Deny {
    /// What the refused request asked of its control, in words, with `amount` the request's
    /// amount said in its unit; empty when the limit says it all.
    pub fn asked(&self, amount: &str) -> String {
        let n = self.requested;
        match self.reason {
            Reason::BudgetLimit => format!("this request reserves {amount}"),
            Reason::ToolCallLimit => "each round reserves one tool call".to_owned(),
            Reason::LoopDetected if n > 1 => {
                format!("the most repeated tool call appears {n} times in one history")
            }
            Reason::LoopDetected => "an identical request".to_owned(),
            Reason::InputTokenLimit => format!("the request has {n} input tokens"),
            Reason::OutputTokenLimit => format!("the request asks for {n} output tokens"),
            Reason::TotalTokenLimit => {
                format!("the request has {n} input and maximum output tokens")
            }
            Reason::RequestCostLimit => {
                format!("the request's input and maximum output cost {amount}")
            }
            Reason::CapacityReserved => {
                "the rest of the scope's requests at once are kept for higher priority classes"
                    .to_owned()
            }
            Reason::RequestRateLimit | Reason::ConcurrencyLimit => String::new(),
        }
    }
}

/// A refusal: the first control that failed, where, and what the client may do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deny {
    /// The first failing control.
    pub reason: Reason,
    /// The scope where it failed.
    pub scope: ScopeKey,
    /// The limit of that control in that scope (requests, tokens, leases or budget units).
    pub limit: u64,
    /// What was left in that scope before this request (0 for the rate control, whose attempt is
    /// counted even when refused).
    pub remaining: u64,
    /// What the request asked for in the control's unit (1 for rate and concurrency).
    pub requested: u64,
    /// When a retry could succeed; `None` when waiting cannot help (token limits, or a request
    /// larger than the whole budget).
    pub retry_after_ms: Option<u64>,
    /// When the limit's window or period resets, if it has one.
    pub reset_after_ms: Option<u64>,
}

/// The state of one limit after an admission, for `RateLimit` and `x-ratelimit-*` headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    /// The control.
    pub reason: Reason,
    /// Which check of the plan: its place in the plan's `checks` (the plan's `scope_of`
    /// finds its scope). An index, not the scope
    /// key: cloning a shared key into every quota costs two atomic operations each.
    pub check: usize,
    /// The limit.
    pub limit: u64,
    /// What is left after this admission.
    pub remaining: u64,
    /// Window or period length in ms (`None` for concurrency).
    pub window_ms: Option<u64>,
    /// Until the window or period resets, in ms.
    pub reset_after_ms: Option<u64>,
}

/// An admitted request. Hold on to it: it must end in `settle` or `release` (or it expires and
/// is charged as the policy says).
#[must_use = "an admission holds leases and a reservation until settled or released"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The output cap to send upstream.
    pub max_output_tokens: u64,
    /// When leases and reservation expire unless renewed.
    pub expires_at: Millis,
    /// The remaining quota of every limited scope, in control order.
    pub quotas: Vec<Quota>,
    /// Admitted without the store (it was unreachable and the policy lets every control this
    /// request is subject to fail open): nothing reserved, nothing to settle.
    pub fail_open: bool,
}

/// A request stopped by the kill switch: nothing counted, nothing held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Killed {
    /// What was switched off: `all`, `tenant:<id>`, `key:<id>`, `model:<name>`, `user:<id>`,
    /// or `provider:<model>` (the provider's own rate limit, held until it resets).
    pub target: String,
    /// The operator's reason, shown to the client.
    pub reason: String,
    /// Until when, for a hold: the provider said its limit is reached until then, so no
    /// request is sent before (none for an operator's switch).
    pub until: Option<crate::clock::Millis>,
}

/// How a hold is kept in the kill switches' table: `hold <until ms> <reason>`, an instant of the
/// store's clock (each store turns a `hold-for <ms> <reason>` it is given into one). A hold
/// past its instant is no switch at all. A hold whose reason starts with `over <n> ` holds only
/// requests of more than `n` tokens (input and output cap): the provider said it has `n` left.
const HOLD: &str = "hold ";
const HOLD_FOR: &str = "hold-for ";
const OVER: &str = "over ";

impl Killed {
    /// For a hold, the ms from `now` (the gateway's clock) to its end, at least 1; `None` for
    /// an operator's switch.
    pub fn wait_ms(&self, now: crate::clock::Millis) -> Option<u64> {
        self.until.map(|until| until.saturating_sub(now).max(1))
    }

    /// The value to set for a hold of `for_ms` from when the store receives it, of every
    /// request, or only of those of more than `over` tokens.
    pub fn hold_for(for_ms: u64, over: Option<u64>, reason: &str) -> String {
        match over {
            Some(n) => format!("{HOLD_FOR}{for_ms} {OVER}{n} {reason}"),
            None => format!("{HOLD_FOR}{for_ms} {reason}"),
        }
    }

    /// A value to keep, given at the store's instant `now`: a `hold-for` made a `hold` until an
    /// instant; anything else as it is.
    pub fn anchored(value: &str, now: crate::clock::Millis) -> String {
        match value.strip_prefix(HOLD_FOR).and_then(|v| v.split_once(' ')) {
            Some((ms, reason)) => match ms.parse::<u64>() {
                Ok(ms) => format!("{HOLD}{} {reason}", now.saturating_add(ms)),
                Err(_) => value.to_owned(),
            },
            None => value.to_owned(),
        }
    }

    /// The switch `value` kept for `target` at the store's instant `now`, if it holds then for
    /// a request of `size` tokens (a store that checked both already passes `None`).
    pub fn kept(
        target: &str,
        value: &str,
        at: Option<(crate::clock::Millis, u64)>,
    ) -> Option<Self> {
        let hold = value.strip_prefix(HOLD).and_then(|v| {
            let (until, reason) = v.split_once(' ')?;
            Some((until.parse::<u64>().ok()?, reason))
        });
        // `over <n> <reason>`: the size it holds above, and the reason.
        let over = |reason: &str| {
            let (n, rest) = reason.strip_prefix(OVER)?.split_once(' ')?;
            Some((n.parse::<u64>().ok()?, rest.to_owned()))
        };
        match hold {
            Some((until, reason))
                if at.is_some_and(|(n, size)| {
                    n >= until || over(reason).is_some_and(|(o, _)| size <= o)
                }) =>
            {
                None
            }
            Some((until, reason)) => Some(Killed {
                target: target.to_owned(),
                reason: over(reason).map_or_else(|| reason.to_owned(), |(_, r)| r),
                until: Some(until),
            }),
            None => Some(Killed {
                target: target.to_owned(),
                reason: value.to_owned(),
                until: None,
            }),
        }
    }
}

/// The outcome of one admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Admitted: leases taken and budget reserved.
    Admit(Admitted),
    /// Refused: nothing held, only the attempt counted.
    Deny(Deny),
    /// Stopped by the kill switch, before any control (the attempt is not counted).
    Killed(Killed),
}

impl Decision {
    /// The denial, if any.
    pub fn deny(&self) -> Option<&Deny> {
        match self {
            Decision::Deny(d) => Some(d),
            Decision::Admit(_) | Decision::Killed(_) => None,
        }
    }
    /// The reason code, `admit`, `kill_switch`, or `upstream_rate_limited` for a provider's
    /// hold.
    pub fn code(&self) -> &'static str {
        match self {
            Decision::Deny(d) => d.reason.code(),
            Decision::Admit(_) => "admit",
            Decision::Killed(k) if k.until.is_some() => "upstream_rate_limited",
            Decision::Killed(_) => "kill_switch",
        }
    }
}
