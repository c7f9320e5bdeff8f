//! The state files a shard keeps beside its log: `fence.json`,
//! `transfers.json` (import cursors), `moved.jsonl` (ids that moved away),
//! `moved_in.jsonl` (ids of the copies imports stored) and `finished.jsonl`
//! (finished jobs, cut to the retention).

use super::*;

/// Largest `fence.json` read (its paused keys are bounded by the
/// rebalance batch, so it is a few KiB).
pub(super) const FENCE_FILE_BYTES_MAX: u64 = 4 << 20;
/// Fence file in each shard directory.
pub const FENCE_FILE: &str = "fence.json";
/// File in a shard's directory: per (shard copied from, key), the largest
/// source id imported by a move. The Import records say the same while
/// their segments exist; this outlives them, so a rerun of a move never
/// imports a job twice after its copies ran and were compacted away.
pub const TRANSFERS_FILE: &str = "transfers.json";
/// Largest transfers file read.
pub(super) const TRANSFERS_FILE_BYTES_MAX: u64 = 64 << 20;

/// File in a shard's directory: one JSON line per key a move purged here,
/// `{"key": KEY, "ids": [ID, ...]}` (the ids it deleted, whose copies run on
/// the key's new shard), oldest first, so that an id from before a move
/// still answers where its job went ([`MoveKeys::moved_away`]). Once
/// past [`MOVED_FILE_REWRITE_BYTES`] it is rewritten with what the bounds
/// of [`MovedAway`] keep; a line holds at most `MOVED_IDS_KEPT` ids.
pub const MOVED_FILE: &str = "moved.jsonl";
/// Size past which the moved file is cut back to the bounds (an id takes
/// at most 21 bytes, so the ids a cut file keeps take at most 42 MB).
pub(super) const MOVED_FILE_REWRITE_BYTES: u64 = 48 << 20;
/// Largest moved file read: a full one plus one line.
pub(super) const MOVED_FILE_BYTES_MAX: u64 = 96 << 20;

/// File in a shard's directory: one JSON line per job that finished here
/// (acked or cancelled), a [`FinishedJob`], oldest first, for
/// [`InspectJobs::finished`]. Appended after the record that finished the
/// jobs, without an fsync (it is what happened, not what must run: a crash
/// may lose its last lines, never a job); past its cut size it is
/// rewritten with what the [`Retention`] keeps: its `finished_jobs` newest
/// lines whatever their length, up to [`FINISHED_FILE_BYTES_MAX`].
pub const FINISHED_FILE: &str = "finished.jsonl";
/// Bytes per job of the retention past which the finished file is cut back
/// (a line takes about 120 to 300 bytes), and never below
/// [`FINISHED_FILE_CUT_BYTES_MIN`]: see [`finished_cut_bytes`].
pub(super) const FINISHED_FILE_BYTES_PER_JOB: u64 = 512;
/// The finished file is never cut below this size: a cut reads the file's
/// end and replaces the file (an fsync), so it must be rare under a busy
/// shard (about every 30,000 acks).
pub(super) const FINISHED_FILE_CUT_BYTES_MIN: u64 = 8 << 20;

/// Most bytes of finished lines a shard keeps (256 MiB): the retention's
/// `finished_jobs` newest jobs are kept whatever their lines' length (a
/// long key or failure reason makes a line up to ~9 KiB), up to this.
pub const FINISHED_FILE_BYTES_MAX: u64 = 256 << 20;

/// The size past which the finished file is cut for `keep`. A cut keeps at
/// most half of it (the newest lines, at most `keep.finished_jobs` of
/// them), so between cuts the file grows by at least half of it, and a
/// reader never needs more than its last `finished_cut_bytes` plus one
/// batch of lines.
pub(super) fn finished_cut_bytes(keep: Retention) -> u64 {
    (FINISHED_FILE_BYTES_PER_JOB * keep.finished_jobs as u64).max(FINISHED_FILE_CUT_BYTES_MIN)
}

/// Most bytes one ack batch adds to the finished file (1,024 lines of at
/// most about 9 KiB each, escaped key and reason included), which a reader
/// reads past the cut size.
pub(super) const FINISHED_BATCH_BYTES_MAX: u64 = 10 << 20;

/// File in a shard's directory: one JSON line per import a move made here,
/// `{"from": SHARD, "pairs": [[SOURCE ID, NEW ID], ...]}`, oldest first, so
/// that an id from before a move finds its copy
/// ([`MoveKeys::imported_as`]). Appended after the Import records, synced
/// with them by [`MoveKeys::sync_imports`] (before the old shard forgets
/// the jobs); cut back like [`MOVED_FILE`] to the bounds of
/// [`shardq_core::MovedIn`]. A pair takes at most 43 bytes.
pub const MOVED_IN_FILE: &str = "moved_in.jsonl";
/// Size past which the moved-in file is cut back to the bounds.
pub(super) const MOVED_IN_FILE_REWRITE_BYTES: u64 = 96 << 20;
/// Largest moved-in file read: a full one plus one line.
pub(super) const MOVED_IN_FILE_BYTES_MAX: u64 = 192 << 20;

/// One line of [`MOVED_FILE`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct MovedLine {
    pub(super) key: String,
    pub(super) ids: Vec<u64>,
}

/// One line of [`MOVED_IN_FILE`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct MovedInLine {
    pub(super) from: String,
    pub(super) pairs: Vec<(u64, u64)>,
}

/// A line of a bounded JSON-lines history ([`MOVED_FILE`],
/// [`MOVED_IN_FILE`]): how many ids it holds, for the bounds.
pub(super) trait Counted: serde::Serialize + serde::de::DeserializeOwned {
    fn ids(&self) -> usize;
}

impl Counted for MovedLine {
    fn ids(&self) -> usize {
        self.ids.len()
    }
}

impl Counted for MovedInLine {
    fn ids(&self) -> usize {
        self.pairs.len()
    }
}

/// One line of [`TRANSFERS_FILE`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Transferred {
    pub(super) from: String,
    pub(super) key: String,
    pub(super) up_to: u64,
}

impl FsBackend {
    pub(super) fn read_transfers(&self, dir: &Path) -> Result<Vec<Transferred>, QueueError> {
        let path = dir.join(TRANSFERS_FILE);
        let bytes = self
            .opts
            .storage
            .read_file(&path, TRANSFERS_FILE_BYTES_MAX)
            .map_err(|e| QueueError::io(format!("reading {}", path.display()), e))?;
        let Some(bytes) = bytes else {
            return Ok(Vec::new());
        };
        serde_json::from_slice(&bytes).map_err(|e| QueueError::BadFile {
            path: path.display().to_string(),
            what: "transfers file",
            reason: e.to_string(),
        })
    }

    /// The lines of the JSON-lines file `name` of a shard, oldest first; a
    /// line that does not parse (the torn end of an append a crash cut) is
    /// skipped.
    pub(super) fn read_lines<T: serde::de::DeserializeOwned>(
        &self,
        shard: &Shard,
        name: &str,
        bytes_max: u64,
    ) -> Result<Vec<T>, QueueError> {
        let path = shard.dir.join(name);
        let bytes = self
            .opts
            .storage
            .read_file(&path, bytes_max)
            .map_err(|e| QueueError::io(format!("reading {}", path.display()), e))?;
        Ok(bytes
            .unwrap_or_default()
            .split(|&b| b == b'\n')
            .filter_map(|line| serde_json::from_slice(line).ok())
            .collect())
    }

    /// Appends `text` (whole lines) to the JSON-lines file at `path`,
    /// ending first a torn line a crash left, so the new lines parse.
    /// Returns the file and its length before.
    pub(super) fn append_lines(
        &self,
        path: &Path,
        mut text: Vec<u8>,
    ) -> std::io::Result<(Arc<dyn LogFile>, u64)> {
        let file = self.opts.storage.open(path, true)?;
        let len = file.len()?;
        let mut last = [0u8; 1];
        if len > 0 && file.read_at(&mut last, len - 1)? == 1 && last[0] != b'\n' {
            text.insert(0, b'\n');
        }
        file.append(&text)?;
        Ok((file, len))
    }

    /// The history file `name` of `shard` as `build` reads it, from
    /// `cache` while the file's length is unchanged (a lookup of an id
    /// that is not live must not parse the file each time); `None` when
    /// there is no such file.
    pub(super) fn cached_history<T>(
        &self,
        shard: &Shard,
        name: &str,
        cache: &Mutex<Option<(u64, Arc<T>)>>,
        build: impl FnOnce() -> Result<T, QueueError>,
    ) -> Result<Option<Arc<T>>, QueueError> {
        let path = shard.dir.join(name);
        let io = |e| QueueError::io(format!("reading {}", path.display()), e);
        let len = match self.opts.storage.open(&path, false) {
            Ok(file) => file.len().map_err(io)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(e)),
        };
        if let Some((_, m)) = lock(cache).as_ref().filter(|(at, _)| *at == len) {
            return Ok(Some(Arc::clone(m)));
        }
        let m = Arc::new(build()?);
        *lock(cache) = Some((len, Arc::clone(&m)));
        Ok(Some(m))
    }

    pub(super) fn read_moved(&self, shard: &Shard) -> Result<Vec<MovedLine>, QueueError> {
        self.read_lines(shard, MOVED_FILE, MOVED_FILE_BYTES_MAX)
    }

    pub(super) fn read_moved_in(&self, shard: &Shard) -> Result<Vec<MovedInLine>, QueueError> {
        self.read_lines(shard, MOVED_IN_FILE, MOVED_IN_FILE_BYTES_MAX)
    }

    /// Appends `jobs` to [`FINISHED_FILE`] (no fsync), cutting the file
    /// back to the retention once large. Best effort: the records that
    /// finished them are written already, and the caller must not be told
    /// that an ack failed when it did not, so a failure here (a full disk)
    /// costs only these lines of finished jobs.
    pub(super) fn note_finished(&self, shard: &Shard, jobs: &[FinishedJob]) {
        let keep = self.opts.retention;
        if jobs.is_empty() || keep.finished_jobs == 0 {
            return;
        }
        let _ = self.append_finished(shard, jobs, keep);
    }

    pub(super) fn append_finished(
        &self,
        shard: &Shard,
        jobs: &[FinishedJob],
        keep: Retention,
    ) -> Result<(), QueueError> {
        let path = shard.dir.join(FINISHED_FILE);
        let io = |e| QueueError::io(format!("writing {}", path.display()), e);
        let mut text = Vec::with_capacity(jobs.len() * 200);
        for j in jobs {
            serde_json::to_writer(&mut text, j).map_err(|e| QueueError::Internal {
                what: format!("encoding a line of the finished file: {e}"),
            })?;
            text.push(b'\n');
        }
        let added = text.len() as u64;
        let mut cut_at = lock(&shard.finished);
        let (_, len) = self.append_lines(&path, text).map_err(io)?;
        *cut_at = (*cut_at).max(finished_cut_bytes(keep));
        if len + added > *cut_at {
            // Keep the retention's count of newest lines, whatever their
            // length (reading more of the file's end until they are all
            // in, up to FINISHED_FILE_BYTES_MAX); then drop the oldest of
            // them while past the retention's age (lines are in finish
            // order, so only those are parsed).
            let mut want = finished_cut_bytes(keep) / 2;
            let (bytes, mut from) = loop {
                let bytes = self.read_tail(&path, want).map_err(io)?;
                let body = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
                match memchr_rev_nth(body, keep.finished_jobs) {
                    Some(at) => break (bytes, at + 1),
                    // The whole file was read (or the bound): keep it all.
                    None if want >= len + added || want >= FINISHED_FILE_BYTES_MAX => {
                        break (bytes, 0)
                    }
                    None => want = (want * 2).min(FINISHED_FILE_BYTES_MAX),
                }
            };
            let now = self.opts.clock.now_ms();
            while from < bytes.len() {
                let end = (bytes[from..].iter().position(|&b| b == b'\n'))
                    .map_or(bytes.len(), |i| from + i + 1);
                let old = serde_json::from_slice::<FinishedJob>(&bytes[from..end])
                    .is_ok_and(|f| !keep.keeps(f.finished_ms, now));
                if !old {
                    break;
                }
                from = end;
            }
            self.opts
                .storage
                .write_file_atomic(&path, &bytes[from..])
                .map_err(io)?;
            *cut_at = finished_cut_bytes(keep).max(2 * (bytes.len() - from) as u64);
        }
        Ok(())
    }

    /// The last `max` bytes of the file at `path` (empty when it does not
    /// exist), from the first whole line on when cut.
    pub(super) fn read_tail(&self, path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
        let file = match self.opts.storage.open(path, false) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let len = file.len()?;
        let at = len.saturating_sub(max);
        let mut buf = vec![0u8; (len - at) as usize];
        let mut got = 0;
        while got < buf.len() {
            let n = file.read_at(&mut buf[got..], at + got as u64)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        buf.truncate(got);
        if at > 0 {
            let first = buf
                .iter()
                .position(|&b| b == b'\n')
                .map_or(buf.len(), |i| i + 1);
            buf.drain(..first);
        }
        Ok(buf)
    }

    /// Appends `line` to [`MOVED_FILE`] and makes it durable; past
    /// [`MOVED_FILE_REWRITE_BYTES`] the file is rewritten with what the
    /// bounds of [`MovedAway`] keep.
    pub(super) fn note_moved(&self, shard: &Shard, mut line: MovedLine) -> Result<(), QueueError> {
        if line.ids.len() > MOVED_IDS_KEPT {
            let cut = line.ids.len() - MOVED_IDS_KEPT;
            line.ids.drain(..cut);
        }
        self.note_bounded(shard, MOVED_FILE, MOVED_FILE_REWRITE_BYTES, &line, true)
    }

    /// Appends `line` to [`MOVED_IN_FILE`] (synced by
    /// [`MoveKeys::sync_imports`]); past [`MOVED_IN_FILE_REWRITE_BYTES`]
    /// the file is rewritten with what the bounds of
    /// [`shardq_core::MovedIn`] keep.
    pub(super) fn note_moved_in(
        &self,
        shard: &Shard,
        mut line: MovedInLine,
    ) -> Result<(), QueueError> {
        if line.pairs.is_empty() {
            return Ok(());
        }
        if line.pairs.len() > MOVED_IDS_KEPT {
            let cut = line.pairs.len() - MOVED_IDS_KEPT;
            line.pairs.drain(..cut);
        }
        self.note_bounded(
            shard,
            MOVED_IN_FILE,
            MOVED_IN_FILE_REWRITE_BYTES,
            &line,
            false,
        )
    }

    /// Appends `line` to the JSON-lines file `name` of `shard` (synced when
    /// `sync`); once past `rewrite_bytes`, rewrites it with its newest
    /// lines within [`MOVED_KEYS_KEPT`] lines and [`MOVED_IDS_KEPT`] ids.
    fn note_bounded<L: Counted>(
        &self,
        shard: &Shard,
        name: &str,
        rewrite_bytes: u64,
        line: &L,
        sync: bool,
    ) -> Result<(), QueueError> {
        let path = shard.dir.join(name);
        let io = |e| QueueError::io(format!("writing {}", path.display()), e);
        let mut text = serde_json::to_vec(line).map_err(|e| QueueError::Internal {
            what: format!("encoding a line of {name}: {e}"),
        })?;
        text.push(b'\n');
        let (file, _) = self.append_lines(&path, text).map_err(io)?;
        if sync {
            file.sync().map_err(io)?;
        }
        // Read back and cut only once large: a rebalance purges and
        // imports many keys, and each must not read the whole file.
        if file.len().map_err(io)? > rewrite_bytes {
            let lines: Vec<L> = self.read_lines(shard, name, 2 * rewrite_bytes)?;
            let mut kept = Vec::new();
            let (mut n, mut total) = (0usize, 0usize);
            for l in lines.iter().rev() {
                if n > 0 && (n >= MOVED_KEYS_KEPT || total + l.ids() > MOVED_IDS_KEPT) {
                    break;
                }
                n += 1;
                total += l.ids();
                kept.push(l);
            }
            let mut out = Vec::new();
            for l in kept.into_iter().rev() {
                out.extend(serde_json::to_vec(l).unwrap_or_default());
                out.push(b'\n');
            }
            self.opts
                .storage
                .write_file_atomic(&path, &out)
                .map_err(io)?;
        }
        Ok(())
    }

    /// Saves `r`'s move cursors (the largest source id imported per shard
    /// and key) to the transfers file, merged with what it holds, before a
    /// segment holding Import records is deleted: a rerun of a move then
    /// never imports a job twice after its copies ran and were compacted.
    pub(super) fn save_import_cursors(&self, dir: &Path, r: &ShardState) -> Result<(), QueueError> {
        let mut on_file: BTreeMap<(String, String), u64> = self
            .read_transfers(dir)?
            .into_iter()
            .map(|t| ((t.from, t.key), t.up_to))
            .collect();
        let mut changed = false;
        for (from, key, up_to) in r.imported() {
            let at = on_file
                .entry((from.to_string(), key.to_string()))
                .or_default();
            if *at < up_to {
                *at = up_to;
                changed = true;
            }
        }
        if !changed {
            return Ok(());
        }
        let transfers: Vec<Transferred> = on_file
            .into_iter()
            .map(|((from, key), up_to)| Transferred { from, key, up_to })
            .collect();
        let path = dir.join(TRANSFERS_FILE);
        let text = serde_json::to_vec(&transfers).map_err(|e| QueueError::Internal {
            what: format!("encoding the transfers file: {e}"),
        })?;
        self.opts
            .storage
            .write_file_atomic(&path, &text)
            .map_err(|e| QueueError::io(format!("writing {}", path.display()), e))
    }
}

/// The position of the `n`th newline from the end of `b` (1 = the last),
/// if it has that many (`None` for 0).
pub(super) fn memchr_rev_nth(b: &[u8], n: usize) -> Option<usize> {
    b.iter()
        .enumerate()
        .rev()
        .filter(|(_, &c)| c == b'\n')
        .nth(n.checked_sub(1)?)
        .map(|(i, _)| i)
}

#[cfg(test)]
mod finished_file_tests {
    use super::memchr_rev_nth;

    #[test]
    pub(super) fn the_cut_keeps_exactly_the_newest_lines() {
        let body = b"a\nb\nc\nd";
        let keep = |n| {
            let from = memchr_rev_nth(body, n).map_or(0, |at| at + 1);
            String::from_utf8(body[from..].to_vec()).unwrap()
        };
        assert_eq!(keep(1), "d");
        assert_eq!(keep(2), "c\nd");
        assert_eq!(keep(4), "a\nb\nc\nd");
        assert_eq!(keep(9), "a\nb\nc\nd");
        assert_eq!(memchr_rev_nth(body, 0), None);
    }
}
