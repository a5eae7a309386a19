//! Client connections, bounded: how many are open in all and per client address, how long one
//! may take from accept to its first complete request head (the first byte and any protocol
//! detection included), and how long it may sit idle between requests. A connection that says
//! nothing is closed at its deadline, so silent sockets cannot hold the listener full.
//!
//! HTTP/1.1 only unless HTTP/2 is configured: detecting the version waits for bytes before any
//! HTTP/1 timeout applies, and cleartext HTTP/2 has none of its own; both are bounded here by
//! the same deadlines, whatever the protocol.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

use crate::config::GatewayConfig;

/// Connections on the admin and metrics listeners at most, in all and per client address.
const PRIVATE_CONNECTIONS: usize = 64;
const PRIVATE_CONNECTIONS_PER_IP: usize = 16;

/// The bounds of one listener's connections.
#[derive(Debug, Clone)]
pub struct Limits {
    /// From accept to the first complete request head.
    pub header_timeout: Duration,
    /// From the end of a response to the next complete request head.
    pub idle_timeout: Duration,
    /// Open connections in all.
    pub max_connections: usize,
    /// Open connections per client address (an IPv6 /64).
    pub per_ip: usize,
    /// Addresses the per-address cap does not apply to (trusted proxies carry many clients).
    pub exempt: Vec<IpAddr>,
    /// HTTP/2 served too, with this many streams per connection.
    pub http2_max_streams: Option<u32>,
}

impl Limits {
    /// The public listener's, from `[server]`.
    pub fn public(cfg: &GatewayConfig) -> Self {
        Self {
            header_timeout: cfg.header_timeout,
            idle_timeout: cfg.idle_timeout,
            max_connections: cfg.max_connections,
            per_ip: cfg.max_connections_per_ip,
            exempt: cfg.trusted_proxies.clone(),
            http2_max_streams: cfg.http2_max_streams,
        }
    }

    /// The admin and metrics listeners': the same deadlines, fewer connections, HTTP/1.1.
    pub fn private(cfg: &GatewayConfig) -> Self {
        Self {
            header_timeout: cfg.header_timeout,
            idle_timeout: cfg.idle_timeout,
            max_connections: PRIVATE_CONNECTIONS,
            per_ip: PRIVATE_CONNECTIONS_PER_IP,
            exempt: Vec::new(),
            http2_max_streams: None,
        }
    }
}

/// The connections a listener accepted, for the drain at shutdown.
#[derive(Debug)]
pub struct Connections {
    set: JoinSet<()>,
    drain: watch::Sender<bool>,
}

impl Connections {
    /// Asks every connection to finish the request it is serving and close; after `timeout`,
    /// cuts off those still open (each request's ticket is dropped with its connection, or its
    /// answer's reading is cut off, which releases it in the store, charged its reservation).
    pub async fn drain(&mut self, timeout: Duration) {
        let _ = self.drain.send(true);
        let drained = tokio::time::timeout(timeout, async {
            while self.set.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                connections = self.set.len(),
                drain_timeout = ?timeout,
                "connections still serving at the end of the drain are cut off: their requests \
                 are released, charged their reservations"
            );
            self.set.abort_all();
            while self.set.join_next().await.is_some() {}
        }
    }
}

/// Accepts connections on `listener` and serves `app` on each within `limits`, until
/// `shutdown` completes; then stops accepting and returns the connections still open.
pub async fn accept(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> Connections {
    let limits = Arc::new(limits);
    let total = Arc::new(Semaphore::new(limits.max_connections));
    let per_ip = Arc::new(PerIp::default());
    let (drain, drain_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // Ended connections leave the set.
        while set.try_join_next().is_some() {}
        let (stream, peer): (_, SocketAddr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(_) => continue,
            },
            () = &mut shutdown => break,
        };
        // Over a limit: close at once rather than queue without bound.
        let Ok(permit) = total.clone().try_acquire_owned() else {
            crate::telemetry::connection_refused("max_connections");
            continue;
        };
        let Some(slot) = per_ip.enter(peer.ip(), &limits) else {
            crate::telemetry::connection_refused("max_connections_per_ip");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = serve(stream, peer, app.clone(), limits.clone(), drain_rx.clone());
        set.spawn(async move {
            conn.await;
            drop((permit, slot));
        });
    }
    Connections { set, drain }
}

/// Serves one connection until it ends, idles past its deadline, or is drained.
async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: Arc<Limits>,
    mut drain: watch::Receiver<bool>,
) {
    let activity = Activity::new(Instant::now() + limits.header_timeout, limits.idle_timeout);
    let idle = activity.expired();
    let svc = hyper::service::service_fn(move |mut req: Request<hyper::body::Incoming>| {
        let busy = activity.begin();
        req.extensions_mut().insert(ConnectInfo(peer));
        let app = app.clone();
        async move {
            let resp = app.oneshot(req.map(Body::new)).await?;
            Ok::<_, std::convert::Infallible>(resp.map(|b| Body::new(Tracked { body: b, busy })))
        }
    });
    let io = TokioIo::new(stream);
    match limits.http2_max_streams {
        None => {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = b.serve_connection(io, svc);
            drive(conn, |c| c.graceful_shutdown(), idle, &mut drain).await;
        }
        Some(streams) => {
            let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            b.http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            b.http2()
                .timer(TokioTimer::new())
                .max_concurrent_streams(streams);
            let conn = b.serve_connection(io, svc);
            drive(conn, |c| c.graceful_shutdown(), idle, &mut drain).await;
        }
    }
}

/// Runs `conn` until it ends or `idle` fires (the connection is then dropped, which closes
/// it); on a drain, lets it finish the request under way (a stream to its end), then close.
async fn drive<C, E>(
    conn: C,
    graceful: impl FnOnce(Pin<&mut C>),
    idle: impl Future<Output = ()>,
    drain: &mut watch::Receiver<bool>,
) where
    C: Future<Output = Result<(), E>>,
{
    let mut conn = std::pin::pin!(conn);
    let draining = tokio::select! {
        _ = conn.as_mut() => false,
        () = idle => false,
        r = drain.wait_for(|d| *d) => r.is_ok(),
    };
    if draining {
        graceful(conn.as_mut());
        let _ = conn.await;
    }
}

/// Open connections per client address: an IPv4 address, or an IPv6 /64.
#[derive(Debug, Default)]
struct PerIp {
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place in [`PerIp`]; dropping it frees the place.
struct IpSlot {
    table: Arc<PerIp>,
    ip: Option<IpAddr>,
}

impl PerIp {
    fn enter(self: &Arc<Self>, peer: IpAddr, limits: &Limits) -> Option<IpSlot> {
        if limits.exempt.contains(&peer) {
            return Some(IpSlot {
                table: self.clone(),
                ip: None,
            });
        }
        let ip = network(peer);
        let mut open = self.open.lock().ok()?;
        let n = open.entry(ip).or_default();
        if *n >= limits.per_ip {
            return None;
        }
        *n += 1;
        Some(IpSlot {
            table: self.clone(),
            ip: Some(ip),
        })
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let Some(ip) = self.ip else { return };
        if let Ok(mut open) = self.table.open.lock() {
            if let Some(n) = open.get_mut(&ip) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    open.remove(&ip);
                }
            }
        }
    }
}

/// The address a client is counted under: itself for IPv4, its /64 for IPv6.
fn network(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(a) => match a.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(a) & !((1u128 << 64) - 1)).into()),
        },
        v4 => v4,
    }
}

/// Whether a connection is serving requests, and when it must have sent its next head.
#[derive(Debug, Clone, Copy)]
struct State {
    busy: usize,
    deadline: Instant,
}

/// A connection's activity, shared by its requests and its watchdog.
#[derive(Clone)]
struct Activity {
    tx: Arc<watch::Sender<State>>,
    idle_timeout: Duration,
}

/// A request under way on a connection; its end (the response body done or dropped) starts
/// the idle deadline once no other request is under way.
struct Busy(Activity);

impl Activity {
    fn new(deadline: Instant, idle_timeout: Duration) -> Self {
        let (tx, _) = watch::channel(State { busy: 0, deadline });
        Self {
            tx: Arc::new(tx),
            idle_timeout,
        }
    }

    fn begin(&self) -> Busy {
        self.tx.send_modify(|s| s.busy += 1);
        Busy(self.clone())
    }

    /// Completes when the connection has been idle past its deadline.
    fn expired(&self) -> impl Future<Output = ()> + use<> {
        let mut rx = self.tx.subscribe();
        async move {
            loop {
                let s = *rx.borrow_and_update();
                if s.busy > 0 {
                    if rx.changed().await.is_err() {
                        return std::future::pending().await;
                    }
                    continue;
                }
                tokio::select! {
                    () = tokio::time::sleep_until(s.deadline) => {
                        let now = *rx.borrow();
                        if now.busy == 0 && now.deadline <= Instant::now() {
                            return;
                        }
                    }
                    r = rx.changed() => {
                        if r.is_err() {
                            return std::future::pending().await;
                        }
                    }
                }
            }
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let idle = self.0.idle_timeout;
        self.0.tx.send_modify(|s| {
            s.busy = s.busy.saturating_sub(1);
            if s.busy == 0 {
                s.deadline = Instant::now() + idle;
            }
        });
    }
}

/// A response body that holds its request's [`Busy`] until it is done (dropped with it).
struct Tracked {
    body: Body,
    #[allow(dead_code)] // held for its `Drop`
    busy: Busy,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}
