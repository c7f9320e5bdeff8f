//! shardq-bench: benchmark harnesses that measure routing behaviour, as
//! opposed to routing speed (that is `shardq bench route`).
//!
//! [`chx`] runs the consistent-hash experiments (A evenness, B rebalance cost,
//! C affinity) against shardq's own routers and, through a real AMQP client,
//! against RabbitMQ's `x-consistent-hash` exchange, and writes the results as
//! CSV, a text summary, JSON headlines and SVG charts. [`demo`] runs the
//! whole story (producers, workers, a live rebalance) on any deployment and
//! checks order and loss as it goes.
//!
//! The library never prints and never draws progress bars: callers pass an
//! [`chx::Observer`]. It talks to nothing but the broker URL it is given.

pub mod chx;
pub mod demo;
pub mod error;

pub use error::ChxError;
