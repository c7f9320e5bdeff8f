//! shardq-deploy: the front door. [`Deployment::open`] turns a data dir into
//! one value (a backend, a map store, a way to take shards, a status) for
//! the embedded engine and for Redis alike, so the CLI, the server and the
//! demo call one API and never ask which storage they run on.
//!
//! A data dir is one of two kinds:
//!
//! * **Embedded** (no `remote.json`): every shard is a log in the data dir
//!   (`url` absent or `file:`); the map is `shardmap.yaml`, the store
//!   `FileMapStore`, shards are taken through `membership.json` leases.
//! * **Redis** (`remote.json` present): every shard lives on Redis
//!   (`redis://host:port/db` or `redis+cluster://host:port,...`). The map,
//!   its version, the rebalance target and lock, the fences and the leases
//!   are in Redis under the deployment's namespace; `remote.json` names
//!   where the map lives, the namespace and the deployment id, and
//!   `shardmap.yaml` is a cache of the last map this data dir saw (never
//!   read as truth). Processes with different data dirs naming the same
//!   deployment cooperate.
//!
//! A map mixing embedded and Redis shards is refused with an error naming
//! the shard. This crate opens, initialises and reports; it must never
//! route, enqueue or run jobs itself beyond handing out the core types that
//! do (`Producer`, `WorkerPool`).

mod batches;
mod dependents;
mod error;
pub mod redis_maps;
mod scheduler;
pub use scheduler::{OwnedShards, ScheduleThread};
pub mod remote;
pub mod spec;
pub mod status;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardq_core::producer::{Producer, ProducerOptions};
use shardq_core::reshard::{MapStore, ReshardBackend};
use shardq_core::{
    Clock, Coordinator, FlowControl, FlowSettings, GroupBuckets, InspectJobs, QueueBackend,
    Retention, RetrySettings, SystemClock,
};
use shardq_fs::map_store::FileMapStore;
use shardq_fs::{EngineOptions, FsBackend, FsCoordinator, MemberOptions};
use shardq_redis::{is_redis_url, RedisBackend, RedisMapStore, RedisOptions};
use shardq_route::ShardMap;

pub use error::DeployError;
pub use redis_maps::{FollowMap, RedisMaps};
pub use remote::{Remote, REMOTE_FILE};
pub use status::{ShardRow, StatusReport};

/// The cached copy of the map in a Redis data dir.
pub const MAP_CACHE_FILE: &str = shardq_fs::layout::SHARD_MAP_FILE;

/// How to open a deployment: the embedded engine's options (durability,
/// payload limit, clock, dead policy) and Redis's (bounds, dead policy);
/// only the ones of the data dir's kind are used.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// For an embedded data dir.
    pub engine: EngineOptions,
    /// For a Redis data dir; its namespace, deployment and queue come from
    /// `remote.json`.
    pub redis: RedisOptions,
}

/// How a process takes part in running shards.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Shard lease, in ms.
    pub lease_ms: u64,
    /// Embedded only: margin past a lapsed lease before takeover, in ms
    /// (`None`: the engine's default, at most half the lease).
    pub clock_skew_ms: Option<u64>,
    /// Most shards held at once (`usize::MAX`: no limit).
    pub max_shards: usize,
    /// What kind of process holds the leases, shown before its `host@pid`
    /// as the shards' owner (`work`, `serve`).
    pub role: &'static str,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            lease_ms: shardq_fs::membership::LEASE_MS_DEFAULT,
            clock_skew_ms: None,
            max_shards: usize::MAX,
            role: "work",
        }
    }
}

/// The owner name of this process in leases: `ROLE:host@pid`.
pub fn owner_name(role: &str) -> String {
    format!("{role}:{}", shardq_fs::membership::default_member_id())
}

/// Where a deployment's shards live.
#[derive(Debug, Clone)]
pub enum Kind {
    /// The embedded engine in the data dir.
    Embedded,
    /// Redis, as named by the data dir's `remote.json`.
    Redis(Remote),
}

enum Store {
    Embedded(Arc<FsBackend>),
    Redis {
        backend: RedisBackend,
        maps: Arc<RedisMaps>,
    },
}

pub use shardq_core::backend::JobLookup;

/// An open deployment. See the crate docs.
pub struct Deployment {
    dir: PathBuf,
    kind: Kind,
    store: Store,
    backend: Arc<dyn ReshardBackend>,
    maps: Arc<dyn MapStore>,
    clock: Arc<dyn Clock>,
    /// The flow control its backend asks before each start.
    flow: Option<Arc<FlowControl>>,
    /// Wakes this process's dependents resolver (`nudge_dependents`).
    dependents_wake: Arc<shardq_core::workflow::Wake>,
}

impl std::fmt::Debug for Deployment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deployment")
            .field("dir", &self.dir)
            .field("kind", &self.kind)
            .finish()
    }
}

/// Format version of the settings documents (`retry`, `retention`,
/// `flow`): every stored document carries it as its `version` field, and a
/// document of another version (or none) is refused, naming both. From
/// the first release on, a change of a document's form is a numbered
/// migration (docs/design.md, "Format versions").
pub const SETTINGS_VERSION: u64 = 1;

/// The text stored for `value` (the default clears the setting): its JSON
/// object with a `"version": SETTINGS_VERSION` field.
fn setting_text<T: serde::Serialize + Default + PartialEq>(
    value: &T,
) -> Result<Option<String>, DeployError> {
    if *value == T::default() {
        return Ok(None);
    }
    let body = serde_json::to_value(value).map_err(|e| DeployError::Invalid(e.to_string()))?;
    let serde_json::Value::Object(fields) = body else {
        return Err(DeployError::Invalid(format!(
            "a setting must be stored as a JSON object, not {body}"
        )));
    };
    let mut doc = serde_json::Map::new();
    doc.insert("version".into(), SETTINGS_VERSION.into());
    doc.extend(fields);
    let text = serde_json::to_string(&serde_json::Value::Object(doc))
        .map_err(|e| DeployError::Invalid(e.to_string()))?;
    Ok(Some(text))
}

/// Changes deployment setting `name` of `maps` atomically against every
/// other writer ([`shardq_core::reshard::update_setting`]): `read` parses
/// the current text (or gives the default), `change` edits a copy and
/// says what to report, `check` refuses a result that may not be stored.
/// Another writer's change in between makes it read and edit again, so
/// no acknowledged change is lost; an `Ok` means stored.
fn update_json_setting<T, R, E>(
    maps: &dyn MapStore,
    name: &str,
    read: impl Fn(Option<&str>) -> Result<T, DeployError>,
    mut change: impl FnMut(&mut T) -> Result<R, E>,
    check: impl Fn(&T, &T) -> Result<(), DeployError>,
) -> Result<R, E>
where
    T: serde::Serialize + Default + PartialEq + Clone,
    E: From<DeployError> + From<shardq_core::reshard::ReshardError>,
{
    shardq_core::reshard::update_setting(maps, name, |current| {
        let before = read(current)?;
        let mut after = before.clone();
        let out = change(&mut after)?;
        if after == before {
            return Ok((current.map(str::to_string), out));
        }
        check(&before, &after)?;
        Ok((setting_text(&after)?, out))
    })
}

/// Reads a setting's text as `parse` does (the default when unset); a
/// text that does not parse names the setting and the command that sets
/// it again.
fn parse_setting<T: Default>(
    name: &str,
    text: Option<&str>,
    parse: fn(&str) -> Result<T, serde_json::Error>,
) -> Result<T, DeployError> {
    let Some(text) = text else {
        return Ok(T::default());
    };
    let again = match name {
        shardq_core::reshard::SETTING_FLOW => "start over with `shardq policy reset`".to_string(),
        _ => format!("set it again with `shardq {name} set`"),
    };
    let shown = shardq_core::job::cut_at_char(text, 200);
    let more = if shown.len() < text.len() { "..." } else { "" };
    let refused = |why: String| {
        DeployError::Invalid(format!(
            "the deployment's {name} setting {shown:?}{more} {why}; {again}"
        ))
    };
    let mut doc: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| refused(format!("does not parse ({e})")))?;
    match doc.remove("version") {
        Some(v) if v.as_u64() == Some(SETTINGS_VERSION) => {}
        found => {
            let found = found.map_or("none".to_string(), |v| v.to_string());
            return Err(refused(format!(
                "is of settings format version {found}, and this build reads version \
                 {SETTINGS_VERSION} only"
            )));
        }
    }
    let body = serde_json::Value::Object(doc).to_string();
    parse(&body).map_err(|e| refused(format!("does not parse ({e})")))
}

fn read_retry(text: Option<&str>) -> Result<RetrySettings, DeployError> {
    let s = parse_setting(
        shardq_core::reshard::SETTING_RETRY,
        text,
        RetrySettings::parse,
    )?;
    s.validate()?;
    Ok(s)
}

fn read_retention(text: Option<&str>) -> Result<Retention, DeployError> {
    let r: Retention = parse_setting(shardq_core::reshard::SETTING_RETENTION, text, |t| {
        serde_json::from_str(t)
    })?;
    r.validate()?;
    Ok(r)
}

fn read_flow(text: Option<&str>) -> Result<FlowSettings, DeployError> {
    let f = parse_setting(
        shardq_core::reshard::SETTING_FLOW,
        text,
        FlowSettings::parse,
    )?;
    f.validate()?;
    Ok(f)
}

/// The `retry` setting of `maps`, parsed and checked; the defaults when
/// unset.
pub(crate) fn retry_setting(maps: &dyn MapStore) -> Result<RetrySettings, DeployError> {
    read_retry(
        maps.load_setting(shardq_core::reshard::SETTING_RETRY)?
            .as_deref(),
    )
}

/// The `retention` setting of `maps`, parsed and checked; the default
/// when unset.
pub(crate) fn retention_setting(maps: &dyn MapStore) -> Result<Retention, DeployError> {
    read_retention(
        maps.load_setting(shardq_core::reshard::SETTING_RETENTION)?
            .as_deref(),
    )
}

/// The `flow` setting of `maps`, parsed and checked; the default (no
/// limits) when unset.
pub(crate) fn flow_setting(maps: &dyn MapStore) -> Result<FlowSettings, DeployError> {
    read_flow(
        maps.load_setting(shardq_core::reshard::SETTING_FLOW)?
            .as_deref(),
    )
}

/// Flow control over `maps`'s `flow` setting, read again every
/// [`shardq_core::flow::FLOW_RECHECK_MS`], with group buckets `groups`.
pub(crate) fn flow_control(
    maps: &Arc<dyn MapStore>,
    groups: Arc<dyn GroupBuckets>,
) -> Result<Arc<FlowControl>, DeployError> {
    // A stored setting that does not read (edited by hand, written by a
    // newer release) must not stop the deployment: no limits until it
    // reads again, and the error is kept where status and metrics show it.
    let (first, error) = match flow_setting(&**maps) {
        Ok(s) => (s, None),
        Err(e) => (FlowSettings::default(), Some(e.to_string())),
    };
    let source = Arc::clone(maps);
    // The text last read: a recheck that finds it unchanged (the common
    // case, every second in every process) parses nothing.
    let last: std::sync::Mutex<Option<Option<String>>> = std::sync::Mutex::new(None);
    let flow = FlowControl::new(first, groups).with_source(Box::new(move || {
        let text = source.load_setting(shardq_core::reshard::SETTING_FLOW)?;
        let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
        if last.as_ref() == Some(&text) {
            return Ok(None);
        }
        let settings = read_flow(text.as_deref())?;
        *last = Some(text);
        Ok(Some(settings))
    }));
    if let Some(e) = error {
        flow.note_error(format!("reading the flow settings: {e}"));
    }
    Ok(Arc::new(flow))
}

/// The kind of data dir `dir` is. An embedded data dir whose map names a
/// Redis shard is refused (mixed maps are not supported).
pub fn kind(dir: &Path) -> Result<Kind, DeployError> {
    if let Some(r) = Remote::read(dir)? {
        return Ok(Kind::Redis(r));
    }
    // Errors reading the local map are left to the embedded engine, which
    // reports them as it always has.
    if let Ok(map) = shardq_fs::layout::read_map(dir) {
        check_all(&map, false)?;
    }
    Ok(Kind::Embedded)
}

/// Checks that every shard of `map` is on Redis (`redis`) or every one is
/// embedded; names the first that is not.
pub fn check_all(map: &ShardMap, redis: bool) -> Result<(), DeployError> {
    for s in &map.shards {
        let url = s.url.as_deref().unwrap_or("");
        if is_redis_url(url) != redis {
            let (want, got) = if redis {
                ("on Redis", "embedded")
            } else {
                ("embedded", "on Redis")
            };
            return Err(DeployError::Invalid(format!(
                "shard {:?} (url {:?}) is {got} while the other shards are {want}: a map mixing the embedded engine and Redis is not supported; give every shard the same kind of url",
                s.name,
                shardq_core::secret::redact(s.url.as_deref().unwrap_or("none"))
            )));
        }
        if !redis && !url.is_empty() && !url.starts_with("file:") {
            return Err(DeployError::Invalid(format!(
                "shard {:?} has url {:?}: expected none, file:, redis://host:port/db or redis+cluster://host:port,...",
                s.name,
                shardq_core::secret::redact(url)
            )));
        }
    }
    Ok(())
}

/// The Redis options of a deployment named by `remote`.
pub fn redis_options_for(remote: &Remote, base: &RedisOptions) -> RedisOptions {
    RedisOptions {
        queue: remote.queue.clone(),
        namespace: remote.namespace.clone(),
        deployment: Some(remote.deployment.clone()),
        ..base.clone()
    }
}

/// What `init` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Initialised {
    /// The published map.
    pub map: ShardMap,
    /// True when an existing Redis deployment was joined.
    pub joined: bool,
    /// Where the map lives (Redis) or `None` (embedded).
    pub map_url: Option<String>,
    /// The Redis namespace, if any.
    pub namespace: Option<String>,
}

/// Makes `dir` an embedded data dir publishing `map`.
pub fn init_embedded(dir: &Path, map: &ShardMap) -> Result<Initialised, DeployError> {
    check_all(map, false)?;
    shardq_fs::Engine::init(dir, map)?;
    Ok(Initialised {
        map: map.clone(),
        joined: false,
        map_url: None,
        namespace: None,
    })
}

/// Makes `dir` a Redis data dir: a new deployment for `map` (shard i on
/// `urls[i % n]`, the map on `urls[0]`) in `namespace` (default: derived
/// from the new deployment id), or, with `join`, the existing deployment in
/// `namespace` (default `default`). Init refuses a namespace already in use;
/// join refuses one that holds no deployment.
pub fn init_redis(
    dir: &Path,
    mut map: ShardMap,
    urls: &[String],
    namespace: Option<&str>,
    join: bool,
    base: &RedisOptions,
) -> Result<Initialised, DeployError> {
    if urls.is_empty() {
        error::invalid!("no Redis URL given");
    }
    for (i, s) in map.shards.iter_mut().enumerate() {
        s.url = Some(urls[i % urls.len()].clone());
    }
    map.validate()?;
    if dir.exists() {
        let mut entries = std::fs::read_dir(dir)
            .map_err(|e| DeployError::io(format!("reading {}", dir.display()), e))?;
        if entries.next().is_some() {
            error::invalid!(
                "cannot initialise {}: the directory is not empty",
                dir.display()
            );
        }
    }
    let map_url = urls[0].clone();
    let (remote, map) = if join {
        let ns = namespace.unwrap_or(shardq_redis::keys::NAMESPACE_DEFAULT);
        let store = RedisMapStore::open_in(&map_url, ns, base)?;
        let Some(found) = store.load_map()? else {
            error::invalid!(
                "Redis at {map_url} holds no shard map in namespace {ns:?}: nothing to join (run init without --join to create a deployment)"
            );
        };
        let opts = RedisOptions {
            namespace: ns.to_string(),
            deployment: None,
            ..base.clone()
        };
        let backend = RedisBackend::open(&found, opts)?;
        let Some(id) = backend.deployment_id() else {
            error::invalid!(
                "Redis at {map_url}: the shards of namespace {ns:?} carry no deployment record: nothing to join"
            );
        };
        (Remote::new(&map_url, ns, &id), found)
    } else {
        let dep = shardq_redis::init_deployment(&map, &map_url, namespace, base).map_err(|e| {
            let text = e.to_string();
            if text.contains("already holds") {
                DeployError::Invalid(format!(
                    "{text}; pass --join to attach this data dir to that deployment, or --namespace NAME to create another one beside it"
                ))
            } else {
                e.into()
            }
        })?;
        let remote = Remote::new(&map_url, &dep.namespace, &dep.id);
        let store = RedisMapStore::open_in(&map_url, &dep.namespace, base)?;
        store.publish_map(&map, 0)?;
        (remote, map)
    };
    check_all(&map, true)?;
    std::fs::create_dir_all(dir)
        .map_err(|e| DeployError::io(format!("creating {}", dir.display()), e))?;
    let cache = dir.join(MAP_CACHE_FILE);
    shardq_fs::layout::write_atomic(&cache, map.to_yaml().as_bytes())
        .map_err(|e| DeployError::io(format!("writing {}", cache.display()), e))?;
    remote.write(dir)?;
    Ok(Initialised {
        map,
        joined: join,
        map_url: Some(remote.map_url.clone()),
        namespace: Some(remote.namespace.clone()),
    })
}

impl Deployment {
    /// Opens data dir `dir`, embedded or Redis.
    pub fn open(dir: &Path, opts: &OpenOptions) -> Result<Deployment, DeployError> {
        match kind(dir)? {
            Kind::Embedded => {
                shardq_fs::layout::check(dir)?;
                let maps: Arc<dyn MapStore> = Arc::new(FileMapStore::open(dir)?);
                let mut engine = opts.engine.clone();
                let retry = retry_setting(&*maps)?;
                // Unset: the caller's engine options stand.
                if retry != RetrySettings::default() {
                    engine.backoff = retry.default.backoff;
                    engine.retry_rules = Arc::new(retry.rules);
                }
                engine.retention = retention_setting(&*maps)?;
                // Given by the caller: it stands.
                if engine.flow.is_none() {
                    let groups = Arc::new(shardq_fs::FileGroupBuckets::new(dir));
                    engine.flow = Some(flow_control(&maps, groups)?);
                }
                let flow = engine.flow.clone();
                let backend = Arc::new(FsBackend::new(dir, engine)?);
                Ok(Deployment {
                    dir: dir.to_path_buf(),
                    kind: Kind::Embedded,
                    clock: Arc::clone(&opts.engine.clock),
                    backend: backend.clone(),
                    store: Store::Embedded(backend),
                    maps,
                    flow,
                    dependents_wake: Arc::default(),
                })
            }
            Kind::Redis(remote) => {
                let ropts = redis_options_for(&remote, &opts.redis);
                let (backend, maps) = redis_maps::open(dir, &remote, ropts)?;
                Ok(Deployment {
                    dir: dir.to_path_buf(),
                    kind: Kind::Redis(remote),
                    clock: Arc::new(SystemClock),
                    backend: Arc::new(backend.clone()),
                    maps: maps.clone(),
                    flow: backend.flow().cloned(),
                    store: Store::Redis { backend, maps },
                    dependents_wake: Arc::default(),
                })
            }
        }
    }

    /// The deployment's retry policies (its `retry` setting: a default and
    /// per-key and per-prefix rules), or the defaults when none is set.
    /// Processes read it when they open the deployment.
    pub fn retry_settings(&self) -> Result<RetrySettings, DeployError> {
        retry_setting(&*self.maps)
    }

    /// Stores the deployment's retry policies, checked first (the defaults
    /// clear the setting), replacing whatever is stored; workers and
    /// servers started after this use them.
    pub fn set_retry_settings(&self, settings: &RetrySettings) -> Result<(), DeployError> {
        let new = settings.clone();
        self.update_retry_settings(|s| {
            *s = new.clone();
            Ok::<_, DeployError>(())
        })
    }

    /// Edits the deployment's retry policies atomically against every
    /// other writer: `change` edits the current settings (it may run more
    /// than once, each time on the settings then stored); the result is
    /// checked and stored. An `Ok` means stored.
    pub fn update_retry_settings<R, E>(
        &self,
        change: impl FnMut(&mut RetrySettings) -> Result<R, E>,
    ) -> Result<R, E>
    where
        E: From<DeployError> + From<shardq_core::reshard::ReshardError>,
    {
        update_json_setting(
            &*self.maps,
            shardq_core::reshard::SETTING_RETRY,
            read_retry,
            change,
            |_, after| Ok(after.validate()?),
        )
    }

    /// The deployment's flow control settings (its `flow` setting:
    /// policies by key and prefix, a default, and groups), or none.
    pub fn flow_settings(&self) -> Result<FlowSettings, DeployError> {
        flow_setting(&*self.maps)
    }

    /// Stores the deployment's flow settings, checked first (the defaults
    /// clear the setting), replacing whatever is stored; this process uses
    /// them at once, every other worker and server of the deployment within
    /// [`shardq_core::flow::FLOW_RECHECK_MS`], without a restart.
    pub fn set_flow_settings(&self, settings: &FlowSettings) -> Result<(), DeployError> {
        let new = settings.clone();
        self.update_flow_settings(|s| {
            *s = new.clone();
            Ok::<_, DeployError>(())
        })
    }

    /// Edits the deployment's flow settings atomically against every other
    /// writer (policies, groups; in this process, another process or
    /// another server): `change` edits the settings stored now (it may run
    /// more than once, each time on the settings then stored), the result
    /// is checked as [`Deployment::set_flow_settings`] checks, and stored.
    /// An `Ok` means stored.
    pub fn update_flow_settings<R, E>(
        &self,
        change: impl FnMut(&mut FlowSettings) -> Result<R, E>,
    ) -> Result<R, E>
    where
        E: From<DeployError> + From<shardq_core::reshard::ReshardError>,
    {
        let stored = update_json_setting(
            &*self.maps,
            shardq_core::reshard::SETTING_FLOW,
            read_flow,
            change,
            |_, after| self.check_flow(after),
        )?;
        self.reread_flow();
        Ok(stored)
    }

    /// Puts the stored flow settings in use in this process at once (after
    /// a change it stored; other processes read them within
    /// [`shardq_core::flow::FLOW_RECHECK_MS`]).
    fn reread_flow(&self) {
        if let Some(f) = &self.flow {
            f.reread(self.clock.now_ms());
        }
    }

    /// Checks flow settings `after` before they are stored.
    fn check_flow(&self, after: &FlowSettings) -> Result<(), DeployError> {
        after.validate()?;
        // A policy asking more runs of a key at once than the backend can
        // keep apart is refused here, where it is set.
        let most = self.queue().limits().key_concurrency_max;
        let high = after.key_concurrency_high();
        if high > most {
            return Err(shardq_core::QueueError::InvalidOption {
                name: "concurrency",
                value: high.to_string(),
                allowed: format!("1 to {most} on this deployment's backend"),
            }
            .into());
        }
        Ok(())
    }

    /// Clears the deployment's flow settings without reading them (every
    /// policy and group goes): the way out of a stored setting that does
    /// not read.
    pub fn reset_flow_settings(&self) -> Result<(), DeployError> {
        self.maps
            .store_setting(shardq_core::reshard::SETTING_FLOW, None)?;
        self.reread_flow();
        Ok(())
    }

    /// Lifts the hold a handler's group back-off put on `group`: its keys
    /// start again at once here and within a second in every process.
    /// A deployment without flow control has no hold to lift.
    pub fn resume_group(&self, group: &str) -> Result<(), DeployError> {
        shardq_core::flow::validate_group_name(group)?;
        if let Some(f) = &self.flow {
            f.resume_group(group)?;
        }
        Ok(())
    }

    /// Removes `group` (refused while a policy names it) and lifts its
    /// hold, so a group made again later starts without one. Whether there
    /// was one.
    pub fn remove_group(&self, group: &str) -> Result<bool, DeployError> {
        shardq_core::flow::validate_group_name(group)?;
        let removed =
            self.update_flow_settings(|s| Ok::<_, DeployError>(s.remove_group(group)?))?;
        if removed {
            self.resume_group(group)?;
        }
        Ok(removed)
    }

    /// This process's flow control (what it admitted and holds back), when
    /// its backend asks one.
    pub fn flow(&self) -> Option<&Arc<FlowControl>> {
        self.flow.as_ref()
    }

    /// How long the deployment's shards keep finished jobs (its
    /// `retention` setting, or the default).
    pub fn retention(&self) -> Result<Retention, DeployError> {
        retention_setting(&*self.maps)
    }

    /// Stores how long finished jobs are kept, checked first (the default
    /// clears the setting); workers and servers started after this use it.
    pub fn set_retention(&self, r: &Retention) -> Result<(), DeployError> {
        r.validate()?;
        self.maps.store_setting(
            shardq_core::reshard::SETTING_RETENTION,
            setting_text(r)?.as_deref(),
        )?;
        Ok(())
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the shards live.
    pub fn kind(&self) -> &Kind {
        &self.kind
    }

    /// True for a Redis deployment.
    pub fn is_redis(&self) -> bool {
        matches!(self.kind, Kind::Redis(_))
    }

    /// The queue backend with its key inventory (for resharding).
    pub fn backend(&self) -> Arc<dyn ReshardBackend> {
        Arc::clone(&self.backend)
    }

    /// The queue backend.
    pub fn queue(&self) -> Arc<dyn QueueBackend> {
        match &self.store {
            Store::Embedded(fs) => fs.clone(),
            Store::Redis { backend, .. } => Arc::new(backend.clone()),
        }
    }

    /// Where the shard map lives.
    pub fn maps(&self) -> Arc<dyn MapStore> {
        Arc::clone(&self.maps)
    }

    /// The clock leases and delays use in this process.
    pub fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock)
    }

    /// The published map.
    pub fn map(&self) -> Result<ShardMap, DeployError> {
        Ok(self.maps.load()?)
    }

    /// Where a job that is no longer live on `shard` went, if it left with
    /// its key in a move: the key, and the shard the published map routes
    /// it to now (where its copy runs, or ran).
    pub fn moved_job(
        &self,
        shard: &str,
        id: shardq_core::JobId,
    ) -> Result<Option<(String, String)>, DeployError> {
        let Some(key) = self.queue().moved_away(shard, id)? else {
            return Ok(None);
        };
        let now = shardq_route::Router::new(self.map()?)?
            .route(&key)
            .to_string();
        Ok(Some((key, now)))
    }

    /// Where job `id` of `shard` is: live or finished there while the
    /// retention keeps it; else, when it left with its key in a move, its
    /// copy on the shard that stored it, followed through later moves
    /// ([`shardq_core::backend::follow_moves`]), live or finished there;
    /// else, a move this shard remembers with no copy found, the key and
    /// where the map routes it now ([`Deployment::moved_job`]).
    pub fn find_job(&self, shard: &str, id: shardq_core::JobId) -> Result<JobLookup, DeployError> {
        let queue = self.queue();
        let shards = self.shard_names().unwrap_or_default();
        let routed = |key: &str| self.route(key).ok();
        let mut finished = |s: &str, id| shardq_core::backend::finished_job(&*queue, s, id);
        Ok(shardq_core::backend::find_job(
            &*queue,
            &shards,
            &routed,
            &mut finished,
            shard,
            id,
        )?)
    }

    /// Cancels job `id` of `shard` ([`shardq_core::InspectJobs::cancel`]);
    /// when it is no longer there because it left with its key in a move,
    /// cancels its copy on the shard that stored it
    /// ([`shardq_core::backend::follow_moves`]). The shard and id acted
    /// on, and the outcome.
    pub fn cancel_job(
        &self,
        shard: &str,
        id: shardq_core::JobId,
    ) -> Result<(String, shardq_core::JobId, shardq_core::CancelOutcome), DeployError> {
        let queue = self.queue();
        let outcome = queue.cancel(shard, id)?;
        if outcome != shardq_core::CancelOutcome::NotFound {
            return Ok((shard.to_string(), id, outcome));
        }
        let shards = self.shard_names().unwrap_or_default();
        let routed = |key: &str| self.route(key).ok();
        match shardq_core::backend::follow_moves(&*queue, &shards, &routed, shard, id)
            .unwrap_or(None)
        {
            Some((at, copy)) => Ok((at.clone(), copy, queue.cancel(&at, copy)?)),
            None => Ok((shard.to_string(), id, outcome)),
        }
    }

    /// Lifts the handler's back-off holding `key` on the shard the
    /// published map routes it to: its backed-off jobs are due now, and the
    /// shard's owner starts the key at its next claim, in whatever process
    /// it runs ([`shardq_core::InspectJobs::resume_key`]). A key moving
    /// now is routed to its old shard, which answers
    /// [`shardq_core::KeyResume::Moving`]. The shard, and what was done.
    pub fn resume_key(&self, key: &str) -> Result<(String, shardq_core::KeyResume), DeployError> {
        shardq_core::validate_key(key)?;
        let shard = self.route(key)?;
        let done = self.queue().resume_key(&shard, key)?;
        Ok((shard, done))
    }

    /// The shard the published map routes `key` to.
    fn route(&self, key: &str) -> Result<String, DeployError> {
        Ok(shardq_route::Router::new(self.map()?)?
            .route(key)
            .to_string())
    }

    /// Names of the shards of the published map.
    pub fn shard_names(&self) -> Result<Vec<String>, DeployError> {
        Ok(self.map()?.shards.into_iter().map(|s| s.name).collect())
    }

    /// A producer routing with the published map.
    pub fn producer(
        &self,
        options: ProducerOptions,
    ) -> Result<Producer<dyn ReshardBackend>, DeployError> {
        Ok(Producer::new(self.backend(), self.maps(), options)?)
    }

    /// The largest payload this deployment's store takes under `opts`
    /// (the embedded engine's or the Redis backend's bound), so callers
    /// need not ask which kind it is.
    pub fn payload_bytes_max(&self, opts: &OpenOptions) -> usize {
        match self.kind() {
            Kind::Embedded => opts.engine.payload_bytes_max,
            Kind::Redis(_) => opts.redis.payload_bytes_max,
        }
    }

    /// A coordinator taking shards for this process.
    pub fn coordinator(&self, opts: &WorkerOptions) -> Result<Box<dyn Coordinator>, DeployError> {
        match &self.store {
            Store::Embedded(_) => {
                let member = MemberOptions {
                    lease_ms: opts.lease_ms,
                    clock_skew_ms: opts.clock_skew_ms.unwrap_or(
                        shardq_fs::membership::CLOCK_SKEW_MS_DEFAULT.min(opts.lease_ms / 2),
                    ),
                    max_local_shards: opts.max_shards,
                    member_id: owner_name(opts.role),
                };
                Ok(Box::new(FsCoordinator::new(
                    &self.dir,
                    member,
                    Arc::clone(&self.clock),
                )?))
            }
            Store::Redis { backend, maps } => {
                let max = if opts.max_shards == usize::MAX {
                    0
                } else {
                    opts.max_shards
                };
                Ok(Box::new(FollowMap::new(
                    backend,
                    Arc::clone(maps),
                    opts.lease_ms,
                    max,
                    Some(owner_name(opts.role)),
                )?))
            }
        }
    }

    /// Makes what was written durable (the embedded engine's unsynced
    /// appends under interval or no durability); Redis's durability is the
    /// server's own.
    pub fn flush(&self) -> Result<(), DeployError> {
        if let Store::Embedded(fs) = &self.store {
            fs.flush()?;
        }
        Ok(())
    }

    /// Counts, owners and leases of every shard of the published map; a
    /// shard that cannot be read is reported on its row, not as an error.
    pub fn status(&self) -> Result<StatusReport, DeployError> {
        let mut report = self.shard_status()?;
        report.schedules = shardq_core::schedule::ScheduleStore::totals(&*self.maps()).ok();
        report.dependents = shardq_core::workflow::WaitingStore::load(&*self.maps())
            .ok()
            .map(|f| f.totals());
        Ok(report)
    }

    fn shard_status(&self) -> Result<StatusReport, DeployError> {
        let names = self.shard_names()?;
        match &self.store {
            Store::Embedded(fs) => {
                let m = shardq_fs::layout::read_membership(&self.dir)?;
                Ok(status::collect(&names, &|n| fs.shard_stats(n), &|name| {
                    let entry = m.shards.get(name);
                    let owner = entry.and_then(|e| e.owner.clone());
                    let until = owner.as_ref().and(entry.map(|e| e.lease_expires_ms));
                    Ok((owner, until))
                }))
            }
            Store::Redis { backend, .. } => Ok(status::collect(
                &names,
                &|n| backend.shard_stats(n),
                &|name| {
                    let lease = backend.lease_holder(name)?;
                    Ok((lease.as_ref().map(|l| l.0.clone()), lease.map(|l| l.1)))
                },
            )),
        }
    }

    /// Prepares a new shard's storage before it joins the map: the embedded
    /// engine makes its directory; Redis checks that the server at `url`
    /// answers and writes the shard's deployment record. Errors name the
    /// shard and the URL; a URL of the other kind is refused (mixed maps
    /// are not supported).
    pub fn deploy_shard(&self, name: &str, url: Option<&str>) -> Result<(), DeployError> {
        match (&self.store, url) {
            (Store::Embedded(_), None) => {
                shardq_fs::map_store::deploy_shard(&self.dir, name)?;
                Ok(())
            }
            (Store::Embedded(_), Some(u)) if u.starts_with("file:") => {
                shardq_fs::map_store::deploy_shard(&self.dir, name)?;
                Ok(())
            }
            (Store::Embedded(_), Some(u)) => error::invalid!(
                "--url {u:?}: this data dir's shards live in the embedded engine; use `file:` or no --url (a map mixing the embedded engine and Redis is not supported)"
            ),
            (Store::Redis { .. }, None) => error::invalid!(
                "--url is required: this data dir's shards live on Redis; give the new shard {name:?}'s server, e.g. --url redis://127.0.0.1:6379/0"
            ),
            (Store::Redis { .. }, Some(u)) if !is_redis_url(u) => error::invalid!(
                "--url {u:?}: this data dir's shards live on Redis; expected redis://host:port/db or redis+cluster://host:port,... (a map mixing the embedded engine and Redis is not supported)"
            ),
            (Store::Redis { backend, maps }, Some(u)) => {
                let Kind::Redis(remote) = &self.kind else {
                    unreachable!("a Redis store has a Redis kind")
                };
                let mut map = ShardMap::with_shards(shardq_route::Algorithm::Rendezvous, [name])?;
                map.shards[0].url = Some(u.to_string());
                // Within the bounds this process opened the deployment with.
                let opts = redis_options_for(remote, backend.options());
                // The Redis error names the shard and the URL and keeps its
                // kind (an unreachable server is "retry later", not bad input).
                shardq_redis::init_shards(&map, &opts)?;
                maps.assign_url(name, u);
                backend.sync_shards(&map)?;
                Ok(())
            }
        }
    }

    /// The embedded engine's backend, for what only it has (repair, flush
    /// policies); `None` on Redis.
    pub fn embedded(&self) -> Option<Arc<FsBackend>> {
        match &self.store {
            Store::Embedded(fs) => Some(fs.clone()),
            Store::Redis { .. } => None,
        }
    }

    /// The Redis backend and map, for what only Redis has; `None` when
    /// embedded.
    pub fn redis(&self) -> Option<(RedisBackend, Arc<RedisMaps>)> {
        match &self.store {
            Store::Embedded(_) => None,
            Store::Redis { backend, maps } => Some((backend.clone(), maps.clone())),
        }
    }
}

#[cfg(test)]
mod settings_format {
    use super::*;

    /// Flow control over a map store rereads the `flow` setting every
    /// recheck: a changed text is put in use, an unchanged one is not
    /// parsed again (the settings in use, and their version, stay), a text
    /// that does not read keeps the settings in use and says why.
    #[test]
    fn flow_control_puts_changed_settings_in_use_and_skips_unchanged_ones() {
        use shardq_core::flow::{LocalGroupBuckets, FLOW_RECHECK_MS};
        let maps: Arc<dyn MapStore> = Arc::new(shardq_core::memory::MemoryMapStore::new(
            ShardMap::with_shards(shardq_route::Algorithm::Rendezvous, ["s0"]).unwrap(),
        ));
        let store = |f: &FlowSettings| {
            maps.store_setting(
                shardq_core::reshard::SETTING_FLOW,
                setting_text(f).unwrap().as_deref(),
            )
            .unwrap()
        };
        let mut many = FlowSettings::default();
        for i in 0..10_000 {
            many.prefixes.insert(
                format!("p{i}:"),
                shardq_core::FlowPolicy {
                    concurrency: 2,
                    ..Default::default()
                },
            );
        }
        store(&many);
        let flow = flow_control(&maps, Arc::new(LocalGroupBuckets::default())).unwrap();
        assert_eq!(*flow.settings(), many);
        let v = flow.version();
        let mut t = 0;
        let mut recheck = || {
            t += FLOW_RECHECK_MS;
            flow.refresh(t);
        };
        for _ in 0..5 {
            recheck();
        }
        assert_eq!(
            flow.version(),
            v,
            "unchanged settings are not put in use again"
        );
        let mut fewer = many.clone();
        fewer.prefixes.remove("p0:");
        store(&fewer);
        recheck();
        assert_eq!(*flow.settings(), fewer);
        assert_eq!(flow.version(), v + 1);
        maps.store_setting(shardq_core::reshard::SETTING_FLOW, Some("{"))
            .unwrap();
        recheck();
        assert_eq!(
            *flow.settings(),
            fewer,
            "a text that does not read changes nothing"
        );
        let err = flow.stats().last_error.expect("the error is kept");
        assert!(err.contains("flow"), "{err}");
        store(&many);
        recheck();
        assert_eq!(*flow.settings(), many);
    }

    /// A stored settings document carries its format version; one of
    /// another version, or with none, is refused naming both versions and
    /// the command that writes it again; a stored document reads back.
    #[test]
    fn settings_documents_carry_their_version_and_others_are_refused() {
        let mut f = FlowSettings::default();
        f.put_group(
            "g",
            shardq_core::GroupLimit {
                rate: None,
                burst: None,
                concurrency: Some(2),
            },
        )
        .unwrap();
        let text = setting_text(&f).unwrap().unwrap();
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc["version"], 1, "{text}");
        assert_eq!(read_flow(Some(&text)).unwrap(), f);
        assert_eq!(read_flow(None).unwrap(), FlowSettings::default());
        let old = text.replace(r#","version":1"#, "");
        assert!(!old.contains("version"), "{old}");
        let e = read_flow(Some(&old)).unwrap_err().to_string();
        assert!(
            e.contains("version none") && e.contains("version 1") && e.contains("policy reset"),
            "{e}"
        );
        let newer = text.replace(r#""version":1"#, r#""version":2"#);
        assert_ne!(newer, text);
        let e = read_flow(Some(&newer)).unwrap_err().to_string();
        assert!(e.contains("version 2") && e.contains("version 1"), "{e}");
        let e = read_retry(Some("[]")).unwrap_err().to_string();
        assert!(
            e.contains("does not parse") && e.contains("shardq retry set"),
            "{e}"
        );
        let r = RetrySettings::default();
        assert_eq!(
            setting_text(&r).unwrap(),
            None,
            "the defaults clear the setting"
        );
    }
}
