//! Dependents through a deployment: adding them (each job dependency
//! looked up where it is, or where it went), reading and cancelling them,
//! and a key's waiting ones. The resolver runs beside the schedules
//! (`scheduler.rs`); the semantics are the core's (`shardq_core::workflow`).

use shardq_core::workflow::{NewDependent, WaitState, Waiting, WaitingStore};

use crate::{DeployError, Deployment, JobLookup};

/// Lookups of a dependency that is not found before it is refused ...
const UNKNOWN_LOOKUPS: u32 = 6;
/// ... and the gap between them (50 ms: 250 ms in all).
const UNKNOWN_LOOKUP_GAP_MS: u64 = 50;

/// A cancel of a job: the shard and id acted on, and the outcome.
pub type JobCancelled = (String, shardq_core::JobId, shardq_core::CancelOutcome);

impl Deployment {
    /// Adds dependents in one compare-and-set (see
    /// [`WaitingStore::add`]): their numbers (`@N`), each with whether it
    /// was a duplicate of one stored with its key's dedup id. A job
    /// dependency no shard knows is refused, naming it.
    pub fn add_dependents(&self, deps: &[NewDependent]) -> Result<Vec<(u64, bool)>, DeployError> {
        let mut lookup = |s: &str, id| -> Result<JobLookup, shardq_core::QueueError> {
            // A job acked a moment ago is neither live nor yet in its
            // shard's finished jobs (the line follows the ack's record):
            // an unknown id is looked up again for a short while before it
            // is refused.
            let mut tries = 0;
            loop {
                let found = self.find_job(s, id).map_err(|e| match e {
                    DeployError::Queue(q) => q,
                    other => shardq_core::QueueError::Internal {
                        what: other.to_string(),
                    },
                })?;
                tries += 1;
                if !matches!(found, JobLookup::Unknown) || tries >= UNKNOWN_LOOKUPS {
                    return Ok(found);
                }
                std::thread::sleep(std::time::Duration::from_millis(UNKNOWN_LOOKUP_GAP_MS));
            }
        };
        if !deps.is_empty() {
            self.refuse_without_retention("after")?;
        }
        let now = self.clock().now_ms();
        Ok(WaitingStore::add(&*self.maps(), &mut lookup, now, deps)?)
    }

    /// Refuses a dependent or a batch (`what` names the option) in a
    /// deployment that keeps no finished job: it could never see a job
    /// complete, so every one would be forgotten.
    pub(crate) fn refuse_without_retention(&self, what: &'static str) -> Result<(), DeployError> {
        if self.retention()?.finished_jobs == 0 {
            return Err(shardq_core::QueueError::InvalidOption {
                name: what,
                value: "a job that waits for others' ends".into(),
                allowed: "a deployment that keeps finished jobs: its retention keeps none (`shardq retention show`), so no job could be seen completing".into(),
            }
            .into());
        }
        Ok(())
    }

    /// Dependent `n`'s record, while it waits and for a day after it
    /// ended.
    pub fn dependent(&self, n: u64) -> Result<Option<Waiting>, DeployError> {
        Ok(WaitingStore::get(&*self.maps(), n)?)
    }

    /// Cancels dependent `n`: while it waits it ends as cancelled (its
    /// dependents see it fail); once released, its job is cancelled
    /// ([`Deployment::cancel_job`]). The record before the call (`None`:
    /// unknown) and, for a released one, the cancel of its job.
    pub fn cancel_dependent(
        &self,
        n: u64,
    ) -> Result<(Option<Waiting>, Option<JobCancelled>), DeployError> {
        let now = self.clock().now_ms();
        let before = WaitingStore::cancel(&*self.maps(), n, now)?;
        let job = match before.as_ref() {
            Some(w) if w.state == WaitState::Released => {
                match w
                    .released
                    .as_deref()
                    .map(shardq_core::workflow::parse_dependency)
                {
                    Some(Ok(shardq_core::workflow::DepRef::Job(s, id))) => {
                        Some(self.cancel_job(&s, id)?)
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        Ok((before, job))
    }

    /// Asks this process's resolver for a pass now: a job ended here
    /// (acked, failed, cancelled), which may let a dependent go. Ends in
    /// other processes are seen by the next periodic pass.
    pub fn nudge_dependents(&self) {
        self.dependents_wake.wake();
    }

    /// What [`Deployment::nudge_dependents`] wakes, for a caller that
    /// outlives a borrow (a pool's event hook).
    pub fn dependents_wake(&self) -> std::sync::Arc<shardq_core::workflow::Wake> {
        std::sync::Arc::clone(&self.dependents_wake)
    }

    /// The dependents of `key` still waiting, by number.
    pub fn waiting_of_key(&self, key: &str) -> Result<Vec<(u64, Waiting)>, DeployError> {
        Ok(WaitingStore::load(&*self.maps())?
            .jobs
            .into_iter()
            .filter(|(_, w)| w.key == key && w.state == WaitState::Waiting)
            .collect())
    }
}
