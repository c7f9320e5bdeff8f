//! Flow control over HTTP: the deployment's policies (`/v1/policies`,
//! `/v1/policies/{key}`, with `?scope=prefix` or `?scope=default`) and
//! groups (`/v1/groups`, `/v1/groups/{name}`), and lifting a handler's
//! back-off of a group or a key (`/v1/groups/{name}/resume`,
//! `/v1/keys/{key}/resume`). Reads need `read`, changes
//! `admin`; every settings change goes through core's checked edits, is a
//! compare-and-set of the stored settings (`Deployment::update_flow_settings`:
//! a 200 means stored, whatever other writers did meanwhile), and reaches
//! every worker and server within a second.

use super::*;
use shardq_core::{FlowPolicy, FlowSettings, GroupLimit, PolicySource, PolicyTarget};

/// A body with nothing in it (`{}`, or none).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoFields {}

/// `?scope=` of the policy routes.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scope {
    /// `key` (the default), `prefix` or `default`.
    scope: Option<String>,
}

fn target(path: String, scope: &Scope) -> Result<PolicyTarget, ApiError> {
    let t = match scope.scope.as_deref().unwrap_or("key") {
        "key" => PolicyTarget::Key(path),
        "prefix" => PolicyTarget::Prefix(path),
        "default" => PolicyTarget::Default,
        other => {
            return Err(ApiError::bad(format!(
                "scope: {} is not one of key, prefix, default",
                shown(other)
            )))
        }
    };
    t.validate()?;
    Ok(t)
}

/// A policy with every field spelt out (`FlowPolicy` in the document).
fn policy_value(p: &FlowPolicy) -> Value {
    json!({
        "concurrency": p.concurrency,
        "rate": p.rate.map(|r| r.to_string()),
        "burst": p.burst_or_default(),
        "weight": p.weight,
        "priority": p.priority,
        "group": p.group,
    })
}

fn group_value(g: &GroupLimit) -> Value {
    json!({
        "rate": g.rate.map(|r| r.to_string()),
        "burst": g.rate.map(|_| g.burst_or_default()),
        "concurrency": g.concurrency,
    })
}

fn settings_value(s: &FlowSettings) -> Value {
    let all = |m: &BTreeMap<String, FlowPolicy>| -> serde_json::Map<String, Value> {
        m.iter()
            .map(|(k, p)| (k.clone(), policy_value(p)))
            .collect()
    };
    let groups: serde_json::Map<String, Value> = (s.groups.iter())
        .map(|(n, g)| (n.clone(), group_value(g)))
        .collect();
    json!({
        "default": policy_value(&s.default),
        "prefixes": all(&s.prefixes),
        "keys": all(&s.keys),
        "groups": groups,
    })
}

/// `GET /v1/policies`: every policy and group.
pub async fn policies(State(app): State<Arc<App>>) -> ApiResult {
    let s = blocking(move || Ok(app.deployment.flow_settings()?)).await?;
    ok(settings_value(&s))
}

/// `GET /v1/policies/{key}`: the policy the key gets and where it comes
/// from (with `?scope=prefix|default`, that policy itself).
pub async fn policy_show(
    State(app): State<Arc<App>>,
    PathParam(key): PathParam,
    QueryParams(scope): QueryParams<Scope>,
) -> ApiResult {
    let t = target(key.clone(), &scope)?;
    let s = blocking(move || Ok(app.deployment.flow_settings()?)).await?;
    let (p, from, prefix) = match &t {
        PolicyTarget::Key(k) => match s.source_of(k) {
            PolicySource::Key => (s.for_key(k), "key", None),
            PolicySource::Prefix(p) => (s.for_key(k), "prefix", Some(p)),
            PolicySource::Default => (s.for_key(k), "default", None),
        },
        PolicyTarget::Prefix(p) => match s.prefixes.get(p) {
            Some(pol) => (pol, "prefix", Some(p.clone())),
            None => {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!("no policy for prefix {}", shown(p)),
                ))
            }
        },
        PolicyTarget::Default => (&s.default, "default", None),
    };
    ok(json!({ "key": key, "policy": policy_value(p), "from": from, "prefix": prefix }))
}

/// `PUT /v1/policies/{key}`: sets the key's (prefix's, default's) whole
/// policy; fields left out take their defaults.
pub async fn policy_put(
    State(app): State<Arc<App>>,
    PathParam(key): PathParam,
    QueryParams(scope): QueryParams<Scope>,
    JsonBody(p): JsonBody<FlowPolicy>,
) -> ApiResult {
    let t = target(key, &scope)?;
    let v = blocking(move || {
        app.deployment
            .update_flow_settings(|s| s.put_policy(&t, p.clone()).map_err(ApiError::from))?;
        Ok(json!({ "target": t.to_string(), "policy": policy_value(&p) }))
    })
    .await?;
    ok(v)
}

/// `DELETE /v1/policies/{key}`: removes the policy (the default goes back
/// to no limits).
pub async fn policy_delete(
    State(app): State<Arc<App>>,
    PathParam(key): PathParam,
    QueryParams(scope): QueryParams<Scope>,
) -> ApiResult {
    let t = target(key, &scope)?;
    let removed = blocking(move || {
        app.deployment
            .update_flow_settings(|s| Ok::<_, ApiError>(s.remove_policy(&t)))
    })
    .await?;
    ok(json!({ "removed": removed }))
}

/// `GET /v1/groups`: every group.
pub async fn groups(State(app): State<Arc<App>>) -> ApiResult {
    let s = blocking(move || Ok(app.deployment.flow_settings()?)).await?;
    ok(settings_value(&s)["groups"].clone())
}

/// `GET /v1/groups/{name}`.
pub async fn group_show(State(app): State<Arc<App>>, PathParam(name): PathParam) -> ApiResult {
    shardq_core::flow::validate_group_name(&name)?;
    let s = blocking(move || Ok(app.deployment.flow_settings()?)).await?;
    match s.groups.get(&name) {
        Some(g) => ok(group_value(g)),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no group {}", shown(&name)),
        )),
    }
}

/// `PUT /v1/groups/{name}`: creates or changes a group.
pub async fn group_put(
    State(app): State<Arc<App>>,
    PathParam(name): PathParam,
    JsonBody(g): JsonBody<GroupLimit>,
) -> ApiResult {
    shardq_core::flow::validate_group_name(&name)?;
    let v = blocking(move || {
        app.deployment
            .update_flow_settings(|s| s.put_group(&name, g.clone()).map_err(ApiError::from))?;
        Ok(json!({ "name": name, "group": group_value(&g) }))
    })
    .await?;
    ok(v)
}

/// `DELETE /v1/groups/{name}`: refused (400) while a policy names it.
pub async fn group_delete(State(app): State<Arc<App>>, PathParam(name): PathParam) -> ApiResult {
    shardq_core::flow::validate_group_name(&name)?;
    let removed = blocking(move || Ok(app.deployment.remove_group(&name)?)).await?;
    ok(json!({ "removed": removed }))
}

/// `POST /v1/groups/{name}/resume`: lifts the hold a handler's group
/// back-off put on the group; its keys start again at once.
pub async fn group_resume(
    State(app): State<Arc<App>>,
    PathParam(name): PathParam,
    JsonBody(_): JsonBody<NoFields>,
) -> ApiResult {
    shardq_core::flow::validate_group_name(&name)?;
    let n = name.clone();
    blocking(move || Ok(app.deployment.resume_group(&n)?)).await?;
    ok(json!({ "name": name, "resumed": true }))
}

/// A key's back-off in the wire form of `back_off` (`GET /v1/keys/{key}`,
/// `GET /v1/keys/{key}/jobs`, `POST /v1/keys/{key}/resume`, and the CLI's
/// `--json`): `{"until_ms", "jobs": [SHARD:ID...]}`, or null for none.
pub fn back_off_value(shard: &str, hold: Option<&shardq_core::KeyHold>) -> Value {
    match hold {
        None => Value::Null,
        Some(h) => json!({
            "until_ms": h.until_ms,
            "jobs": h.jobs.iter().map(|id| job_string(shard, *id)).collect::<Vec<_>>(),
        }),
    }
}

/// `POST /v1/keys/{key}/resume`: lifts the handler's back-off holding the
/// key on the shard it routes to; its backed-off jobs are due now. A key
/// no back-off holds answers `"resumed": false` and changes nothing (a
/// producer's delay or a retry's wait is not lifted); a key moving to
/// another shard is a 409 with `"state": "moving"`.
pub async fn key_resume(
    State(app): State<Arc<App>>,
    PathParam(key): PathParam,
    JsonBody(_): JsonBody<NoFields>,
) -> ApiResult {
    validate_key(&key).map_err(|e| ApiError::bad(format!("key: {e}")))?;
    let a = Arc::clone(&app);
    let k = key.clone();
    let (shard, done) = blocking(move || Ok(a.deployment.resume_key(&k)?)).await?;
    let lifted = match done {
        shardq_core::KeyResume::Resumed(hold) => Some(hold),
        shardq_core::KeyResume::NotHeld => None,
        shardq_core::KeyResume::Moving => {
            return Err(ApiError::conflict(format!(
                "key: {} is moving to another shard now; nothing changed (the move carries its jobs with their waits, which its new shard keeps as plain delays)",
                shown(&key)
            ))
            .with("state", json!("moving"))
            .with("shard", json!(shard)))
        }
    };
    if lifted.is_some() {
        // The key's next job is due now.
        app.work_arrived();
    }
    ok(json!({
        "key": key,
        "shard": shard,
        "resumed": lifted.is_some(),
        "back_off": back_off_value(&shard, lifted.as_ref()),
    }))
}
