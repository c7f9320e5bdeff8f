//! Resharding over HTTP: add, remove and reweight shards, pin and unpin
//! keys (each records a target), and a rebalance run on a thread of the
//! server that started it, with its progress.

use super::*;

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
    // A key that is not pinned is already what was asked: ok too.
    blocking(move || Ok(reshard::unpin(&*app.deployment.maps(), &req.key)?)).await?;
    ok(json!({ "ok": true }))
}

/// Progress of the rebalance this server started last (the record every
/// rebalance writes to the map store, kept here too while it starts).
pub type Progress = reshard::RebalanceProgress;

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
    // One run by another process (or server) that still reports: say so
    // (the lock would refuse this one anyway, after the 202).
    let maps = app.deployment.maps();
    let stored = blocking(move || Ok(reshard::stored_progress(&*maps)?))
        .await
        .ok()
        .flatten();
    let now = app.clock.now_ms();
    if let Some(s) = stored.filter(|s| {
        s.is_running()
            && s.updated_ms
                .is_some_and(|t| now.saturating_sub(t) < reshard::DRAIN_TIMEOUT_MS_DEFAULT)
    }) {
        return Err(ApiError::conflict(format!(
            "a rebalance is running, by {} (phase {}, {} of {} keys moved)",
            s.runner, s.phase, s.keys_moved, s.keys_to_move
        )));
    }
    let before = {
        let mut p = progress(&app.rebalance);
        if p.is_running() {
            return Err(ApiError::conflict(format!(
                "a rebalance started by this server is running (phase {}, {} of {} keys moved)",
                p.phase, p.keys_moved, p.keys_to_move
            )));
        }
        std::mem::replace(&mut *p, Progress::started(now, "shardq serve"))
    };
    let a = Arc::clone(&app);
    let spawned = std::thread::Builder::new()
        .name("shardq-serve-rebalance".into())
        .spawn(move || {
            let opts = RebalanceOptions {
                batch,
                runner: format!("shardq serve (pid {})", std::process::id()),
                ..RebalanceOptions::default()
            };
            let backend = a.deployment.backend();
            let maps = a.deployment.maps();
            a.metrics.rebalance_started();
            let result = reshard::rebalance(&*backend, &*maps, &opts, &mut |ev| {
                a.metrics.rebalance_event(&ev);
                progress(&a.rebalance).note(&ev);
            });
            a.metrics
                .rebalance_ended(result.as_ref().map(|r| r.moved.len()).map_err(|_| ()));
            let mut p = progress(&a.rebalance);
            if matches!(result, Err(reshard::ReshardError::Busy { .. })) {
                // Another run held the lock: this one never started, and
                // the other's record is the one to show.
                *p = before;
            } else {
                p.ended(&result, a.clock.now_ms());
            }
        });
    if let Err(e) = spawned {
        let mut p = progress(&app.rebalance);
        p.phase = "failed".into();
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

/// `GET /v1/admin/rebalance`: the progress of the running or last
/// rebalance of the deployment, whoever runs it (this server, `shardq
/// rebalance`, a demo): the record in the map store, or this server's own
/// while its run starts (or when the store cannot be read).
pub async fn rebalance_progress(State(app): State<Arc<App>>) -> ApiResult {
    let own = progress(&app.rebalance).clone();
    let maps = app.deployment.maps();
    let stored = blocking(move || Ok(reshard::stored_progress(&*maps)?))
        .await
        .ok()
        .flatten();
    // A run that reports wins; then this server's own while it starts;
    // then the later of the two.
    let mut p = match stored {
        Some(s) if s.is_running() => s,
        _ if own.is_running() => own,
        Some(s) if s.started_ms >= own.started_ms => s,
        _ => own,
    };
    if p.phase.is_empty() {
        p.phase = "idle".into();
    }
    ok(serde_json::to_value(p).map_err(|e| ApiError::internal(e.to_string()))?)
}
