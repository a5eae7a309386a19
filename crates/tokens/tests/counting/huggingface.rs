//! Open models counted with a real `tokenizer.json`, written by the `tokenizers` library itself
//! and loaded back from disk the way the gateway loads a configured file.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::Arc;

use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tollgate_tokens::hf::HfTokenizer;
use tollgate_tokens::{Counting, Format, TokenCounter};

fn tokenizer_json(dir: &std::path::Path) -> std::path::PathBuf {
    let vocab: HashMap<String, u32> = ["[UNK]", "hello", "world", "user", "!", "tollgate"]
        .iter()
        .enumerate()
        .map(|(i, w)| ((*w).to_owned(), i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(Whitespace {}));
    let path = dir.join("tokenizer.json");
    tok.save(&path, false).unwrap();
    path
}

#[test]
fn a_tokenizer_json_counts_requests_exactly_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let path = tokenizer_json(dir.path());
    let hf = Arc::new(HfTokenizer::from_file(&path).unwrap());
    assert_eq!(hf.max_token_bytes, "tollgate".len());
    let counter = TokenCounter::default().with_model("my-llama", Counting::HuggingFace(hf.clone()));
    let (n, exact) = counter.count_text("my-llama", "hello world! hello tollgate", None);
    assert_eq!((n, exact), (5, true));
    let body = br#"{"model":"my-llama","max_tokens":9,"messages":[{"role":"user","content":"hello world!"}]}"#;
    let c = counter.count(Format::ChatCompletions, body, None).unwrap();
    assert_eq!(c.encoding, "tokenizer.json");
    // 3 + "user" (1) + "hello world !" (3) + 3.
    assert_eq!((c.input_tokens, c.exact), (10, true));
    // The byte bound uses this vocabulary's longest token (8 bytes): 80 bytes cannot fit in 9.
    let (n, _) = counter.count_text("my-llama", &"x".repeat(80), Some(9));
    assert_eq!(n, 10);
    // A limit: over is limit + 1.
    let (n, _) = counter.count_text("my-llama", "hello hello hello hello", Some(2));
    assert_eq!(n, 3);
    // A long text is counted in chunks and flagged as an estimate.
    let long = "hello world ".repeat(5_000);
    let (n, exact) = counter.count_text("my-llama", &long, None);
    assert_eq!((n, exact), (10_000, false));
    // A file that is not a tokenizer is an error that names it.
    std::fs::write(dir.path().join("bad.json"), "{}").unwrap();
    let e = HfTokenizer::from_file(dir.path().join("bad.json")).unwrap_err();
    assert!(e.contains("bad.json"), "{e}");
}
