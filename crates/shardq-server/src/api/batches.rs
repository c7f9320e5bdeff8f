//! Batches on the wire: `POST /v1/batches` opens one, `batch` in the jobs
//! of `POST /v1/jobs` adds to it, `POST /v1/batches/{id}/close` closes it
//! and `GET /v1/batches/{id}` shows it (counts, callbacks, each job's
//! outcome and result). Opening, adding and closing need `produce`;
//! showing needs `read`. The semantics are the core's
//! (`shardq_core::workflow`, `batch.rs`).

use super::enqueue::{to_new_job, JobIn};
use super::*;
use shardq_core::workflow::{
    batch_counts, parse_batch_id, CallbackKind, NewBatch, WaitState, Waiting,
};

/// `POST /v1/batches`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenBatchRequest {
    /// The key its callbacks are enqueued on.
    key: String,
    on_complete: Option<String>,
    on_success: Option<String>,
    on_death: Option<String>,
    max_attempts: Option<u32>,
    /// Opening again with it answers the batch already opened.
    dedup_id: Option<String>,
}

fn batch_ref(id: &str) -> Result<u64, ApiError> {
    parse_batch_id(id).map_err(|e| ApiError::bad(format!("id: {e}")))
}

fn unknown(n: u64) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("id: no batch @{n} here: it completed longer ago than batches are kept (a day), or never existed"),
    )
}

/// Batch `n` in the wire form of `GET /v1/batches/{id}` (the OpenAPI
/// document's `Batch`), for every place that prints one.
pub fn batch_value(n: u64, w: &Waiting) -> Value {
    let c = batch_counts(w);
    let (open, callbacks, closed_ms) = match &w.batch {
        Some(b) => {
            let cbs: serde_json::Map<String, Value> = b
                .callbacks
                .iter()
                .map(|(k, p)| {
                    let (payload, payload_b64) = super::dependents::text_or_b64(p);
                    (
                        k.as_str().to_string(),
                        json!({
                            "payload": payload,
                            "payload_b64": payload_b64,
                            "fired": b.fired.get(k),
                            "refused": b.refused.get(k),
                        }),
                    )
                })
                .collect();
            (b.open, Value::Object(cbs), b.closed_ms)
        }
        None => (false, json!({}), None),
    };
    let state = match (w.state, open) {
        (WaitState::Waiting, true) => "open",
        (WaitState::Waiting, false) => "closed",
        _ => "complete",
    };
    json!({
        "id": format!("@{n}"),
        "key": w.key,
        "state": state,
        "counts": c,
        "callbacks": callbacks,
        "jobs": super::dependents::dependency_values(&w.after),
        "max_attempts": w.max_attempts,
        "created_ms": w.created_ms,
        "closed_ms": closed_ms,
        "ended_ms": w.ended_ms,
    })
}

/// `POST /v1/batches`: `{"id": "@N", "duplicate": bool}`.
pub async fn batch_open(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<OpenBatchRequest>,
) -> ApiResult {
    validate_key(&req.key).map_err(|e| ApiError::bad(format!("key: {e}")))?;
    if let Some(d) = &req.dedup_id {
        if d.is_empty() || d.len() > DEDUP_ID_BYTES_MAX || shardq_core::job::has_unshowable(d) {
            return Err(ApiError::bad(format!(
                "dedup_id: invalid dedup id {}: 1..={DEDUP_ID_BYTES_MAX} bytes without control or invisible formatting characters",
                shown(d)
            )));
        }
    }
    if req.on_complete.is_none() && req.on_success.is_none() && req.on_death.is_none() {
        return Err(ApiError::bad(
            "on_complete, on_success, on_death: none given; a batch needs at least one callback",
        ));
    }
    let max_attempts = req
        .max_attempts
        .unwrap_or_else(|| app.retry.for_key(&req.key).max_attempts);
    let callbacks = [
        (CallbackKind::Complete, req.on_complete),
        (CallbackKind::Success, req.on_success),
        (CallbackKind::Death, req.on_death),
    ]
    .into_iter()
    .filter_map(|(k, p)| p.map(|p| (k, p.into_bytes())))
    .collect();
    let new = NewBatch {
        key: req.key,
        max_attempts,
        callbacks,
        dedup_id: req.dedup_id,
    };
    let (n, dup) = blocking(move || Ok(app.deployment.open_batch(&new)?)).await?;
    ok(json!({ "id": format!("@{n}"), "duplicate": dup }))
}

/// `POST /v1/batches/{id}/close`: `{"id", "closed"}` (`closed: false`:
/// it was closed already).
pub async fn batch_close(
    State(app): State<Arc<App>>,
    PathParam(id): PathParam,
    JsonBody(_): JsonBody<super::flow::NoFields>,
) -> ApiResult {
    let n = batch_ref(&id)?;
    let before = blocking(move || {
        // An unknown batch is a 404, as for a read of it.
        app.deployment.batch(n)?.ok_or_else(|| unknown(n))?;
        Ok(app.deployment.close_batch(n)?)
    })
    .await?;
    let was_open = before.batch.as_ref().is_some_and(|b| b.open);
    ok(json!({ "id": format!("@{n}"), "closed": was_open }))
}

/// `GET /v1/batches/{id}`.
pub async fn batch_show(State(app): State<Arc<App>>, PathParam(id): PathParam) -> ApiResult {
    let n = batch_ref(&id)?;
    let w = blocking(move || app.deployment.batch(n)?.ok_or_else(|| unknown(n))).await?;
    ok(batch_value(n, &w))
}

/// A `POST /v1/jobs` whose jobs name a batch: every job joins that one
/// batch in one compare-and-set. Answers each with its id `@M`, `shard`
/// empty (it is enqueued on its key by the next resolver pass),
/// `waiting: true` and `batch`.
pub(super) async fn enqueue_in_batch(app: Arc<App>, jobs_in: Vec<JobIn>) -> ApiResult {
    let first = jobs_in
        .iter()
        .find_map(|j| j.batch.clone())
        .unwrap_or_default();
    let n = batch_ref(&first).map_err(|_| {
        ApiError::bad(format!(
            "jobs[].batch: invalid batch id {}: expected @N, as POST /v1/batches answers",
            shown(&first)
        ))
    })?;
    let mut jobs = Vec::with_capacity(jobs_in.len());
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for (i, mut j) in jobs_in.into_iter().enumerate() {
        match j.batch.take() {
            Some(b) if b == first => {}
            other => {
                return Err(ApiError::bad(format!(
                    "jobs[{i}].batch: {} where jobs of this request join {}; a request adds to one batch, every job naming it",
                    other.as_deref().map(shown).unwrap_or_else(|| "none".into()),
                    shown(&first)
                )))
            }
        }
        if j.after.is_some() || j.on_dependency_failure.is_some() {
            return Err(ApiError::bad(format!(
                "jobs[{i}]: a job of a batch takes no after or on_dependency_failure"
            )));
        }
        if j.unique_id.is_some() || j.debounce_id.is_some() {
            return Err(ApiError::bad(format!(
                "jobs[{i}]: a job of a batch takes no unique_id or debounce_id (a dedup_id makes it safe to send again)"
            )));
        }
        if let Some(id) = &j.dedup_id {
            if let Some(first) = seen.insert((j.key.clone(), id.clone()), i) {
                return Err(ApiError::bad(format!(
                    "jobs[{i}].dedup_id: {} already used by jobs[{first}] of this request, for the same key",
                    shown(id)
                )));
            }
        }
        jobs.push(to_new_job(i, j, app.limits.payload_bytes_max, &app.retry)?);
    }
    let keys: Vec<String> = jobs.iter().map(|j| j.key.clone()).collect();
    let a = Arc::clone(&app);
    let ids = blocking(move || Ok(a.deployment.add_to_batch(n, &jobs)?)).await?;
    app.work_arrived();
    let out: Vec<Value> = ids
        .iter()
        .zip(keys)
        .map(|((m, dup), key)| json!({ "id": format!("@{m}"), "shard": "", "key": key, "duplicate": dup, "waiting": true, "batch": format!("@{n}") }))
        .collect();
    ok_jobs(out)
}
