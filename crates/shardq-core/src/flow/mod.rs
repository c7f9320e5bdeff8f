//! Flow control per key: rate limits for a key and for a group of keys,
//! and backing off when a handler says its downstream is limiting it.
//!
//! A deployment keeps one [`FlowSettings`] (its `flow` setting, beside its
//! map): a default [`FlowPolicy`], per-key and per-prefix policies (resolved
//! as retry rules are: the key's own, else its longest prefix's, else the
//! default) and named groups ([`GroupLimit`]) that policies point at.
//!
//! # The bucket recipe
//! A rate is `count` starts per `per_ms` milliseconds; a bucket holds up to
//! `burst` tokens and starts full. Arithmetic is exact, in integer *units*:
//! a token is `per_ms` units and every millisecond adds `count` units, so
//! 50/s adds 50 units a ms to a bucket of `burst x 1000`. A start takes one
//! token (`per_ms` units); when fewer are there, the wait is
//! `ceil((per_ms - units) / count)` ms. Over any window of `w` ms a bucket
//! therefore lets at most `burst + floor(w x count / per_ms)` starts
//! through. A held bucket (a handler's back-off) gives nothing before its
//! hold ends, and keeps refilling meanwhile.
//!
//! # Where the buckets live
//! - A key's bucket lives in the process that owns the key's shard, in
//!   memory: only the owner starts the key's runs, so every start of the key
//!   passes through it, whichever worker runs the job. A bucket is created
//!   full when the key is first seen, so a new owner (after a takeover or a
//!   move) may let one more burst through than the old one left.
//! - A group's bucket and run slots are shared by every process of the
//!   deployment ([`GroupBuckets`]): a locked file in the data dir on the
//!   embedded engine, a hash and a sorted set in the map store's Redis, in
//!   memory for the memory backend and the simulation.
//!
//! # Runs at once per group
//! A group may also cap its keys' runs at once ([`GroupLimit::concurrency`]),
//! over every process: a start takes one of the group's run slots, in the
//! same store and the same atomic step as its token ([`take_group`]), held
//! by that one run (`SHARD/FENCE`, [`RunStart::holder`]) until its lease
//! ends. The backend gives it back when the run is over (ack, fail,
//! back-off, or any of them refused because the run is no longer current:
//! [`FlowControl::runs_ended`]), and renews it when the lease is extended
//! ([`FlowControl::runs_extended`]; a current run whose slot lapsed takes it
//! again). A run that ends any other way (its worker killed, a takeover)
//! frees its slot when its lease lapses, exactly when the run itself may
//! start again. Since a slot names one run, an old run's give-back never
//! frees a newer run's slot, whatever the order of the calls. A key refused
//! for want of a slot is asked again at the first slot's lapse, at most
//! [`GROUP_SLOT_RECHECK_MS`] away: a slot freed by another process is not
//! announced. A give-back that fails is counted; the slot then lapses with
//! its lease.
//!
//! # When limits are checked
//! A backend asks [`FlowControl::admit`] for each key it would start (a
//! Redis claim asks [`FlowControl::admit_many`] for all of its starts at
//! once, one store call per group), after
//! every check of its own (the head is due, nothing in flight, not sealed)
//! and before the run is written. A refused key is passed over and asked
//! again at the time the answer names, never later than
//! [`FLOW_RECHECK_MS`] from now, so a changed setting reaches it within a
//! second; the other keys start meanwhile. A key's bucket is checked before
//! its group's and charged after it, so a refusal by the group costs the
//! key no token; a token taken for a start whose write then fails is lost
//! (the limit errs on the slow side).
//!
//! # Who gets a free slot
//! While any policy sets a weight or a priority, a claim takes a shard's
//! ready keys by [`FairQueue`]: the highest priority first, and within a
//! priority in proportion to their weights (start-time fair queuing), each
//! key's own jobs still in order. A key passed over (over its limit) pays
//! nothing. Without weights and priorities the backend's own order stands
//! (round robin). The ranking is per shard: a process that runs several
//! shards shares its slots among them as before. A Redis shard's claim
//! ranks the first keys of its ready list (a bounded read before the
//! claim script, which then takes exactly the keys chosen, each only if
//! still ready).
//!
//! # Files
//! - `rate.rs`: [`Rate`], its parsing and range.
//! - `policy.rs`: [`FlowPolicy`], [`GroupLimit`], [`FlowSettings`] (per-key
//!   resolution and edits), [`ConcurrencyRules`], [`PolicyTarget`] and
//!   every check of them.
//! - `bucket.rs`: [`Bucket`], the recipe above.
//! - `groups.rs`: group state and run slots, [`GroupBuckets`], the shared
//!   recipe ([`take_group`] and its siblings) and [`LocalGroupBuckets`].
//! - `control.rs`: [`FlowControl`] (admission, refresh, holds and
//!   back-offs, run slots given back and renewed, stats).
//! - `fair.rs`: [`FairQueue`], [`Rank`] and [`shares_by_rank`].
//!
//! Every item is re-exported here: its path is `flow::NAME`, whichever
//! file holds it.

mod bucket;
mod control;
mod fair;
mod groups;
mod policy;
mod rate;
#[cfg(test)]
mod testing;

pub use bucket::Bucket;
pub use control::{
    validate_backoff_ms, Admit, FlowControl, FlowSource, FlowStats, GroupLevel, HeldKey,
    BACKOFF_MS_MAX, FLOW_RECHECK_MS,
};
pub use fair::{shares_by_rank, FairQueue, Popped, Rank, FAIR_STRIDE};
pub use groups::{
    free_group_slots, hold_group, renew_group_slots, resume_group, take_group, take_group_many,
    GroupBuckets, GroupState, LocalGroupBuckets, RunStart, SlotAsk, GROUP_SLOT_RECHECK_MS,
};
pub use policy::{
    validate_group_name, ConcurrencyRules, FlowPolicy, FlowSettings, GroupLimit, PolicySource,
    PolicyTarget, BURST_MAX, FLOW_GROUPS_MAX, FLOW_RULES_MAX, GROUP_CONCURRENCY_MAX, GROUP_NONE,
    KEY_CONCURRENCY_MAX, PRIORITY_MAX, WEIGHT_MAX,
};
pub use rate::{Rate, RATE_COUNT_MAX};
