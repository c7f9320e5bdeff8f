//! Who gets a free slot: the fair queue of a shard's ready keys
//! ([`FairQueue`], start-time fair queuing by weight within a priority),
//! a key's place in line ([`Rank`]), and free slots shared among shards by
//! their keys' ranks ([`shares_by_rank`]).

use std::collections::HashMap;

/// Virtual time one start of a key of weight 1 costs in a [`FairQueue`].
pub const FAIR_STRIDE: u64 = 1 << 20;

/// A queued key: (minus its priority, its start tag, arrival, weight, key).
type FairEntry<K> = (i64, u64, u64, u32, K);

/// A key taken from a [`FairQueue`], with its place.
#[derive(Debug, Clone)]
pub struct Popped<K> {
    /// The key.
    pub key: K,
    priority: i32,
    start: u64,
    weight: u32,
}

impl<K> Popped<K> {
    /// Where the key stood in line.
    pub fn rank(&self) -> Rank {
        Rank::new(self.priority, self.start)
    }
}

/// How many of `free` slots each shard gets when keys are ranked over
/// several shards: their ready keys' ranks merged, the best `free` counted
/// per shard; shards in the order of their best key (shards with no rank
/// among the best get none). Equal ranks on several shards (new keys all
/// start at the virtual time) go round the shards, from the one at `first`
/// (a caller turns it from call to call), so no shard takes every tie.
pub fn shares_by_rank<S: Clone + PartialEq>(
    ranks: &[(S, Vec<Rank>)],
    free: usize,
    first: usize,
) -> Vec<(S, usize)> {
    let n = ranks.len().max(1);
    let mut all: Vec<(Rank, usize, usize, usize)> = (ranks.iter().enumerate())
        .flat_map(|(i, (_, r))| {
            let turn = (i + n - first % n) % n;
            r.iter().enumerate().map(move |(j, r)| (*r, j, turn, i))
        })
        .collect();
    all.sort_unstable();
    let mut shares: Vec<(S, usize)> = Vec::new();
    for (_, _, _, i) in all.into_iter().take(free) {
        let shard = &ranks[i].0;
        match shares.iter_mut().find(|(s, _)| s == shard) {
            Some((_, n)) => *n += 1,
            None => shares.push((shard.clone(), 1)),
        }
    }
    shares
}

/// Where a ready key stands in line for a slot: the higher priority first,
/// then the smaller start tag. Ranks from the shards of one process
/// compare, as their queues share the process's virtual time
/// ([`FlowControl::fair_vtime`](super::FlowControl::fair_vtime)): the
/// smaller goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    neg_priority: i64,
    start: u64,
}

impl Rank {
    /// Before every key's rank: what a shard reports when it must be
    /// claimed from whatever its keys' ranks (work only a claim does, such
    /// as ending cancelled runs, or an error only a claim reports).
    pub const FIRST: Rank = Rank {
        neg_priority: i64::MIN,
        start: 0,
    };

    /// The rank of a key of `priority` whose start tag is `start`.
    pub fn new(priority: i32, start: u64) -> Rank {
        Rank {
            neg_priority: -i64::from(priority),
            start,
        }
    }

    /// The key's priority class.
    pub fn priority(&self) -> i32 {
        i32::try_from(self.neg_priority.saturating_neg()).unwrap_or(i32::MAX)
    }

    /// The key's start tag (virtual time).
    pub fn start(&self) -> u64 {
        self.start
    }
}

/// Ready keys in the order they get slots: the highest priority first, and
/// within a priority start-time fair queuing by weight. A key's start tag
/// is the later of the queue's virtual time and its own finish tag; the
/// smallest starts first, moves the virtual time to its tag, and adds
/// `FAIR_STRIDE / weight` to its own. Backlogged keys of weights 1, 2 and
/// 4 so start in the ratio 1:2:4, and a key that becomes ready starts from
/// the virtual time, not behind a backlogged key's history.
#[derive(Debug, Clone)]
pub struct FairQueue<K> {
    heap: std::collections::BinaryHeap<std::cmp::Reverse<FairEntry<K>>>,
    tags: HashMap<K, u64>,
    vtime: u64,
    seq: u64,
}

impl<K> Default for FairQueue<K> {
    fn default() -> Self {
        FairQueue {
            heap: std::collections::BinaryHeap::new(),
            tags: HashMap::new(),
            vtime: 0,
            seq: 0,
        }
    }
}

impl<K: Ord + Clone + std::hash::Hash> FairQueue<K> {
    /// Queues ready key `k` of `priority` and `weight`.
    pub fn push(&mut self, k: K, priority: i32, weight: u32) {
        let start = self.tags.get(&k).copied().unwrap_or(0).max(self.vtime);
        self.seq += 1;
        self.heap.push(std::cmp::Reverse((
            -i64::from(priority),
            start,
            self.seq,
            weight.max(1),
            k,
        )));
    }

    /// The next key in line, not yet charged: [`FairQueue::charge`] it if
    /// it starts (a key passed over, not due or over its limit, pays
    /// nothing).
    pub fn pop(&mut self) -> Option<Popped<K>> {
        let std::cmp::Reverse((neg_priority, start, _, weight, k)) = self.heap.pop()?;
        Some(Popped {
            key: k,
            priority: -neg_priority as i32,
            start,
            weight,
        })
    }

    /// The ranks of the first `max` queued keys that `startable` accepts,
    /// best first, a key queued twice counted once at its better place;
    /// nothing is taken or charged.
    pub fn ranks(&self, max: usize, mut startable: impl FnMut(&K) -> bool) -> Vec<Rank> {
        let mut all: Vec<(Rank, &K)> = (self.heap.iter())
            .filter(|std::cmp::Reverse(e)| startable(&e.4))
            .map(|std::cmp::Reverse(e)| {
                let rank = Rank {
                    neg_priority: e.0,
                    start: e.1,
                };
                (rank, &e.4)
            })
            .collect();
        all.sort_unstable_by_key(|a| a.0);
        let mut seen = std::collections::HashSet::new();
        (all.into_iter())
            .filter(|(_, k)| seen.insert(*k))
            .map(|(r, _)| r)
            .take(max)
            .collect()
    }

    /// The rank key `k` of `priority` would have queued now.
    pub fn rank_of(&self, k: &K, priority: i32) -> Rank {
        let start = self.tags.get(k).copied().unwrap_or(0).max(self.vtime);
        Rank::new(priority, start)
    }

    /// The virtual time: the start tag of the latest key charged, or
    /// later when raised.
    pub fn vtime(&self) -> u64 {
        self.vtime
    }

    /// Moves the virtual time on to `v` if it is later (the process's
    /// virtual time over all its shards), so keys queued next start there.
    pub fn raise_vtime(&mut self, v: u64) {
        self.vtime = self.vtime.max(v);
    }

    /// Charges a popped key for one start.
    pub fn charge(&mut self, p: &Popped<K>) {
        self.vtime = self.vtime.max(p.start);
        self.tags
            .insert(p.key.clone(), p.start + FAIR_STRIDE / u64::from(p.weight));
        if self.tags.len() > 2 * self.heap.len() + 1_024 {
            // A tag at or below the virtual time is what a new key gets.
            let v = self.vtime;
            self.tags.retain(|_, t| *t > v);
        }
    }

    /// The keys queued, in no order, leaving it empty (tags are kept).
    pub fn drain(&mut self) -> Vec<K> {
        self.heap.drain().map(|std::cmp::Reverse(e)| e.4).collect()
    }

    /// Forgets `k`'s finish tag (its id is about to name another key).
    pub fn forget(&mut self, k: &K) {
        self.tags.remove(k);
    }

    /// Whether no key is queued.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.heap.clear();
        self.tags.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// Free slots go to the best ranks over every shard; equal ranks go
    /// round the shards from `first`, one key of each in turn; a shard that
    /// ranks `Rank::FIRST` (it must be claimed from) goes before all.
    #[test]
    fn shares_by_rank_follow_the_best_ranks_and_take_turns_on_ties() {
        let r = |p: i32, s: u64| Rank::new(p, s);
        let ranks = vec![
            ("a", vec![r(0, 5), r(0, 5), r(0, 9)]),
            ("b", vec![r(0, 5), r(0, 7)]),
            ("c", vec![r(1, 100)]),
        ];
        assert_eq!(
            shares_by_rank(&ranks, 1, 0),
            vec![("c", 1)],
            "priority first"
        );
        assert_eq!(shares_by_rank(&ranks, 2, 0), vec![("c", 1), ("a", 1)]);
        assert_eq!(shares_by_rank(&ranks, 2, 1), vec![("c", 1), ("b", 1)]);
        assert_eq!(
            shares_by_rank(&ranks, 4, 0),
            vec![("c", 1), ("a", 2), ("b", 1)],
            "ties take turns: a, b, then a again"
        );
        assert_eq!(
            shares_by_rank(&ranks, 9, 0),
            vec![("c", 1), ("a", 3), ("b", 2)]
        );
        let urgent = vec![("a", vec![r(9, 0)]), ("b", vec![Rank::FIRST])];
        assert_eq!(shares_by_rank(&urgent, 1, 0), vec![("b", 1)]);
        assert_eq!(Rank::FIRST.priority(), i32::MAX);
    }

    #[test]
    fn fair_queue_shares_by_weight_within_a_priority_and_serves_higher_first() {
        let mut q = FairQueue::default();
        let mut count = BTreeMap::new();
        for (k, w) in [("a", 1), ("b", 2), ("c", 4)] {
            q.push(k, 0, w);
        }
        for _ in 0..7_000 {
            let p = q.pop().expect("backlogged");
            q.charge(&p);
            let k = p.key;
            *count.entry(k).or_insert(0) += 1;
            let w = match k {
                "a" => 1,
                "b" => 2,
                _ => 4,
            };
            q.push(k, 0, w);
        }
        assert_eq!((count["a"], count["b"], count["c"]), (1_000, 2_000, 4_000));
        // A higher priority goes first; a newcomer is not behind history.
        q.push("vip", 5, 1);
        assert_eq!(q.pop().map(|p| p.key), Some("vip"));
        q.push("new", 0, 1);
        let mut next = Vec::new();
        while let Some(p) = q.pop() {
            q.charge(&p);
            next.push(p.key);
        }
        assert!(next.contains(&"new"), "{next:?}");
        // A key passed over (not charged) keeps its place.
        let mut q = FairQueue::default();
        q.push("x", 0, 1);
        q.push("y", 0, 1);
        let passed = q.pop().expect("x");
        q.push(passed.key, 0, 1);
        let y = q.pop().expect("y");
        q.charge(&y);
        q.push(y.key, 0, 1);
        assert_eq!(
            q.pop().map(|p| p.key),
            Some(passed.key),
            "the key passed over paid nothing, so it goes before the one that started"
        );
    }
}
