//! A `redis-server` process on a free loopback port, for tests that need a real Redis and its
//! faults: kill it, restart it on the same port, and it stops when dropped. Nothing is written
//! to disk (`--save ""`, no AOF).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server`.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    extra: Vec<String>,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The `process_id` of the Redis answering on `port`, if any.
fn server_pid(port: u16) -> Option<u32> {
    let mut s =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
            .ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(b"INFO server\r\n").ok()?;
    let mut buf = vec![0u8; 16 * 1024];
    let mut got = 0;
    // Read until the process id line has arrived (the reply is a few hundred bytes).
    while got < buf.len() {
        let n = s.read(&mut buf[got..]).ok()?;
        if n == 0 {
            break;
        }
        got += n;
        let text = String::from_utf8_lossy(&buf[..got]);
        if let Some(line) = text.lines().find(|l| l.starts_with("process_id:")) {
            return line["process_id:".len()..].trim().parse().ok();
        }
    }
    None
}

/// Whether `127.0.0.1:port` answers PING.
pub fn pings(port: u16) -> bool {
    let Ok(mut s) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
    else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl RedisServer {
    /// Starts a server on a free port; panics (test code) if `redis-server` is missing.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra command-line options (e.g. `--cluster-enabled yes`).
    pub fn start_with(extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        for _ in 0..5 {
            let port = free_port().expect("a free port");
            let mut s = Self {
                port,
                child: None,
                extra: extra.clone(),
            };
            if s.spawn().is_ok() {
                return s;
            }
        }
        panic!("could not start redis-server (is it installed? .ci/run installs it)");
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let dir = std::env::temp_dir();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&dir)
            .args(["--protected-mode", "no", "--loglevel", "warning"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if pings(self.port) {
                // Another test may have won a race for the same free port: only our own child
                // counts, or this test would share (and lose) someone else's server.
                let ours = self.child.as_ref().map(Child::id);
                if server_pid(self.port) == ours {
                    return Ok(());
                }
                self.kill();
                return Err(std::io::Error::other(
                    "the port was taken by another redis-server",
                ));
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    self.child = None;
                    return Err(std::io::Error::other(format!(
                        "redis-server exited: {status}"
                    )));
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        Err(std::io::Error::other(
            "redis-server did not answer within 10 s",
        ))
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server with SIGKILL (no shutdown, no save).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn().expect("redis-server restarts on its port");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A local Redis Cluster of three masters (no replicas), on free loopback ports; stopped when
/// dropped. Its node files live in a directory of its own, removed with it.
#[derive(Debug)]
pub struct RedisCluster {
    /// The three masters.
    pub nodes: Vec<RedisServer>,
    dir: std::path::PathBuf,
}

impl RedisCluster {
    /// Starts three cluster-enabled servers and joins them into one cluster covering every slot.
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tollgate-cluster-{}-{}",
            std::process::id(),
            free_port().unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir).expect("a directory for the cluster");
        let mut nodes = Vec::new();
        for i in 0..3 {
            let node_dir = dir.join(format!("n{i}"));
            std::fs::create_dir_all(&node_dir).expect("a node directory");
            let d = node_dir.to_string_lossy().into_owned();
            nodes.push(RedisServer::start_with(&[
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "2000",
                "--dir",
                &d,
            ]));
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &nodes {
            loop {
                let info = Command::new("redis-cli")
                    .args(["-p", &n.port().to_string(), "CLUSTER", "INFO"])
                    .output()
                    .expect("redis-cli runs");
                if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the cluster did not become ready"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Self { nodes, dir }
    }

    /// The seed URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
