//! Opening a backend: the shards of a map, the deployment record and layout
//! checks (`open`, `sync_shards`, `check_store`).

use super::*;

impl RedisBackend {
    /// Opens the shards of `map` whose URL is `redis://host:port/db` or
    /// `redis+cluster://host:port,...`, and checks each server: it answers
    /// within the bounds, never evicts keys (`maxmemory-policy
    /// noeviction`), and every shard carries the deployment record written
    /// by [`crate::init_deployment`] with a layout this build reads
    /// ([`QueueError::StoreLost`] / [`QueueError::UnknownFormat`] otherwise).
    /// Shards with other URLs (or none) are left to other backends.
    pub fn open(map: &ShardMap, options: RedisOptions) -> Result<RedisBackend, RedisError> {
        options.validate()?;
        let deployment = options.deployment.clone();
        let backend = RedisBackend {
            inner: Arc::new(Inner {
                opts: options,
                registry: RwLock::new(Registry::default()),
                tokens: Mutex::new(HashMap::new()),
                deployment: RwLock::new(deployment),
                scripts: Scripts::new(),
                epoch: std::sync::atomic::AtomicU64::new(0),
                limits: Mutex::new((0, None)),
                server_time: Mutex::new(None),
            }),
        };
        backend.sync_shards(map)?;
        if backend.registry().shards.is_empty() {
            return Err(RedisError::NoRedisShards {
                version: map.version,
            });
        }
        Ok(backend)
    }

    /// Adds the Redis shards of `map` this backend does not know yet (a map
    /// published after it was opened, e.g. by `add-shard`), checking each
    /// new server's deployment record. Returns the names added. Known shards
    /// keep their URL: a shard never moves between servers under one name.
    ///
    /// A server that does not answer costs only its own shards: they are
    /// added unchecked, and every call on them fails as unavailable until
    /// it answers (every script checks the deployment record itself, so an
    /// unchecked shard is never written as if it were new). Only when no
    /// shard of `map` answers is that an error here. A server that answers
    /// with another deployment's or no record is an error at once.
    pub fn sync_shards(&self, map: &ShardMap) -> Result<Vec<String>, RedisError> {
        let mut added = Vec::new();
        let mut unreachable: Option<RedisError> = None;
        let mut answered = 0usize;
        for shard in &map.shards {
            let Some(url) = shard.url.as_deref().filter(|u| is_redis_url(u)) else {
                continue;
            };
            if self.registry().index.contains_key(&shard.name) {
                continue;
            }
            shardq_route::validate_shard_name(&shard.name).map_err(|reason| {
                RedisError::InvalidName {
                    what: "shard",
                    name: shard.name.clone(),
                    reason,
                }
            })?;
            if self.inner.opts.wait_replicas > 0 && url.starts_with(SCHEME_CLUSTER) {
                return Err(RedisError::InvalidUrl {
                    shard: shard.name.clone(),
                    url: shardq_core::secret::redacted(url),
                    reason: "waiting for replicas (--redis-wait-replicas) is supported on \
                             redis:// instances only"
                        .into(),
                });
            }
            let known = self.registry().nodes.get(url).cloned();
            let node = match known {
                Some(n) => n,
                // Connect outside the lock: an unreachable server takes
                // seconds to be reported and must not stall other shards.
                None => Arc::new(Node::new(&shard.name, url, self.inner.opts.limits())?),
            };
            let shard_keys = keys::shard_keys(
                &self.inner.opts.namespace,
                &self.inner.opts.queue,
                &shard.name,
            );
            match self.check_record(
                &shard.name,
                &node.url,
                &node,
                &shard_keys,
                OPEN_CHECK_BUDGET_MS,
            ) {
                Ok(()) => answered += 1,
                Err(e) if e.kind() == shardq_core::ErrorKind::Retryable => {
                    unreachable.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
            let mut reg = self
                .inner
                .registry
                .write()
                .unwrap_or_else(|p| p.into_inner());
            if reg.index.contains_key(&shard.name) {
                continue;
            }
            let node = Arc::clone(reg.nodes.entry(url.to_string()).or_insert(node));
            let i = reg.shards.len();
            reg.index.insert(shard.name.clone(), i);
            reg.shards.push(Arc::new(ShardRef {
                name: shard.name.clone(),
                // As shown in errors: without the password.
                url: node.url.clone(),
                node,
                keys: shard_keys,
                held: Mutex::new(None),
                marks: Mutex::new(Marks::default()),
                fair: Mutex::new(FairQueue::default()),
            }));
            added.push(shard.name.clone());
        }
        match unreachable {
            Some(e) if answered == 0 && self.registry().shards.len() == added.len() => Err(e),
            _ => Ok(added),
        }
    }

    /// Checks a shard's deployment record: present, of this deployment,
    /// of a layout this build reads. Learns the deployment id from the first
    /// shard when the caller gave none.
    pub(super) fn check_record(
        &self,
        shard: &str,
        url: &str,
        node: &Node,
        shard_keys: &[String],
        budget_ms: u64,
    ) -> Result<(), RedisError> {
        let meta = std::slice::from_ref(&shard_keys[0]);
        let v = node.run_within(shard, budget_ms, |con, _| {
            self.inner.scripts.shard_record.call(con, meta, &|_| {})
        })?;
        let it = reply::items(&v);
        let dep = it.first().and_then(reply::string);
        let layout = it.get(1).and_then(reply::string);
        let Some(dep) = dep else {
            return Err(QueueError::StoreLost(format!(
                "shard {shard:?} at {url}: no deployment record ({} has no field `dep`): the \
                 server lost its state (restarted without persistence, flushed) or the shard was \
                 never initialised for namespace {:?}; refusing to re-create it silently (run \
                 init for a new deployment, or restore the server's data)",
                shard_keys[0], self.inner.opts.namespace
            ))
            .into());
        };
        let layout = layout.unwrap_or_default();
        if layout != LAYOUT_VERSION.to_string() {
            return Err(QueueError::UnknownFormat {
                what: format!("shard {shard:?} at {url} ({})", shard_keys[0]),
                found: if layout.is_empty() {
                    "none".into()
                } else {
                    layout
                },
                supported: LAYOUT_VERSION.to_string(),
            }
            .into());
        }
        let mut want = self
            .inner
            .deployment
            .write()
            .unwrap_or_else(|p| p.into_inner());
        match want.as_deref() {
            Some(w) if w != dep => Err(QueueError::StoreLost(format!(
                "shard {shard:?} at {url} belongs to deployment {dep:?}, not {w:?}: the server \
                 was re-initialised or the URL points at another deployment"
            ))
            .into()),
            Some(_) => Ok(()),
            None => {
                *want = Some(dep);
                Ok(())
            }
        }
    }

    /// Checks every shard's deployment record and layout again (for `status`
    /// and health checks): [`QueueError::StoreLost`] if a server lost it.
    pub fn check_store(&self) -> Result<(), RedisError> {
        let shards: Vec<Arc<ShardRef>> = self.registry().shards.clone();
        for s in shards {
            self.check_record(&s.name, &s.url, &s.node, &s.keys, s.node.budget_ms())?;
        }
        Ok(())
    }
}
