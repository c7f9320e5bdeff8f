//! shardq-fs (placeholder until its capability lands).
