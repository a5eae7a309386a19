//! Differential tests: counts equal `tiktoken-rs` token counts on generated text in many
//! scripts, for both encodings, and the bounded count agrees with the full count. Texts stay
//! short and free of long whitespace runs, away from tiktoken-rs's known panic (a regex stack
//! overflow on ~1 MB of spaces).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;
use tollgate_tokens::TokenCounter;

fn scripts() -> impl Strategy<Value = String> {
    let pieces = prop_oneof![
        "[a-zA-Z]{1,12}",
        "[0-9]{1,9}",
        "[ \t\n]{1,3}",
        "[.,;:!?'\"()\\[\\]{}<>/\\\\@#$%^&*_=+-]{1,4}",
        "[а-яА-ЯёЁ]{1,10}",           // Cyrillic
        "[\u{4e00}-\u{9fff}]{1,8}",   // CJK ideographs
        "[\u{3040}-\u{30ff}]{1,8}",   // kana
        "[\u{0600}-\u{06ff}]{1,8}",   // Arabic
        "[\u{0900}-\u{097f}]{1,8}",   // Devanagari
        "[\u{1f300}-\u{1f6ff}]{1,3}", // emoji
        "[\u{00c0}-\u{024f}]{1,6}",   // Latin with diacritics
        "'(s|t|re|ve|m|ll|d)",
        "(fn|let|def|return|class) [a-z_]{1,8}\\([a-z, ]{0,10}\\) ?[{:]",
        "\u{3000}{1,3}",
    ];
    proptest::collection::vec(pieces, 0..60).prop_map(|v| v.concat())
}

fn model_for(o200k: bool) -> &'static str {
    if o200k { "gpt-4o" } else { "gpt-4" }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn counts_equal_tiktoken(text in scripts(), o200k in any::<bool>()) {
        let reference = if o200k {
            tiktoken_rs::o200k_base_singleton().encode_ordinary(&text).len()
        } else {
            tiktoken_rs::cl100k_base_singleton().encode_ordinary(&text).len()
        } as u64;
        let (n, exact) = TokenCounter::default().count_text(model_for(o200k), &text, None);
        prop_assert_eq!(n, reference, "text {:?}", text);
        prop_assert!(exact);
    }

    #[test]
    fn bounded_count_agrees_with_full_count(text in scripts(), limit in 0u64..200, o200k in any::<bool>()) {
        let c = TokenCounter::default();
        let (full, _) = c.count_text(model_for(o200k), &text, None);
        let (bounded, _) = c.count_text(model_for(o200k), &text, Some(limit));
        if full <= limit {
            prop_assert_eq!(bounded, full);
        } else {
            prop_assert_eq!(bounded, limit + 1, "over the limit reads as limit + 1");
        }
    }
}
