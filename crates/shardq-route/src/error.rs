//! Errors of the routing layer: everything that can be wrong with a shard map.
//!
//! Every variant names the field and the offending value so an operator can
//! fix the file without reading code.

use thiserror::Error;

/// A shard map that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum MapError {
    /// The document is not valid YAML.
    #[error("shard map is not valid YAML: {0}")]
    Yaml(String),
    /// A required field is absent.
    #[error("shard map: missing field `{field}`")]
    Missing {
        /// Path of the field, such as `version` or `shards[2].name`.
        field: String,
    },
    /// A field holds a value that is not allowed.
    #[error("shard map: field `{field}` has invalid value {value}: {reason}")]
    Invalid {
        /// Path of the field, such as `shards[2].weight`.
        field: String,
        /// The value as written (rendered as YAML/JSON).
        value: String,
        /// What is allowed instead.
        reason: String,
    },
    /// Two shards share a name.
    #[error("shard map: duplicate shard name {name:?} (shards[{first}] and shards[{second}])")]
    DuplicateShard {
        /// The repeated name.
        name: String,
        /// Index of the first occurrence.
        first: usize,
        /// Index of the second occurrence.
        second: usize,
    },
    /// An override points at a shard the map does not list.
    #[error("shard map: override for key {key:?} names unknown shard {shard:?}")]
    UnknownOverrideShard {
        /// The overridden key.
        key: String,
        /// The shard it names.
        shard: String,
    },
    /// No shard is `active`, so nothing could be routed.
    #[error("shard map: no shard is active (every shard is warming or draining); at least one must be active")]
    NoActiveShard,
    /// Two shards claim the same Redis Cluster slot.
    #[error("shard map: slot {slot} is assigned to both {first:?} and {second:?}")]
    SlotConflict {
        /// The slot.
        slot: u16,
        /// The first shard claiming it.
        first: String,
        /// The second shard claiming it.
        second: String,
    },
}

impl MapError {
    pub(crate) fn invalid(
        field: impl Into<String>,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        MapError::Invalid {
            field: field.into(),
            value: value.into(),
            reason: reason.into(),
        }
    }
}
