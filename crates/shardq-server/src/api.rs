//! The request handlers and their wire types: enqueue (with dedup), claim
//! (long-poll), ack, fail, extend, status, keys, dead letters and the
//! resharding operations. Every library call runs on a blocking thread
//! (`spawn_blocking`); handlers validate all input before they store
//! anything, and must never block the async executor or panic on input.

use std::collections::{BTreeMap, HashMap};

use ahash::RandomState;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use shardq_core::job::cut_at_char;
use shardq_core::reshard::{self, RebalanceEvent, RebalanceOptions};
use shardq_core::{
    validate_job_lease_ms, validate_key, FailOutcome, JobId, NewJob, QueueError, Receipt,
    JOB_LEASE_MS_DEFAULT, MAX_ATTEMPTS_DEFAULT,
};
use shardq_route::Router as MapRouter;

use crate::auth::{Principal, ANONYMOUS};
use crate::body::{BoundedVec, JsonBody, PathParam, QueryParams};
use crate::dedup::{Begin, DedupRecord, Scoped};
use crate::error::{join_error, ApiError};
use crate::ids::{job_string, parse_job, parse_receipt, receipt_string};
use crate::limits::*;
use crate::App;

type ApiResult = Result<Response, ApiError>;

fn ok(v: Value) -> ApiResult {
    Ok(Json(v).into_response())
}

/// `{"jobs": [...]}`, serialised straight from typed values (no `Value`
/// tree on the hot paths).
#[derive(Serialize)]
struct JobsReply<T: Serialize> {
    jobs: T,
}

fn ok_jobs<T: Serialize>(jobs: T) -> ApiResult {
    Ok(Json(JobsReply { jobs }).into_response())
}

/// Runs blocking library work off the async executor.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(join_error)?
}

/// A value cut for an error message (quoted, control characters escaped).
pub(crate) fn shown_str(s: &str) -> String {
    shown(s)
}

/// A value cut for an error message.
fn shown(s: &str) -> String {
    if s.len() > 64 {
        format!("{:?}...", cut_at_char(s, 64))
    } else {
        format!("{s:?}")
    }
}

// ---------------------------------------------------------------------------
// Enqueue.
// ---------------------------------------------------------------------------

/// `POST /v1/jobs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnqueueRequest {
    jobs: BoundedVec<JobIn, JOBS_PER_REQUEST_LIMIT>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobIn {
    key: String,
    payload: Option<String>,
    payload_b64: Option<String>,
    delay_ms: Option<u64>,
    max_attempts: Option<u32>,
    dedup_id: Option<String>,
}

#[derive(Debug, Serialize)]
struct Enqueued {
    id: String,
    shard: String,
    key: String,
    duplicate: bool,
}

fn check_dedup_id(id: &str, field: &str) -> Result<(), ApiError> {
    if id.is_empty() || id.len() > DEDUP_ID_BYTES_MAX || id.chars().any(char::is_control) {
        return Err(ApiError::bad(format!(
            "{field}: invalid dedup id {}: 1..={DEDUP_ID_BYTES_MAX} bytes without control characters",
            shown(id)
        )));
    }
    Ok(())
}

fn to_new_job(
    i: usize,
    j: JobIn,
    payload_max: usize,
) -> Result<(NewJob, Option<String>), ApiError> {
    let f = |name: &str| format!("jobs[{i}].{name}");
    validate_key(&j.key).map_err(|e| ApiError::bad(format!("{}: {e}", f("key"))))?;
    let payload = match (j.payload, j.payload_b64) {
        (Some(p), None) => p.into_bytes(),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD
            .decode(b.as_bytes())
            .map_err(|e| {
                ApiError::bad(format!(
                    "{}: invalid base64 {}: {e}",
                    f("payload_b64"),
                    shown(&b)
                ))
            })?,
        (Some(_), Some(_)) => {
            return Err(ApiError::bad(format!(
                "jobs[{i}]: both payload and payload_b64 given; give exactly one"
            )))
        }
        (None, None) => {
            return Err(ApiError::bad(format!(
                "jobs[{i}]: no payload; give payload (UTF-8 text) or payload_b64 (bytes)"
            )))
        }
    };
    if payload.len() > payload_max {
        return Err(ApiError::bad(format!(
            "{}: {} bytes, over the limit of {payload_max} bytes",
            f("payload"),
            payload.len()
        )));
    }
    let job = NewJob {
        key: j.key,
        payload,
        delay_ms: j.delay_ms.unwrap_or(0),
        max_attempts: j.max_attempts.unwrap_or(MAX_ATTEMPTS_DEFAULT),
    };
    job.validate(payload_max).map_err(|e| {
        let field = match e {
            QueueError::InvalidMaxAttempts { .. } => "max_attempts",
            QueueError::InvalidDelay { .. } => "delay_ms",
            _ => "job",
        };
        ApiError::bad(format!("{}: {e}", f(field)))
    })?;
    if let Some(d) = &j.dedup_id {
        check_dedup_id(d, &f("dedup_id"))?;
    }
    Ok((job, j.dedup_id))
}

/// `POST /v1/jobs`: validate everything, look dedup ids up, enqueue the
/// rest through a producer, record the dedup ids durably, reply.
pub async fn enqueue(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<EnqueueRequest>,
) -> ApiResult {
    let jobs_in = req.jobs.into_inner();
    let n = jobs_in.len();
    if n == 0 {
        return Err(ApiError::bad("jobs: empty list; give 1 or more jobs"));
    }
    if n > app.limits.jobs_per_request_max {
        return Err(ApiError::bad(format!(
            "jobs: {n} jobs, over the limit of {} per request",
            app.limits.jobs_per_request_max
        )));
    }
    let mut jobs = Vec::with_capacity(n);
    let mut dedup: Vec<Option<String>> = Vec::with_capacity(n);
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for (i, j) in jobs_in.into_iter().enumerate() {
        let (job, d) = to_new_job(i, j, app.limits.payload_bytes_max)?;
        if let Some(id) = &d {
            if let Some(first) = seen.insert((job.key.clone(), id.clone()), i) {
                return Err(ApiError::bad(format!(
                    "jobs[{i}].dedup_id: {} already used by jobs[{first}] of this request, for the same key",
                    shown(id)
                )));
            }
        }
        jobs.push(job);
        dedup.push(d);
    }
    let a = Arc::clone(&app);
    let out = blocking(move || a.enqueue_blocking(jobs, dedup)).await?;
    app.work_arrived();
    ok_jobs(out)
}

impl App {
    fn enqueue_blocking(
        &self,
        jobs: Vec<NewJob>,
        dedup: Vec<Option<String>>,
    ) -> Result<Vec<Enqueued>, ApiError> {
        let now = self.clock.now_ms();
        let mut results: Vec<Option<Enqueued>> = (0..jobs.len()).map(|_| None).collect();
        // (index, key, dedup id) of the jobs that carry one: a dedup id
        // belongs to its key.
        let with_id: Vec<(usize, String, String)> = dedup
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.as_ref().map(|id| (i, jobs[i].key.clone(), id.clone())))
            .collect();
        let scoped = |list: &[&(usize, String, String)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(_, k, id)| (k.clone(), id.clone()))
                .collect()
        };
        let abort = |ids: &[(String, String)]| {
            let s: Vec<Scoped<'_>> = ids.iter().map(|(key, id)| Scoped { key, id }).collect();
            self.dedup.abort(&s);
        };
        let ids: Vec<Scoped<'_>> = with_id
            .iter()
            .map(|(_, key, id)| Scoped { key, id })
            .collect();
        let found = match self.dedup.begin_many(&ids, now) {
            Ok(found) => found,
            Err(e) => return Err(ApiError::unavailable(format!("dedup store: {e}"))),
        };
        drop(ids);
        // Every fresh id is reserved now: a busy one anywhere in the request
        // releases them all.
        let fresh: Vec<&(usize, String, String)> = with_id
            .iter()
            .zip(&found)
            .filter(|(_, b)| matches!(b, Begin::Fresh))
            .map(|(w, _)| w)
            .collect();
        let reserved: Vec<(String, String)> = scoped(&fresh);
        for ((i, _, id), begun) in with_id.iter().zip(found) {
            let i = *i;
            match begun {
                Begin::Fresh => {}
                Begin::Done(rec) => {
                    results[i] = Some(Enqueued {
                        id: job_string(&rec.shard, JobId(rec.job)),
                        shard: rec.shard,
                        key: rec.key,
                        duplicate: true,
                    })
                }
                Begin::Busy => {
                    abort(&reserved);
                    return Err(ApiError::conflict(format!(
                        "jobs[{i}].dedup_id: {} of key {} is being enqueued by another request right now; retry shortly",
                        shown(id),
                        shown(&jobs[i].key)
                    )));
                }
            }
        }
        let todo: Vec<usize> = (0..jobs.len()).filter(|&i| results[i].is_none()).collect();
        // The jobs to store, moved out (payloads are not copied).
        let batch: Vec<NewJob> = jobs
            .into_iter()
            .enumerate()
            .filter(|(i, _)| results[*i].is_none())
            .map(|(_, j)| j)
            .collect();
        let outcome = if batch.is_empty() {
            Ok(Vec::new())
        } else {
            let mut producer = match self.take_producer() {
                Ok(p) => p,
                Err(e) => {
                    abort(&reserved);
                    return Err(e);
                }
            };
            let r = producer.enqueue_batch(&batch);
            self.metrics.refusals(&producer.take_refusals());
            self.put_producer(producer);
            r
        };
        let (placed, error) = match outcome {
            Ok(p) => (p, None),
            Err(shardq_core::producer::ProduceError::Partial { placed, cause }) => {
                let e = ApiError::from(shardq_core::producer::ProduceError::Partial {
                    placed: placed.clone(),
                    cause,
                });
                (placed, Some(e))
            }
            Err(e @ shardq_core::producer::ProduceError::PausedTooLong { .. }) => {
                let placed = match &e {
                    shardq_core::producer::ProduceError::PausedTooLong { placed, .. } => {
                        placed.clone()
                    }
                    _ => Vec::new(),
                };
                (placed, Some(ApiError::from(e)))
            }
            Err(e) => (Vec::new(), Some(ApiError::from(e))),
        };
        crate::metrics::enqueued(self, &placed);
        let expires_ms = now.saturating_add(self.dedup_window_ms);
        let mut records = Vec::new();
        for p in &placed {
            let i = todo[p.index];
            if let Some(id) = &dedup[i] {
                records.push(DedupRecord::new(
                    &batch[p.index].key,
                    id,
                    &p.shard,
                    p.id.0,
                    expires_ms,
                ));
            }
            results[i] = Some(Enqueued {
                id: job_string(&p.shard, p.id),
                shard: p.shard.clone(),
                key: batch[p.index].key.clone(),
                duplicate: false,
            });
        }
        let recorded: std::collections::HashSet<(&str, &str)> = records
            .iter()
            .map(|r| (r.key.as_str(), r.id.as_str()))
            .collect();
        let unplaced: Vec<(String, String)> = reserved
            .iter()
            .filter(|(k, id)| !recorded.contains(&(k.as_str(), id.as_str())))
            .cloned()
            .collect();
        abort(&unplaced);
        let commit = self.dedup.commit(&records);
        if let Some(e) = error {
            let placed_json: Vec<Value> = results
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().map(|r| json!({"index": i, "id": r.id, "shard": r.shard, "duplicate": r.duplicate})))
                .collect();
            return Err(e.with("placed", Value::Array(placed_json)));
        }
        if let Err(e) = commit {
            // The jobs are stored: the reply says so (an error here would
            // make a client send them again). Memory keeps the records and
            // the next commit writes them; only a crash before then loses
            // them.
            eprintln!(
                "shardq serve: {} dedup records not written yet ({e}); memory answers for them and the next commit writes them",
                records.len()
            );
        }
        Ok(results.into_iter().flatten().collect())
    }
}

// ---------------------------------------------------------------------------
// Claims and the runs they start.
// ---------------------------------------------------------------------------

/// A run: (shard number in the book, job id).
type RunKey = (u32, u64);

/// Receipts of one request grouped by owned shard (parsed, as sent), and
/// the receipts of shards not owned here.
type Grouped = (BTreeMap<String, Vec<(Receipt, String)>>, Vec<String>);

/// One run handed out: who holds it, its fence and lease end.
#[derive(Debug, Clone, Copy)]
struct HeldRun {
    worker: u32,
    principal: Principal,
    fence: u64,
    until: u64,
}

/// Runs handed out, for the per-worker and per-token bounds. Shard and
/// worker names are numbered once (shards for good: there are few; a
/// worker's number is dropped with its last run), so the per-job work
/// allocates nothing. Lapsed runs leave through an index ordered by lease
/// end, so each claim costs the runs that lapsed since the last one, never
/// a walk of every run held.
#[derive(Debug, Default)]
pub struct ClaimBook {
    shards: HashMap<Arc<str>, u32, RandomState>,
    workers: HashMap<Arc<str>, u32, RandomState>,
    next_worker: u32,
    /// Per worker number: its name and how many runs it holds.
    by_worker: HashMap<u32, (Arc<str>, usize), RandomState>,
    by_principal: HashMap<Principal, usize, RandomState>,
    runs: HashMap<RunKey, HeldRun, RandomState>,
    /// (lease end, run, fence) of every run in `runs`.
    lapse: std::collections::BTreeSet<(u64, RunKey, u64)>,
}

impl ClaimBook {
    fn shard_no(&mut self, shard: &str) -> u32 {
        if let Some(&n) = self.shards.get(shard) {
            return n;
        }
        let n = self.shards.len() as u32;
        self.shards.insert(Arc::from(shard), n);
        n
    }

    fn known_shard(&self, shard: &str) -> Option<u32> {
        self.shards.get(shard).copied()
    }

    /// Drops the runs whose lease ended by `now_ms`.
    fn expire(&mut self, now_ms: u64) {
        while let Some(&(until, k, fence)) = self.lapse.first() {
            if until > now_ms {
                break;
            }
            self.lapse.pop_first();
            if self.runs.get(&k).is_some_and(|r| r.fence == fence) {
                self.remove(k);
            }
        }
    }

    fn remove(&mut self, k: RunKey) {
        let Some(run) = self.runs.remove(&k) else {
            return;
        };
        self.lapse.remove(&(run.until, k, run.fence));
        if let Some(n) = self.by_principal.get_mut(&run.principal) {
            *n -= 1;
            if *n == 0 {
                self.by_principal.remove(&run.principal);
            }
        }
        let gone = self.by_worker.get_mut(&run.worker).is_some_and(|(_, n)| {
            *n -= 1;
            *n == 0
        });
        if gone {
            if let Some((name, _)) = self.by_worker.remove(&run.worker) {
                self.workers.remove(&name);
            }
        }
    }

    /// Runs `worker` and `principal` hold at `now_ms` (lapsed leases no
    /// longer count).
    fn held(&mut self, worker: &str, principal: Principal, now_ms: u64) -> (usize, usize) {
        self.expire(now_ms);
        let w = self
            .workers
            .get(worker)
            .and_then(|w| self.by_worker.get(w))
            .map_or(0, |(_, n)| *n);
        (w, self.by_principal.get(&principal).copied().unwrap_or(0))
    }

    fn add(
        &mut self,
        worker: &str,
        principal: Principal,
        shard: &str,
        id: u64,
        fence: u64,
        until: u64,
    ) {
        let k = (self.shard_no(shard), id);
        // A run claimed again (its old run lapsed) replaces the old one.
        self.remove(k);
        let w = match self.workers.get(worker) {
            Some(&w) => w,
            None => {
                let w = self.next_worker;
                self.next_worker = self.next_worker.wrapping_add(1);
                let name: Arc<str> = Arc::from(worker);
                self.workers.insert(Arc::clone(&name), w);
                self.by_worker.insert(w, (name, 0));
                w
            }
        };
        if let Some((_, n)) = self.by_worker.get_mut(&w) {
            *n += 1;
        }
        *self.by_principal.entry(principal).or_insert(0) += 1;
        self.runs.insert(
            k,
            HeldRun {
                worker: w,
                principal,
                fence,
                until,
            },
        );
        self.lapse.insert((until, k, fence));
    }

    fn finish(&mut self, shard: &str, r: Receipt) {
        let Some(sn) = self.known_shard(shard) else {
            return;
        };
        let k = (sn, r.id.0);
        if self.runs.get(&k).is_some_and(|run| run.fence == r.fence) {
            self.remove(k);
        }
    }

    fn extend(&mut self, shard: &str, r: Receipt, until: u64) {
        let Some(sn) = self.known_shard(shard) else {
            return;
        };
        let k = (sn, r.id.0);
        if let Some(run) = self.runs.get_mut(&k) {
            if run.fence == r.fence {
                self.lapse.remove(&(run.until, k, run.fence));
                run.until = until;
                self.lapse.insert((until, k, r.fence));
            }
        }
    }
}

fn book(m: &Mutex<ClaimBook>) -> std::sync::MutexGuard<'_, ClaimBook> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `POST /v1/claim`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    worker: String,
    max: Option<u64>,
    wait_ms: Option<u64>,
    lease_ms: Option<u64>,
}

#[derive(Debug, Serialize)]
struct ClaimedOut {
    id: String,
    shard: String,
    key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_b64: Option<String>,
    attempt: u32,
    max_attempts: u32,
    receipt: String,
    fence: u64,
    lease_expires_ms: u64,
}

/// `POST /v1/claim`: long-polls the owned shards until something is
/// claimable or `wait_ms` passes.
pub async fn claim(
    State(app): State<Arc<App>>,
    principal: Option<axum::Extension<Principal>>,
    JsonBody(req): JsonBody<ClaimRequest>,
) -> ApiResult {
    let principal = principal.map_or(ANONYMOUS, |p| p.0);
    let w = &req.worker;
    if w.is_empty() || w.len() > WORKER_NAME_BYTES_MAX || w.chars().any(char::is_control) {
        return Err(ApiError::bad(format!(
            "worker: invalid worker name {}: 1..={WORKER_NAME_BYTES_MAX} bytes without control characters",
            shown(w)
        )));
    }
    let max = req.max.unwrap_or(1);
    if max == 0 || max > CLAIM_MAX_LIMIT as u64 {
        return Err(ApiError::bad(format!(
            "max: {max} is out of range 1..={CLAIM_MAX_LIMIT}"
        )));
    }
    let wait_ms = req.wait_ms.unwrap_or(0);
    if wait_ms > WAIT_MS_MAX {
        return Err(ApiError::bad(format!(
            "wait_ms: {wait_ms} is over the longest long-poll of {WAIT_MS_MAX} ms"
        )));
    }
    let lease_ms = req.lease_ms.unwrap_or(JOB_LEASE_MS_DEFAULT);
    validate_job_lease_ms(lease_ms).map_err(|e| ApiError::bad(format!("lease_ms: {e}")))?;
    let deadline = Instant::now() + Duration::from_millis(wait_ms);
    let worker = req.worker.clone();
    // Waiting claims poll with a backoff and skip a poll that another
    // waiter just made and found empty, with no work arrived since: a
    // thousand idle long polls cost about one claim round per interval.
    let mut interval_ms = CLAIM_POLL_MS;
    let mut woken = true;
    loop {
        let notified = app.wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if app.owned.stopping() {
            return ok(json!({ "jobs": [] }));
        }
        let generation = app.work_generation();
        if woken || !app.polled_empty_within(generation, interval_ms) {
            let a = Arc::clone(&app);
            let wk = worker.clone();
            let (jobs, err) =
                blocking(move || Ok(a.claim_once(&wk, principal, max as usize, lease_ms))).await?;
            if let Some(e) = err {
                if jobs.is_empty() {
                    return Err(e);
                }
            }
            if !jobs.is_empty() {
                return ok_jobs(jobs);
            }
            app.polled_empty(generation);
        }
        if Instant::now() >= deadline {
            return ok(json!({ "jobs": [] }));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::select! {
            _ = &mut notified => {
                woken = true;
                interval_ms = CLAIM_POLL_MS;
            }
            _ = tokio::time::sleep(left.min(Duration::from_millis(interval_ms))) => {
                woken = false;
                interval_ms = (interval_ms * 2).min(CLAIM_POLL_MAX_MS);
            }
        }
    }
}

impl App {
    /// One claim round over the owned shards, starting at a rotating one.
    fn claim_once(
        &self,
        worker: &str,
        principal: Principal,
        max: usize,
        lease_ms: u64,
    ) -> (Vec<ClaimedOut>, Option<ApiError>) {
        let now = self.clock.now_ms();
        let (held, held_by_token) = book(&self.claims).held(worker, principal, now);
        let cap = self.limits.claims_per_worker_max;
        let token_cap = self.limits.claims_per_token_max;
        if held >= cap {
            return (
                Vec::new(),
                Some(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!("worker {}: holds {held} runs, the limit per worker is {cap}; ack, fail or let some lapse first", shown(worker)),
                )),
            );
        }
        if held_by_token >= token_cap {
            return (
                Vec::new(),
                Some(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!("the workers of this token hold {held_by_token} runs, the limit per token is {token_cap}; ack, fail or let some lapse first"),
                )),
            );
        }
        let mut want = max.min(cap - held).min(token_cap - held_by_token);
        let shards = self.owned.list();
        let mut out = Vec::new();
        let mut error = None;
        if shards.is_empty() {
            return (out, None);
        }
        let start = self
            .rotate
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % shards.len();
        for k in 0..shards.len() {
            if want == 0 {
                break;
            }
            let shard = &shards[(start + k) % shards.len()];
            match self.backend.claim(shard, want, lease_ms) {
                Ok(jobs) => {
                    crate::metrics::claimed(self, &jobs, now);
                    let mut b = book(&self.claims);
                    for j in jobs {
                        want = want.saturating_sub(1);
                        b.add(
                            worker,
                            principal,
                            &j.shard,
                            j.id.0,
                            j.fence,
                            j.lease_until_ms,
                        );
                        let (payload, payload_b64) = match String::from_utf8(j.payload) {
                            Ok(s) => (Some(s), None),
                            Err(e) => (
                                None,
                                Some(
                                    base64::engine::general_purpose::STANDARD
                                        .encode(e.into_bytes()),
                                ),
                            ),
                        };
                        out.push(ClaimedOut {
                            id: job_string(&j.shard, j.id),
                            receipt: receipt_string(
                                &j.shard,
                                Receipt {
                                    id: j.id,
                                    fence: j.fence,
                                },
                            ),
                            shard: j.shard,
                            key: j.key,
                            payload,
                            payload_b64,
                            attempt: j.attempt,
                            max_attempts: j.max_attempts,
                            fence: j.fence,
                            lease_expires_ms: j.lease_until_ms,
                        });
                    }
                }
                Err(QueueError::NotOwner { .. }) => {}
                Err(e) => error = Some(ApiError::from(e)),
            }
        }
        (out, error)
    }

    /// Groups receipts by shard; receipts of shards this server does not
    /// run are set apart (`not owned`); unknown shards are a 400.
    fn group_receipts(&self, receipts: &[String]) -> Result<Grouped, ApiError> {
        let mut groups: BTreeMap<String, Vec<(Receipt, String)>> = BTreeMap::new();
        let mut not_owned = Vec::new();
        let mut map_names: Option<Vec<String>> = None;
        for (i, s) in receipts.iter().enumerate() {
            let (shard, r) =
                parse_receipt(s, || format!("receipts[{i}]")).map_err(ApiError::bad)?;
            if self.owned.contains(&shard) {
                groups.entry(shard).or_default().push((r, s.clone()));
                continue;
            }
            if map_names.is_none() {
                map_names = Some(self.deployment.shard_names()?);
            }
            if !map_names.as_ref().is_some_and(|n| n.contains(&shard)) {
                return Err(ApiError::bad(format!(
                    "receipts[{i}]: receipt {s:?} names unknown shard {shard:?}"
                )));
            }
            not_owned.push(s.clone());
        }
        Ok((groups, not_owned))
    }
}

fn check_receipts(receipts: &[String]) -> Result<(), ApiError> {
    if receipts.is_empty() {
        return Err(ApiError::bad(
            "receipts: empty list; give 1 or more receipts",
        ));
    }
    if receipts.len() > RECEIPTS_PER_REQUEST_MAX {
        return Err(ApiError::bad(format!(
            "receipts: {} receipts, over the limit of {RECEIPTS_PER_REQUEST_MAX} per request",
            receipts.len()
        )));
    }
    Ok(())
}

/// `POST /v1/ack`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AckRequest {
    receipts: BoundedVec<String, RECEIPTS_PER_REQUEST_MAX>,
}

/// 409 listing refused receipts, or 200.
fn refused_or_ok(
    what: &str,
    count_field: &str,
    count: u64,
    stale: Vec<String>,
    not_owned: Vec<String>,
) -> ApiResult {
    if stale.is_empty() && not_owned.is_empty() {
        return ok(json!({ count_field: count }));
    }
    let mut parts = Vec::new();
    if !stale.is_empty() {
        parts.push(format!(
            "{} stale receipts (not their job's current run: late, lapsed or already finished; nothing was changed for them), first {:?}",
            stale.len(),
            stale[0]
        ));
    }
    if !not_owned.is_empty() {
        parts.push(format!(
            "{} receipts of shards not owned by this server, first {:?}",
            not_owned.len(),
            not_owned[0]
        ));
    }
    Err(ApiError::conflict(format!(
        "{what}: {}; {count} other receipts took effect",
        parts.join("; ")
    ))
    .with(count_field, json!(count))
    .with("stale", json!(stale))
    .with("not_owned", json!(not_owned)))
}

/// `POST /v1/ack`: the valid receipts are acked; any stale or not-owned
/// one makes the reply a 409 that lists them.
pub async fn ack(State(app): State<Arc<App>>, JsonBody(req): JsonBody<AckRequest>) -> ApiResult {
    check_receipts(&req.receipts.0)?;
    let a = Arc::clone(&app);
    let (acked, stale, not_owned) = blocking(move || {
        let (groups, mut not_owned) = a.group_receipts(&req.receipts.0)?;
        let mut acked = 0u64;
        let mut stale = Vec::new();
        for (shard, rs) in groups {
            let receipts: Vec<Receipt> = rs.iter().map(|(r, _)| *r).collect();
            match a.backend.ack(&shard, &receipts) {
                Ok(out) => {
                    acked += out.acked;
                    crate::metrics::acked(&a, &shard, &receipts, &out.stale);
                    let mut b = book(&a.claims);
                    for r in &receipts {
                        b.finish(&shard, *r);
                    }
                    stale.extend(out.stale.iter().map(|r| receipt_string(&shard, *r)));
                }
                Err(QueueError::NotOwner { .. }) => {
                    not_owned.extend(rs.into_iter().map(|(_, s)| s))
                }
                Err(e) => return Err(ApiError::from(e).with("acked", json!(acked))),
            }
        }
        Ok((acked, stale, not_owned))
    })
    .await?;
    app.work_arrived();
    refused_or_ok("ack", "acked", acked, stale, not_owned)
}

/// `POST /v1/fail`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailRequest {
    receipt: String,
    reason: Option<String>,
    retry_in_ms: Option<u64>,
}

/// `POST /v1/fail`: 200 with the outcome, 409 for a stale receipt.
pub async fn fail(State(app): State<Arc<App>>, JsonBody(req): JsonBody<FailRequest>) -> ApiResult {
    let (shard, r) = parse_receipt(&req.receipt, || "receipt".into()).map_err(ApiError::bad)?;
    let reason = req.reason.unwrap_or_default();
    if reason.len() > FAIL_REASON_BYTES_MAX {
        return Err(ApiError::bad(format!(
            "reason: {} bytes, over the limit of {FAIL_REASON_BYTES_MAX}",
            reason.len()
        )));
    }
    if let Some(ms) = req.retry_in_ms {
        if ms > shardq_core::job::DELAY_MS_MAX {
            return Err(ApiError::bad(format!(
                "retry_in_ms: {ms} is over the longest delay of {} ms",
                shardq_core::job::DELAY_MS_MAX
            )));
        }
    }
    let receipt = req.receipt.clone();
    let a = Arc::clone(&app);
    let outcome = blocking(move || {
        let (groups, not_owned) = a.group_receipts(std::slice::from_ref(&receipt))?;
        if !not_owned.is_empty() || groups.is_empty() {
            return Err(not_owned_error(&receipt, &shard));
        }
        match a.backend.fail(&shard, r, &reason, req.retry_in_ms) {
            Ok(o) => {
                book(&a.claims).finish(&shard, r);
                crate::metrics::failed(&a, &shard, r, Ok(&o));
                Ok(o)
            }
            Err(QueueError::NotOwner { .. }) => Err(not_owned_error(&receipt, &shard)),
            Err(e @ QueueError::StaleReceipt { .. }) => {
                crate::metrics::failed(&a, &shard, r, Err(()));
                Err(ApiError::from(e).with("receipt", json!(receipt)))
            }
            Err(e) => Err(ApiError::from(e).with("receipt", json!(receipt))),
        }
    })
    .await?;
    app.work_arrived();
    match outcome {
        FailOutcome::Retry { at_ms } => ok(json!({ "outcome": "retry", "retry_at_ms": at_ms })),
        FailOutcome::Dead => ok(json!({ "outcome": "dead" })),
        _ => ok(json!({ "outcome": "unknown" })),
    }
}

fn not_owned_error(receipt: &str, shard: &str) -> ApiError {
    ApiError::conflict(format!(
        "receipt {receipt:?}: shard {shard:?} is not owned by this server (its runs are handed out by the server that holds its lease)"
    ))
    .with("not_owned", json!([receipt]))
}

/// `POST /v1/extend`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExtendRequest {
    receipts: BoundedVec<String, RECEIPTS_PER_REQUEST_MAX>,
    lease_ms: Option<u64>,
}

/// `POST /v1/extend`: like ack, 409 listing stale or not-owned receipts.
pub async fn extend(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<ExtendRequest>,
) -> ApiResult {
    check_receipts(&req.receipts.0)?;
    let lease_ms = req.lease_ms.unwrap_or(JOB_LEASE_MS_DEFAULT);
    validate_job_lease_ms(lease_ms).map_err(|e| ApiError::bad(format!("lease_ms: {e}")))?;
    let (extended, stale, not_owned) = blocking(move || {
        let (groups, mut not_owned) = app.group_receipts(&req.receipts.0)?;
        let mut extended = 0u64;
        let mut stale = Vec::new();
        let until = app.clock.now_ms().saturating_add(lease_ms);
        for (shard, rs) in groups {
            let receipts: Vec<Receipt> = rs.iter().map(|(r, _)| *r).collect();
            match app.backend.extend(&shard, &receipts, lease_ms) {
                Ok(refused) => {
                    let mut b = book(&app.claims);
                    for r in &receipts {
                        if refused.contains(r) {
                            b.finish(&shard, *r);
                        } else {
                            extended += 1;
                            b.extend(&shard, *r, until);
                        }
                    }
                    stale.extend(refused.iter().map(|r| receipt_string(&shard, *r)));
                }
                Err(QueueError::NotOwner { .. }) => {
                    not_owned.extend(rs.into_iter().map(|(_, s)| s))
                }
                Err(e) => return Err(ApiError::from(e).with("extended", json!(extended))),
            }
        }
        Ok((extended, stale, not_owned))
    })
    .await?;
    refused_or_ok("extend", "extended", extended, stale, not_owned)
}

// ---------------------------------------------------------------------------
// Reading: status, keys, dead letters.
// ---------------------------------------------------------------------------

/// `GET /v1/status`: `Deployment::status()`, serialised.
pub async fn status(State(app): State<Arc<App>>) -> ApiResult {
    let report = blocking(move || Ok(app.deployment.status()?)).await?;
    ok(serde_json::to_value(report).map_err(|e| ApiError::internal(e.to_string()))?)
}

/// `GET /v1/keys/{key}`: route, override and counts of one key.
pub async fn key(State(app): State<Arc<App>>, PathParam(key): PathParam) -> ApiResult {
    validate_key(&key).map_err(|e| ApiError::bad(format!("key: {e}")))?;
    let v = blocking(move || {
        let map = app.deployment.map()?;
        let version = map.version;
        let over = map.overrides.get(&key).cloned();
        let router = MapRouter::new(map).map_err(|e| ApiError::internal(e.to_string()))?;
        let shard = router.route(&key).to_string();
        let computed = router.computed(&key).to_string();
        let counts = app.backend.key_counts(&shard, &key)?;
        Ok(json!({
            "key": key,
            "map_version": version,
            "shard": shard,
            "computed": computed,
            "override": over,
            "owned_here": app.owned.contains(&shard),
            "depth": counts.depth,
            "in_flight": counts.in_flight,
            "dead": counts.dead,
        }))
    })
    .await?;
    ok(v)
}

/// `GET /v1/dead` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadQuery {
    shard: Option<String>,
    limit: Option<usize>,
}

impl App {
    fn check_shard(&self, shard: &str, field: &str) -> Result<(), ApiError> {
        if !self.deployment.shard_names()?.iter().any(|s| s == shard) {
            return Err(ApiError::bad(format!(
                "{field}: unknown shard {}",
                shown(shard)
            )));
        }
        Ok(())
    }
}

/// `GET /v1/dead?shard=&limit=`.
pub async fn dead_list(
    State(app): State<Arc<App>>,
    QueryParams(q): QueryParams<DeadQuery>,
) -> ApiResult {
    let limit = q.limit.unwrap_or(DEAD_LIST_DEFAULT);
    if limit == 0 || limit > DEAD_LIST_MAX {
        return Err(ApiError::bad(format!(
            "limit: {limit} is out of range 1..={DEAD_LIST_MAX}"
        )));
    }
    let v = blocking(move || {
        let shards = match &q.shard {
            Some(s) => {
                app.check_shard(s, "shard")?;
                vec![s.clone()]
            }
            None => app.deployment.shard_names()?,
        };
        let mut out = Vec::new();
        for s in shards {
            for d in app.backend.dead_list(&s, limit)? {
                out.push(json!({
                    "id": job_string(&d.shard, d.id),
                    "shard": d.shard,
                    "key": d.key,
                    "attempts": d.attempts,
                    "reason": d.reason,
                }));
            }
        }
        Ok(json!({ "dead": out }))
    })
    .await?;
    ok(v)
}

/// `POST /v1/dead/retry` and `/v1/dead/purge`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadChange {
    shard: Option<String>,
    ids: Option<BoundedVec<String, RECEIPTS_PER_REQUEST_MAX>>,
    /// Every dead letter (of `shard` when given): must be said, never
    /// implied by a missing `ids`.
    all: Option<bool>,
}

async fn dead_change(app: Arc<App>, req: DeadChange, retry: bool) -> ApiResult {
    let all = req.all.unwrap_or(false);
    match (&req.ids, all) {
        (Some(_), true) => {
            return Err(ApiError::bad(
                "ids and all: give either ids (those dead letters) or \"all\": true (every one), not both",
            ))
        }
        (None, false) => {
            return Err(ApiError::bad(
                "ids: no dead letters named; give ids, or \"all\": true for every dead letter (of shard, when given)",
            ))
        }
        (Some(ids), false) if ids.0.is_empty() => {
            return Err(ApiError::bad(format!(
                "ids: 0 ids; give 1..={RECEIPTS_PER_REQUEST_MAX} (or \"all\": true)"
            )))
        }
        _ => {}
    }
    let n = blocking(move || {
        let mut plan: BTreeMap<String, Option<Vec<JobId>>> = BTreeMap::new();
        if let Some(s) = &req.shard {
            app.check_shard(s, "shard")?;
        }
        match &req.ids {
            Some(ids) => {
                for (i, s) in ids.0.iter().enumerate() {
                    let (shard, id) = parse_job(s, &format!("ids[{i}]")).map_err(ApiError::bad)?;
                    if req.shard.as_ref().is_some_and(|want| *want != shard) {
                        return Err(ApiError::bad(format!(
                            "ids[{i}]: job {s:?} is not on shard {:?}",
                            req.shard.as_deref().unwrap_or("")
                        )));
                    }
                    if !plan.contains_key(&shard) {
                        app.check_shard(&shard, &format!("ids[{i}]"))?;
                    }
                    plan.entry(shard)
                        .or_insert_with(|| Some(Vec::new()))
                        .get_or_insert_with(Vec::new)
                        .push(id);
                }
            }
            None => {
                let shards = match &req.shard {
                    Some(s) => vec![s.clone()],
                    None => app.deployment.shard_names()?,
                };
                for s in shards {
                    plan.insert(s, None);
                }
            }
        }
        let mut n = 0usize;
        for (shard, ids) in plan {
            n += if retry {
                app.backend.dead_retry(&shard, ids.as_deref())?
            } else {
                app.backend.dead_purge(&shard, ids.as_deref())?
            };
        }
        Ok(n)
    })
    .await?;
    if retry {
        ok(json!({ "retried": n }))
    } else {
        ok(json!({ "purged": n }))
    }
}

/// `POST /v1/dead/retry`.
pub async fn dead_retry(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<DeadChange>,
) -> ApiResult {
    let a = Arc::clone(&app);
    let r = dead_change(a, req, true).await;
    app.work_arrived();
    r
}

/// `POST /v1/dead/purge`.
pub async fn dead_purge(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<DeadChange>,
) -> ApiResult {
    dead_change(app, req, false).await
}

// ---------------------------------------------------------------------------
// Resharding.
// ---------------------------------------------------------------------------

fn check_name(name: &str, field: &str) -> Result<(), ApiError> {
    shardq_route::map::validate_shard_name(name)
        .map_err(|e| ApiError::bad(format!("{field}: invalid shard name {}: {e}", shown(name))))
}

fn check_weight(weight: u32) -> Result<(), ApiError> {
    let max = shardq_route::map::WEIGHT_MAX;
    if weight == 0 || weight > max {
        return Err(ApiError::bad(format!(
            "weight: {weight} is out of range 1..={max}"
        )));
    }
    Ok(())
}

/// `POST /v1/admin/add-shard`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddShard {
    name: String,
    weight: Option<u32>,
    url: Option<String>,
}

/// Deploys the shard's store, then records it (warming) in the target.
pub async fn add_shard(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<AddShard>,
) -> ApiResult {
    check_name(&req.name, "name")?;
    let weight = req.weight.unwrap_or(1);
    check_weight(weight)?;
    let v = blocking(move || {
        app.deployment.deploy_shard(&req.name, req.url.as_deref())?;
        let version = reshard::add_shard(&*app.deployment.maps(), &req.name, weight, req.url.clone())?;
        Ok(json!({ "name": req.name, "weight": weight, "map_version": version, "state": "warming" }))
    })
    .await?;
    ok(v)
}

/// `POST /v1/admin/remove-shard`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NameOnly {
    name: String,
}

/// Records the shard's removal in the target.
pub async fn remove_shard(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<NameOnly>,
) -> ApiResult {
    check_name(&req.name, "name")?;
    blocking(move || Ok(reshard::remove_shard(&*app.deployment.maps(), &req.name)?)).await?;
    ok(json!({ "ok": true }))
}

/// `POST /v1/admin/set-weight`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetWeight {
    name: String,
    weight: u32,
}

/// Records a new weight in the target.
pub async fn set_weight(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<SetWeight>,
) -> ApiResult {
    check_name(&req.name, "name")?;
    check_weight(req.weight)?;
    blocking(move || {
        Ok(reshard::set_weight(
            &*app.deployment.maps(),
            &req.name,
            req.weight,
        )?)
    })
    .await?;
    ok(json!({ "ok": true }))
}

/// `POST /v1/admin/pin`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pin {
    key: String,
    shard: String,
}

/// Records a pin in the target.
pub async fn pin(State(app): State<Arc<App>>, JsonBody(req): JsonBody<Pin>) -> ApiResult {
    validate_key(&req.key).map_err(|e| ApiError::bad(format!("key: {e}")))?;
    check_name(&req.shard, "shard")?;
    blocking(move || Ok(reshard::pin(&*app.deployment.maps(), &req.key, &req.shard)?)).await?;
    ok(json!({ "ok": true }))
}

/// `POST /v1/admin/unpin`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Unpin {
    key: String,
}

/// Records an unpin in the target.
pub async fn unpin(State(app): State<Arc<App>>, JsonBody(req): JsonBody<Unpin>) -> ApiResult {
    validate_key(&req.key).map_err(|e| ApiError::bad(format!("key: {e}")))?;
    blocking(move || Ok(reshard::unpin(&*app.deployment.maps(), &req.key)?)).await?;
    ok(json!({ "ok": true }))
}

/// Progress of the rebalance this server started last.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Progress {
    /// `idle`, `pinning`, `moving`, `finished` or `failed`.
    pub phase: &'static str,
    /// Keys with work to drain and switch (known after pinning).
    pub keys_to_move: usize,
    /// Keys switched so far.
    pub keys_moved: usize,
    /// Published map version when it started.
    pub from_version: Option<u64>,
    /// Published map version when it finished.
    pub to_version: Option<u64>,
    /// True when there was nothing to do.
    pub nothing_to_do: bool,
    /// Why it failed, if it did.
    pub last_error: Option<String>,
    /// When it started (ms since the epoch).
    pub started_ms: Option<u64>,
    /// When it ended (ms since the epoch).
    pub finished_ms: Option<u64>,
}

fn progress(m: &Mutex<Progress>) -> std::sync::MutexGuard<'_, Progress> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `POST /v1/admin/rebalance`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RebalanceRequest {
    batch: Option<usize>,
}

/// Starts a rebalance on a background thread: 202, or 409 while one runs.
pub async fn rebalance_start(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<RebalanceRequest>,
) -> ApiResult {
    let batch = req.batch.unwrap_or(reshard::BATCH_DEFAULT);
    if batch == 0 || batch > reshard::BATCH_MAX {
        return Err(ApiError::bad(format!(
            "batch: {batch} is out of range 1..={}",
            reshard::BATCH_MAX
        )));
    }
    {
        let mut p = progress(&app.rebalance);
        if matches!(p.phase, "pinning" | "moving") {
            return Err(ApiError::conflict(format!(
                "a rebalance started by this server is running (phase {}, {} of {} keys moved)",
                p.phase, p.keys_moved, p.keys_to_move
            )));
        }
        *p = Progress {
            phase: "pinning",
            started_ms: Some(app.clock.now_ms()),
            ..Progress::default()
        };
    }
    let a = Arc::clone(&app);
    let spawned = std::thread::Builder::new()
        .name("shardq-serve-rebalance".into())
        .spawn(move || {
            let opts = RebalanceOptions {
                batch,
                ..RebalanceOptions::default()
            };
            let backend = a.deployment.backend();
            let maps = a.deployment.maps();
            a.metrics.rebalance_started();
            let result = reshard::rebalance(&*backend, &*maps, &opts, &mut |ev| {
                a.metrics.rebalance_event(&ev);
                let mut p = progress(&a.rebalance);
                match ev {
                    RebalanceEvent::Pinned { pinned, .. } => {
                        p.phase = "moving";
                        p.keys_to_move = pinned;
                    }
                    RebalanceEvent::Switched { done, total, .. } => {
                        p.phase = "moving";
                        p.keys_moved = done;
                        p.keys_to_move = total;
                    }
                    RebalanceEvent::Finished { version } => p.to_version = Some(version),
                    _ => {}
                }
            });
            a.metrics
                .rebalance_ended(result.as_ref().map(|r| r.moved.len()).map_err(|_| ()));
            let mut p = progress(&a.rebalance);
            p.finished_ms = Some(a.clock.now_ms());
            match result {
                Ok(r) => {
                    p.phase = "finished";
                    p.from_version = Some(r.from_version);
                    p.to_version = Some(r.to_version);
                    p.keys_moved = r.moved.len();
                    p.keys_to_move = p.keys_to_move.max(r.moved.len());
                    p.nothing_to_do = r.nothing_to_do;
                }
                Err(e) => {
                    p.phase = "failed";
                    p.last_error = Some(e.to_string());
                }
            }
        });
    if let Err(e) = spawned {
        let mut p = progress(&app.rebalance);
        p.phase = "failed";
        p.last_error = Some(format!("cannot start the rebalance thread: {e}"));
        return Err(ApiError::internal(format!(
            "cannot start the rebalance thread: {e}"
        )));
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "started": true, "phase": "pinning" })),
    )
        .into_response())
}

/// `GET /v1/admin/rebalance`: the progress of the last rebalance.
pub async fn rebalance_progress(State(app): State<Arc<App>>) -> ApiResult {
    let mut p = progress(&app.rebalance).clone();
    if p.phase.is_empty() {
        p.phase = "idle";
    }
    ok(serde_json::to_value(p).map_err(|e| ApiError::internal(e.to_string()))?)
}

// ---------------------------------------------------------------------------
// Health.
// ---------------------------------------------------------------------------

/// `GET /healthz`: the process answers.
pub async fn healthz() -> ApiResult {
    ok(json!({ "ok": true }))
}

/// `GET /readyz`: the map is readable and every shard's store answers.
pub async fn readyz(State(app): State<Arc<App>>) -> ApiResult {
    let v = blocking(move || {
        let map = app.deployment.map()?;
        let mut failed = Vec::new();
        for s in &map.shards {
            if let Err(e) = app.backend.shard_stats(&s.name) {
                failed.push(format!("{}: {e}", s.name));
            }
        }
        if !failed.is_empty() {
            return Err(ApiError::unavailable(format!(
                "not ready: shards that do not answer: {}",
                failed.join("; ")
            ))
            .with("ready", json!(false)));
        }
        Ok(json!({
            "ready": true,
            "map_version": map.version,
            "owned": app.owned.list(),
            "lease_error": app.owned.last_error(),
        }))
    })
    .await?;
    ok(v)
}

/// `GET /v1/openapi.json`.
pub async fn openapi() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        crate::OPENAPI_JSON,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use shardq_core::JobId;

    use super::*;

    fn r(id: u64, fence: u64) -> Receipt {
        Receipt {
            id: JobId(id),
            fence,
        }
    }

    #[test]
    fn the_claim_book_counts_each_workers_live_runs() {
        let p = crate::auth::ANONYMOUS;
        let mut b = ClaimBook::default();
        b.add("w1", p, "s0", 1, 10, 1_000);
        b.add("w1", p, "s1", 1, 11, 1_000);
        b.add("w2", p, "s0", 2, 12, 5_000);
        let held = |b: &mut ClaimBook, w: &str, now: u64| b.held(w, p, now).0;
        assert_eq!(
            (
                held(&mut b, "w1", 0),
                held(&mut b, "w2", 0),
                held(&mut b, "nobody", 0)
            ),
            (2, 1, 0)
        );
        assert_eq!(b.held("w1", p, 0).1, 3, "the token holds all three");
        // A stale fence or an unknown shard finishes nothing.
        b.finish("s0", r(1, 9));
        b.finish("s9", r(1, 10));
        assert_eq!(held(&mut b, "w1", 0), 2);
        b.finish("s0", r(1, 10));
        assert_eq!(held(&mut b, "w1", 0), 1);
        // An extended lease outlives the others; lapsed ones stop counting,
        // and a worker with none left is forgotten.
        b.extend("s1", r(1, 11), 9_000);
        assert_eq!(
            (held(&mut b, "w1", 6_000), held(&mut b, "w2", 6_000)),
            (1, 0)
        );
        assert!(!b.workers.contains_key("w2"), "w2 is forgotten");
        // A run claimed again by another worker moves to it.
        b.add("w3", p, "s1", 1, 13, 9_000);
        assert_eq!(
            (held(&mut b, "w1", 6_000), held(&mut b, "w3", 6_000)),
            (0, 1)
        );
        assert_eq!(b.workers.len(), 1);
        assert_eq!(b.held("w3", p, 6_000).1, 1);
        b.held("w3", p, 9_000);
        assert!(b.runs.is_empty() && b.lapse.is_empty() && b.by_principal.is_empty());
    }

    #[test]
    fn invented_worker_names_share_their_tokens_bound() {
        let (a, z) = (crate::auth::Principal(0), crate::auth::Principal(1));
        let mut b = ClaimBook::default();
        for i in 0..100u64 {
            b.add(&format!("w{i}"), a, "s0", i, i + 1, 1_000);
        }
        assert_eq!(b.held("fresh-name", a, 0), (0, 100));
        assert_eq!(b.held("fresh-name", z, 0), (0, 0));
        // Lapsed runs leave the token's count without any worker claiming.
        assert_eq!(b.held("w0", a, 1_000), (0, 0));
        assert!(b.workers.is_empty());
    }
}
