//! `POST /v1/jobs`: validation of every job, then the jobs stored through a
//! pooled producer; a dedup id goes with its job to the backend, which
//! checks it atomically with the append on the key's shard. It must never
//! report a stored job as failed.

use super::*;

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
pub(super) struct JobIn {
    pub(super) key: String,
    pub(super) payload: Option<String>,
    payload_b64: Option<String>,
    pub(super) delay_ms: Option<u64>,
    pub(super) max_attempts: Option<u32>,
    pub(super) dedup_id: Option<String>,
    pub(super) unique_id: Option<String>,
    pub(super) unique_while: Option<String>,
    pub(super) debounce_id: Option<String>,
    pub(super) debounce_ms: Option<u64>,
    pub(super) debounce_max_ms: Option<u64>,
    /// Dependencies: ids (`SHARD:ID`, `@N`) and indexes of this request's
    /// jobs. A request where any job has it stores every job as a
    /// dependent, in one compare-and-set (jobs without it are released at
    /// the next pass): a graph sent at once.
    pub(super) after: Option<Vec<Value>>,
    pub(super) on_dependency_failure: Option<String>,
    /// A batch's id (`@N`, from `POST /v1/batches`): the job joins it. A
    /// request where any job has it adds every job to that one batch, in
    /// one compare-and-set.
    pub(super) batch: Option<String>,
}

/// A job placed by an enqueue (or the job its dedup id names), as the
/// answer gives it: `{"id", "shard", "key", "duplicate"}`.
#[derive(Debug)]
struct Enqueued {
    shard: String,
    id: JobId,
    key: String,
    duplicate: bool,
}

impl Enqueued {
    /// Bytes of its answer, at a guess (an estimate for the buffer).
    fn wire_estimate(&self) -> usize {
        64 + 3 * self.shard.len() + json_str_estimate(&self.key)
    }
}

impl Serialize for Enqueued {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a> {
            id: crate::ids::WireId<'a>,
            shard: &'a str,
            key: &'a str,
            duplicate: bool,
        }
        Wire {
            id: crate::ids::WireId {
                shard: &self.shard,
                id: self.id,
                fence: None,
            },
            shard: &self.shard,
            key: &self.key,
            duplicate: self.duplicate,
        }
        .serialize(s)
    }
}

/// Checks dedup id `id`; `field` names it in the error (formatted only
/// for one).
fn check_dedup_id(id: &str, field: impl Fn() -> String) -> Result<(), ApiError> {
    if id.is_empty() || id.len() > DEDUP_ID_BYTES_MAX || shardq_core::job::has_unshowable(id) {
        return Err(ApiError::bad(format!(
            "{}: invalid dedup id {}: 1..={DEDUP_ID_BYTES_MAX} bytes without control or invisible formatting characters",
            field(),
            shown(id)
        )));
    }
    shardq_core::job::refuse_reserved_dedup_id(id)
        .map_err(|e| ApiError::bad(format!("{}: {e}", field())))
}

pub(super) fn to_new_job(
    i: usize,
    j: JobIn,
    payload_max: usize,
    retry: &RetrySettings,
) -> Result<NewJob, ApiError> {
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
    if let Some(d) = &j.dedup_id {
        check_dedup_id(d, || f("dedup_id"))?;
    }
    let max_attempts = (j.max_attempts).unwrap_or_else(|| retry.for_key(&j.key).max_attempts);
    let keyed = shardq_core::KeyedSpec {
        unique_id: j.unique_id,
        unique_while: j.unique_while,
        debounce_id: j.debounce_id,
        debounce_ms: j.debounce_ms,
        debounce_max_ms: j.debounce_max_ms,
    };
    let job = keyed
        .apply(NewJob {
            key: j.key,
            payload,
            delay_ms: j.delay_ms.unwrap_or(0),
            max_attempts,
            dedup_id: j.dedup_id,
            keyed: None,
        })
        .map_err(|e| ApiError::bad(format!("jobs[{i}]: {e}")))?;
    job.validate(payload_max).map_err(|e| {
        let field = match e {
            QueueError::InvalidMaxAttempts { .. } => "max_attempts",
            QueueError::InvalidDelay { .. } => "delay_ms",
            QueueError::InvalidDedupId { .. } => "dedup_id",
            _ => "job",
        };
        ApiError::bad(format!("{}: {e}", f(field)))
    })?;
    Ok(job)
}

/// `POST /v1/jobs`: validate everything, enqueue through a producer (the
/// backend answers for dedup ids), reply.
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
    if jobs_in.iter().any(|j| j.batch.is_some()) {
        return super::batches::enqueue_in_batch(app, jobs_in).await;
    }
    if jobs_in.iter().any(|j| j.after.is_some()) {
        return enqueue_graph(app, jobs_in).await;
    }
    if let Some(i) = jobs_in
        .iter()
        .position(|j| j.on_dependency_failure.is_some())
    {
        return Err(ApiError::bad(format!(
            "jobs[{i}].on_dependency_failure: given without after; it applies to a job with dependencies"
        )));
    }
    let mut jobs = Vec::with_capacity(n);
    for (i, j) in jobs_in.into_iter().enumerate() {
        match to_new_job(i, j, app.limits.payload_bytes_max, &app.retry) {
            Ok(job) => jobs.push(job),
            Err(e) => {
                // The first bad job is named: a repeated id before it first.
                check_repeated_dedup_ids(&jobs)?;
                return Err(e);
            }
        }
    }
    check_repeated_dedup_ids(&jobs)?;
    let a = Arc::clone(&app);
    let out = blocking(move || a.enqueue_blocking(jobs)).await?;
    app.work_arrived();
    let estimate = 16 + out.iter().map(Enqueued::wire_estimate).sum::<usize>();
    ok_jobs_sized(out, estimate)
}

/// Refuses jobs of one key that share a dedup id, naming the first such
/// job (a burst of one key's keyed jobs may share an id in one request).
fn check_repeated_dedup_ids(jobs: &[NewJob]) -> Result<(), ApiError> {
    let mut seen: HashMap<(&str, &str), usize, RandomState> =
        HashMap::with_capacity_and_hasher(jobs.len(), RandomState::new());
    for (i, job) in jobs.iter().enumerate() {
        if let Some(id) = job.dedup_id.as_deref().filter(|_| job.keyed.is_none()) {
            if let Some(first) = seen.insert((&job.key, id), i) {
                return Err(ApiError::bad(format!(
                    "jobs[{i}].dedup_id: {} already used by jobs[{first}] of this request, for the same key",
                    shown(id)
                )));
            }
        }
    }
    Ok(())
}

/// A request with `after`: every job a dependent, stored at once. Answers
/// each with its id `@N`, `shard` empty (it is on no shard until
/// released) and `waiting: true`; a job whose key has a dependent with
/// its `dedup_id` answers that one (`duplicate: true`), so a graph whose
/// jobs carry dedup ids can be sent again after a lost answer.
async fn enqueue_graph(app: Arc<App>, jobs_in: Vec<JobIn>) -> ApiResult {
    let n = jobs_in.len();
    let mut deps = Vec::with_capacity(n);
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for (i, mut j) in jobs_in.into_iter().enumerate() {
        if let Some(id) = &j.dedup_id {
            if let Some(first) = seen.insert((j.key.clone(), id.clone()), i) {
                return Err(ApiError::bad(format!(
                    "jobs[{i}].dedup_id: {} already used by jobs[{first}] of this request, for the same key",
                    shown(id)
                )));
            }
        }
        if j.after.is_none() && j.on_dependency_failure.is_some() {
            return Err(ApiError::bad(format!(
                "jobs[{i}].on_dependency_failure: given without after; it applies to a job with dependencies"
            )));
        }
        let after = super::dependents::parse_after(i, &j.after.take().unwrap_or_default(), n)?;
        let on_failure =
            super::dependents::parse_on_failure(i, j.on_dependency_failure.take().as_deref())?;
        if j.unique_id.is_some() || j.debounce_id.is_some() {
            return Err(ApiError::bad(format!(
                "jobs[{i}]: a job of a request with after takes no unique_id or debounce_id (a dedup_id makes it safe to send again)"
            )));
        }
        let job = to_new_job(i, j, app.limits.payload_bytes_max, &app.retry)?;
        deps.push(shardq_core::workflow::NewDependent {
            job,
            after,
            on_failure,
        });
    }
    let keys: Vec<String> = deps.iter().map(|d| d.job.key.clone()).collect();
    let a = Arc::clone(&app);
    let ids = blocking(move || a.add_dependents_blocking(deps)).await?;
    let out: Vec<Value> = ids
        .iter()
        .zip(keys)
        .map(|((n, dup), key)| json!({ "id": format!("@{n}"), "shard": "", "key": key, "duplicate": dup, "waiting": true }))
        .collect();
    ok_jobs(out)
}

impl App {
    fn enqueue_blocking(&self, mut jobs: Vec<NewJob>) -> Result<Vec<Enqueued>, ApiError> {
        let mut producer = self.take_producer()?;
        let outcome = producer.enqueue_batch(&jobs);
        self.metrics.refusals(&producer.take_refusals());
        self.put_producer(producer);
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
        let mut results: Vec<Option<Enqueued>> = (0..jobs.len()).map(|_| None).collect();
        for p in placed {
            // Each job is placed once: its key moves to its answer.
            results[p.index] = Some(Enqueued {
                key: std::mem::take(&mut jobs[p.index].key),
                shard: p.shard,
                id: p.id,
                duplicate: p.duplicate,
            });
        }
        if let Some(e) = error {
            // The jobs stored (and the duplicates answered) are listed, so a
            // client that retries sends only the rest.
            let placed_json: Vec<Value> = results
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().map(|r| json!({"index": i, "id": job_string(&r.shard, r.id), "shard": r.shard, "duplicate": r.duplicate})))
                .collect();
            return Err(e.with("placed", Value::Array(placed_json)));
        }
        Ok(results.into_iter().flatten().collect())
    }
}
