//! Ledger arithmetic: sliding-window counting, budget periods, prices. Integers only, and every
//! function here has a line-for-line twin in the Redis Lua scripts.

use crate::clock::Millis;

mod calendar;
pub use calendar::{Calendar, Every, Zone};

/// Weights are in units of 1/`WEIGHT_SCALE`: the previous window's count is weighted by the
/// share of it that the sliding window still covers, rounded down to this resolution.
pub const WEIGHT_SCALE: u64 = 10_000;

/// A sliding-window counter: two fixed windows, the previous one weighted by overlap.
///
/// Memory is constant per scope whatever the attempt rate (a log of timestamps would grow with
/// an attacker's traffic, because rejected attempts count too).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateWindow {
    /// Start of the current fixed window (aligned to multiples of the window).
    pub start: Millis,
    /// Attempts in the current window.
    pub current: u64,
    /// Attempts in the previous window.
    pub previous: u64,
}

impl RateWindow {
    /// Rolls the window forward to `now` (never backwards).
    pub fn roll(&mut self, now: Millis, window: u64) {
        let start = now - now % window;
        if start <= self.start {
            return;
        }
        if start - self.start == window {
            self.previous = self.current;
        } else {
            self.previous = 0;
        }
        self.current = 0;
        self.start = start;
    }

    /// The weighted count at `now`, scaled by [`WEIGHT_SCALE`].
    pub fn scaled_count(&self, now: Millis, window: u64) -> u64 {
        let elapsed = now.saturating_sub(self.start).min(window);
        let weight = (window - elapsed) * WEIGHT_SCALE / window;
        self.previous.saturating_mul(weight) + self.current.saturating_mul(WEIGHT_SCALE)
    }

    /// Counts one attempt at `now` and says whether it is within `limit`.
    pub fn attempt(&mut self, now: Millis, window: u64, limit: u64) -> bool {
        self.roll(now, window);
        // Saturate well below the point where the scaled products could leave 2^53.
        self.current = (self.current + 1).min(COUNT_CAP);
        self.scaled_count(now, window) <= limit * WEIGHT_SCALE
    }

    /// Attempts left before the limit at `now` (after this attempt was counted).
    pub fn remaining(&self, now: Millis, window: u64, limit: u64) -> u64 {
        let used = self.scaled_count(now, window).div_ceil(WEIGHT_SCALE);
        limit.saturating_sub(used)
    }

    /// How long until one more attempt would be admitted, assuming none arrives before.
    pub fn retry_after(&self, now: Millis, window: u64, limit: u64) -> u64 {
        // The weighted count only falls as time passes, so the first admitting instant is found
        // by binary search over at most two windows.
        let admits = |t: Millis| {
            let mut w = *self;
            w.roll(t, window);
            (w.current + 1).min(COUNT_CAP) * WEIGHT_SCALE
                + w.previous.saturating_mul(weight_at(&w, t, window))
                <= limit * WEIGHT_SCALE
        };
        let horizon = self.start + 2 * window;
        if admits(now) {
            return 0;
        }
        let (mut lo, mut hi) = (now, horizon.max(now + 1));
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if admits(mid) { hi = mid } else { lo = mid }
        }
        hi - now
    }

    /// Whether the state can be forgotten at `now`: neither window still counts.
    pub fn is_stale(&self, now: Millis, window: u64) -> bool {
        now >= self.start + 2 * window
    }
}

fn weight_at(w: &RateWindow, t: Millis, window: u64) -> u64 {
    let elapsed = t.saturating_sub(w.start).min(window);
    (window - elapsed) * WEIGHT_SCALE / window
}

/// Counters saturate here: 2^31 attempts per window is already far past any limit.
pub const COUNT_CAP: u64 = 1 << 31;

/// A budget period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    /// Fixed-length periods aligned to the Unix epoch (a `day` is a UTC calendar day).
    Fixed(u64),
    /// UTC calendar months.
    CalendarMonth,
    /// Days, weeks, months, quarters or years in a time zone, from a chosen start.
    Calendar(Calendar),
}

const DAY_MS: u64 = 86_400_000;

impl Period {
    /// The period containing `now`: `(id, start, end)`.
    pub fn at(self, now: Millis) -> (u64, Millis, Millis) {
        match self {
            Period::Fixed(len) => {
                let id = now / len;
                (id, id * len, (id + 1) * len)
            }
            Period::CalendarMonth => {
                let (y, m, _) = civil_from_days(now / DAY_MS);
                let start = days_from_civil(y, m, 1) * DAY_MS;
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                let end = days_from_civil(ny, nm, 1) * DAY_MS;
                (y * 12 + (m - 1), start, end)
            }
            Period::Calendar(c) => {
                let (start, end) = c.at(now);
                (start, start, end)
            }
        }
    }

    /// The start and end of period `id` (as [`Period::at`] numbers them).
    pub fn span(self, id: u64) -> (Millis, Millis) {
        match self {
            Period::Fixed(len) => (
                id.saturating_mul(len),
                id.saturating_add(1).saturating_mul(len),
            ),
            Period::CalendarMonth => {
                let day = |y: u64, m: u64| days_from_civil(y, m, 1) * DAY_MS;
                let (y, m) = (id / 12, id % 12 + 1);
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                (day(y, m), day(ny, nm))
            }
            Period::Calendar(c) => (id, c.at(id).1),
        }
    }

    /// The id of the period just before period `id`.
    pub fn previous(self, id: u64) -> Option<u64> {
        match self {
            Period::Fixed(_) | Period::CalendarMonth => id.checked_sub(1),
            Period::Calendar(c) => {
                let (start, _) = c.at(id.checked_sub(1)?);
                (start < id).then_some(start)
            }
        }
    }

    /// The period a [`Period::label`] names.
    pub fn from_label(label: &str) -> Option<Self> {
        if label == "month" {
            return Some(Period::CalendarMonth);
        }
        if let Some(len) = label.strip_prefix("fixed:") {
            return len.parse().ok().filter(|l| *l > 0).map(Period::Fixed);
        }
        Calendar::from_label(label).map(Period::Calendar)
    }

    /// What the Redis scripts are given for this period at `now`: its length (0 for a UTC
    /// month, which they compute), or for a calendar in a zone the starts around `now`
    /// (`before,start,end,after`, see [`Calendar::around`]), among which they take the one
    /// containing their own clock's instant.
    pub fn script_arg(self, now: Millis) -> String {
        match self {
            Period::Fixed(len) => itoa::Buffer::new().format(len).to_owned(),
            Period::CalendarMonth => "0".to_owned(),
            Period::Calendar(c) => {
                let [a, b, e, f] = c.around(now);
                format!("{a},{b},{e},{f}")
            }
        }
    }

    /// A short name for keys and records: `fixed:86400000` or `month`. Made for every budget
    /// cell of a request (its store item, its ledger entry): written by `itoa`, since the
    /// formatting machinery costs several times as much as the rest of it.
    pub fn label(self) -> String {
        match self {
            Period::Fixed(len) => {
                let mut digits = itoa::Buffer::new();
                let digits = digits.format(len);
                let mut s = String::with_capacity(6 + digits.len());
                s.push_str("fixed:");
                s.push_str(digits);
                s
            }
            Period::CalendarMonth => "month".to_owned(),
            Period::Calendar(c) => c.label(),
        }
    }
}

/// Days since 1970-01-01 to a (year, month, day) in the proleptic Gregorian calendar
/// (H. Hinnant's algorithm, restricted to dates after the epoch).
pub fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

/// (year, month, day) to days since 1970-01-01, for dates from 1970 on.
pub fn days_from_civil(y: u64, m: u64, d: u64) -> u64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).saturating_sub(719_468)
}

/// The most tokens of one kind one request is charged: no provider bills a billion tokens for
/// one call, and below it every cost the ledger computes (a price of at most
/// [`crate::policy::MAX_LIMIT`] micro-units per million tokens) stays under 2^53, exact in the
/// Redis script's doubles.
pub const MAX_USAGE_TOKENS: u64 = 1_000_000_000;

/// Tokens used by a request, as reported at completion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// Input tokens, including cached ones.
    pub input_tokens: u64,
    /// Of which cached.
    #[serde(default)]
    pub cached_input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Of the input that was not read from a cache, the tokens written to the provider's prompt
    /// cache for five minutes (Anthropic's `cache_creation.ephemeral_5m_input_tokens`, or all
    /// of `cache_creation_input_tokens` without that breakdown): billed at 1.25 times the input
    /// price.
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// Of the same, the tokens written for one hour (`ephemeral_1h_input_tokens`): billed at
    /// twice the input price.
    #[serde(default)]
    pub cache_write_1h_tokens: u64,
    /// Tool calls the model emitted (chat `tool_calls`, the Responses API's function and
    /// built-in tool calls, Anthropic's `tool_use` and `server_tool_use` blocks): counted by
    /// the gateway from the answer, never taken from a number the upstream reports.
    #[serde(default)]
    pub tool_calls: u64,
    /// Micro-dollars a money budget is charged besides the token prices: the per-call fees of
    /// the tools the upstream runs, and what audio tokens and a long context cost above the
    /// text price ([`crate::policy::Charges::fees`]). Computed by the gateway from the price
    /// table; budgets in tokens or tool calls ignore it.
    #[serde(default)]
    pub fees: u64,
}

/// The most fees one request is charged: a hundred thousand dollars, far above any call a
/// provider prices, and below 2^53 with any token cost beside it.
pub const MAX_FEES: u64 = 100_000_000_000;

/// What a request uses that token prices do not cover: the calls of tools the upstream runs,
/// and audio input. At admission, the most the request allows; at settlement, what the answer
/// shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Metered {
    /// Web searches.
    pub web_searches: u64,
    /// File searches.
    pub file_searches: u64,
    /// Code-interpreter sessions.
    pub code_sessions: u64,
    /// Audio input tokens.
    pub audio_input_tokens: u64,
}

impl Usage {
    /// Input + output.
    pub fn total(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// Every number at most [`MAX_USAGE_TOKENS`]: usage comes from the upstream, and no number
    /// it reports may reach the books unbounded (the Redis script computes in doubles, exact
    /// only below 2^53, and formats a number past 2^63 as a negative one). Cached input stays
    /// within input, and cache writes within the input not read from a cache.
    #[must_use]
    pub fn bounded(self) -> Self {
        let max = MAX_USAGE_TOKENS;
        let input_tokens = self.input_tokens.min(max);
        let cached_input_tokens = self.cached_input_tokens.min(input_tokens);
        let uncached = input_tokens - cached_input_tokens;
        let cache_write_tokens = self.cache_write_tokens.min(uncached);
        let cache_write_1h_tokens = self
            .cache_write_1h_tokens
            .min(uncached - cache_write_tokens);
        Self {
            input_tokens,
            cached_input_tokens,
            output_tokens: self.output_tokens.min(max),
            cache_write_tokens,
            cache_write_1h_tokens,
            tool_calls: self.tool_calls.min(max),
            fees: self.fees.min(MAX_FEES),
        }
    }
}

/// Dollars as written by a person, `$12.50`, `50USD` or `0.000001 usd`, in micro-USD; `None`
/// for anything else (a bare number is not money: its unit would be a guess).
pub fn micro_usd(text: &str) -> Option<u64> {
    let lower = text.trim().to_ascii_lowercase();
    let d = lower
        .strip_prefix('$')
        .or_else(|| lower.strip_suffix("usd"))
        .map(str::trim)?;
    let (whole, frac) = d.split_once('.').unwrap_or((d, ""));
    if whole.is_empty() || !whole.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    if frac.len() > 6 || !frac.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let whole: u64 = whole.parse().ok()?;
    let frac: u64 = format!("{frac:0<6}").parse().ok()?;
    whole.checked_mul(1_000_000)?.checked_add(frac)
}

/// Micro-USD as dollars: at least two decimals, up to six (`$0.0125`, `$12.50`).
pub fn dollars(micro: u64) -> String {
    let (whole, frac) = (micro / 1_000_000, micro % 1_000_000);
    let mut f = format!("{frac:06}");
    while f.len() > 2 && f.ends_with('0') {
        f.pop();
    }
    format!("${whole}.{f}")
}

impl Price {
    /// Cost in micro-units, rounded up so that a budget is never under-charged.
    ///
    /// Prompt-cache writes are input billed at a multiple of the input price, by Anthropic's
    /// rule (also Bedrock's and Vertex's for Claude): 1.25 times for five minutes, twice for one
    /// hour. They are charged as input, plus a surcharge of a quarter or one whole input price,
    /// rounded up on its own (at most one micro-unit above the exact sum). The Redis ledger's
    /// `cost` computes the same. The usage's fees are added as they are.
    pub fn cost(&self, u: &Usage) -> u64 {
        let cached = u.cached_input_tokens.min(u.input_tokens);
        let fresh = u.input_tokens - cached;
        let micro_per_mtok = u128::from(fresh) * u128::from(self.input)
            + u128::from(cached) * u128::from(self.cached_input)
            + u128::from(u.output_tokens) * u128::from(self.output);
        // Writes are part of the fresh input; what the upstream reports beyond it is not charged.
        let w5 = u.cache_write_tokens.min(fresh);
        let w1h = u.cache_write_1h_tokens.min(fresh - w5);
        let quarters = (u128::from(w5) + 4 * u128::from(w1h)) * u128::from(self.input);
        let cost = micro_per_mtok.div_ceil(1_000_000)
            + quarters.div_ceil(4_000_000)
            + u128::from(u.fees.min(MAX_FEES));
        u64::try_from(cost).unwrap_or(u64::MAX)
    }
}

/// A price in micro-units per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Price {
    /// Input tokens.
    pub input: u64,
    /// Cached input tokens.
    pub cached_input: u64,
    /// Output tokens.
    pub output: u64,
}

#[cfg(test)]
mod tests;
