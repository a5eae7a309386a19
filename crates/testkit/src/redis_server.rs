//! A `redis-server` process of a test's own, for tests that need a real Redis and its faults:
//! kill it, restart it where it listened, and it stops when dropped. Nothing is written to disk
//! (`--save ""`, no AOF) unless the test asks.
//!
//! By default it listens on a Unix socket in a directory of its own and on no TCP port: there is
//! no port to pick, release and lose to another process before the server binds it. A cluster
//! node and a TLS server need TCP (the cluster bus and TLS listen on TCP only); they take a free
//! port, and a server that answers there is accepted only if its process id is the child's.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Where a server listens.
#[derive(Debug, Clone)]
enum Addr {
    /// A Unix socket in the server's own directory.
    Unix(PathBuf),
    /// A loopback TCP port.
    Tcp(u16),
}

/// A running `redis-server`.
#[derive(Debug)]
pub struct RedisServer {
    addr: Addr,
    child: Option<Child>,
    extra: Vec<String>,
    /// The directory holding the socket, removed when dropped.
    dir: Option<PathBuf>,
}

/// Servers started by this process so far, for their directories' names.
static STARTED: AtomicU32 = AtomicU32::new(0);

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A connection to `addr`, with short timeouts.
fn connect(addr: &Addr) -> Option<Box<dyn ReadWrite>> {
    let timeout = Some(Duration::from_millis(500));
    match addr {
        Addr::Unix(path) => {
            let s = UnixStream::connect(path).ok()?;
            s.set_read_timeout(timeout).ok()?;
            Some(Box::new(s))
        }
        Addr::Tcp(port) => {
            let s = TcpStream::connect_timeout(
                &([127, 0, 0, 1], *port).into(),
                Duration::from_millis(200),
            )
            .ok()?;
            s.set_read_timeout(timeout).ok()?;
            Some(Box::new(s))
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// The `process_id` of the Redis answering at `addr`, if any.
fn server_pid(addr: &Addr) -> Option<u32> {
    let mut s = connect(addr)?;
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

/// Whether the Redis at `addr` answers PING.
fn pings_at(addr: &Addr) -> bool {
    let Some(mut s) = connect(addr) else {
        return false;
    };
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl RedisServer {
    /// Starts a server on a Unix socket of its own; panics (test code) if `redis-server` is
    /// missing.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server on a Unix socket of its own with extra command-line options (e.g.
    /// `--maxmemory-policy allkeys-lru`).
    pub fn start_with(extra: &[&str]) -> Self {
        let n = STARTED.fetch_add(1, Ordering::Relaxed);
        // Short: a socket's path is limited to about 100 bytes.
        let dir = std::env::temp_dir().join(format!("tgr-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory for the socket");
        let mut s = Self {
            addr: Addr::Unix(dir.join("redis.sock")),
            child: None,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            dir: Some(dir),
        };
        if let Err(e) = s.spawn() {
            panic!("could not start redis-server ({e}; is it installed? .ci/run installs it)");
        }
        s
    }

    /// Starts a server on a free loopback TCP port with extra options: for a cluster node or a
    /// TLS server, which need TCP.
    pub fn start_tcp_with(extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        for _ in 0..5 {
            let port = free_port().expect("a free port");
            let mut s = Self {
                addr: Addr::Tcp(port),
                child: None,
                extra: extra.clone(),
                dir: None,
            };
            if s.spawn().is_ok() {
                return s;
            }
        }
        panic!("could not start redis-server (is it installed? .ci/run installs it)");
    }

    fn listen_args(&self) -> Vec<String> {
        match &self.addr {
            Addr::Unix(path) => vec![
                "--port".into(),
                "0".into(),
                "--unixsocket".into(),
                path.display().to_string(),
                "--unixsocketperm".into(),
                "700".into(),
            ],
            Addr::Tcp(port) => vec![
                "--port".into(),
                port.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
            ],
        }
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let dir = self.dir.clone().unwrap_or_else(std::env::temp_dir);
        let child = Command::new("redis-server")
            .args(self.listen_args())
            .args(["--save", "", "--appendonly", "no"])
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
            if pings_at(&self.addr) {
                // On TCP another test may have won a race for the same free port: only our own
                // child counts, or this test would share (and lose) someone else's server.
                let ours = self.child.as_ref().map(Child::id);
                if server_pid(&self.addr) == ours {
                    return Ok(());
                }
                self.kill();
                return Err(std::io::Error::other(
                    "the address was taken by another redis-server",
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

    /// The TCP port of a server started with [`RedisServer::start_tcp_with`]; panics (test
    /// code) for one on a Unix socket.
    pub fn port(&self) -> u16 {
        match &self.addr {
            Addr::Tcp(port) => *port,
            Addr::Unix(path) => panic!("this server listens on {}, not TCP", path.display()),
        }
    }

    /// The Unix socket of a server started with [`RedisServer::start`], if it has one.
    pub fn socket(&self) -> Option<&Path> {
        match &self.addr {
            Addr::Unix(path) => Some(path),
            Addr::Tcp(_) => None,
        }
    }

    /// `unix:///DIR/redis.sock`, or `redis://127.0.0.1:PORT/` on TCP.
    pub fn url(&self) -> String {
        match &self.addr {
            Addr::Unix(path) => format!("unix://{}", path.display()),
            Addr::Tcp(port) => format!("redis://127.0.0.1:{port}/"),
        }
    }

    /// `redis-cli` aimed at this server; add the command's words.
    pub fn cli(&self) -> Command {
        let mut c = Command::new("redis-cli");
        match &self.addr {
            Addr::Unix(path) => c.arg("-s").arg(path),
            Addr::Tcp(port) => c.args(["-p", &port.to_string()]),
        };
        c
    }

    /// `redis-cli` run with `args` against this server: its standard output, trimmed; panics
    /// (test code) if it fails.
    pub fn cli_run(&self, args: &[&str]) -> String {
        let out = self.cli().args(args).output().expect("redis-cli runs");
        assert!(out.status.success(), "redis-cli {args:?} failed");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The server's `INFO` field `field` (e.g. `total_commands_processed`), as a number.
    pub fn info_number(&self, section: &str, field: &str) -> u64 {
        let info = self.cli_run(&["INFO", section]);
        info.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("INFO {section} has no {field}"))
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server with SIGKILL (no shutdown, no save).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again where it listened, empty (unless its options keep data on disk).
    pub fn restart(&mut self) {
        self.kill();
        if let Addr::Unix(path) = &self.addr {
            let _ = std::fs::remove_file(path);
        }
        self.spawn()
            .expect("redis-server restarts where it listened");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
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
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("a directory for the cluster");
        let mut nodes = Vec::new();
        for i in 0..3 {
            let node_dir = dir.join(format!("n{i}"));
            std::fs::create_dir_all(&node_dir).expect("a node directory");
            let d = node_dir.to_string_lossy().into_owned();
            nodes.push(RedisServer::start_tcp_with(&[
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
