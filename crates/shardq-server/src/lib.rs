//! shardq-server: the HTTP/JSON API over any deployment (embedded or
//! Redis). A server is a worker process: it holds shard leases through the
//! deployment's coordinator ([`owner`]) and hands the runs of its shards to
//! remote workers (`/v1/claim`, `/v1/ack`, ...); any server enqueues to any
//! shard through a producer that follows fences and pauses. Paths, fields,
//! status codes and limits are documented in `openapi.json` (served at
//! `/v1/openapi.json`) and `docs/server.md`.
//!
//! This crate translates HTTP to library calls and back. It must never
//! hold queue logic of its own (ordering, leases and fences are the
//! backend's), never run a library call on the async executor, and never
//! answer a bad request with anything but a JSON error.

pub mod api;
pub mod auth;
pub mod body;
pub mod conn;
pub mod dashboard;
pub mod edge;
pub mod error;
pub mod ids;
pub mod limits;
pub mod load;
pub mod metrics;
pub mod owner;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post, put, MethodRouter};
use shardq_core::producer::{Producer, ProducerOptions};
use shardq_core::reshard::ReshardBackend;
use shardq_core::Clock;
use shardq_deploy::{Deployment, OpenOptions, WorkerOptions};

pub use auth::{Role, Tokens};
pub use error::{ApiError, ServerError};
pub use limits::Limits;

use crate::owner::{Owned, OwnerThread};

/// The OpenAPI 3 document of this API.
pub const OPENAPI_JSON: &str = include_str!("../openapi.json");
/// Idle producers kept for reuse (each caches a router).
const PRODUCERS_IDLE_MAX: usize = 8;

/// How to run a server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Where to listen.
    pub listen: SocketAddr,
    /// Accepted tokens; `None` runs without authentication, which is
    /// refused on a non-loopback address.
    pub tokens: Option<Tokens>,
    /// Request bounds.
    pub limits: Limits,
    /// How long a dedup id is remembered, in ms.
    pub dedup_window_ms: u64,
    /// Shard leases.
    pub worker: WorkerOptions,
    /// How to open the deployment.
    pub open: OpenOptions,
    /// Host names (`host` or `host:port`) this server answers to besides
    /// its listening address (see [`edge`]).
    pub allowed_hosts: Vec<String>,
    /// Connection bounds.
    pub conn: conn::ConnLimits,
    /// Whether this server takes shard leases and hands out runs (a
    /// worker process). `false`: a front for the API and the dashboard
    /// only, which enqueues, reads and reshards but owns no shard (its
    /// claims find nothing), so it takes no shard from the workers.
    pub take_shards: bool,
    /// A Postgres outbox to show in `/v1/status`, the metrics and the
    /// dashboard: its URL and schema.
    pub outbox: Option<(String, String)>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            tokens: None,
            limits: Limits::default(),
            dedup_window_ms: limits::DEDUP_WINDOW_MS_DEFAULT,
            worker: WorkerOptions::default(),
            open: OpenOptions::default(),
            allowed_hosts: Vec::new(),
            conn: conn::ConnLimits::default(),
            take_shards: true,
            outbox: None,
        }
    }
}

/// Shared state of the handlers.
pub struct App {
    deployment: Arc<Deployment>,
    backend: Arc<dyn ReshardBackend>,
    owned: Arc<Owned>,
    producers: Mutex<Vec<Producer<dyn ReshardBackend>>>,
    dedup_window_ms: u64,
    /// The deployment's retry policies when the server opened it: a job
    /// enqueued without `max_attempts` gets its key's.
    retry: shardq_core::RetrySettings,
    limits: Limits,
    claims: Mutex<api::ClaimBook>,
    wake: tokio::sync::Notify,
    rebalance: Mutex<api::Progress>,
    clock: Arc<dyn Clock>,
    rotate: AtomicUsize,
    metrics: Arc<shardq_metrics::Metrics>,
    /// What the server is serving now (the `shardq_http_*` gauges).
    load: Arc<load::Load>,
    /// The Postgres outbox shown beside the deployment, if any.
    pub(crate) outbox: Option<shardq_metrics::outbox::OutboxSource>,
    /// Bumped whenever work may have arrived here (enqueue, ack, fail,
    /// dead-letter retry): a claim round that found nothing stands for
    /// the waiters only while it is unchanged.
    work_gen: AtomicU64,
    /// When a claim round last found nothing, and at which generation.
    last_empty_poll: Mutex<Option<(Instant, u64)>>,
    /// Each job's back-offs in a row through this server.
    backoffs: shardq_core::backoff::BackOffs,
    /// Rounds of this server's schedule thread (none for a viewer).
    schedule_passes: Option<Arc<AtomicU64>>,
}

impl App {
    fn take_producer(&self) -> Result<Producer<dyn ReshardBackend>, ApiError> {
        let idle = self
            .producers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        match idle {
            Some(p) => Ok(p),
            None => Ok(self.deployment.producer(ProducerOptions {
                dedup_window_ms: self.dedup_window_ms,
                ..ProducerOptions::default()
            })?),
        }
    }

    /// Work may have arrived: wake the waiting claims.
    pub(crate) fn work_arrived(&self) {
        self.work_gen.fetch_add(1, Ordering::Release);
        self.wake.notify_waiters();
        // An ack, fail or cancel may let a dependent go.
        self.deployment.nudge_dependents();
    }

    pub(crate) fn work_generation(&self) -> u64 {
        self.work_gen.load(Ordering::Acquire)
    }

    /// A claim round at `generation` found nothing.
    pub(crate) fn polled_empty(&self, generation: u64) {
        *self
            .last_empty_poll
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), generation));
    }

    /// Whether a claim round found nothing within the last `ms`, with no
    /// work arrived since.
    pub(crate) fn polled_empty_within(&self, generation: u64, ms: u64) -> bool {
        let last = *self
            .last_empty_poll
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        last.is_some_and(|(at, g)| g == generation && at.elapsed() < Duration::from_millis(ms))
    }

    fn put_producer(&self, p: Producer<dyn ReshardBackend>) {
        let mut idle = self.producers.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < PRODUCERS_IDLE_MAX {
            idle.push(p);
        }
    }
}

/// The outbox's state for the status, the metrics and the dashboard, read
/// over one connection (made again after a failure); errors say why, with
/// the URL's password masked.
fn outbox_source(
    url: &str,
    schema: &str,
) -> Result<shardq_metrics::outbox::OutboxSource, ServerError> {
    let reader = shardq_pg::StatusReader::new(url, schema)
        .map_err(|e| ServerError::Config(format!("--outbox-schema: {e}")))?;
    Ok(Arc::new(move || {
        reader
            .read()
            .map(|s| shardq_metrics::outbox::OutboxSnapshot {
                depth: s.depth,
                oldest_age_ms: s.oldest_age_ms,
                relay_active: s.relay_active,
                open_transactions: s.open_transactions,
                dead_tuples: s.dead_tuples,
            })
            .map_err(|e| shardq_core::secret::redacted(&e.to_string()))
    }))
}

impl App {
    /// The state the handlers share over an open `deployment`: the
    /// request limits (payload bound by the deployment's own), the dedup
    /// window its producers pass to the backend, metrics; `owned` lists the shards this process
    /// runs (none for a viewer).
    pub(crate) fn new(
        opts: &ServerOptions,
        deployment: Arc<Deployment>,
        owned: Arc<owner::Owned>,
    ) -> Result<App, ServerError> {
        let clock = deployment.clock();
        let mut limits = opts.limits.clone();
        limits.payload_bytes_max = deployment
            .payload_bytes_max(&opts.open)
            .min(limits.payload_bytes_max.max(1));
        let retry = deployment.retry_settings()?;
        let outbox = match &opts.outbox {
            Some((url, schema)) => Some(outbox_source(url, schema)?),
            None => None,
        };
        let load = Arc::new(load::Load::default());
        Ok(App {
            owned,
            metrics: Arc::new(
                shardq_metrics::Metrics::for_deployment_with(
                    Arc::clone(&deployment),
                    outbox.clone(),
                )
                .with_http(load.source()),
            ),
            load,
            outbox,
            backend: deployment.backend(),
            deployment,
            producers: Mutex::new(Vec::new()),
            dedup_window_ms: opts.dedup_window_ms,
            retry,
            limits,
            claims: Mutex::new(api::ClaimBook::default()),
            wake: tokio::sync::Notify::new(),
            rebalance: Mutex::new(api::Progress::default()),
            clock,
            rotate: AtomicUsize::new(0),
            work_gen: AtomicU64::new(0),
            last_empty_poll: Mutex::new(None),
            backoffs: shardq_core::backoff::BackOffs::default(),
            schedule_passes: None,
        })
    }
}

/// One served route: method, path (OpenAPI syntax) and the role it needs
/// (`None`: no token needed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteInfo {
    /// `GET`, `POST`, `PUT` or `DELETE`.
    pub method: &'static str,
    /// The path, `{param}` for parameters.
    pub path: &'static str,
    /// The role needed.
    pub role: Option<Role>,
}

/// The route table: every path, its method, the role it needs and its
/// handler. Long on purpose: one entry per route, the single list that
/// routing, authorization and the OpenAPI test all read.
fn table() -> Vec<(RouteInfo, MethodRouter<Arc<App>>)> {
    use Role::*;
    let r = |method, path, role| RouteInfo { method, path, role };
    let dash = dashboard::Dash::new();
    let d = |m: MethodRouter<Arc<App>>| m.layer(axum::Extension(Arc::clone(&dash)));
    vec![
        (r("GET", "/healthz", None), get(api::healthz)),
        (r("GET", "/readyz", None), get(api::readyz)),
        (r("GET", "/v1/openapi.json", None), get(api::openapi)),
        (r("GET", "/metrics", Some(Read)), get(metrics::metrics)),
        (r("POST", "/v1/jobs", Some(Produce)), post(api::enqueue)),
        (r("POST", "/v1/claim", Some(Work)), post(api::claim)),
        (r("POST", "/v1/ack", Some(Work)), post(api::ack)),
        (r("POST", "/v1/fail", Some(Work)), post(api::fail)),
        (r("POST", "/v1/extend", Some(Work)), post(api::extend)),
        (r("POST", "/v1/stale", Some(Work)), post(api::stale)),
        (r("GET", "/v1/status", Some(Read)), get(api::status)),
        (r("GET", "/v1/keys", Some(Read)), get(dashboard::key_search)),
        (r("GET", "/v1/keys/{key}", Some(Read)), get(api::key)),
        (
            r("GET", "/v1/keys/{key}/jobs", Some(Read)),
            get(api::key_jobs),
        ),
        (
            r("POST", "/v1/keys/{key}/resume", Some(Admin)),
            post(api::key_resume),
        ),
        (
            r("POST", "/v1/batches", Some(Produce)),
            post(api::batch_open),
        ),
        (
            r("POST", "/v1/batches/{id}/close", Some(Produce)),
            post(api::batch_close),
        ),
        (
            r("GET", "/v1/batches/{id}", Some(Read)),
            get(api::batch_show),
        ),
        (r("GET", "/v1/jobs/{id}", Some(Read)), get(api::job_show)),
        (
            r("GET", "/v1/jobs/{id}/result", Some(Read)),
            get(api::job_result),
        ),
        (
            r("DELETE", "/v1/jobs/{id}", Some(Admin)),
            delete(api::job_cancel),
        ),
        (r("GET", "/v1/policies", Some(Read)), get(api::policies)),
        (
            r("GET", "/v1/policies/{key}", Some(Read)),
            get(api::policy_show),
        ),
        (
            r("PUT", "/v1/policies/{key}", Some(Admin)),
            put(api::policy_put),
        ),
        (
            r("DELETE", "/v1/policies/{key}", Some(Admin)),
            delete(api::policy_delete),
        ),
        (r("GET", "/v1/groups", Some(Read)), get(api::groups)),
        (
            r("GET", "/v1/groups/{name}", Some(Read)),
            get(api::group_show),
        ),
        (
            r("PUT", "/v1/groups/{name}", Some(Admin)),
            put(api::group_put),
        ),
        (
            r("DELETE", "/v1/groups/{name}", Some(Admin)),
            delete(api::group_delete),
        ),
        (
            r("POST", "/v1/groups/{name}/resume", Some(Admin)),
            post(api::group_resume),
        ),
        (r("GET", "/v1/schedules", Some(Read)), get(api::schedules)),
        (
            r("PUT", "/v1/schedules", Some(Admin)),
            put(api::schedules_apply),
        ),
        (
            r("GET", "/v1/schedules/{id}", Some(Read)),
            get(api::schedule_show),
        ),
        (
            r("PUT", "/v1/schedules/{id}", Some(Admin)),
            put(api::schedule_put),
        ),
        (
            r("DELETE", "/v1/schedules/{id}", Some(Admin)),
            delete(api::schedule_delete),
        ),
        (
            r("POST", "/v1/schedules/{id}/pause", Some(Admin)),
            post(api::schedule_pause),
        ),
        (
            r("POST", "/v1/schedules/{id}/resume", Some(Admin)),
            post(api::schedule_resume),
        ),
        (
            r("POST", "/v1/schedules/{id}/trigger", Some(Admin)),
            post(api::schedule_trigger),
        ),
        (
            r("POST", "/v1/schedules/{id}/backfill", Some(Admin)),
            post(api::schedule_backfill),
        ),
        (r("GET", "/v1/dead", Some(Read)), get(api::dead_list)),
        (
            r("POST", "/v1/dead/retry", Some(Admin)),
            post(api::dead_retry),
        ),
        (
            r("POST", "/v1/dead/purge", Some(Admin)),
            post(api::dead_purge),
        ),
        (
            r("POST", "/v1/admin/add-shard", Some(Admin)),
            post(api::add_shard),
        ),
        (
            r("POST", "/v1/admin/remove-shard", Some(Admin)),
            post(api::remove_shard),
        ),
        (
            r("POST", "/v1/admin/set-weight", Some(Admin)),
            post(api::set_weight),
        ),
        (r("POST", "/v1/admin/pin", Some(Admin)), post(api::pin)),
        (r("POST", "/v1/admin/unpin", Some(Admin)), post(api::unpin)),
        (
            r("POST", "/v1/admin/rebalance", Some(Admin)),
            post(api::rebalance_start),
        ),
        (
            r("GET", "/v1/admin/rebalance", Some(Read)),
            get(api::rebalance_progress),
        ),
        (r("GET", "/", None), get(dashboard::index)),
        (r("GET", "/dashboard/app.js", None), get(dashboard::app_js)),
        (
            r("GET", "/dashboard/style.css", None),
            get(dashboard::style_css),
        ),
        (r("GET", "/v1/ring", Some(Read)), d(get(dashboard::ring))),
        (r("GET", "/v1/hot", Some(Read)), d(get(dashboard::hot))),
        (r("GET", "/v1/history", Some(Read)), get(dashboard::history)),
        (
            r("GET", "/v1/reshard", Some(Read)),
            d(get(dashboard::reshard)),
        ),
    ]
}

/// Every route the server serves.
pub fn routes() -> Vec<RouteInfo> {
    table().into_iter().map(|(i, _)| i).collect()
}

fn router(app: Arc<App>, tokens: Option<Arc<Tokens>>, hosts: Arc<edge::Hosts>) -> axum::Router {
    let mut r: axum::Router<Arc<App>> = axum::Router::new();
    // One semaphore for every route but the health probes, so that the
    // bound holds for the whole server (`Router::layer` would give each
    // route its own) and slow requests never hold back a probe.
    let concurrency =
        tower::limit::GlobalConcurrencyLimitLayer::new(app.limits.concurrency_max.max(1));
    // Claims and result waits (long polls that may wait 30 s idle) have a
    // budget of their own: they never hold a slot an enqueue, an ack or a
    // read needs.
    let polls = tower::limit::GlobalConcurrencyLimitLayer::new(app.limits.polls_max.max(1));
    // Scrapes have a small budget of their own: they answer however busy
    // the other routes are, and a flood of them cannot take the blocking
    // threads every handler needs.
    let scrapes = tower::limit::GlobalConcurrencyLimitLayer::new(limits::METRICS_SCRAPES_MAX);
    // Each counted inside its limit: only admitted requests count.
    let (requests, polls_in) = (
        axum::middleware::from_fn_with_state(Arc::clone(&app.load.requests), load::count),
        axum::middleware::from_fn_with_state(Arc::clone(&app.load.polls), load::count),
    );
    for (info, handler) in table() {
        let handler = match info.path {
            // The probes and the metrics answer however busy the server
            // is: that is when they are wanted.
            "/healthz" | "/readyz" => handler,
            "/metrics" => handler.route_layer(scrapes.clone()),
            "/v1/claim" | "/v1/jobs/{id}/result" => handler
                .route_layer(polls_in.clone())
                .route_layer(polls.clone()),
            _ => handler
                .route_layer(requests.clone())
                .route_layer(concurrency.clone()),
        };
        let handler = match info.role {
            Some(role) => handler.route_layer(axum::middleware::from_fn_with_state(
                auth::Guard {
                    tokens: tokens.clone(),
                    role,
                },
                auth::require,
            )),
            None => handler,
        };
        r = r.route(info.path, handler);
    }
    let limits = app.limits.clone();
    r.fallback(|uri: axum::http::Uri| async move {
        ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            format!("no such path {:?} (see /v1/openapi.json)", uri.path()),
        )
    })
    .method_not_allowed_fallback(|m: axum::http::Method, uri: axum::http::Uri| async move {
        ApiError::new(
            axum::http::StatusCode::METHOD_NOT_ALLOWED,
            format!(
                "method {m} is not allowed on {:?} (see /v1/openapi.json)",
                uri.path()
            ),
        )
    })
    .layer(DefaultBodyLimit::max(limits.body_bytes_max))
    .layer(axum::Extension(body::BodyBudget::new(
        Arc::clone(&app.load.body_bytes),
        limits.body_bytes_in_flight_max,
        limits.body_bytes_max,
    )))
    .layer(axum::Extension(body::BodyReadTimeout(
        Duration::from_millis(limits.body_read_timeout_ms.max(1)),
    )))
    .layer(tower_http::timeout::TimeoutLayer::with_status_code(
        axum::http::StatusCode::REQUEST_TIMEOUT,
        Duration::from_millis(limits::REQUEST_TIMEOUT_MS),
    ))
    .layer(axum::middleware::from_fn_with_state(hosts, edge::check))
    .with_state(app)
}

/// An opened server, listening, not yet serving.
pub struct Server {
    app: Arc<App>,
    owner: Option<OwnerThread>,
    /// Fires the schedules of the shards the owner thread runs.
    schedules: Option<shardq_deploy::ScheduleThread>,
    listener: std::net::TcpListener,
    tokens: Option<Arc<Tokens>>,
    hosts: Arc<edge::Hosts>,
    conn: conn::ConnLimits,
    conn_stats: Arc<conn::ConnStats>,
}

impl Server {
    /// Opens data dir `dir` and the leases, and binds
    /// `opts.listen`. Refuses a non-loopback address without tokens.
    pub fn open(dir: &Path, opts: ServerOptions) -> Result<Server, ServerError> {
        if opts.tokens.is_none() && !opts.listen.ip().is_loopback() {
            return Err(ServerError::Config(format!(
                "refusing to listen on {} without authentication: give --tokens FILE (or SHARDQ_TOKENS_FILE), or listen on a loopback address",
                opts.listen
            )));
        }
        if opts.dedup_window_ms == 0 || opts.dedup_window_ms > limits::DEDUP_WINDOW_MS_MAX {
            return Err(ServerError::Config(format!(
                "invalid dedup window {} ms: must be 1..={} ms",
                opts.dedup_window_ms,
                limits::DEDUP_WINDOW_MS_MAX
            )));
        }
        let l = &opts.limits;
        if l.jobs_per_request_max == 0 || l.jobs_per_request_max > limits::JOBS_PER_REQUEST_LIMIT {
            return Err(ServerError::Config(format!(
                "invalid jobs per request {}: must be 1..={}",
                l.jobs_per_request_max,
                limits::JOBS_PER_REQUEST_LIMIT
            )));
        }
        if l.body_bytes_max == 0
            || l.concurrency_max == 0
            || l.polls_max == 0
            || l.claims_per_worker_max == 0
            || l.claims_per_token_max == 0
            || l.body_read_timeout_ms == 0
            || opts.conn.connections_max == 0
            || opts.conn.header_read_timeout_ms == 0
            || opts.conn.write_stall_ms == 0
        {
            return Err(ServerError::Config(
                "body size, concurrency, polls, claims per worker and per token, body read timeout, connections, header read timeout and write stall must each be at least 1".into(),
            ));
        }
        if l.body_bytes_in_flight_max < l.body_bytes_max {
            return Err(ServerError::Config(format!(
                "invalid body bytes in flight {}: must be at least the largest body, {} bytes",
                l.body_bytes_in_flight_max, l.body_bytes_max
            )));
        }
        let deployment = Arc::new(Deployment::open(dir, &opts.open)?);
        let listener = conn::bind(opts.listen).map_err(|e| ServerError::Io {
            context: format!("listening on {}", opts.listen),
            source: e,
        })?;
        let owner = if opts.take_shards {
            let coordinator = deployment.coordinator(&opts.worker)?;
            let maps = deployment.maps();
            Some(OwnerThread::start(
                coordinator,
                deployment.queue(),
                Box::new(move || maps.load().ok().map(|m| m.version)),
            ))
        } else {
            None
        };
        let owned = owner
            .as_ref()
            .map_or_else(|| Arc::new(Owned::default()), OwnerThread::owned);
        // Schedules fire for the shards this server runs.
        let schedules = match &owner {
            Some(_) => {
                let of = Arc::clone(&owned);
                Some(deployment.spawn_scheduler(
                    Arc::new(move || of.list().into_iter().collect()),
                    Arc::new(|e| eprintln!("shardq serve: {e}")),
                )?)
            }
            None => None,
        };
        let mut app = App::new(&opts, deployment, owned)?;
        app.schedule_passes = schedules
            .as_ref()
            .map(shardq_deploy::ScheduleThread::passes);
        let app = Arc::new(app);
        let hosts = Arc::new(edge::Hosts::new(
            listener.local_addr().unwrap_or(opts.listen),
            &opts.allowed_hosts,
        ));
        let mut conn = opts.conn.clone();
        conn.connections_max = conn::connections_that_fit(conn.connections_max);
        Ok(Server {
            owner,
            schedules,
            listener,
            tokens: opts.tokens.map(Arc::new),
            hosts,
            conn,
            conn_stats: Arc::clone(&app.load.conn),
            app,
        })
    }

    /// The address it listens on (the port, when bound to port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, ServerError> {
        self.listener.local_addr().map_err(|e| ServerError::Io {
            context: "reading the listening address".into(),
            source: e,
        })
    }

    /// Shards this server runs now.
    pub fn owned(&self) -> Vec<String> {
        self.app.owned.list()
    }

    /// The connection bounds in force (the connection limit as it fits
    /// under the open-files limit).
    pub fn conn_limits(&self) -> &conn::ConnLimits {
        &self.conn
    }

    /// The connection loop's counters.
    pub fn conn_stats(&self) -> Arc<conn::ConnStats> {
        Arc::clone(&self.conn_stats)
    }

    /// Serves until `shutdown` completes; then stops accepting, stops
    /// handing out runs, finishes the requests in flight, releases the
    /// shards and the leases. Needs a Tokio runtime.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let Server {
            app,
            owner,
            schedules,
            listener,
            tokens,
            hosts,
            conn,
            conn_stats,
        } = self;
        let listener =
            tokio::net::TcpListener::from_std(listener).map_err(|e| ServerError::Io {
                context: "registering the listening socket".into(),
                source: e,
            })?;
        let owned = app.owned.clone();
        let sweeper = tokio::spawn(api::sweep_timeouts(Arc::clone(&app)));
        let a = Arc::clone(&app);
        let stop_claims = async move {
            shutdown.await;
            owned.set_stopping();
            a.wake.notify_waiters();
        };
        conn::serve(
            listener,
            router(Arc::clone(&app), tokens, hosts),
            conn,
            conn_stats,
            stop_claims,
        )
        .await;
        sweeper.abort();
        if let Some(mut schedules) = schedules {
            let _ = tokio::task::spawn_blocking(move || schedules.stop()).await;
        }
        if let Some(mut owner) = owner {
            owner.stop_claiming();
            let stopped = tokio::task::spawn_blocking(move || owner.stop()).await;
            if let Err(e) = stopped {
                eprintln!("shardq serve: releasing the shards failed: {e}");
            }
        }
        Ok(())
    }
}

/// A server running on a thread of its own (tests, embedding).
pub struct Running {
    addr: SocketAddr,
    load: Arc<load::Load>,
    stop_tx: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<std::thread::JoinHandle<Result<(), ServerError>>>,
}

impl Running {
    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What it serves now, as the `shardq_http_*` gauges show it: tests
    /// wait on it where no answer shows the server's state (a connection
    /// held, a long poll waiting, a body being read).
    pub fn load(&self) -> shardq_metrics::http::HttpSnapshot {
        (self.load.source())()
    }

    /// Shuts it down gracefully and waits.
    pub fn stop(mut self) -> Result<(), ServerError> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
        match self.handle.take() {
            Some(h) => h
                .join()
                .map_err(|_| ServerError::Config("the server thread panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// Opens and starts a server on its own thread and runtime.
pub fn spawn(dir: &Path, opts: ServerOptions) -> Result<Running, ServerError> {
    let server = Server::open(dir, opts)?;
    let addr = server.local_addr()?;
    let load = Arc::clone(&server.app.load);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let dir: PathBuf = dir.to_path_buf();
    let handle = std::thread::Builder::new()
        .name(format!("shardq-serve-{}", dir.display()))
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|e| ServerError::Io {
                    context: "starting the async runtime".into(),
                    source: e,
                })?;
            rt.block_on(server.run(async move {
                let _ = stop_rx.await;
            }))
        })
        .map_err(|e| ServerError::Io {
            context: "starting the server thread".into(),
            source: e,
        })?;
    Ok(Running {
        addr,
        load,
        stop_tx: Some(stop_tx),
        handle: Some(handle),
    })
}

/// Opens a server and serves until SIGINT or SIGTERM, then shuts down
/// gracefully (the `shardq serve` command). Prints where it listens, and
/// says so when it runs without authentication.
pub fn serve_until_signal(dir: &Path, opts: ServerOptions) -> Result<(), ServerError> {
    let no_auth = opts.tokens.is_none();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| ServerError::Io {
            context: "starting the async runtime".into(),
            source: e,
        })?;
    // The listener is registered with the runtime, so open inside it.
    rt.block_on(async move {
        let server = tokio::task::block_in_place(|| Server::open(dir, opts))?;
        let addr = server.local_addr()?;
        if no_auth {
            eprintln!(
                "shardq serve: listening on http://{addr} WITHOUT authentication (loopback only; give --tokens FILE to require bearer tokens)"
            );
        } else {
            eprintln!("shardq serve: listening on http://{addr}");
        }
        eprintln!("shardq serve: running shards {:?}", server.owned());
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| ServerError::Io {
                context: "installing the SIGTERM handler".into(),
                source: e,
            })?;
        server
            .run(async move {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                eprintln!("shardq serve: stopping: finishing requests in flight, then releasing the shards");
            })
            .await
    })
}
