//! Policies and settings: what a key gets ([`FlowPolicy`]), the limits
//! its group shares ([`GroupLimit`]), a deployment's [`FlowSettings`]
//! (resolution per key, prefix or default, and edits), the
//! [`ConcurrencyRules`] a store resolves by itself, and the checks of all
//! of them.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::rate::{Rate, RATE_COUNT_MAX};
use crate::error::QueueError;
use crate::job::validate_key;
use crate::retry::{prefix_rule_for, rule_for};

/// Most key and prefix policies one deployment holds (together).
pub const FLOW_RULES_MAX: usize = 10_000;
/// Most groups one deployment holds.
pub const FLOW_GROUPS_MAX: usize = 1_000;
/// Most tokens a bucket may hold.
pub const BURST_MAX: u64 = 1_000_000;
/// Most runs of one key at once. One run per key (the default) is the
/// queue's strict order; with more, a key's jobs still start in order, up
/// to its concurrency at once. A backend may offer less
/// ([`crate::BackendLimits::key_concurrency_max`]).
pub const KEY_CONCURRENCY_MAX: u32 = 256;
/// Most runs of one group's keys at once.
pub const GROUP_CONCURRENCY_MAX: u32 = 10_000;
/// Largest weight.
pub const WEIGHT_MAX: u32 = 1_000;
/// Priorities run from `-PRIORITY_MAX` to `PRIORITY_MAX`.
pub const PRIORITY_MAX: i32 = 1_000;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::testing::{rate, settings};

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
