//! `status`, for any deployment: every shard of the map, read one by one so
//! that a shard that cannot be read is reported on its row instead of
//! hiding the others. Plain data and one collector; it must never change
//! anything it reads.

use serde::Serialize;
use shardq_core::{QueueError, ShardStats};
use shardq_fs::StatusTotals;

/// The whole status: what `shardq status --json` prints and the server's
/// `GET /v1/status` returns.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct StatusReport {
    /// Per shard, in map order.
    pub shards: Vec<ShardRow>,
    /// Sums over the shards that could be read.
    pub totals: StatusTotals,
    /// Names of the shards that could not be read.
    pub failed: Vec<String>,
    /// Sums over the deployment's schedules; `None` when they could not
    /// be read.
    pub schedules: Option<shardq_core::schedule::ScheduleTotals>,
    /// The deployment's dependents (waiting now; released and failed, ever);
    /// `None` when they could not be read.
    pub dependents: Option<shardq_core::workflow::DependentTotals>,
}

/// One shard in `status`: counts are `None` when the shard could not be
/// read, and `error` says why.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ShardRow {
    /// Shard name.
    pub name: String,
    /// Pending jobs whose start time has come.
    pub ready: Option<u64>,
    /// Pending jobs waiting for their start time.
    pub delayed: Option<u64>,
    /// Runs in flight.
    pub in_flight: Option<u64>,
    /// Dead letters.
    pub dead: Option<u64>,
    /// Distinct keys with work.
    pub keys: Option<u64>,
    /// The largest run fence issued.
    pub fence_high: Option<u64>,
    /// The lease holder, if any.
    pub owner: Option<String>,
    /// When the holder's lease ends (ms since the epoch).
    pub lease_expires_ms: Option<u64>,
    /// Why the shard could not be read.
    pub error: Option<String>,
}

/// Owner and lease end of a shard.
pub type Lease = (Option<String>, Option<u64>);

/// Reads every shard in `names` with `stats` and `lease`; a failure of one
/// shard is recorded on its row and the next shard is read.
pub fn collect(
    names: &[String],
    stats: &dyn Fn(&str) -> Result<ShardStats, QueueError>,
    lease: &dyn Fn(&str) -> Result<Lease, QueueError>,
) -> StatusReport {
    let mut report = StatusReport {
        shards: Vec::with_capacity(names.len()),
        totals: StatusTotals::default(),
        failed: Vec::new(),
        schedules: None,
        dependents: None,
    };
    for name in names {
        let stats = stats(name);
        // A store that did not answer for the counts is not asked again for
        // the lease (each ask waits out its bounds); a damaged log still
        // has a readable lease.
        let unreachable = matches!(&stats, Err(e) if e.kind() == shardq_core::ErrorKind::Retryable);
        let (owner, lease_expires_ms, lease_err) = if unreachable {
            (None, None, None)
        } else {
            match lease(name) {
                Ok((o, l)) => (o, l, None),
                Err(e) => (None, None, Some(format!("reading the lease: {e}"))),
            }
        };
        let mut row = ShardRow {
            name: name.clone(),
            ready: None,
            delayed: None,
            in_flight: None,
            dead: None,
            keys: None,
            fence_high: None,
            owner,
            lease_expires_ms,
            error: lease_err,
        };
        match stats {
            Ok(st) => {
                report.totals.ready += st.ready;
                report.totals.delayed += st.delayed;
                report.totals.in_flight += st.in_flight;
                report.totals.dead += st.dead;
                row.ready = Some(st.ready);
                row.delayed = Some(st.delayed);
                row.in_flight = Some(st.in_flight);
                row.dead = Some(st.dead);
                row.keys = Some(st.keys);
                row.fence_high = Some(st.fence_high);
            }
            Err(e) => {
                row.error = Some(match row.error.take() {
                    None => e.to_string(),
                    Some(first) => format!("{e}; {first}"),
                })
            }
        }
        if row.error.is_some() {
            report.failed.push(name.clone());
        }
        report.shards.push(row);
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_shard_is_reported_on_its_row_and_the_others_count() {
        let names: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let r = collect(
            &names,
            &|n| {
                if n == "b" {
                    Err(QueueError::Unavailable {
                        shard: "b".into(),
                        reason: "no answer in 2000 ms".into(),
                    })
                } else {
                    Ok(ShardStats {
                        name: n.into(),
                        ready: 2,
                        ..ShardStats::default()
                    })
                }
            },
            &|_| Ok((None, None)),
        );
        assert_eq!(r.failed, ["b"]);
        assert_eq!(r.totals.ready, 4);
        assert!(r.shards[1].error.as_deref().unwrap().contains("2000 ms"));
        assert_eq!(r.shards[1].ready, None);
    }
}
