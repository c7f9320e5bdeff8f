//! Retry policies: how many attempts a job gets and how long it waits
//! between them, for the whole deployment, for a key, or for every key
//! starting with a prefix.
//!
//! A deployment keeps one [`RetrySettings`] (its `retry` setting, beside its
//! map). Resolution for a key is fixed and cheap: the rule of the key
//! itself, else the rule of the longest prefix of the key that has one,
//! else the deployment's default. Rules are whole policies (a rule set for
//! a key holds both its attempts and its backoff), so what a key gets never
//! depends on the order rules were written in.
//!
//! Where each part is applied:
//! - `max_attempts` is a job's attempt limit when its producer does not
//!   give one; it is stamped on the job at enqueue (by `shardq enqueue` and
//!   `POST /v1/jobs`), so a later change of the policy leaves queued jobs as
//!   they are.
//! - `backoff` decides the wait after a failed attempt whose handler named
//!   no delay (`retry_in_ms`); the backend resolves it from the key of the
//!   run when the attempt fails, so a change reaches every worker and
//!   server that opens the deployment after it. (A run whose job lease
//!   lapsed is tried again at once, as before: its worker is gone, not its
//!   downstream.)
//!
//! Edits go through [`RetrySettings::put_policy`] and
//! [`RetrySettings::remove_policy`], addressed by a [`PolicyTarget`] as flow
//! policies are: a [`RetryChange`] names the fields to replace, and the
//! others keep what the target gets today.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::QueueError;
use crate::flow::PolicyTarget;
use crate::job::{validate_key, Backoff, BackoffKind, MAX_ATTEMPTS_DEFAULT, MAX_ATTEMPTS_LIMIT};

/// Most key and prefix rules one deployment holds (together).
pub const RETRY_RULES_MAX: usize = 10_000;

/// What a job's failures get: its attempt limit and the waits between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts a job gets when its producer gives none (1 to
    /// [`MAX_ATTEMPTS_LIMIT`]).
    pub max_attempts: u32,
    /// The wait after each failed attempt.
    pub backoff: Backoff,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: MAX_ATTEMPTS_DEFAULT,
            backoff: Backoff::default(),
        }
    }
}

impl RetryPolicy {
    /// Checks every field, naming the one out of range and its value.
    pub fn validate(&self) -> Result<(), QueueError> {
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS_LIMIT {
            return Err(QueueError::InvalidOption {
                name: "max attempts",
                value: self.max_attempts.to_string(),
                allowed: format!("1 to {MAX_ATTEMPTS_LIMIT}"),
            });
        }
        self.backoff.validate()
    }
}

/// Per-key and per-prefix retry policies (the deployment's default is not
/// among them: see [`RetrySettings`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryRules {
    /// A key's own policy.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, RetryPolicy>,
    /// The policy of every key starting with the prefix (the longest
    /// matching prefix wins; a key's own rule wins over every prefix).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prefixes: BTreeMap<String, RetryPolicy>,
}

impl RetryRules {
    /// Whether there is no rule at all.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty() && self.prefixes.is_empty()
    }

    /// The rule `key` follows, if any: its own, else its longest prefix's.
    pub fn for_key(&self, key: &str) -> Option<&RetryPolicy> {
        rule_for(&self.keys, &self.prefixes, key)
    }

    /// Checks every rule: keys and prefixes by the key grammar, each policy
    /// by [`RetryPolicy::validate`], and their number.
    pub fn validate(&self) -> Result<(), QueueError> {
        let n = self.keys.len() + self.prefixes.len();
        if n > RETRY_RULES_MAX {
            return Err(QueueError::InvalidOption {
                name: "retry rules",
                value: n.to_string(),
                allowed: format!("at most {RETRY_RULES_MAX} key and prefix rules"),
            });
        }
        for (k, p) in self.keys.iter().chain(self.prefixes.iter()) {
            validate_key(k)?;
            p.validate()?;
        }
        Ok(())
    }
}

/// The rule `key` follows among per-key and per-prefix rules: its own, else
/// its longest prefix's (cut at char boundaries only). Shared by every kind
/// of per-key setting so they all resolve alike.
pub(crate) fn rule_for<'a, T>(
    keys: &'a BTreeMap<String, T>,
    prefixes: &'a BTreeMap<String, T>,
    key: &str,
) -> Option<&'a T> {
    if let Some(p) = keys.get(key) {
        return Some(p);
    }
    prefix_rule_for(prefixes, key).map(|(_, p)| p)
}

/// The longest prefix of `key` that has a rule, with its rule.
pub(crate) fn prefix_rule_for<'a, T>(
    prefixes: &'a BTreeMap<String, T>,
    key: &str,
) -> Option<(&'a String, &'a T)> {
    if prefixes.is_empty() {
        return None;
    }
    // Longest first: every char boundary of the key, from the end.
    key.char_indices()
        .map(|(i, _)| i)
        .chain(std::iter::once(key.len()))
        .rev()
        .filter(|&i| i > 0)
        .find_map(|i| prefixes.get_key_value(&key[..i]))
}

/// The fields of a retry policy an edit replaces; `None` keeps the value
/// the policy has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryChange {
    /// Attempts a job gets when its producer gives none.
    pub max_attempts: Option<u32>,
    /// Exponential or fixed waits.
    pub kind: Option<BackoffKind>,
    /// The wait after the first failed attempt, in ms. A cap below it
    /// follows it up unless `max_ms` is given too.
    pub base_ms: Option<u64>,
    /// The longest wait, in ms.
    pub max_ms: Option<u64>,
    /// Up to this percentage taken off each wait.
    pub jitter_pct: Option<u8>,
}

impl RetryChange {
    /// `policy` with this change's fields in place (not checked: see
    /// [`RetryPolicy::validate`]).
    pub fn apply(&self, policy: RetryPolicy) -> RetryPolicy {
        let mut p = policy;
        if let Some(n) = self.max_attempts {
            p.max_attempts = n;
        }
        if let Some(k) = self.kind {
            p.backoff.kind = k;
        }
        if let Some(v) = self.base_ms {
            p.backoff.base_ms = v;
            // A cap below a new base follows it up.
            if self.max_ms.is_none() && p.backoff.max_ms < v {
                p.backoff.max_ms = v;
            }
        }
        if let Some(v) = self.max_ms {
            p.backoff.max_ms = v;
        }
        if let Some(v) = self.jitter_pct {
            p.backoff.jitter_pct = v;
        }
        p
    }
}

/// A deployment's retry settings: the default policy and the rules.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RetrySettings {
    /// What a key without a rule gets.
    pub default: RetryPolicy,
    /// Per-key and per-prefix policies.
    #[serde(flatten)]
    pub rules: RetryRules,
}

impl RetrySettings {
    /// The policy of `key`.
    pub fn for_key(&self, key: &str) -> &RetryPolicy {
        self.rules.for_key(key).unwrap_or(&self.default)
    }

    /// Checks the default and every rule.
    pub fn validate(&self) -> Result<(), QueueError> {
        self.default.validate()?;
        self.rules.validate()
    }

    /// What `target` gets today: its own rule, else what its keys resolve
    /// to (where a new rule for it starts from).
    pub fn policy_of(&self, target: &PolicyTarget) -> RetryPolicy {
        match target {
            PolicyTarget::Default => self.default,
            PolicyTarget::Key(k) => *self.for_key(k),
            PolicyTarget::Prefix(p) => *self
                .rules
                .prefixes
                .get(p)
                .unwrap_or_else(|| self.for_key(p)),
        }
    }

    /// Applies `change` to what `target` gets today and makes the result
    /// `target`'s rule (for [`PolicyTarget::Default`], the default). The
    /// key or prefix is checked by the key grammar and the settings whole;
    /// when refused they are left unchanged. Returns the policy set.
    pub fn put_policy(
        &mut self,
        target: &PolicyTarget,
        change: &RetryChange,
    ) -> Result<RetryPolicy, QueueError> {
        target.validate()?;
        let p = change.apply(self.policy_of(target));
        let mut next = self.clone();
        match target {
            PolicyTarget::Default => next.default = p,
            PolicyTarget::Key(k) => {
                next.rules.keys.insert(k.clone(), p);
            }
            PolicyTarget::Prefix(pre) => {
                next.rules.prefixes.insert(pre.clone(), p);
            }
        }
        next.validate()?;
        *self = next;
        Ok(p)
    }

    /// Removes `target`'s rule, so its keys follow the next rule that
    /// matches or the default; for [`PolicyTarget::Default`], puts
    /// [`RetryPolicy::default`] back and keeps the rules. Whether anything
    /// changed.
    pub fn remove_policy(&mut self, target: &PolicyTarget) -> bool {
        match target {
            PolicyTarget::Default => {
                let had = self.default != RetryPolicy::default();
                self.default = RetryPolicy::default();
                had
            }
            PolicyTarget::Key(k) => self.rules.keys.remove(k).is_some(),
            PolicyTarget::Prefix(p) => self.rules.prefixes.remove(p).is_some(),
        }
    }

    /// Parses the `retry` setting's JSON: `default`, and the `keys` and
    /// `prefixes` rules (each optional); any other field is refused.
    pub fn parse(text: &str) -> Result<RetrySettings, serde_json::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Form {
            default: RetryPolicy,
            #[serde(default)]
            keys: BTreeMap<String, RetryPolicy>,
            #[serde(default)]
            prefixes: BTreeMap<String, RetryPolicy>,
        }
        let f: Form = serde_json::from_str(text)?;
        Ok(RetrySettings {
            default: f.default,
            rules: RetryRules {
                keys: f.keys,
                prefixes: f.prefixes,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(attempts: u32, base_ms: u64) -> RetryPolicy {
        RetryPolicy {
            max_attempts: attempts,
            backoff: Backoff {
                base_ms,
                max_ms: base_ms * 10,
                ..Backoff::default()
            },
        }
    }

    #[test]
    fn a_key_rule_beats_the_longest_prefix_which_beats_the_default() {
        let mut s = RetrySettings::default();
        s.rules.prefixes.insert("free:".into(), policy(2, 10));
        s.rules.prefixes.insert("free:eu:".into(), policy(3, 20));
        s.rules.keys.insert("free:eu:acme".into(), policy(4, 30));
        assert_eq!(s.for_key("free:eu:acme").max_attempts, 4);
        assert_eq!(s.for_key("free:eu:other").max_attempts, 3);
        assert_eq!(s.for_key("free:us:x").max_attempts, 2);
        assert_eq!(s.for_key("paid:x"), &RetryPolicy::default());
        // A prefix equal to the whole key counts; a prefix cut inside a
        // character never matches.
        s.rules.prefixes.insert("ä".into(), policy(6, 40));
        assert_eq!(s.for_key("ä").max_attempts, 6);
        assert_eq!(s.for_key("äb").max_attempts, 6);
        assert_eq!(
            s.for_key("b").max_attempts,
            RetryPolicy::default().max_attempts
        );
    }

    #[test]
    fn the_setting_reads_its_one_form_and_refuses_unknown_fields() {
        // A bare backoff is no retry setting.
        let bare = r#"{"base_ms":5,"max_ms":50,"kind":"fixed","jitter_pct":3}"#;
        assert!(RetrySettings::parse(bare).is_err());
        let mut w = RetrySettings::default();
        w.rules.keys.insert("k".into(), policy(7, 9));
        let text = serde_json::to_string(&w).expect("json");
        assert_eq!(RetrySettings::parse(&text).expect("new form"), w);
        assert!(RetrySettings::parse(
            r#"{"default":{"max_attempts":1,"backoff":{"base_ms":1,"max_ms":1}},"other":1}"#
        )
        .is_err());
        // A misspelt field of a rule is named.
        let e = RetrySettings::parse(
            r#"{"default":{"max_attempts":1,"backoff":{"base_ms":1,"max_ms":1}},"keys":{"k":{"max_atempts":2}}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("max_atempts"), "{e}");
    }

    #[test]
    fn a_new_rule_starts_from_what_its_keys_get_today() {
        let mut s = RetrySettings::default();
        s.rules.prefixes.insert("free:".into(), policy(2, 10));
        let key = PolicyTarget::Key("free:acme".into());
        let p = s
            .put_policy(
                &key,
                &RetryChange {
                    jitter_pct: Some(3),
                    ..RetryChange::default()
                },
            )
            .expect("valid");
        // Attempts and waits from the prefix rule, jitter from the change.
        assert_eq!(p.max_attempts, 2);
        assert_eq!((p.backoff.base_ms, p.backoff.max_ms), (10, 100));
        assert_eq!(p.backoff.jitter_pct, 3);
        assert_eq!(s.rules.keys.get("free:acme"), Some(&p));
        assert_eq!(s.for_key("free:acme"), &p);
        // The prefix rule itself is untouched.
        assert_eq!(s.rules.prefixes.get("free:"), Some(&policy(2, 10)));
        // A new prefix rule under it starts from the shorter prefix's.
        let sub = PolicyTarget::Prefix("free:eu:".into());
        let p = s
            .put_policy(
                &sub,
                &RetryChange {
                    max_attempts: Some(9),
                    ..RetryChange::default()
                },
            )
            .expect("valid");
        assert_eq!(
            p,
            RetryPolicy {
                max_attempts: 9,
                ..policy(2, 10)
            }
        );
        assert_eq!(s.for_key("free:eu:x").max_attempts, 9);
        assert_eq!(s.for_key("free:us:x").max_attempts, 2);
    }

    #[test]
    fn a_change_replaces_only_the_fields_it_names() {
        let mut s = RetrySettings::default();
        let before = s.default;
        let p = s
            .put_policy(
                &PolicyTarget::Default,
                &RetryChange {
                    kind: Some(BackoffKind::Fixed),
                    max_ms: Some(before.backoff.max_ms * 2),
                    ..RetryChange::default()
                },
            )
            .expect("valid");
        assert_eq!(s.default, p);
        assert_eq!(p.backoff.kind, BackoffKind::Fixed);
        assert_eq!(p.backoff.max_ms, before.backoff.max_ms * 2);
        assert_eq!(p.max_attempts, before.max_attempts);
        assert_eq!(p.backoff.base_ms, before.backoff.base_ms);
        assert_eq!(p.backoff.jitter_pct, before.backoff.jitter_pct);
        assert!(s.rules.is_empty(), "the default is no rule");
    }

    #[test]
    fn a_cap_below_a_new_base_follows_it_unless_given() {
        let start = policy(3, 10); // base 10 ms, cap 100 ms
        let raised = RetryChange {
            base_ms: Some(500),
            ..RetryChange::default()
        }
        .apply(start);
        assert_eq!((raised.backoff.base_ms, raised.backoff.max_ms), (500, 500));
        let lowered = RetryChange {
            base_ms: Some(50),
            ..RetryChange::default()
        }
        .apply(start);
        assert_eq!((lowered.backoff.base_ms, lowered.backoff.max_ms), (50, 100));
        // A cap given with the base is taken as given (and may be refused).
        let both = RetryChange {
            base_ms: Some(500),
            max_ms: Some(200),
            ..RetryChange::default()
        };
        assert_eq!(both.apply(start).backoff.max_ms, 200);
        let mut s = RetrySettings::default();
        let e = s
            .put_policy(&PolicyTarget::Key("k".into()), &both)
            .unwrap_err();
        assert!(e.to_string().contains("200"), "{e}");
        assert!(
            s.rules.is_empty(),
            "a refused change leaves the settings as they were"
        );
    }

    #[test]
    fn a_refused_change_names_the_value_and_changes_nothing() {
        let mut s = RetrySettings::default();
        s.rules.keys.insert("k".into(), policy(4, 10));
        let before = s.clone();
        let e = s
            .put_policy(
                &PolicyTarget::Key("k".into()),
                &RetryChange {
                    max_attempts: Some(0),
                    ..RetryChange::default()
                },
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("max attempts") && e.contains('0'), "{e}");
        assert_eq!(s, before);
        let e = s
            .put_policy(
                &PolicyTarget::Prefix("bad\nprefix".into()),
                &RetryChange::default(),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("control character"), "{e}");
        let e = s
            .put_policy(&PolicyTarget::Key(String::new()), &RetryChange::default())
            .unwrap_err();
        assert!(matches!(e, QueueError::InvalidKey { .. }), "{e}");
        assert_eq!(s, before);
    }

    #[test]
    fn removing_a_rule_hands_its_keys_to_the_next_rule() {
        let mut s = RetrySettings::default();
        s.rules.prefixes.insert("free:".into(), policy(2, 10));
        s.rules.prefixes.insert("free:eu:".into(), policy(3, 20));
        s.rules.keys.insert("free:eu:acme".into(), policy(4, 30));
        assert!(s.remove_policy(&PolicyTarget::Key("free:eu:acme".into())));
        assert_eq!(s.for_key("free:eu:acme").max_attempts, 3);
        assert!(s.remove_policy(&PolicyTarget::Prefix("free:eu:".into())));
        assert_eq!(s.for_key("free:eu:acme").max_attempts, 2);
        // Nothing to remove: nothing changes.
        let before = s.clone();
        assert!(!s.remove_policy(&PolicyTarget::Key("free:eu:acme".into())));
        assert!(!s.remove_policy(&PolicyTarget::Prefix("free:eu:".into())));
        assert_eq!(s, before);
    }

    #[test]
    fn clearing_the_default_puts_it_back_and_keeps_the_rules() {
        let mut s = RetrySettings::default();
        assert!(
            !s.remove_policy(&PolicyTarget::Default),
            "already the default"
        );
        s.default = policy(8, 10);
        s.rules.prefixes.insert("free:".into(), policy(2, 10));
        assert!(s.remove_policy(&PolicyTarget::Default));
        assert_eq!(s.default, RetryPolicy::default());
        assert_eq!(s.rules.prefixes.len(), 1);
    }

    #[test]
    fn validation_names_the_field_and_value() {
        let mut s = RetrySettings::default();
        s.rules.keys.insert("k".into(), policy(0, 10));
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("max attempts") && e.contains('0'), "{e}");
        let mut s = RetrySettings::default();
        s.rules.prefixes.insert("bad\nprefix".into(), policy(1, 10));
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("control character"));
    }
}
