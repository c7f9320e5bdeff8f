//! Reading: `GET /v1/status`, `/v1/keys/{key}`, `/v1/dead`, and the
//! dead-letter changes (`POST /v1/dead/retry`, `/v1/dead/purge`), which
//! must name what they change (`ids` or `"all": true`).

use super::*;

// ---------------------------------------------------------------------------
// Reading: status, keys, dead letters.
// ---------------------------------------------------------------------------

/// `GET /v1/status`: `Deployment::status()`, serialised.
pub async fn status(State(app): State<Arc<App>>) -> ApiResult {
    // Off the async threads: flow control reads its settings and the
    // groups' run slots from the store.
    // This server's load, with the bounds it is held to.
    let mut server = serde_json::to_value((app.load.source())()).unwrap_or(Value::Null);
    server["requests_max"] = json!(app.limits.concurrency_max);
    server["polls_max"] = json!(app.limits.polls_max);
    server["body_bytes_max"] = json!(app.limits.body_bytes_in_flight_max);
    server["schedule_passes"] = json!(app
        .schedule_passes
        .as_ref()
        .map(|p| p.load(std::sync::atomic::Ordering::SeqCst)));
    let (report, flow, outbox) = blocking(move || {
        let outbox = app.outbox.as_ref().map(|read| match read() {
            Ok(s) => serde_json::to_value(s).unwrap_or(Value::Null),
            Err(why) => json!({ "error": why }),
        });
        Ok((app.deployment.status()?, flow_status(&app), outbox))
    })
    .await?;
    let mut v = serde_json::to_value(report).map_err(|e| ApiError::internal(e.to_string()))?;
    v["flow"] = flow;
    v["server"] = server;
    if let Some(o) = outbox {
        v["outbox"] = o;
    }
    ok(v)
}

/// What this server's flow control holds back now, and its groups with
/// their limits and what this process started and held under them.
fn flow_status(app: &App) -> Value {
    let Some(flow) = app.deployment.flow() else {
        return Value::Null;
    };
    let now = app.clock.now_ms();
    // Settings read again (at most once a second) even while nothing is
    // claimed here, so a changed group shows.
    flow.refresh(now);
    let stats = flow.stats();
    let settings = flow.settings();
    let groups: serde_json::Map<String, Value> = (settings.groups.iter())
        .map(|(name, g)| {
            let held = stats.held_groups.get(name).copied().filter(|&t| t > now);
            // Runs at once are read from the shared store, for the groups
            // that limit them only.
            let running = g.concurrency.map(|_| flow.group_running(name, now));
            (
                name.clone(),
                json!({
                    "rate": g.rate.map(|r| r.to_string()),
                    "per_second": g.rate.map(|r| r.count as f64 * 1000.0 / r.per_ms as f64),
                    "burst": g.rate.map(|_| g.burst_or_default()),
                    "concurrency": g.concurrency,
                    "running": running,
                    "starts": stats.group_starts.get(name).copied().unwrap_or(0),
                    "throttled": stats.group_throttled.get(name).copied().unwrap_or(0),
                    "held_until_ms": held,
                }),
            )
        })
        .collect();
    let held: Vec<Value> = (stats.held_keys.iter())
        .filter(|(_, h)| h.until_ms > now)
        .map(|(k, h)| json!({ "key": k, "until_ms": h.until_ms, "by": h.by.as_ref().map_or_else(|| "its rate".to_string(), |g| format!("group {g}")) }))
        .collect();
    json!({
        "now_ms": now,
        "groups": groups,
        "held_keys": held,
        "key_throttled": stats.key_throttled,
        "errors": stats.errors,
        "last_error": stats.last_error,
    })
}

/// `GET /v1/keys/{key}`: route, override and counts of one key, and the
/// handler's back-off holding it, if one does.
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
        let hold = app.backend.key_hold(&shard, &key)?;
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
            "back_off": super::back_off_value(&shard, hold.as_ref()),
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
    pub(super) fn check_shard(&self, shard: &str, field: &str) -> Result<(), ApiError> {
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
                out.push(super::jobs::dead_value(&d));
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
        let (mut n, mut left, mut keys) = (0usize, 0u64, Vec::new());
        for (shard, ids) in plan {
            n += if retry {
                app.backend.dead_retry(&shard, ids.as_deref())?
            } else {
                app.backend.dead_purge(&shard, ids.as_deref())?
            };
            let (l, k) =
                shardq_core::backend::dead_left_moving(&*app.backend, &shard, ids.as_deref())?;
            left += l;
            keys.extend(k);
        }
        Ok((n, left, keys))
    })
    .await?;
    let (n, left, keys) = n;
    let done = if retry { "retried" } else { "purged" };
    ok(json!({ done: n, "left_moving": left, "moving_keys": keys }))
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
