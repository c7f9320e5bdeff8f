//! The specification's own verification (seed 000), as tests: evenness of
//! rendezvous over 100k tenants and the share of keys that move when a fifth
//! shard joins, for every algorithm that promises minimal movement.

use shardq_route::{Algorithm, Plan, Router, ShardMap};

fn router(algorithm: Algorithm, shards: usize) -> Router {
    let names = (0..shards).map(|i| format!("redis-{i}"));
    Router::new(ShardMap::with_shards(algorithm, names).unwrap()).unwrap()
}

fn tenants() -> Vec<String> {
    (0..100_000).map(|i| format!("t-{i}")).collect()
}

#[test]
fn rendezvous_spreads_100k_tenants_within_5_percent() {
    let r5 = router(Algorithm::Rendezvous, 5);
    let mut counts = [0u32; 5];
    for t in tenants() {
        counts[r5.route_index(t.as_bytes())] += 1;
    }
    let max = *counts.iter().max().unwrap() as f64;
    let min = *counts.iter().min().unwrap() as f64;
    assert!(max / min < 1.05, "counts {counts:?}");
}

/// (algorithm, expected moved fraction, tolerance).
#[test]
fn adding_a_fifth_shard_moves_only_its_share() {
    let cases = [
        // The seed's ring code, run as written, moves 21.8% of these tenants
        // (its comment says 20.1%); 256 vnodes leave a few percent of arc noise.
        (Algorithm::Ring, 0.2, 0.025),
        (Algorithm::Rendezvous, 0.2, 0.01),
        (Algorithm::Jump, 0.2, 0.01),
        (Algorithm::Slots, 0.2, 0.01),
    ];
    let keys = tenants();
    for (algorithm, want, tol) in cases {
        let plan = Plan::compute(
            &router(algorithm, 4),
            &router(algorithm, 5),
            keys.iter().map(String::as_str),
        );
        assert!(
            (plan.moved_fraction - want).abs() < tol,
            "{algorithm}: moved {}",
            plan.moved_fraction
        );
        assert_eq!(
            plan.moved_to_fraction("redis-4"),
            1.0,
            "{algorithm}: {:?}",
            plan.moves
        );
    }
}

#[test]
fn modulo_moves_about_80_percent() {
    let keys = tenants();
    let plan = Plan::compute(
        &router(Algorithm::Modulo, 4),
        &router(Algorithm::Modulo, 5),
        keys.iter().map(String::as_str),
    );
    assert!(
        (plan.moved_fraction - 0.8).abs() < 0.01,
        "moved {}",
        plan.moved_fraction
    );
}
