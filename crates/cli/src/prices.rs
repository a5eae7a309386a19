//! `tollgate prices MODEL`: what a model costs under a policy, figure by figure, and where each
//! figure comes from (the policy's `[prices]`, or the pinned catalog); `tollgate prices diff A
//! B`: how two catalogs (files in LiteLLM's format, or `builtin`) differ.

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use tollgate_core::Policy;
use tollgate_core::ledger::dollars;
use tollgate_core::policy::{Charges, Price, PriceSource};
use tollgate_prices::Catalog;

/// Prints what `model` costs under the policy of `policy` (default: the pinned catalog alone).
pub fn show(model: &str, policy: Option<&Path>, out: &mut impl Write) -> anyhow::Result<()> {
    let policy = match policy {
        Some(p) => crate::whatif::load_policy(p)?,
        None => Policy::from_toml("")?,
    };
    let prices = &policy.prices;
    let Some(source) = prices.source(model) else {
        anyhow::bail!(
            "{model:?} has no price: not in [policy.prices], nor in the catalog ({} models); \
             a money budget refuses its requests",
            tollgate_prices::Catalog::builtin().models.len()
        );
    };
    let catalog = Catalog::builtin().models.get(model);
    let from = |same_as_catalog: bool| match (source, same_as_catalog) {
        (PriceSource::Catalog, _) | (PriceSource::Policy, true) => "catalog",
        (PriceSource::Policy, false) => "policy",
    };
    writeln!(out, "{model}")?;
    let standard = prices.price(model, None).unwrap_or(Price {
        input: 0,
        cached_input: 0,
        output: 0,
    });
    let cat_price = catalog.map(|e| (e.base.input, e.base.output));
    let std_from = from(cat_price == Some((standard.input, standard.output)));
    rates(out, "", &standard, std_from)?;
    for tier in ["priority", "flex", "batch"] {
        if let Some(p) = prices.price(model, Some(tier)) {
            let same = catalog
                .and_then(|e| e.tiers.get(tier))
                .is_some_and(|r| (r.input, r.output) == (p.input, p.output));
            rates(out, &format!("tier {tier}: "), &p, from(same))?;
        }
    }
    // Cache writes: the gateway charges them by Anthropic's rule, on the input price.
    let quarter = standard.input / 4;
    line(
        out,
        "cache write, 5 minutes",
        standard.input + quarter,
        "per million tokens",
        "1.25 × input",
    )?;
    line(
        out,
        "cache write, 1 hour",
        standard.input * 2,
        "per million tokens",
        "2 × input",
    )?;
    charges(out, &prices.charges(model), catalog.map(charges_of), &from)?;
    writeln!(
        out,
        "(catalog: {})",
        tollgate_prices::PINNED_SOURCE.lines().next().unwrap_or("")
    )?;
    Ok(())
}

fn charges_of(e: &tollgate_prices::Entry) -> Charges {
    Charges {
        audio_input: e.audio_input,
        web_search: e.web_search,
        file_search: e.file_search,
        code_session: e.code_session,
        long: None,
    }
}

fn charges(
    out: &mut impl Write,
    c: &Charges,
    catalog: Option<Charges>,
    from: &dyn Fn(bool) -> &'static str,
) -> anyhow::Result<()> {
    let cat = catalog.unwrap_or_default();
    let rows = [
        (
            "audio input",
            c.audio_input,
            cat.audio_input,
            "per million tokens",
        ),
        ("web search", c.web_search, cat.web_search, "per call"),
        ("file search", c.file_search, cat.file_search, "per call"),
        (
            "code interpreter",
            c.code_session,
            cat.code_session,
            "per session",
        ),
    ];
    for (name, v, in_catalog, unit) in rows {
        match v {
            Some(v) => line(out, name, v, unit, from(in_catalog == Some(v)))?,
            None => writeln!(out, "  {name:<28} no price: refused under a money budget")?,
        }
    }
    if let Some((above, p)) = c.long {
        rates(out, &format!("above {above} input tokens: "), &p, "")?;
    }
    Ok(())
}

fn rates(out: &mut impl Write, prefix: &str, p: &Price, from: &str) -> anyhow::Result<()> {
    line(
        out,
        &format!("{prefix}input"),
        p.input,
        "per million tokens",
        from,
    )?;
    line(
        out,
        &format!("{prefix}cached input"),
        p.cached_input,
        "per million tokens",
        from,
    )?;
    line(
        out,
        &format!("{prefix}output"),
        p.output,
        "per million tokens",
        from,
    )
}

fn line(
    out: &mut impl Write,
    name: &str,
    micro: u64,
    unit: &str,
    from: &str,
) -> anyhow::Result<()> {
    writeln!(out, "  {name:<28} {:>12} {unit:<19} {from}", dollars(micro))?;
    Ok(())
}

/// A catalog: `builtin`, or a file in LiteLLM's format.
fn catalog(arg: &str) -> anyhow::Result<Catalog> {
    if arg == "builtin" {
        return Ok(Catalog::builtin().clone());
    }
    let text = std::fs::read_to_string(arg).with_context(|| format!("reading {arg}"))?;
    Catalog::parse(&text).map_err(|e| anyhow::anyhow!("{arg}: {e}"))
}

/// Prints every figure that differs between catalogs `a` and `b`, one line each.
pub fn diff(a: &str, b: &str, out: &mut impl Write) -> anyhow::Result<()> {
    let (a, b) = (catalog(a)?, catalog(b)?);
    let changes = a.diff(&b);
    let shown = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), dollars);
    for (model, figure, before, after) in &changes {
        writeln!(
            out,
            "{model}  {figure}  {} -> {}",
            shown(*before),
            shown(*after)
        )?;
    }
    writeln!(out, "{} figures differ", changes.len())?;
    Ok(())
}
