//! Handler back-offs, bounded: a floor on how long one holds its key, and
//! a bound on how many a job may take in a row.
//!
//! A handler backs off ("my downstream limits me, retry in N ms") without
//! using an attempt ([`crate::RunJobs::back_off`]). Without bounds a
//! handler that always answers "back off 0" starts its key again at once,
//! forever, and its job never reaches the dead letters. So every back-off
//! holds its key at least [`BACKOFF_MS_MIN`], and [`BackOffs`] counts the
//! back-offs of each job in a row (in the process that runs it: the worker
//! pool and the server each keep one): past [`BACKOFFS_IN_A_ROW_MAX`] the
//! next back-off is a failed attempt instead, with a reason that says so,
//! so such a job ends in the dead letters once its attempts are spent.
//! A job's count ends with its run's ack or failure here; a job that ends
//! elsewhere (its key moved, another owner) leaves a count that the bound
//! on the table ([`BACKOFF_JOBS_TRACKED_MAX`]) clears.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::job::JobId;

/// Shortest a back-off holds its key (or group), in ms: a back-off asked
/// for less (0 included) holds it this long.
pub const BACKOFF_MS_MIN: u64 = 100;
/// Back-offs of one job in a row that a process takes; the next one is a
/// failed attempt.
pub const BACKOFFS_IN_A_ROW_MAX: u32 = 100;
/// Jobs whose back-offs a process counts at once; past it the counts start
/// over (a bound on memory, never on correctness: a count only turns
/// endless back-offs into failed attempts).
pub const BACKOFF_JOBS_TRACKED_MAX: usize = 65_536;

/// The back-off a handler's ask becomes: at least [`BACKOFF_MS_MIN`].
pub fn floored_ms(ms: u64) -> u64 {
    ms.max(BACKOFF_MS_MIN)
}

/// The back-offs in a row of each job this process ran.
#[derive(Debug, Default)]
pub struct BackOffs {
    counts: Mutex<HashMap<(String, JobId), u32>>,
}

impl BackOffs {
    /// Counts a back-off of `job` on `shard`: `Ok` while within the bound,
    /// or the reason of the failed attempt it becomes (and the count
    /// starts over).
    pub fn note(&self, shard: &str, job: JobId, ms: u64) -> Result<(), String> {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if counts.len() >= BACKOFF_JOBS_TRACKED_MAX {
            counts.clear();
        }
        let n = counts.entry((shard.to_string(), job)).or_insert(0);
        *n += 1;
        if *n > BACKOFFS_IN_A_ROW_MAX {
            counts.remove(&(shard.to_string(), job));
            return Err(format!(
                "the handler backed off {} times in a row (the last for {ms} ms) without \
                 finishing the job; counted as a failed attempt (at most \
                 {BACKOFFS_IN_A_ROW_MAX} back-offs in a row)",
                BACKOFFS_IN_A_ROW_MAX + 1
            ));
        }
        Ok(())
    }

    /// Ends `job`'s count: its run was acked or failed.
    pub fn ended(&self, shard: &str, job: JobId) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if !counts.is_empty() {
            counts.remove(&(shard.to_string(), job));
        }
    }

    /// [`BackOffs::ended`] of each of `jobs` on `shard`, under one lock.
    pub fn ended_all(&self, shard: &str, jobs: impl IntoIterator<Item = JobId>) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if counts.is_empty() {
            return;
        }
        for job in jobs {
            counts.remove(&(shard.to_string(), job));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_that_always_backs_off_fails_an_attempt_past_the_bound() {
        let b = BackOffs::default();
        for _ in 0..BACKOFFS_IN_A_ROW_MAX {
            b.note("s", JobId(1), 0).unwrap();
        }
        let why = b.note("s", JobId(1), 0).unwrap_err();
        assert!(
            why.contains("101 times in a row") && why.contains("0 ms"),
            "{why}"
        );
        // The count starts over, and is per job.
        b.note("s", JobId(1), 0).unwrap();
        b.note("s", JobId(2), 0).unwrap();
        for _ in 0..BACKOFFS_IN_A_ROW_MAX - 1 {
            b.note("s", JobId(2), 0).unwrap();
        }
        b.ended("s", JobId(2));
        b.note("s", JobId(2), 0).unwrap();
        // Ended together, as an ack ends its runs: each count starts over,
        // other shards' counts stay.
        for _ in 0..BACKOFFS_IN_A_ROW_MAX - 1 {
            b.note("s", JobId(1), 0).unwrap();
            b.note("t", JobId(1), 0).unwrap();
        }
        b.ended_all("s", [JobId(1), JobId(2)]);
        for _ in 0..BACKOFFS_IN_A_ROW_MAX - 1 {
            b.note("s", JobId(1), 0).unwrap();
        }
        b.note("t", JobId(1), 0).unwrap();
        assert!(b.note("t", JobId(1), 0).is_err(), "t's count was kept");
        assert_eq!(floored_ms(0), BACKOFF_MS_MIN);
        assert_eq!(floored_ms(5_000), 5_000);
    }
}
