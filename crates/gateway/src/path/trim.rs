//! Trim instead of refuse: a request above the input limit of a rule in `trim` mode has its
//! oldest turns dropped until it fits. A turn is a user's message and what follows it up to the
//! next one (the assistant's answers, its tool calls and their results), so a tool call never
//! loses its result and no message is cut inside. System and developer messages always stay,
//! and so does the last turn, the one being asked. The fewest turns that make it fit are found
//! by binary search, each candidate counted by the real tokenizer; a request that does not fit
//! even then is left as it was, and refused by the input limit.

use std::ops::Range;

use serde_json::Value;

use crate::dialect::Dialect;
use crate::gateway::Gateway;

/// A body that was trimmed to fit.
pub(crate) struct Trimmed {
    /// The body without its dropped turns.
    pub json: Value,
    /// Its count.
    pub count: tollgate_tokens::RequestCount,
    /// How many turns were dropped.
    pub dropped: u64,
}

/// The body `json` trimmed until its input, with `extra` (what the body does not hold, per
/// counted remote item `per_item`), is at most `target`; `None` when no trimming makes it fit
/// or the format has no turns to drop.
pub(crate) fn fit(
    gw: &Gateway,
    dialect: &dyn Dialect,
    json: &Value,
    target: u64,
    extra: u64,
    per_item: u64,
    limit: Option<u64>,
) -> Option<Trimmed> {
    let field = dialect.turn_list()?;
    let items = json.get(field)?.as_array()?;
    let turns = turns(dialect, items);
    // The last turn is the one being asked: never dropped.
    let droppable = turns.len().checked_sub(1)?;
    let attempt = |k: usize| -> Option<Trimmed> {
        let dropped: Vec<&Range<usize>> = turns.iter().take(k).collect();
        let kept: Vec<Value> = items
            .iter()
            .enumerate()
            .filter(|(i, item)| dialect.pinned(item) || !dropped.iter().any(|r| r.contains(i)))
            .map(|(_, item)| item.clone())
            .collect();
        let mut candidate = json.clone();
        candidate[field] = Value::Array(kept);
        let bytes = serde_json::to_vec(&candidate).ok()?;
        let count = gw
            .config()
            .counter
            .count(dialect.format(), &bytes, limit)
            .ok()?;
        let input = count
            .input_tokens
            .saturating_add(extra)
            .saturating_add(u64::from(count.remote_items).saturating_mul(per_item));
        (!count.over_limit && input <= target).then_some(Trimmed {
            json: candidate,
            count,
            dropped: k as u64,
        })
    };
    // The fewest turns: fitting only gets easier as more are dropped.
    let (mut lo, mut hi) = (1, droppable);
    let mut best = attempt(hi)?;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match attempt(mid) {
            Some(t) => {
                best = t;
                hi = mid;
            }
            None => lo = mid + 1,
        }
    }
    Some(best)
}

/// Checks that the turns of `json`'s list are disjoint ranges in order, within the list (for the
/// `agents` fuzz target).
#[allow(clippy::panic)]
pub(crate) fn check_turns(dialect: &dyn Dialect, json: &Value) {
    let Some(items) = dialect.turn_list().and_then(|f| json.get(f)?.as_array()) else {
        return;
    };
    let mut end = 0;
    for r in turns(dialect, items) {
        assert!(
            r.start >= end && r.start < r.end && r.end <= items.len(),
            "{r:?}"
        );
        end = r.end;
    }
}

/// The turns of a list of messages or items, as index ranges, oldest first. Pinned items inside
/// a range are kept whatever is dropped. What comes before the first turn (an assistant's
/// greeting) is a turn of its own.
fn turns(dialect: &dyn Dialect, items: &[Value]) -> Vec<Range<usize>> {
    let mut starts: Vec<usize> = items
        .iter()
        .enumerate()
        .filter(|(_, item)| !dialect.pinned(item) && dialect.starts_turn(item))
        .map(|(i, _)| i)
        .collect();
    let first_unpinned = items.iter().position(|item| !dialect.pinned(item));
    if let Some(f) = first_unpinned {
        if starts.first() != Some(&f) {
            starts.insert(0, f);
        }
    }
    let mut out = Vec::with_capacity(starts.len());
    for (n, &s) in starts.iter().enumerate() {
        let end = starts.get(n + 1).copied().unwrap_or(items.len());
        out.push(s..end);
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tollgate_tokens::Format;

    use super::*;

    fn of(format: Format, items: &Value) -> Vec<Range<usize>> {
        turns(
            crate::dialect::of(format),
            items.as_array().map(Vec::as_slice).unwrap_or(&[]),
        )
    }

    #[test]
    fn a_chat_turn_keeps_its_tool_calls_with_their_results() {
        let items = json!([
            {"role": "system", "content": "terse"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"},
            {"role": "assistant", "content": "done"},
            {"role": "developer", "content": "note"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "c"}
        ]);
        // The greeting, then each user's turn; system and developer messages are pinned (a
        // pinned one inside a turn stays when the turn goes).
        assert_eq!(
            of(Format::ChatCompletions, &items),
            [1..2, 2..7, 7..9, 9..10]
        );
    }

    #[test]
    fn an_anthropic_tool_result_belongs_to_the_turn_before() {
        let items = json!([
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": [{"type": "text", "text": "b"}]}
        ]);
        assert_eq!(of(Format::AnthropicMessages, &items), [0..4, 4..5]);
    }

    #[test]
    fn a_responses_turn_holds_its_calls_and_outputs() {
        let items = json!([
            {"role": "developer", "content": "terse"},
            {"role": "user", "content": "a"},
            {"type": "reasoning", "id": "r1"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "x"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "b"}]}
        ]);
        assert_eq!(of(Format::Responses, &items), [1..5, 5..6]);
    }
}
