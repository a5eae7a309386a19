//! A TCP proxy whose link can be cut and restored: a store behind it is partitioned from the
//! gateway while both keep running. Loopback only.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy to one target.
#[derive(Debug, Clone)]
pub struct Link {
    /// Where clients connect.
    pub addr: SocketAddr,
    up: Arc<watch::Sender<bool>>,
}

impl Link {
    /// Starts a proxy on a free loopback port to `target`, with the link up.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (up, _) = watch::channel(true);
        let up = Arc::new(up);
        let link = Self {
            addr,
            up: up.clone(),
        };
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let mut rx = up.subscribe();
                if !*rx.borrow_and_update() {
                    // Cut: connections are refused as they come (closed at once).
                    drop(client);
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut client, mut server) = (client, server);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = rx.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        link
    }

    /// Cuts the link: open connections are dropped and new ones closed at once.
    pub fn cut(&self) {
        self.up.send_replace(false);
    }

    /// Restores the link.
    pub fn restore(&self) {
        self.up.send_replace(true);
    }
}
