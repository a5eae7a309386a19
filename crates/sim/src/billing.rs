//! How the simulator bills a request's output, the way OpenAI and Anthropic do: every choice of
//! every prompt is a whole answer up to the cap (`n`, `best_of`, completions' prompt lists);
//! a prediction's tokens that the model rejects are billed as output (this model rejects them
//! all); function-call arguments are output like text. A model may be told to run past the cap
//! ([`crate::SimConfig::ignore_cap`]) and a usage report may be told to say less than was billed
//! ([`crate::SimConfig::reported_output`]): the stats always hold what was billed.

use serde_json::Value;
use tollgate_tokens::{Counting, Encoding, Format, TokenCounter};

use crate::SimConfig;

/// How the simulator counts `model`'s input: OpenAI's families by their vocabularies; a model
/// whose tokenizer is not public by `cl100k_base`, which splits non-Latin scripts far finer
/// than `o200k_base` does, as such a model's own vocabulary may.
pub(crate) fn counter(model: &str) -> TokenCounter {
    let counter = TokenCounter::default();
    match counter.counting_for(model) {
        Counting::Exact(_) => counter,
        _ => counter.with_model(model, Counting::Exact(Encoding::Cl100kBase)),
    }
}

/// A request's output, as billed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Output {
    /// Tokens in each answer.
    pub per_answer: u64,
    /// Answers: choices times prompts.
    pub answers: u64,
    /// Predicted tokens rejected, billed as output.
    pub rejected: u64,
    /// Function-call arguments' tokens.
    pub calls: u64,
    /// Hidden reasoning (or thinking) tokens in each answer, produced before its text.
    pub reasoning: u64,
}

impl Output {
    /// Everything billed as output.
    pub fn billed(&self) -> u64 {
        self.per_answer
            .saturating_add(self.reasoning)
            .saturating_mul(self.answers)
            .saturating_add(self.rejected)
            .saturating_add(self.calls)
    }

    /// What the usage report says was output.
    pub fn reported(&self, config: &SimConfig) -> u64 {
        config.reported_output.unwrap_or_else(|| self.billed())
    }
}

/// The output of `req` in `format` whose cap is `cap`, with the function calls it makes.
pub(crate) fn output(
    config: &SimConfig,
    req: &Value,
    format: Format,
    cap: Option<u64>,
    calls: &[(String, String, String)],
) -> Output {
    let model = req["model"].as_str().unwrap_or("");
    let counter = TokenCounter::default();
    let reasoning = reasoning(config, req, format);
    let per_answer = if config.ignore_cap {
        config.output_tokens
    } else {
        // Reasoning counts against the cap (OpenAI's `max_completion_tokens`, Anthropic's
        // `max_tokens`): the answer gets what it leaves.
        let cap = cap.unwrap_or(u64::MAX);
        config
            .output_tokens
            .min(cap.saturating_sub(reasoning.min(cap)))
    };
    let reasoning = match (config.ignore_cap, cap) {
        (false, Some(c)) => reasoning.min(c),
        _ => reasoning,
    };
    let count = |n: &str| req[n].as_u64().unwrap_or(1).max(1);
    let answers = match format {
        Format::ChatCompletions => count("n"),
        Format::Completions => count("n").max(count("best_of")) * prompts(&req["prompt"]),
        _ => 1,
    };
    let rejected = match &req["prediction"]["content"] {
        Value::String(s) => counter.count_text(model, s, None).0,
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .map(|t| counter.count_text(model, t, None).0)
            .sum(),
        _ => 0,
    };
    let calls = calls
        .iter()
        .map(|(_, _, args)| counter.count_text(model, args, None).0)
        .sum();
    Output {
        per_answer,
        answers,
        rejected,
        calls,
        reasoning,
    }
}

/// The hidden reasoning an answer to `req` produces: the configured amount, and on Anthropic's
/// API only when the request enables thinking, within its `budget_tokens`.
fn reasoning(config: &SimConfig, req: &Value, format: Format) -> u64 {
    match format {
        Format::AnthropicMessages if req["thinking"]["type"] == "enabled" => config
            .reasoning_tokens
            .min(req["thinking"]["budget_tokens"].as_u64().unwrap_or(0)),
        Format::AnthropicMessages => 0,
        _ => config.reasoning_tokens,
    }
}

/// Prompts in a completions `prompt`: a string or one list of token ids is one prompt.
fn prompts(prompt: &Value) -> u64 {
    match prompt {
        Value::Array(items) if !items.first().is_some_and(Value::is_number) => {
            (items.len() as u64).max(1)
        }
        _ => 1,
    }
}

/// The usage object's output details: rejected prediction tokens and reasoning tokens, which
/// OpenAI reports.
pub(crate) fn details(out: &Output) -> Value {
    serde_json::json!({"rejected_prediction_tokens": out.rejected,
        "reasoning_tokens": out.reasoning.saturating_mul(out.answers)})
}
