#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use sha2::{Digest, Sha256};

#[test]
fn the_pinned_catalog_is_the_file_its_digest_names() {
    let digest = Sha256::digest(PINNED.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, PINNED_SHA256.trim());
}

/// A JSON number's decimal text (`2.5e-06`, `0.000003`) times 10^shift, exactly, by moving
/// the decimal point: an oracle that shares no arithmetic with the parser's.
fn shifted(text: &str, shift: i64) -> Option<u64> {
    let (mantissa, exp) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i64>().ok()?),
        None => (text, 0),
    };
    let (whole, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all = format!("{whole}{frac}");
    let digits = all.trim_start_matches('0');
    let lead = (all.len() - digits.len()) as i64;
    let point = whole.len() as i64 + exp + shift - lead;
    if digits.is_empty() {
        return Some(0);
    }
    if point <= 0 {
        // Below one micro-dollar: rounds to 0 or 1.
        return Some(u64::from(point == 0 && digits.as_bytes()[0] >= b'5'));
    }
    let point = point as usize;
    let (int, rest) = if digits.len() > point {
        digits.split_at(point)
    } else {
        (digits, "")
    };
    let mut n: u64 = format!("{int:0<point$}").parse().ok()?;
    if rest.as_bytes().first().is_some_and(|d| *d >= b'5') {
        n += 1;
    }
    Some(n)
}

#[test]
fn every_models_base_price_is_its_dollars_per_token_in_micro_dollars_per_million() {
    let raw: serde_json::Value = serde_json::from_str(PINNED).unwrap();
    let catalog = Catalog::builtin();
    assert!(catalog.models.len() > 1000, "{}", catalog.models.len());
    let mut checked = 0;
    for (name, e) in &catalog.models {
        let r = &raw[name];
        let input = shifted(&r["input_cost_per_token"].to_string(), 12).unwrap();
        assert_eq!(e.base.input, input, "{name}");
        if let Some(o) = r.get("output_cost_per_token") {
            assert_eq!(
                e.base.output,
                shifted(&o.to_string(), 12).unwrap(),
                "{name}"
            );
        }
        if let Some(c) = r.get("cache_read_input_token_cost") {
            assert_eq!(e.base.cached_input, shifted(&c.to_string(), 12), "{name}");
        }
        checked += 1;
    }
    assert_eq!(checked, catalog.models.len());
}

#[test]
fn tiers_long_contexts_audio_and_tool_fees_are_read() {
    let raw: serde_json::Value = serde_json::from_str(PINNED).unwrap();
    let c = Catalog::builtin();
    let mut seen = [0usize; 6];
    for (name, e) in &c.models {
        let r = &raw[name];
        if let Some(p) = r.get("input_cost_per_token_priority") {
            assert_eq!(
                e.tiers["priority"].input,
                shifted(&p.to_string(), 12).unwrap()
            );
            seen[0] += 1;
        }
        if let Some(l) = &e.long {
            let key = format!("input_cost_per_token_above_{}k_tokens", l.above / 1000);
            assert_eq!(
                l.rates.input,
                shifted(&r[&key].to_string(), 12).unwrap(),
                "{name}"
            );
            seen[1] += 1;
        }
        if let Some(a) = r.get("input_cost_per_audio_token") {
            assert_eq!(e.audio_input, shifted(&a.to_string(), 12), "{name}");
            seen[2] += 1;
        }
        if let Some(w) = r["search_context_cost_per_query"].as_object() {
            let most = w.values().filter_map(|v| shifted(&v.to_string(), 6)).max();
            assert_eq!(e.web_search, most, "{name}");
            seen[3] += 1;
        }
        if e.provider == "openai" {
            let fee = &raw["openai/container"]["code_interpreter_cost_per_session"];
            assert_eq!(e.code_session, shifted(&fee.to_string(), 6), "{name}");
            seen[4] += 1;
        }
        if r.get("cache_creation_input_token_cost_above_1hr").is_some() {
            assert!(e.cache_write_1h.is_some(), "{name}");
            seen[5] += 1;
        }
    }
    assert!(seen.iter().all(|n| *n > 0), "{seen:?}");
}

#[test]
fn hostile_figures_are_left_out_and_a_model_without_input_is_not_priced() {
    let c = Catalog::parse(
        r#"{"a": {"input_cost_per_token": -1, "output_cost_per_token": 1e-6},
            "b": {"input_cost_per_token": 1e300, "output_cost_per_token": 1e-6},
            "c": {"input_cost_per_token": "2e-6"},
            "d": {"output_cost_per_token": 1e-6},
            "e": {"input_cost_per_token": 2e-6, "output_cost_per_token": -3,
                  "input_cost_per_token_above_abck_tokens": 1e-6,
                  "search_context_cost_per_query": {"low": "x"}}}"#,
    )
    .unwrap();
    assert_eq!(c.models.keys().collect::<Vec<_>>(), ["e"]);
    let e = &c.models["e"];
    assert_eq!((e.base.input, e.base.output), (2_000_000, 0));
    assert_eq!((e.long, e.web_search), (None, None));
    assert!(Catalog::parse("[1]").is_err());
    assert!(Catalog::parse("{").is_err());
}

#[test]
fn a_diff_names_each_figure_that_changed() {
    let a =
        Catalog::parse(r#"{"m": {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}}"#)
            .unwrap();
    let b = Catalog::parse(
        r#"{"m": {"input_cost_per_token": 1e-6, "output_cost_per_token": 3e-6},
            "n": {"input_cost_per_token": 1e-6}}"#,
    )
    .unwrap();
    let d = a.diff(&b);
    assert!(d.contains(&(
        "m".into(),
        "output".into(),
        Some(2_000_000),
        Some(3_000_000)
    )));
    assert!(d.contains(&("n".into(), "input".into(), None, Some(1_000_000))));
    assert_eq!(d.len(), 3, "{d:?}");
    assert!(a.diff(&a).is_empty());
}

use proptest::prelude::Strategy as _;

proptest::proptest! {
    /// The fuzz target's property on stable: any model entry of numbers, strings and nesting
    /// parses without panic, every figure within the bound, and a catalog's diff with itself
    /// is empty.
    #[test]
    fn any_entry_parses_within_the_bound(
        fields in proptest::collection::vec(
            (
                proptest::sample::select(vec![
                    "input_cost_per_token", "output_cost_per_token",
                    "cache_read_input_token_cost", "input_cost_per_token_priority",
                    "input_cost_per_token_above_200k_tokens", "input_cost_per_token_above_k_tokens",
                    "input_cost_per_audio_token", "search_context_cost_per_query",
                    "file_search_cost_per_1k_calls", "litellm_provider",
                ]),
                proptest::prop_oneof![
                    proptest::num::f64::ANY.prop_map(|f| f.to_string()),
                    (0u64..u64::MAX).prop_map(|n| n.to_string()),
                    proptest::prelude::Just("\"x\"".to_owned()),
                    proptest::prelude::Just("{\"a\": 1e-3, \"b\": -2}".to_owned()),
                    proptest::prelude::Just("null".to_owned()),
                ],
            ),
            0..8,
        )
    ) {
        let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
        let text = format!("{{\"m\": {{{}}}, \"p/container\": {{\"code_interpreter_cost_per_session\": 1e9}}}}", body.join(", "));
        if let Ok(c) = Catalog::parse(&text) {
            for e in c.models.values() {
                for (_, v) in e.figures() {
                    proptest::prop_assert!(v <= MAX_MICRO);
                }
            }
            proptest::prop_assert!(c.diff(&c).is_empty());
        }
    }
}
