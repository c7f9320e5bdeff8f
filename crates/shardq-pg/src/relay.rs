//! The relay: moves committed outbox rows into the deployment, in order,
//! then deletes them.
//!
//! One relay is active per schema: the one holding the session advisory
//! lock `(class, 1)` ([`crate::schema::lock_class`]); others wait in
//! standby and take over when its session ends (a relay that dies, or
//! whose connection drops, frees the lock with its session).
//!
//! A round reads the oldest rows by id (each key's rows in commit order:
//! see [`crate::schema`]), enqueues them through the deployment's
//! producer as one batch (each key's jobs keep their order), and deletes
//! the rows that landed. Each row's job carries a dedup id: the row's own
//! `dedup_id`, or `pg:<schema>:<row id>`. A relay killed between the
//! enqueue and the delete leaves rows whose jobs exist; the next round
//! enqueues them again and the store answers with the existing jobs, so
//! nothing is stored twice, as long as the next round comes within the
//! dedup window ([`RELAY_DEDUP_WINDOW_MS`]). Rows a failed batch did land
//! are deleted at once, so a long outage of the store never replays them.
//!
//! Wake-ups: `enqueue` notifies the schema's channel at commit and the
//! relay LISTENs; a notification lost (a reconnect, a pooler in
//! transaction mode that does not pass LISTEN through) costs at most one
//! poll interval, since the relay reads the table every `poll_ms` whatever
//! it hears.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use postgres::fallible_iterator::FallibleIterator;
use shardq_core::producer::{ProduceError, ProducerOptions};
use shardq_core::NewJob;
use shardq_deploy::Deployment;

use crate::schema::{channel, check_schema, installed_version, latest_version, lock_class};
use crate::PgError;

/// How long a relayed row's dedup id is remembered by the store (1 hour):
/// a relay that dies between storing rows and deleting them must be
/// followed within this by another round, or their jobs are stored again.
pub const RELAY_DEDUP_WINDOW_MS: u64 = 3_600_000;
/// Default rows per round.
pub const RELAY_BATCH_DEFAULT: usize = 2_000;
/// Most rows per round.
pub const RELAY_BATCH_MAX: usize = 10_000;
/// Most payload bytes a round reads (a round takes fewer rows than
/// `--batch` when their payloads are large; always at least one row): the
/// relay's memory bound.
pub const RELAY_BATCH_BYTES_MAX: i64 = 64 << 20;
/// Default longest wait between two reads of the table, in ms.
pub const RELAY_POLL_MS_DEFAULT: u64 = 1_000;
/// Longest wait before a relay that failed tries again, in ms.
pub const RELAY_RETRY_MS_MAX: u64 = 10_000;

/// How a relay runs.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// The outbox's schema.
    pub schema: String,
    /// Rows per round (1..=[`RELAY_BATCH_MAX`]).
    pub batch: usize,
    /// Longest wait between two reads of the table when no notification
    /// comes, in ms (10..=60000).
    pub poll_ms: u64,
    /// Stop once the outbox is empty (for a one-off drain and for tests).
    pub exit_when_empty: bool,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            schema: "shardq".into(),
            batch: RELAY_BATCH_DEFAULT,
            poll_ms: RELAY_POLL_MS_DEFAULT,
            exit_when_empty: false,
        }
    }
}

impl RelayOptions {
    /// Checks every option, naming the first one refused.
    pub fn validate(&self) -> Result<(), PgError> {
        check_schema(&self.schema)?;
        if !(1..=RELAY_BATCH_MAX).contains(&self.batch) {
            return Err(PgError::BadInput(format!(
                "--batch {}: out of range 1..={RELAY_BATCH_MAX}",
                self.batch
            )));
        }
        if !(10..=60_000).contains(&self.poll_ms) {
            return Err(PgError::BadInput(format!(
                "--poll-ms {}: out of range 10..=60000",
                self.poll_ms
            )));
        }
        Ok(())
    }
}

/// What a relay did.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct RelayReport {
    /// Rows moved into the deployment and deleted.
    pub relayed: u64,
    /// Of those, rows whose job the store already had (a round repeated
    /// after a relay died between the enqueue and the delete).
    pub already_stored: u64,
    /// Rounds that failed and were tried again.
    pub retries: u64,
}

/// What the relay tells its caller as it goes.
#[derive(Debug, Clone)]
pub enum RelayEvent {
    /// Waiting: another relay holds the schema's relay lock.
    Standby,
    /// This relay is the active one.
    Active,
    /// A round moved this many rows.
    Relayed(usize),
    /// Something failed; the relay tries again after `retry_ms`.
    Failed {
        /// What failed and why.
        why: String,
        /// When it tries again.
        retry_ms: u64,
    },
}

/// Runs a relay until `stop` (or, with `exit_when_empty`, until the
/// outbox is empty). Connection and store failures are retried with a
/// growing wait (each reported through `on_event`); only bad options, a
/// schema not installed or installed by a newer build end it with an
/// error.
pub fn run(
    deployment: &Deployment,
    url: &str,
    opts: &RelayOptions,
    stop: &AtomicBool,
    on_event: &mut dyn FnMut(RelayEvent),
) -> Result<RelayReport, PgError> {
    opts.validate()?;
    let mut report = RelayReport::default();
    let mut failures = 0u32;
    while !stop.load(Ordering::SeqCst) {
        match session(deployment, url, opts, stop, on_event, &mut report) {
            Ok(()) => return Ok(report),
            Err(e @ PgError::BadInput(_)) => return Err(e),
            Err(e) => {
                failures = failures.saturating_add(1);
                report.retries += 1;
                let retry_ms = (100u64 << failures.min(7)).min(RELAY_RETRY_MS_MAX);
                on_event(RelayEvent::Failed {
                    why: e.to_string(),
                    retry_ms,
                });
                sleep_unless(stop, Duration::from_millis(retry_ms));
            }
        }
    }
    Ok(report)
}

/// Sleeps `d` in short slices, returning early once `stop` is set.
fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::SeqCst) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
}

/// One connection's life: take the relay lock, listen, relay rounds.
/// `Ok` only when asked to stop (or done, with `exit_when_empty`).
fn session(
    deployment: &Deployment,
    url: &str,
    opts: &RelayOptions,
    stop: &AtomicBool,
    on_event: &mut dyn FnMut(RelayEvent),
    report: &mut RelayReport,
) -> Result<(), PgError> {
    let schema = opts.schema.as_str();
    let mut client = crate::connect(url)?;
    let have = installed_version(&mut client, schema)?;
    if have != latest_version() {
        return Err(PgError::BadInput(format!(
            "schema {schema} has outbox migrations up to {have}, this shardq needs {}: run `shardq pg install`",
            latest_version()
        )));
    }
    let class = lock_class(schema);
    let mut said_standby = false;
    loop {
        let got: bool = client
            .query_one("SELECT pg_try_advisory_lock($1, 1)", &[&class])?
            .get(0);
        if got {
            break;
        }
        if !said_standby {
            on_event(RelayEvent::Standby);
            said_standby = true;
        }
        if stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        sleep_unless(stop, Duration::from_millis(opts.poll_ms.min(500)));
    }
    on_event(RelayEvent::Active);
    client.batch_execute(&format!("LISTEN {}", channel(schema)))?;
    let mut producer = deployment.producer(ProducerOptions {
        dedup_window_ms: RELAY_DEDUP_WINDOW_MS,
        ..ProducerOptions::default()
    })?;
    // The oldest rows by id, at most `limit` of them and, past the first,
    // at most RELAY_BATCH_BYTES_MAX of payload.
    let select = client.prepare(&format!(
        "SELECT id, key, payload, dedup_id, delay_ms, max_attempts FROM (
           SELECT id, key, payload, dedup_id, delay_ms, max_attempts,
                  sum(octet_length(payload)) OVER (ORDER BY id) AS upto
           FROM (SELECT * FROM {schema}.outbox ORDER BY id LIMIT $1) oldest
         ) r WHERE upto - octet_length(payload) < $2 ORDER BY id"
    ))?;
    let delete = client.prepare(&format!("DELETE FROM {schema}.outbox WHERE id = ANY($1)"))?;
    let limit = opts.batch as i64;
    while !stop.load(Ordering::SeqCst) {
        let rows = client.query(&select, &[&limit, &RELAY_BATCH_BYTES_MAX])?;
        if rows.is_empty() {
            if opts.exit_when_empty {
                return Ok(());
            }
            // Woken by a commit's notification, or after a poll interval.
            let mut n = client.notifications();
            let _ = n.timeout_iter(Duration::from_millis(opts.poll_ms)).next()?;
            while n.iter().next()?.is_some() {}
            continue;
        }
        let mut ids: Vec<i64> = Vec::with_capacity(rows.len());
        let mut jobs: Vec<NewJob> = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.get(0);
            let key: String = row.get(1);
            let payload: Vec<u8> = row.get(2);
            let dedup: Option<String> = row.get(3);
            let delay: Option<i64> = row.get(4);
            let attempts: Option<i32> = row.get(5);
            let mut job = NewJob::new(key, payload);
            job.dedup_id = Some(dedup.unwrap_or_else(|| format!("pg:{schema}:{id}")));
            if let Some(d) = delay {
                job.delay_ms = d.max(0) as u64;
            }
            if let Some(a) = attempts {
                job.max_attempts = a.max(1) as u32;
            }
            ids.push(id);
            jobs.push(job);
        }
        match producer.enqueue_batch(&jobs) {
            Ok(placed) => {
                report.already_stored += placed.iter().filter(|p| p.duplicate).count() as u64;
                client.execute(&delete, &[&ids])?;
                report.relayed += ids.len() as u64;
                on_event(RelayEvent::Relayed(ids.len()));
            }
            Err(e) => {
                // What landed goes now, so a long outage never replays it.
                let landed: Vec<i64> = match &e {
                    ProduceError::Partial { placed, .. }
                    | ProduceError::PausedTooLong { placed, .. } => {
                        placed.iter().map(|p| ids[p.index]).collect()
                    }
                    _ => Vec::new(),
                };
                if !landed.is_empty() {
                    client.execute(&delete, &[&landed])?;
                    report.relayed += landed.len() as u64;
                }
                return Err(PgError::Store(e.to_string()));
            }
        }
    }
    Ok(())
}
