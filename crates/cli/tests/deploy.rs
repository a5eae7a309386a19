//! The install path, as far as these machines can check it: the compose file parses and has
//! what production needs, its gateway configuration passes `tollgate check`, the release
//! tarball holds the binary, the examples, the dashboard and the alert rules (and its binary
//! runs), and, where a Docker engine runs, the image builds without a base and answers
//! `/healthz`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> PathBuf {
    std::env::var("TOLLGATE_PYTHON").map_or_else(|_| repo().join(".venv/bin/python"), PathBuf::from)
}

/// `tollgate check FILE` with the variables the compose file gives the gateway.
fn check(file: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("check")
        .arg(file)
        .env("OPENAI_API_KEY", "sk-checked")
        .env("TOLLGATE_ADMIN_TOKEN", "admin-token-0123456789")
        .env(
            "TOLLGATE_LEDGER_URL",
            "postgres://tollgate:secret@postgres:5432/tollgate",
        )
        .output()
        .unwrap()
}

#[test]
fn the_compose_file_parses_and_its_gateway_configuration_passes_check() {
    let out = Command::new(python())
        .arg(repo().join("tests/deploy/compose_check.py"))
        .arg(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = check(&repo().join("deploy/compose/gateway.toml"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok: gateway configuration"));
}

#[test]
fn the_release_tarball_holds_what_an_operator_needs() {
    let dist = tempfile::tempdir().unwrap();
    let out = Command::new(repo().join("scripts/release"))
        .env("TOLLGATE_BINARY", env!("CARGO_BIN_EXE_tollgate"))
        .env("TOLLGATE_DIST", dist.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tarball = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let unpacked = tempfile::tempdir().unwrap();
    let out = Command::new("tar")
        .args(["-xzf", &tarball, "-C"])
        .arg(unpacked.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    let top = std::fs::read_dir(unpacked.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    for file in [
        "tollgate",
        "README.md",
        "CHANGELOG.md",
        "docs/keys.md",
        "examples/gateway.toml",
        "deploy/grafana-dashboard.json",
        "deploy/prometheus-alerts.yml",
        "deploy/Dockerfile",
        "deploy/compose/compose.yaml",
    ] {
        assert!(top.join(file).exists(), "{file} missing from {tarball}");
    }
    let out = Command::new(top.join("tollgate"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("tollgate "));
    assert!(check(&top.join("examples/gateway.toml")).status.success());
}

/// Only where a Docker engine answers (`docker info`); these machines have the client alone,
/// and the README says so.
#[test]
#[allow(clippy::print_stderr)] // the one line that says why nothing was built
fn the_image_builds_from_scratch_and_answers_healthz_where_docker_runs() {
    let engine = Command::new("docker")
        .arg("info")
        .output()
        .is_ok_and(|o| o.status.success());
    if !engine {
        eprintln!("no Docker engine here: the image's build is not checked (README, Install)");
        return;
    }
    // The image takes the static binary a release builds.
    let out = Command::new(repo().join("scripts/release"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let docker = |args: &[&str]| {
        let out = Command::new("docker")
            .args(args)
            .current_dir(repo())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "docker {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    docker(&[
        "build",
        "-f",
        "deploy/Dockerfile",
        "-t",
        "tollgate:test",
        ".",
    ]);
    let id = docker(&[
        "run",
        "-d",
        "--network",
        "host",
        "tollgate:test",
        "serve",
        "--demo",
        "--listen",
        "127.0.0.1:0",
    ]);
    let url = tollgate_testkit::wait::at_most_blocking(
        std::time::Duration::from_secs(10),
        || {
            let logs = docker(&["logs", &id]);
            // The demo's banner: `  gateway:   http://127.0.0.1:PORT   (…`.
            logs.lines()
                .find_map(|l| l.trim().strip_prefix("gateway:"))
                .and_then(|rest| rest.split_whitespace().next())
                .map(str::to_owned)
        },
        Option::is_some,
    );
    let url = url.expect("the container printed where it serves");
    let out = Command::new("curl")
        .args(["-s", &format!("{url}/healthz")])
        .output()
        .unwrap();
    docker(&["rm", "-f", &id]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok");
}
