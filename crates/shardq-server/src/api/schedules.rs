//! Recurring schedules over HTTP (`/v1/schedules`): list and show need
//! `read`; set (one, or many with `PUT /v1/schedules`), delete, pause,
//! resume, trigger and backfill need `admin`.
//! The body of a set is the core's `ScheduleSpec`, read the same way as
//! the CLI's flags; every change is a compare-and-set of the deployment's
//! `schedules` setting (a 200 means stored) and reaches every worker and
//! server within a second.

use super::*;
use shardq_core::producer::ProducerOptions;
use shardq_core::schedule::{
    self, validate_schedule_id, ScheduleFile, ScheduleSpec, ScheduleStore,
};

use super::flow::NoFields;

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no schedule {} (see GET /v1/schedules)", shown(id)),
    )
}

/// Schedule `id`, or a 404.
fn existing(app: &App, id: &str) -> Result<schedule::Schedule, ApiError> {
    validate_schedule_id(id)?;
    ScheduleStore::load(&*app.deployment.maps())?
        .schedules
        .remove(id)
        .ok_or_else(|| not_found(id))
}

fn producer(
    app: &App,
) -> Result<shardq_core::producer::Producer<dyn shardq_core::reshard::ReshardBackend>, ApiError> {
    Ok(app.deployment.producer(ProducerOptions::default())?)
}

/// `GET /v1/schedules`: every schedule with its state and next fire.
pub async fn schedules(State(app): State<Arc<App>>) -> ApiResult {
    let views = blocking(move || Ok(ScheduleStore::views(&*app.deployment.maps())?)).await?;
    ok(json!({ "schedules": views }))
}

/// `GET /v1/schedules/{id}`.
pub async fn schedule_show(State(app): State<Arc<App>>, PathParam(id): PathParam) -> ApiResult {
    let v = blocking(move || {
        existing(&app, &id)?;
        ScheduleStore::views(&*app.deployment.maps())?
            .into_iter()
            .find(|v| v.id == id)
            .ok_or_else(|| not_found(&id))
    })
    .await?;
    ok(serde_json::to_value(v).map_err(|e| ApiError::internal(e.to_string()))?)
}

/// `PUT /v1/schedules/{id}`: creates or replaces a schedule (a replaced
/// one keeps its state and whether it is paused).
pub async fn schedule_put(
    State(app): State<Arc<App>>,
    PathParam(id): PathParam,
    JsonBody(spec): JsonBody<ScheduleSpec>,
) -> ApiResult {
    let v = blocking(move || {
        let s = spec.build(&id)?;
        let now = app.deployment.clock().now_ms();
        let stored = ScheduleStore::put(
            &*app.deployment.maps(),
            &id,
            &s,
            now,
            app.limits.payload_bytes_max,
        )?;
        Ok(json!({ "id": id, "schedule": stored }))
    })
    .await?;
    ok(v)
}

/// The body of `PUT /v1/schedules`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyBody {
    /// The schedules, by id.
    schedules: std::collections::BTreeMap<String, ScheduleSpec>,
    /// Also delete every schedule not named.
    #[serde(default)]
    prune: bool,
    /// Store nothing; answer what would change.
    #[serde(default)]
    dry_run: bool,
}

/// `PUT /v1/schedules`: many schedules in one change (the CLI's `schedule
/// apply`); all stored or none.
pub async fn schedules_apply(
    State(app): State<Arc<App>>,
    JsonBody(body): JsonBody<ApplyBody>,
) -> ApiResult {
    let v = blocking(move || {
        let file = ScheduleFile {
            schedules: body.schedules,
        };
        let wanted = file
            .build()
            .map_err(|e| ApiError::bad(format!("schedules: {e}")))?;
        let now = app.deployment.clock().now_ms();
        let maps = app.deployment.maps();
        let max = app.limits.payload_bytes_max;
        let applied = ScheduleStore::apply(&*maps, &wanted, body.prune, body.dry_run, now, max)?;
        Ok(json!({ "dry_run": body.dry_run, "applied": applied }))
    })
    .await?;
    ok(v)
}

/// `DELETE /v1/schedules/{id}`.
pub async fn schedule_delete(State(app): State<Arc<App>>, PathParam(id): PathParam) -> ApiResult {
    let v = blocking(move || {
        validate_schedule_id(&id)?;
        let deleted = ScheduleStore::delete(&*app.deployment.maps(), &id)?;
        Ok(json!({ "id": id, "deleted": deleted }))
    })
    .await?;
    ok(v)
}

async fn set_paused(app: Arc<App>, id: String, paused: bool) -> ApiResult {
    let v = blocking(move || {
        existing(&app, &id)?;
        let now = app.deployment.clock().now_ms();
        let s = ScheduleStore::set_paused(&*app.deployment.maps(), &id, paused, now)?;
        Ok(json!({ "id": id, "schedule": s }))
    })
    .await?;
    ok(v)
}

/// `POST /v1/schedules/{id}/pause`.
pub async fn schedule_pause(
    State(app): State<Arc<App>>,
    PathParam(id): PathParam,
    JsonBody(_): JsonBody<NoFields>,
) -> ApiResult {
    set_paused(app, id, true).await
}

/// `POST /v1/schedules/{id}/resume`: the ticks of the pause never fire.
pub async fn schedule_resume(
    State(app): State<Arc<App>>,
    PathParam(id): PathParam,
    JsonBody(_): JsonBody<NoFields>,
) -> ApiResult {
    set_paused(app, id, false).await
}

/// `POST /v1/schedules/{id}/trigger`: one job now, outside the ticks.
pub async fn schedule_trigger(
    State(app): State<Arc<App>>,
    PathParam(id): PathParam,
    JsonBody(_): JsonBody<NoFields>,
) -> ApiResult {
    let a = Arc::clone(&app);
    let v = blocking(move || {
        let s = existing(&a, &id)?;
        let now = a.deployment.clock().now_ms();
        let p = schedule::trigger(&mut producer(&a)?, &id, &s, now)?;
        Ok(json!({ "id": id, "shard": p.shard, "job": job_string(&p.shard, p.id) }))
    })
    .await?;
    app.work_arrived();
    ok(v)
}

/// The body of a backfill.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackfillBody {
    /// First time of the range.
    from: schedule::TimeArg,
    /// Last time of the range (inclusive).
    to: schedule::TimeArg,
}

/// `POST /v1/schedules/{id}/backfill`: the job of every tick in a range;
/// ticks whose job is stored already are not stored again.
pub async fn schedule_backfill(
    State(app): State<Arc<App>>,
    PathParam(id): PathParam,
    JsonBody(body): JsonBody<BackfillBody>,
) -> ApiResult {
    let a = Arc::clone(&app);
    let v = blocking(move || {
        let s = existing(&a, &id)?;
        let from = body.from.ms("from")?;
        let to = body.to.ms("to")?;
        if from > to {
            return Err(ApiError::bad(format!(
                "from: {from} ms is after to ({to} ms)"
            )));
        }
        let now = a.deployment.clock().now_ms();
        let placed = schedule::backfill(&mut producer(&a)?, &id, &s, from, to, now)?;
        let stored = placed.iter().filter(|(_, p)| !p.duplicate).count();
        Ok(json!({
            "id": id,
            "ticks": placed.len(),
            "stored": stored,
            "already_stored": placed.len() - stored,
        }))
    })
    .await?;
    app.work_arrived();
    ok(v)
}
