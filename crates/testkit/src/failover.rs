//! A managed Redis failing over, on loopback: a primary, a replica that reaches it through a
//! relay the test controls (cut, the replica lags), and the gateways' link, turned from the
//! primary to the promoted replica. What a failover to a replica that lagged leaves behind: the
//! marker, replicated long ago, and none of the last writes.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::faults::Link;
use crate::redis_server::RedisServer;

/// A primary, its replica, and the two links.
#[derive(Debug)]
pub struct Failover {
    pub primary: RedisServer,
    pub replica: RedisServer,
    /// The replication link: the replica reaches the primary through it.
    pub replication: Link,
    /// The gateways' link: to the primary, then to the promoted replica.
    pub store: Link,
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

impl Failover {
    /// Starts both servers, the replica replicating and caught up.
    pub async fn start() -> Self {
        let primary = RedisServer::start_tcp_with(&[]);
        let replication = Link::start(local(primary.port())).await;
        let port = replication.addr.port().to_string();
        let replica = RedisServer::start_tcp_with(&[
            "--replicaof",
            "127.0.0.1",
            &port,
            "--repl-diskless-load",
            "swapdb",
        ]);
        let store = Link::start(local(primary.port())).await;
        let f = Self {
            primary,
            replica,
            replication,
            store,
        };
        f.until_linked().await;
        f
    }

    /// The gateways' store URL.
    pub fn url(&self) -> String {
        format!("redis://{}/", self.store.addr)
    }

    async fn until_linked(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self
            .replica
            .cli_run(&["INFO", "replication"])
            .contains("master_link_status:up")
        {
            assert!(Instant::now() < deadline, "the replica links within 10 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the replica holds every write the primary took (`WAIT 1`).
    pub fn catch_up(&self) {
        let acked = self.primary.cli_run(&["WAIT", "1", "5000"]);
        assert_eq!(acked, "1", "the replica acknowledged the primary's writes");
    }

    /// The replica stops receiving the primary's writes: the replication link is cut.
    pub fn lag(&self) {
        self.replication.cut();
    }

    /// The replica freezes (`SIGSTOP`, or `SIGCONT` to thaw): still linked, as the primary
    /// sees it, and acknowledging nothing.
    pub fn freeze_replica(&self, frozen: bool) {
        let pid = self.replica.pid().expect("the replica runs").to_string();
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let status = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// The primary dies, the replica is promoted, and the gateways' link turns to it.
    pub fn fail_over(&mut self) {
        self.primary.kill();
        assert_eq!(self.replica.cli_run(&["REPLICAOF", "NO", "ONE"]), "OK");
        self.store.retarget(local(self.replica.port()));
    }
}
