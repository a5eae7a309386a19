//! Counting tokens: against the reference tokenizers, the fuzz corpus, hostile input, Hugging Face vocabularies and the memo: one binary, a module per part.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::result_large_err
)]

mod differential;
mod fuzz_corpus;
mod hostile;
mod huggingface;
mod memo;
