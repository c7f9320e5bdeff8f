//! The shard's copy of the flow policies' run limits (`LimitsCopy`): read by
//! the claim per key, rewritten in batches when its version is another, and
//! applied to keys with runs in flight (`relimit`).

use super::*;

/// A shard's copy of the run limits (the `limits` part, see `keys.rs`), as
/// built from one [`ConcurrencyRules`].
pub(crate) struct LimitsCopy {
    /// Names these rules in the copy: a digest of everything below, the
    /// same in every process that holds the same rules.
    pub(crate) version: String,
    /// The limit of a key no entry matches.
    pub(crate) default: u32,
    /// Byte `n - 1` is `1` when some prefix is `n` bytes long, else `0`; as
    /// long as the longest prefix (empty without prefixes).
    pub(crate) lengths: String,
    /// `=<key>` and `^<prefix>` fields with their limits.
    pub(crate) entries: Vec<(String, u32)>,
}

impl LimitsCopy {
    pub(crate) fn of(r: &ConcurrencyRules) -> LimitsCopy {
        // An empty prefix matches no key (as `FlowSettings::for_key` has it).
        let prefixes = || r.prefixes.iter().filter(|(p, _)| !p.is_empty());
        let longest = prefixes().map(|(p, _)| p.len()).max().unwrap_or(0);
        let mut lengths = vec![b'0'; longest];
        for (p, _) in prefixes() {
            lengths[p.len() - 1] = b'1';
        }
        let lengths = String::from_utf8(lengths).unwrap_or_default();
        let entries: Vec<(String, u32)> = (r.keys.iter().map(|(k, n)| (format!("={k}"), *n)))
            .chain(prefixes().map(|(p, n)| (format!("^{p}"), *n)))
            .collect();
        // Fields hold no control character, so `\n` and `\t` separate.
        let mut text = format!("{}\n{lengths}", r.default);
        for (field, n) in &entries {
            text.push_str(&format!("\n{n}\t{field}"));
        }
        let version = format!(
            "{:016x}{:016x}-{}",
            shardq_route::hash::blake2b64(text.as_bytes()),
            shardq_route::hash::fnv1a64(text.as_bytes()),
            entries.len()
        );
        LimitsCopy {
            version,
            default: r.default,
            lengths,
            entries,
        }
    }
}

impl RedisBackend {
    /// The run limits of the flow settings in use, as each shard's copy
    /// holds them (none when every key runs once at a time). Built again
    /// only when the settings change.
    pub(super) fn limits_copy(&self) -> Option<Arc<LimitsCopy>> {
        let f = self.inner.opts.flow.as_deref()?;
        let mut cache = self.inner.limits.lock().unwrap_or_else(|p| p.into_inner());
        let version = f.version();
        if cache.0 != version {
            *cache = (
                version,
                f.concurrency_rules().map(|r| Arc::new(LimitsCopy::of(&r))),
            );
        }
        cache.1.clone()
    }

    /// Writes `copy` as shard `s`'s copy of the run limits (`limits_put`,
    /// at most [`LIMITS_BATCH_MAX`] entries a call; the version goes with
    /// the last, so a claim never reads a half-written copy). False when
    /// the shard is no longer this process's.
    pub(super) fn put_limits(
        &self,
        s: &ShardRef,
        token: &str,
        copy: &LimitsCopy,
    ) -> Result<bool, QueueError> {
        let chunks: Vec<&[(String, u32)]> = if copy.entries.is_empty() {
            vec![&[]]
        } else {
            copy.entries.chunks(LIMITS_BATCH_MAX).collect()
        };
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let v = self.script(s, &self.inner.scripts.limits_put, token, &|c, _| {
                c.arg(if i == 0 { "1" } else { "0" })
                    .arg(if last { copy.version.as_str() } else { "" })
                    .arg(copy.default)
                    .arg(&copy.lengths);
                for (field, n) in *chunk {
                    c.arg(field).arg(*n);
                }
            })?;
            match reply::status(&v).as_str() {
                "OK" => {}
                "NOTOWNER" => return Ok(false),
                other => return Err(self.protocol(s, format!("limits_put answered {other:?}"))),
            }
        }
        Ok(true)
    }

    /// Gives each key with runs held here its run limit under the flow
    /// settings in use (they changed since the last time): a key whose
    /// limit rose may start more at once, and the scripts that end runs
    /// judge whether to schedule a key by the new limit. False when the
    /// shard is no longer this process's.
    pub(super) fn relimit(
        &self,
        s: &ShardRef,
        held: &mut Held,
        flow: &FlowControl,
    ) -> Result<bool, QueueError> {
        let version = flow.version();
        let keys: std::collections::BTreeSet<&str> =
            held.in_flight.values().map(|r| r.key.as_str()).collect();
        let pairs: Vec<(&str, u32)> = (keys.into_iter())
            .map(|k| (k, flow.concurrency_of(k)))
            .collect();
        for chunk in pairs.chunks(RELIMIT_BATCH_MAX) {
            let v = self.script(s, &self.inner.scripts.relimit, &held.token, &|c, _| {
                for (k, n) in chunk {
                    c.arg(*k).arg(*n);
                }
            })?;
            match reply::status(&v).as_str() {
                "OK" => {}
                "NOTOWNER" => return Ok(false),
                other => return Err(self.protocol(s, format!("relimit answered {other:?}"))),
            }
        }
        held.limits_version = version;
        Ok(true)
    }
}
