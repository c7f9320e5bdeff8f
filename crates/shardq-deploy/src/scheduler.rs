//! The schedule thread a worker or a server runs beside its shards: the
//! core's `run_scheduler` over this deployment's backend and map store.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;

use shardq_core::schedule::{run_scheduler, Scheduler, SchedulerOptions};

use crate::{DeployError, Deployment};

/// The shards a process owns now, as its pool or owner thread reports them.
pub type OwnedShards = Arc<dyn Fn() -> BTreeSet<String> + Send + Sync>;

impl Deployment {
    /// Starts a thread that fires the schedules whose key routes to a shard
    /// in `owned()` until `stop`; errors go to `on_error` (a log line), and
    /// the thread keeps going.
    pub fn spawn_scheduler(
        &self,
        owned: OwnedShards,
        stop: Arc<AtomicBool>,
        on_error: Arc<dyn Fn(String) + Send + Sync>,
    ) -> Result<JoinHandle<()>, DeployError> {
        let scheduler = Scheduler::new(
            self.queue(),
            self.maps(),
            SchedulerOptions {
                clock: self.clock(),
            },
        )?;
        std::thread::Builder::new()
            .name("shardq-schedules".into())
            .spawn(move || run_scheduler(scheduler, &*owned, &stop, &*on_error))
            .map_err(|e| DeployError::Io {
                context: "starting the schedule thread".into(),
                source: e,
            })
    }
}
