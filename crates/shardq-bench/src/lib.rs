//! shardq-bench: benchmark harnesses that measure routing behaviour, and
//! the `shardq-bench` binary (`src/main.rs`) that runs them: `shardq-bench
//! chx` for this library's experiments, `shardq-bench route` for routing
//! speed. None of it is linked into the `shardq` binary.
//!
//! [`chx`] runs the consistent-hash experiments (A evenness, B rebalance cost,
//! C affinity) against shardq's own routers and, through a real AMQP client,
//! against RabbitMQ's `x-consistent-hash` exchange, and writes the results as
//! CSV, a text summary, JSON headlines and SVG charts.
//!
//! The library never prints and never draws progress bars: callers pass an
//! [`chx::Observer`]. It talks to nothing but the broker URL it is given.

pub mod chx;
pub mod error;

pub use error::ChxError;
