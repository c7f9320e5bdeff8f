//! Group buckets and run slots, shared by every process of a deployment:
//! a group's stored state ([`GroupState`]), the [`GroupBuckets`] store
//! behind which it lives, the one recipe every store runs under its own
//! lock ([`take_group`] and its siblings), and the store in this process's
//! memory ([`LocalGroupBuckets`]).

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::bucket::Bucket;
use super::policy::GroupLimit;
use crate::error::QueueError;

/// Longest a key refused because its group's runs are all taken waits
/// before it is asked about again (a run that ends elsewhere frees its
/// slot without telling this process).
pub const GROUP_SLOT_RECHECK_MS: u64 = 20;

/// A group's shared state: its bucket and the run slots taken in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupState {
    /// The group's token bucket (also where a handler's hold is kept).
    #[serde(flatten)]
    pub bucket: Bucket,
    /// Run slots taken, by holder (the key whose run holds it), with when
    /// each lapses (its run's lease): a slot its run never gives back
    /// frees itself then.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub slots: BTreeMap<String, u64>,
}

impl GroupState {
    /// Slots taken at `now_ms` (lapsed ones not counted).
    pub fn running(&self, now_ms: u64) -> u64 {
        self.slots.values().filter(|&&t| t > now_ms).count() as u64
    }
}

/// A run slot asked for with a start: whose run, and until when it is held
/// unless renewed (its run's lease).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAsk<'a> {
    /// The run that takes it ([`RunStart::holder`]); a holder that has one
    /// already keeps it.
    pub holder: &'a str,
    /// When the slot lapses unless renewed or given back.
    pub until_ms: u64,
}

/// The run a start would make, as flow control's group slots name it: one
/// run of one shard (its fence is unique there), and when its lease ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunStart<'a> {
    /// The shard the run is on.
    pub shard: &'a str,
    /// The run's fence.
    pub fence: u64,
    /// When its lease ends, unless extended.
    pub lease_until_ms: u64,
}

impl RunStart<'_> {
    /// The run's holder name in its group's slots: `SHARD/FENCE`.
    pub fn holder(&self) -> String {
        format!("{}/{}", self.shard, self.fence)
    }
}

/// The buckets and run slots of groups, shared by every process of a
/// deployment.
pub trait GroupBuckets: Send + Sync {
    /// Takes one token from `group`'s bucket under `limit` at `now_ms`,
    /// and, when the group limits its runs and `slot` is given, one of its
    /// run slots: `Ok(Ok(()))` when taken (both), `Ok(Err(at))` when not,
    /// to be asked again at `at`. Atomic across processes.
    fn take(
        &self,
        group: &str,
        limit: &GroupLimit,
        now_ms: u64,
        slot: Option<SlotAsk<'_>>,
    ) -> Result<Result<(), u64>, QueueError>;

    /// [`GroupBuckets::take`] for several starts at once, in order, each
    /// with its run's slot (used when the group limits its runs): how many
    /// of the first were taken, and when to ask again for the rest (a
    /// bucket or slots that refuse one refuse the ones after it). One
    /// round trip for a claim's starts; this default takes one at a time.
    fn take_many(
        &self,
        group: &str,
        limit: &GroupLimit,
        now_ms: u64,
        asks: &[SlotAsk<'_>],
    ) -> Result<(usize, u64), QueueError> {
        for (i, ask) in asks.iter().enumerate() {
            if let Err(at) = self.take(group, limit, now_ms, Some(*ask))? {
                return Ok((i, at));
            }
        }
        Ok((asks.len(), 0))
    }

    /// Holds `group`'s bucket until `until_ms`: no key of the group starts
    /// before then, in any process.
    fn hold(&self, group: &str, limit: &GroupLimit, until_ms: u64) -> Result<(), QueueError>;

    /// Lifts a hold of `group`'s bucket (an operator's `group resume`, or
    /// the group's removal): its keys start again at once, in every
    /// process (each re-reads the store within
    /// [`FLOW_RECHECK_MS`](super::FLOW_RECHECK_MS)).
    fn resume(&self, group: &str, limit: &GroupLimit) -> Result<(), QueueError>;

    /// `group`'s state as stored, changing nothing (none when it has none
    /// yet: its bucket starts full, its slots free).
    fn peek(&self, group: &str) -> Result<Option<GroupState>, QueueError>;

    /// Gives back the run slots `holders` hold in `group` (their runs
    /// ended); a holder without one changes nothing.
    fn free_slots(&self, group: &str, holders: &[&str]) -> Result<(), QueueError>;

    /// Moves the lapse of the slots `holders` hold in `group` to
    /// `until_ms` (their runs' leases were extended, so they are current);
    /// a holder whose slot lapsed meanwhile takes it again, even over the
    /// limit (the run is running: it counts).
    fn renew_slots(&self, group: &str, holders: &[&str], until_ms: u64) -> Result<(), QueueError>;
}

/// `group`'s state in `states`, new (a full bucket, no slot taken) when it
/// has none.
fn state_of<'a>(
    states: &'a mut BTreeMap<String, GroupState>,
    group: &str,
    limit: &GroupLimit,
    now_ms: u64,
) -> &'a mut GroupState {
    states
        .entry(group.to_string())
        .or_insert_with(|| GroupState {
            bucket: Bucket::full(limit.bucket_rate(), limit.burst_or_default(), now_ms),
            slots: BTreeMap::new(),
        })
}

/// Takes a token, and a run slot when asked and the group limits its runs,
/// from `group`'s state in `states`: the one recipe every [`GroupBuckets`]
/// runs under its own lock (the Redis script is its copy in Lua). The slot
/// is checked first: a key refused for want of one costs the bucket
/// nothing. A full group answers the first lapse of its slots, at most
/// [`GROUP_SLOT_RECHECK_MS`] away (a slot given back elsewhere is not
/// announced).
pub fn take_group(
    states: &mut BTreeMap<String, GroupState>,
    group: &str,
    limit: &GroupLimit,
    now_ms: u64,
    slot: Option<SlotAsk<'_>>,
) -> Result<(), u64> {
    let st = state_of(states, group, limit, now_ms);
    let slot = slot.filter(|_| limit.concurrency.is_some());
    if let (Some(n), Some(ask)) = (limit.concurrency, slot) {
        st.slots.retain(|_, &mut t| t > now_ms);
        if !st.slots.contains_key(ask.holder) && st.slots.len() >= n as usize {
            let first = st.slots.values().min().copied().unwrap_or(now_ms);
            return Err(first
                .min(now_ms.saturating_add(GROUP_SLOT_RECHECK_MS))
                .max(now_ms + 1));
        }
    }
    st.bucket
        .take(limit.bucket_rate(), limit.burst_or_default(), now_ms)?;
    if let Some(ask) = slot {
        st.slots.insert(ask.holder.to_string(), ask.until_ms);
    }
    Ok(())
}

/// [`take_group`] for `asks` in order, stopping at the first refused:
/// how many were taken, and when to ask again for the rest.
pub fn take_group_many(
    states: &mut BTreeMap<String, GroupState>,
    group: &str,
    limit: &GroupLimit,
    now_ms: u64,
    asks: &[SlotAsk<'_>],
) -> (usize, u64) {
    for (i, ask) in asks.iter().enumerate() {
        if let Err(at) = take_group(states, group, limit, now_ms, Some(*ask)) {
            return (i, at);
        }
    }
    (asks.len(), 0)
}

/// Holds `group`'s bucket in `states` until `until_ms`.
pub fn hold_group(
    states: &mut BTreeMap<String, GroupState>,
    group: &str,
    limit: &GroupLimit,
    until_ms: u64,
) {
    state_of(states, group, limit, until_ms)
        .bucket
        .hold(until_ms);
}

/// Lifts a hold of `group`'s bucket in `states` (none: nothing to lift).
pub fn resume_group(states: &mut BTreeMap<String, GroupState>, group: &str) {
    if let Some(st) = states.get_mut(group) {
        st.bucket.resume();
    }
}

/// Gives back `holders`' slots in `group`'s state in `states`.
pub fn free_group_slots(states: &mut BTreeMap<String, GroupState>, group: &str, holders: &[&str]) {
    if let Some(st) = states.get_mut(group) {
        for h in holders {
            st.slots.remove(*h);
        }
    }
}

/// Renews `holders`' slots in `group`'s state in `states` to `until_ms`.
pub fn renew_group_slots(
    states: &mut BTreeMap<String, GroupState>,
    group: &str,
    holders: &[&str],
    until_ms: u64,
) {
    if let Some(st) = states.get_mut(group) {
        for h in holders {
            let t = st.slots.entry(h.to_string()).or_insert(until_ms);
            *t = (*t).max(until_ms);
        }
    }
}

/// Group buckets in this process's memory (the memory backend, tests).
#[derive(Debug, Default)]
pub struct LocalGroupBuckets {
    states: Mutex<BTreeMap<String, GroupState>>,
}

impl LocalGroupBuckets {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, GroupState>> {
        self.states.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl GroupBuckets for LocalGroupBuckets {
    fn peek(&self, group: &str) -> Result<Option<GroupState>, QueueError> {
        Ok(self.lock().get(group).cloned())
    }

    fn take(
        &self,
        group: &str,
        limit: &GroupLimit,
        now_ms: u64,
        slot: Option<SlotAsk<'_>>,
    ) -> Result<Result<(), u64>, QueueError> {
        Ok(take_group(&mut self.lock(), group, limit, now_ms, slot))
    }

    fn take_many(
        &self,
        group: &str,
        limit: &GroupLimit,
        now_ms: u64,
        asks: &[SlotAsk<'_>],
    ) -> Result<(usize, u64), QueueError> {
        Ok(take_group_many(
            &mut self.lock(),
            group,
            limit,
            now_ms,
            asks,
        ))
    }

    fn hold(&self, group: &str, limit: &GroupLimit, until_ms: u64) -> Result<(), QueueError> {
        hold_group(&mut self.lock(), group, limit, until_ms);
        Ok(())
    }

    fn resume(&self, group: &str, _limit: &GroupLimit) -> Result<(), QueueError> {
        resume_group(&mut self.lock(), group);
        Ok(())
    }

    fn free_slots(&self, group: &str, holders: &[&str]) -> Result<(), QueueError> {
        free_group_slots(&mut self.lock(), group, holders);
        Ok(())
    }

    fn renew_slots(&self, group: &str, holders: &[&str], until_ms: u64) -> Result<(), QueueError> {
        renew_group_slots(&mut self.lock(), group, holders, until_ms);
        Ok(())
    }
}
