//! Exact counts of texts counted before, found again by the text: an agent sends its whole
//! history on every turn, and a turn then counts only what is new.

/// Where counts of long texts are kept between requests. A count found here is the count the
/// vocabulary gives; nothing else is ever kept.
pub trait Memo: Send + Sync + std::fmt::Debug {
    /// The count of `text` in `vocabulary`, when it was kept.
    fn get(&self, vocabulary: &'static str, text: &str) -> Option<u64>;
    /// Keeps the count of `text` in `vocabulary`.
    fn put(&self, vocabulary: &'static str, text: &str, tokens: u64);
}

/// Texts shorter than this are counted every time: counting them costs about what a lookup
/// does, and they would crowd out the long ones.
pub const MIN_BYTES: usize = 256;
