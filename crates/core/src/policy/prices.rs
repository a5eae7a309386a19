//! `[policy.prices]`: each model's price and the prices of its service tiers.

use std::collections::BTreeMap;

use super::{MAX_LIMIT, PolicyError, Price, RawPrice};

/// Model prices, and tier prices by model and tier.
type Prices = (
    BTreeMap<String, Price>,
    BTreeMap<String, BTreeMap<String, Price>>,
);

/// The price table, checked: every price at most [`MAX_LIMIT`], tiers one level deep.
pub(super) fn validate(raw: BTreeMap<String, RawPrice>, root: &str) -> Result<Prices, PolicyError> {
    let mut prices = BTreeMap::new();
    let mut tiers = BTreeMap::new();
    for (model, p) in raw {
        let path = format!("{root}.prices.{model:?}");
        let mut model_tiers = BTreeMap::new();
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
            model_tiers.insert(tier.clone(), price(t, &tpath)?);
        }
        prices.insert(model.clone(), price(&p, &path)?);
        if !model_tiers.is_empty() {
            tiers.insert(model, model_tiers);
        }
    }
    Ok((prices, tiers))
}

fn price(p: &RawPrice, path: &str) -> Result<Price, PolicyError> {
    for (field, v) in [("input", p.input), ("output", p.output)] {
        if v > MAX_LIMIT {
            return Err(PolicyError::new(
                format!("{path}.{field}"),
                format!("must be at most {MAX_LIMIT}"),
            ));
        }
    }
    Ok(Price {
        input: p.input,
        cached_input: p.cached_input.unwrap_or(p.input).min(MAX_LIMIT),
        output: p.output,
    })
}
