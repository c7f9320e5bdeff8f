//! [`FileGroupBuckets`]: the buckets and run slots of flow-control groups,
//! shared by every process of an embedded deployment through one small file.
//!
//! `flow-groups.json` in the data dir holds every group's [`GroupState`]
//! (its bucket and the run slots taken, each with when it lapses) as JSON.
//! Each take reads it, changes one group and writes it back in place
//! while holding the file's own flock (bounded by
//! [`GROUP_LOCK_WAIT_MS`]), so starts counted by any process on the host
//! count for all. It is soft state, written without an fsync: a lost or
//! unreadable file only refills the buckets (each group may then let one
//! more burst through, and forgets its slots, so up to its concurrency
//! more runs may start beside those running), never loses or holds a job
//! for good. A file that does not parse is written over with fresh groups,
//! so a flipped byte costs a refill, not a stuck group.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use rustix::fs::{flock, FlockOperation};
use shardq_core::flow::{
    free_group_slots, hold_group, renew_group_slots, resume_group, take_group, take_group_many,
    GroupState, SlotAsk,
};
use shardq_core::{ErrorKind, GroupBuckets, GroupLimit, QueueError};

use crate::error::FsError;
use crate::layout::flock_within;

/// The file, in the data dir.
pub const GROUP_BUCKETS_FILE: &str = "flow-groups.json";
/// Longest wait for the file's lock before a take fails as unavailable.
pub const GROUP_LOCK_WAIT_MS: u64 = 500;

/// Group buckets in `flow-groups.json` (see the module header).
#[derive(Debug)]
pub struct FileGroupBuckets {
    path: PathBuf,
    file: Mutex<Option<File>>,
}

impl FileGroupBuckets {
    /// The buckets of the deployment in data dir `dir` (the file is
    /// created at the first take).
    pub fn new(dir: &Path) -> FileGroupBuckets {
        FileGroupBuckets {
            path: dir.join(GROUP_BUCKETS_FILE),
            file: Mutex::new(None),
        }
    }

    fn io(&self, what: &str, e: std::io::Error) -> QueueError {
        let err = FsError::io(format!("{what} {}", self.path.display()), e);
        QueueError::store(ErrorKind::Retryable, err)
    }

    /// Runs `change` on the buckets under the file's lock and writes them
    /// back.
    fn with_buckets<T>(
        &self,
        change: impl FnOnce(&mut BTreeMap<String, GroupState>) -> T,
    ) -> Result<T, QueueError> {
        let mut slot = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&self.path)
                .map_err(|e| self.io("opening", e))?;
            *slot = Some(f);
        }
        let f = slot.as_mut().expect("opened above");
        let shown = self.path.display().to_string();
        if let Err(holder) = flock_within(f, Duration::from_millis(GROUP_LOCK_WAIT_MS), &shown)
            .map_err(|e| self.io("locking", e))?
        {
            return Err(QueueError::Unavailable {
                shard: "*".into(),
                reason: format!(
                    "the group buckets {shown} stayed locked by another process for \
                     {GROUP_LOCK_WAIT_MS} ms ({holder})"
                ),
            });
        }
        let res = (|| {
            let mut text = Vec::new();
            f.seek(SeekFrom::Start(0))
                .and_then(|_| f.read_to_end(&mut text))
                .map_err(|e| self.io("reading", e))?;
            // Unreadable state is refilled (see the header).
            // The first JSON value only: a write cut short between its
            // bytes and the file's new length leaves old bytes after it.
            let mut buckets: BTreeMap<String, GroupState> =
                serde_json::Deserializer::from_slice(&text)
                    .into_iter()
                    .next()
                    .and_then(Result::ok)
                    .unwrap_or_default();
            let out = change(&mut buckets);
            let new = serde_json::to_vec(&buckets).map_err(|e| QueueError::Internal {
                what: format!("encoding group buckets: {e}"),
            })?;
            f.seek(SeekFrom::Start(0))
                .and_then(|_| f.write_all(&new))
                .and_then(|_| f.set_len(new.len() as u64))
                .map_err(|e| self.io("writing", e))?;
            Ok(out)
        })();
        let _ = flock(&*f, FlockOperation::Unlock);
        if res.is_err() {
            // Open it again next time (the file may have been replaced).
            *slot = None;
        }
        res
    }
}

impl GroupBuckets for FileGroupBuckets {
    fn take(
        &self,
        group: &str,
        limit: &GroupLimit,
        now_ms: u64,
        slot: Option<SlotAsk<'_>>,
    ) -> Result<Result<(), u64>, QueueError> {
        self.with_buckets(|b| take_group(b, group, limit, now_ms, slot))
    }

    fn take_many(
        &self,
        group: &str,
        limit: &GroupLimit,
        now_ms: u64,
        asks: &[SlotAsk<'_>],
    ) -> Result<(usize, u64), QueueError> {
        self.with_buckets(|b| take_group_many(b, group, limit, now_ms, asks))
    }

    fn hold(&self, group: &str, limit: &GroupLimit, until_ms: u64) -> Result<(), QueueError> {
        self.with_buckets(|b| hold_group(b, group, limit, until_ms))
    }

    fn resume(&self, group: &str, _limit: &GroupLimit) -> Result<(), QueueError> {
        self.with_buckets(|b| resume_group(b, group))
    }

    fn peek(&self, group: &str) -> Result<Option<GroupState>, QueueError> {
        self.with_buckets(|b| b.get(group).cloned())
    }

    fn free_slots(&self, group: &str, holders: &[&str]) -> Result<(), QueueError> {
        self.with_buckets(|b| free_group_slots(b, group, holders))
    }

    fn renew_slots(&self, group: &str, holders: &[&str], until_ms: u64) -> Result<(), QueueError> {
        self.with_buckets(|b| renew_group_slots(b, group, holders, until_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit() -> GroupLimit {
        GroupLimit {
            rate: Some("10/s".parse().expect("rate")),
            burst: Some(3),
            concurrency: Some(2),
        }
    }

    /// Two handles on one file (two processes) share one bucket; a
    /// damaged file is refilled, not stuck.
    #[test]
    fn two_handles_share_a_bucket_and_damage_refills_it() {
        let dir = tempfile::tempdir().expect("tmp");
        let a = FileGroupBuckets::new(dir.path());
        let b = FileGroupBuckets::new(dir.path());
        let l = limit();
        assert_eq!(a.take("g", &l, 0, None).unwrap(), Ok(()));
        assert_eq!(b.take("g", &l, 0, None).unwrap(), Ok(()));
        assert_eq!(a.take("g", &l, 0, None).unwrap(), Ok(()));
        assert_eq!(
            b.take("g", &l, 0, None).unwrap(),
            Err(100),
            "the burst is shared"
        );
        b.hold("g", &l, 1_000).unwrap();
        assert_eq!(
            a.take("g", &l, 500, None).unwrap(),
            Err(1_000),
            "held for all"
        );
        // Old bytes past a shorter write are ignored.
        let path = dir.path().join(GROUP_BUCKETS_FILE);
        let mut text = std::fs::read(&path).unwrap();
        text.extend_from_slice(b"\"tail\": 1}");
        std::fs::write(&path, &text).unwrap();
        assert_eq!(
            a.take("g", &l, 500, None).unwrap(),
            Err(1_000),
            "still held"
        );
        std::fs::write(dir.path().join(GROUP_BUCKETS_FILE), b"{\"g\":{\"units\":").unwrap();
        assert_eq!(a.take("g", &l, 500, None).unwrap(), Ok(()), "refilled");
        let text = std::fs::read_to_string(dir.path().join(GROUP_BUCKETS_FILE)).unwrap();
        assert!(text.starts_with('{') && text.ends_with('}'), "{text}");
    }

    /// Run slots are shared by two handles, and given back by either.
    #[test]
    fn two_handles_share_run_slots() {
        let dir = tempfile::tempdir().expect("tmp");
        let a = FileGroupBuckets::new(dir.path());
        let b = FileGroupBuckets::new(dir.path());
        let l = GroupLimit {
            rate: None,
            burst: None,
            concurrency: Some(2),
        };
        let ask = |holder| {
            Some(SlotAsk {
                holder,
                until_ms: 1_000,
            })
        };
        assert_eq!(a.take("g", &l, 0, ask("k1")).unwrap(), Ok(()));
        assert_eq!(b.take("g", &l, 0, ask("k2")).unwrap(), Ok(()));
        assert_eq!(a.take("g", &l, 0, ask("k3")).unwrap(), Err(20), "full");
        b.free_slots("g", &["k1"]).unwrap();
        assert_eq!(a.take("g", &l, 1, ask("k3")).unwrap(), Ok(()));
        a.renew_slots("g", &["k2"], 5_000).unwrap();
        let st = b.peek("g").unwrap().expect("stored");
        assert_eq!(st.running(1_000), 1, "k3 lapsed, k2 renewed: {st:?}");
    }
}
