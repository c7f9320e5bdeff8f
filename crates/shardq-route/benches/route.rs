//! Criterion benchmarks of routing, each read against a bare hash of the same
//! key measured in the same run:
//!
//! - `bare_hash/{xxh3,blake2b64}`: the baseline, one hash of a 20-byte key
//!   (and `blake2b64-crate`: the `blake2` crate's path, for comparison);
//! - `lookup/{algorithm}-{hash}/{shards}`: `Router::route_index` for every
//!   algorithm with xxh3 and blake2b64 at 4, 16, 64 and 256 shards;
//! - `ring_build/{hash}/256x256`: compiling a 256-shard ring of 256 vnodes
//!   (target < 20 ms: map changes must not stall producers);
//! - `peer_hashring/64x256` against `lookup/ring-xxh3/64`: the `hashring`
//!   crate on a ring of the same size.
//!
//! Targets: ring lookup (64 x 256, xxh3) <= 2x bare xxh3; rendezvous at 16
//! shards <= 20x bare hash. Run briefly with
//! `cargo bench -p shardq-route --bench route -- --warm-up-time 1 --measurement-time 2`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use shardq_route::map::VNODES_DEFAULT;
use shardq_route::ring::Ring;
use shardq_route::{Algorithm, HashFn, Router, Shard, ShardMap};

/// Keys cycled through; a power of two so the index is a mask.
const KEYS: usize = 4096;
const HASHES: [HashFn; 2] = [HashFn::Xxh3, HashFn::Blake2b64];
const SHARD_COUNTS: [u32; 4] = [4, 16, 64, 256];

/// `tenant-` and 13 digits (20 bytes), spread like real tenant ids.
fn keys() -> Vec<String> {
    (0..KEYS as u64)
        .map(|i| {
            format!(
                "tenant-{:013}",
                i.wrapping_mul(2_654_435_761) % 10_000_000_000_000
            )
        })
        .collect()
}

fn router(algorithm: Algorithm, hash: HashFn, shards: u32) -> Router {
    let map = ShardMap {
        version: 1,
        algorithm,
        hash,
        vnodes: VNODES_DEFAULT,
        shards: (0..shards)
            .map(|i| Shard::new(format!("redis-{i}")))
            .collect(),
        overrides: Default::default(),
    };
    Router::new(map).expect("bench maps are valid")
}

/// Cycles through the keys, one per iteration, the same way in every bench
/// so the key selection costs the baseline exactly what it costs a lookup.
fn bench_keys<R>(b: &mut criterion::Bencher<'_>, keys: &[String], mut f: impl FnMut(&[u8]) -> R) {
    let mut i = 0usize;
    b.iter(|| {
        i = (i + 1) & (KEYS - 1);
        f(black_box(keys[i].as_bytes()))
    });
}

fn bare_hash(c: &mut Criterion) {
    let keys = keys();
    let mut group = c.benchmark_group("bare_hash");
    for hash in HASHES {
        group.bench_function(hash.name(), |b| bench_keys(b, &keys, |k| hash.hash(k)));
    }
    // The `blake2` crate's own path, against which the written-out
    // one-block BLAKE2b-64 in `blake2b_short.rs` must win to stay.
    group.bench_function("blake2b64-crate", |b| {
        bench_keys(b, &keys, |k| {
            use blake2::digest::consts::U8;
            use blake2::{Blake2b, Digest};
            u64::from_be_bytes(Blake2b::<U8>::digest(k).into())
        })
    });
    group.finish();
}

fn lookup(c: &mut Criterion) {
    let keys = keys();
    for algorithm in Algorithm::ALL {
        for hash in HASHES {
            let mut group = c.benchmark_group(format!("lookup/{algorithm}-{hash}"));
            for n in SHARD_COUNTS {
                let r = router(algorithm, hash, n);
                group.bench_with_input(BenchmarkId::from_parameter(n), &r, |b, r| {
                    bench_keys(b, &keys, |k| r.route_index(k))
                });
            }
            group.finish();
        }
    }
}

fn ring_build(c: &mut Criterion) {
    let names: Vec<String> = (0..256).map(|i| format!("redis-{i}")).collect();
    let mut group = c.benchmark_group("ring_build");
    // Each build takes milliseconds: the minimum sample count is plenty.
    group.sample_size(10);
    for hash in HASHES {
        group.bench_function(BenchmarkId::new(hash.name(), "256x256"), |b| {
            b.iter(|| Ring::build(hash, 256, names.iter().map(|n| (n.as_str(), 1))))
        });
    }
    group.finish();
}

/// A virtual node for the `hashring` crate, which has no vnodes of its own.
#[derive(Debug, Clone, Copy, Hash, PartialEq)]
struct VNode {
    shard: u16,
    replica: u16,
}

fn peer_hashring(c: &mut Criterion) {
    let keys = keys();
    let mut ring = hashring::HashRing::new();
    for shard in 0..64 {
        for replica in 0..256 {
            ring.add(VNode { shard, replica });
        }
    }
    let keys_str: Vec<&str> = keys.iter().map(String::as_str).collect();
    c.bench_function("peer_hashring/64x256", |b| {
        let mut i = 0usize;
        b.iter(|| {
            i = (i + 1) & (KEYS - 1);
            ring.get(black_box(&keys_str[i])).map(|v| v.shard)
        })
    });
}

criterion_group!(benches, bare_hash, lookup, ring_build, peer_hashring);
criterion_main!(benches);
