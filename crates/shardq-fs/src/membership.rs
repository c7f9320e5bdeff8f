//! [`FsCoordinator`]: leases in `membership.json` plus a flock on each owned
//! shard's `.lock`, implementing the [`Coordinator`] trait.
//!
//! A shard is claimed when it is unowned, or its lease lapsed more than the
//! clock-skew margin ago, *and* its `.lock` flock can be taken (so two live
//! processes on one host never own a shard together, even if one stalls past
//! its lease). All time comes from the [`Clock`]. This module must never run
//! or read jobs.
//!
//! Membership follows the published shard map: a shard that is no longer in
//! `shardmap.yaml` is dropped at the next tick (its entry is released and it
//! no longer counts toward `max_local_shards`), and never claimed, so a
//! shard added later is claimed by a process that is at its limit only
//! because it held a removed one. A shard in the map with a directory but
//! no entry yet gets one.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardq_core::backend::Ownership;
use shardq_core::{Clock, Coordinator, QueueError};

use crate::error::FsError;
use crate::layout::{self, MemberEntry, MembershipLock};
use crate::storage::{OsStorage, Storage};

/// Default lease (30 s).
pub const LEASE_MS_DEFAULT: u64 = 30_000;
/// Shortest lease allowed (100 ms).
pub const LEASE_MS_MIN: u64 = 100;
/// Default clock-skew margin added before a lapsed lease may be taken (1 s).
pub const CLOCK_SKEW_MS_DEFAULT: u64 = 1_000;
/// Default shards one process runs.
pub const MAX_LOCAL_SHARDS_DEFAULT: usize = 1;

/// Options of a [`FsCoordinator`].
#[derive(Debug, Clone)]
pub struct MemberOptions {
    /// This process's id in membership.json (default `host@pid`).
    pub member_id: String,
    /// Lease length; renewed every third of it.
    pub lease_ms: u64,
    /// Margin past a lease's end before taking the shard over.
    pub clock_skew_ms: u64,
    /// Most shards owned at once (`usize::MAX` for all).
    pub max_local_shards: usize,
}

impl Default for MemberOptions {
    fn default() -> Self {
        MemberOptions {
            member_id: default_member_id(),
            lease_ms: LEASE_MS_DEFAULT,
            clock_skew_ms: CLOCK_SKEW_MS_DEFAULT,
            max_local_shards: MAX_LOCAL_SHARDS_DEFAULT,
        }
    }
}

/// `host@pid`.
pub fn default_member_id() -> String {
    let uname = rustix::system::uname();
    let host = uname.nodename().to_string_lossy().into_owned();
    format!("{host}@{}", std::process::id())
}

/// See the module docs.
pub struct FsCoordinator {
    dir: PathBuf,
    opts: MemberOptions,
    clock: Arc<dyn Clock>,
    /// Where `membership.json` is written (tests inject a full disk).
    storage: Arc<dyn Storage>,
    claiming: bool,
    /// Owned shards and the flock on their `.lock`.
    owned: BTreeMap<String, File>,
    last_seen: BTreeMap<String, MemberEntry>,
}

impl std::fmt::Debug for FsCoordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsCoordinator")
            .field("member_id", &self.opts.member_id)
            .field("owned", &self.owned.keys().collect::<Vec<_>>())
            .finish()
    }
}

fn q(e: FsError) -> QueueError {
    match e {
        FsError::Queue(q) => q,
        other => QueueError::store(other.kind(), other),
    }
}

impl FsCoordinator {
    /// A coordinator for data dir `dir`.
    pub fn new(
        dir: &Path,
        opts: MemberOptions,
        clock: Arc<dyn Clock>,
    ) -> Result<FsCoordinator, FsError> {
        if opts.lease_ms < LEASE_MS_MIN {
            return Err(FsError::InvalidOption {
                name: "lease_ms",
                value: opts.lease_ms.to_string(),
                reason: format!("must be at least {LEASE_MS_MIN}"),
            });
        }
        if opts.max_local_shards == 0 {
            return Err(FsError::InvalidOption {
                name: "max_local_shards",
                value: "0".into(),
                reason: "must be at least 1, or `all`".into(),
            });
        }
        Ok(FsCoordinator {
            dir: dir.to_path_buf(),
            opts,
            clock,
            storage: Arc::new(OsStorage),
            claiming: true,
            owned: BTreeMap::new(),
            last_seen: BTreeMap::new(),
        })
    }

    /// Writes `membership.json` through `storage` (the engine's, so that
    /// tests can fail its writes as a full disk would).
    pub fn with_storage(mut self, storage: Arc<dyn Storage>) -> FsCoordinator {
        self.storage = storage;
        self
    }

    /// Shards owned now.
    pub fn owned(&self) -> Vec<String> {
        self.owned.keys().cloned().collect()
    }

    /// Test helper for crash simulation: forgets every claim without
    /// touching membership.json, as a killed process would (its flocks go).
    pub fn abandon(&mut self) {
        self.owned.clear();
    }

    fn tick_inner(&mut self) -> Result<Ownership, FsError> {
        let _lock = MembershipLock::acquire(&self.dir)?;
        let mut m = layout::read_membership_with(&*self.storage, &self.dir)?;
        let in_map: BTreeSet<String> = layout::read_map(&self.dir)?
            .shards
            .into_iter()
            .map(|s| s.name)
            .collect();
        let now = self.clock.now_ms();
        let me = self.opts.member_id.clone();
        let mut out = Ownership::default();
        for name in &in_map {
            if !m.shards.contains_key(name) && self.dir.join(name).is_dir() {
                m.shards.insert(name.clone(), MemberEntry::default());
            }
        }

        // Renew what is still ours; drop what someone else took, and what
        // the map no longer has (releasing its entry).
        let owned: Vec<String> = self.owned.keys().cloned().collect();
        for shard in owned {
            match m.shards.get_mut(&shard) {
                Some(e) if e.owner.as_deref() == Some(me.as_str()) && !in_map.contains(&shard) => {
                    e.owner = None;
                    e.lease_expires_ms = 0;
                    self.owned.remove(&shard);
                    out.lost.push(shard);
                }
                Some(e) if e.owner.as_deref() == Some(me.as_str()) => {
                    e.lease_expires_ms = now + self.opts.lease_ms;
                }
                _ => {
                    self.owned.remove(&shard);
                    out.lost.push(shard);
                }
            }
        }

        if self.claiming {
            let names: Vec<String> = m
                .shards
                .keys()
                .filter(|n| in_map.contains(*n))
                .cloned()
                .collect();
            for shard in names {
                if self.owned.len() >= self.opts.max_local_shards {
                    break;
                }
                if self.owned.contains_key(&shard) {
                    continue;
                }
                let e = m.shards.get_mut(&shard).expect("listed");
                let free = match &e.owner {
                    None => true,
                    Some(o) if *o == me => true,
                    Some(_) => now > e.lease_expires_ms.saturating_add(self.opts.clock_skew_ms),
                };
                if !free {
                    continue;
                }
                let Some(lock) = layout::try_lock_shard(&self.dir, &shard)? else {
                    // Its owner is alive on this host though its lease lapsed.
                    continue;
                };
                e.owner = Some(me.clone());
                e.lease_expires_ms = now + self.opts.lease_ms;
                e.epoch += 1;
                self.owned.insert(shard.clone(), lock);
                out.gained.push(shard);
            }
        }
        layout::write_membership_with(&*self.storage, &self.dir, &m)?;
        self.last_seen = m
            .shards
            .into_iter()
            .filter(|(n, _)| in_map.contains(n))
            .collect();
        out.owned = self.owned.keys().cloned().collect();
        Ok(out)
    }
}

impl Coordinator for FsCoordinator {
    fn tick(&mut self) -> Result<Ownership, QueueError> {
        self.tick_inner().map_err(q)
    }

    fn stop_claiming(&mut self) {
        self.claiming = false;
    }

    fn release_all(&mut self) -> Result<(), QueueError> {
        if self.owned.is_empty() {
            return Ok(());
        }
        let result = (|| {
            let _lock = MembershipLock::acquire(&self.dir)?;
            let mut m = layout::read_membership_with(&*self.storage, &self.dir)?;
            for shard in self.owned.keys() {
                if let Some(e) = m.shards.get_mut(shard) {
                    if e.owner.as_deref() == Some(self.opts.member_id.as_str()) {
                        e.owner = None;
                        e.lease_expires_ms = 0;
                    }
                }
            }
            layout::write_membership_with(&*self.storage, &self.dir, &m)
        })();
        self.owned.clear();
        result.map_err(q)
    }

    fn tick_interval_ms(&self) -> u64 {
        (self.opts.lease_ms / 3).max(1)
    }

    fn max_shards(&self) -> usize {
        self.opts.max_local_shards
    }

    fn standby_reason(&self) -> String {
        let now = self.clock.now_ms();
        let owners: Vec<String> = self
            .last_seen
            .iter()
            .map(|(s, e)| match &e.owner {
                Some(o) => format!(
                    "{s} owned by {o} (lease ends in {} ms)",
                    e.lease_expires_ms as i64 - now as i64
                ),
                None => format!("{s} unowned"),
            })
            .collect();
        format!(
            "this process owns no shards (max_local_shards {}): {}; polling every {} ms for lapsed leases",
            if self.opts.max_local_shards == usize::MAX {
                "all".to_string()
            } else {
                self.opts.max_local_shards.to_string()
            },
            owners.join(", "),
            self.tick_interval_ms()
        )
    }
}
