//! `POST /v1/claim` and the book of runs handed out: the long poll over
//! the owned shards, the per-worker and per-token bounds, and the receipts
//! grouped by shard for the run operations. It must never hand out more
//! runs than the bounds allow, nor walk every run on a claim.

use super::*;
use crate::ids::{split_receipt, WireId};

// ---------------------------------------------------------------------------
// Claims and the runs they start.
// ---------------------------------------------------------------------------

/// A run: (shard number in the book, job id).
type RunKey = (u32, u64);

/// Receipts of one request grouped by owned shard (parsed, as sent), and
/// the receipts of shards not owned here.
pub(super) type Grouped = (BTreeMap<String, Vec<(Receipt, String)>>, Vec<String>);

/// One run handed out: who holds it, its fence and lease end, and its
/// job timeout (the claim's `timeout_ms`) when it has one.
#[derive(Debug, Clone, Copy)]
struct HeldRun {
    worker: u32,
    principal: Principal,
    fence: u64,
    until: u64,
    /// (deadline, timeout ms): past the deadline the server fails the run.
    timeout: Option<(u64, u64)>,
}

/// A run's fence, lease end and job timeout, as the book is given them.
#[derive(Debug, Clone, Copy)]
struct RunTerms {
    fence: u64,
    until: u64,
    /// (deadline, timeout ms).
    timeout: Option<(u64, u64)>,
}

/// A run past its job timeout, to be failed: shard, receipt, timeout ms.
pub(crate) type TimedOut = (Arc<str>, Receipt, u64);

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
    /// (deadline, run, fence) of every run in `runs` with a job timeout.
    deadlines: std::collections::BTreeSet<(u64, RunKey, u64)>,
    /// Shard names by number.
    shard_names: Vec<Arc<str>>,
    /// Runs that claims in progress may still add, per worker name and per
    /// token: counted against the bounds, so that concurrent claims of one
    /// worker cannot pass them together.
    reserved_by_worker: HashMap<Arc<str>, usize, RandomState>,
    reserved_by_principal: HashMap<Principal, usize, RandomState>,
}

impl ClaimBook {
    fn shard_no(&mut self, shard: &str) -> u32 {
        if let Some(&n) = self.shards.get(shard) {
            return n;
        }
        let n = self.shards.len() as u32;
        let name: Arc<str> = Arc::from(shard);
        self.shards.insert(Arc::clone(&name), n);
        self.shard_names.push(name);
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

    /// Takes the runs whose job timeout passed by `now_ms` out of the
    /// book: the caller fails each.
    pub(crate) fn timed_out(&mut self, now_ms: u64) -> Vec<TimedOut> {
        let mut out = Vec::new();
        while let Some(&(deadline, k, fence)) = self.deadlines.first() {
            if deadline > now_ms {
                break;
            }
            self.deadlines.pop_first();
            let Some(run) = self.runs.get(&k).filter(|r| r.fence == fence).copied() else {
                continue;
            };
            let ms = run.timeout.map_or(0, |(_, ms)| ms);
            self.remove(k);
            if let Some(name) = self.shard_names.get(k.0 as usize) {
                out.push((
                    Arc::clone(name),
                    Receipt {
                        id: JobId(k.1),
                        fence,
                    },
                    ms,
                ));
            }
        }
        out
    }

    /// Whether a run's job timeout may have passed by `now_ms`.
    pub(crate) fn any_timed_out(&self, now_ms: u64) -> bool {
        self.deadlines.first().is_some_and(|&(d, _, _)| d <= now_ms)
    }

    fn remove(&mut self, k: RunKey) {
        let Some(run) = self.runs.remove(&k) else {
            return;
        };
        self.lapse.remove(&(run.until, k, run.fence));
        if let Some((deadline, _)) = run.timeout {
            self.deadlines.remove(&(deadline, k, run.fence));
        }
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

    /// Reserves up to `max` runs for a claim of `worker` under both bounds:
    /// how many, or the error of the bound already reached.
    fn reserve(
        &mut self,
        worker: &str,
        principal: Principal,
        now_ms: u64,
        max: usize,
        caps: (usize, usize),
    ) -> Result<usize, ApiError> {
        let (held, by_token) = self.held(worker, principal, now_ms);
        let held = held + self.reserved_by_worker.get(worker).copied().unwrap_or(0);
        let by_token = by_token
            + self
                .reserved_by_principal
                .get(&principal)
                .copied()
                .unwrap_or(0);
        let (cap, token_cap) = caps;
        if held >= cap {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("worker {}: holds {held} runs, the limit per worker is {cap}; ack, fail or let some lapse first", shown(worker)),
            ));
        }
        if by_token >= token_cap {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the workers of this token hold {by_token} runs, the limit per token is {token_cap}; ack, fail or let some lapse first"),
            ));
        }
        let n = max.min(cap - held).min(token_cap - by_token);
        *self
            .reserved_by_worker
            .entry(Arc::from(worker))
            .or_insert(0) += n;
        *self.reserved_by_principal.entry(principal).or_insert(0) += n;
        Ok(n)
    }

    /// Ends a reservation of `n` (the runs claimed are in the book now).
    fn unreserve(&mut self, worker: &str, principal: Principal, n: usize) {
        if let Some(r) = self.reserved_by_worker.get_mut(worker) {
            *r = r.saturating_sub(n);
            if *r == 0 {
                self.reserved_by_worker.remove(worker);
            }
        }
        if let Some(r) = self.reserved_by_principal.get_mut(&principal) {
            *r = r.saturating_sub(n);
            if *r == 0 {
                self.reserved_by_principal.remove(&principal);
            }
        }
    }

    fn add(&mut self, worker: &str, principal: Principal, shard: &str, id: u64, terms: RunTerms) {
        let RunTerms {
            fence,
            until,
            timeout,
        } = terms;
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
                timeout,
            },
        );
        self.lapse.insert((until, k, fence));
        if let Some((deadline, _)) = timeout {
            self.deadlines.insert((deadline, k, fence));
        }
    }

    pub(super) fn finish(&mut self, shard: &str, r: Receipt) {
        let Some(sn) = self.known_shard(shard) else {
            return;
        };
        let k = (sn, r.id.0);
        if self.runs.get(&k).is_some_and(|run| run.fence == r.fence) {
            self.remove(k);
        }
    }

    pub(super) fn extend(&mut self, shard: &str, r: Receipt, until: u64) {
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

pub(super) fn book(m: &Mutex<ClaimBook>) -> std::sync::MutexGuard<'_, ClaimBook> {
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
    /// The runs' job timeout, in ms (default: `serve --job-timeout-ms`):
    /// past it the server fails the run, whatever its extends.
    timeout_ms: Option<u64>,
}

/// A run handed out, as the claim answers it ([`ClaimedWire`]): the
/// claimed job's own strings, moved, not copied; the id and receipt are
/// written from them into the answer.
#[derive(Debug)]
struct ClaimedOut {
    shard: String,
    id: JobId,
    key: String,
    /// The payload as text, or in base64 when it is not UTF-8.
    payload: Result<String, String>,
    attempt: u32,
    max_attempts: u32,
    fence: u64,
    lease_expires_ms: u64,
    timeout_expires_ms: Option<u64>,
    dedup_id: Option<String>,
    schedule: Option<shardq_core::schedule::ScheduleTick>,
    /// A released dependent's number.
    dependent: Option<u64>,
    /// The batch of a job of a batch or of a callback, and a callback's
    /// kind.
    batch: Option<(u64, Option<&'static str>)>,
}

impl ClaimedOut {
    /// Bytes of its answer, at a guess (an estimate for the buffer).
    fn wire_estimate(&self) -> usize {
        let payload = match &self.payload {
            Ok(s) | Err(s) => json_str_estimate(s),
        };
        256 + 3 * self.shard.len()
            + json_str_estimate(&self.key)
            + payload
            + self.dedup_id.as_deref().map_or(0, json_str_estimate)
            + self.schedule.as_ref().map_or(0, |t| 64 + t.id.len())
    }
}

/// A dependent's or a batch's id, `@N`.
struct AtId(u64);

impl Serialize for AtId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("@{}", self.0))
    }
}

/// One job of a claim's answer, as sent.
#[derive(Serialize)]
struct ClaimedWire<'a> {
    id: WireId<'a>,
    shard: &'a str,
    key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_b64: Option<&'a str>,
    attempt: u32,
    max_attempts: u32,
    receipt: WireId<'a>,
    fence: u64,
    lease_expires_ms: u64,
    /// When the server fails the run if it has not ended (its job timeout).
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout_expires_ms: Option<u64>,
    /// The dedup id the job was enqueued with.
    #[serde(skip_serializing_if = "Option::is_none")]
    dedup_id: Option<&'a str>,
    /// A schedule's job: its schedule and tick.
    #[serde(skip_serializing_if = "Option::is_none")]
    schedule: Option<&'a shardq_core::schedule::ScheduleTick>,
    /// A released dependent: its id, `@N` (`GET /v1/jobs/@N` lists its
    /// dependencies' outcomes and results).
    #[serde(skip_serializing_if = "Option::is_none")]
    dependent: Option<AtId>,
    /// The batch of a job of a batch or of a callback, `@N`.
    #[serde(skip_serializing_if = "Option::is_none")]
    batch: Option<AtId>,
    /// A batch callback's kind: `complete`, `success` or `death`.
    #[serde(skip_serializing_if = "Option::is_none")]
    batch_callback: Option<&'static str>,
}

impl Serialize for ClaimedOut {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let id = |fence| WireId {
            shard: &self.shard,
            id: self.id,
            fence,
        };
        ClaimedWire {
            id: id(None),
            shard: &self.shard,
            key: &self.key,
            payload: self.payload.as_deref().ok(),
            payload_b64: self.payload.as_deref().err().map(|s| s.as_str()),
            attempt: self.attempt,
            max_attempts: self.max_attempts,
            receipt: id(Some(self.fence)),
            fence: self.fence,
            lease_expires_ms: self.lease_expires_ms,
            timeout_expires_ms: self.timeout_expires_ms,
            dedup_id: self.dedup_id.as_deref(),
            schedule: self.schedule.as_ref(),
            dependent: self.dependent.map(AtId),
            batch: self.batch.map(|(n, _)| AtId(n)),
            batch_callback: self.batch.and_then(|(_, kind)| kind),
        }
        .serialize(s)
    }
}

/// The claim's answer, written into a buffer sized from its jobs.
fn ok_claimed(jobs: Vec<ClaimedOut>) -> ApiResult {
    let estimate = 16 + jobs.iter().map(ClaimedOut::wire_estimate).sum::<usize>();
    ok_jobs_sized(jobs, estimate)
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
    if w.is_empty() || w.len() > WORKER_NAME_BYTES_MAX || shardq_core::job::has_unshowable(w) {
        return Err(ApiError::bad(format!(
            "worker: invalid worker name {}: 1..={WORKER_NAME_BYTES_MAX} bytes without control or invisible formatting characters",
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
    let timeout_ms = req.timeout_ms.or(app.limits.job_timeout_ms);
    if let Some(ms) = req.timeout_ms {
        shardq_core::validate_job_timeout_ms(ms)
            .map_err(|e| ApiError::bad(format!("timeout_ms: {e}")))?;
    }
    let deadline = Instant::now() + Duration::from_millis(wait_ms);
    let worker = req.worker.clone();
    // Waiting claims poll with a backoff and skip a poll that another
    // waiter just made and found empty, with no work arrived since: a
    // thousand idle long polls cost about one claim round per interval.
    let mut interval_ms = CLAIM_POLL_MS;
    let mut woken = true;
    let mut waiting = None;
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
            let (jobs, err) = blocking(move || {
                Ok(a.claim_once(&wk, principal, max as usize, lease_ms, timeout_ms))
            })
            .await?;
            if let Some(e) = err {
                if jobs.is_empty() {
                    return Err(e);
                }
            }
            if !jobs.is_empty() {
                return ok_claimed(jobs);
            }
            app.polled_empty(generation);
        }
        if Instant::now() >= deadline {
            return ok(json!({ "jobs": [] }));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        waiting.get_or_insert_with(|| app.load.waiting());
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

/// A claimed job as the answer gives it; `timeout_expires_ms` is its job
/// timeout's end, when it has one.
fn claimed_out(j: shardq_core::ClaimedJob, timeout_expires_ms: Option<u64>) -> ClaimedOut {
    let payload = String::from_utf8(j.payload)
        .map_err(|e| base64::engine::general_purpose::STANDARD.encode(e.into_bytes()));
    let dedup_id = j.dedup_id.as_deref();
    let batch = dedup_id.and_then(shardq_core::workflow::batch_of_dedup_id);
    ClaimedOut {
        schedule: dedup_id.and_then(shardq_core::schedule::ScheduleTick::of_dedup_id),
        dependent: dedup_id.and_then(shardq_core::workflow::dependent_of_dedup_id),
        batch: batch.map(|(n, kind)| (n, kind.map(shardq_core::workflow::CallbackKind::as_str))),
        shard: j.shard,
        id: j.id,
        key: j.key,
        payload,
        attempt: j.attempt,
        max_attempts: j.max_attempts,
        fence: j.fence,
        lease_expires_ms: j.lease_until_ms,
        timeout_expires_ms,
        dedup_id: j.dedup_id,
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
        timeout_ms: Option<u64>,
    ) -> (Vec<ClaimedOut>, Option<ApiError>) {
        let now = self.clock.now_ms();
        let caps = (
            self.limits.claims_per_worker_max,
            self.limits.claims_per_token_max,
        );
        let reserved = match book(&self.claims).reserve(worker, principal, now, max, caps) {
            Ok(n) => n,
            Err(e) => return (Vec::new(), Some(e)),
        };
        let claimed = self.claim_reserved(worker, principal, reserved, lease_ms, timeout_ms, now);
        book(&self.claims).unreserve(worker, principal, reserved);
        claimed
    }

    /// [`App::claim_once`] of at most `want` runs, already reserved.
    fn claim_reserved(
        &self,
        worker: &str,
        principal: Principal,
        mut want: usize,
        lease_ms: u64,
        timeout_ms: Option<u64>,
        now: u64,
    ) -> (Vec<ClaimedOut>, Option<ApiError>) {
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
        // Ranked keys over several shards: the shards of the best-ranked
        // ready keys first, each for its share; then the others in turn.
        let order = shardq_core::claim_order(self.backend.as_ref(), &shards, start, want, |_| true);
        for (shard, share) in order {
            if want == 0 {
                break;
            }
            match self
                .backend
                .claim(&shard, share.unwrap_or(want).min(want), lease_ms)
            {
                Ok(jobs) => {
                    crate::metrics::claimed(self, &jobs, now);
                    out.reserve(jobs.len());
                    let mut b = book(&self.claims);
                    for j in jobs {
                        want = want.saturating_sub(1);
                        b.add(
                            worker,
                            principal,
                            &j.shard,
                            j.id.0,
                            RunTerms {
                                fence: j.fence,
                                until: j.lease_until_ms,
                                timeout: timeout_ms.map(|ms| (now.saturating_add(ms), ms)),
                            },
                        );
                        out.push(claimed_out(j, timeout_ms.map(|ms| now.saturating_add(ms))));
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
    pub(super) fn group_receipts(&self, receipts: &[String]) -> Result<Grouped, ApiError> {
        let mut groups: BTreeMap<String, Vec<(Receipt, String)>> = BTreeMap::new();
        let mut not_owned = Vec::new();
        let mut map_names: Option<Vec<String>> = None;
        for (i, s) in receipts.iter().enumerate() {
            let (shard, r) =
                split_receipt(s, || format!("receipts[{i}]")).map_err(ApiError::bad)?;
            // Ownership is looked up once per shard of the request.
            if let Some(group) = groups.get_mut(shard) {
                group.push((r, s.clone()));
                continue;
            }
            if self.owned.contains(shard) {
                groups.insert(shard.to_string(), vec![(r, s.clone())]);
                continue;
            }
            if map_names.is_none() {
                map_names = Some(self.deployment.shard_names()?);
            }
            if !map_names
                .as_ref()
                .is_some_and(|n| n.iter().any(|n| n == shard))
            {
                return Err(ApiError::bad(format!(
                    "receipts[{i}]: receipt {s:?} names unknown shard {shard:?}"
                )));
            }
            not_owned.push(s.clone());
        }
        Ok((groups, not_owned))
    }
}

#[cfg(test)]
mod tests {
    use shardq_core::JobId;

    use super::*;

    fn terms(fence: u64, until: u64, timeout: Option<(u64, u64)>) -> RunTerms {
        RunTerms {
            fence,
            until,
            timeout,
        }
    }

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
        b.add("w1", p, "s0", 1, terms(10, 1_000, None));
        b.add("w1", p, "s1", 1, terms(11, 1_000, None));
        b.add("w2", p, "s0", 2, terms(12, 5_000, None));
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
        b.add("w3", p, "s1", 1, terms(13, 9_000, None));
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
    fn claims_in_progress_count_against_the_bounds() {
        let p = crate::auth::ANONYMOUS;
        let mut b = ClaimBook::default();
        // Three claims of one worker at once, bound 3: together they may
        // take 3 runs, not 3 each.
        assert_eq!(b.reserve("w", p, 0, 2, (3, 100)).unwrap(), 2);
        assert_eq!(b.reserve("w", p, 0, 2, (3, 100)).unwrap(), 1);
        assert!(b.reserve("w", p, 0, 2, (3, 100)).is_err());
        // The same for a token's bound across invented names.
        assert_eq!(b.reserve("x", p, 0, 5, (100, 4)).unwrap(), 1);
        assert!(b.reserve("y", p, 0, 5, (100, 4)).is_err());
        // A claim that found nothing gives its reservation back.
        b.unreserve("w", p, 2);
        assert_eq!(b.reserve("w", p, 0, 2, (3, 100)).unwrap(), 2);
        // Runs added and reservations ended: the bound counts the runs.
        b.unreserve("w", p, 3);
        b.unreserve("x", p, 1);
        b.add("w", p, "s0", 1, terms(1, 1_000, None));
        assert_eq!(b.reserve("w", p, 0, 5, (3, 100)).unwrap(), 2);
        assert!(b.reserve("w", p, 0, 5, (3, 100)).is_err());
    }

    #[test]
    fn invented_worker_names_share_their_tokens_bound() {
        let (a, z) = (crate::auth::Principal(0), crate::auth::Principal(1));
        let mut b = ClaimBook::default();
        for i in 0..100u64 {
            b.add(&format!("w{i}"), a, "s0", i, terms(i + 1, 1_000, None));
        }
        assert_eq!(b.held("fresh-name", a, 0), (0, 100));
        assert_eq!(b.held("fresh-name", z, 0), (0, 0));
        // Lapsed runs leave the token's count without any worker claiming.
        assert_eq!(b.held("w0", a, 1_000), (0, 0));
        assert!(b.workers.is_empty());
    }

    #[test]
    fn runs_past_their_job_timeout_leave_the_book_once() {
        let mut b = ClaimBook::default();
        let p = ANONYMOUS;
        b.add("w", p, "s0", 1, terms(10, 60_000, Some((1_000, 1_000))));
        b.add("w", p, "s0", 2, terms(11, 60_000, Some((5_000, 5_000))));
        b.add("w", p, "s1", 3, terms(12, 60_000, None));
        assert!(!b.any_timed_out(999));
        assert!(b.timed_out(999).is_empty());
        let out = b.timed_out(1_000);
        assert_eq!(out.len(), 1);
        assert_eq!((&*out[0].0, out[0].1, out[0].2), ("s0", r(1, 10), 1_000));
        assert!(b.timed_out(1_000).is_empty(), "once");
        // An acked run leaves its deadline too.
        b.finish("s0", r(2, 11));
        assert!(!b.any_timed_out(u64::MAX));
        assert_eq!(b.held("w", p, 0), (1, 1));
    }
}
