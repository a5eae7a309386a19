//! `[policy.prices]` over the price catalog: each model's price, the prices of its service tiers,
//! and what it charges besides tokens ([`Charges`]). A model the operator prices takes the
//! operator's token prices; its tiers and charges are the operator's where written, else the
//! catalog's.

use std::collections::BTreeMap;

use tollgate_prices::{Catalog, Entry, Rates};

use serde::Deserialize;

use crate::ledger::{MAX_FEES, Metered, Price, Usage};
use crate::rule::{MAX_LIMIT, PolicyError};

/// What a model charges besides its token prices, in micro-units: per million tokens for audio
/// and the long context, per call or session for tools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charges {
    /// Audio input tokens, per million.
    pub audio_input: Option<u64>,
    /// One web search.
    pub web_search: Option<u64>,
    /// One file search.
    pub file_search: Option<u64>,
    /// One code-interpreter session.
    pub code_session: Option<u64>,
    /// Input tokens above which the whole request is billed at the second price.
    pub long: Option<(u64, Price)>,
}

impl Charges {
    /// The fees of usage `u` that used `m`, at standard price `price`: tool fees per call or
    /// session, audio tokens above the text input price, and the long-context price above the
    /// standard one when the input passes its threshold. `Err` names what the model has no price
    /// for (a money budget cannot reserve it).
    pub fn fees(&self, price: &Price, u: &Usage, m: &Metered) -> Result<u64, &'static str> {
        let per = |n: u64, fee: Option<u64>, what| match (n, fee) {
            (0, _) => Ok(0u128),
            (n, Some(f)) => Ok(u128::from(n) * u128::from(f)),
            (_, None) => Err(what),
        };
        let mut sum = per(m.web_searches, self.web_search, "web search")?
            + per(m.file_searches, self.file_search, "file search")?
            + per(m.code_sessions, self.code_session, "code interpreter")?;
        if m.audio_input_tokens > 0 {
            let audio = self.audio_input.ok_or("audio input")?;
            let above = u128::from(audio.saturating_sub(price.input));
            sum += (u128::from(m.audio_input_tokens) * above).div_ceil(1_000_000);
        }
        if let Some((_, long)) = self.long.filter(|(above, _)| u.input_tokens > *above) {
            let tokens = Usage { fees: 0, ..*u };
            sum += u128::from(long.cost(&tokens).saturating_sub(price.cost(&tokens)));
        }
        Ok(u64::try_from(sum).unwrap_or(MAX_FEES).min(MAX_FEES))
    }
}

/// How a request's fees are reckoned: its model's standard price and charges, and the most it
/// may use (what admission reserved for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeeRule {
    /// The model's standard price.
    pub price: Price,
    /// Its charges besides tokens.
    pub charges: Charges,
    /// The most the request may use.
    pub most: Metered,
}

impl FeeRule {
    /// The fees of usage `u` that used `used` (`None`: not known, so the most it may have);
    /// what the model has no price for is charged as the most it may use would be, failing
    /// that nothing (admission refused such a request under every money budget).
    pub fn fees(&self, u: &Usage, used: Option<&Metered>) -> u64 {
        let used = used.unwrap_or(&self.most);
        self.charges
            .fees(&self.price, u, used)
            .or_else(|_| self.charges.fees(&self.price, u, &self.most))
            .unwrap_or(0)
    }
}

/// A model's prices as the policy holds them.
#[derive(Debug, Clone)]
struct Priced {
    price: Price,
    tiers: BTreeMap<String, Price>,
    charges: Charges,
}

/// The policy's prices: the operator's, over the catalog unless it is switched off.
#[derive(Debug, Clone, Default)]
pub struct Prices {
    own: BTreeMap<String, Priced>,
    catalog: Option<&'static Catalog>,
}

/// Where a model's price comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `[policy.prices]`.
    Policy,
    /// The catalog.
    Catalog,
}

impl Prices {
    /// Whether no model has a price (no catalog, and no `[prices]`).
    pub fn is_empty(&self) -> bool {
        self.own.is_empty() && self.catalog.is_none_or(|c| c.models.is_empty())
    }

    fn entry(&self, model: &str) -> Option<&'static Entry> {
        self.catalog.and_then(|c| c.models.get(model))
    }

    /// The price of `model` at `tier` (`None`: the standard one), where known.
    pub fn price(&self, model: &str, tier: Option<&str>) -> Option<Price> {
        let own = self.own.get(model);
        match tier {
            None => own
                .map(|p| p.price)
                .or_else(|| self.entry(model).map(|e| price(&e.base))),
            Some(t) => own
                .and_then(|p| p.tiers.get(t).copied())
                .or_else(|| self.entry(model)?.tiers.get(t).map(price)),
        }
    }

    /// What `model` charges besides tokens: the operator's figures, else the catalog's.
    pub fn charges(&self, model: &str) -> Charges {
        let base = self.entry(model).map(charges).unwrap_or_default();
        let Some(own) = self.own.get(model) else {
            return base;
        };
        let c = own.charges;
        Charges {
            audio_input: c.audio_input.or(base.audio_input),
            web_search: c.web_search.or(base.web_search),
            file_search: c.file_search.or(base.file_search),
            code_session: c.code_session.or(base.code_session),
            long: c.long.or(base.long),
        }
    }

    /// Where `model`'s standard price comes from.
    pub fn source(&self, model: &str) -> Option<Source> {
        if self.own.contains_key(model) {
            Some(Source::Policy)
        } else {
            self.entry(model).map(|_| Source::Catalog)
        }
    }

    /// The models the operator priced.
    pub fn own_models(&self) -> impl Iterator<Item = &str> {
        self.own.keys().map(String::as_str)
    }
}

fn price(r: &Rates) -> Price {
    Price {
        input: r.input,
        cached_input: r.cached_input.unwrap_or(r.input),
        output: r.output,
    }
}

fn charges(e: &Entry) -> Charges {
    Charges {
        audio_input: e.audio_input,
        web_search: e.web_search,
        file_search: e.file_search,
        code_session: e.code_session,
        long: e.long.map(|l| (l.above, price(&l.rates))),
    }
}

/// The price table, checked, over the catalog `catalog` names: every price at most
/// [`MAX_LIMIT`], tiers one level deep.
pub(super) fn validate(
    raw: BTreeMap<String, RawPrice>,
    catalog: Option<&str>,
    root: &str,
) -> Result<Prices, PolicyError> {
    let catalog = match catalog {
        None | Some("builtin") => Some(Catalog::builtin()),
        Some("none") => None,
        Some(other) => {
            return Err(PolicyError::new(
                format!("{root}.price_catalog"),
                format!("unknown catalog {other:?}; expected \"builtin\" or \"none\""),
            ));
        }
    };
    let mut own = BTreeMap::new();
    for (model, p) in raw {
        let path = format!("{root}.prices.{model:?}");
        let mut tiers = BTreeMap::new();
        for (tier, t) in &p.tiers {
            let tpath = format!("{path}.tiers.{tier:?}");
            if !t.tiers.is_empty() {
                return Err(PolicyError::new(
                    format!("{tpath}.tiers"),
                    "a tier's price has no tiers of its own",
                ));
            }
            if tier.is_empty() {
                return Err(PolicyError::new(tpath, "a tier needs a name"));
            }
            if own_charges(t, &tpath)? != Charges::default() {
                return Err(PolicyError::new(
                    tpath,
                    "a tier has token prices only; tool, audio and long-context prices are the model's",
                ));
            }
            tiers.insert(
                tier.clone(),
                checked(t.input, t.cached_input, t.output, &tpath)?,
            );
        }
        let price = checked(p.input, p.cached_input, p.output, &path)?;
        let charges = own_charges(&p, &path)?;
        own.insert(
            model,
            Priced {
                price,
                tiers,
                charges,
            },
        );
    }
    Ok(Prices { own, catalog })
}

fn own_charges(p: &RawPrice, path: &str) -> Result<Charges, PolicyError> {
    for (field, v) in [
        ("audio_input", p.audio_input),
        ("web_search", p.web_search),
        ("file_search", p.file_search),
        ("code_session", p.code_session),
    ] {
        if v.is_some_and(|v| v > MAX_LIMIT) {
            return Err(PolicyError::new(
                format!("{path}.{field}"),
                format!("must be at most {MAX_LIMIT}"),
            ));
        }
    }
    let long = match p.long_context {
        None => None,
        Some(RawLongContext {
            above,
            input,
            cached_input,
            output,
        }) => Some((
            above,
            checked(input, cached_input, output, &format!("{path}.long_context"))?,
        )),
    };
    Ok(Charges {
        audio_input: p.audio_input,
        web_search: p.web_search,
        file_search: p.file_search,
        code_session: p.code_session,
        long,
    })
}

fn checked(input: u64, cached: Option<u64>, output: u64, path: &str) -> Result<Price, PolicyError> {
    for (field, v) in [("input", input), ("output", output)] {
        if v > MAX_LIMIT {
            return Err(PolicyError::new(
                format!("{path}.{field}"),
                format!("must be at most {MAX_LIMIT}"),
            ));
        }
    }
    Ok(Price {
        input,
        cached_input: cached.unwrap_or(input).min(MAX_LIMIT),
        output,
    })
}

/// A model's price, in micro-units (micro-USD by default) per million tokens.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrice {
    /// Input tokens.
    pub input: u64,
    /// Cached input tokens (defaults to the input price).
    pub cached_input: Option<u64>,
    /// Output tokens.
    pub output: u64,
    /// The prices of the model's service tiers, by the tier's name as the request states it
    /// (`priority`, `flex`; `inference_geo:us` for Anthropic's region): a request for a tier
    /// that has no price here is refused under a money budget.
    #[serde(default)]
    pub tiers: BTreeMap<String, RawPrice>,
    /// Audio input tokens, per million (the model's audio price, above its text price).
    pub audio_input: Option<u64>,
    /// One web search the upstream runs, in micro-units.
    pub web_search: Option<u64>,
    /// One file search the upstream runs, in micro-units.
    pub file_search: Option<u64>,
    /// One code-interpreter session (container) the upstream starts, in micro-units.
    pub code_session: Option<u64>,
    /// The price of a request whose input is above a number of tokens (the whole request is
    /// billed at it): `{ above = 200000, input = .., output = .. }`.
    pub long_context: Option<RawLongContext>,
}

/// A long-context price as written.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLongContext {
    /// Input tokens above which it applies.
    pub above: u64,
    /// Input tokens.
    pub input: u64,
    /// Cached input tokens (defaults to the input price).
    pub cached_input: Option<u64>,
    /// Output tokens.
    pub output: u64,
}
