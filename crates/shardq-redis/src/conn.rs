//! Connections to one Redis instance or one Redis Cluster, with bounded
//! retries.
//!
//! A [`Node`] is shared by every shard that lives on it. It keeps a few idle
//! connections for reuse, reconnects after a dropped connection or a server
//! restart, and retries `TRYAGAIN`, `CLUSTERDOWN` and `LOADING` with a
//! bounded, growing wait; after [`RETRY_ATTEMPTS_DEFAULT`] attempts the
//! caller gets an error naming the shard and the URL. MOVED and ASK are
//! followed by the `redis` crate's cluster client. This module must never
//! retry forever or hide which server failed.

use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::{ConnectionLike, ErrorKind, RedisResult};

use crate::error::RedisError;

/// Attempts per operation before giving up with [`RedisError::Unreachable`].
pub const RETRY_ATTEMPTS_DEFAULT: u32 = 40;
/// First wait between attempts, in ms; doubles up to [`RETRY_WAIT_MS_MAX`].
pub const RETRY_WAIT_MS_MIN: u64 = 5;
/// Longest wait between attempts, in ms. With the defaults an unreachable
/// server is reported after about 7 s.
pub const RETRY_WAIT_MS_MAX: u64 = 200;
/// Time to establish one TCP connection, in ms.
pub const CONNECT_TIMEOUT_MS: u64 = 1_000;
/// Longest wait for one reply, in ms. Scripts are short (batches are
/// bounded), so a reply slower than this means a stuck server.
pub const RESPONSE_TIMEOUT_MS: u64 = 5_000;
/// Idle connections kept per node for reuse.
pub const IDLE_CONNECTIONS_MAX: usize = 16;
/// Retries the cluster client makes itself (redirects, TRYAGAIN) before
/// handing the error to the retry loop here.
pub const CLUSTER_CLIENT_RETRIES: u32 = 8;

/// URL scheme of one standalone instance.
pub const SCHEME_INSTANCE: &str = "redis://";
/// URL scheme of a Redis Cluster named by seed nodes.
pub const SCHEME_CLUSTER: &str = "redis+cluster://";

enum Endpoint {
    Instance(redis::Client),
    Cluster(ClusterClient),
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
    pub(crate) url: String,
    pub(crate) cluster: bool,
    endpoint: Endpoint,
    idle: Mutex<Vec<Conn>>,
    retry_attempts: u32,
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

impl Node {
    /// A node for `url`; does not connect yet. `shard` names the first shard
    /// using it, for errors.
    pub(crate) fn new(shard: &str, url: &str, retry_attempts: u32) -> Result<Node, RedisError> {
        let invalid = |reason: String| RedisError::InvalidUrl {
            shard: shard.to_string(),
            url: url.to_string(),
            reason,
        };
        let timeout = Duration::from_millis(CONNECT_TIMEOUT_MS);
        let (endpoint, cluster) = if url.starts_with(SCHEME_CLUSTER) {
            let seeds = cluster_seeds(url).map_err(invalid)?;
            let client = ClusterClient::builder(seeds)
                .connection_timeout(timeout)
                .response_timeout(Duration::from_millis(RESPONSE_TIMEOUT_MS))
                .retries(CLUSTER_CLIENT_RETRIES)
                .min_retry_wait(RETRY_WAIT_MS_MIN)
                .max_retry_wait(RETRY_WAIT_MS_MAX)
                .build()
                .map_err(|e| invalid(e.to_string()))?;
            (Endpoint::Cluster(client), true)
        } else if url.starts_with(SCHEME_INSTANCE) {
            let client = redis::Client::open(url).map_err(|e| invalid(e.to_string()))?;
            (Endpoint::Instance(client), false)
        } else {
            return Err(invalid(format!(
                "expected {SCHEME_INSTANCE}host:port/db or {SCHEME_CLUSTER}host:port,host:port"
            )));
        };
        Ok(Node {
            url: url.to_string(),
            cluster,
            endpoint,
            idle: Mutex::new(Vec::new()),
            retry_attempts: retry_attempts.max(1),
        })
    }

    fn connect(&self) -> RedisResult<Conn> {
        match &self.endpoint {
            Endpoint::Instance(client) => {
                let c = client
                    .get_connection_with_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))?;
                let rt = Some(Duration::from_millis(RESPONSE_TIMEOUT_MS));
                c.set_read_timeout(rt)?;
                c.set_write_timeout(rt)?;
                Ok(Conn::Instance(c))
            }
            Endpoint::Cluster(client) => Ok(Conn::Cluster(client.get_connection()?)),
        }
    }

    fn take(&self) -> RedisResult<Conn> {
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

    /// Runs `op` on a connection, retrying transient failures. `op` gets the
    /// attempt number (0 first): an attempt after a lost reply may follow one
    /// that the server did apply, and some operations recover from that.
    pub(crate) fn run<T>(
        &self,
        shard: &str,
        mut op: impl FnMut(&mut dyn ConnectionLike, u32) -> RedisResult<T>,
    ) -> Result<T, RedisError> {
        let mut wait_ms = RETRY_WAIT_MS_MIN;
        let mut last = String::new();
        for attempt in 0..self.retry_attempts {
            if attempt > 0 {
                thread::sleep(Duration::from_millis(wait_ms));
                wait_ms = (wait_ms * 2).min(RETRY_WAIT_MS_MAX);
            }
            let mut conn = match self.take() {
                Ok(c) => c,
                Err(e) => {
                    last = e.to_string();
                    continue;
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
            attempts: self.retry_attempts,
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
