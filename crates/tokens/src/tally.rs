//! A running, bounded token count.

use std::sync::Arc;

use crate::memo::{self, Memo};
use crate::{Counting, MAX_TOKEN_BYTES};

/// Adds up tokens until a limit is passed, then stops counting (everything after is free).
#[derive(Debug, Clone)]
pub struct Tally {
    counting: Counting,
    limit: u64,
    used: u64,
    exact: bool,
    remote: u32,
    audio_refs: u32,
    audio: u64,
    memo: Option<Arc<dyn Memo>>,
}

impl Tally {
    /// A tally with this rule and optional limit.
    pub fn new(counting: Counting, limit: Option<u64>) -> Self {
        let exact = !matches!(counting, Counting::Estimate | Counting::Bytes);
        Self {
            counting,
            limit: limit.unwrap_or(u64::MAX - 1),
            used: 0,
            exact,
            remote: 0,
            audio_refs: 0,
            audio: 0,
            memo: None,
        }
    }

    /// Counts long texts through `memo`: a text counted before is not counted again.
    #[must_use]
    pub fn with_memo(mut self, memo: Option<Arc<dyn Memo>>) -> Self {
        self.memo = memo;
        self
    }

    /// Whether the limit has been passed.
    pub fn over(&self) -> bool {
        self.used > self.limit
    }

    /// Adds a constant overhead (message framing, image tiles).
    pub fn add(&mut self, n: u64) {
        self.used = self.used.saturating_add(n);
    }

    /// Notes an item whose content the body does not hold (a file or document by URL or id):
    /// counted whether or not the limit has been passed, since its content is not text here.
    pub fn remote_item(&mut self) {
        self.remote = self.remote.saturating_add(1);
        self.exact = false;
    }

    /// Notes an earlier audio answer named by id, which the upstream bills again as input and
    /// the body does not hold.
    pub fn audio_reference(&mut self) {
        self.audio_refs = self.audio_refs.saturating_add(1);
        self.exact = false;
    }

    /// Adds `n` audio input tokens (priced apart from text where the model's audio costs more).
    pub fn add_audio(&mut self, n: u64) {
        self.audio = self.audio.saturating_add(n);
        self.add(n);
    }

    /// Marks the count as an estimate.
    pub fn estimated(&mut self) {
        self.exact = false;
    }

    /// Adds the tokens of a text.
    pub fn text(&mut self, s: &str) {
        if self.over() || s.is_empty() {
            return;
        }
        let remaining = self.limit - self.used;
        if matches!(self.counting, Counting::Bytes) {
            self.add(u64::try_from(s.len()).unwrap_or(u64::MAX));
            return;
        }
        // A text needs at least len/longest-token tokens: beyond that it is over without counting.
        let longest = match &self.counting {
            #[cfg(feature = "huggingface")]
            Counting::HuggingFace(h) => h.max_token_bytes,
            _ => MAX_TOKEN_BYTES,
        };
        let at_least = u64::try_from(s.len().div_ceil(longest)).unwrap_or(u64::MAX);
        if at_least > remaining {
            self.used = self.limit + 1;
            return;
        }
        match &self.counting {
            #[cfg(feature = "huggingface")]
            Counting::HuggingFace(h) => match h.count(s) {
                Some((n, exact)) => {
                    self.add(n);
                    if !exact {
                        self.exact = false;
                    }
                }
                None => self.used = self.limit + 1,
            },
            Counting::Exact(e) => {
                let e = *e;
                if let Some(n) = self.counted(e.tokenizer(), e.name(), s, remaining) {
                    self.add(n);
                }
            }
            Counting::Bytes => {}
            Counting::Estimate => {
                // o200k count + 25%, rounded up: stop once even the unscaled count cannot fit.
                let o200k = crate::Encoding::O200kBase;
                if let Some(n) = self.counted(o200k.tokenizer(), o200k.name(), s, remaining) {
                    self.add(n.saturating_mul(5).div_ceil(4));
                }
            }
        }
    }

    /// The count of `s` in a vocabulary when it is at most `cap` (from the memo when kept
    /// there, which a count within the cap fills); over the cap, the tally is marked over and
    /// `None` returned.
    fn counted(
        &mut self,
        tok: Option<&bpe_openai::Tokenizer>,
        vocabulary: &'static str,
        s: &str,
        cap: u64,
    ) -> Option<u64> {
        let Some(tok) = tok else {
            // A vocabulary that did not unpack (a broken build): one token per byte, an upper
            // bound, flagged as not exact.
            self.exact = false;
            return Some(u64::try_from(s.len()).unwrap_or(u64::MAX))
                .filter(|n| *n <= cap)
                .or_else(|| {
                    self.used = self.limit + 1;
                    None
                });
        };
        let memo = self.memo.as_ref().filter(|_| s.len() >= memo::MIN_BYTES);
        let n = match memo.and_then(|m| m.get(vocabulary, s)) {
            Some(n) => Some(n).filter(|n| *n <= cap),
            None => {
                let cap = usize::try_from(cap).unwrap_or(usize::MAX);
                let n = tok
                    .count_till_limit(&tok.normalize(s), cap)
                    .map(|n| n as u64);
                if let (Some(m), Some(n)) = (memo, n) {
                    m.put(vocabulary, s, n);
                }
                n
            }
        };
        if n.is_none() {
            self.used = self.limit + 1;
        }
        n
    }

    /// Adds the tokens of a JSON string literal, deciding from its raw length alone when it is
    /// surely over: an escape takes at most 6 raw bytes per decoded byte, so a literal longer
    /// than 6 × 128 bytes per remaining token is over without being decoded (a body of escaped
    /// tabs would otherwise cost a full unescape).
    pub fn json_string(
        &mut self,
        raw: &serde_json::value::RawValue,
        field: &str,
    ) -> Result<(), crate::RequestError> {
        if self.over() {
            return Ok(());
        }
        let decoded_at_least = raw.get().len().saturating_sub(2) / 6;
        let at_least =
            u64::try_from(decoded_at_least.div_ceil(MAX_TOKEN_BYTES)).unwrap_or(u64::MAX);
        if at_least > self.limit - self.used {
            // Still refuse what is not a string at all.
            if raw.get().as_bytes().first() != Some(&b'"') {
                return Err(crate::RequestError::invalid(field, "expected a string"));
            }
            self.used = self.limit + 1;
            return Ok(());
        }
        let s = crate::openai::string(raw, field)?;
        self.text(&s);
        Ok(())
    }

    /// The count of a request.
    pub fn into_count(
        &self,
        model: String,
        counting: &Counting,
        max_output_tokens: Option<u64>,
        stream: bool,
    ) -> crate::RequestCount {
        let (input_tokens, exact) = self.finish();
        crate::RequestCount {
            model,
            encoding: counting.name(),
            input_tokens,
            max_output_tokens,
            exact,
            over_limit: self.over(),
            stream,
            remote_items: self.remote,
            audio_references: self.audio_refs,
            audio_tokens: self.audio,
        }
    }

    /// `(tokens, exact)`; tokens is `limit + 1` at most when over the limit.
    pub fn finish(&self) -> (u64, bool) {
        (self.used.min(self.limit.saturating_add(1)), self.exact)
    }
}
