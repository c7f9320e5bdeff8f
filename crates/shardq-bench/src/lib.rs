//! shardq-bench (placeholder until its capability lands).
