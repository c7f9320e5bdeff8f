//! The per-shard gauges, read from a deployment's status when a scrape
//! comes instead of being fed.
//!
//! A status read costs one read per shard (a log replay check on the
//! embedded engine, a script per shard on Redis), so it is cached: however
//! many scrapes arrive, the source is called at most once per TTL (one
//! call at a time; the TTL counts from the end of the previous call). A
//! shard that cannot be read gets `shardq_shard_up 0` and no counts while
//! the others report; a status that cannot be read at all (the map is
//! unreadable) sets `shardq_status_up 0` and drops every per-shard series
//! rather than report stale numbers. It must never write anything.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use shardq_deploy::{Deployment, StatusReport};

use crate::{OwnerLabel, ShardLabel};

/// Longest age of the cached status a scrape is answered from (1 s).
pub const STATUS_TTL: Duration = Duration::from_secs(1);

/// The status and the map version it was read under.
#[derive(Debug, Clone)]
pub struct StatusSnapshot {
    /// Version of the published map.
    pub map_version: u64,
    /// Every shard of the map (`Deployment::status()`).
    pub report: StatusReport,
}

/// Where the per-shard gauges come from; `Err` names what could not be
/// read.
pub type StatusSource = Arc<dyn Fn() -> Result<StatusSnapshot, String> + Send + Sync>;

/// A source reading `deployment`'s map version and status.
pub fn deployment_source(deployment: Arc<Deployment>) -> StatusSource {
    Arc::new(move || {
        let context = |e: shardq_deploy::DeployError| {
            format!(
                "reading the status of data dir {}: {e}",
                deployment.dir().display()
            )
        };
        let map_version = deployment.map().map_err(context)?.version;
        let report = deployment.status().map_err(context)?;
        Ok(StatusSnapshot {
            map_version,
            report,
        })
    })
}

type PerShard = Family<ShardLabel, Gauge>;

/// The gauges of the status; see the module docs.
pub(crate) struct ShardGauges {
    source: Option<StatusSource>,
    ttl: Duration,
    /// When the last read ended; held while reading and encoding, so one
    /// scrape at a time reads.
    last: Mutex<Option<Instant>>,
    up: PerShard,
    ready: PerShard,
    delayed: PerShard,
    in_flight: PerShard,
    dead: PerShard,
    keys: PerShard,
    fence_high: PerShard,
    owner: Family<OwnerLabel, Gauge>,
    lease_expires: Family<ShardLabel, Gauge<f64, AtomicU64>>,
    map_version: Gauge,
    status_up: Gauge,
    read_seconds: Gauge<f64, AtomicU64>,
    /// Schedules: how many, paused, and the ticks fired, skipped, missed.
    schedules: [Gauge; 5],
    dependents: [Gauge; 7],
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl ShardGauges {
    /// Registers the gauges when there is a source (without one, none).
    pub(crate) fn register(
        registry: &mut Registry,
        source: Option<StatusSource>,
        ttl: Duration,
    ) -> ShardGauges {
        let g = ShardGauges {
            source,
            ttl,
            last: Mutex::new(None),
            up: Family::default(),
            ready: Family::default(),
            delayed: Family::default(),
            in_flight: Family::default(),
            dead: Family::default(),
            keys: Family::default(),
            fence_high: Family::default(),
            owner: Family::default(),
            lease_expires: Family::default(),
            map_version: Gauge::default(),
            status_up: Gauge::default(),
            read_seconds: Gauge::default(),
            schedules: Default::default(),
            dependents: Default::default(),
        };
        if g.source.is_none() {
            return g;
        }
        g.register_shard_series(registry);
        g.register_status_series(registry);
        g.register_schedule_series(registry);
        g.register_dependent_series(registry);
        g
    }

    /// Registers the per-shard series: counts, owner and lease end.
    fn register_shard_series(&self, r: &mut Registry) {
        let per_shard: [(&str, &str, &PerShard); 7] = [
            (
                "shardq_shard_up",
                "1 if the shard could be read at the last status read, else 0",
                &self.up,
            ),
            (
                "shardq_shard_ready",
                "Pending jobs whose start time has come",
                &self.ready,
            ),
            (
                "shardq_shard_delayed",
                "Pending jobs waiting for their start time",
                &self.delayed,
            ),
            ("shardq_shard_in_flight", "Runs in flight", &self.in_flight),
            ("shardq_shard_dead", "Dead letters", &self.dead),
            ("shardq_shard_keys", "Distinct keys with work", &self.keys),
            (
                "shardq_shard_fence_high",
                "The largest run fence the shard issued",
                &self.fence_high,
            ),
        ];
        for (name, help, family) in per_shard {
            r.register(name, help, family.clone());
        }
        r.register(
            "shardq_shard_owner",
            "1 for the process holding the shard's lease (label owner)",
            self.owner.clone(),
        );
        r.register(
            "shardq_shard_lease_expires_seconds",
            "When the holder's lease of the shard ends, in seconds since the Unix epoch",
            self.lease_expires.clone(),
        );
    }

    /// Registers the series of the status read itself: map version, up, duration.
    fn register_status_series(&self, r: &mut Registry) {
        r.register(
            "shardq_map_version",
            "Version of the published shard map at the last status read",
            self.map_version.clone(),
        );
        r.register(
            "shardq_status_up",
            "1 if the last status read worked (the map could be read), else 0",
            self.status_up.clone(),
        );
        r.register(
            "shardq_status_read_duration_seconds",
            "How long the last status read took",
            self.read_seconds.clone(),
        );
    }

    /// Registers the recurring schedules' series, in the order of `schedules`.
    fn register_schedule_series(&self, r: &mut Registry) {
        let schedule_series = [
            ("shardq_schedules", "Recurring schedules of the deployment"),
            ("shardq_schedules_paused", "Schedules paused"),
            (
                "shardq_schedule_ticks_fired",
                "Ticks that stored a job, over every schedule (grows)",
            ),
            (
                "shardq_schedule_ticks_skipped",
                "Ticks not fired because the previous job was live (overlap), over every schedule (grows)",
            ),
            (
                "shardq_schedule_ticks_missed",
                "Ticks found past their catch-up window (no worker ran them in time), over every schedule (grows)",
            ),
        ];
        for ((name, help), gauge) in schedule_series.into_iter().zip(&self.schedules) {
            r.register(name, help, gauge.clone());
        }
    }

    /// Registers the dependents' and batches' series, in the order of `dependents`.
    fn register_dependent_series(&self, r: &mut Registry) {
        let dependent_series = [
            (
                "shardq_dependents_waiting",
                "Dependents (jobs enqueued with after) waiting for their dependencies",
            ),
            (
                "shardq_dependents_released",
                "Dependents released onto their key once every dependency ended (grows)",
            ),
            (
                "shardq_dependents_failed",
                "Dependents that ended without running: a dependency did not complete under the fail policy, or cancelled while waiting (grows)",
            ),
            (
                "shardq_batches_pending",
                "Batches not yet complete (open, or closed with a job not ended or a callback not fired)",
            ),
            (
                "shardq_batch_jobs_waiting",
                "Jobs added to a batch and not yet released onto their key",
            ),
            (
                "shardq_batch_jobs_released",
                "Jobs of batches released onto their keys (grows)",
            ),
            (
                "shardq_batch_callbacks_fired",
                "Batch callbacks enqueued (complete, success and death; each once per batch) (grows)",
            ),
        ];
        for ((name, help), gauge) in dependent_series.into_iter().zip(&self.dependents) {
            r.register(name, help, gauge.clone());
        }
    }

    /// Refreshes from the source when the cache is older than the TTL, then
    /// encodes `registry`.
    pub(crate) fn render(&self, registry: &Registry) -> String {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(source) = &self.source {
            if last.is_none_or(|t| t.elapsed() >= self.ttl) {
                let started = Instant::now();
                let read = source();
                self.read_seconds.set(started.elapsed().as_secs_f64());
                self.apply(read);
                *last = Some(Instant::now());
            }
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, registry);
        out
    }

    fn apply(&self, read: Result<StatusSnapshot, String>) {
        for f in [
            &self.up,
            &self.ready,
            &self.delayed,
            &self.in_flight,
            &self.dead,
            &self.keys,
            &self.fence_high,
        ] {
            f.clear();
        }
        self.owner.clear();
        self.lease_expires.clear();
        let snap = match read {
            Ok(s) => s,
            Err(_) => {
                self.status_up.set(0);
                return;
            }
        };
        self.status_up.set(1);
        self.map_version.set(int(snap.map_version));
        if let Some(t) = snap.report.schedules {
            let values = [t.schedules, t.paused, t.fired, t.skipped, t.missed];
            for (gauge, v) in self.schedules.iter().zip(values) {
                gauge.set(int(v));
            }
        }
        if let Some(t) = snap.report.dependents {
            for (gauge, v) in self.dependents.iter().zip([
                t.waiting,
                t.released,
                t.failed,
                t.batches,
                t.batch_jobs_waiting,
                t.batch_jobs_released,
                t.callbacks_fired,
            ]) {
                gauge.set(int(v));
            }
        }
        for row in &snap.report.shards {
            let l = ShardLabel {
                shard: row.name.clone(),
            };
            self.up
                .get_or_create(&l)
                .set(i64::from(row.error.is_none()));
            let counts = [
                (&self.ready, row.ready),
                (&self.delayed, row.delayed),
                (&self.in_flight, row.in_flight),
                (&self.dead, row.dead),
                (&self.keys, row.keys),
                (&self.fence_high, row.fence_high),
            ];
            for (family, value) in counts {
                if let Some(v) = value {
                    family.get_or_create(&l).set(int(v));
                }
            }
            if let Some(owner) = &row.owner {
                self.owner
                    .get_or_create(&OwnerLabel {
                        shard: row.name.clone(),
                        owner: owner.clone(),
                    })
                    .set(1);
            }
            if let Some(ms) = row.lease_expires_ms {
                self.lease_expires.get_or_create(&l).set(ms as f64 / 1000.0);
            }
        }
    }
}
