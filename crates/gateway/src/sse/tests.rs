use super::*;

#[test]
fn streamed_tool_calls_count_once_each_in_every_format() {
    let mut chat = SseMeter::new("gpt-4o", false);
    chat.feed(concat!(
        "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}},{\"index\":1,\"id\":\"b\",\"function\":{\"name\":\"g\",\"arguments\":\"\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{}\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"delta\":{\"function_call\":{\"name\":\"h\",\"arguments\":\"\"}}}]}\n\n",
    ).as_bytes());
    assert_eq!(chat.tool_calls, 3);
    let mut responses = SseMeter::responses("gpt-4o");
    responses.feed(concat!(
        "data: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"message\"}}\n\n",
        "data: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"function_call\"}}\n\n",
        "data: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"web_search_call\"}}\n\n",
        "data: {\"type\":\"response.output_item.done\",\"item\":{\"type\":\"function_call\"}}\n\n",
    ).as_bytes());
    assert_eq!(responses.tool_calls, 2);
    let mut anthropic = SseMeter::anthropic("claude-sonnet-4");
    anthropic.feed(concat!(
        "data: {\"type\":\"content_block_start\",\"content_block\":{\"type\":\"text\"}}\n\n",
        "data: {\"type\":\"content_block_start\",\"content_block\":{\"type\":\"tool_use\"}}\n\n",
        "data: {\"type\":\"content_block_start\",\"content_block\":{\"type\":\"server_tool_use\"}}\n\n",
        "data: {\"type\":\"content_block_start\",\"content_block\":{\"type\":\"web_search_tool_result\"}}\n\n",
    ).as_bytes());
    assert_eq!(anthropic.tool_calls, 2);
}

#[test]
fn events_split_across_chunks_are_reassembled_and_usage_is_stripped() {
    let mut m = SseMeter::new("gpt-4o", true);
    let a = m.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hel");
    assert!(a.is_empty());
    let b = m.feed(b"lo\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n");
    let b = String::from_utf8_lossy(&b);
    assert!(b.contains("Hello"));
    assert!(!b.contains("usage"), "usage event removed: {b}");
    assert!(b.contains("[DONE]"));
    assert_eq!(m.usage, Some((5, 0, 1)));
    assert_eq!(m.counted_output, 1);
    assert!(m.done);
}

#[test]
fn anthropic_usage_comes_from_message_start_and_message_delta() {
    let mut m = SseMeter::anthropic("claude-sonnet-4");
    let events = concat!(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":7,\"cache_read_input_tokens\":20,\"cache_creation_input_tokens\":3,\"output_tokens\":1}}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{},\"usage\":{\"output_tokens\":2}}\n\n",
    );
    // Split mid-event: forwarded whole, nothing removed.
    let (a, b) = events.split_at(60);
    let mut out = m.feed(a.as_bytes()).to_vec();
    out.extend_from_slice(&m.feed(b.as_bytes()));
    assert_eq!(out, events.as_bytes());
    assert_eq!(m.usage, Some((30, 20, 2)));
    // The streamed text counted as output is counted (an estimate for Claude models).
    let hello = TokenCounter::default()
        .count_output("claude-sonnet-4", "Hello")
        .1;
    assert!(hello > 0);
    assert_eq!(m.counted_output, hello);
    assert!(!m.done);
    m.feed(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    assert!(m.done);
}

#[test]
fn anthropic_output_counts_text_thinking_and_tool_input() {
    let content = serde_json::json!([
        {"type": "thinking", "thinking": "Let me see.", "signature": "abc"},
        {"type": "text", "text": "Hello"},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Paris"}}
    ]);
    assert_eq!(
        anthropic_output_parts(&content).concat(),
        "Let me see.Hello{\"city\":\"Paris\"}"
    );
    let mut m = SseMeter::anthropic("claude-sonnet-4");
    m.feed(b"data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"Let me see.\"}}\n\n");
    let expected = TokenCounter::default()
        .count_output("claude-sonnet-4", "Let me see.")
        .1;
    assert!(expected > 0);
    assert_eq!(m.counted_output, expected);
}

/// Cache writes by their breakdown; without one, all five-minute; a breakdown that claims
/// more than the total is held to it.
#[test]
fn cache_writes_follow_anthropics_breakdown() {
    use serde_json::json;
    let w = |u: Value| anthropic_cache_writes(&u, &mut false);
    assert_eq!(w(json!({"input_tokens": 5})), (0, 0));
    assert_eq!(w(json!({"cache_creation_input_tokens": 70})), (70, 0));
    assert_eq!(
        w(json!({"cache_creation_input_tokens": 70, "cache_creation":
            {"ephemeral_5m_input_tokens": 30, "ephemeral_1h_input_tokens": 40}})),
        (30, 40)
    );
    assert_eq!(
        w(json!({"cache_creation": {"ephemeral_5m_input_tokens": 3,
            "ephemeral_1h_input_tokens": 4}})),
        (3, 4)
    );
    assert_eq!(
        w(json!({"cache_creation_input_tokens": 10, "cache_creation":
            {"ephemeral_1h_input_tokens": 40}})),
        (0, 10)
    );
}

#[test]
fn a_stream_cut_short_is_charged_the_reported_input() {
    let mut m = SseMeter::anthropic("claude-sonnet-4");
    // Before message_start: the estimate.
    assert_eq!(m.usage_so_far(99), (99, 0, 0));
    m.feed(b"data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":7,\"cache_read_input_tokens\":20,\"output_tokens\":1}}}\n\n");
    m.feed(b"data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n");
    assert_eq!(m.usage, None);
    assert_eq!(m.usage_so_far(99), (27, 20, m.counted_output));
    assert!(m.counted_output > 0);
}

#[test]
fn responses_usage_comes_from_the_last_event_and_output_is_counted_on_the_way() {
    let mut m = SseMeter::responses("gpt-4o");
    let events = concat!(
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"usage\":null}}\n\n",
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hello\"}\n\n",
        "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{\\\"a\\\":1}\"}\n\n",
    );
    let out = m.feed(events.as_bytes());
    assert_eq!(out, events.as_bytes(), "nothing removed");
    assert_eq!(m.response_id.as_deref(), Some("resp_1"));
    let counter = TokenCounter::default();
    let expected = counter.count_text("gpt-4o", "Hello", None).0
        + counter.count_text("gpt-4o", "{\"a\":1}", None).0;
    assert_eq!(m.counted_output, expected);
    // Audio deltas are base64: not counted as text.
    m.feed(b"data: {\"type\":\"response.audio.delta\",\"delta\":\"UklGRiQAAABXQVZFZm10IBAAAAABAAEA\"}\n\n");
    assert_eq!(m.counted_output, expected);
    // Cut short here: the estimate and what was streamed.
    assert_eq!((m.usage, m.usage_so_far(40)), (None, (40, 0, expected)));
    m.feed(b"event: response.incomplete\ndata: {\"type\":\"response.incomplete\",\"response\":{\"id\":\"resp_1\",\"usage\":{\"input_tokens\":37,\"input_tokens_details\":{\"cached_tokens\":5},\"output_tokens\":9}}}\n\n");
    assert_eq!(m.usage, Some((37, 5, 9)));
    assert!(m.done);
    let output = serde_json::json!([
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Think."}]},
        {"type": "function_call", "name": "f", "arguments": "{}"},
        {"type": "message", "content": [{"type": "output_text", "text": "Hi"}, {"type": "refusal", "refusal": "No"}]}
    ]);
    assert_eq!(responses_output_parts(&output).concat(), "Think.{}HiNo");
}

#[test]
fn usage_is_kept_when_the_client_asked() {
    let mut m = SseMeter::new("gpt-4o", false);
    let b = m.feed(
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\r\n\r\n",
    );
    assert!(String::from_utf8_lossy(&b).contains("usage"));
}
