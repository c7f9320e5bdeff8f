//! A minimal `/metrics` listener for processes that serve no HTTP API of
//! their own (`shardq work --metrics-listen ADDR`): an axum router with the
//! one route, on a single-threaded Tokio runtime on a thread of its own, so
//! the worker pool's threads are never involved. Rendering (which may read
//! the status) runs on the runtime's blocking pool, never on the executor.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use thiserror::Error;

use crate::{Metrics, CONTENT_TYPE};

/// Errors of the metrics listener.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The listen address is not `PORT` or `IP:PORT`.
    #[error("invalid metrics listen address {value:?}: give PORT (on 127.0.0.1) or IP:PORT, e.g. 127.0.0.1:9464")]
    Address {
        /// What was given.
        value: String,
    },
    /// Binding or serving failed.
    #[error("metrics listener on {addr}: {context}: {source}")]
    Io {
        /// The address.
        addr: SocketAddr,
        /// What was being done.
        context: &'static str,
        /// The cause.
        source: std::io::Error,
    },
}

/// Parses `PORT` (loopback, 127.0.0.1) or `IP:PORT`.
pub fn parse_listen(value: &str) -> Result<SocketAddr, MetricsError> {
    if let Ok(port) = value.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    value
        .parse::<SocketAddr>()
        .map_err(|_| MetricsError::Address {
            value: value.to_string(),
        })
}

/// The response of `GET /metrics`: [`Metrics::render`], rendered on the
/// blocking pool.
pub async fn metrics_response(metrics: Arc<Metrics>) -> Response {
    match tokio::task::spawn_blocking(move || metrics.render()).await {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering the metrics failed: {e}\n"),
        )
            .into_response(),
    }
}

/// A running listener; stops when dropped.
pub struct Listener {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Listener {
    /// Where it listens (the real port when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Binds `addr` and serves `GET /metrics` from `metrics` on a thread of its
/// own until the returned [`Listener`] is dropped. Binding errors are
/// returned here, not later.
pub fn spawn_listener(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<Listener, MetricsError> {
    let io = |context, source| MetricsError::Io {
        addr,
        context,
        source,
    };
    let std_listener = std::net::TcpListener::bind(addr).map_err(|e| io("binding", e))?;
    let bound = std_listener
        .local_addr()
        .map_err(|e| io("reading the bound address", e))?;
    std_listener
        .set_nonblocking(true)
        .map_err(|e| io("configuring the socket", e))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .max_blocking_threads(2)
        .build()
        .map_err(|e| io("starting the async runtime", e))?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || metrics_response(Arc::clone(&metrics))),
        )
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "not found: the only path here is /metrics\n",
            )
        });
    let thread = std::thread::Builder::new()
        .name(format!("shardq-metrics-{bound}"))
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        eprintln!(
                            "shardq: metrics listener on {bound}: registering the socket: {e}"
                        );
                        return;
                    }
                };
                let served = axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stop_rx.await;
                    })
                    .await;
                if let Err(e) = served {
                    eprintln!("shardq: metrics listener on {bound}: {e}");
                }
            })
        })
        .map_err(|e| io("starting the listener thread", e))?;
    Ok(Listener {
        addr: bound,
        stop: Some(stop_tx),
        thread: Some(thread),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_port_is_loopback_and_garbage_is_named() {
        assert_eq!(
            parse_listen("9464").unwrap(),
            "127.0.0.1:9464".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            parse_listen("0.0.0.0:1").unwrap(),
            "0.0.0.0:1".parse::<SocketAddr>().unwrap()
        );
        let e = parse_listen("localhost").unwrap_err().to_string();
        assert!(e.contains("\"localhost\""), "{e}");
    }
}
