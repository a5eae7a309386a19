//! A PostgreSQL server of a test's own: `initdb` into a fresh directory, `pg_ctl start` listening
//! on a Unix socket in that directory only (no TCP port: none to pick, release and lose to
//! another process before the server binds it), trust authentication for the one local user,
//! stopped (`immediate`) and removed when dropped. As root (PostgreSQL refuses to run as root)
//! the server runs as the `postgres` user, which owns the directory.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A running PostgreSQL.
#[derive(Debug)]
pub struct PgServer {
    dir: PathBuf,
}

/// The port number names the socket file (`.s.PGSQL.5432`) in the server's own directory.
const PORT: u16 = 5432;

/// Servers started by this process so far, for their directories' names.
static STARTED: AtomicU32 = AtomicU32::new(0);

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
        let n = STARTED.fetch_add(1, Ordering::Relaxed);
        // Short: a socket's path is limited to about 100 bytes.
        let dir = std::env::temp_dir().join(format!("tgpg-{}-{n}", std::process::id()));
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
        let server = Self { dir };
        server.pg_ctl_start();
        server
    }

    fn pg_ctl_start(&self) {
        let opts = format!(
            "-p {PORT} -k {} -c listen_addresses='' -c fsync=off -c full_page_writes=off",
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
        let socket = self.dir.join(format!(".s.PGSQL.{PORT}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                Instant::now() < deadline,
                "PostgreSQL did not listen within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `postgres://tollgate@<the socket's directory, percent-encoded>:5432/postgres`: libpq's
    /// form for a Unix socket.
    pub fn url(&self) -> String {
        let dir: String = self
            .dir
            .display()
            .to_string()
            .bytes()
            .map(|b| match b {
                b'/' => "%2F".to_owned(),
                b => char::from(b).to_string(),
            })
            .collect();
        format!("postgres://tollgate@{dir}:{PORT}/postgres")
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

    /// Starts it again on its socket, with its data.
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
