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

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use serde::{Deserialize, Serialize};

use crate::error::QueueError;
use crate::job::validate_key;
use crate::retry::{prefix_rule_for, rule_for};

/// Most key and prefix policies one deployment holds (together).
pub const FLOW_RULES_MAX: usize = 10_000;
/// Most groups one deployment holds.
pub const FLOW_GROUPS_MAX: usize = 1_000;
/// Most starts a rate may allow per unit of time.
pub const RATE_COUNT_MAX: u64 = 1_000_000;
/// Most tokens a bucket may hold.
pub const BURST_MAX: u64 = 1_000_000;
/// Most runs of one key at once. One run per key (the default) is the
/// queue's strict order; with more, a key's jobs still start in order, up
/// to its concurrency at once. A backend may offer less
/// ([`crate::BackendLimits::key_concurrency_max`]).
pub const KEY_CONCURRENCY_MAX: u32 = 256;
/// Most runs of one group's keys at once.
pub const GROUP_CONCURRENCY_MAX: u32 = 10_000;
/// Longest a key refused because its group's runs are all taken waits
/// before it is asked about again (a run that ends elsewhere frees its
/// slot without telling this process).
pub const GROUP_SLOT_RECHECK_MS: u64 = 20;
/// Largest weight.
pub const WEIGHT_MAX: u32 = 1_000;
/// Priorities run from `-PRIORITY_MAX` to `PRIORITY_MAX`.
pub const PRIORITY_MAX: i32 = 1_000;
/// How long settings are used before they are read again, and the longest a
/// refused key waits before it is asked about again.
pub const FLOW_RECHECK_MS: u64 = 1_000;
/// Longest back-off a handler may ask for (one day).
pub const BACKOFF_MS_MAX: u64 = 86_400_000;

/// Starts per unit of time: `50/s`, `600/m`, `1000/h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Rate {
    /// Starts allowed per `per_ms`.
    pub count: u64,
    /// The unit: 1000 (s), 60 000 (m) or 3 600 000 (h).
    pub per_ms: u64,
}

impl Rate {
    /// One second of this rate, rounded up, at least 1: the default burst.
    pub fn default_burst(&self) -> u64 {
        (self.count * 1000).div_ceil(self.per_ms).max(1)
    }

    fn check(&self) -> Result<(), QueueError> {
        if self.count == 0 || self.count > RATE_COUNT_MAX {
            return Err(QueueError::InvalidOption {
                name: "rate",
                value: self.to_string(),
                allowed: format!("1 to {RATE_COUNT_MAX} per unit"),
            });
        }
        if ![1_000, 60_000, 3_600_000].contains(&self.per_ms) {
            return Err(QueueError::InvalidOption {
                name: "rate",
                value: format!("{} per {} ms", self.count, self.per_ms),
                allowed: "a unit of s, m or h".into(),
            });
        }
        Ok(())
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.per_ms {
            1_000 => "s",
            60_000 => "m",
            3_600_000 => "h",
            other => return write!(f, "{}/{}ms", self.count, other),
        };
        write!(f, "{}/{unit}", self.count)
    }
}

impl FromStr for Rate {
    type Err = QueueError;

    fn from_str(text: &str) -> Result<Rate, QueueError> {
        let bad = |why: &str| QueueError::InvalidOption {
            name: "rate",
            value: format!("{text:?}"),
            allowed: format!("N/s, N/m or N/h with N from 1 to {RATE_COUNT_MAX} ({why})"),
        };
        let (n, unit) = text.trim().split_once('/').ok_or_else(|| bad("no unit"))?;
        let per_ms = match unit.trim() {
            "s" | "sec" | "second" => 1_000,
            "m" | "min" | "minute" => 60_000,
            "h" | "hour" => 3_600_000,
            _ => return Err(bad("unknown unit")),
        };
        let count: u64 = n.trim().parse().map_err(|_| bad("not a whole number"))?;
        let r = Rate { count, per_ms };
        r.check().map_err(|_| bad("out of range"))?;
        Ok(r)
    }
}

impl TryFrom<String> for Rate {
    type Error = QueueError;
    fn try_from(s: String) -> Result<Rate, QueueError> {
        s.parse()
    }
}

impl From<Rate> for String {
    fn from(r: Rate) -> String {
        r.to_string()
    }
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// What a key gets: its rate limit, its group, its share of slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowPolicy {
    /// Runs of the key at once (1 to [`KEY_CONCURRENCY_MAX`]; 1 is strict
    /// order, more start the key's jobs in order, this many at once).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub concurrency: u32,
    /// Starts of the key's jobs, over every worker; none: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// Tokens the key's bucket holds (default: one second of `rate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// Share of slots among keys of the same priority (1 to [`WEIGHT_MAX`]).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub weight: u32,
    /// Priority class, higher first.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i32,
    /// The group whose limit the key's starts also count against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

impl Default for FlowPolicy {
    fn default() -> Self {
        FlowPolicy {
            concurrency: 1,
            rate: None,
            burst: None,
            weight: 1,
            priority: 0,
            group: None,
        }
    }
}

fn check_burst(burst: Option<u64>, rate: Option<Rate>) -> Result<(), QueueError> {
    let Some(b) = burst else { return Ok(()) };
    if b == 0 || b > BURST_MAX {
        return Err(QueueError::InvalidOption {
            name: "burst",
            value: b.to_string(),
            allowed: format!("1 to {BURST_MAX}"),
        });
    }
    if rate.is_none() {
        return Err(QueueError::InvalidOption {
            name: "burst",
            value: b.to_string(),
            allowed: "given with a rate (a burst limits nothing alone)".into(),
        });
    }
    Ok(())
}

impl FlowPolicy {
    /// Whether the policy limits starts at all (a rate or a group).
    pub fn limits_starts(&self) -> bool {
        self.rate.is_some() || self.group.is_some()
    }

    /// The key bucket's size.
    pub fn burst_or_default(&self) -> Option<u64> {
        self.rate
            .map(|r| self.burst.unwrap_or_else(|| r.default_burst()))
    }

    /// Checks every field, naming the one out of range and its value.
    pub fn validate(&self) -> Result<(), QueueError> {
        if self.concurrency == 0 || self.concurrency > KEY_CONCURRENCY_MAX {
            return Err(QueueError::InvalidOption {
                name: "concurrency",
                value: self.concurrency.to_string(),
                allowed: format!("1 to {KEY_CONCURRENCY_MAX}"),
            });
        }
        if let Some(r) = self.rate {
            r.check()?;
        }
        check_burst(self.burst, self.rate)?;
        if self.weight == 0 || self.weight > WEIGHT_MAX {
            return Err(QueueError::InvalidOption {
                name: "weight",
                value: self.weight.to_string(),
                allowed: format!("1 to {WEIGHT_MAX}"),
            });
        }
        if self.priority.abs() > PRIORITY_MAX {
            return Err(QueueError::InvalidOption {
                name: "priority",
                value: self.priority.to_string(),
                allowed: format!("-{PRIORITY_MAX} to {PRIORITY_MAX}"),
            });
        }
        if let Some(g) = &self.group {
            validate_group_name(g)?;
        }
        Ok(())
    }
}

/// A limit shared by every key whose policy names the group: a rate, a
/// number of runs at once, or both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupLimit {
    /// Starts of all the group's keys together, over every worker; none:
    /// only `concurrency` limits the group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// Tokens the group's bucket holds (default: one second of `rate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// Runs of the group's keys at once, over every worker (1 to
    /// [`GROUP_CONCURRENCY_MAX`]); none: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
}

/// The bucket of a group without a rate: it never runs dry (a million
/// tokens a millisecond), so only its holds (a handler's back-off) count.
const UNLIMITED: Rate = Rate {
    count: RATE_COUNT_MAX,
    per_ms: 1,
};

impl GroupLimit {
    /// The bucket's size.
    pub fn burst_or_default(&self) -> u64 {
        match self.rate {
            Some(r) => self.burst.unwrap_or_else(|| r.default_burst()),
            None => BURST_MAX,
        }
    }

    /// The rate the bucket counts in (a group without a rate: one that
    /// never runs dry).
    pub fn bucket_rate(&self) -> Rate {
        self.rate.unwrap_or(UNLIMITED)
    }

    /// Checks every field, naming the one out of range and its value.
    pub fn validate(&self) -> Result<(), QueueError> {
        if let Some(r) = self.rate {
            r.check()?;
        }
        check_burst(self.burst, self.rate)?;
        match self.concurrency {
            Some(n) if n == 0 || n > GROUP_CONCURRENCY_MAX => Err(QueueError::InvalidOption {
                name: "concurrency",
                value: n.to_string(),
                allowed: format!("1 to {GROUP_CONCURRENCY_MAX}"),
            }),
            None if self.rate.is_none() => Err(QueueError::InvalidOption {
                name: "group",
                value: "no rate and no concurrency".into(),
                allowed: "a --rate, a --concurrency or both (a group limits nothing without one)"
                    .into(),
            }),
            _ => Ok(()),
        }
    }
}

/// Checks a group name: the key grammar, at most 128 bytes.
pub fn validate_group_name(name: &str) -> Result<(), QueueError> {
    // `policy set --group none` means "in no group": a group of that name
    // could never be joined.
    if name == GROUP_NONE {
        return Err(QueueError::InvalidOption {
            name: "group",
            value: format!("{name:?}"),
            allowed: format!(
                "any name but {GROUP_NONE:?}, which `policy set --group` reads as \"in no group\""
            ),
        });
    }
    if name.len() > 128 {
        return Err(QueueError::InvalidOption {
            name: "group",
            value: format!("{name:?}"),
            allowed: "a name of 1 to 128 bytes".into(),
        });
    }
    validate_key(name).map_err(|_| QueueError::InvalidOption {
        name: "group",
        value: format!("{name:?}"),
        allowed: "a non-empty name without control or invisible characters".into(),
    })
}

/// The word `policy set --group` takes for "in no group"; no group may
/// have it as its name.
pub const GROUP_NONE: &str = "none";

/// A deployment's flow settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowSettings {
    /// What a key without a policy gets.
    #[serde(default, skip_serializing_if = "is_default_policy")]
    pub default: FlowPolicy,
    /// A key's own policy.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, FlowPolicy>,
    /// The policy of every key starting with the prefix (the longest
    /// matching prefix wins; a key's own policy wins over every prefix).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prefixes: BTreeMap<String, FlowPolicy>,
    /// Named limits shared by keys.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub groups: BTreeMap<String, GroupLimit>,
}

fn is_default_policy(p: &FlowPolicy) -> bool {
    *p == FlowPolicy::default()
}

/// Every key's run limit in a form a store can resolve by itself (the
/// Redis claim script does): a key's own entry, else the first prefix of
/// it in `prefixes`, else `default`. The same answer as
/// [`FlowSettings::for_key`]'s `concurrency` for every key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConcurrencyRules {
    /// The concurrency of a key no entry matches.
    pub default: u32,
    /// Keys whose own policy gives another concurrency than their prefix
    /// or the default would (the others need no entry).
    pub keys: Vec<(String, u32)>,
    /// Every prefix policy's concurrency, longest prefix first.
    pub prefixes: Vec<(String, u32)>,
}

impl ConcurrencyRules {
    /// The concurrency of `key` by these rules.
    pub fn of(&self, key: &str) -> u32 {
        if let Some((_, n)) = self.keys.iter().find(|(k, _)| k == key) {
            return *n;
        }
        (self.prefixes.iter())
            .find(|(p, _)| key.starts_with(p.as_str()))
            .map_or(self.default, |(_, n)| *n)
    }
}

/// Which policy a change is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyTarget {
    /// The deployment's default.
    Default,
    /// One key's own policy.
    Key(String),
    /// The policy of every key starting with the prefix.
    Prefix(String),
}

impl PolicyTarget {
    /// Checks the key or prefix by the key grammar.
    pub fn validate(&self) -> Result<(), QueueError> {
        match self {
            PolicyTarget::Default => Ok(()),
            PolicyTarget::Key(k) | PolicyTarget::Prefix(k) => validate_key(k),
        }
    }
}

impl fmt::Display for PolicyTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyTarget::Default => write!(f, "default"),
            PolicyTarget::Key(k) => write!(f, "key {k:?}"),
            PolicyTarget::Prefix(p) => write!(f, "prefix {p:?}"),
        }
    }
}

/// Where a key's policy comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicySource {
    /// The key's own policy.
    Key,
    /// The policy of this prefix of the key.
    Prefix(String),
    /// The deployment's default.
    Default,
}

impl FlowSettings {
    /// The policy `key` follows.
    pub fn for_key(&self, key: &str) -> &FlowPolicy {
        rule_for(&self.keys, &self.prefixes, key).unwrap_or(&self.default)
    }

    /// Where the policy of `key` comes from.
    pub fn source_of(&self, key: &str) -> PolicySource {
        if self.keys.contains_key(key) {
            return PolicySource::Key;
        }
        match prefix_rule_for(&self.prefixes, key) {
            Some((prefix, _)) => PolicySource::Prefix(prefix.clone()),
            None => PolicySource::Default,
        }
    }

    /// Whether any policy sets a weight or a priority (else ready keys
    /// start in the backend's round-robin order).
    pub fn ranks_keys(&self) -> bool {
        let ranked = |p: &FlowPolicy| p.weight != 1 || p.priority != 0;
        ranked(&self.default)
            || self.keys.values().any(ranked)
            || self.prefixes.values().any(ranked)
    }

    /// The most runs at once any policy allows a key.
    pub fn key_concurrency_high(&self) -> u32 {
        (self.keys.values().chain(self.prefixes.values()))
            .map(|p| p.concurrency)
            .fold(self.default.concurrency, u32::max)
    }

    /// Every key's run limit as a store that resolves it itself needs it
    /// (none when every key runs once at a time): see [`ConcurrencyRules`].
    pub fn concurrency_rules(&self) -> Option<ConcurrencyRules> {
        if self.key_concurrency_high() <= 1 {
            return None;
        }
        let by_prefix = |key: &str| {
            prefix_rule_for(&self.prefixes, key)
                .map_or(self.default.concurrency, |(_, p)| p.concurrency)
        };
        let keys = (self.keys.iter())
            .filter(|(k, p)| p.concurrency != by_prefix(k))
            .map(|(k, p)| (k.clone(), p.concurrency))
            .collect();
        let mut prefixes: Vec<(String, u32)> = (self.prefixes.iter())
            .map(|(k, p)| (k.clone(), p.concurrency))
            .collect();
        prefixes.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        Some(ConcurrencyRules {
            default: self.default.concurrency,
            keys,
            prefixes,
        })
    }

    /// Whether any policy limits starts (else admission is free).
    pub fn limits_starts(&self) -> bool {
        self.default.limits_starts()
            || self.keys.values().any(FlowPolicy::limits_starts)
            || self.prefixes.values().any(FlowPolicy::limits_starts)
    }

    /// Checks every policy and group, their number, and that every group a
    /// policy names exists.
    pub fn validate(&self) -> Result<(), QueueError> {
        let n = self.keys.len() + self.prefixes.len();
        if n > FLOW_RULES_MAX {
            return Err(QueueError::InvalidOption {
                name: "policies",
                value: n.to_string(),
                allowed: format!("at most {FLOW_RULES_MAX} key and prefix policies"),
            });
        }
        if self.groups.len() > FLOW_GROUPS_MAX {
            return Err(QueueError::InvalidOption {
                name: "groups",
                value: self.groups.len().to_string(),
                allowed: format!("at most {FLOW_GROUPS_MAX}"),
            });
        }
        for (name, g) in &self.groups {
            validate_group_name(name)?;
            g.validate()?;
        }
        let all = std::iter::once(&self.default)
            .chain(self.keys.values())
            .chain(self.prefixes.values());
        for k in self.keys.keys().chain(self.prefixes.keys()) {
            validate_key(k)?;
        }
        for p in all {
            p.validate()?;
            if let Some(g) = &p.group {
                if !self.groups.contains_key(g) {
                    return Err(QueueError::InvalidOption {
                        name: "group",
                        value: format!("{g:?}"),
                        allowed: format!(
                            "a group that exists (create it first with `shardq group set {g} --rate ...`)"
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// What `target` gets today: its own policy, else what its keys
    /// resolve to (where a new policy for it starts from).
    pub fn policy_of(&self, target: &PolicyTarget) -> FlowPolicy {
        match target {
            PolicyTarget::Default => self.default.clone(),
            PolicyTarget::Key(k) => self.for_key(k).clone(),
            PolicyTarget::Prefix(p) => self
                .prefixes
                .get(p)
                .unwrap_or_else(|| self.for_key(p))
                .clone(),
        }
    }

    /// Sets `target`'s policy; the settings are checked whole (a group the
    /// policy names must exist) and left unchanged when refused.
    pub fn put_policy(&mut self, target: &PolicyTarget, p: FlowPolicy) -> Result<(), QueueError> {
        let mut next = self.clone();
        match target {
            PolicyTarget::Default => next.default = p,
            PolicyTarget::Key(k) => {
                next.keys.insert(k.clone(), p);
            }
            PolicyTarget::Prefix(pre) => {
                next.prefixes.insert(pre.clone(), p);
            }
        }
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// Removes `target`'s policy (the default goes back to no limits);
    /// whether there was one.
    pub fn remove_policy(&mut self, target: &PolicyTarget) -> bool {
        match target {
            PolicyTarget::Default => {
                let had = self.default != FlowPolicy::default();
                self.default = FlowPolicy::default();
                had
            }
            PolicyTarget::Key(k) => self.keys.remove(k).is_some(),
            PolicyTarget::Prefix(p) => self.prefixes.remove(p).is_some(),
        }
    }

    /// Sets group `name`'s limit, checked.
    pub fn put_group(&mut self, name: &str, g: GroupLimit) -> Result<(), QueueError> {
        let mut next = self.clone();
        next.groups.insert(name.to_string(), g);
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// Removes group `name`; refused while a policy names it (the error
    /// names one). Whether there was one.
    pub fn remove_group(&mut self, name: &str) -> Result<bool, QueueError> {
        let users = std::iter::once(("default".to_string(), &self.default))
            .chain(self.keys.iter().map(|(k, p)| (format!("key {k:?}"), p)))
            .chain(
                self.prefixes
                    .iter()
                    .map(|(k, p)| (format!("prefix {k:?}"), p)),
            );
        for (who, p) in users {
            if p.group.as_deref() == Some(name) {
                return Err(QueueError::InvalidOption {
                    name: "group",
                    value: format!("{name:?}"),
                    allowed: format!(
                        "a group no policy names (the {who} policy names it: change or clear it first)"
                    ),
                });
            }
        }
        Ok(self.groups.remove(name).is_some())
    }

    /// Parses the `flow` setting's JSON.
    pub fn parse(text: &str) -> Result<FlowSettings, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// A token bucket (see the module header for the recipe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Units held (a token is `per_ms` units).
    pub units: u64,
    /// When `units` was last brought up to date.
    pub at_ms: u64,
    /// Nothing is given before this (a handler's back-off).
    #[serde(default)]
    pub held_until_ms: u64,
    /// The rate the units are counted in.
    pub count: u64,
    /// The rate's unit.
    pub per_ms: u64,
}

impl Bucket {
    /// A full bucket for `rate` and `burst` at `now_ms`.
    pub fn full(rate: Rate, burst: u64, now_ms: u64) -> Bucket {
        Bucket {
            units: burst.saturating_mul(rate.per_ms),
            at_ms: now_ms,
            held_until_ms: 0,
            count: rate.count,
            per_ms: rate.per_ms,
        }
    }

    /// Brings the bucket up to `now_ms` under `rate` and `burst` (a changed
    /// limit keeps the tokens held, up to the new burst).
    fn refill(&mut self, rate: Rate, burst: u64, now_ms: u64) {
        if self.per_ms != rate.per_ms || self.count != rate.count {
            let tokens_x = self.units as u128 * rate.per_ms as u128 / self.per_ms.max(1) as u128;
            self.units = tokens_x.min(u64::MAX as u128) as u64;
            self.count = rate.count;
            self.per_ms = rate.per_ms;
        }
        if now_ms > self.at_ms {
            let add = (now_ms - self.at_ms).saturating_mul(rate.count);
            self.units = self.units.saturating_add(add);
            self.at_ms = now_ms;
        }
        self.units = self.units.min(burst.saturating_mul(rate.per_ms));
    }

    /// `Ok` if a token is there at `now_ms` (not taken), else when one will be.
    pub fn peek(&mut self, rate: Rate, burst: u64, now_ms: u64) -> Result<(), u64> {
        self.peek_after(rate, burst, now_ms, 0)
    }

    /// [`Bucket::peek`] with `reserved` tokens already promised to earlier
    /// starts (not yet taken): `Ok` if one more is there.
    pub fn peek_after(
        &mut self,
        rate: Rate,
        burst: u64,
        now_ms: u64,
        reserved: u64,
    ) -> Result<(), u64> {
        self.refill(rate, burst, now_ms);
        if now_ms < self.held_until_ms {
            return Err(self.held_until_ms);
        }
        let need = reserved.saturating_add(1).saturating_mul(rate.per_ms);
        if self.units >= need {
            Ok(())
        } else {
            let missing = need - self.units;
            Err(now_ms.saturating_add(missing.div_ceil(rate.count)))
        }
    }

    /// Takes a token at `now_ms`, or says when one will be there.
    pub fn take(&mut self, rate: Rate, burst: u64, now_ms: u64) -> Result<(), u64> {
        self.peek(rate, burst, now_ms)?;
        self.units -= rate.per_ms;
        Ok(())
    }

    /// Holds the bucket until `until_ms` (the later of two holds wins).
    pub fn hold(&mut self, until_ms: u64) {
        self.held_until_ms = self.held_until_ms.max(until_ms);
    }

    /// Lifts a hold: the bucket gives tokens again at once.
    pub fn resume(&mut self) {
        self.held_until_ms = 0;
    }
}

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
    /// process (each re-reads the store within [`FLOW_RECHECK_MS`]).
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

/// The answer of [`FlowControl::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Start it now (its tokens are taken).
    Now,
    /// Not before this time; ask again then.
    NotBefore(u64),
}

/// Where settings come from when they are read again.
pub type FlowSource =
    Box<dyn Fn() -> Result<FlowSettings, Box<dyn std::error::Error + Send + Sync>> + Send + Sync>;

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
            Some(Ok(s)) => self.set(s, now_ms),
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

    /// Whether any policy sets a weight or a priority: ready keys then
    /// start by [`FairQueue`].
    pub fn ranks_keys(&self) -> bool {
        self.ranks.load(Ordering::Relaxed)
    }

    /// The virtual time of ranking over every shard of this process: each
    /// shard's [`FairQueue`] is raised to it before it queues keys
    /// ([`FairQueue::raise_vtime`]) and raises it after it charges them
    /// ([`FlowControl::raise_fair_vtime`]), so the start tags, and so the
    /// [`Rank`]s, of keys on different shards compare.
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

/// Virtual time one start of a key of weight 1 costs in a [`FairQueue`].
pub const FAIR_STRIDE: u64 = 1 << 20;

/// A queued key: (minus its priority, its start tag, arrival, weight, key).
type FairEntry<K> = (i64, u64, u64, u32, K);

/// A key taken from a [`FairQueue`], with its place.
#[derive(Debug, Clone)]
pub struct Popped<K> {
    /// The key.
    pub key: K,
    priority: i32,
    start: u64,
    weight: u32,
}

impl<K> Popped<K> {
    /// Where the key stood in line.
    pub fn rank(&self) -> Rank {
        Rank::new(self.priority, self.start)
    }
}

/// How many of `free` slots each shard gets when keys are ranked over
/// several shards: their ready keys' ranks merged, the best `free` counted
/// per shard; shards in the order of their best key (shards with no rank
/// among the best get none). Equal ranks on several shards (new keys all
/// start at the virtual time) go round the shards, from the one at `first`
/// (a caller turns it from call to call), so no shard takes every tie.
pub fn shares_by_rank<S: Clone + PartialEq>(
    ranks: &[(S, Vec<Rank>)],
    free: usize,
    first: usize,
) -> Vec<(S, usize)> {
    let n = ranks.len().max(1);
    let mut all: Vec<(Rank, usize, usize, usize)> = (ranks.iter().enumerate())
        .flat_map(|(i, (_, r))| {
            let turn = (i + n - first % n) % n;
            r.iter().enumerate().map(move |(j, r)| (*r, j, turn, i))
        })
        .collect();
    all.sort_unstable();
    let mut shares: Vec<(S, usize)> = Vec::new();
    for (_, _, _, i) in all.into_iter().take(free) {
        let shard = &ranks[i].0;
        match shares.iter_mut().find(|(s, _)| s == shard) {
            Some((_, n)) => *n += 1,
            None => shares.push((shard.clone(), 1)),
        }
    }
    shares
}

/// Where a ready key stands in line for a slot: the higher priority first,
/// then the smaller start tag. Ranks from the shards of one process
/// compare, as their queues share the process's virtual time
/// ([`FlowControl::fair_vtime`]): the smaller goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    neg_priority: i64,
    start: u64,
}

impl Rank {
    /// Before every key's rank: what a shard reports when it must be
    /// claimed from whatever its keys' ranks (work only a claim does, such
    /// as ending cancelled runs, or an error only a claim reports).
    pub const FIRST: Rank = Rank {
        neg_priority: i64::MIN,
        start: 0,
    };

    /// The rank of a key of `priority` whose start tag is `start`.
    pub fn new(priority: i32, start: u64) -> Rank {
        Rank {
            neg_priority: -i64::from(priority),
            start,
        }
    }

    /// The key's priority class.
    pub fn priority(&self) -> i32 {
        i32::try_from(self.neg_priority.saturating_neg()).unwrap_or(i32::MAX)
    }

    /// The key's start tag (virtual time).
    pub fn start(&self) -> u64 {
        self.start
    }
}

/// Ready keys in the order they get slots: the highest priority first, and
/// within a priority start-time fair queuing by weight. A key's start tag
/// is the later of the queue's virtual time and its own finish tag; the
/// smallest starts first, moves the virtual time to its tag, and adds
/// `FAIR_STRIDE / weight` to its own. Backlogged keys of weights 1, 2 and
/// 4 so start in the ratio 1:2:4, and a key that becomes ready starts from
/// the virtual time, not behind a backlogged key's history.
#[derive(Debug, Clone)]
pub struct FairQueue<K> {
    heap: std::collections::BinaryHeap<std::cmp::Reverse<FairEntry<K>>>,
    tags: HashMap<K, u64>,
    vtime: u64,
    seq: u64,
}

impl<K> Default for FairQueue<K> {
    fn default() -> Self {
        FairQueue {
            heap: std::collections::BinaryHeap::new(),
            tags: HashMap::new(),
            vtime: 0,
            seq: 0,
        }
    }
}

impl<K: Ord + Clone + std::hash::Hash> FairQueue<K> {
    /// Queues ready key `k` of `priority` and `weight`.
    pub fn push(&mut self, k: K, priority: i32, weight: u32) {
        let start = self.tags.get(&k).copied().unwrap_or(0).max(self.vtime);
        self.seq += 1;
        self.heap.push(std::cmp::Reverse((
            -i64::from(priority),
            start,
            self.seq,
            weight.max(1),
            k,
        )));
    }

    /// The next key in line, not yet charged: [`FairQueue::charge`] it if
    /// it starts (a key passed over, not due or over its limit, pays
    /// nothing).
    pub fn pop(&mut self) -> Option<Popped<K>> {
        let std::cmp::Reverse((neg_priority, start, _, weight, k)) = self.heap.pop()?;
        Some(Popped {
            key: k,
            priority: -neg_priority as i32,
            start,
            weight,
        })
    }

    /// The ranks of the first `max` queued keys that `startable` accepts,
    /// best first, a key queued twice counted once at its better place;
    /// nothing is taken or charged.
    pub fn ranks(&self, max: usize, mut startable: impl FnMut(&K) -> bool) -> Vec<Rank> {
        let mut all: Vec<(Rank, &K)> = (self.heap.iter())
            .filter(|std::cmp::Reverse(e)| startable(&e.4))
            .map(|std::cmp::Reverse(e)| {
                let rank = Rank {
                    neg_priority: e.0,
                    start: e.1,
                };
                (rank, &e.4)
            })
            .collect();
        all.sort_unstable_by_key(|a| a.0);
        let mut seen = std::collections::HashSet::new();
        (all.into_iter())
            .filter(|(_, k)| seen.insert(*k))
            .map(|(r, _)| r)
            .take(max)
            .collect()
    }

    /// The rank key `k` of `priority` would have queued now.
    pub fn rank_of(&self, k: &K, priority: i32) -> Rank {
        let start = self.tags.get(k).copied().unwrap_or(0).max(self.vtime);
        Rank::new(priority, start)
    }

    /// The virtual time: the start tag of the latest key charged, or
    /// later when raised.
    pub fn vtime(&self) -> u64 {
        self.vtime
    }

    /// Moves the virtual time on to `v` if it is later (the process's
    /// virtual time over all its shards), so keys queued next start there.
    pub fn raise_vtime(&mut self, v: u64) {
        self.vtime = self.vtime.max(v);
    }

    /// Charges a popped key for one start.
    pub fn charge(&mut self, p: &Popped<K>) {
        self.vtime = self.vtime.max(p.start);
        self.tags
            .insert(p.key.clone(), p.start + FAIR_STRIDE / u64::from(p.weight));
        if self.tags.len() > 2 * self.heap.len() + 1_024 {
            // A tag at or below the virtual time is what a new key gets.
            let v = self.vtime;
            self.tags.retain(|_, t| *t > v);
        }
    }

    /// The keys queued, in no order, leaving it empty (tags are kept).
    pub fn drain(&mut self) -> Vec<K> {
        self.heap.drain().map(|std::cmp::Reverse(e)| e.4).collect()
    }

    /// Forgets `k`'s finish tag (its id is about to name another key).
    pub fn forget(&mut self, k: &K) {
        self.tags.remove(k);
    }

    /// Whether no key is queued.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.heap.clear();
        self.tags.clear();
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
    use super::*;

    /// Free slots go to the best ranks over every shard; equal ranks go
    /// round the shards from `first`, one key of each in turn; a shard that
    /// ranks `Rank::FIRST` (it must be claimed from) goes before all.
    #[test]
    fn shares_by_rank_follow_the_best_ranks_and_take_turns_on_ties() {
        let r = |p: i32, s: u64| Rank::new(p, s);
        let ranks = vec![
            ("a", vec![r(0, 5), r(0, 5), r(0, 9)]),
            ("b", vec![r(0, 5), r(0, 7)]),
            ("c", vec![r(1, 100)]),
        ];
        assert_eq!(
            shares_by_rank(&ranks, 1, 0),
            vec![("c", 1)],
            "priority first"
        );
        assert_eq!(shares_by_rank(&ranks, 2, 0), vec![("c", 1), ("a", 1)]);
        assert_eq!(shares_by_rank(&ranks, 2, 1), vec![("c", 1), ("b", 1)]);
        assert_eq!(
            shares_by_rank(&ranks, 4, 0),
            vec![("c", 1), ("a", 2), ("b", 1)],
            "ties take turns: a, b, then a again"
        );
        assert_eq!(
            shares_by_rank(&ranks, 9, 0),
            vec![("c", 1), ("a", 3), ("b", 2)]
        );
        let urgent = vec![("a", vec![r(9, 0)]), ("b", vec![Rank::FIRST])];
        assert_eq!(shares_by_rank(&urgent, 1, 0), vec![("b", 1)]);
        assert_eq!(Rank::FIRST.priority(), i32::MAX);
    }

    /// A run for checks that do not count runs.
    const ANY_RUN: RunStart<'static> = RunStart {
        shard: "s",
        fence: 0,
        lease_until_ms: u64::MAX,
    };

    fn rate(s: &str) -> Rate {
        s.parse().expect("rate")
    }

    #[test]
    fn rates_parse_and_bad_ones_name_the_value() {
        assert_eq!(
            rate("50/s"),
            Rate {
                count: 50,
                per_ms: 1000
            }
        );
        assert_eq!(
            rate(" 600 / m"),
            Rate {
                count: 600,
                per_ms: 60_000
            }
        );
        assert_eq!(rate("7/hour").to_string(), "7/h");
        for bad in ["0/s", "-1/s", "5/d", "5", "x/s", "2000000/s", ""] {
            let e = bad.parse::<Rate>().unwrap_err().to_string();
            assert!(
                e.contains("rate") && e.contains(&format!("{bad:?}")),
                "{bad}: {e}"
            );
        }
        assert_eq!(rate("1/h").default_burst(), 1);
        assert_eq!(rate("50/s").default_burst(), 50);
        assert_eq!(rate("90/m").default_burst(), 2);
    }

    /// The recipe, exactly: over any window the starts stay within
    /// burst + window x rate, and the waits named are exact.
    #[test]
    fn a_bucket_follows_the_recipe_to_the_millisecond() {
        let r = rate("50/s");
        let mut b = Bucket::full(r, 5, 1_000);
        for _ in 0..5 {
            assert_eq!(b.take(r, 5, 1_000), Ok(()));
        }
        assert_eq!(b.take(r, 5, 1_000), Err(1_020), "one token per 20 ms");
        assert_eq!(b.take(r, 5, 1_019), Err(1_020));
        assert_eq!(b.take(r, 5, 1_020), Ok(()));
        // Long idle refills to the burst, no further.
        assert_eq!(b.peek(r, 5, 100_000), Ok(()));
        assert_eq!(b.units, 5_000);
        // Every ms for 10 s: starts = burst + floor(10 000 x 50 / 1000).
        let mut b = Bucket::full(r, 5, 0);
        let starts = (0..=10_000u64).filter(|&t| b.take(r, 5, t).is_ok()).count();
        assert_eq!(starts, 5 + 500);
        // A hold gives nothing before it ends, then what refilled.
        let mut b = Bucket::full(r, 2, 0);
        b.hold(500);
        assert_eq!(b.take(r, 2, 10), Err(500));
        assert_eq!(b.take(r, 2, 500), Ok(()));
        // A changed rate keeps the tokens held.
        let mut b = Bucket::full(r, 10, 0);
        let slower = rate("60/m");
        assert_eq!(b.peek(slower, 10, 0), Ok(()));
        assert_eq!(b.units, 10 * 60_000);
    }

    fn settings() -> FlowSettings {
        let mut s = FlowSettings::default();
        s.groups.insert(
            "api".into(),
            GroupLimit {
                rate: Some(rate("10/s")),
                burst: Some(2),
                concurrency: None,
            },
        );
        s.prefixes.insert(
            "free:".into(),
            FlowPolicy {
                rate: Some(rate("2/s")),
                burst: Some(1),
                ..FlowPolicy::default()
            },
        );
        s.keys.insert(
            "free:vip".into(),
            FlowPolicy {
                group: Some("api".into()),
                ..FlowPolicy::default()
            },
        );
        s
    }

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
    fn a_group_limits_something_and_its_concurrency_is_bounded() {
        let mut g = GroupLimit {
            rate: None,
            burst: None,
            concurrency: None,
        };
        let e = g.validate().unwrap_err().to_string();
        assert!(e.contains("no rate and no concurrency"), "{e}");
        for n in [0, GROUP_CONCURRENCY_MAX + 1] {
            g.concurrency = Some(n);
            let e = g.validate().unwrap_err().to_string();
            assert!(
                e.contains("concurrency") && e.contains(&n.to_string()),
                "{e}"
            );
        }
        g.concurrency = Some(GROUP_CONCURRENCY_MAX);
        g.validate().expect("in range");
        g.burst = Some(5);
        let e = g.validate().unwrap_err().to_string();
        assert!(e.contains("burst"), "a burst without a rate: {e}");
    }

    #[test]
    fn live_settings_are_read_again_after_the_recheck_time() {
        let s = Arc::new(Mutex::new(FlowSettings::default()));
        let src = Arc::clone(&s);
        let f = FlowControl::new(
            FlowSettings::default(),
            Arc::new(LocalGroupBuckets::default()),
        )
        .with_source(Box::new(move || Ok(src.lock().unwrap().clone())));
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

    #[test]
    fn fair_queue_shares_by_weight_within_a_priority_and_serves_higher_first() {
        let mut q = FairQueue::default();
        let mut count = BTreeMap::new();
        for (k, w) in [("a", 1), ("b", 2), ("c", 4)] {
            q.push(k, 0, w);
        }
        for _ in 0..7_000 {
            let p = q.pop().expect("backlogged");
            q.charge(&p);
            let k = p.key;
            *count.entry(k).or_insert(0) += 1;
            let w = match k {
                "a" => 1,
                "b" => 2,
                _ => 4,
            };
            q.push(k, 0, w);
        }
        assert_eq!((count["a"], count["b"], count["c"]), (1_000, 2_000, 4_000));
        // A higher priority goes first; a newcomer is not behind history.
        q.push("vip", 5, 1);
        assert_eq!(q.pop().map(|p| p.key), Some("vip"));
        q.push("new", 0, 1);
        let mut next = Vec::new();
        while let Some(p) = q.pop() {
            q.charge(&p);
            next.push(p.key);
        }
        assert!(next.contains(&"new"), "{next:?}");
        // A key passed over (not charged) keeps its place.
        let mut q = FairQueue::default();
        q.push("x", 0, 1);
        q.push("y", 0, 1);
        let passed = q.pop().expect("x");
        q.push(passed.key, 0, 1);
        let y = q.pop().expect("y");
        q.charge(&y);
        q.push(y.key, 0, 1);
        assert_eq!(
            q.pop().map(|p| p.key),
            Some(passed.key),
            "the key passed over paid nothing, so it goes before the one that started"
        );
    }

    #[test]
    fn edits_are_checked_whole_and_a_used_group_stays() {
        let mut s = settings();
        let t = PolicyTarget::Prefix("paid:".into());
        let mut p = s.policy_of(&t);
        p.group = Some("missing".into());
        assert!(s.put_policy(&t, p).is_err());
        assert_eq!(s, settings(), "a refused edit changes nothing");
        let e = s.remove_group("api").unwrap_err().to_string();
        assert!(e.contains("free:vip"), "{e}");
        assert!(s.remove_policy(&PolicyTarget::Key("free:vip".into())));
        assert!(s.remove_group("api").expect("unused now"));
        assert_eq!(
            s.policy_of(&PolicyTarget::Key("free:x".into())).burst,
            Some(1)
        );
    }

    #[test]
    fn validation_names_the_field_and_value() {
        let mut s = FlowSettings::default();
        s.keys.insert(
            "k".into(),
            FlowPolicy {
                group: Some("nope".into()),
                ..FlowPolicy::default()
            },
        );
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("group") && e.contains("nope"), "{e}");
        for (p, field, value) in [
            (
                FlowPolicy {
                    concurrency: 0,
                    ..FlowPolicy::default()
                },
                "concurrency",
                "0",
            ),
            (
                FlowPolicy {
                    concurrency: KEY_CONCURRENCY_MAX + 1,
                    ..FlowPolicy::default()
                },
                "concurrency",
                "257",
            ),
            (
                FlowPolicy {
                    weight: 0,
                    ..FlowPolicy::default()
                },
                "weight",
                "0",
            ),
            (
                FlowPolicy {
                    priority: 5000,
                    ..FlowPolicy::default()
                },
                "priority",
                "5000",
            ),
            (
                FlowPolicy {
                    rate: Some(rate("1/s")),
                    burst: Some(0),
                    ..FlowPolicy::default()
                },
                "burst",
                "0",
            ),
            (
                FlowPolicy {
                    burst: Some(3),
                    ..FlowPolicy::default()
                },
                "burst",
                "3",
            ),
        ] {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(value), "{e}");
        }
        let text = r#"{"keys":{"k":{"rate":"5/fortnight"}}}"#;
        assert!(FlowSettings::parse(text)
            .unwrap_err()
            .to_string()
            .contains("fortnight"));
        let text = r#"{"keys":{"k":{"rat":"5/s"}}}"#;
        assert!(FlowSettings::parse(text)
            .unwrap_err()
            .to_string()
            .contains("rat"));
        let ok = settings();
        let back = FlowSettings::parse(&serde_json::to_string(&ok).unwrap()).unwrap();
        assert_eq!(back, ok);
        assert_eq!(ok.source_of("free:vip"), PolicySource::Key);
        assert_eq!(ok.source_of("free:z"), PolicySource::Prefix("free:".into()));
        assert_eq!(ok.source_of("z"), PolicySource::Default);
    }
}
