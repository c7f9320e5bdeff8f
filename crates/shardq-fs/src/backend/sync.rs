//! Durability: the group-commit `Syncer` of each shard, `sync_shard`, and the
//! `interval` flusher thread.

use super::*;

pub(super) struct Syncer {
    pub(super) synced_to: Mutex<u64>,
    pub(super) latest: Mutex<Option<(u64, Arc<dyn LogFile>)>>,
    pub(super) last_sync_ms: Mutex<u64>,
    /// Set by a failed fsync: later syncs fail without trying (the kernel
    /// may have dropped the dirty pages; a retry that succeeds proves
    /// nothing).
    pub(super) failed: AtomicBool,
}

/// The `interval` flusher thread; dropping the sender wakes it to exit.
pub(super) struct Flusher {
    pub(super) stop: Option<mpsc::Sender<()>>,
    pub(super) thread: Option<JoinHandle<()>>,
}

impl Drop for Flusher {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            // It holds no lock of ours while waiting, and only a weak
            // reference to the shards, so this returns within one fsync.
            let _ = t.join();
        }
    }
}

/// Makes the shard's appends up to at least `end` durable; threads share one
/// fsync (group commit: whoever syncs covers every write before it).
pub(super) fn sync_shard(shard: &Shard, end: u64, clock: &dyn Clock) -> Result<(), QueueError> {
    let mut synced = lock(&shard.sync.synced_to);
    if *synced >= end {
        return Ok(());
    }
    if shard.sync.failed.load(Ordering::Acquire) {
        return Err(QueueError::Poisoned {
            shard: shard.name.clone(),
            cause: "an earlier fsync failed; reopen the shard".into(),
        });
    }
    let Some((target, file)) = lock(&shard.sync.latest).clone() else {
        return Ok(());
    };
    if let Err(e) = file.sync() {
        shard.sync.failed.store(true, Ordering::Release);
        let err = QueueError::io(format!("fsync of shard {:?}", shard.name), e);
        drop(synced);
        return Err(lock(&shard.inner).log.poison(err));
    }
    *synced = target;
    *lock(&shard.sync.last_sync_ms) = clock.now_ms();
    Ok(())
}

/// Starts the `interval` flusher: every `period_ms` it fsyncs each shard with
/// appends not yet synced, so an idle tail is durable within about one
/// period. It exits when the backend is dropped (the stop channel closes, or
/// the weak reference no longer upgrades).
pub(super) fn spawn_flusher(
    shards: Weak<Shards>,
    clock: Arc<dyn Clock>,
    period_ms: u64,
) -> Result<Flusher, QueueError> {
    let (stop, wake) = mpsc::channel::<()>();
    let period = Duration::from_millis(period_ms);
    let thread = std::thread::Builder::new()
        .name("shardq-flusher".into())
        .spawn(move || loop {
            match wake.recv_timeout(period) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            }
            let Some(map) = shards.upgrade() else { return };
            let list: Vec<Arc<Shard>> = map
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .cloned()
                .collect();
            drop(map);
            for shard in list {
                let end = lock(&shard.sync.latest).as_ref().map_or(0, |(e, _)| *e);
                // A failure poisons the shard; its next operation reports it.
                let _ = sync_shard(&shard, end, &*clock);
            }
        })
        .map_err(|e| QueueError::io("starting the interval flusher thread".to_string(), e))?;
    Ok(Flusher {
        stop: Some(stop),
        thread: Some(thread),
    })
}
