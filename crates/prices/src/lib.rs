//! The price catalog: LiteLLM's `model_prices_and_context_window.json` (MIT), a maintained public
//! table of what each model costs, pinned in this crate by its SHA-256 and read into whole
//! micro-dollars. It is the base of a policy's prices; the operator's `[policy.prices]` overrides
//! it model by model.
//!
//! What is read, per model: the input, cached-input and output prices; prompt-cache writes (five
//! minutes and one hour); the `priority`, `flex` and `batch` tiers; the long-context price above
//! a number of input tokens; audio tokens in and out; web search per call (the dearest search
//! context size); file search per call. A provider's code-interpreter session fee is read from
//! its `{provider}/container` entry. Anything else in the file is left alone. A figure that is
//! not a finite, non-negative number of dollars, or is above a million dollars per million
//! tokens, is left out, and a model without an input price is not in the catalog.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::{Map, Value};

/// The pinned catalog as shipped.
pub const PINNED: &str = include_str!("../catalog/model_prices_and_context_window.json");

/// The pinned catalog's SHA-256 (hex), as `scripts/update-prices` wrote it.
pub const PINNED_SHA256: &str =
    include_str!("../catalog/model_prices_and_context_window.json.sha256");

/// Where the pinned catalog came from.
pub const PINNED_SOURCE: &str = include_str!("../catalog/SOURCE");

/// The most a figure may be, in micro-dollars per million tokens or per call: a million dollars.
pub const MAX_MICRO: u64 = 1_000_000_000_000;

/// Prices in micro-dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rates {
    /// Input tokens.
    pub input: u64,
    /// Input tokens read from the provider's prompt cache, where the catalog states it.
    pub cached_input: Option<u64>,
    /// Output tokens.
    pub output: u64,
}

/// The price above a number of input tokens (a long context).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LongContext {
    /// Input tokens above which the whole request is billed at `rates`.
    pub above: u64,
    /// The prices then.
    pub rates: Rates,
}

/// One model's prices.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Entry {
    /// The provider as the catalog names it (`openai`, `anthropic`, ...).
    pub provider: String,
    /// The standard tier's prices.
    pub base: Rates,
    /// Prompt-cache writes for five minutes, and for one hour.
    pub cache_write: Option<u64>,
    /// Prompt-cache writes kept for one hour.
    pub cache_write_1h: Option<u64>,
    /// Service tiers by the name a request gives them: `priority`, `flex`, `batch`.
    pub tiers: BTreeMap<&'static str, Rates>,
    /// The long-context price, where the model has one.
    pub long: Option<LongContext>,
    /// Audio input tokens (micro-dollars per million).
    pub audio_input: Option<u64>,
    /// Audio output tokens (micro-dollars per million).
    pub audio_output: Option<u64>,
    /// One web search call (micro-dollars).
    pub web_search: Option<u64>,
    /// One file search call (micro-dollars).
    pub file_search: Option<u64>,
    /// One code-interpreter session (micro-dollars), from the provider's container entry.
    pub code_session: Option<u64>,
}

impl Entry {
    /// Every figure, named as `tollgate prices` shows it, in micro-dollars (per million tokens,
    /// or per call or session for the tool fees).
    pub fn figures(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        let mut rates = |prefix: &str, r: &Rates| {
            out.push((format!("{prefix}input"), r.input));
            if let Some(c) = r.cached_input {
                out.push((format!("{prefix}cached_input"), c));
            }
            out.push((format!("{prefix}output"), r.output));
        };
        rates("", &self.base);
        for (tier, r) in &self.tiers {
            rates(&format!("tier {tier}: "), r);
        }
        if let Some(l) = &self.long {
            rates(&format!("above {} input tokens: ", l.above), &l.rates);
        }
        let optional = [
            ("cache_write_5m", self.cache_write),
            ("cache_write_1h", self.cache_write_1h),
            ("audio_input", self.audio_input),
            ("audio_output", self.audio_output),
            ("web_search per call", self.web_search),
            ("file_search per call", self.file_search),
            ("code_interpreter per session", self.code_session),
        ];
        for (name, v) in optional {
            if let Some(v) = v {
                out.push((name.to_owned(), v));
            }
        }
        out
    }
}

/// A catalog: its models' prices.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Catalog {
    /// Prices by the model's name as requests give it.
    pub models: BTreeMap<String, Entry>,
}

impl Catalog {
    /// The pinned catalog, read once.
    pub fn builtin() -> &'static Catalog {
        static BUILTIN: OnceLock<Catalog> = OnceLock::new();
        BUILTIN.get_or_init(|| Catalog::parse(PINNED).unwrap_or_default())
    }

    /// A catalog in LiteLLM's format; an error when the text is not a JSON object.
    pub fn parse(text: &str) -> Result<Catalog, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let all = v
            .as_object()
            .ok_or("not a JSON object of models".to_owned())?;
        // Code-interpreter sessions are priced per provider, in an entry of their own.
        let mut sessions = BTreeMap::new();
        for (name, e) in all {
            if let (Some(provider), Some(fee)) = (
                name.strip_suffix("/container"),
                e.get("code_interpreter_cost_per_session").and_then(dollars),
            ) {
                sessions.insert(provider.to_owned(), fee);
            }
        }
        let mut models = BTreeMap::new();
        for (name, e) in all {
            let Some(e) = e.as_object() else { continue };
            if name == "sample_spec" || name.ends_with("/container") {
                continue;
            }
            if let Some(mut entry) = entry(e) {
                entry.code_session = sessions.get(&entry.provider).copied();
                models.insert(name.clone(), entry);
            }
        }
        Ok(Catalog { models })
    }

    /// The models whose figures differ between `self` (before) and `after`: (model, figure,
    /// before, after), a figure absent on one side as `None`.
    pub fn diff(&self, after: &Catalog) -> Vec<(String, String, Option<u64>, Option<u64>)> {
        let mut out = Vec::new();
        let names: std::collections::BTreeSet<&String> =
            self.models.keys().chain(after.models.keys()).collect();
        for name in names {
            let figures = |c: &Catalog| -> BTreeMap<String, u64> {
                c.models
                    .get(name)
                    .map(|e| e.figures().into_iter().collect())
                    .unwrap_or_default()
            };
            let (a, b) = (figures(self), figures(after));
            let fields: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for f in fields {
                let (x, y) = (a.get(f).copied(), b.get(f).copied());
                if x != y {
                    out.push((name.clone(), f.clone(), x, y));
                }
            }
        }
        out
    }
}

/// Dollars (a JSON number) as whole micro-dollars, rounded to the nearest; `None` when not a
/// finite, non-negative number within [`MAX_MICRO`] micro-dollars.
fn dollars(v: &Value) -> Option<u64> {
    micro(v, 1e6)
}

/// Dollars per token as micro-dollars per million tokens.
fn per_mtok(v: &Value) -> Option<u64> {
    micro(v, 1e12)
}

fn micro(v: &Value, scale: f64) -> Option<u64> {
    let x = v.as_f64()? * scale;
    // Within the bound, the cast below is exact for a whole number and saturates nowhere.
    (x.is_finite() && x >= 0.0 && x <= MAX_MICRO as f64).then(|| x.round() as u64)
}

/// A model's rates under `suffix` (`""`, `_priority`, `_above_200k_tokens`...).
fn rates(e: &Map<String, Value>, suffix: &str) -> Option<Rates> {
    let get = |k: &str| e.get(&format!("{k}{suffix}")).and_then(per_mtok);
    Some(Rates {
        input: get("input_cost_per_token")?,
        cached_input: get("cache_read_input_token_cost"),
        output: get("output_cost_per_token").unwrap_or(0),
    })
}

/// The smallest long-context threshold a model states (`input_cost_per_token_above_200k_tokens`).
fn long_context(e: &Map<String, Value>) -> Option<LongContext> {
    let above = e
        .keys()
        .filter_map(|k| {
            k.strip_prefix("input_cost_per_token_above_")?
                .strip_suffix("k_tokens")?
                .parse::<u64>()
                .ok()
        })
        .min()?;
    let rates = rates(e, &format!("_above_{above}k_tokens"))?;
    Some(LongContext {
        above: above * 1000,
        rates,
    })
}

fn entry(e: &Map<String, Value>) -> Option<Entry> {
    let base = rates(e, "")?;
    let mut tiers = BTreeMap::new();
    for (tier, suffix) in [
        ("priority", "_priority"),
        ("flex", "_flex"),
        ("batch", "_batches"),
    ] {
        if let Some(r) = rates(e, suffix) {
            tiers.insert(tier, r);
        }
    }
    let web_search = e
        .get("search_context_cost_per_query")
        .and_then(Value::as_object)
        .and_then(|sizes| sizes.values().filter_map(dollars).max());
    Some(Entry {
        provider: e
            .get("litellm_provider")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
        base,
        cache_write: e.get("cache_creation_input_token_cost").and_then(per_mtok),
        cache_write_1h: e
            .get("cache_creation_input_token_cost_above_1hr")
            .and_then(per_mtok),
        tiers,
        long: long_context(e),
        audio_input: e.get("input_cost_per_audio_token").and_then(per_mtok),
        audio_output: e.get("output_cost_per_audio_token").and_then(per_mtok),
        web_search,
        file_search: e
            .get("file_search_cost_per_1k_calls")
            .and_then(dollars)
            .map(|k| k.div_ceil(1000)),
        code_session: None,
    })
}

#[cfg(test)]
mod tests;
