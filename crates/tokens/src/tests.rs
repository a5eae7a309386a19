use super::*;

fn chat(model: &str, messages: &str) -> Vec<u8> {
    format!(r#"{{"model": "{model}", "messages": {messages}}}"#).into_bytes()
}

/// The six-message conversation of OpenAI's cookbook "How to count tokens with tiktoken".
const COOKBOOK: &str = r#"[
  {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English."},
  {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
  {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
  {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage."},
  {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to do better."},
  {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client deliverable."}
]"#;

fn count(model: &str, body: &[u8]) -> RequestCount {
    TokenCounter::default()
        .count(Format::ChatCompletions, body, None)
        .unwrap_or_else(|e| unreachable!("{model}: {e}"))
}

#[test]
fn cookbook_conversation_counts_as_published() {
    assert_eq!(count("gpt-4", &chat("gpt-4", COOKBOOK)).input_tokens, 129);
    assert_eq!(count("gpt-4o", &chat("gpt-4o", COOKBOOK)).input_tokens, 124);
    let c = count("gpt-4o", &chat("gpt-4o", COOKBOOK));
    assert!(c.exact);
    assert_eq!(c.encoding, "o200k_base");
}

#[test]
fn model_families_map_to_their_encodings() {
    let c = TokenCounter::default();
    for (m, e) in [
        ("gpt-4o-mini", "o200k_base"),
        ("gpt-4.1-nano", "o200k_base"),
        ("gpt-5", "o200k_base"),
        ("o3-mini", "o200k_base"),
        ("gpt-4-turbo", "cl100k_base"),
        ("gpt-3.5-turbo", "cl100k_base"),
        ("text-embedding-3-small", "cl100k_base"),
        ("claude-sonnet-4", "utf8_bytes"),
    ] {
        assert_eq!(c.counting_for(m).name(), e, "{m}");
    }
    // The byte bound is one token per UTF-8 byte: never below any byte-level vocabulary's count.
    let hindi = "भारत एक विशाल देश है";
    let (bound, exact) = c.count_text("house-model", hindi, None);
    assert_eq!((bound, exact), (hindi.len() as u64, false));
    let cl100k = c
        .clone()
        .with_model("house-model", Counting::Exact(Encoding::Cl100kBase))
        .count_text("house-model", hindi, None)
        .0;
    let estimate = c
        .clone()
        .with_model("house-model", Counting::Estimate)
        .count_text("house-model", hindi, None)
        .0;
    assert!(cl100k <= bound, "{cl100k} > {bound}");
    assert!(
        estimate < cl100k,
        "the estimate ({estimate}) can come out low ({cl100k})"
    );
    let c = c.with_model("my-llama", Counting::Exact(Encoding::Cl100kBase));
    assert_eq!(c.counting_for("my-llama").name(), "cl100k_base");
}

#[test]
fn image_costs_follow_the_published_examples() {
    // OpenAI's examples: 1024×1024 high → 765; 2048×4096 high → 1105; low → 85.
    assert_eq!(
        image_tokens("gpt-4o", Some("high"), Some((1024, 1024))).tokens,
        765
    );
    assert_eq!(
        image_tokens("gpt-4o", Some("high"), Some((2048, 4096))).tokens,
        1105
    );
    assert_eq!(
        image_tokens("gpt-4o", Some("low"), Some((4096, 8192))).tokens,
        85
    );
    let unknown = image_tokens("gpt-4o", None, None);
    assert_eq!((unknown.tokens, unknown.exact), (85 + 8 * 170, false));
}

#[test]
fn data_url_images_are_measured_from_their_header() {
    // A 1×1 PNG.
    let png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
    assert_eq!(
        image::data_url_size(&format!("data:image/png;base64,{png}")),
        Some((1, 1))
    );
    assert_eq!(
        image::data_url_size("https://example.invalid/cat.png"),
        None
    );
    let body = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{png}"}}}},{{"type":"text","text":"hi"}}]}}]}}"#
    );
    let c = count("gpt-4o", body.as_bytes());
    // 3 + "user" (1) + image (85 + 1 tile 170) + "hi" (1) + 3.
    assert_eq!(c.input_tokens, 3 + 1 + 255 + 1 + 3);
    assert!(c.exact);
}

#[test]
fn tools_follow_the_cookbook_rule() {
    let body = br#"{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {
          "city": {"type": "string", "description": "The city."},
          "unit": {"type": "string", "description": "Unit", "enum": ["c", "f"]}}}}}]}"#;
    let c = count("gpt-4o", body);
    let t = |s: &str| TokenCounter::default().count_text("gpt-4o", s, None).0;
    let expected = (3 + t("user") + t("hi") + 3)
        + 7
        + t("get_weather:Get the weather")
        + 3
        + 3
        + t("city:string:The city")
        + 3
        + (3 * 2 - 3)
        + t("c")
        + t("f")
        + t("unit:string:Unit")
        + 12;
    assert_eq!(c.input_tokens, expected);
    assert!(c.exact);
}

#[test]
fn max_output_fields_and_formats() {
    let c = TokenCounter::default();
    let b = br#"{"model":"gpt-4o","max_completion_tokens":9,"max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#;
    assert_eq!(
        c.count(Format::ChatCompletions, b, None)
            .map(|r| r.max_output_tokens),
        Ok(Some(9))
    );
    let b = br#"{"model":"gpt-3.5-turbo-instruct","prompt":["hello world", "bye"],"max_tokens":7}"#;
    let r = c
        .count(Format::Completions, b, None)
        .unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!((r.input_tokens, r.max_output_tokens), (3, Some(7)));
    let b = br#"{"model":"text-embedding-3-small","input":[[1,2,3],[4]]}"#;
    let r = c
        .count(Format::Embeddings, b, None)
        .unwrap_or_else(|e| unreachable!("{e}"));
    assert_eq!((r.input_tokens, r.max_output_tokens), (4, None));
    let b = br#"{"model":"claude-sonnet-4","max_tokens":100,"system":"Be brief.","messages":[{"role":"user","content":[{"type":"text","text":"Hello"}]}]}"#;
    let r = c
        .count(Format::AnthropicMessages, b, None)
        .unwrap_or_else(|e| unreachable!("{e}"));
    assert!(!r.exact);
    assert_eq!(r.max_output_tokens, Some(100));
    assert!(r.input_tokens >= 3 + 1 + 1 + 3);
}

#[test]
fn errors_name_the_field() {
    let c = TokenCounter::default();
    let e = c.count(Format::ChatCompletions, br#"{"model":"gpt-4o","messages":[{"role":"user","content":"a"},{"role":"user","content":5}]}"#, None);
    assert_eq!(
        e.as_ref().err().and_then(|e| e.field()),
        Some("messages[1].content")
    );
    let e = c.count(
        Format::ChatCompletions,
        br#"{"model":"gpt-4o","messages":[]}"#,
        None,
    );
    assert_eq!(e.as_ref().err().and_then(|e| e.field()), Some("messages"));
    let e = c.count(
        Format::ChatCompletions,
        br#"{"model":"gpt-4o","messages":[{"role":"user","content":"a"}],"max_tokens":-1}"#,
        None,
    );
    assert!(
        matches!(e, Err(RequestError::Json(m)) if m.contains("max_tokens") || m.contains("invalid value"))
    );
    assert!(
        c.count(Format::ChatCompletions, b"{not json", None)
            .is_err()
    );
    assert!(
        c.count(
            Format::Embeddings,
            br#"{"model":"m","input":{"a":1}}"#,
            None
        )
        .is_err()
    );
}

#[test]
fn responses_messages_count_as_their_chat_equivalent() {
    let c = TokenCounter::default();
    let responses = |body: &str| {
        c.count(Format::Responses, body.as_bytes(), None)
            .unwrap_or_else(|e| unreachable!("{e}"))
    };
    // A string input is one user message; `instructions` a system message before it.
    let r = responses(r#"{"model":"gpt-4o","input":"Hello there!","max_output_tokens":50}"#);
    let chat_body = chat("gpt-4o", r#"[{"role":"user","content":"Hello there!"}]"#);
    assert_eq!(r.input_tokens, count("gpt-4o", &chat_body).input_tokens);
    assert_eq!(r.max_output_tokens, Some(50));
    assert!(!r.exact, "no published rule: flagged as an estimate");
    let r = responses(
        r#"{"model":"gpt-4o","instructions":"Be brief.","stream":true,
            "input":[{"role":"user","content":[{"type":"input_text","text":"Hello there!"}]},
                     {"type":"message","role":"assistant","content":[{"type":"output_text","text":"Hi."}]}]}"#,
    );
    let chat_body = chat(
        "gpt-4o",
        r#"[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello there!"},
            {"role":"assistant","content":"Hi."}]"#,
    );
    assert_eq!(r.input_tokens, count("gpt-4o", &chat_body).input_tokens);
    assert!(r.stream);
    // Function tools follow the chat rule for functions (flat in this API).
    let tool = r#"{"name":"get_weather","description":"Weather.","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}"#;
    let r = responses(&format!(
        r#"{{"model":"gpt-4o","input":"x","tools":[{{"type":"function",{}}}]}}"#,
        &tool[1..tool.len() - 1]
    ));
    let chat_tools = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"x"}}],"tools":[{{"type":"function","function":{tool}}}]}}"#
    );
    assert_eq!(
        r.input_tokens,
        count("gpt-4o", chat_tools.as_bytes()).input_tokens
    );
}

#[test]
fn responses_items_tools_and_errors() {
    let c = TokenCounter::default();
    let n = |body: &str| c.count(Format::Responses, body.as_bytes(), None);
    let base = n(r#"{"model":"gpt-4o","input":[]}"#).map(|r| r.input_tokens);
    assert_eq!(base, Ok(3), "only the reply priming");
    // Function calls and their outputs, reasoning items and built-in tools all count.
    for body in [
        r#"{"model":"gpt-4o","input":[{"type":"function_call","call_id":"c1","name":"f","arguments":"{\"a\":1}"}]}"#,
        r#"{"model":"gpt-4o","input":[{"type":"function_call_output","call_id":"c1","output":"sunny"}]}"#,
        r#"{"model":"gpt-4o","input":[{"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"thought"}]}]}"#,
        r#"{"model":"gpt-4o","input":[],"tools":[{"type":"web_search"}]}"#,
        r#"{"model":"gpt-4o","input":[],"text":{"format":{"type":"json_schema","name":"x","schema":{}}}}"#,
    ] {
        let r = n(body).map(|r| r.input_tokens);
        assert!(r.as_ref().is_ok_and(|t| *t > 3), "{body}: {r:?}");
    }
    // An image's tiles, as in chat.
    let img = n(
        r#"{"model":"gpt-4o","input":[{"role":"user","content":[{"type":"input_image","image_url":"https://example.com/a.png","detail":"low"}]}]}"#,
    );
    assert_eq!(img.map(|r| r.input_tokens), Ok(3 + 1 + 85 + 3));
    // Errors name the field.
    for (body, field) in [
        (r#"{"model":"gpt-4o","input":5}"#, "input"),
        (
            r#"{"model":"gpt-4o","input":[{"content":"x"}]}"#,
            "input[0].role",
        ),
        (
            r#"{"model":"gpt-4o","input":[{"role":"user"}]}"#,
            "input[0].content",
        ),
        (
            r#"{"model":"gpt-4o","input":[{"role":"user","content":[{"type":"input_text"}]}]}"#,
            "input[0].content[0].text",
        ),
        (
            r#"{"model":"gpt-4o","input":"x","instructions":7}"#,
            "instructions",
        ),
        (
            r#"{"model":"gpt-4o","input":"x","tools":[{"name":"f"}]}"#,
            "tools[0]",
        ),
    ] {
        let e = n(body);
        assert_eq!(
            e.as_ref().err().and_then(|e| e.field()),
            Some(field),
            "{body}"
        );
    }
    assert!(matches!(n(r#"{"input":"x"}"#), Err(RequestError::Json(_))));
}
