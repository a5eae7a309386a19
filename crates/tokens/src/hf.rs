//! Open models counted with their own `tokenizer.json` (Hugging Face `tokenizers`, pure-Rust
//! regex backend, nothing downloaded).
//!
//! Regex-based tokenizers can fail on pathological input (long runs of one character), so
//! counting is defended three ways: the byte bound uses the vocabulary's longest token; a text
//! longer than 16 KiB is counted in chunks split at whitespace (then flagged as an estimate,
//! since a merge across a chunk boundary could differ by a token); and a panic inside the
//! library is caught and treated as "over the limit" rather than taking the process down.

use std::path::Path;

/// A loaded `tokenizer.json`.
#[derive(Debug)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// The longest token of the vocabulary, in bytes (at least 1).
    pub max_token_bytes: usize,
}

/// Texts longer than this are counted in chunks.
const CHUNK: usize = 16 * 1024;

impl HfTokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, String> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let max_token_bytes = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(Self {
            inner,
            max_token_bytes,
        })
    }

    fn count_one(&self, text: &str) -> Option<u64> {
        let run =
            std::panic::AssertUnwindSafe(|| self.inner.encode(text, false).map(|e| e.len() as u64));
        match std::panic::catch_unwind(run) {
            Ok(Ok(n)) => Some(n),
            _ => None,
        }
    }

    /// Counts `text`: `(tokens, exact)`, or `None` when the library could not (treated as over
    /// any limit by the caller).
    pub fn count(&self, text: &str) -> Option<(u64, bool)> {
        if text.len() <= CHUNK {
            return self.count_one(text).map(|n| (n, true));
        }
        let mut total = 0u64;
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = rest.len().min(CHUNK);
            while !rest.is_char_boundary(cut) {
                cut -= 1;
            }
            if cut < rest.len() {
                // Prefer a whitespace boundary, where pre-tokenizers split anyway.
                if let Some(ws) = rest[..cut].rfind(char::is_whitespace).filter(|&w| w > 0) {
                    cut = ws;
                }
            }
            total += self.count_one(&rest[..cut])?;
            rest = &rest[cut..];
        }
        Some((total, false))
    }
}
