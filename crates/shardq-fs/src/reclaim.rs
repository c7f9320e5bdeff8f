//! The reclaimed ranges of a shard's log: position ranges whose jobs are all
//! finished, kept in `reclaimed.json` in the shard directory.
//!
//! A range is recorded (atomically, after the records that finished its jobs
//! are durable) before any segment file in it is deleted, so a segment that
//! is missing from the middle of the log is either in a recorded range or
//! lost (reported as corruption). Ranges are merged when they touch, so there
//! are never more of them than kept segments plus one.
//!
//! This module only reads and writes the list; it must never delete a
//! segment (compaction in the backend does, after writing the list).

use std::path::Path;

use serde::{Deserialize, Serialize};
use shardq_core::QueueError;

/// File name in the shard directory.
pub const RECLAIMED_FILE: &str = "reclaimed.json";
/// Value of the `format` field.
pub const RECLAIMED_FORMAT: &str = "shardq-reclaimed";
/// Current format version.
pub const RECLAIMED_VERSION: u32 = 2;
/// Largest file read (4 MiB, about 90,000 ranges): bounds a corrupt file.
const RECLAIMED_BYTES_MAX: u64 = 4 << 20;

/// Sorted, disjoint, non-touching `[start, end)` position ranges, and the
/// shard's run-fence high-water when they were recorded (claim records in
/// deleted segments can no longer tell it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reclaimed {
    ranges: Vec<(u64, u64)>,
    fence_high: u64,
}

#[derive(Serialize, Deserialize)]
struct ReclaimedFile {
    format: String,
    version: u32,
    ranges: Vec<(u64, u64)>,
    fence_high: u64,
}

impl Reclaimed {
    /// The ranges, ascending.
    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }

    /// The largest run fence issued before these ranges were recorded.
    pub fn fence_high(&self) -> u64 {
        self.fence_high
    }

    /// Raises the recorded fence high-water to at least `fence`.
    pub fn raise_fence_high(&mut self, fence: u64) {
        self.fence_high = self.fence_high.max(fence);
    }

    /// The range holding `pos`, if any.
    fn range_of(&self, pos: u64) -> Option<(u64, u64)> {
        let i = self.ranges.partition_point(|&(a, _)| a <= pos);
        let (a, b) = *self.ranges.get(i.checked_sub(1)?)?;
        (pos < b).then_some((a, b))
    }

    /// Whether the job at position `pos` was reclaimed.
    pub fn contains(&self, pos: u64) -> bool {
        self.range_of(pos).is_some()
    }

    /// Whether all of `[start, end)` is reclaimed.
    pub fn covers(&self, start: u64, end: u64) -> bool {
        start >= end || self.range_of(start).is_some_and(|(_, b)| end <= b)
    }

    /// Whether any of `[start, end)` is reclaimed.
    pub fn overlaps(&self, start: u64, end: u64) -> bool {
        let i = self.ranges.partition_point(|&(_, b)| b <= start);
        self.ranges.get(i).is_some_and(|&(a, _)| a < end)
    }

    /// Adds `[start, end)`, merging with touching or overlapping ranges.
    pub fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let (mut a, mut b) = (start, end);
        let lo = self.ranges.partition_point(|&(_, e)| e < a);
        let mut hi = lo;
        while hi < self.ranges.len() && self.ranges[hi].0 <= b {
            a = a.min(self.ranges[hi].0);
            b = b.max(self.ranges[hi].1);
            hi += 1;
        }
        self.ranges.splice(lo..hi, [(a, b)]);
    }

    /// Adds every range of `other`.
    pub fn extend(&mut self, other: &Reclaimed) {
        self.raise_fence_high(other.fence_high);
        for &(a, b) in &other.ranges {
            self.insert(a, b);
        }
    }

    /// Reads the shard directory's list; none yet means nothing reclaimed.
    pub fn load(
        storage: &dyn crate::storage::Storage,
        shard: &str,
        dir: &Path,
    ) -> Result<Reclaimed, QueueError> {
        let path = dir.join(RECLAIMED_FILE);
        let corrupt = |reason: String| QueueError::Corrupt {
            shard: shard.to_string(),
            segment: RECLAIMED_FILE.into(),
            offset: 0,
            reason: format!("{}: {reason}; it was not changed", path.display()),
        };
        let bytes = match storage.read_file(&path, RECLAIMED_BYTES_MAX) {
            Ok(Some(b)) => b,
            Ok(None) => return Ok(Reclaimed::default()),
            Err(e) => return Err(QueueError::io(format!("reading {}", path.display()), e)),
        };
        let text = String::from_utf8(bytes).map_err(|_| corrupt("not UTF-8 text".into()))?;
        if text.len() as u64 > RECLAIMED_BYTES_MAX {
            return Err(corrupt(format!("larger than {RECLAIMED_BYTES_MAX} bytes")));
        }
        let parsed: ReclaimedFile =
            serde_json::from_str(&text).map_err(|e| corrupt(format!("does not parse: {e}")))?;
        if parsed.format != RECLAIMED_FORMAT || parsed.version != RECLAIMED_VERSION {
            return Err(corrupt(format!(
                "format {:?} version {} (expected {RECLAIMED_FORMAT:?} version {RECLAIMED_VERSION})",
                parsed.format, parsed.version
            )));
        }
        let ordered = parsed.ranges.iter().all(|&(a, b)| a < b)
            && parsed.ranges.windows(2).all(|w| w[0].1 < w[1].0);
        if !ordered {
            return Err(corrupt(
                "ranges are not ascending, disjoint and non-empty".into(),
            ));
        }
        Ok(Reclaimed {
            ranges: parsed.ranges,
            fence_high: parsed.fence_high,
        })
    }

    /// Replaces the shard directory's list atomically (temp file, fsync,
    /// rename, fsync dir).
    pub fn store(&self, dir: &Path, storage: &dyn crate::storage::Storage) -> std::io::Result<()> {
        let file = ReclaimedFile {
            format: RECLAIMED_FORMAT.into(),
            version: RECLAIMED_VERSION,
            ranges: self.ranges.clone(),
            fence_high: self.fence_high,
        };
        let text = serde_json::to_string(&file).map_err(std::io::Error::other)?;
        storage.write_file_atomic(&dir.join(RECLAIMED_FILE), text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(inserts: &[(u64, u64)], expected: &[(u64, u64)]) {
        let mut r = Reclaimed::default();
        for &(a, b) in inserts {
            r.insert(a, b);
        }
        assert_eq!(r.ranges(), expected, "after inserting {inserts:?}");
    }

    #[test]
    fn ranges_merge_when_they_touch() {
        check(&[(10, 20)], &[(10, 20)]);
        check(&[(10, 20), (20, 30)], &[(10, 30)]);
        check(&[(20, 30), (10, 20)], &[(10, 30)]);
        check(&[(10, 20), (30, 40)], &[(10, 20), (30, 40)]);
        check(&[(10, 20), (30, 40), (20, 30)], &[(10, 40)]);
        check(&[(10, 20), (30, 40), (50, 60), (15, 55)], &[(10, 60)]);
        check(&[(10, 20), (12, 14)], &[(10, 20)]);
        check(&[(5, 5)], &[]);
    }

    #[test]
    fn lookups() {
        let mut r = Reclaimed::default();
        r.insert(10, 20);
        r.insert(30, 40);
        for (pos, inside) in [(9, false), (10, true), (19, true), (20, false), (35, true)] {
            assert_eq!(r.contains(pos), inside, "contains({pos})");
        }
        assert!(r.covers(10, 20) && r.covers(12, 15) && !r.covers(15, 31));
        assert!(r.overlaps(15, 31) && r.overlaps(0, 11) && !r.overlaps(20, 30));
    }
}
