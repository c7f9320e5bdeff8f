//! What the server is serving now: connections (counted by the connection
//! loop, [`crate::conn::ConnStats`]), requests and long polls in service
//! (counted by [`count`], a layer inside each of the two concurrency
//! limits, so only admitted requests count) and the bytes of bodies being
//! read ([`crate::body::BodyBudget`]). The metrics read it at each scrape
//! (`shardq_http_*`, [`Load::source`]); it never limits anything itself.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::conn::ConnStats;

/// The server's load counters.
#[derive(Debug, Default)]
pub struct Load {
    /// Connections open and refused.
    pub conn: Arc<ConnStats>,
    /// Requests in service (the concurrency limit's routes).
    pub requests: Arc<AtomicUsize>,
    /// Claims and result waits in service (the polls limit's routes).
    pub polls: Arc<AtomicUsize>,
    /// Claims and result waits that found nothing to answer yet and wait.
    pub waiting: Arc<AtomicUsize>,
    /// Bytes of request bodies reserved now (the body budget's count).
    pub body_bytes: Arc<AtomicUsize>,
}

impl Load {
    /// The metrics' view of it.
    pub fn source(self: &Arc<Load>) -> shardq_metrics::http::HttpSource {
        let load = Arc::clone(self);
        Arc::new(move || shardq_metrics::http::HttpSnapshot {
            connections_open: load.conn.open.load(Ordering::Relaxed) as u64,
            connections_refused: load.conn.refused.load(Ordering::Relaxed) as u64,
            requests_in_service: load.requests.load(Ordering::Relaxed) as u64,
            polls_in_service: load.polls.load(Ordering::Relaxed) as u64,
            polls_waiting: load.waiting.load(Ordering::Relaxed) as u64,
            body_bytes_reading: load.body_bytes.load(Ordering::Relaxed) as u64,
        })
    }
}

impl Load {
    /// A long poll that found nothing and waits, counted until dropped.
    pub(crate) fn waiting(&self) -> InService {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        InService(Arc::clone(&self.waiting))
    }
}

/// One request counted until its answer is ready (or it is dropped).
pub(crate) struct InService(Arc<AtomicUsize>);

impl Drop for InService {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Middleware: counts the request in `counter` while it is served.
pub async fn count(State(counter): State<Arc<AtomicUsize>>, req: Request, next: Next) -> Response {
    counter.fetch_add(1, Ordering::Relaxed);
    let _in_service = InService(counter);
    next.run(req).await
}
