//! The consistent-hash harness: experiments A (evenness), B (rebalance cost on
//! add and on remove) and C (affinity), run the same way against every system.
//!
//! A system is anything that implements [`Target`]: it owns an ordered list of
//! queues, receives messages with a routing key, and tells where they landed.
//! The experiments only ever ask a target for per-queue counts ([`Target::count`])
//! or per-message placements ([`Target::place`]), so a library router and a real
//! broker are measured by identical code.
//!
//! Keys are `user-<n>`, as in the specification. This module does no I/O of
//! its own; the targets and [`report`] do.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::error::ChxError;

pub mod embedded;
pub mod rabbitmq;
pub mod report;
pub mod router;

pub use embedded::EmbeddedTarget;
pub use rabbitmq::RabbitTarget;
pub use router::RouterTarget;

/// Largest number of queues: the charts and the CSVs stay readable, and
/// RabbitMQ's exchange is declared with one binding per queue.
pub const QUEUES_MAX: usize = 64;
/// Largest number of messages (A) or keys (B, C) one experiment sends.
pub const MESSAGES_MAX: u64 = 10_000_000;
/// Largest number of copies per key in experiment C.
pub const COPIES_MAX: u32 = 100;

/// What to run. Defaults are the specification's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Params {
    /// Queues (shards) in A, B-add's "before" and C; B adds one, B2 removes one of `queues + 1`.
    pub queues: usize,
    /// Messages sent in A.
    pub messages: u64,
    /// Distinct keys the A messages cycle through.
    pub keys: u64,
    /// Distinct keys placed in B and B2.
    pub rebalance_keys: u64,
    /// Distinct keys in C.
    pub affinity_keys: u64,
    /// Copies of each key in C.
    pub copies: u32,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            queues: 8,
            messages: 100_000,
            keys: 50_000,
            rebalance_keys: 10_000,
            affinity_keys: 10_000,
            copies: 5,
        }
    }
}

impl Params {
    /// Checks every bound, naming the first parameter that breaks one.
    pub fn validate(&self) -> Result<(), ChxError> {
        let bad = |field: &'static str, value: String, reason: String| ChxError::InvalidParam {
            field,
            value,
            reason,
        };
        if self.queues < 2 || self.queues > QUEUES_MAX {
            return Err(bad(
                "queues",
                self.queues.to_string(),
                format!("must be from 2 to {QUEUES_MAX}"),
            ));
        }
        for (field, value) in [
            ("messages", self.messages),
            ("keys", self.keys),
            ("rebalance-keys", self.rebalance_keys),
            ("affinity-keys", self.affinity_keys),
        ] {
            if value == 0 || value > MESSAGES_MAX {
                return Err(bad(
                    field,
                    value.to_string(),
                    format!("must be from 1 to {MESSAGES_MAX}"),
                ));
            }
        }
        if self.keys > self.messages {
            return Err(bad(
                "keys",
                self.keys.to_string(),
                format!(
                    "must not exceed --messages ({}): every key gets at least one message",
                    self.messages
                ),
            ));
        }
        if self.copies == 0 || self.copies > COPIES_MAX {
            return Err(bad(
                "copies",
                self.copies.to_string(),
                format!("must be from 1 to {COPIES_MAX}"),
            ));
        }
        if self.affinity_keys.saturating_mul(u64::from(self.copies)) > MESSAGES_MAX {
            return Err(bad(
                "affinity-keys",
                self.affinity_keys.to_string(),
                format!(
                    "times --copies ({}) must not exceed {MESSAGES_MAX}",
                    self.copies
                ),
            ));
        }
        Ok(())
    }

    /// Index of the queue B2 removes from `queues + 1`: the middle one, so
    /// that order-based schemes (jump, modulo, bucket lists) renumber the rest.
    pub fn removed_index(&self) -> usize {
        // (queues + 1) / 2: index 4 of 9 queues.
        self.queues.div_ceil(2)
    }
}

/// The routing key of key number `n`.
pub fn key(n: u64) -> String {
    format!("user-{n}")
}

/// Receives progress; the binary draws a bar with it, tests ignore it.
pub trait Observer {
    /// A new step starts; `total` units of work follow.
    fn step(&mut self, system: &str, step: &str, total: u64);
    /// `n` more units are done.
    fn advance(&mut self, n: u64);
}

/// An observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct Quiet;

impl Observer for Quiet {
    fn step(&mut self, _system: &str, _step: &str, _total: u64) {}
    fn advance(&mut self, _n: u64) {}
}

/// A system the experiments run against.
pub trait Target {
    /// Short name used in every result file (`ring`, `rabbitmq`, ...).
    fn system(&self) -> &str;
    /// Version of the software under test.
    fn version(&self) -> String;
    /// Starts an experiment with empty queues named `queues`, in binding order.
    fn begin(&mut self, experiment: &str, queues: &[String]) -> Result<(), ChxError>;
    /// Changes the queue set to `queues`, the way an operator would: queues
    /// not yet present are added, missing ones removed, the rest kept as is.
    fn set_queues(&mut self, queues: &[String]) -> Result<(), ChxError>;
    /// Sends one message per key and returns how many each queue received,
    /// in the order of the current queue list. Queues are empty afterwards.
    fn count(
        &mut self,
        keys: &mut dyn Iterator<Item = String>,
        total: u64,
        obs: &mut dyn Observer,
    ) -> Result<Vec<u64>, ChxError>;
    /// Sends one message per entry of `keys` and returns, for each, the index
    /// (in the current queue list) of the queue it reached. Queues are empty afterwards.
    fn place(&mut self, keys: &[String], obs: &mut dyn Observer) -> Result<Vec<usize>, ChxError>;
    /// Ends the experiment and releases what `begin` created.
    fn end(&mut self) -> Result<(), ChxError>;
}

/// Experiment A's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Distribution {
    /// Queue names.
    pub queues: Vec<String>,
    /// Messages per queue.
    pub counts: Vec<u64>,
}

impl Distribution {
    /// Messages counted.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// total / queues.
    pub fn ideal(&self) -> f64 {
        self.total() as f64 / self.counts.len().max(1) as f64
    }

    /// Largest count over smallest; infinite if a queue got nothing.
    pub fn max_min(&self) -> f64 {
        let max = self.counts.iter().copied().max().unwrap_or(0);
        let min = self.counts.iter().copied().min().unwrap_or(0);
        if min == 0 {
            f64::INFINITY
        } else {
            max as f64 / min as f64
        }
    }

    /// Largest count over the ideal: how much more the busiest queue carries.
    pub fn max_ideal(&self) -> f64 {
        let max = self.counts.iter().copied().max().unwrap_or(0);
        max as f64 / self.ideal()
    }

    /// Standard deviation of the counts, as a percentage of the ideal.
    pub fn stddev_pct(&self) -> f64 {
        let ideal = self.ideal();
        let var = self
            .counts
            .iter()
            .map(|&c| (c as f64 - ideal).powi(2))
            .sum::<f64>()
            / self.counts.len().max(1) as f64;
        100.0 * var.sqrt() / ideal
    }
}

/// Which way B changes the queue set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Change {
    /// B: one queue appended.
    Add,
    /// B2: one queue in the middle removed.
    Remove,
}

impl Change {
    /// Name used in `rebalance.csv`.
    pub fn name(self) -> &'static str {
        match self {
            Change::Add => "add",
            Change::Remove => "remove",
        }
    }
}

/// Experiment B's (or B2's) result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rebalance {
    /// Add or remove.
    pub change: Change,
    /// Queues before and after.
    pub queues_before: usize,
    /// Queues after the change.
    pub queues_after: usize,
    /// The queue added or removed.
    pub changed_queue: String,
    /// Distinct keys placed.
    pub keys: u64,
    /// Keys whose queue changed.
    pub moved: u64,
    /// Add: moved keys that went to the new queue.
    pub moved_to_new: u64,
    /// Remove: keys that were on the removed queue (they must move).
    pub on_removed: u64,
    /// Keys that moved without having to: add, to a queue other than the new
    /// one; remove, from a queue that stayed. Zero for a minimal scheme.
    pub needless: u64,
}

impl Rebalance {
    /// moved / keys, in percent.
    pub fn moved_pct(&self) -> f64 {
        pct(self.moved, self.keys)
    }

    /// Share of moved keys that went to the new queue (add only).
    pub fn moved_to_new_pct(&self) -> Option<f64> {
        (self.change == Change::Add).then(|| pct(self.moved_to_new, self.moved))
    }

    /// The least a consistent scheme must move, in percent of keys: add,
    /// 1/(N+1); remove, the removed queue's measured share.
    pub fn ideal_pct(&self) -> f64 {
        match self.change {
            Change::Add => 100.0 / self.queues_after as f64,
            Change::Remove => pct(self.on_removed, self.keys),
        }
    }
}

/// Experiment C's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Affinity {
    /// Distinct keys.
    pub keys: u64,
    /// Copies sent per key.
    pub copies: u32,
    /// Messages sent (keys x copies).
    pub messages: u64,
    /// Keys whose copies reached more than one queue.
    pub split_keys: u64,
    /// Keys whose copies all reached one queue.
    pub single_queue_keys: u64,
}

/// Everything measured for one system, or why not.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SystemReport {
    /// The system's short name.
    pub system: String,
    /// Its version ("" when unknown, for example when skipped).
    pub version: String,
    /// A.
    pub distribution: Option<Distribution>,
    /// B.
    pub add: Option<Rebalance>,
    /// B2.
    pub remove: Option<Rebalance>,
    /// C.
    pub affinity: Option<Affinity>,
    /// Why some experiments have no result: starts with `skipped:` or `failed:`.
    pub note: Option<String>,
}

impl SystemReport {
    /// A row that says the system was not measured, and why.
    pub fn skipped(system: impl Into<String>, reason: impl Into<String>) -> SystemReport {
        SystemReport {
            system: system.into(),
            version: String::new(),
            distribution: None,
            add: None,
            remove: None,
            affinity: None,
            note: Some(format!("skipped: {}", reason.into())),
        }
    }

    /// True when every experiment produced a result.
    pub fn complete(&self) -> bool {
        self.distribution.is_some()
            && self.add.is_some()
            && self.remove.is_some()
            && self.affinity.is_some()
    }
}

/// Percent, 0 when the denominator is 0.
pub fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// Queue names `prefix0 .. prefix{n-1}`.
pub fn queue_names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

/// Runs A, B, B2 and C on `target`. A failure stops the system's remaining
/// experiments and is recorded in the report's note, not returned: one broken
/// system must not hide the others' results.
pub fn run_system(
    target: &mut dyn Target,
    params: &Params,
    obs: &mut dyn Observer,
) -> SystemReport {
    let mut report = SystemReport {
        system: target.system().to_string(),
        version: target.version(),
        distribution: None,
        add: None,
        remove: None,
        affinity: None,
        note: None,
    };
    if let Err(err) = run_all(target, params, obs, &mut report) {
        // Leave the broker clean even when an experiment failed half-way.
        let _ = target.end();
        report.note = Some(format!("failed: {err}"));
    }
    report
}

fn run_all(
    target: &mut dyn Target,
    params: &Params,
    obs: &mut dyn Observer,
    report: &mut SystemReport,
) -> Result<(), ChxError> {
    params.validate()?;
    let names = queue_names("q", params.queues + 1);
    report.distribution = Some(distribution(target, params, &names[..params.queues], obs)?);
    let (add, remove) = rebalance(target, params, &names, obs)?;
    report.add = Some(add);
    report.remove = Some(remove);
    report.affinity = Some(affinity(target, params, &names[..params.queues], obs)?);
    Ok(())
}

/// A: `messages` messages cycling through `keys` keys onto `queues`.
fn distribution(
    target: &mut dyn Target,
    params: &Params,
    queues: &[String],
    obs: &mut dyn Observer,
) -> Result<Distribution, ChxError> {
    target.begin("a", queues)?;
    let keys = params.keys;
    let mut stream = (0..params.messages).map(move |i| key(i % keys));
    obs.step(target.system(), "A evenness", params.messages);
    let counts = target.count(&mut stream, params.messages, obs)?;
    target.end()?;
    let sent: u64 = counts.iter().sum();
    if sent != params.messages {
        return Err(ChxError::Lost {
            system: target.system().to_string(),
            detail: format!(
                "A sent {} messages but the queues hold {sent}",
                params.messages
            ),
        });
    }
    Ok(Distribution {
        queues: queues.to_vec(),
        counts,
    })
}

/// B and B2 on one exchange: place keys on N queues, add queue N, place
/// again, remove the middle queue, place again.
fn rebalance(
    target: &mut dyn Target,
    params: &Params,
    names: &[String],
    obs: &mut dyn Observer,
) -> Result<(Rebalance, Rebalance), ChxError> {
    let keys: Vec<String> = (0..params.rebalance_keys).map(key).collect();
    let n = params.queues;
    let before = &names[..n];
    let grown = &names[..n + 1];
    let removed = params.removed_index();
    let shrunk: Vec<String> = grown
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != removed)
        .map(|(_, q)| q.clone())
        .collect();

    target.begin("b", before)?;
    obs.step(
        target.system(),
        &format!("B place on {n}"),
        keys.len() as u64,
    );
    let on_before = target.place(&keys, obs)?;
    target.set_queues(grown)?;
    obs.step(
        target.system(),
        &format!("B place on {}", n + 1),
        keys.len() as u64,
    );
    let on_grown = target.place(&keys, obs)?;
    target.set_queues(&shrunk)?;
    obs.step(
        target.system(),
        &format!("B2 place on {n}"),
        keys.len() as u64,
    );
    let on_shrunk = target.place(&keys, obs)?;
    target.end()?;

    let mut add = Rebalance {
        change: Change::Add,
        queues_before: n,
        queues_after: n + 1,
        changed_queue: grown[n].clone(),
        keys: keys.len() as u64,
        moved: 0,
        moved_to_new: 0,
        on_removed: 0,
        needless: 0,
    };
    for (&a, &b) in on_before.iter().zip(&on_grown) {
        // Queue indexes agree between the two lists: the new queue is appended.
        if a != b {
            add.moved += 1;
            if b == n {
                add.moved_to_new += 1;
            } else {
                add.needless += 1;
            }
        }
    }
    let mut remove = Rebalance {
        change: Change::Remove,
        queues_before: n + 1,
        queues_after: n,
        changed_queue: grown[removed].clone(),
        keys: keys.len() as u64,
        moved: 0,
        moved_to_new: 0,
        on_removed: 0,
        needless: 0,
    };
    for (&a, &b) in on_grown.iter().zip(&on_shrunk) {
        // Compare by name: indexes after the removed queue shift down by one.
        let was = &grown[a];
        let now = &shrunk[b];
        if a == removed {
            remove.on_removed += 1;
        }
        if was != now {
            remove.moved += 1;
            if a != removed {
                remove.needless += 1;
            }
        }
    }
    Ok((add, remove))
}

/// C: `copies` copies of each key, interleaved, must each reach one queue.
fn affinity(
    target: &mut dyn Target,
    params: &Params,
    queues: &[String],
    obs: &mut dyn Observer,
) -> Result<Affinity, ChxError> {
    let k = params.affinity_keys;
    let messages: Vec<String> = (0..u64::from(params.copies))
        .flat_map(|_| (0..k).map(key))
        .collect();
    target.begin("c", queues)?;
    obs.step(target.system(), "C affinity", messages.len() as u64);
    let placed = target.place(&messages, obs)?;
    target.end()?;
    let mut seen: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); k as usize];
    for (i, &q) in placed.iter().enumerate() {
        seen[i % k as usize].insert(q);
    }
    let split = seen.iter().filter(|s| s.len() > 1).count() as u64;
    Ok(Affinity {
        keys: k,
        copies: params.copies,
        messages: messages.len() as u64,
        split_keys: split,
        single_queue_keys: k - split,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One case per bound: the params and a fragment the error must contain.
    #[test]
    fn bad_params_name_the_field() {
        let base = Params::default();
        let cases: Vec<(Params, &str)> = vec![
            (
                Params {
                    queues: 1,
                    ..base.clone()
                },
                "`queues` has invalid value 1",
            ),
            (
                Params {
                    queues: 65,
                    ..base.clone()
                },
                "`queues` has invalid value 65",
            ),
            (
                Params {
                    messages: 0,
                    ..base.clone()
                },
                "`messages` has invalid value 0",
            ),
            (
                Params {
                    keys: 200_000,
                    ..base.clone()
                },
                "must not exceed --messages",
            ),
            (
                Params {
                    copies: 0,
                    ..base.clone()
                },
                "`copies` has invalid value 0",
            ),
            (
                Params {
                    rebalance_keys: MESSAGES_MAX + 1,
                    ..base.clone()
                },
                "`rebalance-keys`",
            ),
            (
                Params {
                    affinity_keys: 1_000_000,
                    copies: 20,
                    ..base.clone()
                },
                "times --copies (20)",
            ),
        ];
        for (params, want) in cases {
            let err = params.validate().expect_err(want).to_string();
            assert!(err.contains(want), "{params:?}: {err:?} lacks {want:?}");
        }
        base.validate().unwrap();
    }

    #[test]
    fn distribution_ratios() {
        let cases: &[(&[u64], f64, f64)] = &[
            (&[10, 10, 10, 10], 1.0, 1.0),
            (&[12, 8, 10, 10], 1.5, 1.2),
            (&[20, 0], f64::INFINITY, 2.0),
        ];
        for &(counts, max_min, max_ideal) in cases {
            let d = Distribution {
                queues: queue_names("q", counts.len()),
                counts: counts.to_vec(),
            };
            assert_eq!(d.max_min(), max_min, "{counts:?}");
            assert!((d.max_ideal() - max_ideal).abs() < 1e-9, "{counts:?}");
        }
    }

    #[test]
    fn removed_index_is_the_middle() {
        for (queues, want) in [(8, 4), (2, 1), (3, 2)] {
            assert_eq!(
                Params {
                    queues,
                    ..Params::default()
                }
                .removed_index(),
                want
            );
        }
    }
}
