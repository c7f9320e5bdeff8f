//! Repair (placeholder)
