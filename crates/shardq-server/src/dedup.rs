//! Idempotent enqueue: what a `dedup_id` was enqueued as, remembered for
//! the dedup window across server restarts.
//!
//! A dedup id belongs to its key: `(key, dedup_id)` is what is looked up,
//! so one tenant's ids never suppress another's jobs.
//!
//! [`DedupStore::begin_many`] reserves ids for one request (or returns the
//! live record, or says another request holds it) — on every server of the
//! deployment at once, not only this one; after the enqueue
//! [`DedupStore::commit`] makes the records durable *before* the reply;
//! [`DedupStore::abort`] drops reservations whose jobs were not enqueued.
//!
//! * [`FileDedup`] (embedded data dirs): `dedup.log` in the data dir, one
//!   JSON line per record, appended and fsynced under `.dedup.lock` (taken
//!   with a bounded wait, [`DEDUP_LOCK_WAIT_MS`]);
//!   expired records leave memory as time passes, and the file is rewritten
//!   with the live records only on open and whenever it holds more than
//!   twice as many lines as live records (plus a slack); servers sharing
//!   the data dir read each other's new lines before each lookup (and the
//!   whole file again after a rewrite). Reservations are in memory. Memory
//!   holds a keyed 128-bit hash of each id, not the id, and each key and
//!   shard name once: a server's memory grew by about 170 bytes per record
//!   (390 when it held the ids), table growth included; a rewrite copies
//!   the live lines from the file, and one that fails (a full disk, a
//!   damaged old line) leaves the file as it was and the commit standing.
//!   The records of a commit whose append failed stay in memory and are
//!   written ahead of the next commit's.
//! * [`RedisDedup`] (Redis data dirs): one key per id under the
//!   deployment's namespace; a reservation is `SET NX PX` of a pending
//!   marker (for [`PENDING_MS`]), the commit overwrites it with the record
//!   for the window.
//!
//! A server that dies after the enqueue and before the commit leaves no
//! record: a retry enqueues the jobs again (at-least-once). This module
//! must never decide what a job is or touch the queue.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ahash::RandomState;
use rustix::fs::{flock, FlockOperation};
use serde::{Deserialize, Serialize};
use siphasher::sip128::SipHasher13;

/// File of dedup records in an embedded data dir.
pub const DEDUP_FILE: &str = "dedup.log";
/// Lock file serialising appends and rewrites of [`DEDUP_FILE`].
pub const DEDUP_LOCK_FILE: &str = ".dedup.lock";
/// How long a Redis reservation lives without a commit (60 s: longer than
/// the producer's bounded waits), so a server that died mid-request does
/// not block the id for the whole window.
pub const PENDING_MS: u64 = 60_000;
/// Longest record line read back, in bytes.
const LINE_BYTES_MAX: usize = 8 << 10;
/// The file is rewritten with its live records only once it holds this
/// many lines more than twice the live ones.
const COMPACT_SLACK_LINES: usize = 100_000;
/// Most records of failed commits kept to be written with a later one.
const UNWRITTEN_MAX: usize = 100_000;
/// Longest wait for [`DEDUP_LOCK_FILE`], in ms (holders keep it for one
/// append and fsync).
pub const DEDUP_LOCK_WAIT_MS: u64 = 5_000;
/// How long a reservation line holds its id without a commit or release
/// (120 s: longer than the longest request, 90 s, and the producer's
/// bounded waits under it), so a server that died mid-request blocks its
/// ids no longer than this.
pub const RESERVE_MS: u64 = 120_000;

/// What a dedup id was enqueued as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedupRecord {
    /// The client's dedup id.
    pub id: String,
    /// Shard the job landed on.
    pub shard: String,
    /// Job id within the shard.
    pub job: u64,
    /// The job's key.
    pub key: String,
    /// When the record is forgotten (ms since the epoch).
    pub expires_ms: u64,
    /// A reservation (not a record) by the server with this id: the id is
    /// being enqueued there now (embedded data dirs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_by: Option<u64>,
    /// With `reserved_by`: the reservation is given up.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub released: bool,
}

impl DedupRecord {
    /// The record of `(key, id)`: enqueued as job `job` of `shard`.
    pub fn new(key: &str, id: &str, shard: &str, job: u64, expires_ms: u64) -> DedupRecord {
        DedupRecord {
            id: id.to_string(),
            shard: shard.to_string(),
            job,
            key: key.to_string(),
            expires_ms,
            reserved_by: None,
            released: false,
        }
    }
}

/// A dedup id within its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scoped<'a> {
    /// The job's key.
    pub key: &'a str,
    /// The client's dedup id.
    pub id: &'a str,
}

/// What [`DedupStore::begin`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// Nothing known: the id is reserved for this request.
    Fresh,
    /// Enqueued before, within the window.
    Done(DedupRecord),
    /// Another request holds the id right now.
    Busy,
}

/// Where dedup records live. See the module docs.
pub trait DedupStore: Send + Sync {
    /// Looks each id up, in order, and reserves the unknown ones (a store
    /// may answer them in one round trip). On an error nothing stays
    /// reserved.
    fn begin_many(&self, ids: &[Scoped<'_>], now_ms: u64) -> Result<Vec<Begin>, String>;
    /// [`DedupStore::begin_many`] of one id.
    fn begin(&self, key: &str, id: &str, now_ms: u64) -> Result<Begin, String> {
        self.begin_many(&[Scoped { key, id }], now_ms)
            .map(|mut v| v.remove(0))
    }
    /// Makes `records` durable and drops their reservations.
    fn commit(&self, records: &[DedupRecord]) -> Result<(), String>;
    /// Drops reservations of ids that were not enqueued.
    fn abort(&self, ids: &[Scoped<'_>]);
}

// ---------------------------------------------------------------------------
// Embedded: an append-only JSON-lines file.
// ---------------------------------------------------------------------------

/// A dedup id in memory: its 128-bit SipHash-1-3 under a key drawn when
/// the store opens. The ids themselves stay in the file: an id is 30 to
/// 100 bytes and a server remembers every id of the window (5 minutes at
/// 50k jobs/s is 15 million). Two ids share a hash with a probability near
/// n^2 / 2^129 (about 10^-24 for 15 million), and the key is never shown,
/// so ids cannot be chosen to collide.
type IdHash = (u64, u64);

/// What an id was enqueued as (24 bytes): the shard and the key are slots
/// in the store's name tables.
#[derive(Debug, Clone, Copy)]
struct Entry {
    job: u64,
    expires_ms: u64,
    key: u32,
    shard: u32,
}

/// Names shared by many records (keys, shards), counted, so that a key's
/// name is stored once however many of its jobs are remembered and is
/// dropped with its last record.
#[derive(Default)]
struct Names {
    slots: HashMap<Arc<str>, u32, RandomState>,
    names: Vec<(Arc<str>, u32)>,
    free: Vec<u32>,
}

impl Names {
    fn acquire(&mut self, name: &str) -> u32 {
        if let Some(&n) = self.slots.get(name) {
            self.names[n as usize].1 += 1;
            return n;
        }
        let name: Arc<str> = Arc::from(name);
        let n = match self.free.pop() {
            Some(n) => {
                self.names[n as usize] = (Arc::clone(&name), 1);
                n
            }
            None => {
                self.names.push((Arc::clone(&name), 1));
                (self.names.len() - 1) as u32
            }
        };
        self.slots.insert(name, n);
        n
    }

    fn release(&mut self, n: u32) {
        let slot = &mut self.names[n as usize];
        slot.1 -= 1;
        if slot.1 == 0 {
            let name = std::mem::replace(&mut slot.0, Arc::from(""));
            self.slots.remove(&name);
            self.free.push(n);
        }
    }

    fn get(&self, n: u32) -> &str {
        &self.names[n as usize].0
    }

    fn clear(&mut self) {
        *self = Names::default();
    }
}

struct FileState {
    /// The SipHash key of [`IdHash`].
    sip_key: [u8; 16],
    index: HashMap<IdHash, Entry, RandomState>,
    /// `(expires_ms, id)` in the order the records were read or written:
    /// expired ones are dropped from `index` from the front.
    expiry: VecDeque<(u64, IdHash)>,
    keys: Names,
    shards: Names,
    /// Ids this server reserved (their lines name [`FileState::server`]).
    pending: HashSet<IdHash, RandomState>,
    /// Ids other servers reserved: (their server id, until when).
    foreign: HashMap<IdHash, (u64, u64), RandomState>,
    /// This server's id in reservation lines, drawn at open.
    server: u64,
    file: File,
    /// Bytes of the file read into `index`.
    pos: u64,
    /// Record lines in the file (live or not).
    lines: usize,
    /// After a failed rewrite: no new try below this many lines.
    compact_after: usize,
    /// Records of commits whose append failed (their jobs were enqueued):
    /// written ahead of the next commit's, at most [`UNWRITTEN_MAX`].
    unwritten: Vec<DedupRecord>,
    ino: u64,
    /// The latest `now_ms` a caller gave.
    now_ms: u64,
}

impl FileState {
    /// The hash of `id` within `key` (a 0xFF byte, which UTF-8 never holds,
    /// between them).
    fn hash(&self, key: &str, id: &str) -> IdHash {
        use siphasher::sip128::Hasher128;
        use std::hash::Hasher;
        let mut h = SipHasher13::new_with_key(&self.sip_key);
        h.write(key.as_bytes());
        h.write_u8(0xff);
        h.write(id.as_bytes());
        let h = h.finish128();
        (h.h1, h.h2)
    }

    fn record(&self, id: &str, e: &Entry) -> DedupRecord {
        DedupRecord::new(
            self.keys.get(e.key),
            id,
            self.shards.get(e.shard),
            e.job,
            e.expires_ms,
        )
    }

    /// A reservation (or, `released`, its release) of `s` by this server.
    fn reservation(&self, s: &Scoped<'_>, now_ms: u64, released: bool) -> DedupRecord {
        DedupRecord {
            reserved_by: Some(self.server),
            released,
            ..DedupRecord::new(s.key, s.id, "", 0, now_ms.saturating_add(RESERVE_MS))
        }
    }

    /// Whether another server holds a live reservation of `h`.
    fn foreign_holds(&self, h: &IdHash, now_ms: u64) -> bool {
        self.foreign
            .get(h)
            .is_some_and(|&(_, until)| until > now_ms)
    }

    /// Takes in one line of the file: a record or a reservation.
    fn apply(&mut self, r: &DedupRecord) {
        match r.reserved_by {
            Some(server) => {
                self.lines += 1;
                if server == self.server {
                    return;
                }
                let h = self.hash(&r.key, &r.id);
                if r.released {
                    if self.foreign.get(&h).is_some_and(|&(s, _)| s == server) {
                        self.foreign.remove(&h);
                    }
                } else {
                    self.foreign.insert(h, (server, r.expires_ms));
                }
            }
            None => {
                let h = self.hash(&r.key, &r.id);
                self.foreign.remove(&h);
                self.remember(r);
            }
        }
    }

    fn remember(&mut self, r: &DedupRecord) {
        let id = self.hash(&r.key, &r.id);
        let e = Entry {
            job: r.job,
            expires_ms: r.expires_ms,
            key: self.keys.acquire(&r.key),
            shard: self.shards.acquire(&r.shard),
        };
        self.expiry.push_back((r.expires_ms, id));
        if let Some(old) = self.index.insert(id, e) {
            self.forget(&old);
        }
        self.lines += 1;
    }

    fn forget(&mut self, e: &Entry) {
        self.keys.release(e.key);
        self.shards.release(e.shard);
    }

    /// Whether `r` (a line of the file, its id hashing to `id`) is the live
    /// record of its id, or a reservation still held.
    fn is_live(&self, id: &IdHash, r: &DedupRecord) -> bool {
        if let Some(server) = r.reserved_by {
            if r.released || r.expires_ms <= self.now_ms {
                return false;
            }
            return if server == self.server {
                self.pending.contains(id)
            } else {
                self.foreign.get(id) == Some(&(server, r.expires_ms))
            };
        }
        self.index.get(id).is_some_and(|e| {
            e.job == r.job
                && e.expires_ms == r.expires_ms
                && e.expires_ms > self.now_ms
                && self.shards.get(e.shard) == r.shard
        })
    }

    /// Forgets the records and reservations expired at `now_ms`.
    fn expire(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        let now = self.now_ms;
        self.foreign.retain(|_, &mut (_, until)| until > now);
        while let Some((at, _)) = self.expiry.front() {
            if *at > self.now_ms {
                break;
            }
            let (at, id) = self.expiry.pop_front().expect("front exists");
            // A later record of the same id lives on.
            if self.index.get(&id).is_some_and(|e| e.expires_ms <= at) {
                if let Some(e) = self.index.remove(&id) {
                    self.forget(&e);
                }
            }
        }
    }

    /// Records counted in the key and shard names (tests).
    #[cfg(test)]
    fn names_in_use(&self) -> (u32, u32) {
        let live = |n: &Names| n.slots.values().map(|&i| n.names[i as usize].1).sum();
        (live(&self.keys), live(&self.shards))
    }

    fn clear(&mut self) {
        self.index.clear();
        self.foreign.clear();
        self.expiry.clear();
        self.keys.clear();
        self.shards.clear();
        self.lines = 0;
    }
}

/// Dedup records in `dedup.log`. See the module docs.
pub struct FileDedup {
    path: PathBuf,
    lock_path: PathBuf,
    /// [`COMPACT_SLACK_LINES`], smaller in tests.
    compact_slack: usize,
    /// [`DEDUP_LOCK_WAIT_MS`], shorter in tests.
    lock_wait_ms: u64,
    /// Tests: every append fails, as on a full disk.
    #[cfg(test)]
    fail_appends: std::sync::atomic::AtomicBool,
    state: Mutex<FileState>,
}

struct Locked(File);

impl Drop for Locked {
    fn drop(&mut self) {
        let _ = flock(&self.0, FlockOperation::Unlock);
    }
}

/// Takes the lock at `path`, waiting at most `wait_ms`: a server stalled
/// while holding it (SIGSTOP) fails the others' commits after the bound,
/// naming the lock, instead of hanging their requests.
fn lock(path: &Path, wait_ms: u64) -> Result<Locked, String> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    let held = shardq_fs::layout::flock_within(&f, Duration::from_millis(wait_ms))
        .map_err(|e| format!("locking {}: {e}", path.display()))?;
    if !held {
        return Err(format!(
            "{} is held by another server (stalled?): not free after {wait_ms} ms",
            path.display()
        ));
    }
    Ok(Locked(f))
}

fn open_append(path: &Path) -> Result<(File, u64), String> {
    let f = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    let ino = f
        .metadata()
        .map_err(|e| format!("reading {}: {e}", path.display()))?
        .ino();
    Ok((f, ino))
}

/// Parses the complete lines of `bytes` (an unterminated last line is a
/// torn append and left for later); returns the records and the bytes used.
fn parse_lines(bytes: &[u8], path: &Path, base: u64) -> Result<(Vec<DedupRecord>, u64), String> {
    let mut out = Vec::new();
    let mut used = 0usize;
    while let Some(nl) = bytes[used..].iter().position(|&b| b == b'\n') {
        let line = &bytes[used..used + nl];
        if !line.iter().all(u8::is_ascii_whitespace) {
            let rec: DedupRecord = serde_json::from_slice(line).map_err(|e| {
                format!(
                    "{} offset {}: not a dedup record ({e}); move the file away to start with no dedup records",
                    path.display(),
                    base + used as u64
                )
            })?;
            out.push(rec);
        }
        used += nl + 1;
    }
    if bytes.len() - used > LINE_BYTES_MAX {
        return Err(format!(
            "{} offset {}: a line longer than {LINE_BYTES_MAX} bytes: not a dedup file",
            path.display(),
            base + used as u64
        ));
    }
    Ok((out, used as u64))
}

impl FileDedup {
    /// Opens (creating) the dedup file of data dir `dir`, dropping records
    /// expired at `now_ms`.
    pub fn open(dir: &Path, now_ms: u64) -> Result<FileDedup, String> {
        let path = dir.join(DEDUP_FILE);
        let lock_path = dir.join(DEDUP_LOCK_FILE);
        let _l = lock(&lock_path, DEDUP_LOCK_WAIT_MS)?;
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        let (records, used) = parse_lines(&bytes, &path, 0)?;
        // The ids whose last line is a reservation: one followed by a
        // record of its id (expired or not) or by a release has ended.
        let mut held: HashSet<(&str, &str)> = HashSet::new();
        for r in &records {
            let k = (r.key.as_str(), r.id.as_str());
            if r.reserved_by.is_some() && !r.released {
                held.insert(k);
            } else {
                held.remove(&k);
            }
        }
        let held: HashSet<(String, String)> = held
            .into_iter()
            .map(|(k, i)| (k.to_string(), i.to_string()))
            .collect();
        let live: Vec<DedupRecord> = records
            .into_iter()
            .filter(|r| r.expires_ms > now_ms)
            .collect();
        let rewrite = live.len() < count_lines(&bytes) || used != bytes.len() as u64;
        let (file, ino) = open_append(&path)?;
        let pos = file
            .metadata()
            .map_err(|e| format!("reading {}: {e}", path.display()))?
            .len();
        let mut sip_key = [0u8; 16];
        getrandom::fill(&mut sip_key)
            .map_err(|e| format!("drawing the dedup hash key from the OS: {e}"))?;
        let mut st = FileState {
            sip_key,
            index: HashMap::default(),
            expiry: VecDeque::new(),
            keys: Names::default(),
            shards: Names::default(),
            pending: HashSet::default(),
            foreign: HashMap::default(),
            server: {
                let mut b = [0u8; 8];
                getrandom::fill(&mut b)
                    .map_err(|e| format!("drawing a server id from the OS: {e}"))?;
                u64::from_le_bytes(b)
            },
            file,
            pos,
            lines: 0,
            compact_after: 0,
            unwritten: Vec::new(),
            ino,
            now_ms,
        };
        // Reservations in file order (a later record of the id ends one,
        // expired or not: it was read before the filter), then the records
        // by expiry.
        let (reservations, mut live): (Vec<DedupRecord>, Vec<DedupRecord>) =
            live.into_iter().partition(|r| r.reserved_by.is_some());
        for r in &reservations {
            if held.contains(&(r.key.clone(), r.id.clone())) {
                st.apply(r);
            }
        }
        live.sort_by_key(|r| r.expires_ms);
        for r in live {
            st.remember(&r);
        }
        let d = FileDedup {
            path,
            lock_path,
            compact_slack: COMPACT_SLACK_LINES,
            lock_wait_ms: DEDUP_LOCK_WAIT_MS,
            #[cfg(test)]
            fail_appends: std::sync::atomic::AtomicBool::new(false),
            state: Mutex::new(st),
        };
        // Rewrite without expired records (and without a torn tail).
        if rewrite {
            let mut st = lock_state(&d.state);
            d.write_live(&mut st)?;
        }
        Ok(d)
    }

    /// Replaces the file with the live records of `st` (under the lock),
    /// copied line by line from the file (memory holds only hashes of the
    /// ids), and reopens it. Other servers see a new inode and read it again.
    fn write_live(&self, st: &mut FileState) -> Result<(), String> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(format!(".{DEDUP_FILE}.tmp"));
        let result = self.copy_live(st, &tmp);
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        let (mut written, kept, reservations) = result?;
        // Records of failed commits are not in the file yet: memory keeps them.
        for r in &st.unwritten {
            written.insert(st.hash(&r.key, &r.id));
        }
        std::fs::rename(&tmp, &self.path)
            .map_err(|e| format!("renaming {} to {}: {e}", tmp.display(), self.path.display()))?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        let (file, ino) = open_append(&self.path)?;
        st.file = file;
        st.ino = ino;
        st.pos = kept;
        // Each id once, at the expiry of the record kept (an id recorded
        // twice has an older entry too, which would never expire it); what
        // the file no longer holds (expired meanwhile) leaves memory too.
        let mut seen = HashSet::<IdHash, RandomState>::default();
        let index = &st.index;
        st.expiry.retain(|(at, id)| {
            written.contains(id)
                && index.get(id).is_some_and(|e| e.expires_ms == *at)
                && seen.insert(*id)
        });
        let gone: Vec<IdHash> = st
            .index
            .keys()
            .filter(|id| !written.contains(*id))
            .copied()
            .collect();
        for id in gone {
            if let Some(e) = st.index.remove(&id) {
                st.forget(&e);
            }
        }
        st.lines = st.expiry.len() + reservations;
        Ok(())
    }

    /// Writes the live lines of the file to `tmp` (fsynced): the ids of
    /// the records written, their bytes, and the reservation lines kept.
    fn copy_live(
        &self,
        st: &FileState,
        tmp: &Path,
    ) -> Result<(HashSet<IdHash, RandomState>, u64, usize), String> {
        let read_err = |e: std::io::Error| format!("reading {}: {e}", self.path.display());
        let write_err = |e: std::io::Error| format!("writing {}: {e}", tmp.display());
        let mut from = BufReader::new(File::open(&self.path).map_err(read_err)?).take(st.pos);
        let mut to = BufWriter::new(File::create(tmp).map_err(write_err)?);
        let mut written = HashSet::<IdHash, RandomState>::default();
        let mut reserved = HashSet::<IdHash, RandomState>::default();
        let (mut line, mut at, mut kept) = (Vec::new(), 0u64, 0u64);
        loop {
            line.clear();
            let n = from.read_until(b'\n', &mut line).map_err(read_err)?;
            if n == 0 || line.last() != Some(&b'\n') {
                break; // the end, or a torn last line
            }
            if !line.iter().all(u8::is_ascii_whitespace) {
                let r: DedupRecord = serde_json::from_slice(&line).map_err(|e| {
                    format!(
                        "{} offset {at}: not a dedup record ({e})",
                        self.path.display()
                    )
                })?;
                let id = st.hash(&r.key, &r.id);
                let seen = if r.reserved_by.is_some() {
                    &mut reserved
                } else {
                    &mut written
                };
                if st.is_live(&id, &r) && seen.insert(id) {
                    to.write_all(&line).map_err(write_err)?;
                    kept += n as u64;
                }
            }
            at += n as u64;
        }
        let f = to.into_inner().map_err(|e| write_err(e.into_error()))?;
        f.sync_all().map_err(write_err)?;
        Ok((written, kept, reserved.len()))
    }

    /// Reads lines other servers appended since the last read (and the
    /// whole file again if another server rewrote it).
    fn refresh(&self, st: &mut FileState) -> Result<(), String> {
        let ino = std::fs::metadata(&self.path)
            .map_err(|e| format!("reading {}: {e}", self.path.display()))?
            .ino();
        if ino != st.ino {
            let (file, ino) = open_append(&self.path)?;
            st.file = file;
            st.ino = ino;
            st.pos = 0;
            st.clear();
        }
        let len = st
            .file
            .metadata()
            .map_err(|e| format!("reading {}: {e}", self.path.display()))?
            .len();
        if len <= st.pos {
            return Ok(());
        }
        let mut buf = Vec::with_capacity((len - st.pos) as usize);
        let mut f = &st.file;
        f.seek(SeekFrom::Start(st.pos))
            .and_then(|_| f.take(len - st.pos).read_to_end(&mut buf))
            .map_err(|e| format!("reading {}: {e}", self.path.display()))?;
        let (records, used) = parse_lines(&buf, &self.path, st.pos)?;
        for r in &records {
            st.apply(r);
        }
        st.pos += used;
        let now = st.now_ms;
        st.expire(now);
        Ok(())
    }
}

fn count_lines(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| b == b'\n').count()
}

fn lock_state<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl FileDedup {
    /// Appends `lines` (each a record or reservation, serialised with its
    /// newline) under the lock, after [`FileDedup::refresh`]; fsynced when
    /// `sync`. Takes them into `st` without reading them back when nobody
    /// else appended meanwhile.
    fn append(
        &self,
        st: &mut FileState,
        text: &[u8],
        lines: &[&DedupRecord],
        sync: bool,
    ) -> Result<(), String> {
        // A torn line left by a server that died mid-append (its request
        // never returned, so it stored nothing): cut it off, so that it
        // does not become a corrupt line once ours follows it.
        let len = st
            .file
            .metadata()
            .map_err(|e| format!("reading {}: {e}", self.path.display()))?
            .len();
        if len > st.pos {
            st.file
                .set_len(st.pos)
                .map_err(|e| format!("cutting the torn tail of {}: {e}", self.path.display()))?;
        }
        #[cfg(test)]
        if self.fail_appends.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(format!(
                "appending to {}: injected failure",
                self.path.display()
            ));
        }
        st.file
            .write_all(text)
            .and_then(|()| if sync { st.file.sync_data() } else { Ok(()) })
            .map_err(|e| format!("appending to {}: {e}", self.path.display()))?;
        // Under the lock nobody else appended: the file now ends with
        // these lines, which need no reading back.
        let end = st
            .file
            .metadata()
            .map_err(|e| format!("reading {}: {e}", self.path.display()))?
            .len();
        if end == st.pos + text.len() as u64 {
            st.pos = end;
            for r in lines {
                st.apply(r);
            }
            Ok(())
        } else {
            // Reads ours back with whatever else is new.
            self.refresh(st)
        }
    }
}

fn serialise(lines: &[&DedupRecord]) -> Result<Vec<u8>, String> {
    let mut text: Vec<u8> = Vec::with_capacity(lines.len() * 128);
    for r in lines {
        serde_json::to_writer(&mut text, r).map_err(|e| e.to_string())?;
        text.push(b'\n');
    }
    Ok(text)
}

impl DedupStore for FileDedup {
    fn begin_many(&self, ids: &[Scoped<'_>], now_ms: u64) -> Result<Vec<Begin>, String> {
        // One lock and one read of other servers' lines for the request;
        // the lookups and the reservations under the file's lock, so no
        // other server can reserve the same ids in between.
        let mut st = lock_state(&self.state);
        st.expire(now_ms);
        let _l = lock(&self.lock_path, self.lock_wait_ms)?;
        self.refresh(&mut st)?;
        // Records of a commit that could not be written (its jobs are
        // stored; only this server's memory knows them) go out now, under
        // the lock this lookup holds anyway: other servers must see them
        // before that commit's reservations lapse.
        if !st.unwritten.is_empty() {
            let unwritten = std::mem::take(&mut st.unwritten);
            let lines: Vec<&DedupRecord> = unwritten.iter().collect();
            let written =
                serialise(&lines).and_then(|text| self.append(&mut st, &text, &lines, true));
            if written.is_err() {
                st.unwritten = unwritten;
            }
        }
        let mut out = Vec::with_capacity(ids.len());
        let mut reserved: Vec<DedupRecord> = Vec::new();
        for s in ids {
            let h = st.hash(s.key, s.id);
            if st.pending.contains(&h) || st.foreign_holds(&h, now_ms) {
                out.push(Begin::Busy);
                continue;
            }
            if let Some(e) = st.index.get(&h) {
                if e.expires_ms > now_ms {
                    out.push(Begin::Done(st.record(s.id, e)));
                    continue;
                }
            }
            st.pending.insert(h);
            reserved.push(st.reservation(s, now_ms, false));
            out.push(Begin::Fresh);
        }
        if reserved.is_empty() {
            return Ok(out);
        }
        let lines: Vec<&DedupRecord> = reserved.iter().collect();
        let written = serialise(&lines).and_then(|text| self.append(&mut st, &text, &lines, false));
        if let Err(e) = written {
            for r in &reserved {
                let h = st.hash(&r.key, &r.id);
                st.pending.remove(&h);
            }
            return Err(e);
        }
        Ok(out)
    }

    fn commit(&self, records: &[DedupRecord]) -> Result<(), String> {
        if records.is_empty() {
            return Ok(());
        }
        let mut st = lock_state(&self.state);
        // The reservations end with this commit (before a rewrite below
        // would copy their lines).
        for r in records {
            let h = st.hash(&r.key, &r.id);
            st.pending.remove(&h);
        }
        // Records of commits that failed to append go first (their jobs
        // were enqueued; memory answers for them until then).
        let unwritten = std::mem::take(&mut st.unwritten);
        let lines: Vec<&DedupRecord> = unwritten.iter().chain(records).collect();
        let result = (|| {
            let text = serialise(&lines)?;
            let _l = lock(&self.lock_path, self.lock_wait_ms)?;
            self.refresh(&mut st)?;
            self.append(&mut st, &text, &lines, true)?;
            // Keep the file near the live records: rewrite it once it
            // holds mostly expired lines. The records are durable already:
            // a rewrite that fails (a full disk, a damaged old line) leaves
            // the file as it was, says why, and is tried again only once
            // the file has doubled.
            if st.lines > (2 * st.index.len() + self.compact_slack).max(st.compact_after) {
                match self.write_live(&mut st) {
                    Ok(()) => st.compact_after = 0,
                    Err(e) => {
                        st.compact_after = 2 * st.lines;
                        eprintln!(
                            "shardq serve: not rewriting {} now: {e} (its records are \
                             unchanged; tried again at {} lines)",
                            self.path.display(),
                            st.compact_after
                        );
                    }
                }
            }
            Ok(())
        })();
        if result.is_err() {
            for r in records {
                st.remember(r);
            }
        }
        if result.is_err() {
            // A later commit writes them (the file may hold part of this
            // one's lines: a record written twice is harmless).
            st.unwritten = unwritten;
            st.unwritten.extend(records.iter().cloned());
            let over = st.unwritten.len().saturating_sub(UNWRITTEN_MAX);
            if over > 0 {
                st.unwritten.drain(..over);
                eprintln!(
                    "shardq serve: {over} dedup records could not be written to {} and are \
                     kept in memory only",
                    self.path.display()
                );
            }
        }
        result
    }

    fn abort(&self, ids: &[Scoped<'_>]) {
        if ids.is_empty() {
            return;
        }
        let mut st = lock_state(&self.state);
        let now = st.now_ms;
        let mut released = Vec::new();
        for s in ids {
            let h = st.hash(s.key, s.id);
            if st.pending.remove(&h) {
                released.push(st.reservation(s, now, true));
            }
        }
        if released.is_empty() {
            return;
        }
        // Other servers learn it at once; if this fails the reservation
        // lapses by itself after RESERVE_MS.
        let lines: Vec<&DedupRecord> = released.iter().collect();
        let _ = (|| {
            let text = serialise(&lines)?;
            let _l = lock(&self.lock_path, self.lock_wait_ms)?;
            self.refresh(&mut st)?;
            self.append(&mut st, &text, &lines, false)
        })();
    }
}

// ---------------------------------------------------------------------------
// Redis: a key per id.
// ---------------------------------------------------------------------------

/// The value of a reserved, not yet committed id.
const PENDING_VALUE: &str = "pending";
/// Connect and reply bound of the dedup connection.
const REDIS_TIMEOUT_MS: u64 = 2_000;

/// Dedup records in Redis. See the module docs.
pub struct RedisDedup {
    url: String,
    namespace: String,
    window_ms: u64,
    /// A Redis Cluster: one key per command, no pipelines.
    cluster: bool,
    conn: Mutex<Option<Box<dyn redis::ConnectionLike + Send>>>,
}

impl RedisDedup {
    /// Dedup keys of namespace `namespace` on the Redis holding the map
    /// (`redis://` or `redis+cluster://`), records kept for `window_ms`.
    pub fn open(url: &str, namespace: &str, window_ms: u64) -> Result<RedisDedup, String> {
        let d = RedisDedup {
            url: url.to_string(),
            namespace: namespace.to_string(),
            window_ms,
            cluster: url.starts_with("redis+cluster://"),
            conn: Mutex::new(None),
        };
        let mut c = lock_state(&d.conn);
        *c = Some(d.connect()?);
        drop(c);
        Ok(d)
    }

    fn connect(&self) -> Result<Box<dyn redis::ConnectionLike + Send>, String> {
        let t = Duration::from_millis(REDIS_TIMEOUT_MS);
        let err = |e: redis::RedisError| format!("dedup store at {}: {e}", self.url);
        if let Some(rest) = self.url.strip_prefix("redis+cluster://") {
            let seeds: Vec<String> = rest
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|s| format!("redis://{s}"))
                .collect();
            let client = redis::cluster::ClusterClient::builder(seeds)
                .connection_timeout(t)
                .response_timeout(t)
                .build()
                .map_err(err)?;
            Ok(Box::new(client.get_connection().map_err(err)?))
        } else {
            let client = redis::Client::open(self.url.as_str()).map_err(err)?;
            let c = client.get_connection_with_timeout(t).map_err(err)?;
            c.set_read_timeout(Some(t)).map_err(err)?;
            c.set_write_timeout(Some(t)).map_err(err)?;
            Ok(Box::new(c))
        }
    }

    /// The Redis key of `id` within `key` (the key's length first, so
    /// that no two pairs share a name).
    fn key(&self, s: &Scoped<'_>) -> String {
        format!(
            "{}:=dedup:{}:{}:{}:{}",
            shardq_redis::keys::NAMESPACE,
            self.namespace,
            s.key.len(),
            s.key,
            s.id
        )
    }

    /// Runs a pipeline (one round trip), reconnecting once after a failure.
    fn run_pipe<T: redis::FromRedisValue>(&self, p: &redis::Pipeline) -> Result<T, String> {
        let mut guard = lock_state(&self.conn);
        for attempt in 0..2 {
            if guard.is_none() {
                *guard = Some(self.connect()?);
            }
            let Some(c) = guard.as_mut() else { break };
            match p.query::<T>(&mut **c) {
                Ok(v) => return Ok(v),
                Err(e) if attempt == 0 && (e.is_io_error() || e.is_connection_dropped()) => {
                    *guard = None;
                }
                Err(e) => return Err(format!("dedup store at {}: {e}", self.url)),
            }
        }
        Err(format!("dedup store at {}: no connection", self.url))
    }

    /// Runs `cmd`, reconnecting once after a failure.
    fn run<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, String> {
        let mut guard = lock_state(&self.conn);
        for attempt in 0..2 {
            if guard.is_none() {
                *guard = Some(self.connect()?);
            }
            let Some(c) = guard.as_mut() else { break };
            match cmd.query::<T>(&mut **c) {
                Ok(v) => return Ok(v),
                Err(e) if attempt == 0 && (e.is_io_error() || e.is_connection_dropped()) => {
                    *guard = None;
                }
                Err(e) => return Err(format!("dedup store at {}: {e}", self.url)),
            }
        }
        Err(format!("dedup store at {}: no connection", self.url))
    }
}

impl RedisDedup {
    /// Reserves `s` (`SET NX PX`) or reads what holds it.
    fn begin_one(&self, s: &Scoped<'_>) -> Result<Begin, String> {
        let key = self.key(s);
        let set: Option<String> = self.run(
            redis::cmd("SET")
                .arg(&key)
                .arg(PENDING_VALUE)
                .arg("NX")
                .arg("PX")
                .arg(PENDING_MS),
        )?;
        if set.is_some() {
            return Ok(Begin::Fresh);
        }
        let found: Option<String> = self.run(redis::cmd("GET").arg(&key))?;
        found_record(&key, found.as_deref())
    }
}

/// What a dedup key holds: nothing or a reservation (busy), or a record.
fn found_record(key: &str, found: Option<&str>) -> Result<Begin, String> {
    match found {
        None | Some(PENDING_VALUE) => Ok(Begin::Busy),
        Some(text) => serde_json::from_str(text)
            .map(Begin::Done)
            .map_err(|e| format!("dedup key {key:?} holds no dedup record: {e}")),
    }
}

impl DedupStore for RedisDedup {
    fn begin_many(&self, ids: &[Scoped<'_>], _now_ms: u64) -> Result<Vec<Begin>, String> {
        if self.cluster || ids.len() < 2 {
            // A cluster connection routes one key per command.
            let mut out = Vec::with_capacity(ids.len());
            for (n, s) in ids.iter().enumerate() {
                match self.begin_one(s) {
                    Ok(b) => out.push(b),
                    Err(e) => {
                        let fresh: Vec<Scoped<'_>> = ids[..n]
                            .iter()
                            .zip(&out)
                            .filter(|(_, b)| matches!(b, Begin::Fresh))
                            .map(|(s, _)| *s)
                            .collect();
                        self.abort(&fresh);
                        return Err(e);
                    }
                }
            }
            return Ok(out);
        }
        let mut reserve = redis::pipe();
        for s in ids {
            reserve
                .cmd("SET")
                .arg(self.key(s))
                .arg(PENDING_VALUE)
                .arg("NX")
                .arg("PX")
                .arg(PENDING_MS);
        }
        let set: Vec<Option<String>> = self.run_pipe(&reserve)?;
        let taken: Vec<usize> = (0..ids.len()).filter(|&i| set[i].is_none()).collect();
        let mut found: Vec<Option<String>> = Vec::new();
        if !taken.is_empty() {
            let mut get = redis::pipe();
            for &i in &taken {
                get.cmd("GET").arg(self.key(&ids[i]));
            }
            found = self.run_pipe(&get)?;
        }
        let mut out: Vec<Begin> = vec![Begin::Fresh; ids.len()];
        for (n, &i) in taken.iter().enumerate() {
            out[i] = found_record(&self.key(&ids[i]), found[n].as_deref())?;
        }
        Ok(out)
    }

    fn commit(&self, records: &[DedupRecord]) -> Result<(), String> {
        let key = |r: &DedupRecord| {
            self.key(&Scoped {
                key: &r.key,
                id: &r.id,
            })
        };
        if self.cluster {
            for r in records {
                let text = serde_json::to_string(r).map_err(|e| e.to_string())?;
                let () = self.run(
                    redis::cmd("SET")
                        .arg(key(r))
                        .arg(text)
                        .arg("PX")
                        .arg(self.window_ms.max(1)),
                )?;
            }
            return Ok(());
        }
        let mut p = redis::pipe();
        for r in records {
            let text = serde_json::to_string(r).map_err(|e| e.to_string())?;
            p.cmd("SET")
                .arg(key(r))
                .arg(text)
                .arg("PX")
                .arg(self.window_ms.max(1))
                .ignore();
        }
        let () = self.run_pipe(&p)?;
        Ok(())
    }

    fn abort(&self, ids: &[Scoped<'_>]) {
        for s in ids {
            // Only a reservation is dropped, never a record.
            let script = redis::cmd("EVAL")
                .arg("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0")
                .arg(1)
                .arg(self.key(s))
                .arg(PENDING_VALUE)
                .clone();
            let _: Result<i64, String> = self.run(&script);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, job: u64, expires_ms: u64) -> DedupRecord {
        DedupRecord::new("k", id, "shard-0", job, expires_ms)
    }

    fn ids<'a>(key: &'a str, ids: &[&'a str]) -> Vec<Scoped<'a>> {
        ids.iter().map(|id| Scoped { key, id }).collect()
    }

    #[test]
    fn records_survive_reopen_expire_and_torn_tails_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let d = FileDedup::open(dir.path(), 1000).unwrap();
        assert_eq!(d.begin("k", "a", 1000).unwrap(), Begin::Fresh);
        assert_eq!(d.begin("k", "a", 1000).unwrap(), Begin::Busy);
        assert_eq!(d.begin("k", "b", 1000).unwrap(), Begin::Fresh);
        d.commit(&[rec("a", 1, 5000), rec("b", 2, 1500)]).unwrap();
        assert_eq!(
            d.begin("k", "a", 1000).unwrap(),
            Begin::Done(rec("a", 1, 5000))
        );
        drop(d);
        // A torn append.
        let path = dir.path().join(DEDUP_FILE);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"id\":\"c\",\"sha").unwrap();
        let d = FileDedup::open(dir.path(), 2000).unwrap();
        assert_eq!(
            d.begin("k", "a", 2000).unwrap(),
            Begin::Done(rec("a", 1, 5000))
        );
        assert_eq!(d.begin("k", "b", 2000).unwrap(), Begin::Fresh, "b expired");
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<DedupRecord> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "pruned on open: {text}");
        assert_eq!(lines[0], rec("a", 1, 5000));
        assert!(
            lines[1].id == "b" && lines[1].reserved_by.is_some() && !lines[1].released,
            "then b's reservation: {text}"
        );
        // A second server over the same file sees the first one's commits.
        let other = FileDedup::open(dir.path(), 2000).unwrap();
        d.commit(&[rec("b", 3, 9000)]).unwrap();
        assert_eq!(
            other.begin("k", "b", 2000).unwrap(),
            Begin::Done(rec("b", 3, 9000))
        );
        d.abort(&ids("k", &["zzz"]));
        // A server that dies mid-append while others run: the next commit
        // cuts the torn line instead of turning it into a corrupt one.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"id\":\"d\",\"sh").unwrap();
        d.commit(&[rec("e", 4, 9000)]).unwrap();
        assert_eq!(
            other.begin("k", "e", 2000).unwrap(),
            Begin::Done(rec("e", 4, 9000))
        );
        let again = FileDedup::open(dir.path(), 2000).unwrap();
        assert_eq!(
            again.begin("k", "e", 2000).unwrap(),
            Begin::Done(rec("e", 4, 9000))
        );
        assert_eq!(again.begin("k", "d", 2000).unwrap(), Begin::Fresh);
        // One request's ids are answered in one pass, in order.
        assert_eq!(
            again
                .begin_many(&ids("k", &["a", "x", "x", "e"]), 2000)
                .unwrap(),
            vec![
                Begin::Done(rec("a", 1, 5000)),
                Begin::Fresh,
                Begin::Busy,
                Begin::Done(rec("e", 4, 9000))
            ]
        );
    }

    #[test]
    fn expired_records_leave_memory_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DEDUP_FILE);
        let mut d = FileDedup::open(dir.path(), 1000).unwrap();
        d.compact_slack = 10;
        let other = FileDedup::open(dir.path(), 1000).unwrap();
        let names: Vec<String> = (0..30).map(|i| format!("old-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        assert!(d
            .begin_many(&ids("k", &refs), 1000)
            .unwrap()
            .iter()
            .all(|b| *b == Begin::Fresh));
        let old: Vec<DedupRecord> = names.iter().map(|id| rec(id, 1, 1500)).collect();
        d.commit(&old).unwrap();
        assert_eq!(lock_state(&d.state).index.len(), 30);
        // Past their expiry they are forgotten in memory, not only ignored.
        assert_eq!(d.begin("k", "fresh", 2000).unwrap(), Begin::Fresh);
        assert_eq!(lock_state(&d.state).index.len(), 0);
        // The next commit finds the file mostly expired and rewrites it.
        d.commit(&[rec("fresh", 2, 9000)]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 1, "compacted: {text}");
        // Another server over the same dir follows the new file.
        assert_eq!(
            other.begin("k", "fresh", 2000).unwrap(),
            Begin::Done(rec("fresh", 2, 9000))
        );
        assert_eq!(other.begin("k", "old-3", 2000).unwrap(), Begin::Fresh);
        drop(d);
        let again = FileDedup::open(dir.path(), 2000).unwrap();
        assert_eq!(
            again.begin("k", "fresh", 2000).unwrap(),
            Begin::Done(rec("fresh", 2, 9000))
        );
    }

    #[test]
    fn memory_holds_hashes_and_counted_names_and_a_rewrite_keeps_the_latest_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DEDUP_FILE);
        let d = FileDedup::open(dir.path(), 1000).unwrap();
        let r = |id: &str, shard: &str, job: u64, key: &str, expires_ms: u64| {
            DedupRecord::new(key, id, shard, job, expires_ms)
        };
        // Each record answers with its own shard and key.
        d.commit(&[
            r("a", "shard-1", 1, "tenant-1", 1500),
            r("b", "shard-2", 2, "tenant-2", 9000),
            r("c", "shard-2", 3, "tenant-2", 9000),
        ])
        .unwrap();
        let asked = [
            Scoped {
                key: "tenant-1",
                id: "a",
            },
            Scoped {
                key: "tenant-2",
                id: "b",
            },
            Scoped {
                key: "tenant-2",
                id: "c",
            },
        ];
        assert_eq!(
            d.begin_many(&asked, 1000).unwrap(),
            vec![
                Begin::Done(r("a", "shard-1", 1, "tenant-1", 1500)),
                Begin::Done(r("b", "shard-2", 2, "tenant-2", 9000)),
                Begin::Done(r("c", "shard-2", 3, "tenant-2", 9000)),
            ]
        );
        // The same ids under another key are other ids.
        assert_eq!(
            d.begin_many(&ids("tenant-9", &["a", "b"]), 1000).unwrap(),
            vec![Begin::Fresh, Begin::Fresh]
        );
        d.abort(&ids("tenant-9", &["a", "b"]));
        {
            let st = lock_state(&d.state);
            assert_eq!((st.keys.slots.len(), st.shards.slots.len()), (2, 2));
            assert_eq!(st.names_in_use(), (3, 3), "one count per record");
        }
        // A later record of the same id (its first job was lost, say)
        // replaces the first one, in memory and in a rewrite.
        d.commit(&[r("b", "shard-3", 7, "tenant-2", 9500)]).unwrap();
        // "a" expires: its names leave memory with it.
        assert_eq!(d.begin("k", "zz", 2000).unwrap(), Begin::Fresh);
        d.abort(&ids("k", &["zz"]));
        {
            let st = lock_state(&d.state);
            let mut keys: Vec<&str> = st.keys.slots.keys().map(|k| &**k).collect();
            keys.sort_unstable();
            assert_eq!(keys, ["tenant-2"]);
            let mut shards: Vec<&str> = st.shards.slots.keys().map(|k| &**k).collect();
            shards.sort_unstable();
            assert_eq!(shards, ["shard-2", "shard-3"]);
            assert_eq!(st.names_in_use(), (2, 2));
        }
        d.commit(&[r("e", "shard-2", 8, "tenant-2", 9000)]).unwrap();
        // Five records and six reservation lines (three reserved, three
        // released) for three live records: below the rewrite's threshold
        // (twice the live ones plus a slack), so rewrite by hand.
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 11);
        d.write_live(&mut lock_state(&d.state)).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<DedupRecord> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(
            lines,
            vec![
                r("c", "shard-2", 3, "tenant-2", 9000),
                r("b", "shard-3", 7, "tenant-2", 9500),
                r("e", "shard-2", 8, "tenant-2", 9000),
            ],
            "the rewrite copies each id's latest live line, in file order, and no released reservation"
        );
        // The replaced record's expiry does not end the later one; the
        // later one's does, with its names.
        assert_eq!(
            d.begin("tenant-2", "b", 9200).unwrap(),
            Begin::Done(r("b", "shard-3", 7, "tenant-2", 9500))
        );
        assert_eq!(d.begin("tenant-2", "b", 9600).unwrap(), Begin::Fresh);
        d.abort(&ids("tenant-2", &["b"]));
        {
            let st = lock_state(&d.state);
            assert_eq!(st.index.len(), 0, "every record expired at 9600");
            assert_eq!(st.names_in_use(), (0, 0));
            assert!(st.keys.slots.is_empty() && st.shards.slots.is_empty());
        }
        drop(d);
        let again = FileDedup::open(dir.path(), 2000).unwrap();
        assert_eq!(
            again.begin_many(&asked, 2000).unwrap(),
            vec![
                Begin::Fresh,
                Begin::Done(r("b", "shard-3", 7, "tenant-2", 9500)),
                Begin::Done(r("c", "shard-2", 3, "tenant-2", 9000)),
            ]
        );
        // What memory holds per record.
        assert!(std::mem::size_of::<(IdHash, Entry)>() <= 40);
    }

    #[test]
    fn a_rewrite_that_fails_leaves_the_file_and_the_commit_stands() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DEDUP_FILE);
        let mut d = FileDedup::open(dir.path(), 1000).unwrap();
        d.compact_slack = 0;
        let old: Vec<DedupRecord> = (0..4).map(|i| rec(&format!("old-{i}"), i, 1500)).collect();
        d.commit(&old).unwrap();
        d.commit(&[rec("keep", 7, 9000)]).unwrap();
        // A byte of an old line goes bad after it was read.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[2] = b'#';
        std::fs::write(&path, &bytes).unwrap();
        // Past the old ones' expiry the file is mostly expired: the rewrite
        // meets the bad line and gives up, the commit stands.
        assert_eq!(d.begin("k", "new", 2000).unwrap(), Begin::Fresh);
        d.commit(&[rec("new", 4, 9000)]).unwrap();
        let after = std::fs::read(&path).unwrap();
        assert_eq!(
            &after[..bytes.len()],
            &bytes[..],
            "the file was not rewritten"
        );
        // The five records, "new"'s reservation and its record.
        assert_eq!(
            String::from_utf8_lossy(&after).lines().count(),
            7,
            "{}",
            String::from_utf8_lossy(&after)
        );
        assert!(!dir.path().join(format!(".{DEDUP_FILE}.tmp")).exists());
        assert_eq!(
            d.begin("k", "new", 2000).unwrap(),
            Begin::Done(rec("new", 4, 9000))
        );
        assert_eq!(
            d.begin("k", "keep", 2000).unwrap(),
            Begin::Done(rec("keep", 7, 9000))
        );
        // No new try on every commit: only once the file has doubled.
        assert_eq!(lock_state(&d.state).compact_after, 14, "twice the 7 lines");
        // Opening names the bad line, as before.
        let e = FileDedup::open(dir.path(), 2000).err().unwrap();
        assert!(
            e.contains("offset 0") && e.contains("not a dedup record"),
            "{e}"
        );
    }

    #[test]
    fn records_of_a_commit_that_failed_are_written_with_the_next_one() {
        use std::sync::atomic::Ordering;
        let dir = tempfile::tempdir().unwrap();
        let mut d = FileDedup::open(dir.path(), 1000).unwrap();
        d.compact_slack = 0;
        d.fail_appends.store(true, Ordering::SeqCst);
        let e = d.commit(&[rec("a", 1, 9000)]).unwrap_err();
        assert!(e.contains(DEDUP_FILE), "{e}");
        // Memory answers for it meanwhile; a rewrite does not drop it.
        assert_eq!(
            d.begin("k", "a", 1000).unwrap(),
            Begin::Done(rec("a", 1, 9000))
        );
        d.write_live(&mut lock_state(&d.state)).unwrap();
        assert_eq!(
            d.begin("k", "a", 1000).unwrap(),
            Begin::Done(rec("a", 1, 9000))
        );
        d.fail_appends.store(false, Ordering::SeqCst);
        d.commit(&[rec("b", 2, 9000)]).unwrap();
        drop(d);
        let again = FileDedup::open(dir.path(), 1000).unwrap();
        assert_eq!(
            again.begin_many(&ids("k", &["a", "b"]), 1000).unwrap(),
            vec![
                Begin::Done(rec("a", 1, 9000)),
                Begin::Done(rec("b", 2, 9000))
            ],
            "the failed commit's record reached the file with the next commit"
        );
    }

    #[test]
    fn a_failed_commit_reaches_the_other_servers_with_the_next_lookup() {
        use std::sync::atomic::Ordering;
        let dir = tempfile::tempdir().unwrap();
        let d = FileDedup::open(dir.path(), 1000).unwrap();
        let other = FileDedup::open(dir.path(), 1000).unwrap();
        assert_eq!(d.begin("k", "a", 1000).unwrap(), Begin::Fresh);
        d.fail_appends.store(true, Ordering::SeqCst);
        let a = rec("a", 1, 1000 + 2 * RESERVE_MS);
        assert!(d.commit(std::slice::from_ref(&a)).is_err());
        d.fail_appends.store(false, Ordering::SeqCst);
        // No commit follows, only a lookup of another id: it writes the
        // record, so another server never takes the id as fresh once the
        // reservation lapses.
        assert_eq!(d.begin("k", "z", 1000).unwrap(), Begin::Fresh);
        assert_eq!(
            other.begin("k", "a", 1000 + RESERVE_MS + 1).unwrap(),
            Begin::Done(a)
        );
    }

    #[test]
    fn a_stalled_holder_of_the_lock_fails_a_commit_after_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = FileDedup::open(dir.path(), 1000).unwrap();
        d.lock_wait_ms = 300;
        let held = lock(&dir.path().join(DEDUP_LOCK_FILE), 0).unwrap();
        let start = std::time::Instant::now();
        let e = d.commit(&[rec("a", 1, 9000)]).unwrap_err();
        assert!(
            start.elapsed() >= Duration::from_millis(300),
            "{:?}",
            start.elapsed()
        );
        assert!(e.contains(DEDUP_LOCK_FILE) && e.contains("stalled"), "{e}");
        // A lookup needs the lock too (it reserves across servers): it
        // fails after the bound, naming the lock, and reserves nothing.
        let e = d.begin("k", "c", 1000).unwrap_err();
        assert!(e.contains(DEDUP_LOCK_FILE), "{e}");
        drop(held);
        // Memory still answers for the enqueued job; the next commit writes it.
        assert_eq!(
            d.begin("k", "a", 1000).unwrap(),
            Begin::Done(rec("a", 1, 9000))
        );
        assert_eq!(d.begin("k", "c", 1000).unwrap(), Begin::Fresh);
        d.commit(&[rec("b", 2, 9000)]).unwrap();
        let again = FileDedup::open(dir.path(), 1000).unwrap();
        assert_eq!(
            again.begin("k", "a", 1000).unwrap(),
            Begin::Done(rec("a", 1, 9000))
        );
    }

    #[test]
    fn two_servers_given_one_id_at_once_store_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let a = FileDedup::open(dir.path(), 1000).unwrap();
        let b = FileDedup::open(dir.path(), 1000).unwrap();
        // A reserves; B, asked for the same id of the same key meanwhile,
        // is told it is busy (not free); another key's id is B's own.
        assert_eq!(a.begin("t1", "inv-1", 1000).unwrap(), Begin::Fresh);
        assert_eq!(b.begin("t1", "inv-1", 1000).unwrap(), Begin::Busy);
        assert_eq!(b.begin("t2", "inv-1", 1000).unwrap(), Begin::Fresh);
        // A commits: B answers with A's job.
        let done = DedupRecord::new("t1", "inv-1", "shard-0", 7, 9000);
        a.commit(std::slice::from_ref(&done)).unwrap();
        assert_eq!(
            b.begin("t1", "inv-1", 1000).unwrap(),
            Begin::Done(done.clone())
        );
        // A reservation given up is free at once for the other server.
        assert_eq!(a.begin("t1", "inv-2", 1000).unwrap(), Begin::Fresh);
        assert_eq!(b.begin("t1", "inv-2", 1000).unwrap(), Begin::Busy);
        a.abort(&ids("t1", &["inv-2"]));
        assert_eq!(b.begin("t1", "inv-2", 1000).unwrap(), Begin::Fresh);
        // A server that died holding a reservation: a server opened after
        // it still sees it busy, until it lapses.
        assert_eq!(a.begin("t1", "inv-3", 1000).unwrap(), Begin::Fresh);
        drop(a);
        let c = FileDedup::open(dir.path(), 2000).unwrap();
        assert_eq!(c.begin("t1", "inv-3", 2000).unwrap(), Begin::Busy);
        assert_eq!(c.begin("t1", "inv-1", 2000).unwrap(), Begin::Done(done));
        assert_eq!(
            c.begin("t1", "inv-3", 1000 + RESERVE_MS + 1).unwrap(),
            Begin::Fresh,
            "a dead server's reservation lapses"
        );
    }

    #[test]
    fn many_servers_racing_for_the_same_ids_reserve_each_once() {
        let dir = tempfile::tempdir().unwrap();
        let servers: Vec<FileDedup> = (0..4)
            .map(|_| FileDedup::open(dir.path(), 1000).unwrap())
            .collect();
        let fresh = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for d in &servers {
                let fresh = &fresh;
                sc.spawn(move || {
                    for i in 0..200 {
                        let id = format!("id-{i}");
                        if d.begin("k", &id, 1000).unwrap() == Begin::Fresh {
                            fresh.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        assert_eq!(
            fresh.into_inner(),
            200,
            "each id reserved by exactly one server"
        );
    }

    #[test]
    fn a_corrupt_line_is_named_not_skipped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(DEDUP_FILE), b"not json\n").unwrap();
        let e = FileDedup::open(dir.path(), 0).err().unwrap();
        assert!(e.contains("offset 0") && e.contains(DEDUP_FILE), "{e}");
    }
}
