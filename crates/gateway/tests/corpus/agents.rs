//! Runs the `agents` fuzz target's corpus (`fuzz/corpus/agents`) as an ordinary test on stable:
//! client bodies, well-formed and not, through loop detection and trimming's turns in every
//! format.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[test]
fn agents_fuzz_corpus_passes_the_fuzz_check() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/agents");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let run = std::panic::catch_unwind(|| tollgate_gateway::fuzz_agents(&data));
        assert!(run.is_ok(), "{} fails the check", path.display());
        n += 1;
    }
    assert!(n >= 10, "corpus has {n} files");
}
