//! Batches through a deployment: opening one, adding jobs to it, closing
//! it and reading it. The semantics are the core's
//! (`shardq_core::workflow`, `batch.rs`); the resolver that fires the
//! callbacks runs beside the schedules (`scheduler.rs`).

use shardq_core::job::NewJob;
use shardq_core::workflow::{NewBatch, Waiting, WaitingStore};

use crate::{DeployError, Deployment};

impl Deployment {
    /// Opens a batch: its number (`@N`) and whether it is a duplicate of
    /// one opened with the same dedup id on the same key.
    pub fn open_batch(&self, new: &NewBatch) -> Result<(u64, bool), DeployError> {
        self.refuse_without_retention("batch")?;
        let now = self.clock().now_ms();
        Ok(WaitingStore::open_batch(&*self.maps(), now, new)?)
    }

    /// Adds jobs to batch `n` in one compare-and-set: their numbers
    /// (`@m`), each with whether it was a duplicate. Each is enqueued on
    /// its key by the next resolver pass (a worker or an owning server
    /// runs them); this process's resolver, if any, is woken.
    pub fn add_to_batch(&self, n: u64, jobs: &[NewJob]) -> Result<Vec<(u64, bool)>, DeployError> {
        let now = self.clock().now_ms();
        let out = WaitingStore::add_to_batch(&*self.maps(), now, n, jobs)?;
        self.nudge_dependents();
        Ok(out)
    }

    /// Closes batch `n`; the record before the call.
    pub fn close_batch(&self, n: u64) -> Result<Waiting, DeployError> {
        let now = self.clock().now_ms();
        let before = WaitingStore::close_batch(&*self.maps(), n, now)?;
        self.nudge_dependents();
        Ok(before)
    }

    /// Batch `n`'s record (`None`: unknown, or not a batch), while it is
    /// pending and for a day after it completed.
    pub fn batch(&self, n: u64) -> Result<Option<Waiting>, DeployError> {
        Ok(WaitingStore::get(&*self.maps(), n)?.filter(|w| w.batch.is_some()))
    }
}
