//! [`RedisMapStore`]: the shard map kept in Redis, so producers and workers
//! on other hosts read the same map and its version; it is the
//! [`MapStore`] live resharding drives when shards live on Redis.
//!
//! Reserved keys, all in the deployment's `{=map:<ns>}` hashtag (one slot
//! in a cluster; [`crate::keys`]):
//!
//! * [`map_key`] hash (`version`, `yaml`): the published map. Publishing is
//!   compare-and-set on the version: two operators cannot overwrite each
//!   other's change.
//! * [`target_key`] string: the YAML of the map a pending rebalance must
//!   reach; absent when none is pending.
//! * [`settings_key`] hash: deployment settings by name (`retry`: the
//!   retry backoff as JSON).
//! * [`rebalance_lock_key`] string: the running rebalance's token
//!   (`host@pid#nonce`), taken with `SET NX PX` and renewed by a thread
//!   while held; a holder that dies frees it within [`REBALANCE_LOCK_MS`].
//! * [`rebalance_epoch_key`] string: a counter each rebalance `INCR`s
//!   under the lock for its epoch. A holder that only stalled past the
//!   lock's lease still holds its older epoch, which the shards refuse
//!   once the next holder entered them (`MoveKeys::enter_rebalance`).
//!
//! This module must never publish a map it has not validated, and never
//! release or extend a lock whose token is not its own.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use shardq_core::flow::{Bucket, GroupState, SlotAsk, GROUP_SLOT_RECHECK_MS};
use shardq_core::reshard::{MapStore, ReshardError};
use shardq_core::{GroupBuckets, GroupLimit, QueueError};
use shardq_route::ShardMap;

use crate::backend::RedisOptions;
use crate::conn::{Limits, Node};
use crate::error::RedisError;
use crate::keys::{
    group_bucket_key, group_slots_key, map_key, rebalance_epoch_key, rebalance_lock_key,
    settings_key, target_key, NAMESPACE_DEFAULT,
};
use crate::scripts::{reply, Scripts};

const STORE: &str = "map store";

/// Lifetime of the rebalance lock without renewal, in ms (10 s): how long a
/// killed coordinator of another host blocks the next `rebalance` and the
/// producers' lift of its orphaned fence (one of this host is seen dead
/// at once: [`crate::coord::holder_dead_here`]). A holder that only
/// stalls past it loses the lock and, by the epoch, every write it would
/// make after the next holder's ([`MapStore::rebalance_epoch`]).
pub const REBALANCE_LOCK_MS: u64 = 10_000;
/// Renewals per lock lifetime: a lock survives two missed renewals.
pub const REBALANCE_LOCK_RENEWALS: u64 = 3;

static LOCK_NONCE: AtomicU64 = AtomicU64::new(0);

/// The shard map stored in one Redis instance or cluster.
#[derive(Clone)]
pub struct RedisMapStore {
    node: Arc<Node>,
    scripts: Arc<Scripts>,
    map_key: String,
    target_key: String,
    lock_key: String,
    settings_key: String,
    namespace: String,
    /// The token of the rebalance lock this store holds, while it does.
    held: Arc<std::sync::Mutex<Option<String>>>,
    /// Set by the renewal thread when a renewal found the lock gone or
    /// another holder's: [`MapStore::check_lock`] then fails.
    lost: Arc<AtomicBool>,
}

impl RedisMapStore {
    /// A store at `url` (`redis://host:port/db` or
    /// `redis+cluster://host:port,...`) for the default namespace. Checks
    /// that the server answers and never evicts keys.
    pub fn open(url: &str) -> Result<RedisMapStore, RedisError> {
        RedisMapStore::open_in(url, NAMESPACE_DEFAULT, &RedisOptions::default())
    }

    /// [`RedisMapStore::open`] with `retry_attempts` per operation before
    /// the server is reported unreachable (default namespace).
    pub fn open_with(url: &str, retry_attempts: u32) -> Result<RedisMapStore, RedisError> {
        let opts = RedisOptions {
            retry_attempts,
            ..RedisOptions::default()
        };
        RedisMapStore::open_in(url, NAMESPACE_DEFAULT, &opts)
    }

    /// The map store of deployment namespace `namespace` at `url`, with the
    /// connection bounds of `options`.
    pub fn open_in(
        url: &str,
        namespace: &str,
        options: &RedisOptions,
    ) -> Result<RedisMapStore, RedisError> {
        crate::keys::validate_queue_name(namespace).map_err(|reason| RedisError::InvalidName {
            what: "namespace",
            name: namespace.to_string(),
            reason,
        })?;
        let limits: Limits = options.limits();
        let node = Node::new(STORE, url, limits)?;
        node.run(STORE, |con, _| redis::cmd("PING").query::<String>(con))?;
        Ok(RedisMapStore {
            node: Arc::new(node),
            scripts: Arc::new(Scripts::new()),
            map_key: map_key(namespace),
            target_key: target_key(namespace),
            lock_key: rebalance_lock_key(namespace),
            settings_key: settings_key(namespace),
            namespace: namespace.to_string(),
            held: Arc::default(),
            lost: Arc::default(),
        })
    }

    /// The token of the rebalance lock this store holds, or "" (then map
    /// writes check no lock).
    fn held_token(&self) -> String {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default()
    }

    fn lock_lost(&self, what: &str) -> RedisError {
        RedisError::LockLost {
            url: self.node.url.clone(),
            what: what.to_string(),
        }
    }

    fn lock_lost_reshard(&self, what: &str) -> ReshardError {
        store_err(self.lock_lost(what))
    }

    /// The URL of the store.
    pub fn url(&self) -> &str {
        &self.node.url
    }

    /// The published map, or `None` if none was published yet.
    pub fn load_map(&self) -> Result<Option<ShardMap>, RedisError> {
        let (version, yaml): (Option<u64>, Option<String>) = self.node.run(STORE, |con, _| {
            redis::cmd("HMGET")
                .arg(&self.map_key)
                .arg("version")
                .arg("yaml")
                .query(con)
        })?;
        let (Some(version), Some(yaml)) = (version, yaml) else {
            return Ok(None);
        };
        let map = ShardMap::from_yaml(&yaml).map_err(|e| RedisError::Map {
            url: self.node.url.clone(),
            reason: format!("stored map (version {version}) does not parse: {e}"),
        })?;
        if map.version != version {
            return Err(RedisError::Map {
                url: self.node.url.clone(),
                reason: format!(
                    "stored version field {version} differs from the map's own version {}",
                    map.version
                ),
            });
        }
        Ok(Some(map))
    }

    /// Publishes `map` if the stored version is `expected_version` (0: no map
    /// stored yet) and `map.version` is newer.
    pub fn publish_map(&self, map: &ShardMap, expected_version: u64) -> Result<(), RedisError> {
        map.validate().map_err(|e| RedisError::Map {
            url: self.node.url.clone(),
            reason: format!("refusing to publish an invalid map: {e}"),
        })?;
        let yaml = map.to_yaml();
        let keys = [self.map_key.clone(), self.lock_key.clone()];
        let token = self.held_token();
        let v = self.node.run(STORE, |con, _| {
            self.scripts.map_publish.call(con, &keys, &|c| {
                c.arg(expected_version)
                    .arg(map.version)
                    .arg(&yaml)
                    .arg(&token);
            })
        })?;
        let found = reply::items(&v).get(1).and_then(reply::u64).unwrap_or(0);
        match reply::status(&v).as_str() {
            "OK" => Ok(()),
            "CONFLICT" => Err(RedisError::VersionConflict {
                url: self.node.url.clone(),
                expected: expected_version,
                found,
            }),
            "LOCKLOST" => Err(self.lock_lost("publishing the map")),
            "STALE" => Err(RedisError::Map {
                url: self.node.url.clone(),
                reason: format!(
                    "map version {} is not newer than the stored version {found}; raise the version",
                    map.version
                ),
            }),
            other => Err(RedisError::Map {
                url: self.node.url.clone(),
                reason: format!("publish answered {other:?}"),
            }),
        }
    }
}

fn store_err(e: RedisError) -> ReshardError {
    match e {
        RedisError::VersionConflict {
            expected, found, ..
        } => ReshardError::Conflict { expected, found },
        e @ RedisError::Unreachable { .. } => ReshardError::Unavailable(e.to_string()),
        e @ RedisError::LockLost { .. } => ReshardError::LockLost {
            reason: e.to_string(),
        },
        other => ReshardError::store(other.kind(), other),
    }
}

/// The held rebalance lock: a thread renews it; drop stops the thread and
/// releases the lock if it is still ours.
struct LockGuard {
    stop: Option<mpsc::Sender<()>>,
    renewer: Option<thread::JoinHandle<()>>,
    node: Arc<Node>,
    scripts: Arc<Scripts>,
    token: String,
    lock_key: String,
    held: Arc<std::sync::Mutex<Option<String>>>,
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        {
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            if held.as_deref() == Some(self.token.as_str()) {
                *held = None;
            }
        }
        drop(self.stop.take());
        if let Some(h) = self.renewer.take() {
            let _ = h.join();
        }
        let keys = [self.lock_key.clone()];
        // Best effort: a lock we fail to release lapses on its own.
        let _ = self.node.run(STORE, |con, _| {
            self.scripts.lock_release.call(con, &keys, &|c| {
                c.arg(&self.token);
            })
        });
    }
}

impl RedisMapStore {
    /// Runs the group-bucket script on `group`'s bucket and slots: how many
    /// starts were taken, and when to ask again for the rest.
    fn group_bucket(
        &self,
        group: &str,
        limit: &GroupLimit,
        now_ms: u64,
        op: GroupOp<'_>,
    ) -> Result<(usize, u64), QueueError> {
        let keys = [
            group_bucket_key(&self.namespace, group),
            group_slots_key(&self.namespace, group),
        ];
        let rate = limit.bucket_rate();
        let v = self
            .node
            .run(STORE, |con, _| {
                self.scripts.group_bucket.call(con, &keys, &|c| {
                    c.arg(now_ms)
                        .arg(rate.count)
                        .arg(rate.per_ms)
                        .arg(limit.burst_or_default());
                    match op {
                        GroupOp::Hold(t) => {
                            c.arg("hold").arg(t);
                        }
                        GroupOp::Resume => {
                            c.arg("resume");
                        }
                        GroupOp::Take { n, asks } => {
                            let conc = limit.concurrency.filter(|_| !asks.is_empty());
                            // One claim's runs share their lease's end.
                            let lapse = asks.iter().map(|a| a.until_ms).max().unwrap_or(0);
                            c.arg("take")
                                .arg(conc.unwrap_or(0))
                                .arg(lapse)
                                .arg(GROUP_SLOT_RECHECK_MS)
                                .arg(n);
                            if conc.is_some() {
                                for a in asks {
                                    c.arg(a.holder);
                                }
                            }
                        }
                    }
                })
            })
            .map_err(|e| QueueError::store(e.kind(), e))?;
        let items = reply::items(&v);
        match reply::status(&v).as_str() {
            "OK" => Ok((
                items.get(1).and_then(reply::u64).unwrap_or(0) as usize,
                items.get(2).and_then(reply::u64).unwrap_or(now_ms + 1_000),
            )),
            other => Err(QueueError::Internal {
                what: format!("group {group:?}'s bucket answered {other:?}"),
            }),
        }
    }
}

/// What [`RedisMapStore::group_bucket`] does to a group.
#[derive(Clone, Copy)]
enum GroupOp<'a> {
    /// Takes `n` starts' tokens, and their run slots (`asks`, one per
    /// start) when the group limits runs and they are given.
    Take { n: usize, asks: &'a [SlotAsk<'a>] },
    /// Holds the bucket until then.
    Hold(u64),
    /// Lifts a hold.
    Resume,
}

/// Group buckets and run slots in the map store's Redis: a hash and a
/// sorted set per group, changed by one script per take, so every process
/// of the deployment, on any host, counts against the same limits.
impl GroupBuckets for RedisMapStore {
    fn take(
        &self,
        group: &str,
        limit: &GroupLimit,
        now_ms: u64,
        slot: Option<SlotAsk<'_>>,
    ) -> Result<Result<(), u64>, QueueError> {
        let asks = Vec::from_iter(slot);
        let one = GroupOp::Take { n: 1, asks: &asks };
        let (taken, at) = self.group_bucket(group, limit, now_ms, one)?;
        Ok(if taken == 1 { Ok(()) } else { Err(at) })
    }

    fn take_many(
        &self,
        group: &str,
        limit: &GroupLimit,
        now_ms: u64,
        asks: &[SlotAsk<'_>],
    ) -> Result<(usize, u64), QueueError> {
        if asks.is_empty() {
            return Ok((0, 0));
        }
        let all = GroupOp::Take {
            n: asks.len(),
            asks,
        };
        self.group_bucket(group, limit, now_ms, all)
    }

    fn hold(&self, group: &str, limit: &GroupLimit, until_ms: u64) -> Result<(), QueueError> {
        // Counted at the hold's own time: the bucket refills meanwhile.
        self.group_bucket(group, limit, 0, GroupOp::Hold(until_ms))
            .map(|_| ())
    }

    fn resume(&self, group: &str, limit: &GroupLimit) -> Result<(), QueueError> {
        // As a hold: counted at no time of its own (the bucket refills at
        // the next take).
        self.group_bucket(group, limit, 0, GroupOp::Resume)
            .map(|_| ())
    }

    fn free_slots(&self, group: &str, holders: &[&str]) -> Result<(), QueueError> {
        if holders.is_empty() {
            return Ok(());
        }
        let key = group_slots_key(&self.namespace, group);
        self.node
            .run(STORE, |con, _| {
                redis::cmd("ZREM").arg(&key).arg(holders).query::<()>(con)
            })
            .map_err(|e| QueueError::store(e.kind(), e))
    }

    fn renew_slots(&self, group: &str, holders: &[&str], until_ms: u64) -> Result<(), QueueError> {
        if holders.is_empty() {
            return Ok(());
        }
        let key = group_slots_key(&self.namespace, group);
        self.node
            .run(STORE, |con, _| {
                // Later only (GT); a lapsed one is taken again (the run is
                // current). Kept past the longest lease and a day.
                let mut p = redis::pipe();
                let z = p.cmd("ZADD").arg(&key).arg("GT");
                for h in holders {
                    z.arg(until_ms).arg(*h);
                }
                p.ignore()
                    .cmd("PEXPIRE")
                    .arg(&key)
                    .arg(shardq_core::job::JOB_LEASE_MS_MAX + 86_400_000)
                    .ignore();
                p.query::<()>(con)
            })
            .map_err(|e| QueueError::store(e.kind(), e))
    }

    fn peek(&self, group: &str) -> Result<Option<GroupState>, QueueError> {
        let key = group_bucket_key(&self.namespace, group);
        let slots_key = group_slots_key(&self.namespace, group);
        let (v, slots): (Vec<Option<u64>>, Vec<(String, u64)>) = self
            .node
            .run(STORE, |con, _| {
                redis::pipe()
                    .cmd("HMGET")
                    .arg(&key)
                    .arg(&["u", "at", "held", "c", "p"])
                    .cmd("ZRANGE")
                    .arg(&slots_key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(con)
            })
            .map_err(|e| QueueError::store(e.kind(), e))?;
        let slots = slots.into_iter().collect();
        Ok(match v.as_slice() {
            [Some(units), Some(at_ms), held, Some(count), Some(per_ms)] => Some(GroupState {
                slots,
                bucket: Bucket {
                    units: *units,
                    at_ms: *at_ms,
                    held_until_ms: held.unwrap_or(0),
                    count: *count,
                    per_ms: *per_ms,
                },
            }),
            _ => None,
        })
    }
}

impl MapStore for RedisMapStore {
    fn load(&self) -> Result<ShardMap, ReshardError> {
        self.load_map()
            .map_err(store_err)?
            .ok_or_else(|| ReshardError::NoMap {
                location: format!("Redis at {}", self.node.url),
            })
    }

    fn publish(&self, map: &ShardMap, expected_version: u64) -> Result<(), ReshardError> {
        map.validate()?;
        self.publish_map(map, expected_version).map_err(store_err)
    }

    fn load_target(&self) -> Result<Option<ShardMap>, ReshardError> {
        let yaml: Option<String> = self
            .node
            .run(STORE, |con, _| {
                redis::cmd("GET").arg(&self.target_key).query(con)
            })
            .map_err(store_err)?;
        match yaml {
            None => Ok(None),
            Some(y) => ShardMap::from_yaml(&y)
                .map(Some)
                .map_err(|e| ReshardError::BadTarget {
                    location: format!("Redis at {} ({})", self.node.url, self.target_key),
                    reason: e.to_string(),
                }),
        }
    }

    fn store_target(&self, target: &ShardMap) -> Result<(), ReshardError> {
        let yaml = target.to_yaml();
        let keys = [self.target_key.clone(), self.lock_key.clone()];
        let token = self.held_token();
        let v = self
            .node
            .run(STORE, |con, _| {
                self.scripts.target_set.call(con, &keys, &|c| {
                    c.arg(&yaml).arg(&token);
                })
            })
            .map_err(store_err)?;
        match reply::status(&v).as_str() {
            "OK" => Ok(()),
            _ => Err(self.lock_lost_reshard("recording the target")),
        }
    }

    /// Reads the target, compares it with `reached` here, and deletes it
    /// with a script that checks it still holds the very text read (and
    /// that the lock is still this store's).
    fn clear_target(&self, reached: &ShardMap) -> Result<bool, ReshardError> {
        let text: Option<String> = self
            .node
            .run(STORE, |con, _| {
                redis::cmd("GET").arg(&self.target_key).query(con)
            })
            .map_err(store_err)?;
        if let Some(t) = &text {
            match ShardMap::from_yaml(t) {
                Ok(pending) if shardq_core::reshard::same_target(&pending, reached) => {}
                _ => return Ok(false),
            }
        }
        let keys = [self.target_key.clone(), self.lock_key.clone()];
        let token = self.held_token();
        let v = self
            .node
            .run(STORE, |con, _| {
                self.scripts.target_clear.call(con, &keys, &|c| {
                    c.arg(text.as_deref().unwrap_or("")).arg(&token);
                })
            })
            .map_err(store_err)?;
        match reply::status(&v).as_str() {
            "OK" => Ok(true),
            "CHANGED" => Ok(false),
            _ => Err(self.lock_lost_reshard("clearing the target")),
        }
    }

    fn check_lock(&self) -> Result<(), ReshardError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(self.lock_lost_reshard("going on"));
        }
        Ok(())
    }

    fn load_setting(&self, name: &str) -> Result<Option<String>, ReshardError> {
        shardq_core::reshard::validate_setting_name(name)?;
        self.node
            .run(STORE, |con, _| {
                redis::cmd("HGET")
                    .arg(&self.settings_key)
                    .arg(name)
                    .query(con)
            })
            .map_err(store_err)
    }

    /// One script compares and writes. A retried call after a lost reply
    /// finds its own write and answers 0: the caller reads again, finds
    /// its change in place and writes nothing more.
    fn swap_setting(
        &self,
        name: &str,
        expected: Option<&str>,
        value: Option<&str>,
    ) -> Result<bool, ReshardError> {
        shardq_core::reshard::validate_setting_name(name)?;
        let keys = [self.settings_key.clone()];
        let v = self
            .node
            .run(STORE, |con, _| {
                self.scripts.setting_swap.call(con, &keys, &|c| {
                    c.arg(name)
                        .arg(if expected.is_some() { "1" } else { "0" })
                        .arg(expected.unwrap_or(""))
                        .arg(if value.is_some() { "1" } else { "0" })
                        .arg(value.unwrap_or(""));
                })
            })
            .map_err(store_err)?;
        Ok(reply::u64(&v) == Some(1))
    }

    fn rebalance_epoch(&self) -> Result<u64, ReshardError> {
        let token = self
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                ReshardError::Invalid("a rebalance epoch is taken under the rebalance lock".into())
            })?;
        // One script checks the lock is still ours and counts: a holder
        // stopped past its lease gets no epoch. A retried call after a lost
        // reply skips a number: harmless, epochs only need to grow.
        let keys = [self.lock_key.clone(), rebalance_epoch_key(&self.namespace)];
        let v = self
            .node
            .run(STORE, |con, _| {
                self.scripts.lock_epoch.call(con, &keys, &|c| {
                    c.arg(&token);
                })
            })
            .map_err(store_err)?;
        match (
            reply::status(&v).as_str(),
            reply::items(&v).get(1).and_then(reply::u64),
        ) {
            ("OK", Some(epoch)) => Ok(epoch),
            _ => Err(ReshardError::Busy {
                holder: format!(
                    "this rebalance's lock ({token}) lapsed and was taken over or freed"
                ),
            }),
        }
    }

    fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, ReshardError> {
        let token = format!(
            "{}#{}",
            crate::coord::default_owner(),
            LOCK_NONCE.fetch_add(1, Ordering::SeqCst)
        );
        // A retried SET after a lost reply finds our own token: that is ours.
        let take = || -> Result<Option<String>, ReshardError> {
            self.node
                .run(STORE, |con, _| {
                    redis::cmd("SET")
                        .arg(&self.lock_key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(REBALANCE_LOCK_MS)
                        .arg("GET")
                        .query(con)
                })
                .map_err(store_err)
        };
        let mut got = take()?;
        // A holder of this host that is gone (killed) frees its lock now,
        // not when its lease lapses: released only while it still holds
        // that dead token, then taken once more.
        if let Some(dead) = got
            .clone()
            .filter(|h| *h != token && crate::coord::holder_dead_here(h))
        {
            let keys = [self.lock_key.clone()];
            self.node
                .run(STORE, |con, _| {
                    self.scripts.lock_release.call(con, &keys, &|c| {
                        c.arg(&dead);
                    })
                })
                .map_err(store_err)?;
            got = take()?;
        }
        if let Some(holder) = got.filter(|h| *h != token) {
            let ttl: i64 = self
                .node
                .run(STORE, |con, _| {
                    redis::cmd("PTTL").arg(&self.lock_key).query(con)
                })
                .unwrap_or(-1);
            let holder = if ttl > 0 {
                format!("{holder}, lock lapses in {ttl} ms unless renewed")
            } else {
                holder
            };
            return Err(ReshardError::Busy { holder });
        }
        let (stop, stopped) = mpsc::channel::<()>();
        let node = Arc::clone(&self.node);
        let scripts = Arc::clone(&self.scripts);
        let renew_token = token.clone();
        let lock_key = self.lock_key.clone();
        let lost = Arc::clone(&self.lost);
        lost.store(false, Ordering::SeqCst);
        let every = Duration::from_millis(REBALANCE_LOCK_MS / REBALANCE_LOCK_RENEWALS);
        let renewer = thread::Builder::new()
            .name("shardq-rebalance-lock".into())
            .spawn(move || {
                let keys = [lock_key];
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    // A renewal that could not reach Redis is retried next
                    // period (the lock lapses only after two more misses);
                    // one that found the lock gone or another holder's
                    // marks it lost, and the rebalance stops at its next
                    // step (`check_lock`).
                    let renewed = node.run(STORE, |con, _| {
                        scripts.lock_renew.call(con, &keys, &|c| {
                            c.arg(&renew_token).arg(REBALANCE_LOCK_MS);
                        })
                    });
                    if let Ok(v) = renewed {
                        if reply::u64(&v) == Some(0) {
                            lost.store(true, Ordering::SeqCst);
                            break;
                        }
                    }
                }
            })
            .map_err(|e| ReshardError::io("starting the map lock's renewal thread", e))?;
        *self.held.lock().unwrap_or_else(|e| e.into_inner()) = Some(token.clone());
        Ok(Box::new(LockGuard {
            stop: Some(stop),
            renewer: Some(renewer),
            node: Arc::clone(&self.node),
            scripts: Arc::clone(&self.scripts),
            token,
            lock_key: self.lock_key.clone(),
            held: Arc::clone(&self.held),
        }))
    }
}
