//! Integration tests of the Redis backend against real `redis-server`
//! processes that the tests start on free loopback ports.

mod cluster;
mod common;
mod contract;
mod core_contract;
mod crash;
mod dead_letters;
mod failover;
mod hardening;
mod policies;
mod reshard;
mod sharing;
