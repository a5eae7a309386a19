//! What the binary's process tests share.

#![allow(clippy::unwrap_used, clippy::panic, dead_code)]

use std::io::BufRead;
use std::process::{Child, Command, Stdio};

/// A `tollgate serve` process, killed when dropped.
pub struct Instance(pub Child);

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Initialises the (new) store that `config` names, as its operator would before the first
/// start: `tollgate admin init-store --config CONFIG`.
pub fn init_store(config: &std::path::Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["admin", "init-store", "--config"])
        .arg(config)
        .env_remove("TOLLGATE_ADMIN_URL")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "init-store: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts `tollgate serve --config CONFIG` on a free loopback port; returns it and its URL.
pub fn start_instance(config: &std::path::Path) -> (Instance, String) {
    let (instance, mut urls) = start_instance_with(config, &[]);
    (instance, urls.remove(0))
}

/// The same, its main URL followed by the URL of each side listener named in `also` (`admin`,
/// `metrics`) as the process printed it: a configuration naming port 0 for them has the process
/// bind free ports itself, so that no test releases a port for another to take.
pub fn start_instance_with(config: &std::path::Path, also: &[&str]) -> (Instance, Vec<String>) {
    start_instance_logging(config, also, Stdio::inherit())
}

/// [`start_instance_with`], its standard error (the run-time log) sent to `log`.
pub fn start_instance_logging(
    config: &std::path::Path,
    also: &[&str],
    log: Stdio,
) -> (Instance, Vec<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(config)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut printed = Vec::new();
    for _ in 0..=also.len() {
        printed.push(lines.next().unwrap().unwrap());
    }
    let url_of = |line: &str| line.trim().rsplit(' ').next().unwrap().to_owned();
    assert!(
        printed[0].starts_with("tollgate: serving on "),
        "{printed:?}"
    );
    let mut urls = vec![url_of(&printed[0])];
    for what in also {
        let line = printed
            .iter()
            .find(|l| l.starts_with(&format!("tollgate: {what} on ")))
            .unwrap_or_else(|| panic!("no {what} listener printed: {printed:?}"));
        urls.push(url_of(line));
    }
    for url in &urls {
        assert!(url.starts_with("http://127.0.0.1:"), "{printed:?}");
    }
    (Instance(child), urls)
}

/// A temporary directory holding the admin token `token` in a file: (the directory, the file).
/// The start of a configuration with an admin listener on a free port (its token in
/// `token_file`) and one upstream, the simulator at `sim_url`, serving `gpt-4o`.
pub fn admin_head(token_file: &std::path::Path, sim_url: &str) -> String {
    format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n\
         [[upstreams]]\nname = \"sim\"\nbase_url = \"{sim_url}\"\nmodels = [\"gpt-4o\"]\n",
        token_file.display()
    )
}

pub fn admin_token_file(token: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, token).unwrap();
    (dir, file)
}

/// Serves the gateway configuration `text` in this process on a free loopback port, until the
/// test ends: its address.
pub async fn serve_in_process(text: &str) -> std::net::SocketAddr {
    let config =
        tollgate_gateway::GatewayConfig::from_toml(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tollgate_gateway::serve(
        config,
        listener,
        std::future::pending(),
    ));
    addr
}
