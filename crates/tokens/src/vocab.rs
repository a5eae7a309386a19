//! The embedded vocabularies: the encoders the build made (`build.rs`), compressed, unpacked on
//! first use into the tokenizers `bpe-openai` makes, with the same pre-tokenising patterns
//! (OpenAI's, with their negative look-ahead rewritten as `bpe-openai` rewrites it).

use std::sync::LazyLock;

use bpe_openai::Tokenizer;
use bpe_openai::byte_pair_encoding::BytePairEncoding;

static O200K: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/o200k_base.bpe.zst"));
static CL100K: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/cl100k_base.bpe.zst"));

/// `o200k_base`.
pub(crate) static O200K_BASE: LazyLock<Option<Tokenizer>> = LazyLock::new(|| {
    let pat1 = [
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        "\\p{N}{1,3}",
        " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*",
        "\\s*[\\r\\n]+",
        "\\s+$",
    ]
    .join("|");
    tokenizer(O200K, &pat1)
});

/// `cl100k_base`.
pub(crate) static CL100K_BASE: LazyLock<Option<Tokenizer>> = LazyLock::new(|| {
    let pat1 = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+$";
    tokenizer(CL100K, pat1)
});

/// The tokenizer of a packed encoder: `None` if it does not unpack, which only a broken build
/// can cause (the build made the bytes, and `every_vocabulary_unpacks` checks them). Read as it
/// unpacks, so that the unpacked bytes are never held whole beside the encoder made of them.
fn tokenizer(packed: &[u8], pat1: &str) -> Option<Tokenizer> {
    let unpacked = zstd::stream::read::Decoder::new(packed).ok()?;
    let bpe: BytePairEncoding =
        rmp_serde::from_read(std::io::BufReader::with_capacity(1 << 16, unpacked)).ok()?;
    Tokenizer::new_lookahead(
        bpe,
        &[(pat1, false), ("\\s+\\s", true), ("\\s+", false)],
        false,
    )
    .ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_vocabulary_unpacks() {
        assert!(super::O200K_BASE.is_some());
        assert!(super::CL100K_BASE.is_some());
    }
}
