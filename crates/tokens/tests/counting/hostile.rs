//! Hostile inputs: none panics, none overflows the stack, and every verdict is right. How long
//! they take is measured in `benches/count.rs`, not here.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use tollgate_tokens::{Format, RequestError, TokenCounter};

const LIMIT: u64 = 8192;
const TEN_MB: usize = 10 * 1024 * 1024;

fn chat_with(content: &str) -> Vec<u8> {
    let body = serde_json::json!({
        "model": "gpt-4o",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": content}],
    });
    serde_json::to_vec(&body).unwrap()
}

fn over(content: &str) -> bool {
    let c = TokenCounter::default()
        .count(Format::ChatCompletions, &chat_with(content), Some(LIMIT))
        .unwrap();
    assert_eq!(
        c.over_limit,
        c.input_tokens > LIMIT,
        "over_limit agrees with the count"
    );
    c.over_limit
}

#[test]
fn ten_megabyte_runs_are_over_the_limit() {
    for unit in [" ", "\t", "a", "\u{3000}", "7", "🙂", "ab ", "\n"] {
        let s = unit.repeat(TEN_MB / unit.len());
        assert!(over(&s), "10 MB of {unit:?}");
    }
}

#[test]
fn runs_just_under_the_byte_bound_are_counted_exactly() {
    // 1 MB of spaces is the input that makes tiktoken-rs overflow its stack; here it is counted.
    let s = " ".repeat(1 << 20);
    let (n, _) = TokenCounter::default().count_text("gpt-4o", &s, None);
    assert!(n > 0 && n <= (1 << 20));
    // Exactly at the limit: a text of LIMIT tokens is not over.
    let s = "hello ".repeat(LIMIT as usize - 10);
    let (n, _) = TokenCounter::default().count_text("gpt-4o", &s, None);
    let (b, _) = TokenCounter::default().count_text("gpt-4o", &s, Some(n));
    assert_eq!(b, n);
    let (b, _) = TokenCounter::default().count_text("gpt-4o", &s, Some(n - 1));
    assert_eq!(b, n);
}

#[test]
fn random_bytes_as_text_are_handled() {
    // Pseudo-random code points (a fixed LCG; reproducible), lossily made into a string.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let bytes: Vec<u8> = (0..2_000_000)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect();
    let s = String::from_utf8_lossy(&bytes);
    assert!(over(&s));
    let head: String = s.chars().take(2000).collect();
    let (n, _) = TokenCounter::default().count_text("gpt-4o", &head, None);
    assert!(n > 0);
}

#[test]
fn deeply_nested_json_is_an_error_not_a_crash() {
    for depth in [200usize, 10_000, 1_000_000] {
        let body = format!(
            r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":{}1{}}}]}}"#,
            "[".repeat(depth),
            "]".repeat(depth)
        );
        let r =
            TokenCounter::default().count(Format::ChatCompletions, body.as_bytes(), Some(LIMIT));
        assert!(
            matches!(r, Err(RequestError::Json(_) | RequestError::Invalid { .. })),
            "depth {depth}"
        );
    }
}

#[test]
fn a_million_tiny_messages_stop_at_the_limit() {
    let one = r#"{"role":"user","content":"a"},"#;
    let mut body = String::from(r#"{"model":"gpt-4o","messages":["#);
    body.push_str(&one.repeat(300_000));
    body.push_str(r#"{"role":"user","content":"a"}]}"#);
    let c = TokenCounter::default()
        .count(Format::ChatCompletions, body.as_bytes(), Some(LIMIT))
        .unwrap();
    assert!(c.over_limit);
    assert_eq!(c.input_tokens, LIMIT + 1);
}

#[test]
fn escaped_strings_and_huge_numbers() {
    let s = "\\u0041".repeat(100_000);
    let body = format!(r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{s}"}}]}}"#);
    let c = TokenCounter::default()
        .count(Format::ChatCompletions, body.as_bytes(), None)
        .unwrap();
    assert!(c.input_tokens > 0);
    let body =
        br#"{"model":"gpt-4o","max_tokens":1e400,"messages":[{"role":"user","content":"a"}]}"#;
    assert!(
        TokenCounter::default()
            .count(Format::ChatCompletions, body, None)
            .is_err()
    );
    let body = br#"{"model":"gpt-4o","max_tokens":99999999999999999999999,"messages":[{"role":"user","content":"a"}]}"#;
    assert!(
        TokenCounter::default()
            .count(Format::ChatCompletions, body, None)
            .is_err()
    );
}

#[test]
fn wrong_types_everywhere_are_errors() {
    let c = TokenCounter::default();
    for body in [
        r#"[]"#,
        r#"{"model":1,"messages":[]}"#,
        r#"{"model":"gpt-4o","messages":"hi"}"#,
        r#"{"model":"gpt-4o","messages":[{"content":"no role"}]}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"a","tool_calls":[{"function":1}]}]}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"a"}],"tools":[{"function":{"description":"no name"}}]}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"a"}],"stream":"yes"}"#,
        "\u{0}",
        "",
    ] {
        assert!(
            c.count(Format::ChatCompletions, body.as_bytes(), Some(LIMIT))
                .is_err(),
            "{body}"
        );
    }
}

#[test]
fn responses_bodies_are_bounded_too() {
    let c = TokenCounter::default();
    let count = |body: serde_json::Value| {
        c.count(
            Format::Responses,
            &serde_json::to_vec(&body).unwrap(),
            Some(LIMIT),
        )
    };
    let big = "a".repeat(TEN_MB);
    for body in [
        serde_json::json!({"model": "gpt-4o", "input": big}),
        serde_json::json!({"model": "gpt-4o", "instructions": big, "input": "hi"}),
        serde_json::json!({"model": "gpt-4o", "input": [{"role": "user", "content": [{"type": "input_text", "text": big}]}]}),
        serde_json::json!({"model": "gpt-4o", "input": [{"type": "function_call_output", "call_id": "c", "output": big}]}),
        serde_json::json!({"model": "gpt-4o", "input": [{"type": "reasoning", "summary": big}]}),
    ] {
        let r = count(body).unwrap();
        assert!(
            r.over_limit && r.input_tokens == LIMIT + 1,
            "{}",
            r.input_tokens
        );
    }
    // A hundred thousand small messages: over the limit, and the count stops there.
    let items: Vec<_> = (0..100_000)
        .map(|_| serde_json::json!({"role": "user", "content": "hello"}))
        .collect();
    let r = count(serde_json::json!({"model": "gpt-4o", "input": items})).unwrap();
    assert!(r.over_limit, "{}", r.input_tokens);
    // An item nested 100,000 deep is skipped over by the parser without recursion (no stack
    // overflow) and counted from its text: over the limit.
    let deep = format!(
        r#"{{"model":"gpt-4o","input":[{{"type":"x","v":{}1{}}}]}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let r = c.count(Format::Responses, deep.as_bytes(), Some(LIMIT));
    assert!(r.as_ref().is_ok_and(|r| r.over_limit), "{r:?}");
    // As a message's content, the same nesting is the parser's error, named by field.
    let deep = format!(
        r#"{{"model":"gpt-4o","input":[{{"role":"user","content":[{}1{}]}}]}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let e = c.count(Format::Responses, deep.as_bytes(), Some(LIMIT));
    assert_eq!(
        e.as_ref().err().and_then(|e| e.field()),
        Some("input[0].content[0]"),
        "{e:?}"
    );
}
