//! The in-memory view of one shard, rebuilt by replaying its log: per-key
//! queues, in-flight heads, dead jobs, a scheduler of claimable keys, and
//! per segment the count of unfinished jobs and the other segments whose jobs
//! its records refer to (for compaction).
//!
//! Reclaimed ranges hold only finished jobs: their enqueues are skipped and
//! records referring to them are ignored silently, unlike references into a
//! repair hole or to unknown jobs.
//!
//! Every process that reads a shard keeps one; only the owner claims from it.
//! It must never do I/O: the log feeds it records and writes what it picks.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use shardq_core::flow::{FairQueue, Rank};
use shardq_core::{
    Admit, DeadJob, DeadPolicy, FlowControl, JobId, KeyCounts, KeyHold, ShardStats,
    KEY_HOLD_SCAN_JOBS,
};

/// The hasher of maps keyed by text a producer chose (keys, dedup ids):
/// seeded at random per process, so colliding keys cannot be crafted.
type TextHash = ahash::RandomState;

/// The hasher of maps keyed by job id: XXH3 of the id's 8 bytes, the value
/// `xxhash_rust::xxh3::Xxh3Builder` gives (so the maps keep their layout and
/// order), computed in one call. `Xxh3Builder` makes a streaming hasher per
/// hash, copying its 192-byte secret and buffering the bytes, which cost
/// several times the hash itself on the paths that touch these maps once or
/// more a job (a move's purge of a million jobs, every ack).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IdHash;

impl std::hash::BuildHasher for IdHash {
    type Hasher = IdHasher;

    #[inline]
    fn build_hasher(&self) -> IdHasher {
        IdHasher { hash: None }
    }
}

/// See [`IdHash`]. A job id is hashed by one `write_u64`, whose value is the
/// one XXH3 gives its bytes; any other input (the maps take none) hashes
/// each write as XXH3 seeded with the hash so far.
pub(crate) struct IdHasher {
    hash: Option<u64>,
}

impl std::hash::Hasher for IdHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        self.hash = Some(match self.hash {
            None => xxhash_rust::xxh3::xxh3_64(bytes),
            Some(h) => xxhash_rust::xxh3::xxh3_64_with_seed(bytes, h),
        });
    }

    #[inline]
    fn write_u64(&mut self, id: u64) {
        self.write(&id.to_ne_bytes());
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash.unwrap_or_else(|| xxhash_rust::xxh3::xxh3_64(&[]))
    }
}

use crate::log::Replay;
use crate::reclaim::Reclaimed;
use crate::record::Record;

/// A pending job: 24 bytes. The key and payload stay on disk and are read
/// back by position when the job is claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub id: u64,
    pub not_before_ms: u64,
    pub attempt: u32,
    pub max_attempts: u32,
}

#[derive(Debug, Default)]
struct KeyState {
    key: Box<str>,
    /// Its live jobs that are not dead, running or not, in id order: a
    /// run that fails keeps its place, so its retry goes before the key's
    /// later jobs. The runs are those of `in_flight_ids`.
    queue: VecDeque<Slot>,
    /// Jobs of `queue` in flight.
    running: u32,
    /// Runs at once the key's policy allowed when last asked (0 means 1):
    /// a key at it is not scheduled until a run ends or the policy changes.
    limit: u32,
    /// Jobs of the key picked by the pick going on (0 between picks).
    picked: u32,
    dead: u32,
    /// In `ready` or `timers` (at most once).
    scheduled: bool,
    /// Flow control refused the key until then (this process's memory
    /// only: the limit is asked again after a restart).
    held_until_ms: u64,
    /// What the attempts of its jobs that have made some left: their start
    /// times and the last failure's reason, by job (usually one entry: the
    /// head; a dead letter retried in front of a retried head makes two).
    history: Vec<Attempts>,
}

/// The attempts of one job: when each started, and why the last one failed.
#[derive(Debug, Default)]
struct Attempts {
    job: u64,
    starts: Vec<u64>,
    reason: Option<Box<str>>,
}

impl KeyState {
    /// Whether the key runs as many jobs as it may (counting those picked
    /// by the pick going on).
    fn full(&self) -> bool {
        self.running + self.picked >= self.limit.max(1)
    }

    /// The job the key starts next, with its index: the first of the
    /// queue that is not running, past the first `picked` such (picked
    /// already by the pick going on).
    fn next_slot(
        &self,
        in_flight: &HashMap<u64, Run, IdHash>,
        picked: u32,
    ) -> Option<(usize, Slot)> {
        if self.running == 0 {
            return self
                .queue
                .get(picked as usize)
                .map(|s| (picked as usize, *s));
        }
        (self.queue.iter().enumerate())
            .filter(|(_, s)| !in_flight.contains_key(&s.id))
            .nth(picked as usize)
            .map(|(i, s)| (i, *s))
    }

    fn attempts_of(&self, id: u64) -> Option<&Attempts> {
        self.history.iter().find(|a| a.job == id)
    }

    fn attempts_mut(&mut self, id: u64) -> &mut Attempts {
        let i = match self.history.iter().position(|a| a.job == id) {
            Some(i) => i,
            None => {
                self.history.push(Attempts {
                    job: id,
                    ..Attempts::default()
                });
                self.history.len() - 1
            }
        };
        &mut self.history[i]
    }

    /// Job `id` left its key's queue (acked, dead, cancelled, purged).
    fn take_attempts(&mut self, id: u64) -> Option<Attempts> {
        let i = self.history.iter().position(|a| a.job == id)?;
        Some(self.history.swap_remove(i))
    }

    /// The last failure's reason of job `id`, if it was retried.
    fn reason_of(&self, id: u64) -> Option<&str> {
        self.attempts_of(id).and_then(|a| a.reason.as_deref())
    }

    /// The start times of job `id`'s attempts.
    fn starts_of(&self, id: u64) -> &[u64] {
        self.attempts_of(id).map_or(&[], |a| &a.starts)
    }
}

#[derive(Debug)]
struct DeadEntry {
    key: u32,
    slot: Slot,
    reason: Box<str>,
    /// When its attempts started, as far as the log tells.
    starts: Box<[u64]>,
}

/// The current run of an in-flight job.
#[derive(Debug, Clone, Copy)]
struct Run {
    key: u32,
    fence: u64,
    /// When the run's job lease ends (ms); `u64::MAX` for runs replayed
    /// from the log (only the owner that started a run times it, and a new
    /// owner ends every replayed run at adopt).
    lease_until_ms: u64,
    /// Cancelled while it ran (a CancelRun record): results are refused,
    /// and the owner deletes the job when the run's job lease lapses.
    cancelled: bool,
}

/// An in-flight run as the owner checks receipts against it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunInfo<'a> {
    pub key: &'a str,
    pub attempt: u32,
    pub max_attempts: u32,
    pub fence: u64,
    pub lease_until_ms: u64,
    pub cancelled: bool,
}

/// Where job `id` is in a key's queue, which is in id order (jobs are
/// appended in id order, a failed run's job keeps its place and a dead job
/// retried goes back to its place): the head is checked, the rest searched
/// by halves.
fn queue_position(q: &VecDeque<Slot>, id: u64) -> Option<usize> {
    if q.front()?.id == id {
        return Some(0);
    }
    let i = q.partition_point(|s| s.id < id);
    (q.get(i)?.id == id).then_some(i)
}

/// A live job as [`ShardState::live_job`] finds it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LiveJob<'a> {
    pub key: &'a str,
    pub slot: Slot,
    /// Its run in flight: fence and job lease deadline (`u64::MAX` for a
    /// run this process only replayed).
    pub run: Option<(u64, u64)>,
    /// A dead letter (its reason is `reason`).
    pub dead: bool,
    /// The reason its last attempt failed, for a job retried (or dead).
    pub reason: Option<&'a str>,
    /// When its attempts started (those the log recorded), oldest first.
    pub starts: &'a [u64],
    /// Where its payload is when a debounce gave it one.
    pub payload_at: Option<u64>,
}

/// A job picked for claiming.
#[derive(Debug, Clone)]
pub(crate) struct Pick {
    pub id: u64,
    pub key: Box<str>,
    pub attempt: u32,
    pub max_attempts: u32,
    pub not_before_ms: u64,
    /// The run's fence.
    pub fence: u64,
}

/// What a claim's picks need for their runs: the shard's name, when their
/// leases end, and the fences (`next_fence(now_us, last, floor)` each, the
/// last one handed out kept in `last`).
pub(crate) struct RunFences<'a> {
    pub shard: &'a str,
    pub lease_until_ms: u64,
    pub now_us: u64,
    pub last: u64,
    pub floor: u64,
}

/// Compaction's view of one segment.
#[derive(Debug, Default)]
struct SegInfo {
    /// Unfinished jobs enqueued in it.
    live: u64,
    /// Bases of earlier segments holding jobs its records refer to (claims,
    /// acks, fails, dead changes); usually one or two. The file must be
    /// kept until those are reclaimed, or replay would miss the records.
    refs: Vec<u64>,
    /// Latest expiry of the dedup records in it: the file is kept until
    /// then, so the records survive restarts for their window.
    dedup_until_ms: u64,
}

/// A live dedup record of the shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DedupEntry {
    /// The job's id on `shard`.
    pub job: u64,
    /// Forgotten at this time.
    pub expires_ms: u64,
    /// The shard holding the job; `None` for this shard.
    pub shard: Option<Box<str>>,
}

/// The index key of `(key, id)`: a key holds no control character, so
/// NUL separates them unambiguously.
pub(crate) fn dedup_slot(key: &str, id: &str) -> Box<str> {
    let mut s = String::with_capacity(key.len() + id.len() + 1);
    s.push_str(key);
    s.push('\0');
    s.push_str(id);
    s.into_boxed_str()
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct ShardState {
    keys: Vec<KeyState>,
    /// Key -> slot in `keys`; hashed with XXH3 (fast on short keys, and the
    /// project never uses `DefaultHasher`).
    index: HashMap<Box<str>, u32, TextHash>,
    free_keys: Vec<u32>,
    dead: BTreeMap<u64, DeadEntry>,
    ready: VecDeque<u32>,
    /// Ready keys by priority and weight, while flow control ranks keys
    /// (else `ready` is used, round robin).
    fair: FairQueue<u32>,
    timers: BinaryHeap<Reverse<(u64, u32)>>,
    /// Per segment base, of segments that enqueued or referred to a job.
    segs: BTreeMap<u64, SegInfo>,
    /// Ranges whose jobs are all finished (recorded, plus everything below
    /// the first segment kept).
    reclaimed: Reclaimed,
    /// Ranges cut out by repair: references into them are to lost jobs.
    holes: Vec<(u64, u64)>,
    in_flight_ids: HashMap<u64, Run, IdHash>,
    /// The key (slot in `keys`) of every job in a key's queue, so a job is
    /// found by id without a walk of every key ([`ShardState::live_job`]).
    job_keys: crate::id_index::IdIndex,
    /// Largest run fence seen in a claim record (or recorded with the
    /// reclaimed ranges, for claims in deleted segments).
    fence_high: u64,
    policy: DeadPolicy,
    /// Slots in all key queues (in-flight heads included).
    queued: u64,
    /// No queued slot has a later start time than this (an upper bound,
    /// reset when the queues empty): once it has passed, every waiting job
    /// is ready and [`ShardState::stats`] needs no walk over the jobs.
    not_before_max_ms: u64,
    /// Dedup records by [`dedup_slot`], with their expiries in time order
    /// for pruning.
    dedup: HashMap<Arc<str>, DedupEntry, TextHash>,
    dedup_expiries: BinaryHeap<Reverse<(u64, Arc<str>)>>,
    /// Per (shard copied from, key), the largest source id imported, from
    /// the Import records replayed (the backend keeps it in a file too, for
    /// when those records' segments are gone).
    /// By shard, then key: looked up by `&str` without building a key (an
    /// import replays this for every job it copies).
    imported: HashMap<Box<str>, HashMap<Box<str>, u64, TextHash>, TextHash>,
    /// Keys a pick passed by because they were sealed for a move; a later
    /// pick schedules them again once they are not.
    parked: Vec<Box<str>>,
    /// Jobs whose run was cancelled and that a new owner found in flight:
    /// never picked; the owner writes a Cancel record for each.
    cancel_pending: Vec<u64>,
    /// The [`FlowControl::version`] of the settings keys' `limit` follow.
    flow_version: u64,
    /// Waiting jobs whose wait a handler's back-off set (a BackOff record),
    /// with its end: what `key resume` lifts. A job leaves it when it is
    /// claimed again, resumed, cancelled or purged.
    backed_off: HashMap<u64, u64, IdHash>,
    /// Keyed jobs (unique, debounced) by [`dedup_slot`] of key and id: the
    /// newest job stored with the id and its enqueue time. A keyed enqueue
    /// meets it while it is live; it leaves when the job finishes.
    keyed: HashMap<Box<str>, (u64, u64), TextHash>,
    /// The slot in `keyed` of each keyed job.
    keyed_of: HashMap<u64, Box<str>, IdHash>,
    /// Debounced jobs whose payload is a Debounce record's: the record's
    /// position. Its segment counts the job as live until the job
    /// finishes or a newer Debounce record takes over.
    payload_at: HashMap<u64, u64, IdHash>,
}

impl ShardState {
    /// A state for a log whose deleted segments are `reclaimed` (the log
    /// refuses to open when a deleted prefix is not recorded there).
    pub fn new(reclaimed: &Reclaimed, policy: DeadPolicy) -> ShardState {
        let reclaimed = reclaimed.clone();
        let fence_high = reclaimed.fence_high();
        ShardState {
            keys: Vec::new(),
            index: HashMap::with_hasher(TextHash::new()),
            free_keys: Vec::new(),
            dead: BTreeMap::new(),
            ready: VecDeque::new(),
            fair: FairQueue::default(),
            timers: BinaryHeap::new(),
            segs: BTreeMap::new(),
            reclaimed,
            holes: Vec::new(),
            in_flight_ids: HashMap::with_hasher(IdHash),
            job_keys: crate::id_index::IdIndex::default(),
            fence_high,
            policy,
            queued: 0,
            not_before_max_ms: 0,
            dedup: HashMap::with_hasher(TextHash::new()),
            dedup_expiries: BinaryHeap::new(),
            imported: HashMap::with_hasher(TextHash::new()),
            parked: Vec::new(),
            cancel_pending: Vec::new(),
            flow_version: 0,
            backed_off: HashMap::with_hasher(IdHash),
            keyed: HashMap::with_hasher(TextHash::new()),
            keyed_of: HashMap::with_hasher(IdHash),
            payload_at: HashMap::with_hasher(IdHash),
        }
    }

    /// The key's newest job stored with keyed id `id`, if it is live and
    /// not dead.
    pub fn keyed_live(&self, key: &str, id: &str) -> Option<shardq_core::KeyedLive> {
        let &(job, created_ms) = self.keyed.get(&*dedup_slot(key, id))?;
        self.slot_of(key, job)?;
        Some(shardq_core::KeyedLive {
            job: shardq_core::JobId(job),
            created_ms,
            running: self.in_flight_ids.contains_key(&job),
        })
    }

    /// Where a debounced job's payload is now (a Debounce record), if not
    /// in its own record.
    pub fn payload_at(&self, job: u64) -> Option<u64> {
        self.payload_at.get(&job).copied()
    }

    /// Notes keyed job `job` of `key` (enqueued at `created_ms`) as the
    /// newest with its id.
    fn note_keyed(&mut self, job: u64, key: &str, id: &str, created_ms: u64) {
        let slot = dedup_slot(key, id);
        self.keyed_of.insert(job, slot.clone());
        self.keyed.insert(slot, (job, created_ms));
    }

    /// Counts one more (`+1`) or one fewer live holder of the segment that
    /// holds position `pos`.
    fn seg_live_at(&mut self, pos: u64, up: bool) {
        if let Some((_, seg)) = self.segs.range_mut(..=pos).next_back() {
            seg.live = if up {
                seg.live + 1
            } else {
                seg.live.saturating_sub(1)
            };
        }
    }

    /// Every (shard copied from, key, largest source id imported), as
    /// replayed.
    pub fn imported(&self) -> impl Iterator<Item = (&str, &str, u64)> + '_ {
        self.imported.iter().flat_map(|(from, keys)| {
            keys.iter()
                .map(move |(key, &up_to)| (&**from, &**key, up_to))
        })
    }

    /// The largest source id imported from `from` for `key`, as replayed.
    pub fn imported_up_to(&self, from: &str, key: &str) -> Option<u64> {
        self.imported.get(from)?.get(key).copied()
    }

    /// `key`'s jobs not in flight, queued and dead, with an id above
    /// `after`, in id order, at most `max`: (slot, dead reason).
    pub fn key_jobs(&self, key: &str, after: Option<u64>, max: usize) -> Vec<(Slot, Option<&str>)> {
        let Some(k) = self.lookup(key) else {
            return Vec::new();
        };
        let ks = &self.keys[k as usize];
        let above = |id: u64| after.is_none_or(|a| id > a);
        // The queue is in id order: the first job above `after` is found
        // by halves, not by a walk from the head (a chunk of a million-job
        // export reads what it returns, not the backlog).
        let mut out: Vec<(Slot, Option<&str>)> = Vec::new();
        let waiting = |s: &&Slot| ks.running == 0 || !self.in_flight_ids.contains_key(&s.id);
        let (a, b) = ks.queue.as_slices();
        let start = |part: &[Slot]| part.partition_point(|s| !above(s.id));
        for part in [a, b] {
            out.extend(
                (part[start(part)..].iter())
                    .filter(waiting)
                    .take(max)
                    .map(|s| (*s, None)),
            );
        }
        if ks.dead > 0 {
            let from = after.map_or(0, |a| a.saturating_add(1));
            out.extend(
                self.dead
                    .range(from..)
                    .filter(|(_, e)| e.key == k)
                    .take(max)
                    .map(|(_, e)| (e.slot, Some(&*e.reason))),
            );
        }
        if out.len() > max {
            // The `max` lowest ids, without sorting all.
            out.select_nth_unstable_by_key(max, |(s, _)| s.id);
            out.truncate(max);
        }
        out.sort_unstable_by_key(|(s, _)| s.id);
        out
    }

    /// Jobs to delete before picking, with their keys: cancelled runs a
    /// new owner found in flight.
    pub fn cancel_pending(&self) -> Vec<(u64, &str)> {
        self.cancel_pending
            .iter()
            .filter_map(|&id| {
                self.keys
                    .iter()
                    .find(|ks| queue_position(&ks.queue, id).is_some())
                    .map(|ks| (id, &*ks.key))
            })
            .collect()
    }

    /// The live job `id` (queued, delayed, running or dead), found by the
    /// runs in flight, the dead letters and each key's queue (kept in id
    /// order); `None` when no live job has that id.
    pub fn live_job(&self, id: u64) -> Option<LiveJob<'_>> {
        if let Some(run) = self.in_flight_ids.get(&id) {
            let ks = &self.keys[run.key as usize];
            let i = queue_position(&ks.queue, id)?;
            return Some(LiveJob {
                key: &ks.key,
                slot: ks.queue[i],
                run: Some((run.fence, run.lease_until_ms)),
                dead: false,
                reason: ks.reason_of(id),
                starts: ks.starts_of(id),
                payload_at: self.payload_at(id),
            });
        }
        if let Some(e) = self.dead.get(&id) {
            return Some(LiveJob {
                key: &self.keys[e.key as usize].key,
                slot: e.slot,
                run: None,
                dead: true,
                reason: Some(&e.reason),
                starts: &e.starts,
                payload_at: self.payload_at(id),
            });
        }
        let ks = &self.keys[self.job_keys.get(id)? as usize];
        let i = queue_position(&ks.queue, id)?;
        Some(LiveJob {
            key: &ks.key,
            slot: ks.queue[i],
            run: None,
            dead: false,
            reason: ks.reason_of(id),
            starts: ks.starts_of(id),
            payload_at: self.payload_at(id),
        })
    }

    /// Up to `max` of `key`'s live jobs (its run in flight, queued, delayed
    /// and dead), in id order.
    pub fn key_live_jobs(&self, key: &str, max: usize) -> Vec<LiveJob<'_>> {
        let Some(k) = self.lookup(key) else {
            return Vec::new();
        };
        let ks = &self.keys[k as usize];
        // The queue is in id order but for a retried dead letter ahead of
        // a retried head (see `KeyState::queue`): its first `max + 2` hold
        // the `max` lowest ids, so a read costs what it returns.
        let mut out: Vec<LiveJob<'_>> = ks
            .queue
            .iter()
            .take(max.saturating_add(2))
            .map(|s| LiveJob {
                key: &ks.key,
                slot: *s,
                run: (ks.running > 0)
                    .then(|| self.in_flight_ids.get(&s.id))
                    .flatten()
                    .map(|r| (r.fence, r.lease_until_ms)),
                dead: false,
                reason: ks.reason_of(s.id),
                starts: ks.starts_of(s.id),
                payload_at: self.payload_at(s.id),
            })
            .collect();
        if ks.dead > 0 {
            out.extend(
                self.dead
                    .iter()
                    .filter(|(_, e)| e.key == k)
                    .take(max)
                    .map(|(_, e)| LiveJob {
                        key: &ks.key,
                        slot: e.slot,
                        run: None,
                        dead: true,
                        reason: Some(&e.reason),
                        starts: &e.starts,
                        payload_at: self.payload_at(e.slot.id),
                    }),
            );
        }
        out.sort_unstable_by_key(|j| j.slot.id);
        out.truncate(max);
        out
    }

    /// Forgets the dedup records expired at `now_ms`.
    pub fn prune_dedup(&mut self, now_ms: u64) {
        while let Some(Reverse((at, _))) = self.dedup_expiries.peek() {
            if *at > now_ms {
                break;
            }
            let Some(Reverse((at, slot))) = self.dedup_expiries.pop() else {
                break;
            };
            if self.dedup.get(&*slot).is_some_and(|e| e.expires_ms == at) {
                self.dedup.remove(&*slot);
            }
        }
    }

    /// The live record of `(key, id)` at `now_ms`.
    pub fn dedup_lookup(&self, key: &str, id: &str, now_ms: u64) -> Option<&DedupEntry> {
        thread_local! {
            // The slot text of a lookup, built here with no allocation per
            // call (one per enqueued job with an id).
            static SLOT: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
        }
        SLOT.with_borrow_mut(|slot| {
            slot.clear();
            slot.push_str(key);
            slot.push('\0');
            slot.push_str(id);
            self.dedup.get(slot.as_str())
        })
        .filter(|e| e.expires_ms > now_ms)
    }

    /// The live records at `now_ms`: (key, id, entry), for a key or all.
    pub fn dedup_records(&self, key: Option<&str>, now_ms: u64) -> Vec<(&str, &str, &DedupEntry)> {
        self.dedup
            .iter()
            .filter(|(_, e)| e.expires_ms > now_ms)
            .filter_map(|(slot, e)| {
                let (k, id) = slot.split_once('\0')?;
                key.is_none_or(|want| want == k).then_some((k, id, e))
            })
            .collect()
    }

    /// Latest expiry of the dedup records in the segment at `base`.
    pub fn dedup_until_ms(&self, base: u64) -> u64 {
        self.segs.get(&base).map_or(0, |s| s.dedup_until_ms)
    }

    fn slot_added(&mut self, id: u64, k: u32, not_before_ms: u64) {
        self.queued += 1;
        self.not_before_max_ms = self.not_before_max_ms.max(not_before_ms);
        self.job_keys.insert(id, k);
    }

    fn slot_removed(&mut self, id: u64) {
        self.job_keys.remove(id);
        self.slot_left();
    }

    /// A slot left the queues (its entry in `job_keys` removed apart).
    fn slot_left(&mut self) {
        self.queued -= 1;
        if self.queued == 0 {
            self.not_before_max_ms = 0;
        }
    }

    fn key_index(&mut self, key: &str) -> u32 {
        if let Some(&k) = self.index.get(key) {
            return k;
        }
        let ks = KeyState {
            key: key.into(),
            ..KeyState::default()
        };
        let k = match self.free_keys.pop() {
            Some(k) => {
                self.keys[k as usize] = ks;
                k
            }
            None => {
                self.keys.push(ks);
                (self.keys.len() - 1) as u32
            }
        };
        self.index.insert(key.into(), k);
        k
    }

    /// Forgets a key that has nothing left, so distinct keys do not pile up.
    fn maybe_drop_key(&mut self, k: u32) {
        let ks = &self.keys[k as usize];
        if ks.queue.is_empty() && ks.running == 0 && ks.dead == 0 && !ks.scheduled {
            let key = std::mem::take(&mut self.keys[k as usize].key);
            self.index.remove(&key);
            self.fair.forget(&k);
            self.free_keys.push(k);
        }
    }

    fn schedule(&mut self, k: u32) {
        let halt = self.policy == DeadPolicy::Halt;
        let ks = &mut self.keys[k as usize];
        if ks.scheduled || ks.full() || (halt && ks.dead > 0) {
            return;
        }
        let Some((_, next)) = ks.next_slot(&self.in_flight_ids, ks.picked) else {
            return;
        };
        ks.scheduled = true;
        // Every key waits in `timers` until its next job is due (and flow
        // control lets it start), then in `ready`.
        self.timers
            .push(Reverse((next.not_before_ms.max(ks.held_until_ms), k)));
    }

    /// Schedules `k` again by its next job (an older entry may stay
    /// queued; picks pass a key whose next job is not due).
    fn reschedule(&mut self, k: u32) {
        self.keys[k as usize].scheduled = false;
        self.schedule(k);
    }

    fn lookup(&self, key: &str) -> Option<u32> {
        self.index.get(key).copied()
    }

    fn in_hole(&self, id: u64) -> bool {
        self.holes.iter().any(|&(a, b)| (a..b).contains(&id))
    }

    /// A reference to a job the state does not know: fine if the job was in a
    /// repaired hole (repair reported it lost), an inconsistency otherwise.
    fn unknown(&self, id: u64, what: &str) -> Result<(), String> {
        if self.in_hole(id) {
            Ok(())
        } else {
            Err(format!(
                "{what} refers to job {id}, which is not among its key's jobs"
            ))
        }
    }

    /// The key of `key`'s job `job` and its index in the key's queue.
    fn slot_of(&self, key: &str, job: u64) -> Option<(u32, usize)> {
        let k = self.lookup(key)?;
        Some((k, queue_position(&self.keys[k as usize].queue, job)?))
    }

    /// Job `job` of key `k` is no longer in flight (whatever became of it).
    fn run_ended(&mut self, k: u32, job: u64) {
        if self.in_flight_ids.remove(&job).is_some() {
            let ks = &mut self.keys[k as usize];
            ks.running = ks.running.saturating_sub(1);
        }
    }

    fn finish(&mut self, id: u64) {
        self.seg_live_at(id, false);
        // The maps are looked at only when they hold any job: most shards'
        // jobs are neither debounced nor keyed, and a purge finishes a
        // backlog job by job.
        if let Some(at) = (!self.payload_at.is_empty())
            .then(|| self.payload_at.remove(&id))
            .flatten()
        {
            self.seg_live_at(at, false);
        }
        if let Some(slot) = (!self.keyed_of.is_empty())
            .then(|| self.keyed_of.remove(&id))
            .flatten()
        {
            if self.keyed.get(&slot).is_some_and(|&(j, _)| j == id) {
                self.keyed.remove(&slot);
            }
        }
    }

    /// Notes that a record in the segment at `seg_base` refers to job `id`.
    fn note_ref(&mut self, seg_base: u64, id: u64) {
        let Some((&job_base, _)) = self.segs.range(..=id).next_back() else {
            return;
        };
        if job_base != seg_base {
            let refs = &mut self.segs.entry(seg_base).or_default().refs;
            if !refs.contains(&job_base) {
                refs.push(job_base);
            }
        }
    }

    /// The job a record refers to, if it is not in a reclaimed range.
    fn referred(rec: &Record<'_>) -> Option<u64> {
        match *rec {
            Record::Claim { job, .. }
            | Record::Ack { job, .. }
            | Record::Fail { job, .. }
            | Record::BackOff { job, .. }
            | Record::Resume { job, .. }
            | Record::Debounce { job, .. }
            | Record::DeadRetry { job }
            | Record::DeadPurge { job }
            | Record::Cancel { job, .. }
            | Record::CancelRun { job, .. } => Some(job),
            Record::Enqueue { .. }
            | Record::Seal
            | Record::Hole { .. }
            | Record::Dedup { .. }
            | Record::Import { .. }
            | Record::PurgeKey { .. } => None,
        }
    }

    /// Applies one record at log position `pos` of the segment at `seg_base`.
    pub fn apply(&mut self, pos: u64, seg_base: u64, rec: &Record<'_>) -> Result<(), String> {
        if let Record::Claim { fence, .. } = *rec {
            // Even a claim of a reclaimed job raised the high-water.
            self.fence_high = self.fence_high.max(fence);
        }
        let job = Self::referred(rec);
        if let Some(job) = job {
            if self.reclaimed.contains(job) {
                // Finished long ago; its segment may be gone.
                return Ok(());
            }
        }
        self.apply_inner(pos, seg_base, rec)?;
        if let Some(job) = job {
            self.note_ref(seg_base, job);
        }
        Ok(())
    }

    fn apply_inner(&mut self, pos: u64, seg_base: u64, rec: &Record<'_>) -> Result<(), String> {
        match *rec {
            Record::Enqueue {
                created_ms,
                not_before_ms,
                max_attempts,
                key,
                dedup,
                ..
            } => self.on_enqueue(
                pos,
                seg_base,
                (created_ms, not_before_ms),
                max_attempts,
                key,
                dedup,
            )?,
            Record::Claim {
                job,
                attempt,
                fence,
                started_ms,
                key,
            } => self.on_claim(job, attempt, fence, started_ms, key)?,
            Record::Ack { job, key } => self.on_ack(job, key)?,
            Record::Fail {
                job,
                retry_at_ms,
                dead,
                key,
                reason,
            } => self.on_fail(job, retry_at_ms, dead, key, reason)?,
            Record::BackOff {
                job,
                retry_at_ms,
                key,
            } => self.on_back_off(job, retry_at_ms, key)?,
            Record::Resume { job, at_ms, key } => self.on_resume(job, at_ms, key)?,
            Record::Debounce {
                job,
                not_before_ms,
                key,
                ..
            } => self.on_debounce(pos, seg_base, job, not_before_ms, key)?,
            Record::DeadRetry { job } => self.on_dead_retry(job)?,
            Record::DeadPurge { job } => self.on_dead_purge(job)?,
            Record::Import { .. } => self.on_import(pos, seg_base, rec)?,
            Record::PurgeKey { key } => self.on_purge_key(seg_base, key)?,
            Record::Cancel { job, key } => self.on_cancel(job, key)?,
            Record::CancelRun { job, fence } => {
                // A run that ended before this record needs nothing.
                if let Some(run) = self.in_flight_ids.get_mut(&job) {
                    if run.fence == fence {
                        run.cancelled = true;
                    }
                }
            }
            Record::Seal => {}
            Record::Hole { bytes } => self.holes.push((pos, pos + bytes)),
            Record::Dedup {
                job,
                expires_ms,
                key,
                id,
                shard,
            } => self.note_dedup(seg_base, job, expires_ms, key, id, shard),
        }
        Ok(())
    }

    /// A job enqueued: its key's queue gains it (and its dedup record is noted).
    fn on_enqueue(
        &mut self,
        pos: u64,
        seg_base: u64,
        (created_ms, not_before_ms): (u64, u64),
        max_attempts: u32,
        key: &str,
        dedup: Option<crate::record::EnqueueDedup<'_>>,
    ) -> Result<(), String> {
        let keyed = dedup.filter(|d| shardq_core::job::is_keyed_id(d.id));
        if let Some(d) = dedup.filter(|_| keyed.is_none()) {
            // Kept even when the job is reclaimed: the id answers
            // until it expires.
            self.note_dedup(seg_base, pos, d.expires_ms, key, d.id, "");
        }
        if self.reclaimed.contains(pos) {
            // Reclaimed: finished, and so are all records about it.
            self.segs.entry(seg_base).or_default();
            return Ok(());
        }
        let k = self.key_index(key);
        self.keys[k as usize].queue.push_back(Slot {
            id: pos,
            not_before_ms,
            attempt: 0,
            max_attempts,
        });
        self.slot_added(pos, k, not_before_ms);
        self.segs.entry(seg_base).or_default().live += 1;
        if let Some(d) = keyed {
            self.note_keyed(pos, key, d.id, created_ms);
        }
        self.schedule(k);
        Ok(())
    }

    /// A debounced enqueue gave waiting job `job` its payload (this
    /// record's) and start. Written under the append lock for a job not in
    /// flight; the record's segment holds the payload while the job lives.
    fn on_debounce(
        &mut self,
        pos: u64,
        seg_base: u64,
        job: u64,
        not_before_ms: u64,
        key: &str,
    ) -> Result<(), String> {
        let Some((k, i)) = self.slot_of(key, job) else {
            return self.unknown(job, "debounce");
        };
        self.backed_off.remove(&job);
        self.keys[k as usize].queue[i].not_before_ms = not_before_ms;
        self.not_before_max_ms = self.not_before_max_ms.max(not_before_ms);
        self.segs.entry(seg_base).or_default().live += 1;
        if let Some(old) = self.payload_at.insert(job, pos) {
            self.seg_live_at(old, false);
        }
        self.reschedule(k);
        Ok(())
    }

    /// A run started.
    fn on_claim(
        &mut self,
        job: u64,
        attempt: u32,
        fence: u64,
        started_ms: u64,
        key: &str,
    ) -> Result<(), String> {
        let Some((k, i)) = self.slot_of(key, job) else {
            return self.unknown(job, "claim");
        };
        // A job still in flight here was left so by an owner that
        // went away (a new owner drops those runs at adopt without
        // a record): this run replaces it.
        let replaces = self.in_flight_ids.contains_key(&job);
        self.backed_off.remove(&job);
        let ks = &mut self.keys[k as usize];
        ks.running += u32::from(!replaces);
        ks.queue[i].attempt = attempt;
        ks.attempts_mut(job).starts.push(started_ms);
        self.in_flight_ids.insert(
            job,
            Run {
                key: k,
                fence,
                lease_until_ms: u64::MAX,
                cancelled: false,
            },
        );
        Ok(())
    }

    /// A run acked: the job is finished.
    fn on_ack(&mut self, job: u64, key: &str) -> Result<(), String> {
        let Some((k, i)) = self.slot_of(key, job) else {
            return self.unknown(job, "ack");
        };
        let ks = &mut self.keys[k as usize];
        ks.take_attempts(job);
        if ks.queue.remove(i).is_some() {
            self.slot_removed(job);
        }
        self.run_ended(k, job);
        self.finish(job);
        self.schedule(k);
        self.maybe_drop_key(k);
        Ok(())
    }

    /// A run failed: the job waits for its retry, or is a dead letter.
    fn on_fail(
        &mut self,
        job: u64,
        retry_at_ms: u64,
        dead: bool,
        key: &str,
        reason: &str,
    ) -> Result<(), String> {
        let Some((k, i)) = self.slot_of(key, job) else {
            return self.unknown(job, "fail");
        };
        self.run_ended(k, job);
        let ks = &mut self.keys[k as usize];
        if dead {
            let starts: Box<[u64]> = ks
                .take_attempts(job)
                .map(|a| a.starts.into_boxed_slice())
                .unwrap_or_default();
            let slot = ks.queue.remove(i).expect("the slot was found");
            ks.dead += 1;
            self.slot_removed(job);
            self.dead.insert(
                job,
                DeadEntry {
                    key: k,
                    slot,
                    reason: reason.into(),
                    starts,
                },
            );
        } else {
            ks.attempts_mut(job).reason = Some(reason.into());
            ks.queue[i].not_before_ms = retry_at_ms;
            self.not_before_max_ms = self.not_before_max_ms.max(retry_at_ms);
        }
        // Its key's next job may be this one again, not yet due.
        self.reschedule(k);
        Ok(())
    }

    /// A handler backed off: the run ends without using its attempt.
    fn on_back_off(&mut self, job: u64, retry_at_ms: u64, key: &str) -> Result<(), String> {
        let Some((k, i)) = self.slot_of(key, job) else {
            return self.unknown(job, "back-off");
        };
        self.run_ended(k, job);
        self.backed_off.insert(job, retry_at_ms);
        let ks = &mut self.keys[k as usize];
        let slot = &mut ks.queue[i];
        slot.attempt = slot.attempt.saturating_sub(1);
        slot.not_before_ms = retry_at_ms;
        if let Some(a) = ks.history.iter_mut().find(|a| a.job == job) {
            a.starts.pop();
        }
        self.not_before_max_ms = self.not_before_max_ms.max(retry_at_ms);
        self.reschedule(k);
        Ok(())
    }

    /// A back-off lifted (`key resume`).
    fn on_resume(&mut self, job: u64, at_ms: u64, key: &str) -> Result<(), String> {
        let Some((k, i)) = self.slot_of(key, job) else {
            return self.unknown(job, "resume");
        };
        // Written under the append lock while the job waited on its
        // back-off; a run of it since (none can start before this
        // record) would have nothing to lift.
        if self.backed_off.remove(&job).is_some() && !self.in_flight_ids.contains_key(&job) {
            let slot = &mut self.keys[k as usize].queue[i];
            slot.not_before_ms = slot.not_before_ms.min(at_ms);
            // Its key's next job may be due now: drop its timer.
            self.reschedule(k);
        }
        Ok(())
    }

    /// A dead letter put back in its key's order.
    fn on_dead_retry(&mut self, job: u64) -> Result<(), String> {
        let Some(entry) = self.dead.remove(&job) else {
            return self.unknown(job, "dead retry");
        };
        let ks = &mut self.keys[entry.key as usize];
        ks.dead -= 1;
        let slot = Slot {
            attempt: 0,
            not_before_ms: 0,
            ..entry.slot
        };
        // Back at its place in key order (before running jobs
        // started after it, which it then follows).
        let at = ks.queue.partition_point(|s| s.id < job);
        ks.queue.insert(at, slot);
        let next = ks.next_slot(&self.in_flight_ids, 0).map(|(_, s)| s.id);
        self.slot_added(job, entry.key, 0);
        if next == Some(job) {
            // It is the key's next job: drop a stale timer.
            self.reschedule(entry.key);
        } else {
            self.schedule(entry.key);
        }
        Ok(())
    }

    /// A dead letter purged.
    fn on_dead_purge(&mut self, job: u64) -> Result<(), String> {
        let Some(entry) = self.dead.remove(&job) else {
            return self.unknown(job, "dead purge");
        };
        self.keys[entry.key as usize].dead -= 1;
        self.finish(job);
        self.schedule(entry.key);
        self.maybe_drop_key(entry.key);
        Ok(())
    }

    /// A job copied in by a move (waiting, or a dead letter): `rec`, an
    /// Import record.
    fn on_import(&mut self, pos: u64, seg_base: u64, rec: &Record<'_>) -> Result<(), String> {
        let Record::Import {
            source_id,
            created_ms,
            not_before_ms,
            attempt,
            max_attempts,
            dead,
            from,
            key,
            reason,
            dedup_id,
            ..
        } = *rec
        else {
            return Err(format!("record at {pos} is not an Import record"));
        };
        if !self.imported.contains_key(from) {
            self.imported
                .insert(from.into(), HashMap::with_hasher(TextHash::new()));
        }
        let keys = self.imported.get_mut(from).expect("inserted");
        match keys.get_mut(key) {
            Some(cursor) => *cursor = (*cursor).max(source_id),
            None => {
                keys.insert(key.into(), source_id);
            }
        }
        if self.reclaimed.contains(pos) {
            self.segs.entry(seg_base).or_default();
            return Ok(());
        }
        let k = self.key_index(key);
        let slot = Slot {
            id: pos,
            not_before_ms,
            attempt,
            max_attempts,
        };
        if dead {
            self.keys[k as usize].dead += 1;
            self.dead.insert(
                pos,
                DeadEntry {
                    key: k,
                    slot,
                    reason: reason.into(),
                    starts: Box::default(),
                },
            );
        } else {
            self.keys[k as usize].queue.push_back(slot);
            self.slot_added(slot.id, k, not_before_ms);
            if shardq_core::job::is_keyed_id(dedup_id) {
                self.note_keyed(pos, key, dedup_id, created_ms);
            }
            self.schedule(k);
        }
        self.segs.entry(seg_base).or_default().live += 1;
        Ok(())
    }

    /// A moved key's copies purged: its jobs that are not running, and its dead letters.
    fn on_purge_key(&mut self, seg_base: u64, key: &str) -> Result<(), String> {
        let Some(k) = self.lookup(key) else {
            return Ok(());
        };
        let ks = &mut self.keys[k as usize];
        // Running jobs stay (a move purges only keys it waited on).
        let running = &self.in_flight_ids;
        let removed: Vec<u64> = (ks.queue.iter())
            .filter(|s| !running.contains_key(&s.id))
            .map(|s| s.id)
            .collect();
        ks.queue.retain(|s| running.contains_key(&s.id));
        if ks.queue.is_empty() {
            ks.scheduled = false;
        }
        let backed_off = !self.backed_off.is_empty();
        for id in &removed {
            ks.take_attempts(*id);
            if backed_off {
                self.backed_off.remove(id);
            }
        }
        self.job_keys.remove_many(&removed);
        for id in &removed {
            self.slot_left();
            self.finish(*id);
            self.note_ref(seg_base, *id);
        }
        let dead: Vec<u64> = self
            .dead
            .iter()
            .filter(|(_, e)| e.key == k)
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            self.dead.remove(&id);
            self.keys[k as usize].dead -= 1;
            self.finish(id);
            self.note_ref(seg_base, id);
        }
        self.schedule(k);
        self.maybe_drop_key(k);
        Ok(())
    }

    /// A job cancelled (a running one ends with its run).
    fn on_cancel(&mut self, job: u64, key: &str) -> Result<(), String> {
        let found = self.lookup(key).and_then(|k| {
            let ks = &self.keys[k as usize];
            let i = queue_position(&ks.queue, job)?;
            Some((k, i, self.in_flight_ids.contains_key(&job)))
        });
        let Some((k, i, running)) = found else {
            return self.unknown(job, "cancel");
        };
        let was_next = (self.keys[k as usize].next_slot(&self.in_flight_ids, 0))
            .is_some_and(|(_, s)| s.id == job);
        if running {
            // A run cancelled earlier ends this way (its lease
            // lapsed, or a new owner found it). An owner cancels
            // only jobs it does not run, so a run not cancelled is
            // one an owner that went away left in the log (a new
            // owner drops those at adopt, without a record): it
            // ended then.
            self.run_ended(k, job);
        }
        self.cancel_pending.retain(|&j| j != job);
        self.backed_off.remove(&job);
        self.keys[k as usize].queue.remove(i);
        self.keys[k as usize].take_attempts(job);
        self.slot_removed(job);
        self.finish(job);
        if was_next || running {
            // The key's next job changed: schedule it by the new one.
            self.reschedule(k);
        }
        self.maybe_drop_key(k);
        Ok(())
    }

    /// A dedup record (its own, or an Enqueue's field) of `(key, id)` at
    /// the segment `seg_base`. Kept whatever became of its job (acked,
    /// reclaimed): it answers for the id until it expires.
    fn note_dedup(
        &mut self,
        seg_base: u64,
        job: u64,
        expires_ms: u64,
        key: &str,
        id: &str,
        shard: &str,
    ) {
        let seg = self.segs.entry(seg_base).or_default();
        seg.dedup_until_ms = seg.dedup_until_ms.max(expires_ms);
        let slot: Arc<str> = dedup_slot(key, id).into();
        let entry = DedupEntry {
            job,
            expires_ms,
            shard: (!shard.is_empty()).then(|| shard.into()),
        };
        // A record of (key, id) is written only once the earlier one
        // expired (the append checks first): the later wins.
        self.dedup_expiries
            .push(Reverse((expires_ms, Arc::clone(&slot))));
        self.dedup.insert(slot, entry);
    }

    /// A new owner: jobs left in flight by the previous one go back to the
    /// head of their keys (they already count the attempt). The scheduler is
    /// rebuilt from the heads: replay never picks, so a key's timer may still
    /// carry the start time of a head that finished long ago (later than its
    /// head's now, if the clock stepped back).
    pub fn reset_in_flight(&mut self) {
        // A cancelled run's job is not run again: the new owner deletes it
        // (a Cancel record, [`ShardState::cancel_pending`]) before it picks.
        self.cancel_pending = self
            .in_flight_ids
            .iter()
            .filter(|(_, r)| r.cancelled)
            .map(|(&id, _)| id)
            .collect();
        self.cancel_pending.sort_unstable();
        for (id, run) in std::mem::take(&mut self.in_flight_ids) {
            let ks = &mut self.keys[run.key as usize];
            ks.running = 0;
            if let Some(i) = queue_position(&ks.queue, id) {
                ks.queue[i].not_before_ms = 0;
            }
        }
        self.rebuild_schedule();
    }

    /// Reschedules every key from its head.
    fn rebuild_schedule(&mut self) {
        self.ready.clear();
        self.fair.clear();
        self.timers.clear();
        for ks in &mut self.keys {
            ks.scheduled = false;
        }
        let live: Vec<u32> = self.index.values().copied().collect();
        for k in live {
            self.schedule(k);
            self.maybe_drop_key(k);
        }
    }

    /// Picks up to `max` claimable jobs, each key's in order and no more
    /// than its concurrency lets run. The caller writes a claim record for
    /// each and applies it; picks not written must be handed back with
    /// [`ShardState::unpick`].
    pub fn pick(
        &mut self,
        now_ms: u64,
        runs: &mut RunFences<'_>,
        max: usize,
        sealed: &dyn Fn(&str) -> bool,
        flow: Option<&FlowControl>,
    ) -> Vec<Pick> {
        let ranked = flow.filter(|f| f.ranks_keys());
        let limited = flow.filter(|f| f.limits_starts());
        self.relimit(flow);
        self.queue_candidates(now_ms, sealed, ranked);
        let halt = self.policy == DeadPolicy::Halt;
        let mut out: Vec<Pick> = Vec::new();
        // A key can sit in `ready` twice (a dead retry or a takeover that
        // changed its next job reschedules it while an older entry is
        // queued), and one of concurrency above 1 is queued again after
        // each pick. Claim records are applied only after this returns, so
        // the jobs picked here count as running (`KeyState::picked`, reset
        // below for the keys in `touched`).
        let mut touched: Vec<u32> = Vec::new();
        while out.len() < max {
            let mut popped = None;
            let next = match ranked {
                Some(_) => self.fair.pop().map(|p| {
                    let k = p.key;
                    popped = Some(p);
                    k
                }),
                None => self.ready.pop_front(),
            };
            let Some(k) = next else {
                break;
            };
            let ks = &mut self.keys[k as usize];
            ks.scheduled = false;
            if let Some(f) = flow {
                ks.limit = f.concurrency_of(&ks.key);
            }
            let mine = ks.picked;
            if ks.full() || (halt && ks.dead > 0) {
                continue;
            }
            if sealed(&ks.key) {
                // Sealed for a move: no run starts here; parked until unsealed.
                let key = ks.key.clone();
                if !self.parked.contains(&key) {
                    self.parked.push(key);
                }
                continue;
            }
            let Some((_, head)) = ks.next_slot(&self.in_flight_ids, mine) else {
                continue;
            };
            if self.cancel_pending.contains(&head.id) {
                continue;
            }
            if head.not_before_ms.max(ks.held_until_ms) > now_ms {
                self.schedule(k);
                continue;
            }
            let fence = shardq_core::next_fence(runs.now_us, runs.last, runs.floor);
            let start = shardq_core::flow::RunStart {
                shard: runs.shard,
                fence,
                lease_until_ms: runs.lease_until_ms,
            };
            if let Some(Admit::NotBefore(at)) = limited.map(|f| f.admit(&ks.key, now_ms, &start)) {
                // Over its limit: asked again then, the others go on.
                ks.held_until_ms = at;
                self.schedule(k);
                continue;
            }
            if let Some(p) = &popped {
                self.fair.charge(p);
                if let Some(f) = ranked {
                    f.raise_fair_vtime(self.fair.vtime());
                }
            }
            if mine == 0 {
                touched.push(k);
            }
            ks.picked += 1;
            runs.last = fence;
            out.push(Pick {
                fence,
                id: head.id,
                key: ks.key.clone(),
                attempt: head.attempt + 1,
                max_attempts: head.max_attempts,
                not_before_ms: head.not_before_ms,
            });
            // Room for another run of the key: it queues again, behind the
            // keys ready now (round robin) or by its new start tag.
            if ks.running + ks.picked < ks.limit.max(1) && !ks.scheduled {
                ks.scheduled = true;
                match ranked {
                    Some(f) => {
                        let (priority, weight) = f.rank_of(&ks.key);
                        self.fair.push(k, priority, weight);
                    }
                    None => self.ready.push_back(k),
                }
            }
        }
        for k in touched {
            self.keys[k as usize].picked = 0;
        }
        out
    }

    /// Keys' concurrency after a change of the flow settings: a key with
    /// runs in flight that may now run more is scheduled (it was left out
    /// while full).
    fn relimit(&mut self, flow: Option<&FlowControl>) {
        let version = flow.map_or(0, |f| f.version());
        if version == self.flow_version {
            return;
        }
        self.flow_version = version;
        let mut busy: Vec<u32> = self.in_flight_ids.values().map(|r| r.key).collect();
        busy.sort_unstable();
        busy.dedup();
        for k in busy {
            let ks = &mut self.keys[k as usize];
            ks.limit = flow.map_or(1, |f| f.concurrency_of(&ks.key));
            self.schedule(k);
        }
    }

    /// Queues the keys a pick may start: those parked while sealed that no
    /// longer are, those whose timer is due, and (`ranked`) every ready
    /// key into the fair queue, raised to the process's virtual time.
    fn queue_candidates(
        &mut self,
        now_ms: u64,
        sealed: &dyn Fn(&str) -> bool,
        ranked: Option<&FlowControl>,
    ) {
        // Keys passed by while sealed come back once they are not.
        let parked = std::mem::take(&mut self.parked);
        for key in parked {
            match self.lookup(&key) {
                Some(_) if sealed(&key) => self.parked.push(key),
                Some(k) => self.schedule(k),
                None => {}
            }
        }
        while let Some(Reverse((at, k))) = self.timers.peek().copied() {
            if at > now_ms {
                break;
            }
            self.timers.pop();
            self.ready.push_back(k);
        }
        if let Some(f) = ranked {
            self.fair.raise_vtime(f.fair_vtime());
            while let Some(k) = self.ready.pop_front() {
                let (priority, weight) = f.rank_of(&self.keys[k as usize].key);
                self.fair.push(k, priority, weight);
            }
        } else if !self.fair.is_empty() {
            // Ranks were cleared: back to round robin.
            self.ready.extend(self.fair.drain());
        }
    }

    /// While `flow` ranks keys: the ranks of up to `max` keys a pick would
    /// start now, best first, with the keys of runs whose lease lapsed by
    /// `now_ms` (a claim ends those runs first). Limits are not asked and
    /// nothing is charged.
    pub fn ranks(
        &mut self,
        now_ms: u64,
        max: usize,
        sealed: &dyn Fn(&str) -> bool,
        flow: &FlowControl,
    ) -> Vec<Rank> {
        if !flow.ranks_keys() {
            return Vec::new();
        }
        self.relimit(Some(flow));
        self.queue_candidates(now_ms, sealed, Some(flow));
        let halt = self.policy == DeadPolicy::Halt;
        let keys = &self.keys;
        let (cancel_pending, in_flight) = (&self.cancel_pending, &self.in_flight_ids);
        let mut out = self.fair.ranks(max, |&k| {
            let ks = &keys[k as usize];
            let blocked = ks.full() || (halt && ks.dead > 0) || sealed(&ks.key);
            !blocked
                && ks.next_slot(in_flight, 0).is_some_and(|(_, head)| {
                    !cancel_pending.contains(&head.id)
                        && head.not_before_ms.max(ks.held_until_ms) <= now_ms
                })
        });
        // Cancels only a claim carries out (a previous owner's, or of a run
        // whose lease lapsed): the shard must be claimed from, whatever its
        // keys' ranks.
        let mut must_claim = !self.cancel_pending.is_empty();
        for id in self.lapsed(now_ms) {
            let Some(run) = self.in_flight_ids.get(&id) else {
                continue;
            };
            let ks = &self.keys[run.key as usize];
            if run.cancelled {
                must_claim = true;
                continue;
            }
            if sealed(&ks.key) || (halt && ks.dead > 0) {
                continue;
            }
            let (priority, _) = flow.rank_of(&ks.key);
            out.push(self.fair.rank_of(&run.key, priority));
        }
        if must_claim {
            out.push(Rank::FIRST);
        }
        out.sort_unstable();
        out.truncate(max);
        out
    }

    /// Hands back picks whose claim was not written.
    pub fn unpick(&mut self, picks: &[Pick]) {
        for p in picks {
            if let Some(k) = self.lookup(&p.key) {
                self.schedule(k);
            }
        }
    }

    /// The current run of an in-flight job.
    pub fn in_flight(&self, id: u64) -> Option<RunInfo<'_>> {
        let run = *self.in_flight_ids.get(&id)?;
        let ks = &self.keys[run.key as usize];
        let h = ks.queue.get(queue_position(&ks.queue, id)?)?;
        Some(RunInfo {
            key: &ks.key,
            attempt: h.attempt,
            max_attempts: h.max_attempts,
            fence: run.fence,
            lease_until_ms: run.lease_until_ms,
            cancelled: run.cancelled,
        })
    }

    /// The run of job `id` with fence `fence`, if it is the job's current run.
    pub fn current_run(&self, id: u64, fence: u64) -> Option<RunInfo<'_>> {
        self.in_flight(id)
            .filter(|r| r.fence == fence && !r.cancelled)
    }

    /// Sets the job lease of the current run of `id` (after its claim record
    /// was applied, or for an extend).
    pub fn set_lease(&mut self, id: u64, until_ms: u64) {
        if let Some(run) = self.in_flight_ids.get_mut(&id) {
            run.lease_until_ms = until_ms;
        }
    }

    /// In-flight jobs whose run's job lease ended at or before `now_ms`, in
    /// id order.
    pub fn lapsed(&self, now_ms: u64) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .in_flight_ids
            .iter()
            .filter(|(_, r)| r.lease_until_ms <= now_ms)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The largest run fence issued on this shard, as far as the log shows.
    pub fn fence_high(&self) -> u64 {
        self.fence_high
    }

    /// Earliest time a scheduled key becomes claimable: `Some(0)` if one is
    /// claimable now.
    /// When work may start next: 0 when a key is ready, else the earlier of
    /// the first timer and the first job lease to end (a run in flight lapses
    /// back into work unless acked or failed); `None` when nothing waits and
    /// nothing is in flight.
    pub fn next_due_ms(&mut self) -> Option<u64> {
        if !self.ready.is_empty() || !self.fair.is_empty() {
            return Some(0);
        }
        // A timer left for a job that is gone or started (cancelled, moved,
        // its key dropped) is stale: the key was scheduled again by its new
        // next job, if it has one. Stale ones on top would report work that
        // is not there (and keep `--exit-when-idle` waiting for it). A key
        // still marked scheduled is scheduled again by its next job, so no
        // key is left marked with nothing queued for it.
        while let Some(Reverse((at, k))) = self.timers.peek().copied() {
            let Some(ks) = self.keys.get(k as usize) else {
                self.timers.pop();
                continue;
            };
            let next = (ks.next_slot(&self.in_flight_ids, 0))
                .map(|(_, h)| h.not_before_ms.max(ks.held_until_ms));
            if ks.scheduled && next == Some(at) {
                break;
            }
            self.timers.pop();
            if ks.scheduled {
                self.reschedule(k);
            }
        }
        let timer = self.timers.peek().map(|Reverse((at, _))| *at);
        let lease = self.in_flight_ids.values().map(|r| r.lease_until_ms).min();
        match (timer, lease) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The handler's back-off holding `key` at `now_ms`: its first
    /// [`KEY_HOLD_SCAN_JOBS`] waiting jobs whose wait a BackOff record set
    /// and has not ended.
    pub fn key_hold(&self, key: &str, now_ms: u64) -> Option<KeyHold> {
        if self.backed_off.is_empty() {
            return None;
        }
        let ks = &self.keys[self.lookup(key)? as usize];
        let mut hold = KeyHold {
            jobs: Vec::new(),
            until_ms: 0,
        };
        let waiting = (ks.queue.iter())
            .filter(|s| ks.running == 0 || !self.in_flight_ids.contains_key(&s.id))
            .take(KEY_HOLD_SCAN_JOBS);
        for s in waiting {
            if s.not_before_ms > now_ms && self.backed_off.contains_key(&s.id) {
                hold.jobs.push(JobId(s.id));
                hold.until_ms = hold.until_ms.max(s.not_before_ms);
            }
        }
        (!hold.jobs.is_empty()).then_some(hold)
    }

    pub fn key_counts(&self, key: &str) -> KeyCounts {
        let Some(k) = self.lookup(key) else {
            return KeyCounts::default();
        };
        let ks = &self.keys[k as usize];
        let in_flight = u64::from(ks.running);
        KeyCounts {
            depth: ks.queue.len() as u64 - in_flight,
            in_flight,
            dead: u64::from(ks.dead),
        }
    }

    /// Every key with pending, in-flight or dead jobs, with its counts (what a
    /// rebalance must drain, and what `shardq hot` ranks).
    pub fn keys_with_work(&self) -> Vec<(String, KeyCounts)> {
        self.index
            .values()
            .filter_map(|&k| {
                let ks = &self.keys[k as usize];
                // Dead letters tie a key to this shard too (a retry runs here).
                (!ks.queue.is_empty() || ks.dead > 0)
                    .then(|| (ks.key.to_string(), self.key_counts(&ks.key)))
            })
            .collect()
    }

    pub fn stats(&self, name: &str, now_ms: u64) -> ShardStats {
        let mut s = ShardStats {
            name: name.to_string(),
            dead: self.dead.len() as u64,
            keys: self.index.len() as u64,
            fence_high: self.fence_high,
            ..ShardStats::default()
        };
        if self.not_before_max_ms <= now_ms {
            // Every waiting job is ready: count without walking the jobs.
            s.in_flight = self.in_flight_ids.len() as u64;
            s.ready = self.queued - s.in_flight;
            #[cfg(debug_assertions)]
            {
                let walked = self.walked_stats(now_ms);
                assert_eq!(
                    (s.ready, s.delayed, s.in_flight),
                    walked,
                    "the queued-slot count drifted from the queues"
                );
            }
            return s;
        }
        (s.ready, s.delayed, s.in_flight) = self.walked_stats(now_ms);
        s
    }

    /// (ready, delayed, in flight) by walking every queued slot.
    fn walked_stats(&self, now_ms: u64) -> (u64, u64, u64) {
        let (mut ready, mut delayed, mut in_flight) = (0, 0, 0);
        for ks in &self.keys {
            in_flight += u64::from(ks.running);
            for slot in ks.queue.iter() {
                if ks.running > 0 && self.in_flight_ids.contains_key(&slot.id) {
                    continue;
                }
                if slot.not_before_ms > now_ms {
                    delayed += 1;
                } else {
                    ready += 1;
                }
            }
        }
        (ready, delayed, in_flight)
    }

    pub fn dead_list(&self, shard: &str, limit: usize) -> Vec<DeadJob> {
        self.dead
            .iter()
            .take(limit)
            .map(|(&id, e)| DeadJob {
                shard: shard.to_string(),
                id: JobId(id),
                key: self.keys[e.key as usize].key.to_string(),
                attempts: e.slot.attempt,
                reason: e.reason.to_string(),
                attempt_starts_ms: e.starts.to_vec(),
            })
            .collect()
    }

    pub fn dead_ids(&self) -> Vec<u64> {
        self.dead.keys().copied().collect()
    }

    /// The key of dead job `id`, if it is dead.
    pub fn dead_key(&self, id: u64) -> Option<&str> {
        self.dead.get(&id).map(|e| &*self.keys[e.key as usize].key)
    }

    /// Unfinished jobs enqueued in the segment at `base`.
    pub fn live_in_segment(&self, base: u64) -> u64 {
        self.segs.get(&base).map_or(0, |s| s.live)
    }

    /// Whether the file of the segment at `base` holds records about jobs
    /// outside the reclaimed ranges (so it must be kept).
    pub fn segment_refers_to_live(&self, base: u64) -> bool {
        self.segs
            .get(&base)
            .is_some_and(|s| s.refs.iter().any(|&r| !self.reclaimed.contains(r)))
    }

    /// The segment at `base` was deleted.
    pub fn forget_segment(&mut self, base: u64) {
        self.segs.remove(&base);
    }

    /// Learns the reclaimed ranges (a superset of those known). Jobs in them
    /// are finished: a replica that lagged behind the compaction may still
    /// hold some whose finishing records were in segments it will now step
    /// over, so they are dropped here.
    pub fn set_reclaimed(&mut self, reclaimed: &Reclaimed) {
        self.reclaimed.extend(reclaimed);
        self.fence_high = self.fence_high.max(reclaimed.fence_high());
        let stale = self
            .segs
            .iter()
            .any(|(&b, s)| s.live > 0 && self.reclaimed.contains(b));
        if !stale {
            return;
        }
        let r = &self.reclaimed;
        for ks in &mut self.keys {
            ks.queue.retain(|s| !r.contains(s.id));
        }
        self.job_keys.retain(|id| !r.contains(id));
        self.in_flight_ids.retain(|&id, _| !r.contains(id));
        for ks in &mut self.keys {
            ks.running = 0;
        }
        for run in self.in_flight_ids.values() {
            self.keys[run.key as usize].running += 1;
        }
        self.queued = self.keys.iter().map(|ks| ks.queue.len() as u64).sum();
        if self.queued == 0 {
            self.not_before_max_ms = 0;
        }
        let dead: Vec<u64> = self
            .dead
            .keys()
            .copied()
            .filter(|&id| r.contains(id))
            .collect();
        for id in dead {
            if let Some(e) = self.dead.remove(&id) {
                self.keys[e.key as usize].dead -= 1;
            }
        }
        for (&b, s) in self.segs.iter_mut() {
            if r.contains(b) {
                s.live = 0;
            }
        }
        // Heads changed.
        self.rebuild_schedule();
    }
}

impl Replay for ShardState {
    fn record(&mut self, pos: u64, seg_base: u64, rec: &Record<'_>) -> Result<(), String> {
        self.apply(pos, seg_base, rec)
    }
    fn reclaimed(&mut self, reclaimed: &Reclaimed) {
        self.set_reclaimed(reclaimed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Job ids hash as `Xxh3Builder` hashes them, so the maps keyed by id
    /// keep the layout and iteration order they had with it.
    #[test]
    fn id_hash_gives_what_xxh3_builder_gives() {
        use std::hash::BuildHasher;
        let old = xxhash_rust::xxh3::Xxh3Builder::new();
        let mut id = 0u64;
        for i in 0..100_000u64 {
            id = id
                .wrapping_add(1 + i % 977)
                .wrapping_mul(if i % 5000 == 0 { 3 } else { 1 });
            for v in [id, i, u64::MAX - i, id << 32] {
                assert_eq!(IdHash.hash_one(v), old.hash_one(v), "id {v}");
            }
        }
        let mut a: HashMap<u64, u64, IdHash> = HashMap::with_hasher(IdHash);
        let mut b: HashMap<u64, u64, xxhash_rust::xxh3::Xxh3Builder> = HashMap::with_hasher(old);
        for v in (0..50_000u64).map(|v| v * 41 + 7) {
            a.insert(v, v);
            b.insert(v, v);
        }
        assert!(a.iter().eq(b.iter()), "the same order");
    }

    /// An empty state of a log from its start.
    fn fresh() -> ShardState {
        ShardState::new(&crate::reclaim::Reclaimed::default(), DeadPolicy::Continue)
    }

    /// Flow control giving every key `policy`.
    fn every_key(policy: shardq_core::flow::FlowPolicy) -> FlowControl {
        use shardq_core::flow::{FlowSettings, LocalGroupBuckets};
        let settings = FlowSettings {
            default: policy,
            ..FlowSettings::default()
        };
        FlowControl::new(settings, std::sync::Arc::new(LocalGroupBuckets::default()))
    }

    fn test_fences() -> RunFences<'static> {
        RunFences {
            shard: "s",
            lease_until_ms: u64::MAX,
            now_us: 0,
            last: 0,
            floor: 0,
        }
    }

    fn enqueue(s: &mut ShardState, pos: u64, key: &str) {
        let rec = Record::Enqueue {
            created_ms: 0,
            not_before_ms: 0,
            max_attempts: 1,
            key,
            dedup: None,
            payload: b"",
        };
        s.apply(pos, 0, &rec).unwrap();
    }

    /// A job is found by id through the id index wherever it stands
    /// (queued, running, dead, retried back to its key's head) and not once
    /// it finished; a key's first jobs come in id order from the head of
    /// its queue, a retried dead letter among them.
    #[test]
    fn jobs_are_found_by_id_and_a_keys_first_jobs_from_its_head() {
        let mut s = fresh();
        for pos in [0, 10, 20, 30] {
            enqueue(&mut s, pos, "k");
        }
        enqueue(&mut s, 40, "other");
        let found = |s: &ShardState, id| s.live_job(id).map(|j| (j.key.to_string(), j.dead));
        assert_eq!(found(&s, 10), Some(("k".into(), false)));
        assert_eq!(found(&s, 40), Some(("other".into(), false)));
        assert_eq!(found(&s, 11), None, "no job has that id");
        let _ = s.pick(0, &mut test_fences(), 10, &|_| false, None);
        claim(&mut s, 100, 0, 1, 7);
        assert!(found(&s, 0).is_some(), "running");
        fail(&mut s, 200, 0, true, "boom");
        assert_eq!(found(&s, 0), Some(("k".into(), true)), "dead");
        s.apply(300, 0, &Record::DeadRetry { job: 0 }).unwrap();
        assert_eq!(found(&s, 0), Some(("k".into(), false)), "retried");
        let first: Vec<u64> = (s.key_live_jobs("k", 2).iter())
            .map(|j| j.slot.id)
            .collect();
        assert_eq!(first, [0, 10]);
        s.apply(400, 0, &Record::Cancel { job: 10, key: "k" })
            .unwrap();
        assert_eq!(found(&s, 10), None, "cancelled");
        let first: Vec<u64> = (s.key_live_jobs("k", 2).iter())
            .map(|j| j.slot.id)
            .collect();
        assert_eq!(first, [0, 20]);
        assert_eq!(s.job_keys.len(), 4, "one index entry per queued job");
    }

    /// Regression: a dead job retried to the head of a key that was already
    /// scheduled queued the key twice, and one `pick` handed the same job
    /// out twice.
    #[test]
    fn a_key_queued_twice_is_picked_once() {
        let mut s = fresh();
        enqueue(&mut s, 0, "k");
        let first = s.pick(0, &mut test_fences(), 10, &|_| false, None);
        assert_eq!(first.len(), 1);
        claim(&mut s, 100, 0, 1, 7);
        fail(&mut s, 200, 0, true, "boom");
        enqueue(&mut s, 300, "k");
        // The key is scheduled for job 300; retrying job 0 puts it at the head.
        s.apply(400, 0, &Record::DeadRetry { job: 0 }).unwrap();
        let picks = s.pick(0, &mut test_fences(), 10, &|_| false, None);
        let ids: Vec<u64> = picks.iter().map(|p| p.id).collect();
        assert_eq!(ids, vec![0], "one pick per key, the retried head first");
    }

    /// A delayed head cancelled leaves no work behind: the shard is idle
    /// (its stale timer is not reported as due), and a later job of the
    /// key is due by its own time.
    #[test]
    fn a_cancelled_delayed_head_leaves_no_stale_timer() {
        let mut s = fresh();
        let rec = Record::Enqueue {
            created_ms: 0,
            not_before_ms: 600_000,
            max_attempts: 1,
            key: "k",
            dedup: None,
            payload: b"",
        };
        s.apply(0, 0, &rec).unwrap();
        assert_eq!(s.next_due_ms(), Some(600_000));
        s.apply(50, 0, &Record::Cancel { job: 0, key: "k" })
            .unwrap();
        assert_eq!(s.next_due_ms(), None, "nothing is left to run");
        enqueue(&mut s, 100, "k");
        assert_eq!(s.next_due_ms(), Some(0), "the key's new job is due now");
    }

    fn claim(s: &mut ShardState, pos: u64, job: u64, attempt: u32, at: u64) {
        let rec = Record::Claim {
            job,
            attempt,
            fence: pos,
            started_ms: at,
            key: "k",
        };
        s.apply(pos, 0, &rec).unwrap();
    }

    fn fail(s: &mut ShardState, pos: u64, job: u64, dead: bool, reason: &str) {
        let rec = Record::Fail {
            job,
            retry_at_ms: 0,
            dead,
            key: "k",
            reason,
        };
        s.apply(pos, 0, &rec).unwrap();
    }

    /// A key of concurrency 3 runs its first three jobs; one fails with a
    /// retry that waits: nothing later starts before it. A replay of the
    /// same records gives the same state, and a new owner (every run back)
    /// starts them again in key order once the retry is due.
    #[test]
    fn runs_of_a_concurrent_key_replay_and_restart_in_order() {
        use shardq_core::flow::FlowPolicy;
        let flow = every_key(FlowPolicy {
            concurrency: 3,
            ..FlowPolicy::default()
        });
        let never = |_: &str| false;
        let mut s = fresh();
        let mut log: Vec<(u64, Record<'static>)> = Vec::new();
        let mut write = |s: &mut ShardState, pos: u64, rec: Record<'static>| {
            s.apply(pos, 0, &rec).unwrap();
            log.push((pos, rec));
        };
        for pos in [0, 10, 20, 30] {
            let rec = Record::Enqueue {
                created_ms: 0,
                not_before_ms: 0,
                max_attempts: 5,
                key: "k",
                dedup: None,
                payload: b"",
            };
            write(&mut s, pos, rec);
        }
        let ids = |picks: Vec<Pick>| picks.iter().map(|p| p.id).collect::<Vec<u64>>();
        let picks = s.pick(0, &mut test_fences(), 10, &never, Some(&flow));
        assert_eq!(ids(picks.clone()), [0, 10, 20], "three at once, in order");
        for (i, p) in picks.iter().enumerate() {
            let rec = Record::Claim {
                job: p.id,
                attempt: 1,
                fence: 100 + i as u64,
                started_ms: 0,
                key: "k",
            };
            write(&mut s, 100 + i as u64, rec);
        }
        assert!(ids(s.pick(0, &mut test_fences(), 10, &never, Some(&flow))).is_empty());
        let fail = Record::Fail {
            job: 10,
            retry_at_ms: 5_000,
            dead: false,
            key: "k",
            reason: "later",
        };
        write(&mut s, 200, fail);
        write(&mut s, 210, Record::Ack { job: 0, key: "k" });
        assert!(
            ids(s.pick(0, &mut test_fences(), 10, &never, Some(&flow))).is_empty(),
            "job 30 overtook the waiting retry of job 10"
        );
        assert_eq!(s.key_counts("k").in_flight, 1);
        let view = |s: &ShardState| -> Vec<(u64, bool, u64, u32)> {
            (s.key_live_jobs("k", 10).iter())
                .map(|j| {
                    (
                        j.slot.id,
                        j.run.is_some(),
                        j.slot.not_before_ms,
                        j.slot.attempt,
                    )
                })
                .collect()
        };
        assert_eq!(
            view(&s),
            [(10, false, 5_000, 1), (20, true, 0, 1), (30, false, 0, 0)]
        );
        let mut replayed = fresh();
        for (pos, rec) in &log {
            replayed.apply(*pos, 0, rec).unwrap();
        }
        assert_eq!(view(&replayed), view(&s), "replay agrees");
        replayed.reset_in_flight();
        assert!(ids(replayed.pick(0, &mut test_fences(), 10, &never, Some(&flow))).is_empty());
        let again = replayed.pick(5_000, &mut test_fences(), 10, &never, Some(&flow));
        assert_eq!(ids(again), [10, 20, 30], "a new owner starts them in order");
        let go = s.pick(5_000, &mut test_fences(), 10, &never, Some(&flow));
        assert_eq!(ids(go), [10, 30], "the retry, then the next job");
    }

    /// A new owner claims again a job the log shows in flight (the old
    /// owner's run ends without a record): the claim replaces that run,
    /// live and on a replay of the whole log.
    #[test]
    fn a_claim_after_a_takeover_replaces_the_old_owners_run() {
        let mut s = fresh();
        enqueue(&mut s, 0, "k");
        claim(&mut s, 100, 0, 1, 0);
        s.reset_in_flight();
        claim(&mut s, 200, 0, 2, 5);
        assert_eq!(s.key_counts("k").in_flight, 1);
        let mut replayed = fresh();
        enqueue(&mut replayed, 0, "k");
        claim(&mut replayed, 100, 0, 1, 0);
        claim(&mut replayed, 200, 0, 2, 5);
        assert_eq!(replayed.key_counts("k").in_flight, 1);
        assert_eq!(replayed.in_flight(0).map(|r| r.fence), Some(200));
        replayed
            .apply(300, 0, &Record::Ack { job: 0, key: "k" })
            .unwrap();
        assert_eq!(replayed.key_counts("k"), KeyCounts::default());
    }

    /// A new owner cancels a job the old owner left running (the new owner
    /// dropped that run at adopt, without a record): a replay of the log
    /// ends the run with the cancel, and the key runs on.
    #[test]
    fn a_cancel_after_a_takeover_ends_the_old_owners_run_on_replay() {
        let mut s = fresh();
        enqueue(&mut s, 0, "k");
        enqueue(&mut s, 10, "k");
        claim(&mut s, 100, 0, 1, 0);
        s.apply(200, 0, &Record::Cancel { job: 0, key: "k" })
            .expect("a cancel of a run left by an owner that went away");
        assert_eq!(s.key_counts("k").in_flight, 0);
        assert_eq!(s.key_counts("k").depth, 1);
        let picks = s.pick(0, &mut test_fences(), 10, &|_| false, None);
        assert_eq!(picks.iter().map(|p| p.id).collect::<Vec<_>>(), [10]);
    }

    /// A key of concurrency 3 whose second job waits: one pick starts its
    /// first job and finds the second not due. The key stays scheduled for
    /// the second's time, through `next_due_ms`, and starts it then.
    #[test]
    fn a_keys_later_job_not_due_in_a_pick_that_started_one_is_started_when_due() {
        use shardq_core::flow::FlowPolicy;
        let flow = every_key(FlowPolicy {
            concurrency: 3,
            ..FlowPolicy::default()
        });
        let never = |_: &str| false;
        let mut s = fresh();
        let add = |s: &mut ShardState, pos: u64, key: &str, not_before_ms: u64| {
            let rec = Record::Enqueue {
                created_ms: 0,
                not_before_ms,
                max_attempts: 5,
                key,
                dedup: None,
                payload: b"",
            };
            s.apply(pos, 0, &rec).unwrap();
        };
        add(&mut s, 0, "k", 0);
        add(&mut s, 10, "k", 60_000);
        for (pos, key) in [(20, "a"), (30, "b"), (40, "c")] {
            add(&mut s, pos, key, 0);
        }
        let picks = s.pick(0, &mut test_fences(), 8, &never, Some(&flow));
        let mut ids: Vec<u64> = picks.iter().map(|p| p.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, [0, 20, 30, 40]);
        for (i, p) in picks.iter().enumerate() {
            let rec = Record::Claim {
                job: p.id,
                attempt: 1,
                fence: 100 + i as u64,
                started_ms: 0,
                key: &p.key,
            };
            s.apply(100 + i as u64, 0, &rec).unwrap();
        }
        assert_eq!(s.next_due_ms(), Some(60_000), "the waiting job's time");
        let later = s.pick(60_000, &mut test_fences(), 8, &never, Some(&flow));
        assert_eq!(later.iter().map(|p| p.id).collect::<Vec<_>>(), [10]);
    }

    /// A run cancelled while it ran leaves work only a claim does once its
    /// lease lapses (its job goes): the shard then ranks first, so a
    /// process ranking keys over its shards claims there even while other
    /// shards' keys rank better. Before the lapse the key ranks nothing.
    #[test]
    fn a_lapsed_cancelled_run_makes_its_shard_rank_first() {
        use shardq_core::flow::FlowPolicy;
        let mut s = fresh();
        let flow = every_key(FlowPolicy {
            weight: 2,
            ..FlowPolicy::default()
        });
        let never = |_: &str| false;
        enqueue(&mut s, 0, "k");
        assert_eq!(s.ranks(0, 4, &never, &flow).len(), 1, "k is ready");
        claim(&mut s, 100, 0, 1, 0);
        s.set_lease(0, 1_000);
        s.apply(200, 0, &Record::CancelRun { job: 0, fence: 100 })
            .unwrap();
        assert!(s.ranks(500, 4, &never, &flow).is_empty(), "k runs");
        assert_eq!(s.ranks(2_000, 4, &never, &flow), vec![Rank::FIRST]);
    }

    /// Replay gives a job its attempts' start times and last reason, keeps
    /// them for a dead letter and never lends them to the key's next job.
    #[test]
    fn attempt_times_and_reasons_follow_their_job() {
        let mut s = fresh();
        enqueue(&mut s, 0, "k");
        enqueue(&mut s, 10, "k");
        claim(&mut s, 100, 0, 1, 5);
        fail(&mut s, 110, 0, false, "first");
        claim(&mut s, 120, 0, 2, 7);
        fail(&mut s, 130, 0, false, "second");
        claim(&mut s, 140, 0, 3, 9);
        let head = s.live_job(0).unwrap();
        assert_eq!((head.starts, head.reason), (&[5, 7, 9][..], Some("second")));
        assert_eq!(s.live_job(10).unwrap().starts, &[] as &[u64]);
        fail(&mut s, 150, 0, true, "third");
        let dead = s.live_job(0).unwrap();
        assert_eq!((dead.starts, dead.reason), (&[5, 7, 9][..], Some("third")));
        assert_eq!(s.dead_list("s", 10)[0].attempt_starts_ms, vec![5, 7, 9]);
        // The next job starts with a clean history.
        claim(&mut s, 160, 10, 1, 20);
        let next = s.live_job(10).unwrap();
        assert_eq!((next.starts, next.reason), (&[20][..], None));
        // The dead letter retried goes before it (older id); its own run
        // leaves job 10's history alone.
        fail(&mut s, 170, 10, false, "ten failed");
        s.apply(180, 0, &Record::DeadRetry { job: 0 }).unwrap();
        assert_eq!(
            s.live_job(0).unwrap().starts,
            &[] as &[u64],
            "attempts reset"
        );
        claim(&mut s, 190, 0, 1, 30);
        fail(&mut s, 200, 0, false, "zero again");
        let ten = s.live_job(10).unwrap();
        assert_eq!((ten.starts, ten.reason), (&[20][..], Some("ten failed")));
        let zero = s.live_job(0).unwrap();
        assert_eq!((zero.starts, zero.reason), (&[30][..], Some("zero again")));
    }
}
