//! Builds the embedded vocabularies: each `data/*.tiktoken.gz` (checked against
//! `data/SHA256SUMS`) becomes the byte-pair encoder that `bpe-openai` builds from it, serialised
//! as that crate serialises it and compressed with zstd, so that the binary carries about 19 MB
//! of vocabularies rather than 47 MB. The counter unpacks each on first use (`src/vocab.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Read;
use std::path::Path;

use bpe::byte_pair_encoding::{BytePairEncoding, read_tiktoken};
use sha2::{Digest, Sha256};

/// `bpe-openai`'s hash factor for OpenAI's vocabularies: with it, the encoder's token hashes
/// have no collision, so it is built without searching for one.
const HASH_FACTOR: u64 = 17_846_336_922_010_275_747;

/// zstd's level: the smallest of its standard levels; the build pays its time once.
const LEVEL: i32 = 19;

fn main() {
    println!("cargo::rerun-if-changed=data");
    println!("cargo::rerun-if-changed=build.rs");
    let out = std::env::var("OUT_DIR").expect("OUT_DIR");
    let sums = std::fs::read_to_string("data/SHA256SUMS").expect("data/SHA256SUMS");
    for name in ["o200k_base", "cl100k_base"] {
        let file = format!("{name}.tiktoken.gz");
        let gz = std::fs::read(Path::new("data").join(&file)).expect(&file);
        let digest: String = Sha256::digest(&gz)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert!(
            sums.lines().any(|l| l == format!("{digest}  {file}")),
            "data/{file}: its digest {digest} is not the one in data/SHA256SUMS"
        );
        let mut text = String::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_string(&mut text)
            .expect("a gzip file");
        let tokens = read_tiktoken(&text).expect("a tiktoken file");
        let bpe = BytePairEncoding::from_dictionary(tokens, Some(HASH_FACTOR));
        let raw = rmp_serde::to_vec(&bpe).expect("serialised");
        let packed = zstd::bulk::compress(&raw, LEVEL).expect("compressed");
        std::fs::write(Path::new(&out).join(format!("{name}.bpe.zst")), packed).expect("written");
    }
}
