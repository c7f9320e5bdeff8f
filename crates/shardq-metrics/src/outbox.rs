//! The Postgres outbox's gauges (`shardq serve --outbox-postgres`): its
//! depth, the oldest row's age (the relay's lag), whether a relay is
//! active, the transactions holding keys back and the table's dead tuples,
//! read from a source when a scrape comes, at most once per TTL, like the
//! per-shard gauges. An outbox that cannot be read sets
//! `shardq_outbox_up 0` and leaves the other series as last read.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The outbox's state as the gauges show it (`shardq_pg::Status`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct OutboxSnapshot {
    /// Committed rows not yet relayed.
    pub depth: i64,
    /// Age of the oldest committed row, in ms (`None`: empty).
    pub oldest_age_ms: Option<i64>,
    /// Whether a relay is active.
    pub relay_active: bool,
    /// Transactions holding an outbox key now.
    pub open_transactions: i64,
    /// The outbox table's dead tuples.
    pub dead_tuples: i64,
}

/// Where the outbox's gauges come from; `Err` says why it cannot be read.
pub type OutboxSource = Arc<dyn Fn() -> Result<OutboxSnapshot, String> + Send + Sync>;

/// The outbox's gauges; see the module docs.
pub(crate) struct OutboxGauges {
    source: OutboxSource,
    ttl: Duration,
    last: Mutex<Option<Instant>>,
    up: Gauge,
    depth: Gauge,
    oldest_age: Gauge<f64, AtomicU64>,
    relay_active: Gauge,
    open_transactions: Gauge,
    dead_tuples: Gauge,
}

impl OutboxGauges {
    pub(crate) fn register(registry: &mut Registry, source: OutboxSource, ttl: Duration) -> Self {
        let g = OutboxGauges {
            source,
            ttl,
            last: Mutex::new(None),
            up: Gauge::default(),
            depth: Gauge::default(),
            oldest_age: Gauge::default(),
            relay_active: Gauge::default(),
            open_transactions: Gauge::default(),
            dead_tuples: Gauge::default(),
        };
        let r = registry;
        r.register(
            "shardq_outbox_up",
            "1 if the Postgres outbox could be read at the last read, else 0",
            g.up.clone(),
        );
        r.register(
            "shardq_outbox_depth",
            "Committed outbox rows not yet relayed",
            g.depth.clone(),
        );
        r.register(
            "shardq_outbox_oldest_age_seconds",
            "Age of the oldest committed outbox row (the relay's lag; 0 when empty)",
            g.oldest_age.clone(),
        );
        r.register(
            "shardq_outbox_relay_active",
            "1 if a relay holds the outbox's relay lock, else 0",
            g.relay_active.clone(),
        );
        r.register(
            "shardq_outbox_open_transactions",
            "Transactions holding an outbox key now (later rows of their keys wait)",
            g.open_transactions.clone(),
        );
        r.register(
            "shardq_outbox_dead_tuples",
            "Dead tuples of the outbox table (vacuum clears them)",
            g.dead_tuples.clone(),
        );
        g
    }

    /// Reads the source when the last read is older than the TTL.
    pub(crate) fn refresh(&self) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|t| t.elapsed() < self.ttl) {
            return;
        }
        match (self.source)() {
            Ok(s) => {
                self.up.set(1);
                self.depth.set(s.depth);
                self.oldest_age
                    .set(s.oldest_age_ms.unwrap_or(0) as f64 / 1000.0);
                self.relay_active.set(i64::from(s.relay_active));
                self.open_transactions.set(s.open_transactions);
                self.dead_tuples.set(s.dead_tuples);
            }
            Err(_) => {
                self.up.set(0);
            }
        }
        *last = Some(Instant::now());
    }
}
