//! The simulator's command line: `--help` answers, a bad option is an error, not a panic.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

fn sim(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate-sim"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn help_lists_the_options() {
    let out = sim(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    for opt in [
        "--listen",
        "--latency-ms",
        "--token-delay-ms",
        "--output-tokens",
        "--api-key",
    ] {
        assert!(text.contains(opt), "{opt} missing from:\n{text}");
    }
}

#[test]
fn a_bad_option_is_refused_without_a_panic() {
    for args in [
        &["--latency"][..],
        &["--latency-ms", "soon"],
        &["--listen", "nowhere"],
    ] {
        let out = sim(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.contains("error:") && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}
