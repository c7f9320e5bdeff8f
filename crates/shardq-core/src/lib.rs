//! shardq-core (placeholder until its capability lands).
