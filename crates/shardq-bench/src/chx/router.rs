//! shardq's library routers as a harness target: a "queue" is a shard of a
//! [`ShardMap`], and sending a message is routing its key. No I/O.
//!
//! Changing the queue set rebuilds the map from the new name list, which is
//! exactly what publishing a new shard-map version does.

use shardq_route::{Algorithm, Router, ShardMap};

use super::{Observer, Target};
use crate::error::ChxError;

/// Keys routed between two progress reports; keeps the observer cheap.
const PROGRESS_EVERY: u64 = 4096;

/// One shardq algorithm with the default hash and vnodes.
#[derive(Debug)]
pub struct RouterTarget {
    algorithm: Algorithm,
    router: Option<Router>,
}

impl RouterTarget {
    /// A target routing with `algorithm`.
    pub fn new(algorithm: Algorithm) -> RouterTarget {
        RouterTarget {
            algorithm,
            router: None,
        }
    }

    fn router(&self) -> &Router {
        // begin() always runs first; a missing router is a harness bug.
        self.router.as_ref().expect("begin() builds the router")
    }
}

impl Target for RouterTarget {
    fn system(&self) -> &str {
        self.algorithm.name()
    }

    fn version(&self) -> String {
        format!("shardq-route {}", env!("CARGO_PKG_VERSION"))
    }

    fn begin(&mut self, _experiment: &str, queues: &[String]) -> Result<(), ChxError> {
        self.set_queues(queues)
    }

    fn set_queues(&mut self, queues: &[String]) -> Result<(), ChxError> {
        let map = ShardMap::with_shards(self.algorithm, queues.iter().cloned())?;
        self.router = Some(Router::new(map)?);
        Ok(())
    }

    fn count(
        &mut self,
        keys: &mut dyn Iterator<Item = String>,
        _total: u64,
        obs: &mut dyn Observer,
    ) -> Result<Vec<u64>, ChxError> {
        let router = self.router();
        let mut counts = vec![0u64; router.map().shards.len()];
        let mut pending = 0;
        for key in keys {
            counts[router.route_index(key.as_bytes())] += 1;
            pending += 1;
            if pending == PROGRESS_EVERY {
                obs.advance(pending);
                pending = 0;
            }
        }
        obs.advance(pending);
        Ok(counts)
    }

    fn place(&mut self, keys: &[String], obs: &mut dyn Observer) -> Result<Vec<usize>, ChxError> {
        let router = self.router();
        let placed = keys
            .iter()
            .map(|k| router.route_index(k.as_bytes()))
            .collect();
        obs.advance(keys.len() as u64);
        Ok(placed)
    }

    fn end(&mut self) -> Result<(), ChxError> {
        self.router = None;
        Ok(())
    }
}
