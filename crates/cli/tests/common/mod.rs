//! What the binary's process tests share.

#![allow(clippy::unwrap_used, dead_code)]

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

/// Starts `tollgate serve --config CONFIG` on a free loopback port; returns it and its URL.
pub fn start_instance(config: &std::path::Path) -> (Instance, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(config)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line.trim().rsplit(' ').next().unwrap().to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "{line}");
    (Instance(child), url)
}

/// A free loopback port, for a listener a configuration names.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A temporary directory holding the admin token `token` in a file: (the directory, the file).
pub fn admin_token_file(token: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, token).unwrap();
    (dir, file)
}
