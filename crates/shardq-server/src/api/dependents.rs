//! Dependents on the wire: the `after` field of `POST /v1/jobs` (ids, and
//! indexes of the same request: a graph stored in one compare-and-set),
//! and `@N` ids in `GET /v1/jobs/{id}`, its result wait and `DELETE`.
//! The semantics are the core's (`shardq_core::workflow`).

use super::*;
use shardq_core::workflow::{
    parse_dependency, DepRef, NewDependent, OnDependencyFailure, WaitState, Waiting,
};

/// A dependent's id (`@N`) in a path, if `id` is one.
pub fn dependent_ref(id: &str) -> Result<Option<u64>, ApiError> {
    match id.strip_prefix('@') {
        None => Ok(None),
        Some(n) => n.parse().map(Some).map_err(|_| {
            ApiError::bad(format!(
                "id: invalid dependent id {}: expected @N, e.g. \"@17\"",
                shown(id)
            ))
        }),
    }
}

/// The dependencies in a job's `after`: ids (`SHARD:ID`, `@N`) and
/// indexes of jobs earlier or later in the same request.
pub fn parse_after(i: usize, after: &[Value], jobs: usize) -> Result<Vec<DepRef>, ApiError> {
    let deps: Vec<DepRef> = after
        .iter()
        .enumerate()
        .map(|(k, v)| {
            let field = format!("jobs[{i}].after[{k}]");
            match v {
                Value::String(s) => {
                    parse_dependency(s).map_err(|e| ApiError::bad(format!("{field}: {e}")))
                }
                Value::Number(n) => match n.as_u64().filter(|n| (*n as usize) < jobs) {
                    Some(n) if n as usize == i => Err(ApiError::bad(format!(
                        "{field}: {n} is this job's own index; a job cannot wait for itself"
                    ))),
                    Some(n) => Ok(DepRef::Node(n as usize)),
                    None => Err(ApiError::bad(format!(
                        "{field}: {n} is not an index of this request's jobs (0 to {})",
                        jobs - 1
                    ))),
                },
                other => Err(ApiError::bad(format!(
                    "{field}: {other} is neither a job id (\"SHARD:ID\", \"@N\") nor an index of this request's jobs"
                ))),
            }
        })
        .collect::<Result<_, _>>()?;
    let mut seen = std::collections::BTreeMap::new();
    for (k, d) in deps.iter().enumerate() {
        if let Some(first) = seen.insert(d, k) {
            return Err(ApiError::bad(format!(
                "jobs[{i}].after[{k}]: {} is already after[{first}]; name each dependency once",
                after[k]
            )));
        }
    }
    if deps.len() > shardq_core::workflow::DEPENDENCIES_MAX {
        return Err(ApiError::bad(format!(
            "jobs[{i}].after: {} dependencies, over the limit of {}",
            deps.len(),
            shardq_core::workflow::DEPENDENCIES_MAX
        )));
    }
    Ok(deps)
}

/// The `on_dependency_failure` field.
pub fn parse_on_failure(i: usize, v: Option<&str>) -> Result<OnDependencyFailure, ApiError> {
    match v {
        None => Ok(OnDependencyFailure::default()),
        Some(s) => OnDependencyFailure::parse(s)
            .map_err(|e| ApiError::bad(format!("jobs[{i}].on_dependency_failure: {e}"))),
    }
}

/// Text or base64 of stored base64 bytes, as `result`/`result_b64`.
pub(super) fn text_or_b64(b64: &str) -> (Option<String>, Option<String>) {
    match base64::engine::general_purpose::STANDARD.decode(b64) {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(t) => (Some(t), None),
            Err(_) => (None, Some(b64.to_string())),
        },
        Err(_) => (None, Some(b64.to_string())),
    }
}

/// Dependencies (or a batch's jobs) in their wire form: id, outcome,
/// where it ended, result (text or base64), reason.
pub(super) fn dependency_values(after: &[shardq_core::workflow::Dependency]) -> Vec<Value> {
    after
        .iter()
        .map(|d| {
            let mut v = json!({ "id": d.id, "outcome": d.outcome.map(|o| o.as_str()) });
            if let Some(at) = &d.at {
                v["at"] = json!(at);
            }
            if let Some(r) = &d.result_b64 {
                let (text, b64) = text_or_b64(r);
                if let Some(t) = text {
                    v["result"] = json!(t);
                }
                if let Some(b) = b64 {
                    v["result_b64"] = json!(b);
                }
            }
            if d.result_dropped {
                v["result_dropped"] = json!(true);
            }
            if let Some(r) = &d.reason {
                v["reason"] = json!(r);
            }
            v
        })
        .collect()
}

/// Dependent `n` in the wire form of `GET /v1/jobs/@N` (the OpenAPI
/// document's `Dependent`), for every place that prints one.
pub fn dependent_value(n: u64, w: &Waiting) -> Value {
    let after = dependency_values(&w.after);
    let (payload, payload_b64) = text_or_b64(&w.payload_b64);
    let state = match w.state {
        WaitState::Waiting => "waiting",
        WaitState::Released => "released",
        WaitState::Failed => "failed",
        WaitState::Cancelled => "cancelled",
    };
    json!({
        "id": format!("@{n}"),
        "key": w.key,
        "state": state,
        "on_dependency_failure": w.on_failure,
        "after": after,
        "created_ms": w.created_ms,
        "released": w.released,
        "reason": w.reason,
        "ended_ms": w.ended_ms,
        "max_attempts": w.max_attempts,
        "delay_ms": w.delay_ms,
        "payload": payload,
        "payload_b64": payload_b64,
    })
}

/// The 404 of an unknown dependent.
fn unknown(n: u64) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("id: no dependent @{n} here: it ended longer ago than dependents are kept (a day), or never existed"),
    )
}

impl App {
    /// Adds the dependents of a request in one compare-and-set: the ids
    /// answered, in order.
    pub(crate) fn add_dependents_blocking(
        &self,
        deps: Vec<NewDependent>,
    ) -> Result<Vec<(u64, bool)>, ApiError> {
        Ok(self.deployment.add_dependents(&deps)?)
    }

    /// `GET /v1/jobs/@N`: the dependent, and once released its job as
    /// `GET /v1/jobs/{id}` shows it (`job`; absent when not found); with
    /// whether it may still change.
    pub(crate) fn show_dependent(&self, n: u64) -> Result<(Value, bool), ApiError> {
        let w = self.deployment.dependent(n)?.ok_or_else(|| unknown(n))?;
        if w.batch.is_some() {
            // A batch's id: the batch, as `GET /v1/batches/@N` shows it.
            let open = w.state == WaitState::Waiting;
            return Ok((super::batches::batch_value(n, &w), open));
        }
        let mut v = dependent_value(n, &w);
        let mut open = w.state == WaitState::Waiting;
        if let Some(Ok(DepRef::Job(s, id))) = w.released.as_deref().map(parse_dependency) {
            if let Ok((job, live)) = super::jobs::find_in(self, &s, id, &format!("{s}:{}", id.0)) {
                v["job"] = job;
                open = live;
            }
        }
        Ok((v, open))
    }

    /// `GET /v1/jobs/@N/result`: the released job's answer (with
    /// `dependent`), a failed or cancelled dependent as a dead job (its
    /// `reason` names the dependency), or `state: "waiting"`.
    pub(crate) fn dependent_result(&self, n: u64) -> Result<(Value, bool), ApiError> {
        let (v, open) = self.show_dependent(n)?;
        let id = format!("@{n}");
        if v.get("counts").is_some() {
            return Err(ApiError::bad(format!(
                "id: {id} is a batch, which has no result of its own: GET /v1/batches/{id} lists its jobs' results"
            )));
        }
        Ok(match v["state"].as_str() {
            Some("released") => match v.get("job") {
                Some(job) => {
                    let mut job = job.clone();
                    job["dependent"] = json!(id);
                    (job, open)
                }
                None => (
                    json!({ "id": id, "state": "released", "dependent": id }),
                    true,
                ),
            },
            Some("waiting") => (json!({ "id": id, "state": "waiting" }), true),
            _ => (
                json!({ "id": id, "state": "dead", "dependent_state": v["state"], "reason": v["reason"] }),
                false,
            ),
        })
    }

    /// `DELETE /v1/jobs/@N`.
    pub(crate) fn cancel_dependent(&self, n: u64) -> Result<Value, ApiError> {
        let (before, job) = self.deployment.cancel_dependent(n)?;
        let w = before.ok_or_else(|| unknown(n))?;
        let id = format!("@{n}");
        match (w.state, job) {
            (WaitState::Waiting, _) => Ok(json!({ "id": id, "cancelled": true, "stopping": false })),
            (WaitState::Released, Some((at, acted, outcome))) => match outcome {
                shardq_core::CancelOutcome::Cancelled | shardq_core::CancelOutcome::Stopping => Ok(json!({
                    "id": id,
                    "cancelled": true,
                    "stopping": outcome == shardq_core::CancelOutcome::Stopping,
                    "job": job_string(&at, acted),
                })),
                shardq_core::CancelOutcome::Running => Err(ApiError::conflict(format!(
                    "id: dependent {id} was released as job {} and is running; a running job is not cancelled",
                    job_string(&at, acted)
                ))
                .with("state", json!("running"))),
                shardq_core::CancelOutcome::Moving => Err(ApiError::conflict(format!(
                    "id: dependent {id} was released as job {}, whose key is moving; cancel it once the move is done",
                    job_string(&at, acted)
                ))
                .with("state", json!("moving"))),
                shardq_core::CancelOutcome::NotFound => Err(ApiError::conflict(format!(
                    "id: dependent {id} was released as job {}, which has finished",
                    job_string(&at, acted)
                ))
                .with("state", json!("finished"))),
            },
            (state, _) => Err(ApiError::conflict(format!(
                "id: dependent {id} has ended ({}) and is not cancelled again",
                match state {
                    WaitState::Failed => "failed",
                    WaitState::Cancelled => "cancelled",
                    _ => "released",
                }
            ))
            .with("state", json!(match state {
                WaitState::Failed => "failed",
                WaitState::Cancelled => "cancelled",
                _ => "released",
            }))),
        }
    }
}
