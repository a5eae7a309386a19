//! A TCP proxy whose link can be cut and restored, or turned to another target: a store behind
//! it is partitioned from the gateway while both keep running, or replaced by another (a
//! failover). Loopback only.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::watch;

/// Where a proxy forwards to.
#[derive(Debug, Clone)]
enum Target {
    Tcp(SocketAddr),
    Unix(Arc<PathBuf>),
}

/// Whether a link forwards, and where: each change of target ends the connections made
/// before it.
#[derive(Debug, Clone)]
struct State {
    up: bool,
    target: Target,
    generation: u64,
}

/// A running proxy to one target.
#[derive(Debug, Clone)]
pub struct Link {
    /// Where clients connect.
    pub addr: SocketAddr,
    up: Arc<watch::Sender<State>>,
}

impl Link {
    /// Starts a proxy on a free loopback port to `target`, with the link up.
    pub async fn start(target: SocketAddr) -> Self {
        Self::serve(Target::Tcp(target)).await
    }

    /// Starts a proxy on a free loopback port to the Unix socket at `path` (a test's own
    /// Redis), with the link up.
    pub async fn to_socket(path: PathBuf) -> Self {
        Self::serve(Target::Unix(Arc::new(path))).await
    }

    async fn serve(target: Target) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (up, _) = watch::channel(State {
            up: true,
            target,
            generation: 0,
        });
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
                let state = rx.borrow_and_update().clone();
                if !state.up {
                    // Cut: connections are refused as they come (closed at once).
                    drop(client);
                    continue;
                }
                let (target, generation) = (state.target, state.generation);
                tokio::spawn(async move {
                    let mut client = client;
                    let copied = async {
                        match target {
                            Target::Tcp(addr) => {
                                let mut server = TcpStream::connect(addr).await?;
                                tokio::io::copy_bidirectional(&mut client, &mut server).await
                            }
                            Target::Unix(path) => {
                                let mut server = UnixStream::connect(path.as_path()).await?;
                                tokio::io::copy_bidirectional(&mut client, &mut server).await
                            }
                        }
                    };
                    tokio::select! {
                        _ = copied => {}
                        _ = rx.wait_for(|s| !s.up || s.generation != generation) => {}
                    }
                });
            }
        });
        link
    }

    /// Cuts the link: open connections are dropped and new ones closed at once.
    pub fn cut(&self) {
        self.up.send_modify(|s| s.up = false);
    }

    /// Restores the link.
    pub fn restore(&self) {
        self.up.send_modify(|s| s.up = true);
    }

    /// Turns the link to `target`: open connections are dropped, new ones go there.
    pub fn retarget(&self, target: SocketAddr) {
        self.up.send_modify(|s| {
            s.target = Target::Tcp(target);
            s.generation += 1;
        });
    }
}
