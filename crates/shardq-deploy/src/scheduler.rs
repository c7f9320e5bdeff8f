//! The threads a worker or a server runs beside its shards: the core's
//! `run_scheduler` (schedules) and `run_resolver` (dependents) over this
//! deployment's backend and map store.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use shardq_core::schedule::{run_scheduler, Scheduler, SchedulerOptions};

use crate::{DeployError, Deployment};

/// The shards a process owns now, as its pool or owner thread reports them.
pub type OwnedShards = Arc<dyn Fn() -> BTreeSet<String> + Send + Sync>;

/// The running schedule and dependents threads; stopped (and waited for,
/// their passes finished and recorded) when dropped.
pub struct ScheduleThread {
    stop: Arc<AtomicBool>,
    passes: Arc<AtomicU64>,
    handles: Vec<JoinHandle<()>>,
}

impl ScheduleThread {
    /// The schedule thread's rounds ended so far: once it moved past a
    /// value read, every pass in flight at that read is over.
    pub fn passes(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.passes)
    }

    /// Stops the threads and waits for them.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for h in self.handles.drain(..) {
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
    /// in `owned()`, and one that resolves the deployment's dependents
    /// (every process resolves all of them: a release is deduplicated and
    /// outcomes are recorded by compare-and-set, so passes of several
    /// processes agree), until stopped; errors go to `on_error` (a log
    /// line), and the threads keep going.
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
        let spawn_err = |e| DeployError::Io {
            context: "starting the schedule and dependents threads".into(),
            source: e,
        };
        let resolver = shardq_core::workflow::Resolver::new(self.maps(), self.clock());
        let release =
            shardq_core::workflow::release_producer(self.queue(), self.maps(), self.clock())?;
        let (backend, flag2, on_error2) = (self.queue(), Arc::clone(&flag), Arc::clone(&on_error));
        let wake = self.dependents_wake();
        let passes = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&passes);
        let handle = std::thread::Builder::new()
            .name("shardq-schedules".into())
            .spawn(move || run_scheduler(scheduler, &*owned, &flag, &*on_error, &counted))
            .map_err(spawn_err)?;
        let mut thread = ScheduleThread {
            stop,
            passes,
            handles: vec![handle],
        };
        let resolving = std::thread::Builder::new()
            .name("shardq-dependents".into())
            .spawn(move || {
                shardq_core::workflow::run_resolver(
                    resolver,
                    backend,
                    release,
                    &flag2,
                    &*on_error2,
                    &wake,
                )
            })
            .map_err(spawn_err)?;
        thread.handles.push(resolving);
        Ok(thread)
    }
}
