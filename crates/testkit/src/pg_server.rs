//! A PostgreSQL server of a test's own: `initdb` into a fresh directory, `pg_ctl start` on a free
//! loopback port, trust authentication for the one local user, stopped (`immediate`) and removed
//! when dropped. As root (PostgreSQL refuses to run as root) the server runs as the `postgres`
//! user, which owns the directory.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A running PostgreSQL.
#[derive(Debug)]
pub struct PgServer {
    port: u16,
    dir: PathBuf,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Whether this process runs as root.
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// `prog` as a command, run as `postgres` when this process is root.
fn pg_cmd(prog: &str) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", prog]);
        c
    } else {
        Command::new(prog)
    }
}

impl PgServer {
    /// Makes a cluster and starts it; panics (test code) if PostgreSQL is missing.
    pub fn start() -> Self {
        let port = free_port().expect("a free port");
        let dir = std::env::temp_dir().join(format!("tollgate-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let data = dir.join("data");
        std::fs::create_dir_all(&dir).expect("a directory for PostgreSQL");
        if is_root() {
            let _ = Command::new("chown").arg("postgres").arg(&dir).status();
        }
        let ok = pg_cmd("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "tollgate", "--no-sync", "-E", "UTF8"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("initdb runs (is PostgreSQL installed? .ci/run installs it)");
        assert!(ok.success(), "initdb failed");
        let server = Self { port, dir };
        server.pg_ctl_start();
        server
    }

    fn pg_ctl_start(&self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off",
            self.port,
            self.dir.display()
        );
        let ok = pg_cmd("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-o", &opts, "-l"])
            .arg(self.dir.join("log"))
            .args(["-w", "-t", "30", "start"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("pg_ctl runs");
        assert!(
            ok.success(),
            "pg_ctl start failed: see {}",
            self.dir.join("log").display()
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "PostgreSQL did not listen within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `postgres://tollgate@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://tollgate@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server (fast shutdown), as a database going down does.
    pub fn stop(&self) {
        let _ = pg_cmd("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "fast", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }

    /// Starts it again on its port, with its data.
    pub fn restart(&self) {
        self.stop();
        self.pg_ctl_start();
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = pg_cmd("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
