//! Runs the `sse` fuzz target's corpus (`fuzz/corpus/sse`) as an ordinary test on stable:
//! upstream event streams, well-formed and not, through the meter of each format.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[test]
fn sse_fuzz_corpus_passes_the_fuzz_check() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/sse");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let run = std::panic::catch_unwind(|| tollgate_gateway::sse::fuzz_check(&data));
        assert!(run.is_ok(), "{} fails the check", path.display());
        n += 1;
    }
    assert!(n >= 10, "corpus has {n} files");
}
