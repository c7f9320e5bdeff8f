//! The HTTP server's load gauges (`shardq serve`): connections open and
//! refused, requests and long polls in service, long polls waiting, bytes of request bodies
//! being read. Read from the server's counters when a scrape comes (a few
//! atomic loads, no TTL), so they show the load as it is at the scrape:
//! how close the server runs to `--connections-max`, `--concurrency-max`,
//! `--polls-max` and `--body-bytes-in-flight-max`.

use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The server's load as the gauges show it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HttpSnapshot {
    /// Connections open now.
    pub connections_open: u64,
    /// Connections closed at once since the start because the server was
    /// full.
    pub connections_refused: u64,
    /// Requests in service now (claims and result waits aside; the health
    /// probes and the metrics aside).
    pub requests_in_service: u64,
    /// Claims and result waits in service now (long polls included).
    pub polls_in_service: u64,
    /// Of those, the ones that found nothing to answer yet and wait.
    pub polls_waiting: u64,
    /// Bytes of request bodies reserved by the requests reading them now.
    pub body_bytes_reading: u64,
}

/// Where the load gauges come from.
pub type HttpSource = Arc<dyn Fn() -> HttpSnapshot + Send + Sync>;

/// The load gauges; see the module docs.
pub(crate) struct HttpGauges {
    source: HttpSource,
    connections_open: Gauge,
    connections_refused: Gauge,
    requests: Gauge,
    polls: Gauge,
    waiting: Gauge,
    body_bytes: Gauge,
}

impl HttpGauges {
    pub(crate) fn register(registry: &mut Registry, source: HttpSource) -> Self {
        let g = HttpGauges {
            source,
            connections_open: Gauge::default(),
            connections_refused: Gauge::default(),
            requests: Gauge::default(),
            polls: Gauge::default(),
            waiting: Gauge::default(),
            body_bytes: Gauge::default(),
        };
        let r = registry;
        r.register(
            "shardq_http_connections_open",
            "Connections open now (bound: serve --connections-max)",
            g.connections_open.clone(),
        );
        r.register(
            "shardq_http_connections_refused",
            "Connections closed at once since the start because the server was full",
            g.connections_refused.clone(),
        );
        r.register(
            "shardq_http_requests_in_service",
            "Requests in service now, claims, result waits, probes and metrics aside (bound: serve --concurrency-max)",
            g.requests.clone(),
        );
        r.register(
            "shardq_http_polls_in_service",
            "Claims and result waits in service now, long polls included (bound: serve --polls-max)",
            g.polls.clone(),
        );
        r.register(
            "shardq_http_polls_waiting",
            "Claims and result waits that found nothing to answer yet and wait (idle workers, waiting readers)",
            g.waiting.clone(),
        );
        r.register(
            "shardq_http_body_bytes_reading",
            "Bytes of request bodies reserved by the requests reading them now (bound: serve --body-bytes-in-flight-max)",
            g.body_bytes.clone(),
        );
        g
    }

    /// Reads the source.
    pub(crate) fn refresh(&self) {
        let s = (self.source)();
        let set = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        set(&self.connections_open, s.connections_open);
        set(&self.connections_refused, s.connections_refused);
        set(&self.requests, s.requests_in_service);
        set(&self.polls, s.polls_in_service);
        set(&self.waiting, s.polls_waiting);
        set(&self.body_bytes, s.body_bytes_reading);
    }
}
