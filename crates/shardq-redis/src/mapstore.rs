//! [`RedisMapStore`]: the shard map kept in Redis, so producers and workers
//! on other hosts read the same map and its version.
//!
//! The map lives under the reserved key [`crate::keys::MAP_KEY`] as a hash
//! (`version`, `yaml`). Publishing is compare-and-set on the version: two
//! operators cannot overwrite each other's change. This module must never
//! publish a map it has not validated.

use shardq_route::ShardMap;

use crate::conn::{Node, RETRY_ATTEMPTS_DEFAULT};
use crate::error::RedisError;
use crate::keys::MAP_KEY;
use crate::scripts::{reply, Lua, Scripts};

const STORE: &str = "map store";

/// The shard map stored in one Redis instance or cluster.
pub struct RedisMapStore {
    node: Node,
    publish: Lua,
}

impl RedisMapStore {
    /// A store at `url` (`redis://host:port/db` or
    /// `redis+cluster://host:port,...`). Checks that the server answers.
    pub fn open(url: &str) -> Result<RedisMapStore, RedisError> {
        let node = Node::new(STORE, url, RETRY_ATTEMPTS_DEFAULT)?;
        node.run(STORE, |con, _| redis::cmd("PING").query::<String>(con))?;
        Ok(RedisMapStore {
            node,
            publish: Scripts::new().map_publish,
        })
    }

    /// The URL of the store.
    pub fn url(&self) -> &str {
        &self.node.url
    }

    /// The published map, or `None` if none was published yet.
    pub fn load_map(&self) -> Result<Option<ShardMap>, RedisError> {
        let (version, yaml): (Option<u64>, Option<String>) = self.node.run(STORE, |con, _| {
            redis::cmd("HMGET")
                .arg(MAP_KEY)
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
        let keys = [MAP_KEY.to_string()];
        let v = self.node.run(STORE, |con, _| {
            self.publish.call(con, &keys, &|c| {
                c.arg(expected_version).arg(map.version).arg(&yaml);
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
