//! Runs the fuzz target's corpus (`fuzz/corpus/request`) as an ordinary test on stable.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[test]
fn fuzz_corpus_passes_the_fuzz_check() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/request");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        tollgate_tokens::fuzz_check(&data);
        n += 1;
    }
    assert!(n >= 10, "corpus has {n} files");
}
