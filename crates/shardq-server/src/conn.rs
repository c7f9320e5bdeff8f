//! The connection loop: accepts TCP connections, serves each with hyper's
//! HTTP/1 server, and bounds what a client can hold without sending work:
//!
//! * a request's header must fit in [`READ_BUFFER_BYTES_MAX`], so a
//!   header that never ends costs at most that much memory;
//! * a connection must send a whole request header within
//!   [`HEADER_READ_TIMEOUT_MS`], and an idle keep-alive connection is
//!   closed after the same time (hyper starts the timer again after each
//!   response), so silent sockets and half headers do not stay open;
//! * at most [`ConnLimits::connections_max`] connections are open at once;
//!   one more is accepted and closed at once, so the listen queue keeps
//!   moving and a flood never takes the file descriptors that the lease
//!   machinery needs ([`FDS_RESERVED`] are kept free for it);
//! * a connection whose peer stops reading (its receive window full) may
//!   stall a write for at most [`ConnLimits::write_stall_ms`], then it is
//!   closed: a client that never reads its answers cannot hold a
//!   connection for good;
//! * a failed `accept` (out of file descriptors) rests for
//!   [`ACCEPT_RETRY_MS`] instead of spinning.
//!
//! Shutdown stops accepting, lets the requests in flight finish and closes
//! idle connections. This module must never look at a request: routing,
//! limits per request and auth are the router's.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// Longest wait for a request's whole header, and longest idle time of a
/// keep-alive connection between requests (20 s).
pub const HEADER_READ_TIMEOUT_MS: u64 = 20_000;
/// Longest a write may make no progress before its connection is closed
/// (20 s).
pub const WRITE_STALL_MS_DEFAULT: u64 = 20_000;
/// Most bytes a connection's read buffer may hold (16 KiB): a request
/// line and its headers must fit (the longest key, a token and the usual
/// headers take a few KiB); a header that does not end within it is
/// refused (431) instead of growing the buffer. So unfinished headers cost
/// at most this per connection, [`CONNECTIONS_MAX_DEFAULT`] x 16 KiB =
/// 64 MiB in all. Bodies stream past it (their own bound is the router's).
pub const READ_BUFFER_BYTES_MAX: usize = 16 * 1024;
/// Default most connections open at once.
pub const CONNECTIONS_MAX_DEFAULT: usize = 4096;
/// File descriptors kept free of connections for the store, the leases,
/// the logs and the map (each lease tick opens a lock file).
pub const FDS_RESERVED: usize = 256;
/// Rest after a failed `accept` (such as EMFILE), in ms.
pub const ACCEPT_RETRY_MS: u64 = 50;
/// Length of the listen queue (the kernel caps it at `somaxconn`): a burst
/// of this many connects is queued, where std's 128 drops the rest's SYNs
/// and their clients wait a second for the retransmit.
pub const LISTEN_BACKLOG: i32 = 1024;

/// Binds a non-blocking listening socket on `addr` with a queue of
/// [`LISTEN_BACKLOG`].
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// The connection bounds of one server.
#[derive(Debug, Clone)]
pub struct ConnLimits {
    /// Most connections open at once.
    pub connections_max: usize,
    /// See [`HEADER_READ_TIMEOUT_MS`].
    pub header_read_timeout_ms: u64,
    /// Longest a write may make no progress, in ms.
    pub write_stall_ms: u64,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            connections_max: CONNECTIONS_MAX_DEFAULT,
            header_read_timeout_ms: HEADER_READ_TIMEOUT_MS,
            write_stall_ms: WRITE_STALL_MS_DEFAULT,
        }
    }
}

/// Raises the soft limit of open files to the hard one and returns how
/// many connections fit under it with [`FDS_RESERVED`] kept free, at most
/// `wanted`.
pub fn connections_that_fit(wanted: usize) -> usize {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if let (Some(cur), Some(max)) = (lim.current, lim.maximum) {
        if cur < max {
            lim.current = Some(max);
            // Best effort: on failure the current limit stands.
            let _ = setrlimit(Resource::Nofile, lim);
        }
    }
    let soft = getrlimit(Resource::Nofile)
        .current
        .map(|n| n as usize)
        .unwrap_or(usize::MAX);
    wanted.min(soft.saturating_sub(FDS_RESERVED)).max(1)
}

/// Counters of the loop, for tests and metrics.
#[derive(Debug, Default)]
pub struct ConnStats {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Connections closed at once because the server was full.
    pub refused: AtomicUsize,
}

async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Serves `router` on `listener` until `shutdown` completes, then drains.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    limits: ConnLimits,
    stats: Arc<ConnStats>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Semaphore::new(limits.connections_max.max(1)));
    // Set on shutdown: the loop and every connection task see it.
    let (stop_tx, mut stop_rx) = watch::channel(false);
    // Each connection task holds a receiver: closed once all are done.
    let (done_tx, done_rx) = watch::channel(());
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let header_timeout = Duration::from_millis(limits.header_read_timeout_ms.max(1));
    let write_stall = Duration::from_millis(limits.write_stall_ms.max(1));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped(&mut stop_rx) => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(_) => {
                // Out of descriptors (or a connection reset before accept):
                // rest, the connections in flight finish and free some.
                tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let mut stop = stop_rx.clone();
        let done = done_rx.clone();
        let stats = Arc::clone(&stats);
        stats.open.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(READ_BUFFER_BYTES_MAX)
                .keep_alive(true);
            let io = StallBound::new(stream, write_stall);
            let conn = builder.serve_connection(TokioIo::new(io), service);
            tokio::pin!(conn);
            let stopping = async move { stopped(&mut stop).await };
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stopping => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.as_mut().await;
                }
            }
            stats.open.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
            drop(done);
        });
    }
    drop(listener);
    drop(done_rx);
    done_tx.closed().await;
}

/// A stream whose writes may stay pending (the peer does not read) for at
/// most `bound` in a row: past it they fail with `TimedOut`, which ends the
/// connection. Reads pass through (their timeouts are hyper's).
struct StallBound<T> {
    inner: T,
    bound: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> StallBound<T> {
    fn new(inner: T, bound: Duration) -> StallBound<T> {
        StallBound {
            inner,
            bound,
            stalled: None,
        }
    }

    /// The outcome of a write-side poll: progress clears the timer, a
    /// pending one starts it (or fails once it has run out).
    fn bounded<R>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<std::io::Result<R>>,
    ) -> Poll<std::io::Result<R>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let bound = self.bound;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(bound)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the peer read nothing of the answer within the write bound",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallBound<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallBound<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.bounded(cx, polled)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.bounded(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.bounded(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.bounded(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
