//! The backend contract as executable checks, written once and run against
//! every [`QueueBackend`]: the memory backend (`shardq-core`'s tests), the
//! embedded engine (`shardq-fs`'s) and Redis (`shardq-redis`'s).
//!
//! Each check starts from an empty shard the harness owns and asserts an
//! invariant a user relies on (per-key order, one run per key, receipts,
//! job leases, dead letters as work, growing fences), never a mechanism.
//! The checks panic with a message naming the broken promise. A backend's
//! test file runs them with [`contract_tests!`](crate::contract_tests), one
//! test per check, each on a harness of its own; [`CHECKS`] names them
//! all. This module does no I/O of its own.

use shardq_core::backend::QueueBackend;
use shardq_core::error::QueueError;
use shardq_core::job::{CancelOutcome, ClaimedJob, JobId, JobState, KeyCounts, NewJob, Receipt};

mod batch;
mod dedup;
mod flow;
mod inspect;
mod moves;
mod run;
mod workflow;

pub use batch::*;
pub use dedup::*;
pub use flow::*;
pub use inspect::*;
pub use moves::*;
pub use run::*;
pub use workflow::*;

/// A backend under test and a way to let its time pass.
pub trait ContractHarness {
    /// The backend; `shard()` is adopted by it and empty at the start of
    /// each check.
    fn backend(&self) -> &dyn QueueBackend;
    /// A fresh, empty shard name for the next check.
    fn fresh_shard(&self) -> String;
    /// Lets `ms` of the backend's time pass (a manual clock moves; a real
    /// server is waited for).
    fn pass_ms(&self, ms: u64);
    /// The shortest job lease the backend can be tested with, in ms.
    fn short_lease_ms(&self) -> u64 {
        shardq_core::job::JOB_LEASE_MS_MIN
    }
    /// The backend's flow control, opened with [`flow_settings`], for the
    /// checks that change policies while jobs run (none: they are skipped).
    fn flow(&self) -> Option<&shardq_core::flow::FlowControl> {
        None
    }
}

/// A harness whose store can be put back to an earlier state behind the
/// backend's back (a lagging replica promoted, a restore from an older
/// backup), for [`rewound_store_is_refused`].
pub trait RewindHarness: ContractHarness {
    /// Remembers the stored state of `shard` now.
    fn checkpoint(&self, shard: &str);
    /// Puts the stored state of `shard` back to the last checkpoint; the
    /// backend is not told.
    fn rewind(&self, shard: &str);
}

/// The name of every check on a [`ContractHarness`], in the order the
/// generated tests are written.
pub const CHECKS: &[&str] = crate::__contract_checks! { __contract_check_names () };

/// The name of every check on a [`RewindHarness`] only.
pub const REWIND_CHECKS: &[&str] = crate::__contract_rewind_checks! { __contract_check_names () };

/// What [`contract_tests!`](crate::contract_tests) runs after each check
/// when the caller gives nothing: nothing.
#[doc(hidden)]
pub fn nothing_after<H: ?Sized>(_harness: &H, _check: &str) {}

/// A job lease long enough never to lapse within one check.
const LONG_LEASE_MS: u64 = 600_000;

/// The retry rules every harness opens its backend with, for
/// [`a_keys_retry_rule_decides_its_wait`]: keys starting with
/// `contract-slow:` wait an hour after a failure, and the key
/// `contract-slow:fast` (its own rule beats the prefix) a millisecond.
pub fn retry_rules() -> shardq_core::retry::RetryRules {
    let fixed = |ms: u64| shardq_core::retry::RetryPolicy {
        max_attempts: 5,
        backoff: shardq_core::job::Backoff {
            base_ms: ms,
            max_ms: ms,
            kind: shardq_core::job::BackoffKind::Fixed,
            jitter_pct: 0,
        },
    };
    let mut r = shardq_core::retry::RetryRules::default();
    r.prefixes.insert("contract-slow:".into(), fixed(3_600_000));
    r.keys.insert("contract-slow:fast".into(), fixed(1));
    r
}

/// The flow settings every harness opens its backend with, for
/// [`rate_limits_hold_across_every_claim`]: keys starting with
/// `contract-rate:` start at most 10 a second (burst 2) each; keys starting
/// with `contract-grp:` share the group `contract-group`, 20 a second
/// (burst 3); keys starting with `contract-w1:`, `contract-w2:` and
/// `contract-w4:` have weights 1, 2 and 4, and `contract-vip:` priority 5;
/// keys starting with `contract-slot:` share the group `contract-slots`,
/// two runs at once; keys starting with `contract-c3:` run three at once.
pub fn flow_settings() -> shardq_core::flow::FlowSettings {
    use shardq_core::flow::{FlowPolicy, GroupLimit, Rate};
    let rate = |count: u64| Rate {
        count,
        per_ms: 1_000,
    };
    let mut f = shardq_core::flow::FlowSettings::default();
    f.prefixes.insert(
        "contract-rate:".into(),
        FlowPolicy {
            rate: Some(rate(10)),
            burst: Some(2),
            ..FlowPolicy::default()
        },
    );
    f.groups.insert(
        "contract-group".into(),
        GroupLimit {
            rate: Some(rate(20)),
            burst: Some(3),
            concurrency: None,
        },
    );
    f.groups.insert(
        "contract-slots".into(),
        GroupLimit {
            rate: None,
            burst: None,
            concurrency: Some(2),
        },
    );
    f.prefixes.insert(
        "contract-slot:".into(),
        FlowPolicy {
            group: Some("contract-slots".into()),
            ..FlowPolicy::default()
        },
    );
    for (prefix, weight) in [
        ("contract-w1:", 1),
        ("contract-w2:", 2),
        ("contract-w4:", 4),
    ] {
        f.prefixes.insert(
            prefix.into(),
            FlowPolicy {
                weight,
                ..FlowPolicy::default()
            },
        );
    }
    f.prefixes.insert(
        "contract-c3:".into(),
        FlowPolicy {
            concurrency: 3,
            ..FlowPolicy::default()
        },
    );
    f.prefixes.insert(
        "contract-c3r:".into(),
        FlowPolicy {
            concurrency: 3,
            rate: Some(rate(2)),
            burst: Some(2),
            ..FlowPolicy::default()
        },
    );
    f.prefixes.insert(
        "contract-vip:".into(),
        FlowPolicy {
            priority: 5,
            ..FlowPolicy::default()
        },
    );
    f.prefixes.insert(
        "contract-grp:".into(),
        FlowPolicy {
            group: Some("contract-group".into()),
            ..FlowPolicy::default()
        },
    );
    f
}

/// The window the dedup checks use (long enough never to lapse in a check).
const DEDUP_WINDOW_MS: u64 = 600_000;

fn enqueue_dedup(
    h: &dyn ContractHarness,
    shard: &str,
    jobs: &[(&str, &str)],
    window_ms: u64,
) -> Vec<shardq_core::job::Stored> {
    let jobs: Vec<NewJob> = jobs
        .iter()
        .map(|(k, d)| NewJob::new(*k, "p").with_dedup_id(*d))
        .collect();
    h.backend()
        .enqueue_dedup(shard, u64::MAX, &jobs, window_ms)
        .unwrap_or_else(|e| panic!("enqueue_dedup to {shard}: {e}"))
}

fn depth(h: &dyn ContractHarness, shard: &str, key: &str) -> u64 {
    h.backend()
        .key_counts(shard, key)
        .expect("key_counts")
        .depth
}

fn enqueue(h: &dyn ContractHarness, shard: &str, key: &str, payload: &str, attempts: u32) {
    let mut job = NewJob::new(key, payload);
    job.max_attempts = attempts;
    h.backend()
        .enqueue(shard, u64::MAX, &[job])
        .unwrap_or_else(|e| panic!("enqueue to {shard}: {e}"));
}

fn claim(h: &dyn ContractHarness, shard: &str, max: usize, lease_ms: u64) -> Vec<ClaimedJob> {
    h.backend()
        .claim(shard, max, lease_ms)
        .unwrap_or_else(|e| panic!("claim on {shard}: {e}"))
}

fn ack_one(h: &dyn ContractHarness, shard: &str, r: Receipt) {
    let out = h.backend().ack(shard, &[r]).expect("ack");
    assert_eq!(out.acked, 1, "the current run's ack must finish the job");
}
