//! `tollgate check` and the top-level help: the file's kind told by what it holds, positional
//! and `--config` forms alike, URLs read whole, rules that never apply warned about; every
//! command listed, and `serve` without a configuration pointing at `--demo`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

/// `tollgate ARGS`: (exit code, stdout, stderr).
fn tollgate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn file(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

const UPSTREAM: &str =
    "[[upstreams]]\nname = \"u\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"gpt-4o\"]\n";

#[test]
fn check_tells_files_apart_by_content_and_reads_urls_whole() {
    let dir = tempfile::tempdir().unwrap();
    let gw = file(&dir, "gw.toml", UPSTREAM);
    let (code, a, _) = tollgate(&["check", &gw]);
    assert_eq!(code, 0);
    let (code, b, _) = tollgate(&["check", "--config", &gw]);
    assert_eq!(code, 0);
    assert_eq!(a, b, "the positional and --config forms differ");
    assert!(a.starts_with("ok: gateway configuration"), "{a}");

    // Only [server]: a gateway configuration (it was read as a bare policy).
    let server = file(
        &dir,
        "server.toml",
        "[server]\nlisten = \"127.0.0.1:8080\"\n",
    );
    let (_, out, err) = tollgate(&["check", &server]);
    assert!(
        !out.contains("ok: policy") && !err.contains("policy"),
        "{out}{err}"
    );
    let policy = file(
        &dir,
        "policy.toml",
        "version = \"p1\"\n[[scopes]]\nkey = \"tenant\"\nrequests = { limit = 5, window = \"1m\" }\n",
    );
    let (code, out, _) = tollgate(&["check", &policy]);
    assert_eq!((code, out.trim()), (0, "ok: policy p1 with 1 scopes"));
    let odd = file(&dir, "odd.toml", "flavour = \"vanilla\"\n");
    let (code, _, err) = tollgate(&["check", &odd]);
    assert_ne!(code, 0);
    assert!(
        err.contains("cannot tell what this file is") && err.contains("flavour"),
        "{err}"
    );

    let port = file(
        &dir,
        "port.toml",
        &format!("[store]\nurl = \"redis://127.0.0.1:notaport\"\n{UPSTREAM}"),
    );
    let (code, _, err) = tollgate(&["check", &port]);
    assert_ne!(code, 0);
    assert!(
        err.contains("store.url") && err.contains("notaport"),
        "{err}"
    );
}

#[test]
fn check_warns_about_rules_that_never_apply() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "{UPSTREAM}[[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[policy]\n\
         [[policy.scopes]]\nname = \"per-user\"\nkey = \"user\"\nrequests = {{ limit = 5, window = \"1m\" }}\n\
         [[policy.scopes]]\nname = \"other\"\nkey = \"tenant\"\nmatch = {{ tenant = \"acne\" }}\n\
         requests = {{ limit = 5, window = \"1m\" }}\n",
        tollgate_gateway::hash_key("sk-1")
    );
    let cfg = file(&dir, "gw.toml", &text);
    let (code, _, err) = tollgate(&["check", &cfg]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("\"per-user\" is keyed on user") && err.contains("never applies"),
        "{err}"
    );
    assert!(err.contains("\"other\" matches tenant = \"acne\""), "{err}");
}

#[test]
fn the_help_lists_every_command_and_serve_points_at_the_demo() {
    let (_, help, _) = tollgate(&["--help"]);
    // The summary above the usage, however it is wrapped.
    let summary: String = help
        .split("Usage:")
        .next()
        .unwrap()
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    for c in [
        "serve", "admin", "check", "count", "hash-key", "replay", "whatif", "spend",
    ] {
        assert!(help.contains(&format!("  {c} ")), "{c} missing:\n{help}");
        assert!(
            summary.contains(&format!("`{c}`")) || c == "serve",
            "{c} not in the summary:\n{help}"
        );
    }
    let (code, _, err) = tollgate(&["serve"]);
    assert_eq!(code, 2);
    assert!(err.contains("--demo"), "{err}");
}
