//! The request handlers and their wire types, one module per kind of
//! request: `enqueue` (with dedup), `claims` (long-poll, the book of runs
//! handed out), `runs` (ack, fail, extend, stale), `reads` (status, keys, dead
//! letters), `jobs` (one job: show, a key's jobs, cancel), `dependents` (jobs
//! that wait for others: `after`, `@N` ids), `flow`
//! (policies and groups), `schedules` (recurring schedules) and `admin` (resharding); health and the OpenAPI document here.
//! Every library call runs on a blocking thread (`spawn_blocking`);
//! handlers validate all input before they store anything, and must never
//! block the async executor or panic on input.

mod admin;
mod batches;
mod claims;
mod dependents;
mod enqueue;
mod flow;
mod jobs;
mod reads;
mod runs;
mod schedules;

pub use admin::*;
pub use batches::{batch_close, batch_open, batch_show, batch_value};
pub use claims::*;
pub use dependents::{dependent_value, parse_after};
pub use enqueue::*;
pub use flow::*;
pub use jobs::*;
pub use reads::*;
pub(crate) use runs::sweep_timeouts;
pub use runs::*;
pub use schedules::*;

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
use shardq_core::reshard::{self, RebalanceOptions};
use shardq_core::{
    validate_job_lease_ms, validate_key, FailOutcome, JobId, NewJob, QueueError, Receipt,
    RetrySettings, JOB_LEASE_MS_DEFAULT,
};
use shardq_route::Router as MapRouter;

use crate::auth::{Principal, ANONYMOUS};
use crate::body::{BoundedVec, JsonBody, PathParam, QueryParams};
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

/// [`ok_jobs`] written once into a buffer of `estimate` bytes: axum's
/// `Json` starts at 128 bytes and grows by `realloc`, copying what it
/// wrote at each step, so the long answers (a claim or an enqueue of
/// hundreds of jobs) are best sized from their jobs first.
fn ok_jobs_sized<T: Serialize>(jobs: T, estimate: usize) -> ApiResult {
    let mut buf = Vec::with_capacity(estimate);
    match serde_json::to_writer(&mut buf, &JobsReply { jobs }) {
        Ok(()) => Ok((
            [(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            )],
            axum::body::Body::from(buf),
        )
            .into_response()),
        Err(e) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("writing the answer: {e}"),
        )),
    }
}

/// Bytes a JSON string of `s` takes beyond its own length, at a guess
/// (its quotes, and some room for escapes), for [`ok_jobs_sized`].
fn json_str_estimate(s: &str) -> usize {
    s.len() + s.len() / 16 + 2
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
            "lease_error": app.owned.last_error().map(|e| shardq_core::secret::redacted(&e)),
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
