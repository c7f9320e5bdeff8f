//! One job at a time, for operators: `GET /v1/jobs/{id}` (a live job),
//! `GET /v1/keys/{key}/jobs` (a key's live jobs in key order) and
//! `DELETE /v1/jobs/{id}` (cancel a job; a running one's run is asked to
//! stop, and the job goes when the run ends).

use super::*;
use shardq_core::{CancelOutcome, Finish, FinishedJob, JobInfo, JobState, KEY_JOBS_MAX};
use shardq_deploy::JobLookup;

/// A job's run in flight.
#[derive(Debug, Serialize)]
struct RunOut {
    fence: u64,
    lease_expires_ms: u64,
}

/// A live job on the wire (`Job` in the OpenAPI document).
#[derive(Debug, Serialize)]
struct JobOut {
    id: String,
    shard: String,
    key: String,
    state: JobState,
    attempts: u32,
    max_attempts: u32,
    created_ms: u64,
    not_before_ms: u64,
    run: Option<RunOut>,
    reason: Option<String>,
    attempt_starts_ms: Vec<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_b64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dedup_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    schedule: Option<shardq_core::schedule::ScheduleTick>,
}

fn job_out(shard: &str, j: JobInfo) -> JobOut {
    let (payload, payload_b64) = match String::from_utf8(j.payload) {
        Ok(s) => (Some(s), None),
        Err(e) => (
            None,
            Some(base64::engine::general_purpose::STANDARD.encode(e.into_bytes())),
        ),
    };
    JobOut {
        id: job_string(shard, j.id),
        shard: shard.to_string(),
        key: j.key,
        state: j.state,
        attempts: j.attempts,
        max_attempts: j.max_attempts,
        created_ms: j.created_ms,
        not_before_ms: j.not_before_ms,
        // A run this process only replayed has no known deadline.
        run: j.run.map(|(fence, until)| RunOut {
            fence,
            lease_expires_ms: if until == u64::MAX { 0 } else { until },
        }),
        reason: j.reason,
        attempt_starts_ms: j.attempt_starts_ms,
        payload,
        payload_b64,
        schedule: j
            .dedup_id
            .as_deref()
            .and_then(shardq_core::schedule::ScheduleTick::of_dedup_id),
        dedup_id: j.dedup_id,
    }
}

/// A finished job on the wire (`finished` of `GET /v1/keys/{key}/jobs`).
#[derive(Debug, Serialize)]
struct FinishedOut {
    id: String,
    shard: String,
    key: String,
    outcome: Finish,
    attempts: u32,
    finished_ms: u64,
    attempt_starts_ms: Vec<u64>,
    reason: Option<String>,
    /// The handler's result when it is text.
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<String>,
    /// The handler's result in base64 when it is not text.
    #[serde(skip_serializing_if = "Option::is_none")]
    result_b64: Option<String>,
}

/// A finished job of `shard` in the wire form of `finished` in
/// `GET /v1/keys/{key}/jobs`, for every place that prints one.
pub fn finished_value(shard: &str, f: FinishedJob) -> Value {
    serde_json::to_value(FinishedOut {
        id: job_string(shard, f.id),
        shard: shard.to_string(),
        key: f.key,
        outcome: f.outcome,
        attempts: f.attempts,
        finished_ms: f.finished_ms,
        attempt_starts_ms: f.attempt_starts_ms,
        reason: f.reason,
        result: (f.result.as_ref()).and_then(|b| std::str::from_utf8(b).ok().map(str::to_string)),
        result_b64: (f.result.as_ref())
            .filter(|b| std::str::from_utf8(b).is_err())
            .map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
    })
    .unwrap_or(Value::Null)
}

/// A live job of `shard` in the wire form of `GET /v1/jobs/{id}` (the
/// OpenAPI document's `Job`), for every place that prints one (the CLI's
/// `--json` too).
pub fn job_value(shard: &str, j: JobInfo) -> Value {
    serde_json::to_value(job_out(shard, j)).unwrap_or(Value::Null)
}

/// A dead letter in the wire form of `GET /v1/dead` (the OpenAPI
/// document's `DeadJob`), for every place that prints one (`shardq dead
/// list --json` too).
pub fn dead_value(d: &shardq_core::DeadJob) -> Value {
    json!({
        "id": job_string(&d.shard, d.id),
        "shard": d.shard,
        "key": d.key,
        "attempts": d.attempts,
        "reason": d.reason,
        "attempt_starts_ms": d.attempt_starts_ms,
    })
}

/// The shard and id of a `SHARD:ID` path parameter, the shard checked.
fn job_ref(app: &App, id: &str) -> Result<(String, JobId), ApiError> {
    let (shard, job) = parse_job(id, "id").map_err(ApiError::bad)?;
    app.check_shard(&shard, "id")?;
    Ok((shard, job))
}

/// Job `job` of `shard` as `GET /v1/jobs/{id}` answers it: live or
/// finished there, or its copy after a move
/// ([`shardq_deploy::Deployment::find_job`]);
/// with whether it may still change (not finished, not dead). The 404 of
/// an id not found says where its key went, when a move is remembered.
pub(crate) fn find_in(
    app: &App,
    shard: &str,
    job: JobId,
    id: &str,
) -> Result<(Value, bool), ApiError> {
    find(app, shard, job, id)
}

fn find(app: &App, shard: &str, job: JobId, id: &str) -> Result<(Value, bool), ApiError> {
    // A copy found after a move says so: `moved` names its key, the shard
    // it is on and the id asked for.
    let moved = |at: &str, found: JobId, key: &str, mut v: Value| {
        if at != shard || found != job {
            v["moved"] = json!({ "key": key, "shard": at, "from": id });
        }
        v
    };
    match app.deployment.find_job(shard, job)? {
        JobLookup::Live(at, j) => {
            let waiting = j.state != JobState::Dead;
            let (found, key) = (j.id, j.key.clone());
            let v = serde_json::to_value(job_out(&at, j)).unwrap_or(Value::Null);
            Ok((moved(&at, found, &key, v), waiting))
        }
        JobLookup::Finished(at, f) => {
            let (found, key) = (f.id, f.key.clone());
            Ok((moved(&at, found, &key, finished_value(&at, f)), false))
        }
        JobLookup::Moved { key, shard: now } => Err(gone(id, Some((key, now)))),
        JobLookup::Unknown => Err(gone(id, None)),
    }
}

/// The 404 of a job that is not live on its shard: where it went when it
/// left with its key in a move (`moved`: its key and the shard the map
/// routes it to now), else why it may be gone.
fn gone(id: &str, moved: Option<(String, String)>) -> ApiError {
    match moved {
        Some((key, now)) => ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "id: job {} is no longer on its shard: it moved with its key {} to shard {now}, where it runs or ran under a new id (GET /v1/keys/{{key}}/jobs lists the key's jobs there)",
                shown(id),
                shardq_core::job::shown_key(&key)
            ),
        )
        .with("moved", json!({ "key": key, "shard": now })),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "id: no job {} here: it finished or was cancelled longer ago than the retention keeps, moved away with its key longer ago than the shards remember, or never existed",
                shown(id)
            ),
        ),
    }
}

/// `GET /v1/jobs/{id}`: a live job (queued, delayed, running or dead), a
/// finished one while the retention keeps it, or the copy of one that
/// moved with its key (answered under the copy's id).
pub async fn job_show(State(app): State<Arc<App>>, PathParam(id): PathParam) -> ApiResult {
    let v = blocking(move || {
        if let Some(n) = super::dependents::dependent_ref(&id)? {
            return Ok(app.show_dependent(n)?.0);
        }
        let (shard, job) = job_ref(&app, &id)?;
        Ok(find(&app, &shard, job, &id)?.0)
    })
    .await?;
    Ok(Json(v).into_response())
}

/// `GET /v1/jobs/{id}/result` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResultQuery {
    wait_ms: Option<u64>,
}

/// How often a waiting result looks at the store again, for acks made
/// by other processes (this server's own acks wake it at once).
const RESULT_RECHECK_MS: u64 = 250;

/// `GET /v1/jobs/{id}/result?wait_ms=`: the job once it finished
/// (`outcome`, and `result` or `result_b64` when its handler gave one),
/// waiting up to `wait_ms` (at most the long-poll bound) while it is
/// queued, delayed or running; woken by this server's acks, and looking
/// again every 250 ms for other processes'. A job still live at the end
/// of the wait, or dead-lettered, is answered as `GET /v1/jobs/{id}`
/// answers it (a `state`, no `outcome`).
pub async fn job_result(
    State(app): State<Arc<App>>,
    PathParam(id): PathParam,
    QueryParams(q): QueryParams<ResultQuery>,
) -> ApiResult {
    let wait_ms = q.wait_ms.unwrap_or(0);
    if wait_ms > crate::limits::WAIT_MS_MAX {
        return Err(ApiError::bad(format!(
            "wait_ms: {wait_ms} is over the longest long-poll of {} ms",
            crate::limits::WAIT_MS_MAX
        )));
    }
    let dependent = super::dependents::dependent_ref(&id)?;
    let (shard, job) = match dependent {
        Some(_) => (String::new(), JobId(0)),
        None => job_ref(&app, &id)?,
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(wait_ms);
    let mut in_wait = None;
    loop {
        let notified = app.wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let (a, s, i) = (Arc::clone(&app), shard.clone(), id.clone());
        let (v, waiting) = blocking(move || match dependent {
            Some(n) => a.dependent_result(n),
            None => find(&a, &s, job, &i),
        })
        .await?;
        let now = std::time::Instant::now();
        if !waiting || now >= deadline || app.owned.stopping() {
            return Ok(Json(v).into_response());
        }
        in_wait.get_or_insert_with(|| app.load.waiting());
        let nap = (deadline - now).min(std::time::Duration::from_millis(RESULT_RECHECK_MS));
        let _ = tokio::time::timeout(nap, notified).await;
    }
}

/// `GET /v1/keys/{key}/jobs` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyJobsQuery {
    limit: Option<usize>,
    finished: Option<usize>,
}

/// `GET /v1/keys/{key}/jobs?limit=&finished=`: the key's live jobs on the
/// shard it routes to, in key order, the handler's back-off holding it
/// (`back_off`, null for none), and its `finished` jobs (acked or
/// cancelled, within the deployment's retention), newest first.
pub async fn key_jobs(
    State(app): State<Arc<App>>,
    PathParam(key): PathParam,
    QueryParams(q): QueryParams<KeyJobsQuery>,
) -> ApiResult {
    validate_key(&key).map_err(|e| ApiError::bad(format!("key: {e}")))?;
    let limit = q.limit.unwrap_or(KEY_JOBS_DEFAULT);
    if limit == 0 || limit > KEY_JOBS_MAX {
        return Err(ApiError::bad(format!(
            "limit: {limit} is out of range 1..={KEY_JOBS_MAX}"
        )));
    }
    let finished = q.finished.unwrap_or(KEY_FINISHED_DEFAULT);
    if finished > KEY_JOBS_MAX {
        return Err(ApiError::bad(format!(
            "finished: {finished} is out of range 0..={KEY_JOBS_MAX}"
        )));
    }
    let v = blocking(move || {
        let map = app.deployment.map()?;
        let router = MapRouter::new(map).map_err(|e| ApiError::internal(e.to_string()))?;
        let shard = router.route(&key).to_string();
        let jobs: Vec<JobOut> = app
            .backend
            .key_jobs(&shard, &key, limit)?
            .into_iter()
            .map(|j| job_out(&shard, j))
            .collect();
        let hold = app.backend.key_hold(&shard, &key)?;
        // Finished jobs that cannot be read leave the live jobs listed,
        // and say why beside them. From every shard: a finished job stays
        // where it finished, before a move too.
        let shards: Vec<String> = router.map().shards.iter().map(|s| s.name.clone()).collect();
        let (finished, finished_error) = match finished {
            0 => (Vec::new(), None),
            n => {
                let (list, failed) =
                    shardq_core::backend::key_finished(&*app.backend, &shards, &key, n);
                let list: Vec<Value> = list
                    .into_iter()
                    .map(|(s, f)| finished_value(&s, f))
                    .collect();
                let why = (!failed.is_empty()).then(|| {
                    failed
                        .iter()
                        .map(|(s, e)| format!("{s}: {e}"))
                        .collect::<Vec<_>>()
                        .join("; ")
                });
                (list, why)
            }
        };
        let back_off = super::back_off_value(&shard, hold.as_ref());
        // Its dependents still waiting (on no shard yet).
        let waiting: Vec<Value> = app
            .deployment
            .waiting_of_key(&key)?
            .iter()
            .map(|(n, w)| super::dependent_value(*n, w))
            .collect();
        let mut v = json!({ "key": key, "shard": shard, "jobs": jobs, "back_off": back_off, "finished": finished, "waiting": waiting });
        if let Some(e) = finished_error {
            v["finished_error"] = e.into();
        }
        Ok(v)
    })
    .await?;
    ok(v)
}

/// `DELETE /v1/jobs/{id}`: cancels a queued, delayed or dead job, or asks
/// a running one's run to stop (a backend that cannot answers 409).
pub async fn job_cancel(State(app): State<Arc<App>>, PathParam(id): PathParam) -> ApiResult {
    let a = Arc::clone(&app);
    let v = blocking(move || {
        if let Some(n) = super::dependents::dependent_ref(&id)? {
            return a.cancel_dependent(n);
        }
        let (shard, job) = job_ref(&a, &id)?;
        // The job, or its copy when it moved with its key.
        let (at, acted, outcome) = a.deployment.cancel_job(&shard, job)?;
        let answer = |stopping: bool| {
            let mut v = json!({ "id": id, "cancelled": true, "stopping": stopping });
            if (at.as_str(), acted) != (shard.as_str(), job) {
                v["id"] = json!(format!("{at}:{}", acted.0));
                v["moved"] = json!({ "shard": at, "from": id });
            }
            v
        };
        match outcome {
            CancelOutcome::Cancelled => Ok(answer(false)),
            // Its run is asked to stop; the job goes when the run ends.
            CancelOutcome::Stopping => Ok(answer(true)),
            CancelOutcome::Running => Err(ApiError::conflict(format!(
                "id: job {} is running; a running job is not cancelled (its key's one run is never cut short): cancel it after its run ends, or let its handler fail it",
                shown(&id)
            ))
            .with("state", json!("running"))),
            CancelOutcome::Moving => Err(ApiError::conflict(format!(
                "id: the key of job {} is moving to another shard; cancel it once the move is done, by its id there",
                shown(&id)
            ))
            .with("state", json!("moving"))),
            // Where it went is a courtesy: a lookup that fails says no more.
            CancelOutcome::NotFound => Err(gone(
                &id,
                a.deployment.moved_job(&shard, job).unwrap_or(None),
            )),
        }
    })
    .await?;
    // The key's next job may be due now.
    app.work_arrived();
    ok(v)
}
