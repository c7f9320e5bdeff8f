//! Connections to one Redis instance or one Redis Cluster, with bounded
//! calls.
//!
//! A [`Node`] is shared by every shard that lives on it. It keeps a few idle
//! connections for reuse, reconnects after a dropped connection or a server
//! restart, and retries refused connections, timeouts, `TRYAGAIN`,
//! `CLUSTERDOWN` and `LOADING` with a growing wait, within
//! [`RETRY_ATTEMPTS_DEFAULT`] attempts and [`RETRY_BUDGET_MS_DEFAULT`] ms;
//! then the caller gets [`RedisError::Unreachable`] (`QueueError::Unavailable`)
//! naming the shard and the URL. Every step of a connection is bounded: the
//! TCP connect by [`CONNECT_TIMEOUT_MS`], the handshake (AUTH, SELECT, sent
//! here rather than by the client library so they run under the timeout) and
//! every reply by [`RESPONSE_TIMEOUT_MS`], so a stopped server (SIGSTOP, a
//! hung host) costs a bounded wait, never a hang. Each connection opened
//! checks `maxmemory-policy` once: a server that may evict keys is refused
//! ([`RedisError::Refused`]). An `OOM` refusal becomes [`RedisError::Full`].
//! MOVED and ASK are followed by the `redis` crate's cluster client. This
//! module must never retry without bound or hide which server failed.

use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::{ConnectionLike, ErrorKind, RedisResult};

use crate::error::RedisError;

/// Attempts per operation before giving up with [`RedisError::Unreachable`]
/// (also bounded in time by [`RETRY_BUDGET_MS_DEFAULT`]).
pub const RETRY_ATTEMPTS_DEFAULT: u32 = 40;
/// Longest time one operation keeps retrying, in ms (5 s): past it the
/// caller gets [`RedisError::Unreachable`] (`QueueError::Unavailable`). One
/// attempt in flight when the budget runs out still ends within its own
/// connect and response timeouts, so a call returns within about
/// budget + [`CONNECT_TIMEOUT_MS`] + [`RESPONSE_TIMEOUT_MS`].
pub const RETRY_BUDGET_MS_DEFAULT: u64 = 5_000;
/// First wait between attempts, in ms; doubles up to [`RETRY_WAIT_MS_MAX`].
pub const RETRY_WAIT_MS_MIN: u64 = 5;
/// Longest wait between attempts, in ms.
pub const RETRY_WAIT_MS_MAX: u64 = 200;
/// Time to establish one TCP connection, in ms (2 s).
pub const CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Longest wait for one reply, in ms (2 s), including the replies of the
/// connection handshake (AUTH, SELECT, the eviction-policy check). Scripts
/// are short (batches are bounded), so a reply slower than this means a
/// stuck server (stopped, swapping, or blocked by a slow command).
pub const RESPONSE_TIMEOUT_MS: u64 = 2_000;
/// Shortest connect or reply timeout a process may set, in ms.
pub const TIMEOUT_MS_MIN: u64 = 10;
/// Longest connect or reply timeout a process may set, in ms (1 min).
pub const TIMEOUT_MS_MAX: u64 = 60_000;
/// Longest retry budget a process may set, in ms (10 min); 0 makes one
/// attempt only.
pub const RETRY_BUDGET_MS_MAX: u64 = 600_000;
/// Idle connections kept per node for reuse.
pub const IDLE_CONNECTIONS_MAX: usize = 16;
/// Retries the cluster client makes itself (redirects, TRYAGAIN) before
/// handing the error to the retry loop here.
pub const CLUSTER_CLIENT_RETRIES: u32 = 8;
/// The only `maxmemory-policy` shardq accepts: any eviction policy may drop
/// a shard's keys (jobs, leases, the deployment record) without telling.
pub const REQUIRED_MAXMEMORY_POLICY: &str = "noeviction";

/// URL scheme of one standalone instance.
pub const SCHEME_INSTANCE: &str = "redis://";
/// URL scheme of a Redis Cluster named by seed nodes.
pub const SCHEME_CLUSTER: &str = "redis+cluster://";

/// Bounds of one node's calls.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) retry_attempts: u32,
    pub(crate) retry_budget_ms: u64,
    pub(crate) connect_timeout_ms: u64,
    pub(crate) response_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            retry_attempts: RETRY_ATTEMPTS_DEFAULT,
            retry_budget_ms: RETRY_BUDGET_MS_DEFAULT,
            connect_timeout_ms: CONNECT_TIMEOUT_MS,
            response_timeout_ms: RESPONSE_TIMEOUT_MS,
        }
    }
}

enum Endpoint {
    /// The client for the socket (no database, no credentials: the
    /// handshake is done here, under the response timeout), and the real
    /// database and credentials.
    Instance {
        client: redis::Client,
        db: i64,
        username: Option<String>,
        password: Option<String>,
    },
    Cluster {
        client: ClusterClient,
        seeds: Vec<String>,
    },
}

/// A live connection of either kind.
pub(crate) enum Conn {
    Instance(redis::Connection),
    Cluster(ClusterConnection),
}

impl Conn {
    pub(crate) fn like(&mut self) -> &mut dyn ConnectionLike {
        match self {
            Conn::Instance(c) => c,
            Conn::Cluster(c) => c,
        }
    }
}

/// One Redis instance or cluster, shared by the shards on it.
pub(crate) struct Node {
    /// The URL as shown: its password replaced by
    /// [`shardq_core::secret::MASK`].
    pub(crate) url: String,
    pub(crate) cluster: bool,
    endpoint: Endpoint,
    idle: Mutex<Vec<Conn>>,
    limits: Limits,
}

/// Why a connection could not be opened.
enum OpenError {
    /// May pass: retried.
    Transient(redis::RedisError),
    /// Will not pass by retrying (an evicting server, bad credentials).
    Fatal(String),
}

/// Splits `redis+cluster://h:p,h:p` into `redis://h:p` seed URLs.
pub(crate) fn cluster_seeds(url: &str) -> Result<Vec<String>, String> {
    let rest = url
        .strip_prefix(SCHEME_CLUSTER)
        .ok_or_else(|| format!("expected a URL starting with {SCHEME_CLUSTER}"))?;
    let rest = rest.trim_end_matches('/');
    let seeds: Vec<String> = rest
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| format!("{SCHEME_INSTANCE}{s}"))
        .collect();
    if seeds.is_empty() {
        return Err("no seed node given; expected redis+cluster://host:port,host:port".into());
    }
    Ok(seeds)
}

/// A client whose handshake sends nothing (database 0, no credentials), and
/// the database and credentials of `url`.
fn bare_client(url: &str) -> RedisResult<(redis::Client, i64, Option<String>, Option<String>)> {
    let mut info = redis::Client::open(url)?.get_connection_info().clone();
    let db = info.redis.db;
    let username = info.redis.username.take();
    let password = info.redis.password.take();
    info.redis.db = 0;
    Ok((redis::Client::open(info)?, db, username, password))
}

/// Opens one standalone connection with every step bounded: TCP connect
/// within the connect timeout, then AUTH, SELECT and the eviction-policy
/// check under the response timeout.
fn open_instance(
    url: &str,
    client: &redis::Client,
    db: i64,
    username: &Option<String>,
    password: &Option<String>,
    limits: &Limits,
) -> Result<redis::Connection, OpenError> {
    let mut c = client
        .get_connection_with_timeout(Duration::from_millis(limits.connect_timeout_ms))
        .map_err(OpenError::Transient)?;
    let rt = Some(Duration::from_millis(limits.response_timeout_ms));
    c.set_read_timeout(rt).map_err(OpenError::Transient)?;
    c.set_write_timeout(rt).map_err(OpenError::Transient)?;
    let fatal_or_transient = |e: redis::RedisError| {
        if transient(&e) {
            OpenError::Transient(e)
        } else {
            OpenError::Fatal(format!("{url}: {e}"))
        }
    };
    if let Some(pw) = password {
        let mut auth = redis::cmd("AUTH");
        if let Some(user) = username {
            auth.arg(user);
        }
        auth.arg(pw)
            .query::<()>(&mut c)
            .map_err(fatal_or_transient)?;
    }
    if db != 0 {
        redis::cmd("SELECT")
            .arg(db)
            .query::<()>(&mut c)
            .map_err(fatal_or_transient)?;
    }
    check_policy(url, &mut c)?;
    Ok(c)
}

/// Refuses a server whose `maxmemory-policy` may evict keys.
fn check_policy(url: &str, c: &mut redis::Connection) -> Result<(), OpenError> {
    let got: RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query(c);
    match got {
        Ok(v) => match v.get(1) {
            Some(p) if p == REQUIRED_MAXMEMORY_POLICY => Ok(()),
            Some(p) => Err(OpenError::Fatal(format!(
                "Redis at {url} has maxmemory-policy {p:?}, which may evict shardq's keys (jobs, \
                 leases, the deployment record) without notice; shardq needs \
                 {REQUIRED_MAXMEMORY_POLICY}: run `CONFIG SET maxmemory-policy \
                 {REQUIRED_MAXMEMORY_POLICY}` (and set it in redis.conf)"
            ))),
            None => Err(OpenError::Fatal(format!(
                "Redis at {url} answered CONFIG GET maxmemory-policy with {v:?}; cannot verify \
                 that it never evicts keys (shardq needs {REQUIRED_MAXMEMORY_POLICY})"
            ))),
        },
        Err(e) if transient(&e) => Err(OpenError::Transient(e)),
        Err(e) => Err(OpenError::Fatal(format!(
            "Redis at {url} refused CONFIG GET maxmemory-policy ({e}): the CONFIG command is \
             disabled or renamed, so shardq cannot verify that the server never evicts keys; \
             allow CONFIG for shardq's user, or check that maxmemory-policy is \
             {REQUIRED_MAXMEMORY_POLICY}"
        ))),
    }
}

impl Node {
    /// A node for `url`; does not connect yet. `shard` names the first shard
    /// using it, for errors.
    pub(crate) fn new(shard: &str, url: &str, limits: Limits) -> Result<Node, RedisError> {
        // Errors and messages show the URL without its password: the
        // credentials stay in the endpoint only.
        let shown = shardq_core::secret::redacted(url);
        let invalid = |reason: String| RedisError::InvalidUrl {
            shard: shard.to_string(),
            url: shown.clone(),
            reason: shardq_core::secret::redacted(&reason),
        };
        let limits = Limits {
            retry_attempts: limits.retry_attempts.max(1),
            connect_timeout_ms: limits.connect_timeout_ms.max(1),
            response_timeout_ms: limits.response_timeout_ms.max(1),
            ..limits
        };
        let (endpoint, cluster) = if url.starts_with(SCHEME_CLUSTER) {
            let seeds = cluster_seeds(url).map_err(invalid)?;
            for s in &seeds {
                bare_client(s).map_err(|e| invalid(e.to_string()))?;
            }
            let client = ClusterClient::builder(seeds.clone())
                .connection_timeout(Duration::from_millis(limits.connect_timeout_ms))
                .response_timeout(Duration::from_millis(limits.response_timeout_ms))
                .retries(CLUSTER_CLIENT_RETRIES)
                .min_retry_wait(RETRY_WAIT_MS_MIN)
                .max_retry_wait(RETRY_WAIT_MS_MAX)
                .build()
                .map_err(|e| invalid(e.to_string()))?;
            (Endpoint::Cluster { client, seeds }, true)
        } else if url.starts_with(SCHEME_INSTANCE) {
            let (client, db, username, password) =
                bare_client(url).map_err(|e| invalid(e.to_string()))?;
            (
                Endpoint::Instance {
                    client,
                    db,
                    username,
                    password,
                },
                false,
            )
        } else {
            return Err(invalid(format!(
                "expected {SCHEME_INSTANCE}host:port/db or {SCHEME_CLUSTER}host:port,host:port"
            )));
        };
        Ok(Node {
            url: shown,
            cluster,
            endpoint,
            idle: Mutex::new(Vec::new()),
            limits,
        })
    }

    /// Opens a connection; the eviction policy is checked once per
    /// connection opened (for a cluster: on every seed node reachable).
    fn connect(&self) -> Result<Conn, OpenError> {
        match &self.endpoint {
            Endpoint::Instance {
                client,
                db,
                username,
                password,
            } => open_instance(&self.url, client, *db, username, password, &self.limits)
                .map(Conn::Instance),
            Endpoint::Cluster { client, seeds } => {
                let mut checked = 0;
                let mut last = None;
                for seed in seeds {
                    let opened = bare_client(seed).map_err(OpenError::Transient).and_then(
                        |(c, db, u, p)| open_instance(seed, &c, db, &u, &p, &self.limits),
                    );
                    match opened {
                        Ok(_) => checked += 1,
                        Err(OpenError::Fatal(why)) => return Err(OpenError::Fatal(why)),
                        Err(OpenError::Transient(e)) => last = Some(e),
                    }
                }
                if checked == 0 {
                    if let Some(e) = last {
                        return Err(OpenError::Transient(e));
                    }
                }
                client
                    .get_connection()
                    .map(Conn::Cluster)
                    .map_err(OpenError::Transient)
            }
        }
    }

    fn take(&self) -> Result<Conn, OpenError> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match idle {
            Some(c) => Ok(c),
            None => self.connect(),
        }
    }

    fn give_back(&self, conn: Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < IDLE_CONNECTIONS_MAX {
            idle.push(conn);
        }
    }

    /// Runs `op` on a connection, retrying transient failures within the
    /// node's attempt and time budget. `op` gets the attempt number (0
    /// first): an attempt after a lost reply may follow one that the server
    /// did apply, and some operations recover from that.
    /// This node's time budget for one call, in ms.
    pub(crate) fn budget_ms(&self) -> u64 {
        self.limits.retry_budget_ms
    }

    pub(crate) fn run<T>(
        &self,
        shard: &str,
        op: impl FnMut(&mut dyn ConnectionLike, u32) -> RedisResult<T>,
    ) -> Result<T, RedisError> {
        self.run_within(shard, self.limits.retry_budget_ms, op)
    }

    /// [`Node::run`] with its own time budget, in ms (a lease renewal must
    /// give up before the lease it renews lapses).
    pub(crate) fn run_within<T>(
        &self,
        shard: &str,
        budget_ms: u64,
        mut op: impl FnMut(&mut dyn ConnectionLike, u32) -> RedisResult<T>,
    ) -> Result<T, RedisError> {
        let started = Instant::now();
        let budget = Duration::from_millis(budget_ms);
        let mut wait_ms = RETRY_WAIT_MS_MIN;
        let mut last = String::new();
        let mut attempts = 0;
        for attempt in 0..self.limits.retry_attempts {
            if attempt > 0 {
                if started.elapsed() + Duration::from_millis(wait_ms) >= budget {
                    break;
                }
                thread::sleep(Duration::from_millis(wait_ms));
                wait_ms = (wait_ms * 2).min(RETRY_WAIT_MS_MAX);
            }
            attempts += 1;
            let mut conn = match self.take() {
                Ok(c) => c,
                Err(OpenError::Transient(e)) => {
                    last = e.to_string();
                    continue;
                }
                Err(OpenError::Fatal(why)) => {
                    return Err(RedisError::Refused {
                        shard: shard.to_string(),
                        url: self.url.clone(),
                        reason: why,
                    })
                }
            };
            match op(conn.like(), attempt) {
                Ok(v) => {
                    self.give_back(conn);
                    return Ok(v);
                }
                Err(e) if transient(&e) => {
                    last = e.to_string();
                    // A server-side transient error leaves the connection
                    // usable; a broken socket does not.
                    if !(e.is_io_error() || e.is_connection_dropped() || e.is_timeout()) {
                        self.give_back(conn);
                    }
                }
                Err(e) => {
                    if !(e.is_io_error() || e.is_connection_dropped()) {
                        self.give_back(conn);
                    }
                    if e.code() == Some("OOM") {
                        return Err(RedisError::Full {
                            shard: shard.to_string(),
                            url: self.url.clone(),
                            cause: e.to_string(),
                        });
                    }
                    // A script's `CORRUPT record:` error (Redis puts the
                    // script's line before the text of an error raised
                    // inside a function).
                    if e.code() == Some("CORRUPT") || e.to_string().contains("CORRUPT record: ") {
                        return Err(RedisError::CorruptRecord {
                            shard: shard.to_string(),
                            url: self.url.clone(),
                            cause: e.to_string(),
                        });
                    }
                    return Err(RedisError::Command {
                        shard: shard.to_string(),
                        url: self.url.clone(),
                        cause: e.to_string(),
                    });
                }
            }
        }
        Err(RedisError::Unreachable {
            shard: shard.to_string(),
            url: self.url.clone(),
            attempts,
            elapsed_ms: started.elapsed().as_millis() as u64,
            cause: last,
        })
    }
}

/// Errors that a later attempt may not see: the network, a restarting
/// server, a cluster in the middle of moving a slot.
fn transient(e: &redis::RedisError) -> bool {
    if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() || e.is_timeout() {
        return true;
    }
    matches!(
        e.kind(),
        ErrorKind::TryAgain
            | ErrorKind::ClusterDown
            | ErrorKind::BusyLoadingError
            | ErrorKind::MasterDown
            | ErrorKind::Moved
            | ErrorKind::Ask
            | ErrorKind::ClusterConnectionNotFound
            | ErrorKind::ReadOnly
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_split_into_seeds() {
        assert_eq!(
            cluster_seeds("redis+cluster://127.0.0.1:7000,127.0.0.1:7001").unwrap(),
            ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]
        );
        assert!(cluster_seeds("redis+cluster://").is_err());
        assert!(cluster_seeds("redis://x").is_err());
    }
}
