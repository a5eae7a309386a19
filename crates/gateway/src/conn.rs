//! Client connections, bounded: how many are open in all and per client address, how long one
//! may take from accept to its first complete request head (the first byte and any protocol
//! detection included), and how long it may sit idle between requests. A connection that says
//! nothing is closed at its deadline, so silent sockets cannot hold the listener full.
//!
//! A full admin or metrics listener closes its longest-idle connection (one that has not sent a
//! complete request head, or sits between requests) to take a new one: silent sockets and idle
//! keep-alives cannot keep the operator out, whoever opened them. A connection serving a request
//! is never closed for another; what a tenant's token may hold that way is bounded by the admin
//! routes.
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
    /// Which listener, as the connection gauge names it: `public`, or `private` (admin and
    /// metrics).
    pub listener: &'static str,
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
    /// When full, close the longest-idle connection to take a new one (rather than refuse it).
    pub evict_idle: bool,
}

impl Limits {
    /// The public listener's, from `[server]`.
    pub fn public(cfg: &GatewayConfig) -> Self {
        Self {
            listener: "public",
            header_timeout: cfg.header_timeout,
            idle_timeout: cfg.idle_timeout,
            max_connections: cfg.max_connections,
            per_ip: cfg.max_connections_per_ip,
            exempt: cfg.trusted_proxies.clone(),
            http2_max_streams: cfg.http2_max_streams,
            evict_idle: false,
        }
    }

    /// The admin and metrics listeners': the same deadlines, fewer connections, HTTP/1.1, and
    /// room made for a new connection by closing the longest-idle one.
    pub fn private(cfg: &GatewayConfig) -> Self {
        Self {
            listener: "private",
            header_timeout: cfg.header_timeout,
            idle_timeout: cfg.idle_timeout,
            max_connections: PRIVATE_CONNECTIONS,
            per_ip: PRIVATE_CONNECTIONS_PER_IP,
            exempt: Vec::new(),
            http2_max_streams: None,
            evict_idle: true,
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
    let open = Arc::new(Open::default());
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
        // Over a limit: close at once rather than queue without bound, unless an idle
        // connection may make room.
        let places = match enter(&total, &per_ip, peer.ip(), &limits) {
            Ok(p) => Ok(p),
            Err(full) if limits.evict_idle => open
                .make_room(full, peer.ip(), || {
                    enter(&total, &per_ip, peer.ip(), &limits)
                })
                .await
                .map_err(|_| full),
            Err(full) => Err(full),
        };
        let (permit, slot) = match places {
            Ok(p) => p,
            Err(full) => {
                crate::telemetry::connection_refused(full.limit());
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let activity = Activity::new(Instant::now() + limits.header_timeout, limits.idle_timeout);
        let entry = open.add(network(peer.ip()), &activity);
        let conn = serve(
            stream,
            peer,
            app.clone(),
            limits.clone(),
            activity,
            drain_rx.clone(),
        );
        let counted = Counted::new(limits.listener);
        set.spawn(async move {
            conn.await;
            drop((permit, slot, entry, counted));
        });
    }
    Connections { set, drain }
}

/// An open connection in the gauge, for as long as it is held (a connection cut off at the
/// drain is dropped with its task).
struct Counted(&'static str);

impl Counted {
    fn new(listener: &'static str) -> Self {
        crate::telemetry::connections_open(listener, 1.0);
        Self(listener)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        crate::telemetry::connections_open(self.0, -1.0);
    }
}

/// Serves one connection until it ends, idles past its deadline, or is drained.
async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: Arc<Limits>,
    activity: Activity,
    mut drain: watch::Receiver<bool>,
) {
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

/// Which limit a connection found full.
#[derive(Debug, Clone, Copy)]
enum Full {
    Total,
    PerIp,
}

impl Full {
    fn limit(self) -> &'static str {
        match self {
            Self::Total => "max_connections",
            Self::PerIp => "max_connections_per_ip",
        }
    }
}

/// A connection's places in both limits.
type Places = (tokio::sync::OwnedSemaphorePermit, IpSlot);

fn enter(
    total: &Arc<Semaphore>,
    per_ip: &Arc<PerIp>,
    ip: IpAddr,
    limits: &Limits,
) -> Result<Places, Full> {
    let permit = total.clone().try_acquire_owned().map_err(|_| Full::Total)?;
    let slot = per_ip.enter(ip, limits).ok_or(Full::PerIp)?;
    Ok((permit, slot))
}

/// The connections open on a listener, by network, with their activity: for closing the
/// longest-idle one when the listener is full.
#[derive(Default)]
struct Open {
    next: std::sync::atomic::AtomicU64,
    conns: Mutex<HashMap<u64, (IpAddr, Watched)>>,
    /// Told when a connection ends.
    freed: tokio::sync::Notify,
}

/// A connection's activity, as [`Open`] watches it.
type Watched = Arc<watch::Sender<State>>;

/// A connection's entry in [`Open`]; dropping it removes the entry and says a place is free.
struct Entry(Arc<Open>, u64);

impl Open {
    fn add(self: &Arc<Self>, net: IpAddr, activity: &Activity) -> Entry {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut c) = self.conns.lock() {
            c.insert(id, (net, activity.tx.clone()));
        }
        Entry(self.clone(), id)
    }

    /// Closes the idle connection (of `peer`'s network when that is what is full) nearest its
    /// deadline, and waits a moment for its place; then `enter` again.
    async fn make_room(
        &self,
        full: Full,
        peer: IpAddr,
        enter: impl Fn() -> Result<Places, Full>,
    ) -> Result<Places, Full> {
        let net = network(peer);
        let victim = self.conns.lock().ok().and_then(|c| {
            c.values()
                .filter(|(n, _)| matches!(full, Full::Total) || *n == net)
                .map(|(_, tx)| (tx.borrow().deadline, tx.clone()))
                .filter(|(_, tx)| tx.borrow().busy == 0)
                .min_by_key(|(deadline, _)| *deadline)
                .map(|(_, tx)| tx)
        });
        let Some(victim) = victim else {
            return Err(full);
        };
        let deadline = Instant::now() + Duration::from_millis(250);
        victim.send_if_modified(|s| {
            let idle = s.busy == 0;
            s.cut |= idle;
            idle
        });
        crate::telemetry::connection_evicted();
        loop {
            // Listening before looking, so that no place freed between the two is missed.
            let freed = self.freed.notified();
            match enter() {
                Ok(p) => return Ok(p),
                Err(f) if Instant::now() >= deadline => return Err(f),
                Err(_) => {
                    let _ = tokio::time::timeout_at(deadline, freed).await;
                }
            }
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        if let Ok(mut c) = self.0.conns.lock() {
            c.remove(&self.1);
        }
        self.0.freed.notify_waiters();
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
    /// Closed to make room for another connection (only while idle).
    cut: bool,
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
        let (tx, _) = watch::channel(State {
            busy: 0,
            deadline,
            cut: false,
        });
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
                if s.cut {
                    return;
                }
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
