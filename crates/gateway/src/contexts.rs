//! Context that OpenAI's Responses API keeps upstream. A request that names an earlier
//! response (`previous_response_id`) or a conversation (`conversation`) is billed for that whole
//! context as input, though its body holds only the new turn: counting the body alone would let
//! a small request carry a huge input past the input-token limit and the budget's reservation.
//! So the gateway remembers, for each response it served, the context that a follow-up carries
//! (the response's input plus its output), by response id and by conversation id, and adds it to
//! a follow-up's counted input: in the Redis store, for every instance that shares it (for
//! `responses.context_ttl`); with the memory store, in [`Contexts`]. Context it has
//! not seen (served elsewhere, forgotten, referenced item by item, or a stored prompt) counts as
//! `responses.unknown_context_tokens`. Settlement charges what the upstream reports, so an
//! estimate only moves the reservation.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;

/// Most contexts remembered by the memory store's gateway; beyond it the oldest are forgotten,
/// so memory stays bounded whatever the number of conversations.
pub const REMEMBERED: usize = 100_000;

/// The longest response or conversation id kept or looked up (OpenAI's are about 50 bytes).
pub const MAX_ID_BYTES: usize = 256;

/// Whether `id` may be kept or looked up: ids come from clients, and neither Redis keys nor the
/// map below should grow with whatever a client sends. A longer one is unknown context.
pub fn keepable(id: &str) -> bool {
    id.len() <= MAX_ID_BYTES
}

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
        if !keepable(id) {
            return None;
        }
        self.inner.lock().ok()?.tokens.get(id).copied()
    }

    /// Remembers (or updates: a conversation grows) the context of `id`.
    pub fn remember(&self, id: &str, tokens: u64) {
        if !keepable(id) {
            return;
        }
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

/// What a Responses request carries beyond its body: the ids of the context it continues (its
/// `previous_response_id` and its `conversation`), and whether it also holds content kept
/// upstream that no id here measures (`item_reference` items, a stored `prompt`).
pub fn carried(request: &Value) -> (Vec<&str>, bool) {
    let ids = [
        request["previous_response_id"].as_str(),
        conversation_id(request),
    ]
    .into_iter()
    .flatten()
    .collect();
    let references = request["input"]
        .as_array()
        .is_some_and(|items| items.iter().any(|i| i["type"] == "item_reference"))
        || request["prompt"]["id"].is_string();
    (ids, references)
}

/// Input tokens of a request that its body does not hold: the largest context of the `known`
/// ones it continues (`None`: not known, counted as `unknown`), plus `unknown` once for
/// references.
pub fn hidden_input(
    known: impl IntoIterator<Item = Option<u64>>,
    references: bool,
    unknown: u64,
) -> u64 {
    let earlier = known
        .into_iter()
        .map(|k| k.unwrap_or(unknown))
        .max()
        .unwrap_or(0);
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
        let hidden = |v: Value| {
            let (ids, references) = carried(&v);
            hidden_input(ids.into_iter().map(|id| c.get(id)), references, 9_000)
        };
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
    fn ids_longer_than_any_kept_are_neither_kept_nor_found() {
        let c = Contexts::default();
        let long = "c".repeat(MAX_ID_BYTES + 1);
        c.remember(&long, 5);
        assert!(c.is_empty());
        assert_eq!(c.get(&long), None);
        let longest = "c".repeat(MAX_ID_BYTES);
        c.remember(&longest, 5);
        assert_eq!(c.get(&longest), Some(5));
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
