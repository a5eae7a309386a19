//! What loop detection decides on: the request's fingerprint (the body fields that make it what
//! it is, ids that change between sendings left out) and how often its history's most repeated
//! tool call (name and arguments) appears. Computed only when a rule detects loops.

use std::collections::HashMap;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::dialect::{Dialect, Volatile};

/// Keys whose values differ between two sendings of the same content.
const VOLATILE_IDS: [&str; 4] = ["id", "tool_call_id", "call_id", "tool_use_id"];

/// (fingerprint, the most repeated tool call's count) of a request body.
pub(crate) fn facts(dialect: &dyn Dialect, json: &Value) -> (u64, u64) {
    let mut h = Sha256::new();
    for (field, volatile) in dialect.content_fields() {
        h.update(field.as_bytes());
        digest(&mut h, json.get(*field).unwrap_or(&Value::Null), *volatile);
    }
    let mut seen: HashMap<[u8; 32], u64> = HashMap::new();
    for (name, args) in dialect.history_tool_calls(json) {
        let mut c = Sha256::new();
        digest(&mut c, name, Volatile::None);
        // Arguments arrive as a JSON string (OpenAI) or an object (Anthropic): the same call
        // either way, and whatever its spacing.
        match args
            .as_str()
            .and_then(|s| serde_json::from_str::<Value>(s).ok())
        {
            Some(parsed) => digest(&mut c, &parsed, Volatile::None),
            None => digest(&mut c, args, Volatile::None),
        }
        *seen.entry(c.finalize().into()).or_default() += 1;
    }
    let fp: [u8; 32] = h.finalize().into();
    let mut first = [0u8; 8];
    first.copy_from_slice(&fp[..8]);
    (
        u64::from_be_bytes(first),
        seen.into_values().max().unwrap_or(0),
    )
}

/// Feeds `v` into `h`, unambiguously (each value tagged, each string and list sized), with
/// object keys in sorted order (`serde_json`'s map is sorted). Walked without recursion.
fn digest(h: &mut Sha256, v: &Value, volatile: Volatile) {
    enum Item<'a> {
        Value(&'a Value),
        Key(&'a str),
    }
    let kept = |k: &str| volatile == Volatile::None || !VOLATILE_IDS.contains(&k);
    let mut stack = vec![Item::Value(v)];
    while let Some(item) = stack.pop() {
        let v = match item {
            Item::Key(k) => {
                string(h, k);
                continue;
            }
            Item::Value(v) => v,
        };
        match v {
            Value::Null => h.update(b"n"),
            Value::Bool(b) => h.update(if *b { b"t" } else { b"f" }),
            Value::Number(n) => {
                h.update(b"#");
                string(h, &n.to_string());
            }
            Value::String(s) => {
                h.update(b"s");
                string(h, s);
            }
            Value::Array(a) => {
                h.update(b"[");
                h.update((a.len() as u64).to_be_bytes());
                stack.extend(a.iter().rev().map(Item::Value));
            }
            Value::Object(m) => {
                let n = m.keys().filter(|k| kept(k)).count();
                h.update(b"{");
                h.update((n as u64).to_be_bytes());
                for (k, v) in m.iter().rev().filter(|(k, _)| kept(k)) {
                    stack.push(Item::Value(v));
                    stack.push(Item::Key(k));
                }
            }
        }
    }
}

/// A string, sized.
fn string(h: &mut Sha256, s: &str) {
    h.update((s.len() as u64).to_be_bytes());
    h.update(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat() -> &'static dyn Dialect {
        crate::dialect::of(tollgate_tokens::Format::ChatCompletions)
    }

    #[test]
    fn ids_that_change_between_sendings_do_not_change_the_fingerprint() {
        let a = json!({"model": "m", "messages": [{"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "x"}], "user": "u1"});
        let mut b = a.clone();
        b["messages"][0]["tool_calls"][0]["id"] = json!("call_2");
        b["messages"][1]["tool_call_id"] = json!("call_2");
        b["user"] = json!("u2");
        b["temperature"] = json!(0.5);
        assert_eq!(facts(chat(), &a).0, facts(chat(), &b).0);
        let mut c = a.clone();
        c["messages"][1]["content"] = json!("y");
        assert_ne!(facts(chat(), &a).0, facts(chat(), &c).0);
    }

    #[test]
    fn values_of_different_shapes_never_collide() {
        let a = json!({"model": "m", "messages": ["ab", "c"]});
        let b = json!({"model": "m", "messages": ["a", "bc"]});
        let c = json!({"model": "m", "messages": [["ab"], "c"]});
        let d = json!({"model": "m", "messages": [{"ab": "c"}]});
        let fps: Vec<u64> = [a, b, c, d].iter().map(|j| facts(chat(), j).0).collect();
        for (i, x) in fps.iter().enumerate() {
            assert!(!fps[i + 1..].contains(x), "{fps:?}");
        }
    }

    #[test]
    fn the_same_call_is_counted_however_its_arguments_are_spaced() {
        let call = |args: &str| {
            json!({"role": "assistant", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "search", "arguments": args}}]})
        };
        let j = json!({"model": "m", "messages": [call("{\"q\": 1}"), call("{\"q\":1}"),
            call("{\"q\":2}")]});
        assert_eq!(facts(chat(), &j).1, 2);
        let anthropic = crate::dialect::of(tollgate_tokens::Format::AnthropicMessages);
        let block = json!({"type": "tool_use", "id": "t", "name": "search", "input": {"q": 1}});
        let j = json!({"model": "m", "messages": [
            {"role": "assistant", "content": [block.clone(), block.clone(), block]}]});
        assert_eq!(facts(anthropic, &j).1, 3);
    }
}
