//! The end of a stream the gateway cuts off at its output cap, written as the upstream would
//! have ended it there, so that a client's SDK finishes the answer as one cut by its cap.

use bytes::Bytes;
use serde_json::{Value, json};

use super::SseMeter;

/// The closing events of `m`'s stream, with its usage (input, cached input, output).
pub(super) fn cap_end(m: &SseMeter, (input, cached, output): (u64, u64, u64)) -> Bytes {
    let mut out = String::new();
    let mut event = |name: Option<&str>, data: &Value| {
        if let Some(n) = name {
            out.push_str("event: ");
            out.push_str(n);
            out.push('\n');
        }
        out.push_str("data: ");
        out.push_str(&data.to_string());
        out.push_str("\n\n");
    };
    if m.anthropic {
        if let Some(index) = m.open_block {
            event(
                Some("content_block_stop"),
                &json!({"type": "content_block_stop", "index": index}),
            );
        }
        event(
            Some("message_delta"),
            &json!({"type": "message_delta",
                "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                "usage": {"output_tokens": output}}),
        );
        event(Some("message_stop"), &json!({"type": "message_stop"}));
    } else if m.responses {
        let usage = json!({"input_tokens": input,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input.saturating_add(output)});
        event(
            Some("response.incomplete"),
            &json!({"type": "response.incomplete", "response": {
                "id": m.response_id, "object": "response", "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
                "model": m.model, "output": [], "usage": usage}}),
        );
    } else {
        let object = m.object.as_deref().unwrap_or("chat.completion.chunk");
        let completions = object == "text_completion";
        for index in 0..m.choices.max(1) {
            let choice = if completions {
                json!({"index": index, "text": "", "finish_reason": "length", "logprobs": null})
            } else {
                json!({"index": index, "delta": {}, "finish_reason": "length"})
            };
            event(
                None,
                &json!({"id": m.id, "object": object, "created": 0, "model": m.model,
                    "choices": [choice]}),
            );
        }
        if !m.strip_usage {
            event(
                None,
                &json!({"id": m.id, "object": object, "created": 0, "model": m.model,
                    "choices": [], "usage": {"prompt_tokens": input,
                    "completion_tokens": output, "total_tokens": input.saturating_add(output),
                    "prompt_tokens_details": {"cached_tokens": cached}}}),
            );
        }
        out.push_str("data: [DONE]\n\n");
    }
    Bytes::from(out)
}
