//! `remote.json`: what makes a data dir a Redis one. It names where the
//! shard map lives (`map_url`), the deployment's namespace and id, and the
//! queue; every Redis key of the deployment is found from these. This
//! module only reads and writes that file; it must never talk to Redis.

use std::path::Path;

use serde::{Deserialize, Serialize};
use shardq_redis::is_redis_url;

use crate::error::{invalid, DeployError};

/// The file that makes a data dir a Redis one.
pub const REMOTE_FILE: &str = "remote.json";
/// `format` field of [`REMOTE_FILE`].
pub const REMOTE_FORMAT: &str = "shardq-remote";
/// Version of the [`REMOTE_FILE`] format.
pub const REMOTE_VERSION: u32 = 1;
/// Longest `remote.json` read, in bytes: it holds a few short strings.
const REMOTE_BYTES_MAX: u64 = 64 << 10;

/// Contents of `remote.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Remote {
    /// Always [`REMOTE_FORMAT`].
    pub format: String,
    /// [`REMOTE_VERSION`].
    pub version: u32,
    /// The Redis instance or cluster holding the shard map.
    pub map_url: String,
    /// Queue name: part of every shard key's hashtag.
    pub queue: String,
    /// The deployment's namespace: the prefix of all its keys.
    pub namespace: String,
    /// The deployment id written at init; every process checks the store
    /// still carries it (a store that lost its state does not).
    pub deployment: String,
}

impl Remote {
    /// A record for a deployment at `map_url`.
    pub fn new(map_url: &str, namespace: &str, deployment: &str) -> Remote {
        Remote {
            format: REMOTE_FORMAT.into(),
            version: REMOTE_VERSION,
            map_url: map_url.to_string(),
            queue: shardq_redis::keys::QUEUE_DEFAULT.to_string(),
            namespace: namespace.to_string(),
            deployment: deployment.to_string(),
        }
    }

    /// Reads `dir/remote.json`, `None` when absent (an embedded data dir).
    pub fn read(dir: &Path) -> Result<Option<Remote>, DeployError> {
        let path = dir.join(REMOTE_FILE);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(DeployError::io(format!("reading {}", path.display()), e)),
        };
        if meta.len() > REMOTE_BYTES_MAX {
            invalid!(
                "{} is {} bytes, over {REMOTE_BYTES_MAX}: not a shardq remote file",
                path.display(),
                meta.len()
            );
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| DeployError::io(format!("reading {}", path.display()), e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            DeployError::Invalid(format!("{} is not valid JSON: {e}", path.display()))
        })?;
        let version = v.get("version").and_then(|x| x.as_u64()).unwrap_or(0);
        if v.get("format").and_then(|x| x.as_str()) != Some(REMOTE_FORMAT) {
            invalid!("{}: not a {REMOTE_FORMAT:?} file", path.display());
        }
        if version != u64::from(REMOTE_VERSION) {
            return Err(shardq_core::QueueError::UnknownFormat {
                what: path.display().to_string(),
                found: version.to_string(),
                supported: REMOTE_VERSION.to_string(),
            }
            .into());
        }
        let r: Remote = serde_json::from_value(v).map_err(|e| {
            DeployError::Invalid(format!(
                "{} is not a valid remote file: {e}",
                path.display()
            ))
        })?;
        if !is_redis_url(&r.map_url) {
            invalid!(
                "{}: map_url {:?} is not a redis:// or redis+cluster:// URL",
                path.display(),
                shardq_core::secret::redact(&r.map_url)
            );
        }
        Ok(Some(r))
    }

    /// Writes `dir/remote.json` atomically.
    pub fn write(&self, dir: &Path) -> Result<(), DeployError> {
        let path = dir.join(REMOTE_FILE);
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| DeployError::Invalid(format!("encoding {}: {e}", path.display())))?;
        shardq_fs::layout::write_atomic(&path, text.as_bytes())
            .map_err(|e| DeployError::io(format!("writing {}", path.display()), e))
    }
}
