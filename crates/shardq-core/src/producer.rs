//! The producer: routes each job with the published shard map and enqueues
//! it, following map changes safely.
//!
//! A producer caches a [`Router`] and re-reads the map at most every
//! `refresh_ms` (the bound on how stale its routing may be when nothing
//! forces a reload). Staleness never misplaces a job: every enqueue carries
//! the map version it routed with, and a shard that no longer trusts that
//! version refuses it ([`QueueError::Fenced`]); the producer then reloads,
//! routes again and retries, waiting (bounded) for the new version to be
//! published. A key whose backlog a rebalance has moved to another shard
//! ([`QueueError::Moved`], before the switch is published) has its jobs sent
//! there at once, with the same map version, until the map changes: a move
//! never makes a producer wait. A key paused ([`QueueError::Paused`]) is
//! retried until `pause_wait_ms`; past that the caller gets
//! [`ProduceError::PausedTooLong`], never a silent drop.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use shardq_route::Router;
use thiserror::Error;

use crate::backend::{BackendLimits, QueueBackend};
use crate::clock::{Clock, SystemClock};
use crate::error::QueueError;
use crate::job::{JobId, NewJob};
use crate::reshard::{MapStore, ReshardError};

/// Default longest wait for a paused key (30 s): the specification's
/// migrations pause a key for about as long as its backlog takes to drain.
pub const PAUSE_WAIT_MS_DEFAULT: u64 = 30_000;
/// Default longest wait for a newer map after being fenced.
pub const FENCE_WAIT_MS_DEFAULT: u64 = 30_000;
/// How long a producer waits for a newer map after a fence before it
/// checks for a rebalance that died before publishing one
/// ([`crate::reshard::lift_orphaned_fence`]), and then between checks.
pub const ORPHAN_FENCE_AFTER_MS: u64 = 2_000;
/// Default interval between map freshness checks.
pub const REFRESH_MS_DEFAULT: u64 = 100;
/// Sleep between retries of a refused enqueue.
pub const RETRY_SLEEP_MS: u64 = 1;

/// Options of a [`Producer`].
#[derive(Debug, Clone)]
pub struct ProducerOptions {
    /// Longest wait for a paused key, in ms.
    pub pause_wait_ms: u64,
    /// Longest wait for a newer map after a fence, in ms.
    pub fence_wait_ms: u64,
    /// Re-read the map when the cached one is older than this, in ms.
    pub refresh_ms: u64,
    /// Time for the waits (a manual clock in simulations).
    pub clock: Arc<dyn Clock>,
    /// How long the backend remembers a job's dedup id, in ms (jobs with
    /// one go through [`RunJobs::enqueue_dedup`]).
    pub dedup_window_ms: u64,
}

impl Default for ProducerOptions {
    fn default() -> Self {
        ProducerOptions {
            pause_wait_ms: PAUSE_WAIT_MS_DEFAULT,
            fence_wait_ms: FENCE_WAIT_MS_DEFAULT,
            refresh_ms: REFRESH_MS_DEFAULT,
            clock: Arc::new(SystemClock),
            dedup_window_ms: crate::job::DEDUP_WINDOW_MS_DEFAULT,
        }
    }
}

/// Errors of a [`Producer`].
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProduceError {
    /// The backend refused the job for a reason retrying cannot fix.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The map could not be loaded.
    #[error(transparent)]
    Map(#[from] ReshardError),
    /// Keys stayed paused longer than the bound. Their jobs were NOT
    /// enqueued; every other job of the call was (see `placed`).
    #[error("keys {keys:?} stayed paused for more than {limit_ms} ms (the first on shard {shard:?}): they are being moved and their old shard has not drained; their jobs were NOT enqueued (the {placed_count} jobs of other keys were), retry later", placed_count = placed.len())]
    PausedTooLong {
        /// Every key given up on.
        keys: Vec<String>,
        /// Shard that paused the first of them.
        shard: String,
        /// The bound.
        limit_ms: u64,
        /// Where the other jobs of the call landed, in input order.
        placed: Vec<Placed>,
    },
    /// An error after some jobs of the call were already enqueued: they are
    /// listed, so a caller that retries does not enqueue them twice.
    #[error("{cause} ({} jobs of the call were enqueued before it; the rest were not)", placed.len())]
    Partial {
        /// Jobs enqueued before the error, in input order.
        placed: Vec<Placed>,
        /// The error.
        cause: Box<ProduceError>,
    },
    /// No newer map appeared after a fence.
    #[error("shard {shard:?} refuses map version {map_version} and no newer map was published within {waited_ms} ms; the job was NOT enqueued (is a rebalance stuck? rerun `shardq rebalance`)")]
    FencedTooLong {
        /// Refusing shard.
        shard: String,
        /// Our version.
        map_version: u64,
        /// How long we waited.
        waited_ms: u64,
    },
}

impl ProduceError {
    /// The kind of this error.
    pub fn kind(&self) -> crate::ErrorKind {
        match self {
            ProduceError::Queue(q) => q.kind(),
            ProduceError::Map(r) => r.kind(),
            ProduceError::PausedTooLong { .. } | ProduceError::FencedTooLong { .. } => {
                crate::ErrorKind::Retryable
            }
            ProduceError::Partial { cause, .. } => cause.kind(),
        }
    }
}

/// Where an enqueued job landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// Position of the job in the slice handed to the call.
    pub index: usize,
    /// Shard name (of the original job, for a duplicate).
    pub shard: String,
    /// Job id within the shard (of the original job, for a duplicate).
    pub id: JobId,
    /// Map version it was routed with.
    pub map_version: u64,
    /// True when the job was not stored: its `(key, dedup_id)` was, as
    /// `shard`/`id`.
    pub duplicate: bool,
}

/// Refused appends a producer met (and retried or gave up on), counted per
/// shard since the last [`Producer::take_refusals`]: one per append call
/// refused, which may hold several jobs. For metrics; plain counts, since a
/// producer is used by one caller at a time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refusals {
    /// Appends refused by the shard's fence (the map version was too old).
    pub fenced: BTreeMap<String, u64>,
    /// Appends refused because the key was paused for a move.
    pub paused: BTreeMap<String, u64>,
    /// Appends refused because the key's backlog had moved on (sent on to
    /// its new shard at once: not a wait).
    pub moved: BTreeMap<String, u64>,
}

impl Refusals {
    /// True when nothing was refused.
    pub fn is_empty(&self) -> bool {
        self.fenced.is_empty() && self.paused.is_empty() && self.moved.is_empty()
    }
}

/// Most keys whose shard a producer remembers (it forgets them all when
/// full, and whenever it loads another map version).
const ROUTE_CACHE_KEYS_MAX: usize = 1 << 16;
/// Most [`QueueError::Moved`] answers followed for one key in one call (a
/// key moved twice while this producer held one map); past it the key waits
/// as if paused, reloading the map.
pub const MOVED_HOPS_MAX: u32 = 4;

/// Routes and enqueues jobs; see the module docs.
pub struct Producer<B: QueueBackend + ?Sized> {
    backend: Arc<B>,
    store: Arc<dyn MapStore>,
    router: Router,
    /// Map index of recently routed keys, valid for `router` only: a
    /// tenant's jobs come again and again, and routing one (rendezvous,
    /// say) costs a hash per shard.
    route_cache: HashMap<Box<str>, usize, ahash::RandomState>,
    /// Keys a shard answered [`QueueError::Moved`] for, with the shard
    /// that holds them now: valid for `router` only, like `route_cache`.
    moved: HashMap<Box<str>, String, ahash::RandomState>,
    loaded_at_ms: u64,
    options: ProducerOptions,
    refusals: Refusals,
}

impl<B: QueueBackend + ?Sized> Producer<B> {
    /// A producer over `backend`, routing with the map in `store`.
    pub fn new(
        backend: Arc<B>,
        store: Arc<dyn MapStore>,
        options: ProducerOptions,
    ) -> Result<Self, ProduceError> {
        let router = Router::new(store.load()?).map_err(ReshardError::from)?;
        Ok(Producer {
            backend,
            store,
            router,
            route_cache: HashMap::default(),
            moved: HashMap::default(),
            loaded_at_ms: options.clock.now_ms(),
            options,
            refusals: Refusals::default(),
        })
    }

    /// The refusals met since the last call, and starts counting afresh.
    pub fn take_refusals(&mut self) -> Refusals {
        std::mem::take(&mut self.refusals)
    }

    /// The map version routing uses now.
    pub fn map_version(&self) -> u64 {
        self.router.version()
    }

    /// Re-reads the map; true if the version changed.
    pub fn reload(&mut self) -> Result<bool, ProduceError> {
        let map = self.store.load()?;
        self.loaded_at_ms = self.options.clock.now_ms();
        if map.version == self.router.version() {
            return Ok(false);
        }
        self.router = Router::new(map).map_err(ReshardError::from)?;
        self.route_cache.clear();
        self.moved.clear();
        Ok(true)
    }

    /// Re-reads the map if the cached one is older than `refresh_ms`.
    fn reload_if_stale(&mut self) -> Result<(), ProduceError> {
        if self
            .options
            .clock
            .now_ms()
            .saturating_sub(self.loaded_at_ms)
            >= self.options.refresh_ms
        {
            self.reload()?;
        }
        Ok(())
    }

    /// Sets how long the backend remembers the dedup ids of the jobs this
    /// producer enqueues from now on, in ms.
    pub fn set_dedup_window_ms(&mut self, window_ms: u64) {
        self.options.dedup_window_ms = window_ms;
    }

    /// The shard `key` routes to with the map in use (re-read when stale).
    pub fn shard_of(&mut self, key: &str) -> Result<String, ProduceError> {
        self.reload_if_stale()?;
        Ok(self.router.route(key).to_string())
    }

    /// Routes `job` and enqueues it; returns where it landed.
    pub fn enqueue(&mut self, job: &NewJob) -> Result<Placed, ProduceError> {
        let mut placed = self.enqueue_batch(std::slice::from_ref(job))?;
        placed.pop().ok_or_else(|| {
            ProduceError::Queue(QueueError::Internal {
                what: format!("the enqueue of key {:?} returned no placement", job.key),
            })
        })
    }

    /// Routes and enqueues `jobs`: one append per shard, so a durable
    /// backend fsyncs once per shard per call. Jobs of one key keep their
    /// order. A paused key's jobs are held back and retried (bounded) while
    /// the rest go ahead; on [`ProduceError::PausedTooLong`] every job of
    /// the other keys was enqueued and none of the named key's.
    pub fn enqueue_batch(&mut self, jobs: &[NewJob]) -> Result<Vec<Placed>, ProduceError> {
        let mut placed: Vec<Option<Placed>> = vec![None; jobs.len()];
        let done =
            |placed: Vec<Option<Placed>>| -> Vec<Placed> { placed.into_iter().flatten().collect() };
        match self.place_batch(jobs, &mut placed) {
            Ok(gave_up) if gave_up.is_empty() => Ok(done(placed)),
            Ok(gave_up) => {
                let shard = gave_up[0].1.clone();
                Err(ProduceError::PausedTooLong {
                    keys: gave_up.into_iter().map(|(k, _)| k).collect(),
                    shard,
                    limit_ms: self.options.pause_wait_ms,
                    placed: done(placed),
                })
            }
            Err(e) if placed.iter().any(Option::is_some) => Err(ProduceError::Partial {
                placed: done(placed),
                cause: Box::new(e),
            }),
            Err(e) => Err(e),
        }
    }

    /// The work of [`Producer::enqueue_batch`]: fills `placed` and returns
    /// the keys given up on (with the shard that paused them).
    fn place_batch(
        &mut self,
        jobs: &[NewJob],
        placed: &mut [Option<Placed>],
    ) -> Result<Vec<(String, String)>, ProduceError> {
        self.reload_if_stale()?;
        let clock = Arc::clone(&self.options.clock);
        let started_ms = clock.now_ms();
        let mut pending: Vec<usize> = (0..jobs.len()).collect();
        let mut call = Placing {
            jobs,
            placed,
            paused: BTreeSet::new(),
            paused_since: BTreeMap::new(),
            hops: BTreeMap::new(),
            gave_up: Vec::new(),
        };
        let mut fence_wait = FenceWait::default();
        while !pending.is_empty() {
            let version = self.router.version();
            // Taken out for this round (groups borrow it), put back after.
            let moved = std::mem::take(&mut self.moved);
            let groups = self.group_pending(jobs, &pending, &call.paused, &moved);
            let mut round = Round {
                version,
                limits: self.backend.limits(),
                retry: Vec::new(),
                fenced: None,
                new_moves: Vec::new(),
            };
            for ((dest, own), group) in groups {
                let shard = match dest {
                    Dest::At(at) => self.router.map().shards[at].name.clone(),
                    Dest::Moved(to) => to.to_string(),
                };
                self.send_group(&mut call, &mut round, &group, &shard, own)?;
            }
            self.keep_moves(moved, round.new_moves);
            round.retry.sort_unstable();
            pending = round.retry;
            if pending.is_empty() {
                break;
            }
            if let Some(shard) = round.fenced {
                if self.reload()? {
                    call.hops.clear();
                } else {
                    self.wait_out_fence(shard, version, started_ms, &mut fence_wait)?;
                }
            } else if pending.iter().all(|&i| call.paused.contains(&jobs[i].key)) {
                clock.sleep_ms(RETRY_SLEEP_MS);
                // Not a reload per retry: a pause is lifted together with a
                // raise of the old shard's fence (the retry is then Fenced
                // and reloads), or after a drain timeout with the key still
                // pinned there (the cached route stays right). Reading the
                // map every millisecond parsed it, thousands of pins and all
                // mid-rebalance, in every waiting producer.
                self.reload_if_stale()?;
            }
        }
        Ok(call.gave_up)
    }

    /// The pending jobs grouped by destination: one group per shard, and a
    /// group of its own for each paused key.
    fn group_pending<'a>(
        &mut self,
        jobs: &'a [NewJob],
        pending: &[usize],
        paused: &BTreeSet<String>,
        moved: &'a MovedKeys,
    ) -> BTreeMap<(Dest<'a>, Option<&'a str>), Vec<usize>> {
        // A paused key gets a group of its own so that its refusal does not
        // hold back the others.
        let mut groups: BTreeMap<(Dest<'a>, Option<&'a str>), Vec<usize>> = BTreeMap::new();
        for &i in pending {
            let key = jobs[i].key.as_str();
            let own = paused.contains(key).then_some(key);
            if let Some(to) = moved.get(key) {
                groups
                    .entry((Dest::Moved(to.as_str()), own))
                    .or_default()
                    .push(i);
                continue;
            }
            let at = self.route_index_cached(key);
            groups.entry((Dest::At(at), own)).or_default().push(i);
        }
        groups
    }

    /// The map index `key` routes to, remembered in `route_cache`.
    fn route_index_cached(&mut self, key: &str) -> usize {
        match self.route_cache.get(key) {
            Some(&at) => at,
            None => {
                let at = self.router.route_index(key.as_bytes());
                if self.route_cache.len() >= ROUTE_CACHE_KEYS_MAX {
                    self.route_cache.clear();
                }
                self.route_cache.insert(key.into(), at);
                at
            }
        }
    }

    /// Sends one group's jobs to `shard` part by part; from the first part
    /// refused on, the group goes to `round.retry` (unless given up on).
    fn send_group(
        &mut self,
        call: &mut Placing<'_>,
        round: &mut Round,
        group: &[usize],
        shard: &str,
        own: Option<&str>,
    ) -> Result<(), ProduceError> {
        // The backend's bounds per call: parts in order, so a key's jobs
        // still go in one after another; once a part is refused the later
        // ones are not sent (they go again with it), so none of them
        // overtakes it.
        let mut parts = split_by_limits(group, call.jobs, round.limits).into_iter();
        while let Some(idxs) = parts.next() {
            let batch: Vec<NewJob> = idxs.iter().map(|&i| call.jobs[i].clone()).collect();
            // A key refused for now (paused, or sent on too often), waited
            // on within the bound.
            let waits_on = match self.send(shard, round.version, &batch) {
                Ok(stored) => {
                    call.land(idxs, stored, round.version);
                    continue;
                }
                Err(e) => self.refused(e, shard, idxs, call, round)?,
            };
            if let Some(key) = waits_on {
                if self.wait_or_give_up(call, round, key, shard, own, idxs) {
                    // The later parts hold this key alone too.
                    break;
                }
            }
            // Refused: the rest of the group goes again with it.
            for rest in parts.by_ref() {
                round.retry.extend(rest);
            }
            break;
        }
        Ok(())
    }

    /// Books a refused part: counts the refusal and queues the part again
    /// when it can go at once (fenced, moved); returns the key to wait on
    /// (paused, or sent on too often).
    fn refused(
        &mut self,
        err: QueueError,
        shard: &str,
        idxs: &[usize],
        call: &mut Placing<'_>,
        round: &mut Round,
    ) -> Result<Option<String>, ProduceError> {
        match err {
            QueueError::Fenced { .. } => {
                *self.refusals.fenced.entry(shard.to_string()).or_default() += 1;
                round.fenced = Some(shard.to_string());
                round.retry.extend(idxs);
                Ok(None)
            }
            QueueError::Moved { key, to, .. } => {
                // Its backlog is on `to` now: its jobs go there at once, the
                // chunk's others again where they route (order kept: none of
                // the chunk went in).
                *self.refusals.moved.entry(shard.to_string()).or_default() += 1;
                let n = call.hops.entry(key.clone()).or_default();
                *n += 1;
                if *n <= MOVED_HOPS_MAX {
                    call.paused.remove(&key);
                    round.new_moves.push((key, to));
                    round.retry.extend(idxs);
                    Ok(None)
                } else {
                    // Sent on more often than any move sends a key: waited
                    // on as a pause is, and given up on after as long (never
                    // an endless loop).
                    Ok(Some(key))
                }
            }
            QueueError::Paused { key, .. } => {
                *self.refusals.paused.entry(shard.to_string()).or_default() += 1;
                Ok(Some(key))
            }
            // (The moved keys are forgotten: a shard tells them again.)
            e => Err(e.into()),
        }
    }

    /// Waits on `key`, refused for now: true when it is given up on (past
    /// the pause wait, in a group of its own), else marks it paused and
    /// queues the part again.
    fn wait_or_give_up(
        &self,
        call: &mut Placing<'_>,
        round: &mut Round,
        key: String,
        shard: &str,
        own: Option<&str>,
        idxs: &[usize],
    ) -> bool {
        let clock = &self.options.clock;
        let since_ms = *call
            .paused_since
            .entry(key.clone())
            .or_insert_with(|| clock.now_ms());
        // Give up only on a group that holds this key alone: a mixed group
        // is split next round, so the other keys' jobs still go in.
        if own == Some(key.as_str())
            && clock.now_ms().saturating_sub(since_ms) >= self.options.pause_wait_ms
        {
            if !call.gave_up.iter().any(|(k, _)| *k == key) {
                call.gave_up.push((key, shard.to_string()));
            }
            return true;
        }
        call.paused.insert(key);
        round.retry.extend(idxs);
        false
    }

    /// Puts `moved` back with this round's moved keys added (forgetting the
    /// old ones first when they would be too many).
    fn keep_moves(&mut self, moved: MovedKeys, new_moves: Vec<(String, String)>) {
        self.moved = moved;
        if self.moved.len() + new_moves.len() > ROUTE_CACHE_KEYS_MAX {
            self.moved.clear();
        }
        for (key, to) in new_moves {
            self.moved.insert(key.into(), to);
        }
    }
}

/// Keys a shard answered [`QueueError::Moved`] for, with the shard that
/// holds them now.
type MovedKeys = HashMap<Box<str>, String, ahash::RandomState>;

/// One call of [`Producer::place_batch`]: its jobs, where they landed, and
/// what it carries from round to round.
struct Placing<'a> {
    jobs: &'a [NewJob],
    placed: &'a mut [Option<Placed>],
    /// Keys refused for now: each gets a group of its own.
    paused: BTreeSet<String>,
    /// When each key waited on was first refused.
    paused_since: BTreeMap<String, u64>,
    /// [`QueueError::Moved`] answers followed per key.
    hops: BTreeMap<String, u32>,
    /// Keys given up on, with the shard that refused them.
    gave_up: Vec<(String, String)>,
}

impl Placing<'_> {
    /// Records where the jobs of an accepted part landed (their keys are no
    /// longer paused).
    fn land(&mut self, idxs: &[usize], stored: Vec<crate::job::Stored>, version: u64) {
        for (&i, st) in idxs.iter().zip(stored) {
            self.placed[i] = Some(Placed {
                index: i,
                shard: st.shard,
                id: st.id,
                map_version: version,
                duplicate: st.duplicate,
            });
            self.paused.remove(&self.jobs[i].key);
        }
    }
}

/// One round of [`Producer::place_batch`]: what it sends with, and what it
/// leaves for the next.
struct Round {
    /// The map version the round routes with.
    version: u64,
    /// The backend's bounds per call.
    limits: BackendLimits,
    /// Jobs to send again.
    retry: Vec<usize>,
    /// A shard that refused the round's map version.
    fenced: Option<String>,
    /// Keys a shard said moved, with the shard that holds them now.
    new_moves: Vec<(String, String)>,
}

/// How long one call has waited on fences: since the first fence it met,
/// and when it last tried to lift an orphaned one (ms after that).
#[derive(Debug, Default)]
struct FenceWait {
    since_ms: Option<u64>,
    last_heal_ms: u64,
}

impl<B: QueueBackend + ?Sized> Producer<B> {
    /// One append of `batch` to `shard` (through the dedup path when any
    /// job carries a dedup id).
    fn send(
        &self,
        shard: &str,
        version: u64,
        batch: &[NewJob],
    ) -> Result<Vec<crate::job::Stored>, QueueError> {
        if batch.iter().any(|j| j.dedup_id.is_some()) {
            return self
                .backend
                .enqueue_dedup(shard, version, batch, self.options.dedup_window_ms);
        }
        let ids = self.backend.enqueue(shard, version, batch)?;
        Ok(ids
            .into_iter()
            .map(|id| crate::job::Stored {
                id,
                shard: shard.to_string(),
                duplicate: false,
            })
            .collect())
    }

    /// After a fence with no newer map to follow: a fence no map follows
    /// for a while may be one a rebalance left as it died between the two,
    /// lifted when no rebalance runs (at most one try per
    /// [`ORPHAN_FENCE_AFTER_MS`], counted from the first fence this call
    /// met); past the fence wait the call gives up; else a short sleep
    /// before the next try.
    fn wait_out_fence(
        &mut self,
        shard: String,
        version: u64,
        started_ms: u64,
        wait: &mut FenceWait,
    ) -> Result<(), ProduceError> {
        let clock = Arc::clone(&self.options.clock);
        let waited_ms = clock.now_ms().saturating_sub(started_ms);
        let fenced_ms = clock
            .now_ms()
            .saturating_sub(*wait.since_ms.get_or_insert(clock.now_ms()));
        if fenced_ms >= ORPHAN_FENCE_AFTER_MS
            && fenced_ms >= wait.last_heal_ms.saturating_add(ORPHAN_FENCE_AFTER_MS)
        {
            wait.last_heal_ms = fenced_ms;
            // Its failure (a shard not answering) changes nothing: the wait
            // goes on.
            if matches!(
                crate::reshard::lift_orphaned_fence(&*self.backend, &*self.store),
                Ok(true)
            ) {
                self.reload()?;
                return Ok(());
            }
        }
        if waited_ms >= self.options.fence_wait_ms {
            return Err(ProduceError::FencedTooLong {
                shard,
                map_version: version,
                waited_ms,
            });
        }
        clock.sleep_ms(RETRY_SLEEP_MS);
        Ok(())
    }
}

/// Where a group of jobs goes: a shard of the map by index, or the shard a
/// key's backlog moved to (by name: it may be missing from an old map).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Dest<'a> {
    At(usize),
    Moved(&'a str),
}

/// `group` (indexes into `jobs`) in order, cut into parts within the
/// backend's bounds per call (a part holds at least one job).
fn split_by_limits<'a>(
    group: &'a [usize],
    jobs: &[NewJob],
    limits: BackendLimits,
) -> Vec<&'a [usize]> {
    let jobs_max = limits.enqueue_batch_jobs_max.max(1);
    let mut parts = Vec::new();
    let (mut start, mut bytes) = (0usize, 0usize);
    for (n, &i) in group.iter().enumerate() {
        // A dedup id adds its bytes and fields to the job's record (counted
        // generously, as the separate record it once was).
        let size = jobs[i].payload.len()
            + jobs[i].key.len()
            + jobs[i]
                .dedup_id
                .as_ref()
                .map_or(0, |d| d.len() + jobs[i].key.len() + 64);
        let count = n - start;
        if count > 0 && (count >= jobs_max || bytes + size > limits.enqueue_batch_bytes_max) {
            parts.push(&group[start..n]);
            start = n;
            bytes = 0;
        }
        bytes += size;
    }
    if start < group.len() {
        parts.push(&group[start..]);
    }
    parts
}

#[cfg(test)]
mod tests {
    use crate::backend::MoveKeys;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use shardq_route::{Algorithm, ShardMap};

    use super::*;
    use crate::memory::{MemoryBackend, MemoryMapStore};
    use crate::SystemClock;

    /// A map store that counts loads.
    struct Counting {
        inner: MemoryMapStore,
        loads: AtomicUsize,
    }

    impl MapStore for Counting {
        fn load(&self) -> Result<shardq_route::ShardMap, ReshardError> {
            self.loads.fetch_add(1, Ordering::SeqCst);
            self.inner.load()
        }
        fn publish(&self, map: &ShardMap, expected: u64) -> Result<(), ReshardError> {
            self.inner.publish(map, expected)
        }
        fn load_target(&self) -> Result<Option<ShardMap>, ReshardError> {
            self.inner.load_target()
        }
        fn store_target(&self, target: &ShardMap) -> Result<(), ReshardError> {
            self.inner.store_target(target)
        }
        fn clear_target(&self, reached: &ShardMap) -> Result<bool, ReshardError> {
            self.inner.clear_target(reached)
        }
        fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, ReshardError> {
            self.inner.try_lock_rebalance()
        }
    }

    #[test]
    fn batches_are_cut_by_the_backends_bounds_in_order() {
        let jobs: Vec<NewJob> = ["aa", "bbbb", "c", "dddddd", "e"]
            .iter()
            .map(|p| NewJob::new("k", *p))
            .collect();
        let all: Vec<usize> = (0..jobs.len()).collect();
        let check = |jobs_max: usize, bytes_max: usize, want: &[&[usize]]| {
            let limits = BackendLimits {
                enqueue_batch_jobs_max: jobs_max,
                enqueue_batch_bytes_max: bytes_max,
                ..BackendLimits::default()
            };
            assert_eq!(split_by_limits(&all, &jobs, limits), want, "{limits:?}");
        };
        check(usize::MAX, usize::MAX, &[&[0, 1, 2, 3, 4]]);
        check(2, usize::MAX, &[&[0, 1], &[2, 3], &[4]]);
        // Key "k" is one byte of each job: sizes 3, 5, 2, 7, 2.
        check(usize::MAX, 8, &[&[0, 1], &[2], &[3], &[4]]);
        // A job over the bytes bound still goes, alone (the backend says why).
        check(usize::MAX, 1, &[&[0], &[1], &[2], &[3], &[4]]);
    }

    #[test]
    fn a_remembered_route_is_forgotten_when_the_map_changes() {
        let backend = Arc::new(MemoryBackend::new(&["s0", "s1"], Arc::new(SystemClock)));
        let map = ShardMap::with_shards(Algorithm::Rendezvous, ["s0", "s1"]).unwrap();
        let store = Arc::new(MemoryMapStore::new(map.clone()));
        let mut producer = Producer::new(
            Arc::clone(&backend),
            store.clone(),
            ProducerOptions::default(),
        )
        .unwrap();
        let first = producer.enqueue(&NewJob::new("k", "1")).unwrap();
        assert_eq!(
            producer.enqueue(&NewJob::new("k", "2")).unwrap().shard,
            first.shard
        );
        // Pin the key to the other shard: the next map version routes it there.
        let other = if first.shard == "s0" { "s1" } else { "s0" };
        let mut next = map.clone();
        next.version += 1;
        next.overrides.insert("k".into(), other.into());
        store.publish(&next, map.version).unwrap();
        assert!(producer.reload().unwrap());
        assert_eq!(
            producer.enqueue(&NewJob::new("k", "3")).unwrap().shard,
            other
        );
    }

    #[test]
    fn waiting_for_a_paused_key_does_not_reread_the_map_every_retry() {
        let backend = Arc::new(MemoryBackend::new(&["s0", "s1"], Arc::new(SystemClock)));
        let map = ShardMap::with_shards(Algorithm::Rendezvous, ["s0", "s1"]).unwrap();
        let shard = Router::new(map.clone()).unwrap().route("k").to_string();
        let store = Arc::new(Counting {
            inner: MemoryMapStore::new(map),
            loads: AtomicUsize::new(0),
        });
        let mut fence = backend.fence(&shard).unwrap();
        fence.paused_keys.insert("k".into());
        backend.set_fence(&shard, &fence).unwrap();
        let options = ProducerOptions {
            pause_wait_ms: 100,
            refresh_ms: 60_000,
            ..ProducerOptions::default()
        };
        let mut producer = Producer::new(Arc::clone(&backend), store.clone(), options).unwrap();
        let err = producer.enqueue(&NewJob::new("k", "x")).unwrap_err();
        assert!(matches!(err, ProduceError::PausedTooLong { .. }), "{err}");
        // One load when the producer was built; ~100 retries read nothing.
        assert_eq!(store.loads.load(Ordering::SeqCst), 1);
        // Every refused append is counted for the shard that refused it.
        let refusals = producer.take_refusals();
        assert!(refusals.fenced.is_empty(), "{refusals:?}");
        assert!(
            refusals.paused.get(&shard).is_some_and(|&n| n >= 2),
            "{refusals:?}"
        );
        assert!(producer.take_refusals().is_empty());
    }
}
