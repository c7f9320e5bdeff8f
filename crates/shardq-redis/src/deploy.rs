//! Deployments: what `init` writes so that every later process can tell its
//! own store from a lost, rewound or foreign one.
//!
//! [`init_deployment`] picks a random deployment id and a namespace (given,
//! or `d<12 hex digits of the id>`), writes the deployment record
//! ([`keys::deployment_key`]: `id`, `layout`, `created_ms`) next to the
//! shard map and, on every Redis shard of the map, the shard's own record
//! (`meta.dep`, `meta.layout`). It refuses a namespace whose record or
//! shard keys exist already, naming the server and the key, so init never
//! writes over another deployment or over a store that only lost part of
//! its state. [`RedisBackend::open`](crate::RedisBackend::open) and every
//! script check the shard records afterwards. This module must never delete
//! or overwrite a key it did not create.

use shardq_core::QueueError;
use shardq_route::ShardMap;

use crate::backend::{is_redis_url, RedisOptions};
use crate::conn::Node;
use crate::coord::random_hex;
use crate::error::RedisError;
use crate::keys::{self, LAYOUT_VERSION};
use crate::scripts::{reply, Scripts};

/// A deployment's identity, as [`init_deployment`] wrote it. The caller
/// keeps both (the binary in its data dir) and passes them back in
/// [`RedisOptions::namespace`] and [`RedisOptions::deployment`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deployment {
    /// Random id (32 hex digits).
    pub id: String,
    /// Namespace of every key of the deployment.
    pub namespace: String,
    /// Key layout version ([`LAYOUT_VERSION`]).
    pub layout: u32,
}

const STORE: &str = "deployment record";

/// Initialises a new deployment for `map`: the deployment record on the map
/// store at `map_url` and the record of every Redis shard of `map`.
/// `namespace` is the caller's choice or `None` for one derived from the
/// new id; `options` gives the queue and the connection bounds (its
/// `namespace` and `deployment` are ignored). Refuses, before writing
/// anything, a namespace that has a record or any shard key already.
pub fn init_deployment(
    map: &ShardMap,
    map_url: &str,
    namespace: Option<&str>,
    options: &RedisOptions,
) -> Result<Deployment, RedisError> {
    let id = random_hex()?;
    let namespace = match namespace {
        Some(n) => n.to_string(),
        None => format!("d{}", &id[..12]),
    };
    let opts = RedisOptions {
        namespace: namespace.clone(),
        deployment: Some(id.clone()),
        ..options.clone()
    };
    opts.validate()?;
    let scripts = Scripts::new();
    let store = Node::new(STORE, map_url, opts.limits())?;
    let dkey = keys::deployment_key(&namespace);
    let existing: Option<String> = store.run(STORE, |con, _| {
        redis::cmd("HGET").arg(&dkey).arg("id").query(con)
    })?;
    if let Some(found) = existing {
        return Err(QueueError::AlreadyExists {
            what: format!(
                "Redis at {map_url} already holds deployment {found:?} in namespace {namespace:?} \
                 ({dkey}); refusing to initialise over it (choose another namespace, or open the \
                 existing deployment)"
            ),
        }
        .into());
    }
    let shards = redis_shards(map, &opts)?;
    for (name, url, node, shard_keys) in &shards {
        // One EXISTS per key: a cluster connection does not pipeline.
        let found: Vec<bool> = node.run(name, |con, _| {
            shard_keys
                .iter()
                .map(|k| redis::cmd("EXISTS").arg(k).query(con))
                .collect()
        })?;
        if let Some(i) = found.iter().position(|&e| e) {
            return Err(exists_error(name, url, &namespace, &shard_keys[i]));
        }
    }
    for shard in &shards {
        init_one(&scripts, shard, &namespace, &id, LAYOUT_VERSION)?;
    }
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    store.run(STORE, |con, _| {
        redis::cmd("HSET")
            .arg(&dkey)
            .arg("id")
            .arg(&id)
            .arg("layout")
            .arg(LAYOUT_VERSION)
            .arg("created_ms")
            .arg(created)
            .query::<()>(con)
    })?;
    Ok(Deployment {
        id,
        namespace,
        layout: LAYOUT_VERSION,
    })
}

/// Writes the records of shards of `map` that have none yet (shards added
/// to the map after init, e.g. by `add-shard`), for the deployment in
/// `options` (`namespace` and `deployment` must be set). Shards that carry
/// this deployment's record are left alone; a shard with any other keys is
/// refused. Returns the shards initialised.
pub fn init_shards(map: &ShardMap, options: &RedisOptions) -> Result<Vec<String>, RedisError> {
    options.validate()?;
    let Some(id) = options.deployment.clone() else {
        return Err(QueueError::InvalidOption {
            name: "RedisOptions::deployment",
            value: "None".into(),
            allowed: "the deployment id, which init_shards needs".into(),
        }
        .into());
    };
    let scripts = Scripts::new();
    let mut fresh = Vec::new();
    for (name, url, node, shard_keys) in redis_shards(map, options)? {
        let dep: Option<String> = node.run(&name, |con, _| {
            redis::cmd("HGET").arg(&shard_keys[0]).arg("dep").query(con)
        })?;
        if dep.as_deref() == Some(id.as_str()) {
            continue;
        }
        fresh.push((name, url, node, shard_keys));
    }
    let mut done = Vec::new();
    for shard in fresh {
        init_one(&scripts, &shard, &options.namespace, &id, LAYOUT_VERSION)?;
        done.push(shard.0);
    }
    Ok(done)
}

type ShardTarget = (String, String, Node, Vec<String>);

fn redis_shards(map: &ShardMap, opts: &RedisOptions) -> Result<Vec<ShardTarget>, RedisError> {
    let mut out = Vec::new();
    for shard in &map.shards {
        let Some(url) = shard.url.as_deref().filter(|u| is_redis_url(u)) else {
            continue;
        };
        shardq_route::validate_shard_name(&shard.name).map_err(|reason| {
            RedisError::InvalidName {
                what: "shard",
                name: shard.name.clone(),
                reason,
            }
        })?;
        let node = Node::new(&shard.name, url, opts.limits())?;
        let shard_keys = keys::shard_keys(&opts.namespace, &opts.queue, &shard.name);
        // The URL as shown in errors: without its password.
        let shown = node.url.clone();
        out.push((shard.name.clone(), shown, node, shard_keys));
    }
    if out.is_empty() {
        return Err(RedisError::NoRedisShards {
            version: map.version,
        });
    }
    Ok(out)
}

fn exists_error(shard: &str, url: &str, namespace: &str, key: &str) -> RedisError {
    QueueError::AlreadyExists {
        what: format!(
            "shard {shard:?}: Redis at {url} already has key {key} of namespace {namespace:?}; \
             refusing to initialise over another deployment's shard (choose another namespace, or \
             remove that deployment's keys)"
        ),
    }
    .into()
}

/// Writes the deployment record of one shard, at key layout `layout`.
fn init_one(
    scripts: &Scripts,
    (name, url, node, shard_keys): &ShardTarget,
    namespace: &str,
    id: &str,
    layout: u32,
) -> Result<(), RedisError> {
    let v = node.run(name, |con, _| {
        scripts.init_shard.call(con, shard_keys, &|c| {
            (c.arg("").arg("").arg("0").arg(id).arg(layout)).arg(crate::scripts::keys_pin_value());
        })
    })?;
    match reply::status(&v).as_str() {
        "OK" => Ok(()),
        "EXISTS" => {
            let key = reply::items(&v)
                .get(1)
                .and_then(reply::string)
                .unwrap_or_default();
            Err(exists_error(name, url, namespace, &key))
        }
        other => Err(RedisError::Protocol {
            shard: name.to_string(),
            url: url.to_string(),
            reason: format!("init answered {other:?}"),
        }),
    }
}
