//! Which shards this server runs: a dedicated thread ticks the deployment's
//! coordinator every `tick_interval_ms`, and within [`MAP_CHECK_MS`] of a
//! new published map (a shard added or removed, a rebalance's switch),
//! adopts gained shards
//! (`backend.adopt`) and releases lost ones (`backend.release`), and keeps
//! the set of adopted shards that claims poll. On stop it stops claiming,
//! releases every shard and gives up the leases. It must never claim,
//! ack or fail a job itself.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use shardq_core::{Coordinator, QueueBackend, QueueError};

/// How often the lease thread looks at the published map's version, in
/// ms: a new version makes it tick at once, so a shard added live is run
/// here within about this, not a whole tick interval later.
pub const MAP_CHECK_MS: u64 = 250;

/// The published map's version, read by the lease thread (`None` when the
/// map does not read: the next regular tick deals with it).
pub type MapVersion = Box<dyn FnMut() -> Option<u64> + Send>;

/// The shards adopted by this server, shared with the request handlers.
#[derive(Debug, Default)]
pub struct Owned {
    shards: RwLock<BTreeSet<String>>,
    stopping: AtomicBool,
    last_error: RwLock<Option<String>>,
}

impl Owned {
    /// The adopted shards, in name order.
    pub fn list(&self) -> Vec<String> {
        self.read().iter().cloned().collect()
    }

    /// True if this server runs `shard`.
    pub fn contains(&self, shard: &str) -> bool {
        self.read().contains(shard)
    }

    /// True once the server is shutting down: claims hand out nothing.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// The last coordinator error, if the last tick failed.
    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeSet<String>> {
        self.shards.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeSet<String>> {
        self.shards.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the server as shutting down.
    pub fn set_stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    fn set_error(&self, e: Option<String>) {
        *self.last_error.write().unwrap_or_else(|p| p.into_inner()) = e;
    }
}

/// The coordinator thread.
pub struct OwnerThread {
    owned: Arc<Owned>,
    stop_tx: Option<mpsc::Sender<()>>,
    handle: Option<JoinHandle<()>>,
}

impl OwnerThread {
    /// Starts ticking `coordinator`; the first tick runs before this returns,
    /// so shards free at start are owned by the time the server listens.
    pub fn start(
        mut coordinator: Box<dyn Coordinator>,
        backend: Arc<dyn QueueBackend>,
        mut map_version: MapVersion,
    ) -> OwnerThread {
        let owned = Arc::new(Owned::default());
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let mut unadopted: BTreeSet<String> = BTreeSet::new();
        let mut seen = map_version();
        tick(&mut *coordinator, &*backend, &owned, &mut unadopted);
        let o = Arc::clone(&owned);
        let handle = std::thread::Builder::new()
            .name("shardq-serve-leases".into())
            .spawn(move || {
                let interval = Duration::from_millis(coordinator.tick_interval_ms().max(1));
                let check = interval.min(Duration::from_millis(MAP_CHECK_MS));
                let mut last = std::time::Instant::now();
                while let Err(RecvTimeoutError::Timeout) = stop_rx.recv_timeout(check) {
                    let now = map_version();
                    let changed = now.is_some() && now != seen;
                    if changed || last.elapsed() >= interval {
                        if changed {
                            seen = now;
                        }
                        tick(&mut *coordinator, &*backend, &o, &mut unadopted);
                        last = std::time::Instant::now();
                    }
                }
                coordinator.stop_claiming();
                let shards: Vec<String> = std::mem::take(&mut *o.write()).into_iter().collect();
                for s in &shards {
                    if let Err(e) = backend.release(s) {
                        eprintln!("shardq serve: releasing shard {s:?}: {e}");
                    }
                }
                if let Err(e) = coordinator.release_all() {
                    eprintln!(
                        "shardq serve: giving up the shard leases: {e} (they lapse on their own)"
                    );
                }
            });
        let handle = match handle {
            Ok(h) => Some(h),
            Err(e) => {
                eprintln!("shardq serve: cannot start the lease thread: {e}; no shard is run");
                owned.write().clear();
                None
            }
        };
        OwnerThread {
            owned,
            stop_tx: Some(stop_tx),
            handle,
        }
    }

    /// The shared set of adopted shards.
    pub fn owned(&self) -> Arc<Owned> {
        Arc::clone(&self.owned)
    }

    /// Claims hand out nothing from now on (shutdown has begun).
    pub fn stop_claiming(&self) {
        self.owned.stopping.store(true, Ordering::SeqCst);
    }

    /// Releases every shard and the leases, and waits for the thread.
    pub fn stop(&mut self) {
        self.stop_claiming();
        self.stop_tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for OwnerThread {
    fn drop(&mut self) {
        self.stop();
    }
}

fn tick(
    coordinator: &mut dyn Coordinator,
    backend: &dyn QueueBackend,
    owned: &Owned,
    unadopted: &mut BTreeSet<String>,
) {
    let own = match coordinator.tick() {
        Ok(own) => own,
        Err(e) => {
            let msg = format!("lease tick: {e}");
            if matches!(e, QueueError::StoreLost(_)) {
                // Stop running anything on a store that lost its state.
                for s in std::mem::take(&mut *owned.write()) {
                    let _ = backend.release(&s);
                }
            }
            eprintln!("shardq serve: {msg}");
            owned.set_error(Some(msg));
            return;
        }
    };
    owned.set_error(None);
    for s in &own.lost {
        owned.write().remove(s);
        unadopted.remove(s);
        let _ = backend.release(s);
        eprintln!("shardq serve: lost shard {s:?} to another process");
    }
    let mut to_adopt: BTreeSet<String> = own.gained.iter().cloned().collect();
    to_adopt.extend(unadopted.iter().filter(|s| own.owned.contains(s)).cloned());
    unadopted.retain(|s| own.owned.contains(s));
    for s in to_adopt {
        match backend.adopt(&s) {
            Ok(()) => {
                unadopted.remove(&s);
                eprintln!("shardq serve: running shard {s:?}");
                owned.write().insert(s);
            }
            Err(e) => {
                eprintln!("shardq serve: adopting shard {s:?}: {e} (retried at the next tick)");
                unadopted.insert(s);
            }
        }
    }
    owned.write().retain(|s| own.owned.contains(s));
}
