//! The key of every queued job by its id, in 12 bytes a job: job ids are
//! log positions, so a shard enqueues them in increasing order and the
//! index is two sorted vectors appended at their end, searched by
//! bisection. A job that leaves is marked gone (its key set to
//! [`GONE`]); the marks are swept out once they are half the entries, so
//! the index costs amortised O(1) a change and O(log n) a lookup, and
//! never more than twice the queued jobs. A job put back out of order (a
//! dead letter retried) is inserted at its place, which is rare.
//!
//! It answers [`crate::state::ShardState::live_job`] without a walk of
//! every key's queue.

/// The key slot of an entry whose job left.
const GONE: u32 = u32::MAX;

/// Job id -> key slot of the queued jobs of one shard.
#[derive(Debug, Default)]
pub(crate) struct IdIndex {
    ids: Vec<u64>,
    keys: Vec<u32>,
    gone: usize,
}

impl IdIndex {
    /// Job `id` is queued on key slot `key`.
    pub fn insert(&mut self, id: u64, key: u32) {
        if self.ids.last().is_none_or(|&last| last < id) {
            self.ids.push(id);
            self.keys.push(key);
            return;
        }
        match self.ids.binary_search(&id) {
            Ok(i) => {
                if self.keys[i] == GONE {
                    self.gone -= 1;
                }
                self.keys[i] = key;
            }
            Err(i) => {
                self.ids.insert(i, id);
                self.keys.insert(i, key);
            }
        }
    }

    /// Job `id` is no longer queued.
    pub fn remove(&mut self, id: u64) {
        let Ok(i) = self.ids.binary_search(&id) else {
            return;
        };
        if self.keys[i] == GONE {
            return;
        }
        self.keys[i] = GONE;
        self.gone += 1;
        if self.gone * 2 > self.ids.len() {
            self.sweep();
        }
    }

    /// Jobs `ids` are no longer queued: as [`IdIndex::remove`] of each,
    /// but when they are sorted and not few beside the index (a key's
    /// backlog purged), in one walk of the index instead of a search each.
    pub fn remove_many(&mut self, ids: &[u64]) {
        if ids.len() < 64 || ids.len() * 4 < self.ids.len() || !ids.is_sorted() {
            for &id in ids {
                self.remove(id);
            }
            return;
        }
        let mut i = 0;
        for &id in ids {
            while i < self.ids.len() && self.ids[i] < id {
                i += 1;
            }
            if i == self.ids.len() {
                break;
            }
            if self.ids[i] == id && self.keys[i] != GONE {
                self.keys[i] = GONE;
                self.gone += 1;
            }
        }
        if self.gone * 2 > self.ids.len() {
            self.sweep();
        }
    }

    /// The key slot of queued job `id`.
    pub fn get(&self, id: u64) -> Option<u32> {
        let i = self.ids.binary_search(&id).ok()?;
        Some(self.keys[i]).filter(|&k| k != GONE)
    }

    /// Drops every entry `gone` says left (a bulk removal).
    pub fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
        for (id, key) in self.ids.iter().zip(self.keys.iter_mut()) {
            if *key != GONE && !keep(*id) {
                *key = GONE;
                self.gone += 1;
            }
        }
        self.sweep();
    }

    /// Queued jobs indexed.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.ids.len() - self.gone
    }

    fn sweep(&mut self) {
        let mut w = 0;
        for r in 0..self.ids.len() {
            if self.keys[r] != GONE {
                self.ids[w] = self.ids[r];
                self.keys[w] = self.keys[r];
                w += 1;
            }
        }
        self.ids.truncate(w);
        self.keys.truncate(w);
        self.gone = 0;
        if self.ids.capacity() > 4 * w.max(1024) {
            self.ids.shrink_to(2 * w);
            self.keys.shrink_to(2 * w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a map, through appends, out-of-order inserts, removals that
    /// trigger sweeps, and a bulk removal.
    #[test]
    fn it_answers_as_a_map_would() {
        let mut x = IdIndex::default();
        let mut m = std::collections::BTreeMap::new();
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        let mut top = 0u64;
        for _ in 0..20_000 {
            match next() % 4 {
                0 | 1 => {
                    top += 1 + next() % 5;
                    let k = (next() % 50) as u32;
                    x.insert(top, k);
                    m.insert(top, k);
                }
                2 => {
                    let id = next() % (top + 1);
                    x.remove(id);
                    m.remove(&id);
                }
                _ => {
                    // A dead letter retried: an old id back.
                    let id = next() % (top + 1);
                    let k = (next() % 50) as u32;
                    x.insert(id, k);
                    m.insert(id, k);
                }
            }
        }
        for id in 0..=top + 1 {
            assert_eq!(x.get(id), m.get(&id).copied(), "id {id}");
        }
        assert_eq!(x.len(), m.len());
        // Removals in bulk answer as removals one by one do.
        let mut y = IdIndex::default();
        for (&id, &k) in x.ids.iter().zip(x.keys.iter()) {
            if k != GONE {
                y.insert(id, k);
            }
        }
        let sorted: Vec<u64> = (0..=top).filter(|id| id % 7 != 2).collect();
        let mut each = IdIndex::default();
        for (&id, &k) in x.ids.iter().zip(x.keys.iter()) {
            if k != GONE {
                each.insert(id, k);
            }
        }
        y.remove_many(&sorted);
        for &id in &sorted {
            each.remove(id);
        }
        let few: Vec<u64> = (0..=top).step_by(97).collect();
        y.remove_many(&few);
        for &id in &few {
            each.remove(id);
        }
        for id in 0..=top + 1 {
            assert_eq!(y.get(id), each.get(id), "id {id} after remove_many");
        }
        assert_eq!(y.len(), each.len());
        x.retain(|id| id % 3 != 0);
        m.retain(|id, _| id % 3 != 0);
        for id in 0..=top {
            assert_eq!(x.get(id), m.get(&id).copied(), "id {id} after retain");
        }
        assert_eq!(x.len(), m.len());
        assert!(x.ids.len() == x.len(), "swept");
    }
}
