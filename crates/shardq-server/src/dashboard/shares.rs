//! What the dashboard draws as a circle: each active shard's share of the
//! key space under one shard map, as arcs of the circle (fractions in
//! `[0, 1)`).
//!
//! * `ring`: the exact arcs, from the same points the router builds
//!   (`h("{name}#{i}")` for `i in 0..vnodes*weight`, ties to the later
//!   shard), merged where neighbours share an owner. A ring with more than
//!   [`RING_POINTS_EXACT_MAX`] points, or with more than [`ARCS_MAX`]
//!   merged arcs, is drawn from [`BUCKETS`] equal buckets instead (each the
//!   owner at its midpoint); the shares stay exact.
//! * `modulo`, `rendezvous`, `jump`, `slots`: a sample of keys routed by
//!   the map's algorithm; the arcs are one per shard, in map order, sized
//!   by its share of the sample.
//!
//! Cost is bounded: at most [`RING_POINTS_EXACT_MAX`] hashes for a ring and
//! at most [`SAMPLE_WORK_MAX`] shard evaluations for a sample. Pure: no I/O.

use serde::Serialize;
use shardq_route::{Algorithm, HashFn, Router, ShardMap, ShardState};

/// Largest ring drawn from its exact points.
pub const RING_POINTS_EXACT_MAX: u64 = 1 << 20;
/// Most arcs sent to the browser.
pub const ARCS_MAX: usize = 4096;
/// Buckets of a ring too large to send arc by arc.
pub const BUCKETS: usize = 2048;
/// Most sample keys.
pub const SAMPLE_KEYS_MAX: usize = 20_000;
/// Bound on sample keys times active shards (rendezvous looks at every shard).
pub const SAMPLE_WORK_MAX: usize = 4_000_000;

/// One shard's part.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ShardShare {
    /// Shard name.
    pub name: String,
    /// Weight in the map.
    pub weight: u32,
    /// `active`, `warming` or `draining`.
    pub state: &'static str,
    /// Fraction of the key space it owns (0 unless active).
    pub share: f64,
    /// What its weight alone would give it: weight over the active weights.
    pub ideal: f64,
    /// Ring points it owns (ring only).
    pub points: Option<u64>,
}

/// An arc `[start, end)` of the circle owned by shard `shard` (map index).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Arc {
    /// Map index of the owner.
    pub shard: usize,
    /// Start, as a fraction of the circle.
    pub start: f64,
    /// End, as a fraction of the circle.
    pub end: f64,
}

/// The whole picture for one map version.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Shares {
    /// Map version.
    pub map_version: u64,
    /// Algorithm name.
    pub algorithm: &'static str,
    /// Hash name.
    pub hash: &'static str,
    /// Virtual nodes per unit of weight (ring).
    pub vnodes: u32,
    /// How the shares were found: `ring-points`, `ring-buckets` or `sample`.
    pub method: &'static str,
    /// Keys sampled (`sample` only).
    pub sample_keys: Option<usize>,
    /// Operator and rebalance pins in the map (they override the picture).
    pub overrides: usize,
    /// Per shard, in map order.
    pub shards: Vec<ShardShare>,
    /// The circle.
    pub arcs: Vec<Arc>,
}

/// Computes the shares of `map` (already validated by the caller's router).
pub fn compute(map: &ShardMap) -> Result<Shares, String> {
    let active: Vec<usize> = map
        .shards
        .iter()
        .enumerate()
        .filter(|(_, s)| s.state == ShardState::Active)
        .map(|(i, _)| i)
        .collect();
    let weight_sum: u64 = active
        .iter()
        .map(|&i| u64::from(map.shards[i].weight))
        .sum();
    let mut shards: Vec<ShardShare> = map
        .shards
        .iter()
        .map(|s| ShardShare {
            name: s.name.clone(),
            weight: s.weight,
            state: s.state.name(),
            share: 0.0,
            ideal: if s.state == ShardState::Active && weight_sum > 0 {
                f64::from(s.weight) / weight_sum as f64
            } else {
                0.0
            },
            points: None,
        })
        .collect();
    let points_total: u64 = active
        .iter()
        .map(|&i| u64::from(map.vnodes) * u64::from(map.shards[i].weight))
        .sum();
    let mut out = Shares {
        map_version: map.version,
        algorithm: map.algorithm.name(),
        hash: map.hash.name(),
        vnodes: map.vnodes,
        method: "sample",
        sample_keys: None,
        overrides: map.overrides.len(),
        shards: Vec::new(),
        arcs: Vec::new(),
    };
    if active.is_empty() {
        out.shards = shards;
        return Ok(out);
    }
    if map.algorithm == Algorithm::Ring && points_total <= RING_POINTS_EXACT_MAX {
        let (arcs, per_shard, owned_points) = ring_arcs(map, &active);
        for (i, s) in shards.iter_mut().enumerate() {
            s.share = per_shard[i];
            if map.shards[i].state == ShardState::Active {
                s.points = Some(owned_points[i]);
            }
        }
        if arcs.len() <= ARCS_MAX {
            out.method = "ring-points";
            out.arcs = arcs;
        } else {
            out.method = "ring-buckets";
            out.arcs = bucketed(&arcs);
        }
        out.shards = shards;
        return Ok(out);
    }
    // Sample keys through the router itself: the same answer as routing.
    let mut plain = map.clone();
    plain.overrides.clear();
    let router = Router::new(plain).map_err(|e| format!("compiling map v{}: {e}", map.version))?;
    let n = (SAMPLE_WORK_MAX / active.len()).clamp(1, SAMPLE_KEYS_MAX);
    let mut counts = vec![0u64; map.shards.len()];
    for k in 0..n {
        let key = format!("sample-key-{k}");
        counts[router.computed_index(key.as_bytes())] += 1;
    }
    let mut at = 0.0;
    for (i, s) in shards.iter_mut().enumerate() {
        s.share = counts[i] as f64 / n as f64;
        if s.share > 0.0 {
            out.arcs.push(Arc {
                shard: i,
                start: at,
                end: (at + s.share).min(1.0),
            });
            at += s.share;
        }
    }
    out.sample_keys = Some(n);
    out.shards = shards;
    Ok(out)
}

/// The key space of `hash`: crc16 values stay below 2^16.
fn space(hash: HashFn) -> f64 {
    if hash == HashFn::Crc16 {
        65536.0
    } else {
        18446744073709551616.0
    }
}

/// Exact arcs, per-shard shares and owned point counts of a ring.
fn ring_arcs(map: &ShardMap, active: &[usize]) -> (Vec<Arc>, Vec<f64>, Vec<u64>) {
    let mut pairs: Vec<(u64, usize)> = Vec::new();
    for &i in active {
        let s = &map.shards[i];
        for v in 0..u64::from(map.vnodes) * u64::from(s.weight) {
            let name = format!("{}#{v}", s.name);
            pairs.push((map.hash.hash(name.as_bytes()), i));
        }
    }
    // Equal values: the later shard in map order wins (map indexes grow in
    // map order, so the last of a run of equal values after sorting).
    pairs.sort_unstable();
    let mut points: Vec<(u64, usize)> = Vec::with_capacity(pairs.len());
    for (j, &p) in pairs.iter().enumerate() {
        if pairs.get(j + 1).is_some_and(|next| next.0 == p.0) {
            continue;
        }
        points.push(p);
    }
    let total = space(map.hash);
    let mut per_shard = vec![0.0f64; map.shards.len()];
    let mut owned = vec![0u64; map.shards.len()];
    let mut arcs: Vec<Arc> = Vec::new();
    let push = |arcs: &mut Vec<Arc>, shard: usize, start: f64, end: f64| {
        if end <= start {
            return;
        }
        if let Some(last) = arcs.last_mut() {
            if last.shard == shard && (last.end - start).abs() < 1e-15 {
                last.end = end;
                return;
            }
        }
        arcs.push(Arc { shard, start, end });
    };
    // A key hashing to h goes to the first point strictly greater than h:
    // [p[j-1], p[j]) belongs to p[j]'s owner; below p[0] and from the last
    // point on, to p[0]'s owner.
    let first_owner = points[0].1;
    let mut prev = 0.0f64;
    for &(p, o) in &points {
        let end = p as f64 / total;
        owned[o] += 1;
        per_shard[o] += end - prev;
        push(&mut arcs, o, prev, end);
        prev = end;
    }
    per_shard[first_owner] += 1.0 - prev;
    push(&mut arcs, first_owner, prev, 1.0);
    (arcs, per_shard, owned)
}

/// The owner at the midpoint of each of [`BUCKETS`] equal buckets, merged.
fn bucketed(arcs: &[Arc]) -> Vec<Arc> {
    let mut out: Vec<Arc> = Vec::new();
    let mut j = 0usize;
    for b in 0..BUCKETS {
        let start = b as f64 / BUCKETS as f64;
        let end = (b + 1) as f64 / BUCKETS as f64;
        let mid = (start + end) / 2.0;
        while j + 1 < arcs.len() && arcs[j].end <= mid {
            j += 1;
        }
        let shard = arcs[j].shard;
        match out.last_mut() {
            Some(last) if last.shard == shard => last.end = end,
            _ => out.push(Arc { shard, start, end }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(algorithm: Algorithm, weights: &[u32]) -> ShardMap {
        let names: Vec<String> = (0..weights.len()).map(|i| format!("s{i}")).collect();
        let mut m = ShardMap::with_shards(algorithm, names).unwrap();
        for (s, &w) in m.shards.iter_mut().zip(weights) {
            s.weight = w;
        }
        m.validate().unwrap();
        m
    }

    fn share_of_keys(m: &ShardMap, n: usize) -> Vec<f64> {
        let r = Router::new(m.clone()).unwrap();
        let mut c = vec![0usize; m.shards.len()];
        for k in 0..n {
            c[r.computed_index(format!("probe-{k}").as_bytes())] += 1;
        }
        c.into_iter().map(|x| x as f64 / n as f64).collect()
    }

    #[test]
    fn ring_arcs_route_like_the_router_and_cover_the_circle() {
        let m = map(Algorithm::Ring, &[1, 2, 1]);
        let s = compute(&m).unwrap();
        assert_eq!(s.method, "ring-points");
        let sum: f64 = s.shards.iter().map(|x| x.share).sum();
        assert!((sum - 1.0).abs() < 1e-9, "{sum}");
        // Arcs tile [0, 1) in order.
        assert_eq!(s.arcs[0].start, 0.0);
        assert_eq!(s.arcs.last().unwrap().end, 1.0);
        for w in s.arcs.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        // The router agrees with the arcs key by key.
        let r = Router::new(m.clone()).unwrap();
        for k in 0..2000 {
            let key = format!("k{k}");
            let f = m.hash.hash(key.as_bytes()) as f64 / space(m.hash);
            let arc = s.arcs.iter().find(|a| a.start <= f && f < a.end).unwrap();
            let want = r.computed_index(key.as_bytes());
            // Float rounding may put a key right on a boundary into the next arc.
            if arc.shard != want {
                let near = s.arcs.iter().any(|a| {
                    a.shard == want && ((a.start - f).abs() < 1e-12 || (a.end - f).abs() < 1e-12)
                });
                assert!(near, "key {key}: arc says {} router says {want}", arc.shard);
            }
        }
        // Shares are near the share of a large key sample.
        let sample = share_of_keys(&m, 50_000);
        for (x, y) in s.shards.iter().zip(sample) {
            assert!((x.share - y).abs() < 0.02, "{} vs {y}", x.share);
        }
        assert_eq!(s.shards[1].points, Some(2 * u64::from(m.vnodes)));
        assert!((s.shards[1].ideal - 0.5).abs() < 1e-12);
    }

    #[test]
    fn sampled_algorithms_follow_weights_and_skip_warming_shards() {
        let mut m = map(Algorithm::Rendezvous, &[1, 3]);
        m.shards.push(shardq_route::Shard {
            state: ShardState::Warming,
            ..shardq_route::Shard::new("new")
        });
        m.validate().unwrap();
        let s = compute(&m).unwrap();
        assert_eq!(s.method, "sample");
        assert_eq!(s.sample_keys, Some(SAMPLE_KEYS_MAX));
        assert!((s.shards[1].share - 0.75).abs() < 0.03, "{:?}", s.shards);
        assert_eq!(s.shards[2].share, 0.0);
        assert_eq!(s.shards[2].state, "warming");
        assert_eq!(s.arcs.len(), 2);
        for alg in [Algorithm::Jump, Algorithm::Modulo, Algorithm::Slots] {
            let s = compute(&map(alg, &[1, 1, 1, 1])).unwrap();
            let sum: f64 = s.shards.iter().map(|x| x.share).sum();
            assert!((sum - 1.0).abs() < 1e-9, "{alg:?}");
        }
    }

    #[test]
    fn a_crowded_ring_is_drawn_in_buckets() {
        let names: Vec<String> = (0..40).map(|i| format!("s{i}")).collect();
        let mut m = ShardMap::with_shards(Algorithm::Ring, names).unwrap();
        m.vnodes = 512;
        let s = compute(&m).unwrap();
        assert_eq!(s.method, "ring-buckets");
        assert!(s.arcs.len() <= BUCKETS);
        let sum: f64 = s.shards.iter().map(|x| x.share).sum();
        assert!((sum - 1.0).abs() < 1e-9);
    }
}
