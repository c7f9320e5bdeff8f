//! One process's runtime flow control ([`FlowControl`]): admitting starts
//! against key and group buckets ([`FlowControl::admit`],
//! [`FlowControl::admit_many`]), re-reading the settings
//! ([`FlowControl::refresh`]), a handler's back-off holding its group,
//! group run slots given back and renewed, and what it did
//! ([`FlowStats`], [`GroupLevel`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use serde::Serialize;

use super::bucket::Bucket;
use super::groups::{GroupBuckets, RunStart, SlotAsk};
use super::policy::{ConcurrencyRules, FlowSettings, GroupLimit};
use crate::error::QueueError;

/// How long settings are used before they are read again, and the longest a
/// refused key waits before it is asked about again.
pub const FLOW_RECHECK_MS: u64 = 1_000;
/// Longest back-off a handler may ask for (one day).
pub const BACKOFF_MS_MAX: u64 = 86_400_000;

/// The answer of [`FlowControl::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Start it now (its tokens are taken).
    Now,
    /// Not before this time; ask again then.
    NotBefore(u64),
}

/// Where settings come from when they are read again: `Ok(None)` when
/// they did not change since the source's last answer (so a recheck of
/// unchanged settings costs no parse and no comparison of every policy).
pub type FlowSource = Box<
    dyn Fn() -> Result<Option<FlowSettings>, Box<dyn std::error::Error + Send + Sync>>
        + Send
        + Sync,
>;

/// A group's limit and its state now, as `shardq status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupLevel {
    /// The group.
    pub name: String,
    /// Its rate (`200/s`), if it has one.
    pub rate: Option<String>,
    /// Its bucket's size.
    pub burst: u64,
    /// Tokens in its bucket now (the burst when it has no bucket yet).
    pub tokens: f64,
    /// Its runs at once, if it limits them.
    pub concurrency: Option<u32>,
    /// Its run slots taken now, over every process.
    pub running: u64,
    /// When a handler's back-off holding the group ends, if it does now.
    pub held_until_ms: Option<u64>,
    /// Why the bucket could not be read, if it could not.
    pub error: Option<String>,
}

/// A key held back, until when and by what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeldKey {
    /// When it is asked about again.
    pub until_ms: u64,
    /// The group whose bucket held it; none: its own rate.
    pub by: Option<String>,
}

/// Counts of what flow control did, since the process started.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FlowStats {
    /// Starts admitted, by group.
    pub group_starts: BTreeMap<String, u64>,
    /// Refusals by a group's bucket, by group.
    pub group_throttled: BTreeMap<String, u64>,
    /// Refusals by keys' own buckets.
    pub key_throttled: u64,
    /// Keys refused at their last check and when they are asked again.
    pub held_keys: BTreeMap<String, HeldKey>,
    /// Groups whose bucket was empty at its last check, until when.
    pub held_groups: BTreeMap<String, u64>,
    /// Failed reads of the settings or of a group's bucket (a failed read
    /// keeps the settings in use; a group that cannot be read holds its
    /// keys back until it can).
    pub errors: u64,
    /// The last of them.
    pub last_error: Option<String>,
}

struct Loaded {
    settings: Arc<FlowSettings>,
}

/// One process's flow control: the key buckets of the shards it owns and
/// its view of the shared group buckets.
pub struct FlowControl {
    loaded: RwLock<Loaded>,
    /// Of the settings in use, outside the lock: a claim asks them for
    /// every key it would start.
    limits: AtomicBool,
    ranks: AtomicBool,
    /// Whether any policy lets a key run more than once at once.
    several: AtomicBool,
    /// Counts the settings put in use ([`FlowControl::version`]).
    version: AtomicU64,
    /// The virtual time of ranking over every shard of this process
    /// ([`FlowControl::fair_vtime`]).
    fair_vtime: AtomicU64,
    loaded_ms: AtomicU64,
    source: Option<FlowSource>,
    keys: Mutex<HashMap<Box<str>, Bucket>>,
    groups: Arc<dyn GroupBuckets>,
    stats: Mutex<FlowStats>,
}

impl fmt::Debug for FlowControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlowControl").finish_non_exhaustive()
    }
}

/// Most keys listed as held in [`FlowStats`].
const HELD_KEYS_SHOWN: usize = 1_000;

impl FlowStats {
    /// Lists `key` as held until `until_ms` by group `by` (none: its own
    /// rate), within [`HELD_KEYS_SHOWN`].
    fn note_held(&mut self, key: &str, until_ms: u64, by: Option<String>) {
        if self.held_keys.len() < HELD_KEYS_SHOWN {
            self.held_keys
                .insert(key.to_string(), HeldKey { until_ms, by });
        }
    }
}

impl FlowControl {
    /// Flow control with fixed `settings` and group buckets `groups`.
    pub fn new(settings: FlowSettings, groups: Arc<dyn GroupBuckets>) -> FlowControl {
        let limits = settings.limits_starts();
        let ranks = settings.ranks_keys();
        let several = settings.key_concurrency_high() > 1;
        FlowControl {
            loaded: RwLock::new(Loaded {
                settings: Arc::new(settings),
            }),
            limits: AtomicBool::new(limits),
            ranks: AtomicBool::new(ranks),
            several: AtomicBool::new(several),
            version: AtomicU64::new(1),
            fair_vtime: AtomicU64::new(0),
            loaded_ms: AtomicU64::new(0),
            source: None,
            keys: Mutex::new(HashMap::new()),
            groups,
            stats: Mutex::new(FlowStats::default()),
        }
    }

    /// Reads the settings again from `source` at most every
    /// [`FLOW_RECHECK_MS`] ([`FlowControl::refresh`]).
    pub fn with_source(mut self, source: FlowSource) -> FlowControl {
        self.source = Some(source);
        self
    }

    /// The settings in use.
    pub fn settings(&self) -> Arc<FlowSettings> {
        Arc::clone(&self.read().settings)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Loaded> {
        self.loaded.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Uses `settings` from now on.
    pub fn set(&self, settings: FlowSettings, now_ms: u64) {
        let mut l = self.loaded.write().unwrap_or_else(|e| e.into_inner());
        self.limits
            .store(settings.limits_starts(), Ordering::Relaxed);
        self.ranks.store(settings.ranks_keys(), Ordering::Relaxed);
        self.several
            .store(settings.key_concurrency_high() > 1, Ordering::Relaxed);
        if *l.settings != settings {
            l.settings = Arc::new(settings);
            self.version.fetch_add(1, Ordering::Relaxed);
        }
        self.loaded_ms.store(now_ms, Ordering::Relaxed);
    }

    /// Reads the settings again when the last read is [`FLOW_RECHECK_MS`]
    /// old (a failed read keeps the settings in use, and is logged), and
    /// forgets key buckets that are full again (a new one is the same).
    pub fn refresh(&self, now_ms: u64) {
        if now_ms < (self.loaded_ms.load(Ordering::Relaxed)).saturating_add(FLOW_RECHECK_MS) {
            return;
        }
        match self.source.as_ref().map(|source| source()) {
            Some(Ok(Some(s))) => self.set(s, now_ms),
            Some(Ok(None)) => self.loaded_ms.store(now_ms, Ordering::Relaxed),
            Some(Err(e)) => {
                self.note_error(format!("reading the flow settings: {e}"));
                self.loaded_ms.store(now_ms, Ordering::Relaxed);
            }
            // Fixed settings: only the pruning below.
            None => self.loaded_ms.store(now_ms, Ordering::Relaxed),
        }
        let settings = self.settings();
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        keys.retain(|k, b| {
            let p = settings.for_key(k);
            match (p.rate, p.burst_or_default()) {
                (Some(r), Some(burst)) => {
                    b.refill(r, burst, now_ms);
                    b.units < burst.saturating_mul(r.per_ms) || b.held_until_ms > now_ms
                }
                _ => false,
            }
        });
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        st.held_keys.retain(|_, h| h.until_ms > now_ms);
        st.held_groups.retain(|_, at| *at > now_ms);
    }

    /// Reads the settings again now, whatever the time of the last read:
    /// a change this process stored itself takes effect in it at once (in
    /// every other process within [`FLOW_RECHECK_MS`]).
    pub fn reread(&self, now_ms: u64) {
        self.loaded_ms.store(0, Ordering::Relaxed);
        self.refresh(now_ms);
    }

    /// Whether any policy sets a weight or a priority: ready keys then
    /// start by [`FairQueue`](super::FairQueue).
    pub fn ranks_keys(&self) -> bool {
        self.ranks.load(Ordering::Relaxed)
    }

    /// The virtual time of ranking over every shard of this process: each
    /// shard's [`FairQueue`](super::FairQueue) is raised to it before it
    /// queues keys ([`FairQueue::raise_vtime`](super::FairQueue::raise_vtime))
    /// and raises it after it charges them
    /// ([`FlowControl::raise_fair_vtime`]), so the start tags, and so the
    /// [`Rank`](super::Rank)s, of keys on different shards compare.
    pub fn fair_vtime(&self) -> u64 {
        self.fair_vtime.load(Ordering::Relaxed)
    }

    /// Moves the process's virtual time on to `v` if it is later.
    pub fn raise_fair_vtime(&self, v: u64) {
        self.fair_vtime.fetch_max(v, Ordering::Relaxed);
    }

    /// The (priority, weight) of `key`.
    pub fn rank_of(&self, key: &str) -> (i32, u32) {
        let l = self.read();
        let p = l.settings.for_key(key);
        (p.priority, p.weight)
    }

    /// Grows each time settings that differ from those in use are put in
    /// use, from 1: what a caller derived from them may need deriving again.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }

    /// [`FlowSettings::concurrency_rules`] of the settings in use.
    pub fn concurrency_rules(&self) -> Option<ConcurrencyRules> {
        if !self.several.load(Ordering::Relaxed) {
            return None;
        }
        self.read().settings.concurrency_rules()
    }

    /// Runs of `key` allowed at once (1 unless a policy says more).
    pub fn concurrency_of(&self, key: &str) -> u32 {
        if !self.several.load(Ordering::Relaxed) {
            return 1;
        }
        self.read().settings.for_key(key).concurrency
    }

    /// Whether any policy limits starts (when not, [`FlowControl::admit`]
    /// always answers `Now`).
    pub fn limits_starts(&self) -> bool {
        self.limits.load(Ordering::Relaxed)
    }

    /// Whether the run `start` of `key` may start at `now_ms`; when it may,
    /// its tokens are taken, and its group's run slot when the group limits
    /// its runs (held until the run's lease ends, unless
    /// [`FlowControl::runs_ended`] gives it back first or
    /// [`FlowControl::runs_extended`] renews it). See the module header.
    pub fn admit(&self, key: &str, now_ms: u64, start: &RunStart<'_>) -> Admit {
        if !self.limits_starts() {
            return Admit::Now;
        }
        self.admit_many(&[(key, *start)], now_ms)[0]
    }

    /// [`FlowControl::admit`] for the runs a claim would start at once, in
    /// order, with one call to each group's store for all of them (a
    /// claim's starts cost one round trip per group, not one per start).
    /// The answers are those of asking one at a time: a group that refuses
    /// one start refuses the ones after it, and a key's start refused
    /// refuses its later ones (a claim of a key of concurrency above 1 may
    /// start several of its runs, in order: each counts the tokens its
    /// earlier ones were promised). One difference, never looser: when a
    /// group refuses a run of a key with a rate of its own, a later run of
    /// that key may be refused by the key (its tokens counted as promised
    /// to the refused run) where asking one at a time would name the group.
    pub fn admit_many(&self, runs: &[(&str, RunStart<'_>)], now_ms: u64) -> Vec<Admit> {
        let mut out = vec![Admit::Now; runs.len()];
        if !self.limits_starts() {
            return out;
        }
        let settings = self.settings();
        let recheck = now_ms.saturating_add(FLOW_RECHECK_MS);
        let mut by_group: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        let mut key_limited = Vec::new();
        // Per key in this call: tokens promised to its earlier runs, and
        // when its first refused run may start (its later ones wait too).
        let mut promised: HashMap<&str, u64> = HashMap::new();
        let mut refused: HashMap<&str, u64> = HashMap::new();
        // Key buckets are peeked here and charged once the groups have
        // answered, so the lock is not held across a group's store (a file
        // lock, a round trip) and a refusal by the group costs the key
        // nothing. Only the shard's owner starts a key, one claim at a
        // time, so no other start of it comes between.
        {
            let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
            for (i, (key, _)) in runs.iter().enumerate() {
                if let Some(&at) = refused.get(key) {
                    let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
                    st.key_throttled += 1;
                    st.note_held(key, at, None);
                    out[i] = Admit::NotBefore(at);
                    continue;
                }
                let p = settings.for_key(key);
                if let Some((rate, burst)) = p.rate.zip(p.burst_or_default()) {
                    let b = keys
                        .entry((*key).into())
                        .or_insert_with(|| Bucket::full(rate, burst, now_ms));
                    let before = promised.entry(key).or_default();
                    if let Err(at) = b.peek_after(rate, burst, now_ms, *before) {
                        let at = at.min(recheck);
                        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
                        st.key_throttled += 1;
                        st.note_held(key, at, None);
                        out[i] = Admit::NotBefore(at);
                        refused.insert(key, at);
                        continue;
                    }
                    *before += 1;
                    key_limited.push(i);
                }
                if let Some(g) = p
                    .group
                    .as_deref()
                    .filter(|g| settings.groups.contains_key(*g))
                {
                    by_group.entry(g).or_default().push(i);
                }
            }
        }
        for (name, idx) in by_group {
            let limit = &settings.groups[name];
            let held = (self.stats.lock().unwrap_or_else(|e| e.into_inner()))
                .held_groups
                .get(name)
                .copied()
                .filter(|&at| at > now_ms);
            let holders: Vec<String> = idx.iter().map(|&i| runs[i].1.holder()).collect();
            let asks: Vec<SlotAsk<'_>> = (idx.iter().zip(&holders))
                .map(|(&i, h)| SlotAsk {
                    holder: h,
                    until_ms: runs[i].1.lease_until_ms,
                })
                .collect();
            let (taken, at) = match held {
                // Other processes only take tokens: an empty bucket seen
                // here stays empty at least until then.
                Some(at) => (0, at),
                None => match self.groups.take_many(name, limit, now_ms, &asks) {
                    Ok(r) => r,
                    Err(e) => {
                        self.note_error(format!("group {name:?}'s bucket: {e}"));
                        (0, recheck)
                    }
                },
            };
            let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            *st.group_starts.entry(name.to_string()).or_default() += taken as u64;
            if taken < idx.len() {
                let at = at.min(recheck);
                *st.group_throttled.entry(name.to_string()).or_default() +=
                    (idx.len() - taken) as u64;
                st.held_groups.insert(name.to_string(), at);
                for &i in &idx[taken..] {
                    st.note_held(runs[i].0, at, Some(name.to_string()));
                    out[i] = Admit::NotBefore(at);
                }
            }
        }
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        for i in key_limited {
            if out[i] != Admit::Now {
                continue;
            }
            let p = settings.for_key(runs[i].0);
            if let Some((rate, burst)) = p.rate.zip(p.burst_or_default()) {
                // A full bucket forgotten by a refresh meanwhile is the
                // same as a new one: the start is charged either way.
                let b = (keys.entry(runs[i].0.into()))
                    .or_insert_with(|| Bucket::full(rate, burst, now_ms));
                let _ = b.take(rate, burst, now_ms);
            }
        }
        out
    }

    /// A handler's back-off for `key`'s whole group: no key of the group
    /// starts before `until_ms`, in any process. The group held; none when
    /// the key has no group (the key's own wait is its job's delay), or
    /// when the group's store failed (counted in [`FlowStats::errors`]: the
    /// run's back-off stands, only the group's hold is lost).
    pub fn hold_group_of(&self, key: &str, until_ms: u64) -> Option<String> {
        let settings = self.settings();
        let (name, limit) = (settings.for_key(key).group.as_ref())
            .and_then(|g| settings.groups.get_key_value(g))?;
        if let Err(e) = self.groups.hold(name, limit, until_ms) {
            self.note_error(format!("holding group {name:?}: {e}"));
            return None;
        }
        // Not remembered here past the next look at the store: the hold
        // lives there, where `group resume` lifts it for every process.
        Some(name.clone())
    }

    /// Lifts `group`'s hold (a handler's group back-off) in the shared
    /// store and in this process: its keys start again at once here, and
    /// within [`FLOW_RECHECK_MS`] in every other process. A group the
    /// settings do not name (removed) is lifted as one without limits.
    pub fn resume_group(&self, group: &str) -> Result<(), QueueError> {
        let settings = self.settings();
        let limit = settings.groups.get(group).cloned().unwrap_or(GroupLimit {
            rate: None,
            burst: None,
            concurrency: None,
        });
        self.groups.resume(group, &limit)?;
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        st.held_groups.remove(group);
        Ok(())
    }

    /// The groups that limit their runs of the runs `runs` (key, fence) of
    /// `shard`, each with its runs' slot holders.
    fn slot_groups(&self, shard: &str, runs: &[(&str, u64)]) -> BTreeMap<String, Vec<String>> {
        let mut by_group: BTreeMap<String, Vec<String>> = BTreeMap::new();
        if !self.limits_starts() {
            return by_group;
        }
        let settings = self.settings();
        for &(key, fence) in runs {
            if let Some(g) = (settings.for_key(key).group.as_ref()).filter(|g| {
                settings
                    .groups
                    .get(*g)
                    .is_some_and(|l| l.concurrency.is_some())
            }) {
                let holder = RunStart {
                    shard,
                    fence,
                    lease_until_ms: 0,
                }
                .holder();
                by_group.entry(g.clone()).or_default().push(holder);
            }
        }
        by_group
    }

    /// The runs `runs` (key, fence) of `shard` are over (acked, failed,
    /// backed off, or refused as no longer current): their group run slots
    /// are given back, and this process asks those groups again at its next
    /// claim. A slot names one run, so giving back an old run's slot never
    /// frees a newer run's of the same key. A failure is counted, not
    /// returned: the slot then lapses with its run's lease.
    pub fn runs_ended(&self, shard: &str, runs: &[(&str, u64)]) {
        for (group, holders) in self.slot_groups(shard, runs) {
            let holders: Vec<&str> = holders.iter().map(String::as_str).collect();
            if let Err(e) = self.groups.free_slots(&group, &holders) {
                self.note_error(format!("giving back group {group:?}'s run slots: {e}"));
            }
            let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            st.held_groups.remove(&group);
        }
    }

    /// The runs `runs` (key, fence) of `shard` had their leases moved to
    /// `until_ms`: so are their group run slots (taken again when they
    /// lapsed meanwhile: the run is current, so it counts).
    pub fn runs_extended(&self, shard: &str, runs: &[(&str, u64)], until_ms: u64) {
        for (group, holders) in self.slot_groups(shard, runs) {
            let holders: Vec<&str> = holders.iter().map(String::as_str).collect();
            if let Err(e) = self.groups.renew_slots(&group, &holders, until_ms) {
                self.note_error(format!("renewing group {group:?}'s run slots: {e}"));
            }
        }
    }

    /// Runs of `group` holding a slot at `now_ms`, over every process (none
    /// when its store cannot be read).
    pub fn group_running(&self, group: &str, now_ms: u64) -> Option<u64> {
        match self.groups.peek(group) {
            Ok(st) => Some(st.map_or(0, |st| st.running(now_ms))),
            Err(e) => {
                self.note_error(format!("group {group:?}'s run slots: {e}"));
                None
            }
        }
    }

    /// Every group's limit and its state at `now_ms`, read from the shared
    /// store (the same for every process of the deployment).
    pub fn group_levels(&self, now_ms: u64) -> Vec<GroupLevel> {
        let settings = self.settings();
        (settings.groups.iter())
            .map(|(name, limit)| {
                let burst = limit.burst_or_default();
                let mut level = GroupLevel {
                    name: name.clone(),
                    rate: limit.rate.map(|r| r.to_string()),
                    burst,
                    tokens: burst as f64,
                    concurrency: limit.concurrency,
                    running: 0,
                    held_until_ms: None,
                    error: None,
                };
                match self.groups.peek(name) {
                    Ok(Some(mut st)) => {
                        let rate = limit.bucket_rate();
                        let _ = st.bucket.peek(rate, burst, now_ms);
                        level.tokens = st.bucket.units as f64 / rate.per_ms as f64;
                        level.held_until_ms = Some(st.bucket.held_until_ms).filter(|&t| t > now_ms);
                        level.running = st.running(now_ms);
                    }
                    Ok(None) => {}
                    Err(e) => level.error = Some(e.to_string()),
                }
                level
            })
            .collect()
    }

    /// Counts a failure to read the settings or a group's store (shown in
    /// [`FlowStats`]).
    pub fn note_error(&self, what: String) {
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        st.errors += 1;
        st.last_error = Some(what);
    }

    /// What flow control did so far, and what it holds back now.
    pub fn stats(&self) -> FlowStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Checks a back-off a handler asked for.
pub fn validate_backoff_ms(ms: u64) -> Result<(), QueueError> {
    if ms > BACKOFF_MS_MAX {
        return Err(QueueError::InvalidOption {
            name: "back-off",
            value: format!("{ms} ms"),
            allowed: format!("0 to {BACKOFF_MS_MAX} ms"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::flow::testing::{rate, settings};
    use crate::flow::{
        FlowPolicy, FlowSettings, GroupBuckets, GroupLimit, LocalGroupBuckets, Rate, RunStart,
        GROUP_SLOT_RECHECK_MS,
    };

    /// A run for checks that do not count runs.
    const ANY_RUN: RunStart<'static> = RunStart {
        shard: "s",
        fence: 0,
        lease_until_ms: u64::MAX,
    };

    #[test]
    fn admit_charges_the_key_and_its_group_and_names_the_wait() {
        let s = settings();
        s.validate().expect("valid");
        let g: Arc<dyn GroupBuckets> = Arc::new(LocalGroupBuckets::default());
        let f = FlowControl::new(s, Arc::clone(&g));
        assert_eq!(f.admit("paid:x", 0, &ANY_RUN), Admit::Now, "no policy");
        assert_eq!(f.admit("free:a", 0, &ANY_RUN), Admit::Now);
        assert_eq!(f.admit("free:a", 0, &ANY_RUN), Admit::NotBefore(500));
        assert_eq!(
            f.admit("free:b", 0, &ANY_RUN),
            Admit::Now,
            "a bucket per key"
        );
        // The group: burst 2, then one every 100 ms.
        assert_eq!(f.admit("free:vip", 0, &ANY_RUN), Admit::Now);
        assert_eq!(f.admit("free:vip", 0, &ANY_RUN), Admit::Now);
        assert_eq!(f.admit("free:vip", 0, &ANY_RUN), Admit::NotBefore(100));
        assert_eq!(f.admit("free:vip", 100, &ANY_RUN), Admit::Now);
        // A group's hold holds every key of it; waits are capped so a
        // changed setting is seen within FLOW_RECHECK_MS.
        assert_eq!(f.hold_group_of("free:vip", 5_000), Some("api".into()));
        assert_eq!(f.admit("free:vip", 200, &ANY_RUN), Admit::NotBefore(1_200));
        assert_eq!(f.hold_group_of("free:a", 5_000), None);
        let st = f.stats();
        assert_eq!(st.group_starts["api"], 3);
        assert_eq!(st.key_throttled, 1);
    }

    #[test]
    fn a_group_refusal_costs_the_key_no_token() {
        let mut s = settings();
        s.keys.insert(
            "k".into(),
            FlowPolicy {
                rate: Some(rate("1/s")),
                burst: Some(1),
                group: Some("api".into()),
                ..FlowPolicy::default()
            },
        );
        let f = FlowControl::new(s, Arc::new(LocalGroupBuckets::default()));
        assert_eq!(f.admit("free:vip", 0, &ANY_RUN), Admit::Now);
        assert_eq!(f.admit("free:vip", 0, &ANY_RUN), Admit::Now);
        assert_eq!(
            f.admit("k", 0, &ANY_RUN),
            Admit::NotBefore(100),
            "the group is empty"
        );
        assert_eq!(
            f.admit("k", 100, &ANY_RUN),
            Admit::Now,
            "the key kept its token"
        );
    }

    /// Puts every key starting with `prefix` in group `name`, of `rate`
    /// (with its burst) if given and `concurrency` runs at once.
    fn group_of_prefix(
        s: &mut FlowSettings,
        prefix: &str,
        name: &str,
        rate: Option<(Rate, u64)>,
        concurrency: u32,
    ) {
        let limit = GroupLimit {
            rate: rate.map(|r| r.0),
            burst: rate.map(|r| r.1),
            concurrency: Some(concurrency),
        };
        s.groups.insert(name.into(), limit);
        let policy = FlowPolicy {
            group: Some(name.into()),
            ..FlowPolicy::default()
        };
        s.prefixes.insert(prefix.into(), policy);
    }

    /// A group's concurrency counts runs over every key of it: a start
    /// takes a slot until its lease ends, an ended or renewed run gives it
    /// back or keeps it, a holder keeps its own slot, a lapsed one frees.
    #[test]
    fn a_groups_runs_are_capped_until_they_end_or_lapse() {
        let mut s = FlowSettings::default();
        group_of_prefix(&mut s, "t:", "db", None, 2);
        s.validate().expect("valid");
        let g: Arc<dyn GroupBuckets> = Arc::new(LocalGroupBuckets::default());
        let f = FlowControl::new(s, Arc::clone(&g));
        // Run `fence` of shard "s", its lease until `until`.
        let run = |fence, until| RunStart {
            shard: "s",
            fence,
            lease_until_ms: until,
        };
        assert_eq!(f.admit("t:a", 0, &run(1, 1_000)), Admit::Now);
        assert_eq!(f.admit("t:b", 0, &run(2, 1_000)), Admit::Now);
        assert_eq!(
            f.admit("t:a", 0, &run(1, 1_000)),
            Admit::Now,
            "a run keeps its slot"
        );
        assert_eq!(
            f.admit("t:c", 0, &run(3, 1_000)),
            Admit::NotBefore(GROUP_SLOT_RECHECK_MS),
            "two runs at once"
        );
        assert_eq!(
            f.admit("other", 1, &run(4, 1_000)),
            Admit::Now,
            "no group, no cap"
        );
        f.runs_ended("s", &[("t:a", 1)]);
        assert_eq!(
            f.admit("t:a", 5, &run(5, 1_000)),
            Admit::Now,
            "a slot given back"
        );
        // The first run's give-back, late, frees nothing of the second's.
        f.runs_ended("s", &[("t:a", 1)]);
        assert_eq!(f.admit("t:d", 6, &run(6, 1_000)), Admit::NotBefore(26));
        f.runs_extended("s", &[("t:b", 2)], 5_000);
        // At 1,000 run 5's slot lapses; run 2's was renewed.
        assert_eq!(f.admit("t:d", 1_000, &run(7, 9_000)), Admit::Now);
        assert_eq!(
            f.admit("t:e", 1_001, &run(8, 9_000)),
            Admit::NotBefore(1_021)
        );
        let level = &f.group_levels(1_001)[0];
        assert_eq!((level.running, level.concurrency), (2, Some(2)));
        assert_eq!(level.rate, None);
        // A current run whose slot lapsed takes it again when extended.
        f.runs_extended("s", &[("t:a", 5)], 9_000);
        assert_eq!(f.group_levels(1_001)[0].running, 3);
        f.runs_ended("s", &[("t:b", 2), ("t:d", 7), ("t:a", 5)]);
        assert_eq!(f.group_levels(1_001)[0].running, 0);
        // A back-off's hold still holds a group without a rate.
        assert_eq!(f.hold_group_of("t:a", 3_000), Some("db".into()));
        assert_eq!(
            f.admit("t:a", 2_000, &run(9, 9_000)),
            Admit::NotBefore(3_000)
        );
    }

    /// Asking for a claim's starts at once answers as asking one at a time,
    /// also for several runs of one key (a key of concurrency above 1): each
    /// counts the tokens its key's earlier runs took.
    #[test]
    fn admitting_many_at_once_answers_as_one_at_a_time() {
        let mut s = settings();
        group_of_prefix(&mut s, "db:", "db", Some((rate("100/s"), 5)), 2);
        s.keys.insert(
            "b3".into(),
            FlowPolicy {
                rate: Some(rate("2/s")),
                burst: Some(3),
                ..FlowPolicy::default()
            },
        );
        let keys = [
            "b3",
            "free:a",
            "free:vip",
            "b3",
            "db:1",
            "free:a",
            "b3",
            "b3",
            "paid:x",
            "free:b",
            "free:a",
            "free:vip2",
            "db:2",
            "db:1",
            "db:3",
            "free:a",
            "b3",
        ];
        let one = FlowControl::new(s.clone(), Arc::new(LocalGroupBuckets::default()));
        let many = FlowControl::new(s, Arc::new(LocalGroupBuckets::default()));
        for now in [0, 50, 100, 700, 5_000] {
            let runs: Vec<(&str, RunStart<'_>)> = (keys.iter().enumerate())
                .map(|(i, k)| {
                    let start = RunStart {
                        shard: "s",
                        fence: now * 100 + i as u64,
                        lease_until_ms: now + 600,
                    };
                    (*k, start)
                })
                .collect();
            let each: Vec<Admit> = runs.iter().map(|(k, r)| one.admit(k, now, r)).collect();
            assert_eq!(many.admit_many(&runs, now), each, "at {now} ms");
        }
        assert_eq!(one.stats(), many.stats());
    }

    #[test]
    fn live_settings_are_read_again_after_the_recheck_time() {
        let s = Arc::new(Mutex::new(FlowSettings::default()));
        let src = Arc::clone(&s);
        let f = FlowControl::new(
            FlowSettings::default(),
            Arc::new(LocalGroupBuckets::default()),
        )
        .with_source(Box::new(move || Ok(Some(src.lock().unwrap().clone()))));
        f.refresh(0);
        assert_eq!(f.admit("k", 0, &ANY_RUN), Admit::Now);
        s.lock().unwrap().default.rate = Some(rate("1/s"));
        s.lock().unwrap().default.burst = Some(1);
        f.refresh(500);
        assert!(!f.limits_starts(), "not yet read again");
        f.refresh(1_000);
        assert_eq!(f.admit("k", 1_000, &ANY_RUN), Admit::Now);
        assert_eq!(f.admit("k", 1_000, &ANY_RUN), Admit::NotBefore(2_000));
    }
}
