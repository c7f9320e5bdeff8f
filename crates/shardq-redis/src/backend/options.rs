//! `RedisOptions`: the connection bounds, retries, replicas to wait for,
//! retry and retention settings and flow control a backend opens with.

use super::*;

/// Options of [`RedisBackend::open`].
#[derive(Clone)]
pub struct RedisOptions {
    /// The deployment's namespace (chosen at [`crate::init_deployment`]):
    /// the first part of every shard's hashtag.
    pub namespace: String,
    /// The deployment id the caller expects (from its own configuration);
    /// `None` accepts the one the shards carry, as long as they agree.
    pub deployment: Option<String>,
    /// Queue name: the second part of every shard's hashtag.
    pub queue: String,
    /// Retry backoff after a failed attempt of a key without a rule.
    pub backoff: Backoff,
    /// Per-key and per-prefix retry policies: a failed run of a key with a
    /// rule waits its rule's backoff instead (the key is the one this
    /// process claimed the run with).
    pub retry_rules: Arc<RetryRules>,
    /// How many finished jobs each shard keeps (written to the shard when
    /// this process adopts it), and how long.
    pub retention: Retention,
    /// Whether a dead job halts its key.
    pub dead_policy: DeadPolicy,
    /// Largest payload accepted, in bytes.
    pub payload_bytes_max: usize,
    /// Attempts per Redis operation before reporting the server unreachable.
    pub retry_attempts: u32,
    /// Longest time one operation keeps retrying, in ms.
    pub retry_budget_ms: u64,
    /// TCP connect timeout per attempt, in ms.
    pub connect_timeout_ms: u64,
    /// Reply timeout per command, in ms.
    pub response_timeout_ms: u64,
    /// Time source for leases and delays; `None` uses the Redis server's
    /// clock (one clock for every host, the default).
    pub clock: Option<Arc<dyn Clock>>,
    /// Replicated acknowledgement: after every script that changes a shard
    /// (enqueue, claim, ack, fail, extend, adopt, fence, dead-letter moves)
    /// `WAIT` until this many replicas have it; 0 (the default) does not
    /// wait. A write the replicas do not confirm within
    /// [`RedisOptions::wait_replicas_timeout_ms`] fails with
    /// [`QueueError::Unavailable`] naming the count (an enqueue is then not
    /// reported as stored, though the primary may hold it). Standalone
    /// `redis://` shards only.
    pub wait_replicas: u32,
    /// How long a write waits for [`RedisOptions::wait_replicas`], in ms
    /// (kept below the reply timeout).
    pub wait_replicas_timeout_ms: u64,
    /// Flow control: which claimed runs may start now (rate limits of keys
    /// and groups). A run it refuses is given back at once, without using
    /// an attempt, not before the time it names. None: every run starts.
    pub flow: Option<Arc<FlowControl>>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            namespace: NAMESPACE_DEFAULT.to_string(),
            deployment: None,
            queue: QUEUE_DEFAULT.to_string(),
            backoff: Backoff::default(),
            retry_rules: Arc::default(),
            retention: Retention::default(),
            dead_policy: DeadPolicy::default(),
            payload_bytes_max: PAYLOAD_BYTES_MAX_DEFAULT,
            retry_attempts: RETRY_ATTEMPTS_DEFAULT,
            retry_budget_ms: RETRY_BUDGET_MS_DEFAULT,
            connect_timeout_ms: CONNECT_TIMEOUT_MS,
            response_timeout_ms: RESPONSE_TIMEOUT_MS,
            clock: None,
            flow: None,
            wait_replicas: 0,
            wait_replicas_timeout_ms: WAIT_REPLICAS_TIMEOUT_MS_DEFAULT,
        }
    }
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("namespace", &self.namespace)
            .field("deployment", &self.deployment)
            .field("queue", &self.queue)
            .field("backoff", &self.backoff)
            .field("dead_policy", &self.dead_policy)
            .field("payload_bytes_max", &self.payload_bytes_max)
            .field("retry_attempts", &self.retry_attempts)
            .field("retry_budget_ms", &self.retry_budget_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("response_timeout_ms", &self.response_timeout_ms)
            .field("clock", &self.clock.is_some())
            .field("wait_replicas", &self.wait_replicas)
            .field("wait_replicas_timeout_ms", &self.wait_replicas_timeout_ms)
            .finish()
    }
}

impl RedisOptions {
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            retry_attempts: self.retry_attempts,
            retry_budget_ms: self.retry_budget_ms,
            connect_timeout_ms: self.connect_timeout_ms,
            response_timeout_ms: self.response_timeout_ms,
        }
    }

    /// The `WAIT` timeout: the configured one, below the reply timeout so
    /// the command's own reply is never cut off.
    pub(super) fn wait_timeout_ms(&self) -> u64 {
        self.wait_replicas_timeout_ms
            .clamp(1, (self.response_timeout_ms * 3 / 4).max(1))
    }

    pub(crate) fn validate(&self) -> Result<(), RedisError> {
        keys::validate_queue_name(&self.queue).map_err(|reason| RedisError::InvalidName {
            what: "queue",
            name: self.queue.clone(),
            reason,
        })?;
        keys::validate_queue_name(&self.namespace).map_err(|reason| RedisError::InvalidName {
            what: "namespace",
            name: self.namespace.clone(),
            reason,
        })
    }
}
