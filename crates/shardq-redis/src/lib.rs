//! shardq-redis (placeholder until its capability lands).
