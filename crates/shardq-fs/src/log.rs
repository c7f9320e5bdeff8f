//! One shard's append-only log: segment files, the cross-process append lock,
//! tailing, torn-tail truncation, corruption detection, rolling, stepping
//! over reclaimed (deleted) segments and deleting them.
//!
//! Rules this module keeps (argued in `docs/design.md`):
//! * bytes are appended only while holding the shard's `.append.lock` flock,
//!   after reading everything up to the end of the log, so the appender knows
//!   the end is a record boundary;
//! * bad bytes are judged only while holding that lock (no writer can be
//!   half-way): a torn tail (the last record's declared length runs past the
//!   end of the file) is truncated by a writer and stepped short of by a
//!   reader; anything else, a checksum failure in the file's last whole
//!   record included, is corruption and the shard stops serving; records are
//!   never skipped;
//! * a reader ([`Access::LockedRead`], e.g. `status`) never truncates or
//!   creates anything;
//! * after a failed write or fsync the log refuses all further work;
//! * a segment missing after a seal is stepped over only if the reclaimed
//!   list covers it (read after listing the directory: compaction records a
//!   range before it deletes a file), and the replay hears of the new ranges
//!   before any record past them.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};
use shardq_core::QueueError;

use crate::layout;
use crate::reclaim::Reclaimed;
use crate::record::{
    self, check_segment_header, decode, segment_header, DecodeError, HeaderError, Record,
    HEADER_BYTES, SEGMENT_FORMAT_VERSION, SEGMENT_HEADER_BYTES,
};
use crate::storage::{list_segments, segment_name, LogFile, Storage};

/// Name of the lock file every appender holds while appending.
pub const APPEND_LOCK_FILE: &str = ".append.lock";
/// Default longest wait for a shard's append lock (1 s). A process stalled
/// while holding it (SIGSTOP, a hung disk) makes that shard
/// [`QueueError::Unavailable`] after this long instead of stalling the
/// caller, so a pool keeps serving its other shards.
pub const APPEND_LOCK_WAIT_MS_DEFAULT: u64 = 1_000;
/// Default segment size before rolling to a new one (64 MiB).
pub const SEGMENT_BYTES_DEFAULT: u64 = 64 << 20;
/// Bytes read from a segment at a time while tailing.
const READ_CHUNK_BYTES: usize = 4 << 20;
/// Bytes read at once when fetching a claimed job's record.
const CLAIM_READ_BYTES: usize = 512;
/// Attempts to list and open segments while compaction deletes some.
const LIST_RETRIES_MAX: usize = 16;

/// What reading the log feeds.
pub(crate) trait Replay {
    /// One record at global position `pos` of the segment at `seg_base`.
    fn record(&mut self, pos: u64, seg_base: u64, rec: &Record<'_>) -> Result<(), String>;
    /// The reclaimed ranges as now recorded (a superset of any told before);
    /// told before any record read after stepping over a deleted segment.
    fn reclaimed(&mut self, reclaimed: &Reclaimed);
}

/// Replay for a process that only appends: records are checked by decoding
/// and otherwise ignored.
pub(crate) struct Validate;

impl Replay for Validate {
    fn record(&mut self, _: u64, _: u64, _: &Record<'_>) -> Result<(), String> {
        Ok(())
    }
    fn reclaimed(&mut self, _: &Reclaimed) {}
}

/// Where tailing stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tail {
    /// At a record boundary at the end of the log.
    Clean,
    /// On bytes that are incomplete or invalid; without the append lock a
    /// writer may be half-way, so only a locked pass can judge them.
    NeedsLock,
}

/// How a pass over the log may treat what it finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Without the append lock: a writer may be half-way, so bad bytes are
    /// left for a locked pass.
    Unlocked,
    /// Holding the append lock, reading only (status, counts, a replica
    /// catching up): bad bytes are judged, but nothing is truncated or
    /// created. A torn tail is where the log ends, for now.
    LockedRead,
    /// Holding the append lock in order to append: a torn tail is truncated
    /// and a segment missing after a seal is created.
    LockedWrite,
}

impl Access {
    fn locked(self) -> bool {
        self != Access::Unlocked
    }
    fn writer(self) -> bool {
        self == Access::LockedWrite
    }
}

/// A segment's base and open file.
type OpenSegment = (u64, Arc<dyn LogFile>);

/// Holds the append flock until dropped.
pub(crate) struct AppendGuard(Arc<File>);

impl Drop for AppendGuard {
    fn drop(&mut self) {
        let _ = flock(&*self.0, FlockOperation::Unlock);
    }
}

/// See the module docs.
pub(crate) struct ShardLog {
    pub name: String,
    dir: PathBuf,
    storage: Arc<dyn Storage>,
    append_lock: Arc<File>,
    segments: BTreeMap<u64, Arc<dyn LogFile>>,
    /// Sealed segments read through: base -> position after the seal (the
    /// next segment's base).
    ends: BTreeMap<u64, u64>,
    /// The reclaimed list as last read.
    reclaimed: Reclaimed,
    /// Set after reading a seal until the next segment is open.
    after_seal: Option<u64>,
    cur_base: u64,
    cur_off: u64,
    segment_bytes_max: u64,
    /// Longest wait for the append lock, in ms.
    lock_wait_ms: u64,
    buf: Vec<u8>,
    /// Set after a failed write or fsync, or on corruption: all work stops.
    pub broken: Option<QueueError>,
    /// Bytes cut off as a torn tail since open (reported by status/repair).
    pub torn_bytes_truncated: u64,
}

/// Wraps an I/O error with its context, which is formatted only when
/// there is an error (not on every read).
fn io_err<F: FnOnce() -> String>(ctx: F) -> impl FnOnce(io::Error) -> QueueError {
    move |e| QueueError::io(ctx(), e)
}

impl ShardLog {
    /// Opens the shard in `dir`; reading starts at the first segment when
    /// `from_start`, else at the last (appenders need only validate the
    /// tail).
    pub fn open(
        name: &str,
        dir: &Path,
        storage: Arc<dyn Storage>,
        segment_bytes_max: u64,
        lock_wait_ms: u64,
        from_start: bool,
    ) -> Result<ShardLog, QueueError> {
        let lock_path = dir.join(APPEND_LOCK_FILE);
        let append_lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(io_err(|| format!("opening {}", lock_path.display())))?;
        let mut log = ShardLog {
            name: name.to_string(),
            dir: dir.to_path_buf(),
            storage,
            append_lock: Arc::new(append_lock),
            segments: BTreeMap::new(),
            ends: BTreeMap::new(),
            reclaimed: Reclaimed::default(),
            after_seal: None,
            cur_base: 0,
            cur_off: 0,
            segment_bytes_max,
            lock_wait_ms,
            buf: Vec::new(),
            broken: None,
            torn_bytes_truncated: 0,
        };
        log.open_segments(from_start)?;
        Ok(log)
    }

    fn open_segments(&mut self, from_start: bool) -> Result<(), QueueError> {
        for _ in 0..LIST_RETRIES_MAX {
            let bases = list_segments(&self.dir).map_err(io_err(|| {
                format!("listing segments of {}", self.dir.display())
            }))?;
            let Some(&first) = bases.first() else {
                return Err(QueueError::Corrupt {
                    shard: self.name.clone(),
                    segment: "-".into(),
                    offset: 0,
                    reason: format!("no segment files in {}", self.dir.display()),
                });
            };
            let wanted: Vec<u64> = if from_start {
                bases.clone()
            } else {
                vec![*bases.last().expect("non-empty")]
            };
            let mut opened = BTreeMap::new();
            let mut vanished = false;
            for base in wanted {
                match self.storage.open(&self.segment_path(base), false) {
                    Ok(f) => {
                        opened.insert(base, f);
                    }
                    // Compaction deleted it between listing and opening.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        vanished = true;
                        break;
                    }
                    Err(e) => {
                        return Err(QueueError::io(
                            format!("opening {}", self.segment_path(base).display()),
                            e,
                        ))
                    }
                }
            }
            if vanished {
                continue;
            }
            // Read after listing: a file missing from the listing was
            // recorded before it was deleted.
            self.reclaimed = Reclaimed::load(&*self.storage, &self.name, &self.dir)?;
            if !self.reclaimed.covers(0, first) {
                // Compaction records a range before it deletes a segment in
                // it: a first segment past an unrecorded gap means files
                // were lost, not reclaimed.
                return Err(QueueError::Corrupt {
                    shard: self.name.clone(),
                    segment: segment_name(0),
                    offset: 0,
                    reason: format!(
                        "the log starts at {} but the segments before it are not recorded \
                         as reclaimed in {} (restore the files from a backup)",
                        segment_name(first),
                        crate::reclaim::RECLAIMED_FILE
                    ),
                });
            }
            self.segments = opened;
            self.cur_base = if from_start {
                first
            } else {
                *bases.last().expect("non-empty")
            };
            self.cur_off = 0;
            return Ok(());
        }
        Err(QueueError::io(
            format!("shard {:?}: opening its segments", self.name),
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "segments kept vanishing while opening them",
            ),
        ))
    }

    /// The reclaimed list as last read.
    pub fn reclaimed(&self) -> &Reclaimed {
        &self.reclaimed
    }

    /// Re-reads the reclaimed list from disk.
    pub fn reload_reclaimed(&mut self) -> Result<&Reclaimed, QueueError> {
        self.reclaimed = Reclaimed::load(&*self.storage, &self.name, &self.dir)?;
        Ok(&self.reclaimed)
    }

    /// Offset of the read position within the current segment.
    pub fn cur_off(&self) -> u64 {
        self.cur_off
    }

    /// Global position of the end of what has been read.
    pub fn end_pos(&self) -> u64 {
        self.cur_base + self.cur_off
    }

    fn segment_path(&self, base: u64) -> PathBuf {
        self.dir.join(segment_name(base))
    }

    fn check_usable(&self) -> Result<(), QueueError> {
        match &self.broken {
            None => Ok(()),
            Some(QueueError::Corrupt {
                shard,
                segment,
                offset,
                reason,
            }) => Err(QueueError::Corrupt {
                shard: shard.clone(),
                segment: segment.clone(),
                offset: *offset,
                reason: reason.clone(),
            }),
            Some(other) => Err(QueueError::Poisoned {
                shard: self.name.clone(),
                cause: other.to_string(),
            }),
        }
    }

    /// Marks the log broken after a failed write or fsync.
    pub fn poison(&mut self, err: QueueError) -> QueueError {
        let msg = err.to_string();
        if self.broken.is_none() {
            self.broken = Some(QueueError::Poisoned {
                shard: self.name.clone(),
                cause: msg.clone(),
            });
        }
        QueueError::Poisoned {
            shard: self.name.clone(),
            cause: msg,
        }
    }

    /// Takes the append lock, waiting at most the configured bound
    /// (appenders hold it for one write; one that holds it longer is
    /// stalled). Past the bound the shard is [`QueueError::Unavailable`],
    /// which is transient: the caller tries again later.
    pub fn lock(&self) -> Result<AppendGuard, QueueError> {
        let path = self.dir.join(APPEND_LOCK_FILE);
        let start = Instant::now();
        let shown = path.display().to_string();
        let held = layout::flock_within(
            &self.append_lock,
            Duration::from_millis(self.lock_wait_ms),
            &shown,
        )
        .map_err(io_err(|| format!("locking {shown}")))?;
        match held {
            Ok(()) => Ok(AppendGuard(Arc::clone(&self.append_lock))),
            Err(holder) => Err(QueueError::Unavailable {
                shard: self.name.clone(),
                reason: format!(
                    "its append lock {shown} is held by another process ({holder}): not \
                     free after {} ms (bound {} ms); other shards are not affected",
                    start.elapsed().as_millis(),
                    self.lock_wait_ms
                ),
            }),
        }
    }

    fn current_file(&mut self) -> Result<Arc<dyn LogFile>, QueueError> {
        if let Some(f) = self.segments.get(&self.cur_base) {
            return Ok(Arc::clone(f));
        }
        let path = self.segment_path(self.cur_base);
        let f = self
            .storage
            .open(&path, false)
            .map_err(io_err(|| format!("opening {}", path.display())))?;
        self.segments.insert(self.cur_base, Arc::clone(&f));
        Ok(f)
    }

    /// Reads from the current position to the end of the log, calling
    /// `apply(position, segment_base, record)` for each record. `access`
    /// says whether the caller holds the append lock, which allows judging
    /// bad bytes (report corruption; a writer also truncates a torn tail)
    /// and, for a writer, creating the segment after a seal.
    pub fn catch_up(
        &mut self,
        access: Access,
        replay: &mut dyn Replay,
    ) -> Result<Tail, QueueError> {
        self.check_usable()?;
        // A seal read by an earlier pass that could not go on.
        if !self.step_past_seal(access, replay)? {
            return Ok(if access == Access::LockedRead {
                Tail::Clean
            } else {
                Tail::NeedsLock
            });
        }
        loop {
            let file = self.current_file()?;
            let len = file.len().map_err(io_err(|| {
                format!(
                    "reading the length of {}",
                    self.segment_path(self.cur_base).display()
                )
            }))?;
            match self.read_segment(&*file, len, access, replay)? {
                SegmentEnd::Sealed => {
                    let next = self.cur_base + self.cur_off;
                    self.ends.insert(self.cur_base, next);
                    self.after_seal = Some(next);
                    if !self.step_past_seal(access, replay)? {
                        // A locked reader that is not a writer: the roller
                        // died before creating the next segment; the log
                        // ends at the seal until a writer creates it.
                        return Ok(if access == Access::LockedRead {
                            Tail::Clean
                        } else {
                            Tail::NeedsLock
                        });
                    }
                }
                SegmentEnd::Clean => return Ok(Tail::Clean),
                SegmentEnd::Stuck => return Ok(Tail::NeedsLock),
            }
        }
    }

    /// Moves into the segment after the seal read last, if one is pending;
    /// false when only a locked pass can.
    fn step_past_seal(
        &mut self,
        access: Access,
        replay: &mut dyn Replay,
    ) -> Result<bool, QueueError> {
        let Some(next) = self.after_seal else {
            return Ok(true);
        };
        let Some((base, f)) = self.next_segment(next, access, replay)? else {
            return Ok(false);
        };
        self.after_seal = None;
        self.segments.insert(base, f);
        self.cur_base = base;
        self.cur_off = 0;
        Ok(true)
    }

    /// The segment the log continues in after a seal that ends at `next`:
    /// normally the file at `next`; past a reclaimed gap, the first file
    /// after it; `None` when only a locked pass can decide (the roller may
    /// not have created it yet).
    fn next_segment(
        &mut self,
        next: u64,
        access: Access,
        replay: &mut dyn Replay,
    ) -> Result<Option<OpenSegment>, QueueError> {
        if let Some(f) = self.segments.get(&next) {
            // Opened earlier: read it even if it was deleted since.
            return Ok(Some((next, Arc::clone(f))));
        }
        let mut want = next;
        for _ in 0..LIST_RETRIES_MAX {
            let path = self.segment_path(want);
            match self.storage.open(&path, false) {
                Ok(f) => return Ok(Some((want, f))),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(QueueError::io(format!("opening {}", path.display()), e)),
            }
            // List first, then read the list of reclaimed ranges: a file
            // missing from the listing was recorded there before it was
            // deleted.
            let bases = list_segments(&self.dir).map_err(io_err(|| {
                format!("listing segments of {}", self.dir.display())
            }))?;
            if bases.binary_search(&next).is_ok() {
                // Created meanwhile (by a roller, as we hold no lock).
                want = next;
                continue;
            }
            let later = bases.iter().copied().find(|&b| b > next);
            let reclaimed = Reclaimed::load(&*self.storage, &self.name, &self.dir)?;
            match later {
                Some(b) if reclaimed.covers(next, b) => {
                    if reclaimed != self.reclaimed {
                        self.reclaimed = reclaimed;
                        replay.reclaimed(&self.reclaimed);
                    }
                    want = b;
                }
                Some(b) if access.locked() => {
                    return Err(QueueError::Corrupt {
                        shard: self.name.clone(),
                        segment: segment_name(next),
                        offset: 0,
                        reason: format!(
                            "the segment is missing but not recorded as reclaimed in {}; \
                             the next segment is {} (restore the file from a backup)",
                            crate::reclaim::RECLAIMED_FILE,
                            segment_name(b)
                        ),
                    });
                }
                Some(_) => return Ok(None),
                None if reclaimed.contains(next) => {
                    return Err(QueueError::Corrupt {
                        shard: self.name.clone(),
                        segment: segment_name(next),
                        offset: 0,
                        reason: "the log ends in a reclaimed range: its current segment is missing"
                            .into(),
                    });
                }
                None if access.writer() => {
                    // A roller died between sealing and creating the next
                    // segment: create it for them. It may have died before
                    // syncing the sealed one, which every later sync counts
                    // on (only the current segment is ever synced again):
                    // synced first.
                    let sealed = self.current_file()?;
                    sealed.sync().map_err(|e| {
                        let p = self.segment_path(self.cur_base);
                        self.poison(QueueError::io(format!("syncing {}", p.display()), e))
                    })?;
                    let f = self
                        .storage
                        .open(&path, true)
                        .map_err(io_err(|| format!("creating {}", path.display())))?;
                    self.storage.sync_dir(&self.dir).map_err(|e| {
                        self.poison(QueueError::io(format!("syncing {}", self.dir.display()), e))
                    })?;
                    return Ok(Some((next, f)));
                }
                None => return Ok(None),
            }
        }
        Err(QueueError::io(
            format!(
                "shard {:?}: stepping over the segments after {}",
                self.name,
                segment_name(next)
            ),
            std::io::Error::new(std::io::ErrorKind::NotFound, "segments kept vanishing"),
        ))
    }

    fn read_segment(
        &mut self,
        file: &dyn LogFile,
        len: u64,
        access: Access,
        replay: &mut dyn Replay,
    ) -> Result<SegmentEnd, QueueError> {
        let mut buf = std::mem::take(&mut self.buf);
        let result = self.read_segment_inner(file, len, access, replay, &mut buf);
        buf.clear();
        if buf.capacity() > READ_CHUNK_BYTES * 2 {
            buf.shrink_to(READ_CHUNK_BYTES);
        }
        self.buf = buf;
        result
    }

    fn read_segment_inner(
        &mut self,
        file: &dyn LogFile,
        len: u64,
        access: Access,
        replay: &mut dyn Replay,
        buf: &mut Vec<u8>,
    ) -> Result<SegmentEnd, QueueError> {
        if self.cur_off == 0 {
            match self.check_header(file, len, access)? {
                HeaderState::Valid => self.cur_off = SEGMENT_HEADER_BYTES as u64,
                HeaderState::Stuck => return Ok(SegmentEnd::Stuck),
                // A reader: the segment was created and its header is not
                // (all) written yet; it is empty for now.
                HeaderState::NotYet => return Ok(SegmentEnd::Clean),
            }
        }
        let mut need = HEADER_BYTES;
        while self.cur_off < len {
            let want = (len - self.cur_off).min(READ_CHUNK_BYTES.max(need) as u64) as usize;
            buf.resize(want, 0);
            read_full(file, buf, self.cur_off).map_err(io_err(|| {
                format!(
                    "reading {} at offset {}",
                    self.segment_path(self.cur_base).display(),
                    self.cur_off
                )
            }))?;
            let mut p = 0usize;
            let mut consumed_any = false;
            while p < buf.len() {
                match decode(&buf[p..]) {
                    Ok((rec, n)) => {
                        let pos = self.cur_base + self.cur_off + p as u64;
                        replay.record(pos, self.cur_base, &rec).map_err(|reason| {
                            QueueError::Inconsistent {
                                shard: self.name.clone(),
                                segment: segment_name(self.cur_base),
                                offset: self.cur_off + p as u64,
                                reason,
                            }
                        })?;
                        p += n;
                        consumed_any = true;
                        if rec == Record::Seal {
                            self.cur_off += p as u64;
                            return Ok(SegmentEnd::Sealed);
                        }
                    }
                    Err(DecodeError::Incomplete) => {
                        need = record_total(&buf[p..]).unwrap_or(HEADER_BYTES);
                        break;
                    }
                    Err(DecodeError::Invalid(reason)) => {
                        self.cur_off += p as u64;
                        return self.judge_bad(file, len, access, buf, p, reason);
                    }
                }
            }
            self.cur_off += p as u64;
            if !consumed_any && self.cur_off + (buf.len() as u64) >= len {
                // An incomplete record at the end of the file.
                let at = p;
                return self.judge_bad(file, len, access, buf, at, "record is cut short".into());
            }
        }
        Ok(SegmentEnd::Clean)
    }

    /// Bad bytes at `self.cur_off` (`buf[p..]` holds them): torn tail or
    /// corruption. Without the lock nothing is decided.
    ///
    /// Torn means the last write of a crashed appender: the record at the
    /// end of the file whose declared length runs past the end of the file
    /// (or whose length field itself is cut short). Anything else, a
    /// checksum failure in a record that lies wholly inside the file above
    /// all, is corruption, even in the file's last record: a flipped bit in
    /// a record that was written whole must not be cut away silently. Only
    /// a writer truncates a torn tail; a reader stops before it.
    fn judge_bad(
        &mut self,
        file: &dyn LogFile,
        len: u64,
        access: Access,
        buf: &[u8],
        p: usize,
        reason: String,
    ) -> Result<SegmentEnd, QueueError> {
        if !access.locked() {
            return Ok(SegmentEnd::Stuck);
        }
        let rest = &buf[p..];
        let rest_is_whole_tail = self.cur_off + rest.len() as u64 >= len;
        let runs_past_end = match rest.get(0..4) {
            // The length field itself is cut short.
            None => true,
            Some(_) => record_total(rest).is_some_and(|t| self.cur_off + t as u64 > len),
        };
        if rest_is_whole_tail && runs_past_end {
            if !access.writer() {
                return Ok(SegmentEnd::Clean);
            }
            let path = self.segment_path(self.cur_base);
            file.truncate(self.cur_off)
                .and_then(|()| file.sync())
                .map_err(|e| {
                    self.poison(QueueError::io(format!("truncating {}", path.display()), e))
                })?;
            self.torn_bytes_truncated += len - self.cur_off;
            return Ok(SegmentEnd::Clean);
        }
        let err = QueueError::Corrupt {
            shard: self.name.clone(),
            segment: segment_name(self.cur_base),
            offset: self.cur_off,
            reason,
        };
        self.broken = Some(QueueError::Corrupt {
            shard: self.name.clone(),
            segment: segment_name(self.cur_base),
            offset: self.cur_off,
            reason: err.to_string(),
        });
        Err(err)
    }

    /// Checks the header of the current segment (`len` bytes long). A file
    /// shorter than a header whose bytes are a prefix of the header is a
    /// roll (or init) that died before the header was written: a writer
    /// completes it, a reader sees an empty segment. Anything else that is
    /// not this build's header is corruption, or an unknown format.
    fn check_header(
        &mut self,
        file: &dyn LogFile,
        len: u64,
        access: Access,
    ) -> Result<HeaderState, QueueError> {
        let want = segment_header();
        let mut got = vec![0u8; (len as usize).min(SEGMENT_HEADER_BYTES)];
        read_full(file, &mut got, 0).map_err(io_err(|| {
            format!(
                "reading the header of {}",
                self.segment_path(self.cur_base).display()
            )
        }))?;
        let segment = segment_name(self.cur_base);
        if got.len() < SEGMENT_HEADER_BYTES && got[..] == want[..got.len()] {
            return match access {
                Access::Unlocked => Ok(HeaderState::Stuck),
                Access::LockedRead => Ok(HeaderState::NotYet),
                Access::LockedWrite => {
                    self.write_header(file)?;
                    Ok(HeaderState::Valid)
                }
            };
        }
        match check_segment_header(&got) {
            Ok(()) => Ok(HeaderState::Valid),
            Err(HeaderError::UnknownVersion(v)) => Err(QueueError::UnknownFormat {
                what: format!(
                    "segment {segment} of shard {:?} ({})",
                    self.name,
                    self.segment_path(self.cur_base).display()
                ),
                found: v.to_string(),
                supported: SEGMENT_FORMAT_VERSION.to_string(),
            }),
            Err(HeaderError::Invalid(reason)) => {
                let reason = format!(
                    "bad segment header: {reason} (repair does not rewrite headers: restore the \
                     file from a backup)"
                );
                self.broken = Some(QueueError::Corrupt {
                    shard: self.name.clone(),
                    segment: segment.clone(),
                    offset: 0,
                    reason: reason.clone(),
                });
                Err(QueueError::Corrupt {
                    shard: self.name.clone(),
                    segment,
                    offset: 0,
                    reason,
                })
            }
        }
    }

    /// Writes the header into an empty (or header-torn) segment and makes it
    /// durable; the caller holds the append lock. Poisons on failure.
    fn write_header(&mut self, file: &dyn LogFile) -> Result<(), QueueError> {
        let path = self.segment_path(self.cur_base);
        file.truncate(0)
            .and_then(|()| file.append(&segment_header()))
            .and_then(|()| file.sync())
            .map_err(|e| {
                self.poison(QueueError::io(
                    format!("writing the segment header of {}", path.display()),
                    e,
                ))
            })
    }

    /// Appends `bytes` (whole records) at the end; the caller holds the lock
    /// and has caught up. On failure the log is poisoned.
    pub fn append_locked(&mut self, bytes: &[u8]) -> Result<Arc<dyn LogFile>, QueueError> {
        self.check_usable()?;
        if self.cur_off >= self.segment_bytes_max {
            self.roll()?;
        }
        debug_assert!(
            self.cur_off >= SEGMENT_HEADER_BYTES as u64,
            "an appender has read the segment header"
        );
        let file = self.current_file()?;
        if let Err(e) = file.append(bytes) {
            let path = self.segment_path(self.cur_base);
            // Best effort: cut what may have been written, so other
            // appenders do not have to; they would truncate it anyway.
            let _ = file.truncate(self.cur_off);
            return Err(self.poison(QueueError::io(
                format!("appending to {}", path.display()),
                e,
            )));
        }
        self.cur_off += bytes.len() as u64;
        Ok(file)
    }

    /// Seals the current segment and starts the next. Holds the lock.
    fn roll(&mut self) -> Result<(), QueueError> {
        let mut seal = Vec::new();
        record::encode(&mut seal, &Record::Seal);
        let file = self.current_file()?;
        let path = self.segment_path(self.cur_base);
        file.append(&seal)
            .and_then(|()| file.sync())
            .map_err(|e| self.poison(QueueError::io(format!("sealing {}", path.display()), e)))?;
        let next = self.cur_base + self.cur_off + seal.len() as u64;
        let next_path = self.segment_path(next);
        let f = self
            .storage
            .open(&next_path, true)
            .and_then(|f| {
                f.append(&segment_header())?;
                f.sync()?;
                Ok(f)
            })
            .and_then(|f| self.storage.sync_dir(&self.dir).map(|()| f))
            .map_err(|e| {
                self.poison(QueueError::io(
                    format!("creating {}", next_path.display()),
                    e,
                ))
            })?;
        self.segments.insert(next, f);
        self.ends.insert(self.cur_base, next);
        self.cur_base = next;
        self.cur_off = SEGMENT_HEADER_BYTES as u64;
        Ok(())
    }

    /// Reads the record at global position `pos` (an enqueue, for a claim)
    /// and checks it right after reading it back.
    pub fn read_record_at(&mut self, pos: u64) -> Result<Vec<u8>, QueueError> {
        self.locate(pos)?.read()
    }

    /// Where the record at `pos` is, to read it later without the log: the
    /// segment's file stays readable while the handle lives, even once a
    /// compaction deleted it (a record of a live job is never rewritten).
    pub fn locate(&self, pos: u64) -> Result<RecordAt, QueueError> {
        let (&base, file) =
            self.segments
                .range(..=pos)
                .next_back()
                .ok_or_else(|| QueueError::Internal {
                    what: format!("shard {:?}: a segment holding position {pos}", self.name),
                })?;
        Ok(RecordAt {
            shard: self.name.clone(),
            file: Arc::clone(file),
            base,
            off: pos - base,
        })
    }
}

/// A record's place, from [`ShardLog::locate`].
pub struct RecordAt {
    shard: String,
    file: Arc<dyn LogFile>,
    base: u64,
    off: u64,
}

impl RecordAt {
    /// Reads the record and checks it right after reading it back.
    pub fn read(&self) -> Result<Vec<u8>, QueueError> {
        let (file, base, off) = (&self.file, self.base, self.off);
        let ctx = || format!("reading {} at offset {off}", segment_name(base));
        // One read serves the common small record; a larger one takes two.
        let mut rec = vec![0u8; CLAIM_READ_BYTES];
        let got = file.read_at(&mut rec, off).map_err(io_err(&ctx))?;
        rec.truncate(got);
        let total = record_total(&rec).unwrap_or(HEADER_BYTES);
        if rec.len() < total {
            rec.resize(total, 0);
            read_full(&**file, &mut rec, off).map_err(io_err(&ctx))?;
        }
        rec.truncate(total);
        if let Err(e) = decode(&rec) {
            return Err(QueueError::Corrupt {
                shard: self.shard.clone(),
                segment: segment_name(base),
                offset: off,
                reason: format!("record changed after it was read: {e:?}"),
            });
        }
        Ok(rec)
    }
}

impl ShardLog {
    /// Sealed segments read through and still kept, as `(base, end)`,
    /// oldest first.
    pub fn sealed_segments(&self) -> Vec<(u64, u64)> {
        self.segments
            .keys()
            .filter(|&&b| b < self.cur_base)
            .filter_map(|b| self.ends.get(b).map(|&e| (*b, e)))
            .collect()
    }

    /// The shard's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Makes everything appended to the current segment durable (earlier
    /// segments were fsynced when sealed). Poisons the log on failure.
    pub fn sync_current(&mut self) -> Result<(), QueueError> {
        self.check_usable()?;
        let file = self.current_file()?;
        file.sync().map_err(|e| {
            let path = self.segment_path(self.cur_base);
            self.poison(QueueError::io(format!("syncing {}", path.display()), e))
        })
    }

    /// Records `reclaimed` (the caller's union of the list on disk and new
    /// ranges) before any segment in it is deleted. Poisons the log on
    /// failure: the file may or may not have been replaced.
    pub fn store_reclaimed(&mut self, reclaimed: Reclaimed) -> Result<(), QueueError> {
        self.check_usable()?;
        if let Err(e) = reclaimed.store(&self.dir, &*self.storage) {
            let path = self.dir.join(crate::reclaim::RECLAIMED_FILE);
            return Err(self.poison(QueueError::io(format!("writing {}", path.display()), e)));
        }
        self.reclaimed = reclaimed;
        Ok(())
    }

    /// Deletes a sealed segment whose range is recorded as reclaimed.
    pub fn delete_segment(&mut self, base: u64) -> Result<(), QueueError> {
        assert!(base < self.cur_base, "the current segment is never deleted");
        let end = self.ends.get(&base).copied().unwrap_or(base + 1);
        assert!(
            self.reclaimed.covers(base, end),
            "a segment is deleted only after its range is recorded as reclaimed"
        );
        let path = self.segment_path(base);
        match self.storage.remove(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(QueueError::io(format!("deleting {}", path.display()), e)),
        }
        self.segments.remove(&base);
        self.ends.remove(&base);
        Ok(())
    }
}

enum HeaderState {
    Valid,
    Stuck,
    NotYet,
}

enum SegmentEnd {
    Clean,
    Sealed,
    Stuck,
}

/// Total size of the record whose header starts `buf`, if the length is in
/// bounds.
fn record_total(buf: &[u8]) -> Option<usize> {
    let len = u32::from_le_bytes(buf.get(0..4)?.try_into().ok()?) as usize;
    (1..=record::RECORD_BODY_BYTES_MAX)
        .contains(&len)
        .then_some(HEADER_BYTES + len)
}

fn read_full(file: &dyn LogFile, buf: &mut [u8], mut off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = file.read_at(&mut buf[done..], off)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file ended early (truncated by another process?)",
            ));
        }
        done += n;
        off += n as u64;
    }
    Ok(())
}
