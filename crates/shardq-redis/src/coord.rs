//! [`RedisCoordinator`]: shard leases kept in Redis, so worker processes on
//! different hosts (and with different data dirs) share one set of shards.
//!
//! Each shard has a lease hash (`owner` = `host@pid`, `token`, `until`). A
//! tick renews the leases this coordinator holds and takes free or lapsed
//! ones. A token is `<owner>#<epoch>#<n>`: the epoch is random per
//! coordinator, so no two holders ever carry the same token, even after the
//! store lost or rewound its leases (FLUSHALL, a restart from an old
//! snapshot). A renewal whose token is not the stored one fails and the
//! shard is reported lost; the backend's scripts refuse claims, acks, fails
//! and extends that carry any other token, so a stale owner that wakes up
//! late cannot touch jobs its successor runs. A shard whose deployment
//! record is gone makes the tick fail with [`QueueError::StoreLost`]. Every
//! lease call is bounded by the tick interval, so one hung server cannot
//! hold up the renewal of the others. The coordinator must never run or
//! move jobs itself.

use std::collections::BTreeMap;

use shardq_core::{Coordinator, Ownership, QueueError};

use crate::backend::RedisBackend;
use crate::error::RedisError;
use crate::keys;
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
    /// Random per coordinator: makes its tokens unique across store restarts.
    epoch: String,
    /// Tokens issued so far (the `<n>` of the next token).
    issued: u64,
    /// Shard -> lease token, for the leases held.
    held: BTreeMap<String, String>,
    /// Shard -> (owner, until) for leases others hold, or an error text.
    others: BTreeMap<String, String>,
}

/// This host's name, as lock and lease tokens carry it.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_string())
}

/// `host@pid` of this process.
pub fn default_owner() -> String {
    format!("{}@{}", host_name(), std::process::id())
}

/// Whether a lock token (`host@pid#nonce`, as [`default_owner`] starts
/// it) names a process of this host that is gone: no `/proc/<pid>`, or a
/// zombie. Only where `/proc` shows this host's processes (Linux); a
/// token of another host, of this process, or one that does not parse is
/// never called dead, so the lock then lapses by its lease alone. A pid
/// reused by a new process reads as alive: the lease decides, as before.
pub fn holder_dead_here(token: &str) -> bool {
    let Some((host, rest)) = token.split_once('@') else {
        return false;
    };
    let Some(pid) = rest.split('#').next().and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    if host != host_name() || pid == std::process::id() || pid == 0 {
        return false;
    }
    if !std::path::Path::new("/proc/self/stat").exists() {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => match stat.rfind(')') {
            Some(i) => matches!(stat[i + 1..].trim_start().chars().next(), Some('Z' | 'X')),
            None => false,
        },
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

enum Lease {
    Held,
    Gained(String),
    Other(String, u64),
    /// Our token is not the stored one: the lease was taken over, or the
    /// store lost or rewound it.
    Stale(String, u64),
    /// The shard's deployment record is gone.
    Lost(QueueError),
    Free,
}

/// 16 random bytes as hex, from the kernel (`/dev/urandom`).
pub(crate) fn random_hex() -> Result<String, RedisError> {
    use std::io::Read;
    let mut buf = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(|e| {
            RedisError::Queue(QueueError::io("reading random bytes from /dev/urandom", e))
        })?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

impl RedisCoordinator {
    /// A coordinator for `backend`'s shards. Grants go to `backend` (and its
    /// clones), which then may adopt the shards.
    pub fn new(
        backend: &RedisBackend,
        options: CoordinatorOptions,
    ) -> Result<RedisCoordinator, RedisError> {
        let all = shardq_core::RunJobs::shard_names(backend);
        if let Some(list) = &options.shards {
            for s in list {
                if !all.contains(s) {
                    return Err(QueueError::UnknownShard { shard: s.clone() }.into());
                }
            }
        }
        // A script reads a token starting with `@` as a rebalance's epoch.
        if let Some(owner) = options.owner.as_deref().filter(|o| o.starts_with('@')) {
            return Err(QueueError::InvalidOption {
                name: "owner",
                value: format!("{owner:?}"),
                allowed: "a name not starting with '@'".into(),
            }
            .into());
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
            epoch: random_hex()?,
            issued: 0,
            held: BTreeMap::new(),
            others: BTreeMap::new(),
        })
    }

    /// The owner name this coordinator writes into leases.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The lease token held for `shard`, if any.
    pub fn token(&self, shard: &str) -> Option<&str> {
        self.held.get(shard).map(String::as_str)
    }

    fn lease_once(&mut self, shard: &str) -> Result<Lease, RedisError> {
        let s = self.backend.shard(shard)?;
        let mine = self.held.get(shard).cloned().unwrap_or_default();
        let fresh = if mine.is_empty() {
            self.issued += 1;
            format!("{}#{}#{}", self.owner, self.epoch, self.issued)
        } else {
            String::new()
        };
        let dep = self.backend.lease_args();
        let keys = [s.keys[keys::LEASE_PART].clone(), s.keys[0].clone()];
        // Past the limit this only renews what it holds and reports the rest.
        let claiming = if self.claiming && self.held.len() < self.max_shards {
            "1"
        } else {
            "0"
        };
        // Bounded by the tick interval: a renewal that cannot finish before
        // the next tick is reported, and the other shards are renewed.
        let budget = self.tick_interval_ms();
        let v = s.node.run_within(&s.name, budget, |con, _| {
            let now = self.backend.now_arg();
            self.backend.inner.scripts.lease.call(con, &keys, &|c| {
                c.arg(&now)
                    .arg(&self.owner)
                    .arg(&mine)
                    .arg(self.lease_ms)
                    .arg(claiming)
                    .arg(&dep)
                    .arg(&fresh);
            })
        })?;
        let it = reply::items(&v);
        let n = |i: usize| it.get(i).and_then(reply::u64).unwrap_or(0);
        Ok(match reply::status(&v).as_str() {
            "HELD" => Lease::Held,
            "GAINED" => Lease::Gained(it.get(1).and_then(reply::string).unwrap_or_default()),
            "OTHER" => Lease::Other(it.get(1).and_then(reply::string).unwrap_or_default(), n(2)),
            "STALE" => Lease::Stale(it.get(1).and_then(reply::string).unwrap_or_default(), n(2)),
            "LOST" => {
                let found = it.get(1).and_then(reply::string).unwrap_or_default();
                Lease::Lost(RedisBackend::lost(&s, &dep, &found))
            }
            _ => Lease::Free,
        })
    }
}

impl Coordinator for RedisCoordinator {
    fn tick(&mut self) -> Result<Ownership, QueueError> {
        let mut own = Ownership::default();
        let mut first_err = None;
        let mut lost_store: Option<QueueError> = None;
        let mut failures = 0;
        let shards = match &self.shards {
            Some(list) => list.clone(),
            None => shardq_core::RunJobs::shard_names(&self.backend),
        };
        let total = shards.len();
        for shard in shards {
            match self.lease_once(&shard) {
                Ok(Lease::Held) => {}
                Ok(Lease::Gained(token)) => {
                    self.backend.grant(&shard, &token);
                    self.held.insert(shard.clone(), token);
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
                Ok(Lease::Stale(owner, until)) => {
                    self.held.remove(&shard);
                    self.backend.revoke(&shard);
                    own.lost.push(shard.clone());
                    let who = if owner.is_empty() {
                        "nobody (the store lost or rewound the lease)".to_string()
                    } else {
                        format!("{owner} until {until} ms")
                    };
                    self.others
                        .insert(shard.clone(), format!("lease lost: now held by {who}"));
                }
                Ok(Lease::Lost(e)) => {
                    if self.held.remove(&shard).is_some() {
                        self.backend.revoke(&shard);
                        own.lost.push(shard.clone());
                    }
                    self.others.insert(shard.clone(), e.to_string());
                    lost_store.get_or_insert(e);
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
        // A store that lost its state stops the worker: running the other
        // shards on would hide it. The lost shards are revoked already.
        if let Some(e) = lost_store {
            return Err(e);
        }
        // Every renewal failed: an error, but only when no shard was given
        // up in this tick. An error means nothing changed, so the shards
        // revoked above must be reported lost (their handlers stop); the
        // next tick, owning nothing, reports the error.
        if failures == total && failures > 0 && own.lost.is_empty() {
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

    fn max_shards(&self) -> usize {
        self.max_shards
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
