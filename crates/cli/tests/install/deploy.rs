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

/// The image builds from nothing (`FROM scratch`, no registry) with podman, as root, and holds
/// the binary it was given as its entry point. Containers are not run on these machines, so the
/// image is read rather than started: its configuration, and the binary in its one layer.
#[test]
fn the_image_builds_from_scratch_with_the_binary_alone() {
    let ctx = tempfile::tempdir().unwrap();
    let put = |from: &Path, to: &str| {
        let to = ctx.path().join(to);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, to).unwrap();
    };
    // The build context the Dockerfile names: the binary a release puts in dist/ (here the
    // test's own build) and the configuration the image serves by default.
    let binary = Path::new(env!("CARGO_BIN_EXE_tollgate"));
    put(binary, "dist/tollgate");
    put(&repo().join("deploy/Dockerfile"), "deploy/Dockerfile");
    put(
        &repo().join("deploy/compose/gateway.toml"),
        "deploy/compose/gateway.toml",
    );
    let podman = |args: &[&str]| {
        let out = Command::new("podman")
            .args(args)
            .current_dir(ctx.path())
            .output()
            .expect("podman is installed by scripts/test-deps");
        assert!(
            out.status.success(),
            "podman {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let tag = format!("localhost/tollgate-test:{}", std::process::id());
    podman(&["build", "-q", "-f", "deploy/Dockerfile", "-t", &tag, "."]);
    let inspect: serde_json::Value =
        serde_json::from_str(&podman(&["image", "inspect", &tag])).unwrap();
    let config = &inspect[0]["Config"];
    assert_eq!(
        config["Entrypoint"],
        serde_json::json!(["/tollgate"]),
        "{config}"
    );
    assert_eq!(
        config["Cmd"],
        serde_json::json!(["serve", "--config", "/etc/tollgate/gateway.toml"]),
        "{config}"
    );
    for port in ["8080/tcp", "8081/tcp", "9090/tcp"] {
        assert!(
            config["ExposedPorts"].get(port).is_some(),
            "{port}: {config}"
        );
    }
    // One layer per COPY, nothing from a base: the binary and the configuration.
    let layers = inspect[0]["RootFS"]["Layers"]
        .as_array()
        .map_or(0, Vec::len);
    assert_eq!(layers, 2, "{}", inspect[0]["RootFS"]);
    let archive = ctx.path().join("image");
    podman(&["save", "--format", "docker-dir", "-o", "image", &tag]);
    podman(&["rmi", &tag]);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(archive.join("manifest.json")).unwrap()).unwrap();
    let mut found = false;
    for layer in manifest["layers"].as_array().unwrap() {
        let digest = layer["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:");
        let out = Command::new("tar")
            .args(["-xOf", &archive.join(digest).to_string_lossy(), "tollgate"])
            .output()
            .unwrap();
        if out.status.success() && !out.stdout.is_empty() {
            assert!(
                out.stdout == std::fs::read(binary).unwrap(),
                "the image's /tollgate is not the binary given"
            );
            found = true;
        }
    }
    assert!(found, "no layer holds /tollgate: {manifest}");
}
