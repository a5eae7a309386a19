//! Context that OpenAI's Responses API keeps upstream. A request that names an earlier
//! response (`previous_response_id`) or a conversation (`conversation`) is billed for that whole
//! context as input, though its body holds only the new turn: counting the body alone would let
//! a small request carry a huge input past the input-token limit and the budget's reservation.
//! So the gateway remembers, for each response it served, the context that a follow-up carries
//! (the response's input plus its output), by response id and by conversation id, and adds it to
//! a follow-up's counted input. Context it has not seen (served by another instance, forgotten,
//! referenced item by item, or a stored prompt) counts as `responses.unknown_context_tokens`.
//! Settlement charges what the upstream reports, so an estimate only moves the reservation.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;

/// Most contexts remembered; beyond it the oldest are forgotten (about 10 MB at 100 bytes each).
pub const REMEMBERED: usize = 100_000;

/// Response and conversation ids → the input tokens a follow-up carries.
#[derive(Debug, Default)]
pub struct Contexts {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    tokens: HashMap<String, u64>,
    /// Ids in the order they were first remembered, oldest first.
    order: VecDeque<String>,
}

impl Contexts {
    /// The context remembered for `id`.
    pub fn get(&self, id: &str) -> Option<u64> {
        self.inner.lock().ok()?.tokens.get(id).copied()
    }

    /// Remembers (or updates: a conversation grows) the context of `id`.
    pub fn remember(&self, id: &str, tokens: u64) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        if let Some(t) = inner.tokens.get_mut(id) {
            *t = tokens;
            return;
        }
        inner.tokens.insert(id.to_owned(), tokens);
        inner.order.push_back(id.to_owned());
        while inner.order.len() > REMEMBERED {
            if let Some(old) = inner.order.pop_front() {
                inner.tokens.remove(&old);
            }
        }
    }

    /// How many ids are remembered.
    pub fn len(&self) -> usize {
        self.inner.lock().map_or(0, |i| i.tokens.len())
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The conversation a Responses request belongs to: `conversation` as an id or as `{"id": …}`.
pub fn conversation_id(request: &Value) -> Option<&str> {
    let c = &request["conversation"];
    c.as_str().or(c["id"].as_str())
}

/// Input tokens of a Responses request that its body does not hold: the remembered context of
/// its `previous_response_id` or `conversation` (`unknown` for one not remembered), plus
/// `unknown` once for `item_reference` items or a stored `prompt`.
pub fn hidden_input(request: &Value, contexts: &Contexts, unknown: u64) -> u64 {
    let known_or = |id: Option<&str>| id.map_or(0, |id| contexts.get(id).unwrap_or(unknown));
    let earlier =
        known_or(request["previous_response_id"].as_str()).max(known_or(conversation_id(request)));
    let references = request["input"]
        .as_array()
        .is_some_and(|items| items.iter().any(|i| i["type"] == "item_reference"))
        || request["prompt"]["id"].is_string();
    earlier.saturating_add(if references { unknown } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn follow_ups_carry_what_was_remembered_and_unknown_context_counts_as_configured() {
        let c = Contexts::default();
        c.remember("resp_1", 500);
        c.remember("conv_1", 700);
        let hidden = |v: Value| hidden_input(&v, &c, 9_000);
        assert_eq!(hidden(json!({"input": "hi"})), 0);
        assert_eq!(hidden(json!({"previous_response_id": "resp_1"})), 500);
        assert_eq!(hidden(json!({"previous_response_id": "resp_x"})), 9_000);
        assert_eq!(hidden(json!({"conversation": "conv_1"})), 700);
        assert_eq!(hidden(json!({"conversation": {"id": "conv_1"}})), 700);
        assert_eq!(hidden(json!({"conversation": "conv_x"})), 9_000);
        assert_eq!(
            hidden(json!({"input": [{"type": "item_reference", "id": "msg_1"}]})),
            9_000
        );
        assert_eq!(
            hidden(json!({"previous_response_id": "resp_1", "prompt": {"id": "pmpt_1"}})),
            9_500
        );
        // A conversation grows: its context is replaced, not added to.
        c.remember("conv_1", 1_200);
        assert_eq!(hidden(json!({"conversation": "conv_1"})), 1_200);
    }

    #[test]
    fn memory_is_bounded_oldest_first() {
        let c = Contexts::default();
        for i in 0..REMEMBERED + 10 {
            c.remember(&format!("resp_{i}"), 1);
        }
        assert_eq!(c.len(), REMEMBERED);
        assert_eq!(c.get("resp_9"), None);
        assert_eq!(c.get("resp_10"), Some(1));
    }
}
