//! Counting through a memo gives exactly the counts of counting from scratch: for every turn of
//! a generated conversation whose history is sent again each turn, in every format, with and
//! without a limit, for models of both vocabularies and an estimated one sharing one memo.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use tollgate_tokens::{Format, Memo, TokenCounter};

/// A memo that keeps everything, and counts its hits.
#[derive(Debug, Default)]
struct Kept {
    map: Mutex<HashMap<(&'static str, String), u64>>,
    hits: Mutex<u64>,
}

impl Memo for Kept {
    fn get(&self, vocabulary: &'static str, text: &str) -> Option<u64> {
        let n = self
            .map
            .lock()
            .unwrap()
            .get(&(vocabulary, text.to_owned()))
            .copied();
        if n.is_some() {
            *self.hits.lock().unwrap() += 1;
        }
        n
    }
    fn put(&self, vocabulary: &'static str, text: &str, tokens: u64) {
        self.map
            .lock()
            .unwrap()
            .insert((vocabulary, text.to_owned()), tokens);
    }
}

fn texts() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z]{1,12} ",
        "[0-9]{1,9}",
        "[ \t\n]{1,3}",
        "[а-яА-Я]{1,10} ",
        "[\u{4e00}-\u{9fff}]{1,8}",
        "(fn|let|def) [a-z_]{1,8}\\(\\) \\{\n",
    ];
    // Short ones (counted every time) and long ones (kept in the memo).
    prop_oneof![
        proptest::collection::vec(piece.clone(), 1..20).prop_map(|v| v.concat()),
        proptest::collection::vec(piece, 60..400).prop_map(|v| v.concat()),
    ]
}

fn body(format: Format, model: &str, history: &[String]) -> Vec<u8> {
    let messages: Vec<serde_json::Value> = history
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({"role": role, "content": t})
        })
        .collect();
    let v = match format {
        Format::Responses => serde_json::json!({"model": model, "input": messages}),
        Format::Completions => serde_json::json!({"model": model, "prompt": history}),
        Format::Embeddings => serde_json::json!({"model": model, "input": history}),
        _ => serde_json::json!({"model": model, "max_tokens": 10, "messages": messages}),
    };
    serde_json::to_vec(&v).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn a_memo_changes_no_count(
        pool in proptest::collection::vec(texts(), 1..6),
        picks in proptest::collection::vec(0usize..6, 1..12),
        // A limit as a share of each body's full count, so that it falls inside the body.
        share in prop_oneof![Just(None), (1u64..100).prop_map(Some)],
    ) {
        let memo = Arc::new(Kept::default());
        let plain = TokenCounter::default();
        let memoised = plain.with_memo(Some(memo.clone() as Arc<dyn Memo>));
        let history: Vec<String> = picks.iter().map(|i| pool[i % pool.len()].clone()).collect();
        for model in ["gpt-4o", "gpt-4", "some-unknown-model"] {
            for format in [
                Format::ChatCompletions,
                Format::AnthropicMessages,
                Format::Responses,
                Format::Completions,
                Format::Embeddings,
            ] {
                // Every turn sends the whole history again.
                for turn in 1..=history.len() {
                    let b = body(format, model, &history[..turn]);
                    let full = plain.count(format, &b, None).unwrap().input_tokens;
                    let limit = share.map(|p| (full * p / 100).max(1));
                    let want = plain.count(format, &b, limit);
                    let got = memoised.count(format, &b, limit);
                    prop_assert_eq!(format!("{got:?}"), format!("{want:?}"));
                }
            }
        }
        // The memo was used whenever a long text came again.
        let long_again = history.iter().filter(|t| t.len() >= tollgate_tokens::memo::MIN_BYTES).count() > 0;
        if long_again && share.is_none() {
            prop_assert!(*memo.hits.lock().unwrap() > 0);
        }
    }
}

/// A text kept with its count is over a limit below that count, as counted from scratch: the
/// memo's count is checked against what is left, not added blindly.
#[test]
fn a_kept_count_over_what_is_left_is_over() {
    let memo = Arc::new(Kept::default());
    let counter = TokenCounter::default().with_memo(Some(memo.clone() as Arc<dyn Memo>));
    let long = "the quick brown fox jumps over the lazy dog ".repeat(40);
    let b = body(
        Format::ChatCompletions,
        "gpt-4o",
        std::slice::from_ref(&long),
    );
    let full = counter.count(Format::ChatCompletions, &b, None).unwrap();
    assert!(!full.over_limit);
    // Now kept: a second request with it, under a limit below its count.
    let b2 = body(
        Format::ChatCompletions,
        "gpt-4o",
        &["short".to_owned(), long],
    );
    let plain = TokenCounter::default()
        .count(Format::ChatCompletions, &b2, Some(100))
        .unwrap();
    let kept = counter
        .count(Format::ChatCompletions, &b2, Some(100))
        .unwrap();
    assert!(plain.over_limit);
    assert_eq!(format!("{kept:?}"), format!("{plain:?}"));
    assert!(
        *memo.hits.lock().unwrap() > 0,
        "the second count used the memo"
    );
}
