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

/// A running schedule thread; stopped (and waited for, its pass finished
/// and recorded) when dropped.
pub struct ScheduleThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl ScheduleThread {
    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for ScheduleThread {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Deployment {
    /// Starts a thread that fires the schedules whose key routes to a shard
    /// in `owned()` until it is stopped; errors go to `on_error` (a log
    /// line), and the thread keeps going.
    pub fn spawn_scheduler(
        &self,
        owned: OwnedShards,
        on_error: Arc<dyn Fn(String) + Send + Sync>,
    ) -> Result<ScheduleThread, DeployError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let scheduler = Scheduler::new(
            self.queue(),
            self.maps(),
            SchedulerOptions {
                clock: self.clock(),
            },
        )?;
        let handle = std::thread::Builder::new()
            .name("shardq-schedules".into())
            .spawn(move || run_scheduler(scheduler, &*owned, &flag, &*on_error))
            .map_err(|e| DeployError::Io {
                context: "starting the schedule thread".into(),
                source: e,
            })?;
        Ok(ScheduleThread {
            stop,
            handle: Some(handle),
        })
    }
}
