//! Turning what a user types into maps and URLs: the version-1 map of
//! `init`, `--redis` instance lists and `--redis-cluster` seeds. Pure
//! parsing; it must never open a connection or a file.

use shardq_redis::{SCHEME_CLUSTER, SCHEME_INSTANCE};
use shardq_route::{Algorithm, HashFn, ShardMap};

use crate::error::{invalid, DeployError};

/// Most shards `init` creates.
pub const INIT_SHARDS_MAX: usize = shardq_route::map::SHARDS_MAX;

/// The version-1 map `init` creates: `shard-0`..`shard-(N-1)`.
pub fn init_map(
    shards: usize,
    algorithm: &str,
    hash: Option<&str>,
) -> Result<ShardMap, DeployError> {
    if shards == 0 || shards > INIT_SHARDS_MAX {
        invalid!("invalid --shards {shards}: must be 1..={INIT_SHARDS_MAX}");
    }
    let algorithm: Algorithm = algorithm
        .parse()
        .map_err(|e| DeployError::Invalid(format!("invalid --algorithm {algorithm:?}: {e}")))?;
    let names: Vec<String> = (0..shards).map(|i| format!("shard-{i}")).collect();
    let mut map = ShardMap::with_shards(algorithm, names)?;
    if let Some(h) = hash {
        map.hash = h
            .parse::<HashFn>()
            .map_err(|e| DeployError::Invalid(format!("invalid --hash {h:?}: {e}")))?;
        map.validate()?;
    }
    Ok(map)
}

/// Turns `--redis` values into shard URLs: a comma-separated list of
/// `redis://host:port[/db]` (or `host:port`), each kept as one instance.
pub fn instance_urls(spec: &str) -> Result<Vec<String>, DeployError> {
    let mut urls = Vec::new();
    for s in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if s.starts_with(SCHEME_CLUSTER) {
            invalid!("--redis {s:?}: a cluster URL; use --redis-cluster for a Redis Cluster");
        }
        if s.starts_with(SCHEME_INSTANCE) {
            urls.push(s.to_string());
        } else if s.contains("://") {
            invalid!("--redis {s:?}: expected redis://host:port/db");
        } else {
            urls.push(format!("{SCHEME_INSTANCE}{s}"));
        }
    }
    if urls.is_empty() {
        invalid!("--redis {spec:?}: no URL given; expected redis://host:port/db,...");
    }
    Ok(urls)
}

/// Turns `--redis-cluster` seeds (`redis://h:p,h:p`, `h:p,...` or
/// `redis+cluster://h:p,...`) into one `redis+cluster://h:p,...` URL.
pub fn cluster_url(spec: &str) -> Result<String, DeployError> {
    let rest = spec.strip_prefix(SCHEME_CLUSTER).unwrap_or(spec);
    let mut seeds = Vec::new();
    for s in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let s = s.strip_prefix(SCHEME_INSTANCE).unwrap_or(s);
        if s.contains("://") {
            invalid!("--redis-cluster {spec:?}: seed {s:?} is not host:port");
        }
        // A cluster has one database: drop a `/0`.
        seeds.push(s.split('/').next().unwrap_or(s).to_string());
    }
    if seeds.is_empty() {
        invalid!("--redis-cluster {spec:?}: no seed node given; expected redis://host:port,...");
    }
    Ok(format!("{SCHEME_CLUSTER}{}", seeds.join(",")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_specs() {
        assert_eq!(
            instance_urls("redis://127.0.0.1:7001/0, 127.0.0.1:7002").unwrap(),
            ["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002"]
        );
        assert!(instance_urls("").is_err());
        assert!(instance_urls("redis+cluster://127.0.0.1:7000").is_err());
        assert!(instance_urls("http://x").is_err());
        assert_eq!(
            cluster_url("redis://127.0.0.1:7000/0,127.0.0.1:7001").unwrap(),
            "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"
        );
        assert_eq!(
            cluster_url("redis+cluster://127.0.0.1:7000").unwrap(),
            "redis+cluster://127.0.0.1:7000"
        );
        assert!(cluster_url(",").is_err());
    }

    #[test]
    fn init_maps_name_bad_values() {
        assert_eq!(init_map(3, "ring", None).unwrap().shards.len(), 3);
        let e = init_map(0, "ring", None).unwrap_err().to_string();
        assert!(e.contains("--shards 0"), "{e}");
        let e = init_map(2, "circle", None).unwrap_err().to_string();
        assert!(e.contains("\"circle\""), "{e}");
        let e = init_map(2, "ring", Some("md5")).unwrap_err().to_string();
        assert!(e.contains("\"md5\""), "{e}");
    }
}
