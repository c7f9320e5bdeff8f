//! Property tests for the routing invariants, for every algorithm where the
//! property holds:
//! - adding a shard moves keys only to it (ring, rendezvous, slots, jump);
//! - removing a shard moves only its keys (ring, rendezvous, slots; jump for its last shard);
//! - raising one shard's weight moves keys only to it (ring, rendezvous, slots);
//! - overrides win in every state; warming and draining shards receive nothing else;
//! - routing is a pure function of (map, key).

use proptest::prelude::*;
use shardq_route::{Algorithm, HashFn, Router, Shard, ShardMap, ShardState};

const MINIMAL: [Algorithm; 3] = [Algorithm::Ring, Algorithm::Rendezvous, Algorithm::Slots];

fn map(algorithm: Algorithm, hash: HashFn, weights: &[u32]) -> ShardMap {
    let mut m =
        ShardMap::with_shards(algorithm, (0..weights.len()).map(|i| format!("s{i}"))).unwrap();
    m.hash = hash;
    m.vnodes = 32;
    for (s, &w) in m.shards.iter_mut().zip(weights) {
        s.weight = w;
    }
    m
}

fn keys_strategy() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec("[a-z0-9{}é-]{0,24}", 1..200)
}

fn hash_strategy() -> impl Strategy<Value = HashFn> {
    prop::sample::select(vec![
        HashFn::Blake2b64,
        HashFn::Xxh3,
        HashFn::Xxh64,
        HashFn::Murmur3,
        HashFn::Fnv1a64,
    ])
}

fn algorithm_strategy() -> impl Strategy<Value = Algorithm> {
    prop::sample::select(MINIMAL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn adding_a_shard_moves_keys_only_to_it(
        alg in prop::sample::select(vec![Algorithm::Ring, Algorithm::Rendezvous, Algorithm::Slots, Algorithm::Jump]),
        hash in hash_strategy(),
        weights in prop::collection::vec(1u32..4, 1..7),
        keys in keys_strategy(),
    ) {
        let weights = if alg == Algorithm::Jump { vec![1; weights.len()] } else { weights };
        let before = Router::new(map(alg, hash, &weights)).unwrap();
        let mut grown = map(alg, hash, &weights);
        grown.shards.push(Shard::new("new"));
        let after = Router::new(grown).unwrap();
        for k in &keys {
            let (a, b) = (before.route(k), after.route(k));
            prop_assert!(a == b || b == "new", "{alg} key {k:?} moved {a} -> {b}");
        }
    }

    #[test]
    fn removing_a_shard_moves_only_its_keys(
        alg in algorithm_strategy(),
        hash in hash_strategy(),
        weights in prop::collection::vec(1u32..4, 2..7),
        victim in 0usize..6,
        keys in keys_strategy(),
    ) {
        let victim = victim % weights.len();
        let before = Router::new(map(alg, hash, &weights)).unwrap();
        let mut shrunk = map(alg, hash, &weights);
        let gone = shrunk.shards.remove(victim).name;
        let after = Router::new(shrunk).unwrap();
        for k in &keys {
            let (a, b) = (before.route(k), after.route(k));
            prop_assert!(a == b || a == gone, "{alg} key {k:?} moved {a} -> {b}");
        }
    }

    #[test]
    fn jump_removing_the_last_shard_moves_only_its_keys(
        n in 2usize..12,
        keys in keys_strategy(),
    ) {
        let before = Router::new(map(Algorithm::Jump, HashFn::Xxh3, &vec![1; n])).unwrap();
        let after = Router::new(map(Algorithm::Jump, HashFn::Xxh3, &vec![1; n - 1])).unwrap();
        let last = format!("s{}", n - 1);
        for k in &keys {
            let (a, b) = (before.route(k), after.route(k));
            prop_assert!(a == b || a == last);
        }
    }

    #[test]
    fn raising_a_weight_moves_keys_only_to_that_shard(
        alg in algorithm_strategy(),
        hash in hash_strategy(),
        weights in prop::collection::vec(1u32..4, 2..7),
        which in 0usize..6,
        extra in 1u32..4,
        keys in keys_strategy(),
    ) {
        let which = which % weights.len();
        let before = Router::new(map(alg, hash, &weights)).unwrap();
        let mut heavier = weights.clone();
        heavier[which] += extra;
        let after = Router::new(map(alg, hash, &heavier)).unwrap();
        let target = format!("s{which}");
        for k in &keys {
            let (a, b) = (before.route(k), after.route(k));
            prop_assert!(a == b || b == target, "{alg} key {k:?} moved {a} -> {b}");
        }
    }

    #[test]
    fn states_and_overrides(
        alg in prop::sample::select(Algorithm::ALL.to_vec()),
        hash in hash_strategy(),
        n in 2usize..6,
        keys in keys_strategy(),
    ) {
        let mut m = map(alg, hash, &vec![1; n]);
        m.shards[0].state = ShardState::Warming;
        m.shards[1].state = ShardState::Draining;
        // Keep one active shard at least.
        m.shards.push(Shard::new("live"));
        let pinned = keys[0].clone();
        m.overrides.insert(pinned.clone(), "s0".into());
        let r = Router::new(m).unwrap();
        for k in &keys {
            let shard = r.route(k);
            if *k == pinned {
                prop_assert_eq!(shard, "s0", "override must win even on a warming shard");
            } else {
                prop_assert!(shard != "s0" && shard != "s1", "{alg}: {k:?} routed to non-active {shard}");
            }
            prop_assert!(r.computed(k) != "s0" && r.computed(k) != "s1");
        }
    }

    #[test]
    fn routing_is_a_pure_function_of_map_and_key(
        alg in prop::sample::select(Algorithm::ALL.to_vec()),
        hash in prop::sample::select(HashFn::ALL.to_vec()),
        weights in prop::collection::vec(1u32..4, 1..6),
        keys in keys_strategy(),
    ) {
        let m = map(alg, hash, &weights);
        let r1 = Router::new(m.clone()).unwrap();
        let r2 = Router::from_yaml(&m.to_yaml()).unwrap();
        for k in &keys {
            prop_assert_eq!(r1.route(k), r2.route(k));
            prop_assert_eq!(r1.route(k), r1.route(k));
        }
    }

    #[test]
    fn map_parser_never_panics(text in "\\PC{0,200}") {
        let _ = ShardMap::from_yaml(&text);
    }
}

#[test]
fn equal_weights_give_exactly_the_unweighted_rendezvous() {
    // Weight 3 everywhere must route like weight 1 everywhere.
    let w1 = Router::new(map(Algorithm::Rendezvous, HashFn::Blake2b64, &[1, 1, 1, 1])).unwrap();
    let w3 = Router::new(map(Algorithm::Rendezvous, HashFn::Blake2b64, &[3, 3, 3, 3])).unwrap();
    for i in 0..20_000 {
        let k = format!("t-{i}");
        assert_eq!(w1.route(&k), w3.route(&k));
    }
}

#[test]
fn weights_shift_load_proportionally() {
    // One shard of weight 2 among three of weight 1 should take about 2/5.
    for alg in MINIMAL {
        let mut m = map(alg, HashFn::Xxh3, &[2, 1, 1, 1]);
        m.vnodes = 256;
        let r = Router::new(m).unwrap();
        let heavy = (0..50_000)
            .filter(|i| r.route(&format!("t-{i}")) == "s0")
            .count();
        let share = heavy as f64 / 50_000.0;
        assert!(
            (share - 0.4).abs() < 0.03,
            "{alg}: weight-2 shard got {share}"
        );
    }
}
