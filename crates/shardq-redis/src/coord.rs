//! [`RedisCoordinator`]: shard leases kept in Redis, so worker processes on
//! different hosts (and with different data dirs) share one set of shards.
//!
//! Each shard has a lease hash (`owner` = `host@pid`, `token`, `until`). A
//! tick renews the leases this coordinator holds and takes free or lapsed
//! ones. Taking over raises the token; the backend's scripts refuse claims,
//! acks and fails that carry an older token, so a stale owner that wakes up
//! late cannot touch jobs its successor runs. The coordinator must never run
//! or move jobs itself.

use std::collections::BTreeMap;

use shardq_core::{Coordinator, Ownership, QueueError};

use crate::backend::RedisBackend;
use crate::error::RedisError;
use crate::scripts::reply;

/// Default shard lease, in ms (10 s): how long a vanished owner keeps its
/// shards before another process takes them over.
pub const LEASE_MS_DEFAULT: u64 = 10_000;
/// Shortest lease accepted, in ms; shorter ones would lapse between ticks.
pub const LEASE_MS_MIN: u64 = 50;
/// Ticks per lease period: a lease survives two missed ticks.
pub const TICKS_PER_LEASE: u64 = 3;

/// Options of [`RedisCoordinator::new`].
#[derive(Debug, Clone, Default)]
pub struct CoordinatorOptions {
    /// Owner name written into leases; `None` means `host@pid`.
    pub owner: Option<String>,
    /// Lease length in ms; 0 means [`LEASE_MS_DEFAULT`].
    pub lease_ms: u64,
    /// Shards to take part in; `None` means all of the backend's, including
    /// shards it learns later ([`RedisBackend::sync_shards`]).
    pub shards: Option<Vec<String>>,
    /// Most shards to hold at once; 0 means no limit.
    pub max_shards: usize,
}

/// Leases per shard, in Redis. See the module docs.
pub struct RedisCoordinator {
    backend: RedisBackend,
    owner: String,
    lease_ms: u64,
    /// A fixed list, or `None` to follow the backend's shards.
    shards: Option<Vec<String>>,
    max_shards: usize,
    claiming: bool,
    /// Shard -> fencing token, for the leases held.
    held: BTreeMap<String, u64>,
    /// Shard -> (owner, until) for leases others hold, or an error text.
    others: BTreeMap<String, String>,
}

/// `host@pid` of this process.
pub fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_string());
    format!("{host}@{}", std::process::id())
}

enum Lease {
    Held,
    Gained(u64),
    Other(String, u64),
    Free,
}

impl RedisCoordinator {
    /// A coordinator for `backend`'s shards. Grants go to `backend` (and its
    /// clones), which then may adopt the shards.
    pub fn new(
        backend: &RedisBackend,
        options: CoordinatorOptions,
    ) -> Result<RedisCoordinator, RedisError> {
        let all = shardq_core::QueueBackend::shard_names(backend);
        if let Some(list) = &options.shards {
            for s in list {
                if !all.contains(s) {
                    return Err(QueueError::UnknownShard { shard: s.clone() }.into());
                }
            }
        }
        let lease_ms = if options.lease_ms == 0 {
            LEASE_MS_DEFAULT
        } else {
            options.lease_ms.max(LEASE_MS_MIN)
        };
        Ok(RedisCoordinator {
            backend: backend.clone(),
            owner: options.owner.unwrap_or_else(default_owner),
            lease_ms,
            shards: options.shards,
            max_shards: if options.max_shards == 0 {
                usize::MAX
            } else {
                options.max_shards
            },
            claiming: true,
            held: BTreeMap::new(),
            others: BTreeMap::new(),
        })
    }

    /// The owner name this coordinator writes into leases.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The fencing token held for `shard`, if any.
    pub fn token(&self, shard: &str) -> Option<u64> {
        self.held.get(shard).copied()
    }

    fn lease_once(&self, shard: &str) -> Result<Lease, RedisError> {
        let s = self.backend.shard(shard)?;
        let mine = self.held.get(shard).copied().unwrap_or(0).to_string();
        // Past the limit this only renews what it holds and reports the rest.
        let claiming = if self.claiming && self.held.len() < self.max_shards {
            "1"
        } else {
            "0"
        };
        let v = s.node.run(&s.name, |con, _| {
            let now = self.backend.now_arg();
            self.backend
                .inner
                .scripts
                .lease
                .call(con, s.lease_key(), &|c| {
                    c.arg(&now)
                        .arg(&self.owner)
                        .arg(&mine)
                        .arg(self.lease_ms)
                        .arg(claiming);
                })
        })?;
        let it = reply::items(&v);
        let n = |i: usize| it.get(i).and_then(reply::u64).unwrap_or(0);
        Ok(match reply::status(&v).as_str() {
            "HELD" => Lease::Held,
            "GAINED" => Lease::Gained(n(1)),
            "OTHER" => Lease::Other(it.get(1).and_then(reply::string).unwrap_or_default(), n(2)),
            _ => Lease::Free,
        })
    }
}

impl Coordinator for RedisCoordinator {
    fn tick(&mut self) -> Result<Ownership, QueueError> {
        let mut own = Ownership::default();
        let mut first_err = None;
        let mut failures = 0;
        let shards = match &self.shards {
            Some(list) => list.clone(),
            None => shardq_core::QueueBackend::shard_names(&self.backend),
        };
        let total = shards.len();
        for shard in shards {
            match self.lease_once(&shard) {
                Ok(Lease::Held) => {}
                Ok(Lease::Gained(token)) => {
                    self.held.insert(shard.clone(), token);
                    self.backend.grant(&shard, token);
                    self.others.remove(&shard);
                    own.gained.push(shard.clone());
                }
                Ok(Lease::Other(owner, until)) => {
                    if self.held.remove(&shard).is_some() {
                        self.backend.revoke(&shard);
                        own.lost.push(shard.clone());
                    }
                    self.others
                        .insert(shard.clone(), format!("leased by {owner} until {until} ms"));
                }
                Ok(Lease::Free) => {
                    if self.held.remove(&shard).is_some() {
                        self.backend.revoke(&shard);
                        own.lost.push(shard.clone());
                    }
                    self.others.insert(
                        shard.clone(),
                        "free (this process stopped claiming or holds its limit)".into(),
                    );
                }
                Err(e) => {
                    // A lease that cannot be renewed is given up at once:
                    // another process may take it over when it lapses.
                    if self.held.remove(&shard).is_some() {
                        self.backend.revoke(&shard);
                        own.lost.push(shard.clone());
                    }
                    self.others
                        .insert(shard.clone(), format!("unreachable: {e}"));
                    failures += 1;
                    first_err.get_or_insert(e);
                }
            }
        }
        if failures == total && failures > 0 {
            if let Some(e) = first_err {
                return Err(e.into());
            }
        }
        own.owned = self.held.keys().cloned().collect();
        Ok(own)
    }

    fn stop_claiming(&mut self) {
        self.claiming = false;
    }

    fn release_all(&mut self) -> Result<(), QueueError> {
        let mut first_err: Option<QueueError> = None;
        for (shard, token) in std::mem::take(&mut self.held) {
            self.backend.revoke(&shard);
            let s = self.backend.shard(&shard)?;
            let token = token.to_string();
            let r = s.node.run(&s.name, |con, _| {
                self.backend
                    .inner
                    .scripts
                    .lease_release
                    .call(con, s.lease_key(), &|c| {
                        c.arg("").arg(&token);
                    })
            });
            if let Err(e) = r {
                first_err.get_or_insert(e.into());
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn tick_interval_ms(&self) -> u64 {
        (self.lease_ms / TICKS_PER_LEASE).max(1)
    }

    fn standby_reason(&self) -> String {
        if self.others.is_empty() {
            return format!("{} owns no shard yet", self.owner);
        }
        let parts: Vec<String> = self
            .others
            .iter()
            .map(|(s, why)| format!("{s}: {why}"))
            .collect();
        format!("{} owns no shard; {}", self.owner, parts.join("; "))
    }
}
