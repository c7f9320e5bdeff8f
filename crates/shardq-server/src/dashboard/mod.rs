//! The dashboard: a page served at `/` (HTML, CSS and JS embedded in the
//! binary, no network at run time) that polls the JSON API, and the five
//! read endpoints it adds:
//!
//! * `GET /v1/ring`: each shard's share of the key space under the published
//!   map and the arcs of the circle the page draws ([`shares`]).
//! * `GET /v1/hot?top=N`: per shard, the keys with the most work
//!   (`KeyInventory::keys_with_work`, top `N` of at most [`HOT_TOP_MAX`]).
//! * `GET /v1/reshard`: a rebalance as the stores show it, whoever runs it
//!   (this server, another, the CLI, the demo): the pending target, the keys
//!   still pinned to their old shard and the keys already switched (the
//!   temporary overrides of the published map), and the keys paused now on
//!   each shard with how long this server has seen them paused.
//! * `GET /v1/keys?prefix=P`: the keys with work starting with `P`, on every
//!   shard, with their counts (at most [`KEY_SEARCH_MAX`]).
//! * `GET /v1/history?seconds=N`: this server's own counts per second for
//!   the last `N` seconds (at most an hour): jobs enqueued, runs claimed,
//!   acked and failed, the claimed jobs' mean and longest wait from due to
//!   start, and the counts' totals since it started
//!   (`shardq_metrics::History`). Read from memory, not cached.
//!
//! Every answer but the history is cached for [`CACHE_MS`] (the ring per map version), and
//! one computation runs at a time per endpoint, so however many pages poll,
//! the queue sees at most one scan per second from them. This module holds
//! no queue logic and must never change what it reads.
//!
//! [`spawn_viewer`] serves the whole API over a data dir without taking
//! shard leases (claims hand out nothing): `shardq demo --serve` uses it to
//! watch a deployment whose shards another worker pool runs.

pub mod shares;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use shardq_deploy::Deployment;
use shardq_route::Router as MapRouter;

use crate::body::QueryParams;
use crate::error::{join_error, ApiError};
use crate::owner::Owned;
use crate::{App, Running, ServerError, ServerOptions};

/// How long an answer of the dashboard's endpoints is reused, in ms.
pub const CACHE_MS: u64 = 1_000;
/// Largest `top` of `GET /v1/hot`.
pub const HOT_TOP_MAX: usize = 100;
/// Default `top` of `GET /v1/hot`.
pub const HOT_TOP_DEFAULT: usize = 10;
/// Paused keys listed by `GET /v1/reshard` (all are counted).
pub const PAUSED_LIST_MAX: usize = 50;
/// Pinned and switched keys listed by `GET /v1/reshard` (all are counted).
pub const MOVING_LIST_MAX: usize = 20;

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const STYLE_CSS: &str = include_str!("assets/style.css");

type ApiResult = Result<Response, ApiError>;

/// A cached answer.
#[derive(Default)]
struct Cached {
    at: Option<Instant>,
    /// What the answer depends on besides time (`top`, a map version).
    tag: u64,
    value: Value,
}

impl Cached {
    fn fresh(&self, tag: u64, ttl: Option<Duration>) -> Option<Value> {
        let at = self.at?;
        if self.tag != tag || ttl.is_some_and(|ttl| at.elapsed() >= ttl) {
            return None;
        }
        Some(self.value.clone())
    }

    fn store(&mut self, tag: u64, value: Value) -> Value {
        self.at = Some(Instant::now());
        self.tag = tag;
        self.value = value.clone();
        value
    }
}

/// The dashboard's state on one server: caches, and when each paused key
/// was first seen paused.
#[derive(Default)]
pub struct Dash {
    ring: Mutex<Cached>,
    hot: Mutex<Cached>,
    reshard: Mutex<Cached>,
    paused_since: Mutex<HashMap<(String, String), u64>>,
}

impl Dash {
    /// A fresh state, shared by the dashboard's routes of one router.
    pub fn new() -> Arc<Dash> {
        Arc::new(Dash::default())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn ttl() -> Option<Duration> {
    Some(Duration::from_millis(CACHE_MS))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(join_error)?
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// `GET /`: the page.
pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

/// `GET /dashboard/app.js`.
pub async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

/// `GET /dashboard/style.css`.
pub async fn style_css() -> Response {
    asset("text/css; charset=utf-8", STYLE_CSS)
}

/// `GET /v1/ring`: shares and arcs of the published map, computed once per
/// map version (and at most once a second, to notice a new version).
pub async fn ring(State(app): State<Arc<App>>, Extension(dash): Extension<Arc<Dash>>) -> ApiResult {
    let v = blocking(move || {
        let mut cache = lock(&dash.ring);
        // Within a second, reuse whatever was computed; later, only the
        // map is read again, and the shares recomputed if it changed.
        if let Some(v) = cache.fresh(cache.tag, ttl()) {
            return Ok(v);
        }
        let map = app.deployment.map()?;
        if let Some(v) = cache.fresh(map.version, None) {
            cache.at = Some(Instant::now());
            return Ok(v);
        }
        let s = shares::compute(&map).map_err(ApiError::internal)?;
        let v = serde_json::to_value(s).map_err(|e| ApiError::internal(e.to_string()))?;
        Ok(cache.store(map.version, v))
    })
    .await?;
    Ok(Json(v).into_response())
}

/// `GET /v1/history` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryQuery {
    seconds: Option<usize>,
}

/// Seconds `GET /v1/history` gives when not told: the last hour.
pub const HISTORY_SECONDS_DEFAULT: usize = shardq_metrics::HISTORY_SECONDS;

/// `GET /v1/history?seconds=N`: see the module docs.
pub async fn history(
    State(app): State<Arc<App>>,
    QueryParams(q): QueryParams<HistoryQuery>,
) -> ApiResult {
    let seconds = q.seconds.unwrap_or(HISTORY_SECONDS_DEFAULT);
    if seconds == 0 || seconds > shardq_metrics::HISTORY_SECONDS {
        return Err(ApiError::bad(format!(
            "seconds: {seconds} is out of range 1..={}",
            shardq_metrics::HISTORY_SECONDS
        )));
    }
    let w = app
        .metrics
        .history()
        .window(seconds, shardq_metrics::now_s());
    Ok(Json(json!({
        "until_s": w.until_s,
        "step_s": 1,
        "enqueued": w.enqueued,
        "claimed": w.claimed,
        "acked": w.acked,
        "failed": w.failed,
        "wait_mean_ms": w.wait_mean_ms,
        "wait_max_ms": w.wait_max_ms,
        "totals": {
            "enqueued": w.totals[0],
            "claimed": w.totals[1],
            "acked": w.totals[2],
            "failed": w.totals[3],
        },
    }))
    .into_response())
}

/// Most keys `GET /v1/keys?prefix=` lists.
pub const KEY_SEARCH_MAX: usize = 100;

/// `GET /v1/keys` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySearchQuery {
    prefix: String,
    limit: Option<usize>,
}

/// `GET /v1/keys?prefix=P&limit=N`: the keys with work (queued, delayed,
/// in flight or dead) that start with `P`, on every shard, in key order,
/// with their counts; at most `N` ([`KEY_SEARCH_MAX`]). Walks each shard's
/// keys with work, as `/v1/hot` does.
pub async fn key_search(
    State(app): State<Arc<App>>,
    QueryParams(q): QueryParams<KeySearchQuery>,
) -> ApiResult {
    let limit = q.limit.unwrap_or(KEY_SEARCH_MAX);
    if limit == 0 || limit > KEY_SEARCH_MAX {
        return Err(ApiError::bad(format!(
            "limit: {limit} is out of range 1..={KEY_SEARCH_MAX}"
        )));
    }
    if q.prefix.len() > shardq_core::KEY_BYTES_MAX {
        return Err(ApiError::bad(format!(
            "prefix: {} bytes, longer than a key may be ({})",
            q.prefix.len(),
            shardq_core::KEY_BYTES_MAX
        )));
    }
    let v = blocking(move || {
        let mut found: Vec<Value> = Vec::new();
        let mut failed: Vec<Value> = Vec::new();
        let mut more = false;
        for shard in app.deployment.shard_names()? {
            match app.backend.keys_with_work(&shard) {
                Ok(keys) => {
                    for (k, c) in keys.into_iter().filter(|(k, _)| k.starts_with(&q.prefix)) {
                        found.push(json!({"key": k, "shard": shard, "depth": c.depth, "in_flight": c.in_flight, "dead": c.dead}));
                    }
                }
                Err(e) => failed.push(json!({"shard": shard, "error": e.to_string()})),
            }
        }
        found.sort_by(|a, b| a["key"].as_str().cmp(&b["key"].as_str()));
        if found.len() > limit {
            found.truncate(limit);
            more = true;
        }
        Ok(json!({ "prefix": q.prefix, "keys": found, "more": more, "failed": failed }))
    })
    .await?;
    Ok(Json(v).into_response())
}

/// `GET /v1/hot` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotQuery {
    top: Option<usize>,
}

/// `GET /v1/hot?top=N`: per shard, the `N` keys with the most queued and
/// in-flight jobs, and how many keys have work.
pub async fn hot(
    State(app): State<Arc<App>>,
    Extension(dash): Extension<Arc<Dash>>,
    QueryParams(q): QueryParams<HotQuery>,
) -> ApiResult {
    let top = q.top.unwrap_or(HOT_TOP_DEFAULT);
    if top == 0 || top > HOT_TOP_MAX {
        return Err(ApiError::bad(format!(
            "top: {top} is out of range 1..={HOT_TOP_MAX}"
        )));
    }
    let v = blocking(move || {
        let mut cache = lock(&dash.hot);
        if let Some(v) = cache.fresh(top as u64, ttl()) {
            return Ok(v);
        }
        let mut out = Vec::new();
        for shard in app.deployment.shard_names()? {
            match app.backend.keys_with_work(&shard) {
                Ok(mut keys) => {
                    let n = keys.len();
                    let weight = |c: &shardq_core::KeyCounts| c.depth + c.in_flight;
                    if n > top {
                        keys.select_nth_unstable_by(top - 1, |a, b| {
                            weight(&b.1).cmp(&weight(&a.1)).then_with(|| a.0.cmp(&b.0))
                        });
                        keys.truncate(top);
                    }
                    keys.sort_by(|a, b| weight(&b.1).cmp(&weight(&a.1)).then_with(|| a.0.cmp(&b.0)));
                    let rows: Vec<Value> = keys
                        .into_iter()
                        .map(|(k, c)| {
                            json!({"key": k, "depth": c.depth, "in_flight": c.in_flight, "dead": c.dead})
                        })
                        .collect();
                    out.push(json!({"shard": shard, "keys_with_work": n, "top": rows, "error": null}));
                }
                Err(e) => out.push(json!({"shard": shard, "keys_with_work": null, "top": [], "error": e.to_string()})),
            }
        }
        Ok(cache.store(top as u64, json!({ "top": top, "shards": out })))
    })
    .await?;
    Ok(Json(v).into_response())
}

/// `GET /v1/reshard`: the rebalance as the stores show it.
pub async fn reshard(
    State(app): State<Arc<App>>,
    Extension(dash): Extension<Arc<Dash>>,
) -> ApiResult {
    let v = blocking(move || {
        let mut cache = lock(&dash.reshard);
        if let Some(v) = cache.fresh(0, ttl()) {
            return Ok(v);
        }
        let now = app.clock.now_ms();
        let published = app.deployment.map()?;
        let target = app.deployment.maps().load_target()?;
        let mut pinned: Vec<(String, String)> = Vec::new();
        let mut switched: Vec<(String, String)> = Vec::new();
        if let Some(t) = &target {
            let router = MapRouter::new(t.clone()).map_err(|e| {
                ApiError::internal(format!("compiling the target map v{}: {e}", t.version))
            })?;
            for (key, shard) in &published.overrides {
                if t.overrides.get(key) == Some(shard) {
                    continue; // the operator's pin
                }
                if router.route(key) == shard {
                    switched.push((key.clone(), shard.clone()));
                } else {
                    pinned.push((key.clone(), shard.clone()));
                }
            }
        }
        let mut paused: Vec<Value> = Vec::new();
        let mut paused_total = 0usize;
        let mut errors: BTreeMap<String, String> = BTreeMap::new();
        let mut seen: HashMap<(String, String), u64> = HashMap::new();
        {
            let since = lock(&dash.paused_since);
            for s in &published.shards {
                match app.backend.fence(&s.name) {
                    Ok(f) => {
                        // A frozen key (sealed too) is not waited for:
                        // its enqueues go on to its new shard.
                        let frozen: Vec<String> = f
                            .paused_keys
                            .iter()
                            .filter(|k| f.is_frozen(k))
                            .cloned()
                            .collect();
                        for key in f.paused_keys {
                            if frozen.contains(&key) {
                                continue;
                            }
                            let k = (s.name.clone(), key);
                            let first = since.get(&k).copied().unwrap_or(now);
                            paused_total += 1;
                            if paused.len() < PAUSED_LIST_MAX {
                                paused.push(json!({
                                    "shard": k.0, "key": k.1, "since_ms": first,
                                    "paused_ms": now.saturating_sub(first),
                                }));
                            }
                            seen.insert(k, first);
                        }
                    }
                    Err(e) => {
                        errors.insert(s.name.clone(), e.to_string());
                    }
                }
            }
        }
        *lock(&dash.paused_since) = seen;
        let phase = match (&target, pinned.len() + switched.len()) {
            (None, _) => "idle",
            (Some(_), 0) => "pending",
            (Some(_), _) => "moving",
        };
        let list = |v: &[(String, String)]| -> Vec<Value> {
            v.iter()
                .take(MOVING_LIST_MAX)
                .map(|(k, s)| json!({"key": k, "shard": s}))
                .collect()
        };
        let v = json!({
            "phase": phase,
            "published_version": published.version,
            "target_version": target.as_ref().map(|t| t.version),
            "target_shards": target.as_ref().map(|t| t.shards.iter().map(|s| json!({
                "name": s.name, "weight": s.weight, "state": s.state.name(),
            })).collect::<Vec<_>>()),
            "keys_pinned": pinned.len(),
            "keys_switched": switched.len(),
            "pinned": list(&pinned),
            "switched": list(&switched),
            "paused_total": paused_total,
            "paused": paused,
            "errors": errors,
            "now_ms": now,
        });
        Ok(cache.store(0, v))
    })
    .await?;
    Ok(Json(v).into_response())
}

/// Serves the whole API over data dir `dir` on a thread of its own without
/// taking any shard lease: status, keys, the dashboard and the admin paths
/// work; claims hand out nothing (no shard is owned here).
pub fn spawn_viewer(dir: &Path, opts: ServerOptions) -> Result<Running, ServerError> {
    if opts.tokens.is_none() && !opts.listen.ip().is_loopback() {
        return Err(ServerError::Config(format!(
            "refusing to listen on {} without authentication: give tokens, or listen on a loopback address",
            opts.listen
        )));
    }
    let deployment = Arc::new(Deployment::open(dir, &opts.open)?);
    let app = Arc::new(App::new(&opts, deployment, Arc::new(Owned::default()))?);
    let listener = crate::conn::bind(opts.listen).map_err(|e| ServerError::Io {
        context: format!("listening on {}", opts.listen),
        source: e,
    })?;
    let io = |context: &str| {
        let context = context.to_string();
        move |e| ServerError::Io { context, source: e }
    };
    let addr = listener
        .local_addr()
        .map_err(io("reading the listening address"))?;
    let tokens = opts.tokens.map(Arc::new);
    let hosts = Arc::new(crate::edge::Hosts::new(addr, &opts.allowed_hosts));
    let mut conn = opts.conn.clone();
    conn.connections_max = crate::conn::connections_that_fit(conn.connections_max);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let load = Arc::clone(&app.load);
    let handle = std::thread::Builder::new()
        .name("shardq-dashboard".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .map_err(io("starting the async runtime"))?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)
                    .map_err(io("registering the listening socket"))?;
                let conn_stats = Arc::clone(&app.load.conn);
                crate::conn::serve(
                    listener,
                    crate::router(app, tokens, hosts),
                    conn,
                    conn_stats,
                    async move {
                        let _ = stop_rx.await;
                    },
                )
                .await;
                Ok(())
            })
        })
        .map_err(io("starting the dashboard thread"))?;
    Ok(Running {
        addr,
        load,
        stop_tx: Some(stop_tx),
        handle: Some(handle),
    })
}
