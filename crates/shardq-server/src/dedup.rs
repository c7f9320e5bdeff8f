//! Idempotent enqueue: what a `dedup_id` was enqueued as, remembered for
//! the dedup window across server restarts.
//!
//! [`DedupStore::begin`] reserves an id for one request (or returns the
//! live record, or says another request holds it); after the enqueue
//! [`DedupStore::commit`] makes the records durable *before* the reply;
//! [`DedupStore::abort`] drops reservations whose jobs were not enqueued.
//!
//! * [`FileDedup`] (embedded data dirs): `dedup.log` in the data dir, one
//!   JSON line per record, appended and fsynced under `.dedup.lock`;
//!   expired records leave memory as time passes, and the file is rewritten
//!   with the live records only on open and whenever it holds more than
//!   twice as many lines as live records (plus a slack); servers sharing
//!   the data dir read each other's new lines before each lookup (and the
//!   whole file again after a rewrite). Reservations are in memory.
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
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ahash::RandomState;
use rustix::fs::{flock, FlockOperation};
use serde::{Deserialize, Serialize};

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
    /// Looks `id` up and, if unknown, reserves it.
    fn begin(&self, id: &str, now_ms: u64) -> Result<Begin, String>;
    /// [`DedupStore::begin`] for every id of a request, in order (a store
    /// may answer them in one round trip).
    fn begin_many(&self, ids: &[&str], now_ms: u64) -> Result<Vec<Begin>, String> {
        begin_each(self, ids, now_ms)
    }
    /// Makes `records` durable and drops their reservations.
    fn commit(&self, records: &[DedupRecord]) -> Result<(), String>;
    /// Drops reservations of ids that were not enqueued.
    fn abort(&self, ids: &[String]);
}

/// [`DedupStore::begin`] id by id; on an error, the ids this call reserved
/// are released before it is returned.
fn begin_each<S: DedupStore + ?Sized>(
    store: &S,
    ids: &[&str],
    now_ms: u64,
) -> Result<Vec<Begin>, String> {
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        match store.begin(id, now_ms) {
            Ok(b) => out.push(b),
            Err(e) => {
                let fresh: Vec<String> = ids
                    .iter()
                    .zip(&out)
                    .filter(|(_, b)| matches!(b, Begin::Fresh))
                    .map(|(id, _)| id.to_string())
                    .collect();
                store.abort(&fresh);
                return Err(e);
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Embedded: an append-only JSON-lines file.
// ---------------------------------------------------------------------------

/// A record in memory: the id is the map's key (shared with `expiry`), the
/// shard name is shared by every record of the shard.
struct Entry {
    shard: Arc<str>,
    job: u64,
    key: Box<str>,
    expires_ms: u64,
}

impl Entry {
    fn record(&self, id: &str) -> DedupRecord {
        DedupRecord {
            id: id.to_string(),
            shard: self.shard.to_string(),
            job: self.job,
            key: self.key.to_string(),
            expires_ms: self.expires_ms,
        }
    }
}

struct FileState {
    index: HashMap<Arc<str>, Entry, RandomState>,
    /// `(expires_ms, id)` in the order the records were read or written:
    /// expired ones are dropped from `index` from the front.
    expiry: VecDeque<(u64, Arc<str>)>,
    shards: HashSet<Arc<str>, RandomState>,
    pending: HashSet<String, RandomState>,
    file: File,
    /// Bytes of the file read into `index`.
    pos: u64,
    /// Record lines in the file (live or not).
    lines: usize,
    ino: u64,
    /// The latest `now_ms` a caller gave.
    now_ms: u64,
}

impl FileState {
    fn remember(&mut self, r: &DedupRecord) {
        let id: Arc<str> = Arc::from(r.id.as_str());
        let shard = match self.shards.get(r.shard.as_str()) {
            Some(s) => Arc::clone(s),
            None => {
                let s: Arc<str> = Arc::from(r.shard.as_str());
                self.shards.insert(Arc::clone(&s));
                s
            }
        };
        self.expiry.push_back((r.expires_ms, Arc::clone(&id)));
        self.index.insert(
            id,
            Entry {
                shard,
                job: r.job,
                key: r.key.as_str().into(),
                expires_ms: r.expires_ms,
            },
        );
        self.lines += 1;
    }

    /// Forgets the records expired at `now_ms`.
    fn expire(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        while let Some((at, _)) = self.expiry.front() {
            if *at > self.now_ms {
                break;
            }
            let (at, id) = self.expiry.pop_front().expect("front exists");
            // A later record of the same id lives on.
            if self.index.get(&id).is_some_and(|e| e.expires_ms <= at) {
                self.index.remove(&id);
            }
        }
    }
}

/// Dedup records in `dedup.log`. See the module docs.
pub struct FileDedup {
    path: PathBuf,
    lock_path: PathBuf,
    /// [`COMPACT_SLACK_LINES`], smaller in tests.
    compact_slack: usize,
    state: Mutex<FileState>,
}

struct Locked(File);

impl Drop for Locked {
    fn drop(&mut self) {
        let _ = flock(&self.0, FlockOperation::Unlock);
    }
}

fn lock(path: &Path) -> Result<Locked, String> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    flock(&f, FlockOperation::LockExclusive)
        .map_err(|e| format!("locking {}: {e}", path.display()))?;
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
        let _l = lock(&lock_path)?;
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        let (records, used) = parse_lines(&bytes, &path, 0)?;
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
        let mut st = FileState {
            index: HashMap::default(),
            expiry: VecDeque::new(),
            shards: HashSet::default(),
            pending: HashSet::default(),
            file,
            pos,
            lines: 0,
            ino,
            now_ms,
        };
        let mut live = live;
        live.sort_by_key(|r| r.expires_ms);
        for r in live {
            st.remember(&r);
        }
        let d = FileDedup {
            path,
            lock_path,
            compact_slack: COMPACT_SLACK_LINES,
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
    /// and reopens it. Other servers see a new inode and read it again.
    fn write_live(&self, st: &mut FileState) -> Result<(), String> {
        let mut text = String::new();
        let mut written = HashSet::<&str, RandomState>::default();
        for (_, id) in &st.expiry {
            if !written.insert(id) {
                continue;
            }
            if let Some(e) = st.index.get(id) {
                text.push_str(&serde_json::to_string(&e.record(id)).map_err(|e| e.to_string())?);
                text.push('\n');
            }
        }
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(format!(".{DEDUP_FILE}.tmp"));
        let mut f = File::create(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
        f.write_all(text.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &self.path)
            .map_err(|e| format!("renaming {} to {}: {e}", tmp.display(), self.path.display()))?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        let (file, ino) = open_append(&self.path)?;
        st.file = file;
        st.ino = ino;
        st.pos = text.len() as u64;
        // Each id once, oldest expiry first.
        let mut seen = HashSet::<Arc<str>, RandomState>::default();
        st.expiry
            .retain(|(_, id)| st.index.contains_key(id) && seen.insert(Arc::clone(id)));
        st.lines = st.expiry.len();
        Ok(())
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
            st.lines = 0;
            st.index.clear();
            st.expiry.clear();
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
            st.remember(r);
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

impl DedupStore for FileDedup {
    fn begin(&self, id: &str, now_ms: u64) -> Result<Begin, String> {
        self.begin_many(&[id], now_ms).map(|mut v| v.remove(0))
    }

    fn begin_many(&self, ids: &[&str], now_ms: u64) -> Result<Vec<Begin>, String> {
        // One lock and one read of other servers' lines for the request.
        let mut st = lock_state(&self.state);
        st.expire(now_ms);
        self.refresh(&mut st)?;
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            if st.pending.contains(id) {
                out.push(Begin::Busy);
                continue;
            }
            if let Some(e) = st.index.get(id) {
                if e.expires_ms > now_ms {
                    out.push(Begin::Done(e.record(id)));
                    continue;
                }
            }
            st.pending.insert(id.to_string());
            out.push(Begin::Fresh);
        }
        Ok(out)
    }

    fn commit(&self, records: &[DedupRecord]) -> Result<(), String> {
        if records.is_empty() {
            return Ok(());
        }
        let mut text: Vec<u8> = Vec::with_capacity(records.len() * 128);
        for r in records {
            serde_json::to_writer(&mut text, r).map_err(|e| e.to_string())?;
            text.push(b'\n');
        }
        let mut st = lock_state(&self.state);
        let result = (|| {
            let _l = lock(&self.lock_path)?;
            self.refresh(&mut st)?;
            // A torn line left by a server that died mid-append (its commit
            // never returned, so it stored nothing): cut it off, so that it
            // does not become a corrupt line once ours follows it.
            let len = st
                .file
                .metadata()
                .map_err(|e| format!("reading {}: {e}", self.path.display()))?
                .len();
            if len > st.pos {
                st.file.set_len(st.pos).map_err(|e| {
                    format!("cutting the torn tail of {}: {e}", self.path.display())
                })?;
            }
            st.file
                .write_all(&text)
                .and_then(|()| st.file.sync_data())
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
                for r in records {
                    st.remember(r);
                }
            } else {
                // Reads ours back with whatever else is new.
                self.refresh(&mut st)?;
            }
            // Keep the file near the live records: rewrite it once it
            // holds mostly expired lines.
            if st.lines > 2 * st.index.len() + self.compact_slack {
                self.write_live(&mut st)?;
            }
            Ok(())
        })();
        for r in records {
            st.pending.remove(&r.id);
            if result.is_err() {
                st.remember(r);
            }
        }
        result
    }

    fn abort(&self, ids: &[String]) {
        let mut st = lock_state(&self.state);
        for id in ids {
            st.pending.remove(id);
        }
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

    fn key(&self, id: &str) -> String {
        format!(
            "{}:=dedup:{}:{id}",
            shardq_redis::keys::NAMESPACE,
            self.namespace
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

impl DedupStore for RedisDedup {
    fn begin(&self, id: &str, _now_ms: u64) -> Result<Begin, String> {
        let key = self.key(id);
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
        match found.as_deref() {
            None => Ok(Begin::Busy),
            Some(PENDING_VALUE) => Ok(Begin::Busy),
            Some(text) => serde_json::from_str(text)
                .map(Begin::Done)
                .map_err(|e| format!("dedup key {key:?} holds no dedup record: {e}")),
        }
    }

    fn begin_many(&self, ids: &[&str], now_ms: u64) -> Result<Vec<Begin>, String> {
        if self.cluster || ids.len() < 2 {
            // A cluster connection routes one key per command.
            return begin_each(self, ids, now_ms);
        }
        let mut reserve = redis::pipe();
        for id in ids {
            reserve
                .cmd("SET")
                .arg(self.key(id))
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
                get.cmd("GET").arg(self.key(ids[i]));
            }
            found = self.run_pipe(&get)?;
        }
        let mut out: Vec<Begin> = vec![Begin::Fresh; ids.len()];
        for (n, &i) in taken.iter().enumerate() {
            out[i] = match found[n].as_deref() {
                None | Some(PENDING_VALUE) => Begin::Busy,
                Some(text) => serde_json::from_str(text).map(Begin::Done).map_err(|e| {
                    format!(
                        "dedup key {:?} holds no dedup record: {e}",
                        self.key(ids[i])
                    )
                })?,
            };
        }
        Ok(out)
    }

    fn commit(&self, records: &[DedupRecord]) -> Result<(), String> {
        if self.cluster {
            for r in records {
                let text = serde_json::to_string(r).map_err(|e| e.to_string())?;
                let () = self.run(
                    redis::cmd("SET")
                        .arg(self.key(&r.id))
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
                .arg(self.key(&r.id))
                .arg(text)
                .arg("PX")
                .arg(self.window_ms.max(1))
                .ignore();
        }
        let () = self.run_pipe(&p)?;
        Ok(())
    }

    fn abort(&self, ids: &[String]) {
        for id in ids {
            // Only a reservation is dropped, never a record.
            let script = redis::cmd("EVAL")
                .arg("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0")
                .arg(1)
                .arg(self.key(id))
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
        DedupRecord {
            id: id.into(),
            shard: "shard-0".into(),
            job,
            key: "k".into(),
            expires_ms,
        }
    }

    #[test]
    fn records_survive_reopen_expire_and_torn_tails_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let d = FileDedup::open(dir.path(), 1000).unwrap();
        assert_eq!(d.begin("a", 1000).unwrap(), Begin::Fresh);
        assert_eq!(d.begin("a", 1000).unwrap(), Begin::Busy);
        assert_eq!(d.begin("b", 1000).unwrap(), Begin::Fresh);
        d.commit(&[rec("a", 1, 5000), rec("b", 2, 1500)]).unwrap();
        assert_eq!(d.begin("a", 1000).unwrap(), Begin::Done(rec("a", 1, 5000)));
        drop(d);
        // A torn append.
        let path = dir.path().join(DEDUP_FILE);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"id\":\"c\",\"sha").unwrap();
        let d = FileDedup::open(dir.path(), 2000).unwrap();
        assert_eq!(d.begin("a", 2000).unwrap(), Begin::Done(rec("a", 1, 5000)));
        assert_eq!(d.begin("b", 2000).unwrap(), Begin::Fresh, "b expired");
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 1, "pruned on open: {text}");
        // A second server over the same file sees the first one's commits.
        let other = FileDedup::open(dir.path(), 2000).unwrap();
        d.commit(&[rec("b", 3, 9000)]).unwrap();
        assert_eq!(
            other.begin("b", 2000).unwrap(),
            Begin::Done(rec("b", 3, 9000))
        );
        d.abort(&["zzz".into()]);
        // A server that dies mid-append while others run: the next commit
        // cuts the torn line instead of turning it into a corrupt one.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"id\":\"d\",\"sh").unwrap();
        d.commit(&[rec("e", 4, 9000)]).unwrap();
        assert_eq!(
            other.begin("e", 2000).unwrap(),
            Begin::Done(rec("e", 4, 9000))
        );
        let again = FileDedup::open(dir.path(), 2000).unwrap();
        assert_eq!(
            again.begin("e", 2000).unwrap(),
            Begin::Done(rec("e", 4, 9000))
        );
        assert_eq!(again.begin("d", 2000).unwrap(), Begin::Fresh);
        // One request's ids are answered in one pass, in order.
        assert_eq!(
            again.begin_many(&["a", "x", "x", "e"], 2000).unwrap(),
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
        let ids: Vec<String> = (0..30).map(|i| format!("old-{i}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        assert!(d
            .begin_many(&refs, 1000)
            .unwrap()
            .iter()
            .all(|b| *b == Begin::Fresh));
        let old: Vec<DedupRecord> = ids.iter().map(|id| rec(id, 1, 1500)).collect();
        d.commit(&old).unwrap();
        assert_eq!(lock_state(&d.state).index.len(), 30);
        // Past their expiry they are forgotten in memory, not only ignored.
        assert_eq!(d.begin("fresh", 2000).unwrap(), Begin::Fresh);
        assert_eq!(lock_state(&d.state).index.len(), 0);
        // The next commit finds the file mostly expired and rewrites it.
        d.commit(&[rec("fresh", 2, 9000)]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 1, "compacted: {text}");
        // Another server over the same dir follows the new file.
        assert_eq!(
            other.begin("fresh", 2000).unwrap(),
            Begin::Done(rec("fresh", 2, 9000))
        );
        assert_eq!(other.begin("old-3", 2000).unwrap(), Begin::Fresh);
        drop(d);
        let again = FileDedup::open(dir.path(), 2000).unwrap();
        assert_eq!(
            again.begin("fresh", 2000).unwrap(),
            Begin::Done(rec("fresh", 2, 9000))
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
