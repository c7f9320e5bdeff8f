//! `GET /metrics` (Prometheus text format, `docs/metrics.md`) and the calls
//! that feed it from the handlers: enqueues (the producer's fenced and
//! paused refusals are added where the producer is returned to the pool),
//! remote claims (start of the wait and run timers), acks and fails, and
//! the rebalance runner. The numbers live in `shardq-metrics`; this module
//! only translates, and a feeding call never touches storage.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use shardq_core::producer::Placed;
use shardq_core::{ClaimedJob, Receipt};

use crate::App;

/// `GET /metrics`: every series; the per-shard gauges come from
/// `Deployment::status()`, read at most once per second whatever the
/// scrape rate.
pub async fn metrics(State(app): State<Arc<App>>) -> Response {
    shardq_metrics::serve::metrics_response(Arc::clone(&app.metrics)).await
}

/// Jobs a producer placed (the duplicates of a dedup id are not counted),
/// counted once per shard, not once a job.
pub(crate) fn enqueued(app: &App, placed: &[Placed]) {
    let mut counts: Vec<(&str, u64)> = Vec::new();
    for p in placed.iter().filter(|p| !p.duplicate) {
        match counts.iter_mut().find(|(s, _)| *s == p.shard) {
            Some((_, n)) => *n += 1,
            None => counts.push((&p.shard, 1)),
        }
    }
    for (shard, n) in counts {
        app.metrics.enqueued(shard, n);
    }
}

/// Runs handed to a remote worker at `now_ms`.
pub(crate) fn claimed(app: &App, jobs: &[ClaimedJob], now_ms: u64) {
    // One claim's jobs are of one shard.
    for chunk in jobs.chunk_by(|a, b| a.shard == b.shard) {
        let runs: Vec<(shardq_core::Receipt, u64)> = (chunk.iter())
            .map(|j| (j.receipt(), j.created_ms.max(j.not_before_ms)))
            .collect();
        app.metrics.runs_claimed(&chunk[0].shard, &runs, now_ms);
    }
}

/// An ack of `receipts` on `shard`; `stale` were refused.
pub(crate) fn acked(app: &App, shard: &str, receipts: &[Receipt], stale: &[Receipt]) {
    let now = app.clock.now_ms();
    app.metrics.run_acked(shard, receipts, stale, now);
}

/// A fail of run `r` on `shard`: its outcome, or `Err` when it was refused
/// as stale.
pub(crate) fn failed(
    app: &App,
    shard: &str,
    r: Receipt,
    outcome: Result<&shardq_core::FailOutcome, ()>,
) {
    match outcome {
        Ok(o) => {
            let dead = matches!(o, shardq_core::FailOutcome::Dead);
            app.metrics.run_failed(shard, r, dead, app.clock.now_ms());
        }
        Err(()) => app.metrics.run_fail_stale(shard, r),
    }
}
