//! Helpers shared by the integration tests: maps over test servers, and a
//! small worker that owns shards through a coordinator.

use std::collections::BTreeMap;
use std::sync::Arc;

use shardq_core::{ClaimedJob, Clock, Coordinator, ManualClock, NewJob, RunJobs};
use shardq_redis::{
    init_deployment, CoordinatorOptions, Deployment, RedisBackend, RedisCoordinator, RedisOptions,
};
use shardq_route::{Algorithm, Shard, ShardMap};

/// A map of `(name, url)` shards, version 1.
pub fn map_of(shards: &[(&str, String)]) -> ShardMap {
    let mut map = ShardMap::with_shards(Algorithm::Rendezvous, shards.iter().map(|s| s.0))
        .expect("valid map");
    for (s, (_, url)) in map.shards.iter_mut().zip(shards) {
        *s = Shard {
            url: Some(url.clone()),
            ..s.clone()
        };
    }
    map
}

/// Initialises a deployment in the default namespace for `map` (its map
/// store on the first shard's server), as `shardq init` would.
pub fn init(map: &ShardMap) -> Deployment {
    let url = map.shards[0].url.clone().expect("a shard url");
    init_deployment(
        map,
        &url,
        Some(shardq_redis::keys::NAMESPACE_DEFAULT),
        &RedisOptions::default(),
    )
    .expect("init deployment")
}

/// Options on a manual clock.
pub fn opts_manual(clock: &ManualClock) -> RedisOptions {
    RedisOptions {
        clock: Some(Arc::new(clock.clone()) as Arc<dyn Clock>),
        ..RedisOptions::default()
    }
}

/// Options on a manual clock with flow control of `settings`, its group
/// buckets in the map store at `store_url` (as a deployment has them).
pub fn opts_with_flow(
    clock: &ManualClock,
    settings: shardq_core::flow::FlowSettings,
    store_url: &str,
) -> RedisOptions {
    let store = shardq_redis::RedisMapStore::open(store_url).expect("map store");
    RedisOptions {
        flow: Some(Arc::new(shardq_core::FlowControl::new(
            settings,
            Arc::new(store),
        ))),
        ..opts_manual(clock)
    }
}

/// Flow settings that let every key run `n` jobs at once.
pub fn concurrency_settings(n: u32) -> shardq_core::flow::FlowSettings {
    shardq_core::flow::FlowSettings {
        default: shardq_core::flow::FlowPolicy {
            concurrency: n,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A coordinator that owns every shard it can, adopting what it gains.
pub fn owner(backend: &RedisBackend, name: &str, lease_ms: u64) -> RedisCoordinator {
    let mut c = RedisCoordinator::new(
        backend,
        CoordinatorOptions {
            owner: Some(name.to_string()),
            lease_ms,
            shards: None,
            max_shards: 0,
        },
    )
    .expect("coordinator");
    tick_adopt(backend, &mut c);
    c
}

/// One tick; adopts what was gained. Returns the shards owned.
pub fn tick_adopt(backend: &RedisBackend, c: &mut RedisCoordinator) -> Vec<String> {
    let own = c.tick().expect("tick");
    for s in &own.gained {
        backend.adopt(s).expect("adopt");
    }
    own.owned
}

pub fn job(key: &str, payload: &str) -> NewJob {
    NewJob::new(key, payload.as_bytes().to_vec())
}

pub fn payloads(jobs: &[ClaimedJob]) -> Vec<String> {
    let mut v: Vec<String> = jobs
        .iter()
        .map(|j| String::from_utf8_lossy(&j.payload).into_owned())
        .collect();
    v.sort();
    v
}

/// Checks that, per key, the first run of each sequence number comes in
/// increasing order and that every expected sequence number ran. Payloads
/// are `<key>/<seq>`. Returns the number of repeated runs.
pub fn check_order(runs: &[String], expected: &BTreeMap<String, u64>) -> usize {
    let mut seen: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut repeats = 0;
    for r in runs {
        let (k, n) = r.rsplit_once('/').expect("payload key/seq");
        let n: u64 = n.parse().expect("seq");
        let list = seen.entry(k.to_string()).or_default();
        if list.contains(&n) {
            repeats += 1;
            continue;
        }
        if let Some(&last) = list.last() {
            assert!(n > last, "key {k}: job {n} started after job {last}");
        }
        list.push(n);
    }
    for (k, &count) in expected {
        let got = seen.get(k).map(Vec::len).unwrap_or(0) as u64;
        assert_eq!(got, count, "key {k}: {got} of {count} jobs ran");
    }
    repeats
}
