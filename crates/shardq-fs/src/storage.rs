//! All disk access to segment files goes through [`Storage`] and [`LogFile`],
//! so tests can inject failed writes and fsyncs ([`FaultyStorage`]) and
//! power losses that drop what was not fsynced ([`CrashStorage`]).
//!
//! This module moves bytes; it must never interpret them.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Suffix of segment files; the stem is the segment's base position,
/// zero-padded to 20 digits.
pub const SEGMENT_SUFFIX: &str = ".seg";

/// File name of the segment that starts at `base`.
pub fn segment_name(base: u64) -> String {
    format!("{base:020}{SEGMENT_SUFFIX}")
}

/// One open segment file.
#[allow(clippy::len_without_is_empty)] // a file length, not a collection
pub trait LogFile: Send + Sync {
    /// Reads at `offset`; returns bytes read (0 at end of file).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Appends all of `data` at the end of the file.
    fn append(&self, data: &[u8]) -> io::Result<()>;
    /// Overwrites bytes at `offset` (repair only).
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    /// Makes written data durable (fdatasync).
    fn sync(&self) -> io::Result<()>;
    /// Current file length.
    fn len(&self) -> io::Result<u64>;
    /// Cuts the file to `len` bytes.
    fn truncate(&self, len: u64) -> io::Result<()>;
}

/// Opens, lists and removes segment files.
pub trait Storage: Send + Sync + std::fmt::Debug {
    /// Opens a segment for reading and appending; creates it if `create`.
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>>;
    /// Deletes a segment.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Makes a directory's entries (created or removed files) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Replaces a small state file (a shard's `fence.json`,
    /// `reclaimed.json`, the data dir's `membership.json` and map files)
    /// atomically and durably: temp file, fsync, rename,
    /// fsync of the directory. Durable once it returns.
    fn write_file_atomic(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        crate::layout::write_atomic(path, bytes)
    }
    /// Reads a small state file whole: `None` when it does not exist;
    /// `max_bytes + 1` bytes at most are read, so a caller can refuse a
    /// file over its bound without reading it all.
    fn read_file(&self, path: &Path, max_bytes: u64) -> io::Result<Option<Vec<u8>>> {
        read_bounded(path, max_bytes)
    }
}

/// [`Storage::read_file`] on the real file system.
pub fn read_bounded(path: &Path, max_bytes: u64) -> io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut buf = Vec::new();
    f.take(max_bytes.saturating_add(1)).read_to_end(&mut buf)?;
    Ok(Some(buf))
}

/// Base positions of the segments in `dir`, ascending. Other files are ignored.
pub fn list_segments(dir: &Path) -> io::Result<Vec<u64>> {
    let mut bases = Vec::new();
    for entry in fs::read_dir(dir)? {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(stem) = name.strip_suffix(SEGMENT_SUFFIX) {
            if stem.len() == 20 {
                if let Ok(base) = stem.parse::<u64>() {
                    bases.push(base);
                }
            }
        }
    }
    bases.sort_unstable();
    Ok(bases)
}

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct OsStorage;

struct OsFile(File);

impl LogFile for OsFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.0.read_at(buf, offset)
    }
    fn append(&self, data: &[u8]) -> io::Result<()> {
        // The file is opened O_APPEND, and appends happen under the shard's
        // append lock, so the bytes land contiguously at the end.
        (&self.0).write_all(data)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        // O_APPEND ignores pwrite's offset on Linux; repair reopens without it.
        let f = OpenOptions::new().write(true).open(proc_path(&self.0)?)?;
        f.write_all_at(data, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.0.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
}

fn proc_path(f: &File) -> io::Result<std::path::PathBuf> {
    use std::os::fd::AsRawFd;
    fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()))
}

impl Storage for OsStorage {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>> {
        let f = OpenOptions::new()
            .read(true)
            .append(true)
            .create(create)
            .open(path)?;
        Ok(Arc::new(OsFile(f)))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// Test storage: the real file system, with switches that make appends,
/// fsyncs or deletions fail (as a full disk, a failing device or a crash
/// would), and a count of file fsyncs.
#[derive(Debug, Default, Clone)]
pub struct FaultyStorage {
    /// When set, every append fails (after writing half the bytes).
    pub fail_appends: Arc<AtomicBool>,
    /// When set, every fsync fails.
    pub fail_syncs: Arc<AtomicBool>,
    /// When set, every segment deletion fails (leaves the file in place).
    pub fail_removes: Arc<AtomicBool>,
    /// When set, every state-file write (`fence.json`, `reclaimed.json`,
    /// and `membership.json` and the map files of a coordinator or map
    /// store given this storage) fails and leaves the old file in place, as
    /// a full disk would.
    pub fail_file_writes: Arc<AtomicBool>,
    /// When set, every state-file read fails, as an I/O error of the disk
    /// would.
    pub fail_file_reads: Arc<AtomicBool>,
    /// File fsyncs that succeeded.
    pub syncs: Arc<AtomicU64>,
}

struct FaultyFile {
    inner: Arc<dyn LogFile>,
    owner: FaultyStorage,
}

impl LogFile for FaultyFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn append(&self, data: &[u8]) -> io::Result<()> {
        if self.owner.fail_appends.load(Ordering::SeqCst) {
            // A failing write may leave part of the data behind.
            self.inner.append(&data[..data.len() / 2])?;
            return Err(io::Error::other("injected write failure"));
        }
        self.inner.append(data)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(data, offset)
    }
    fn sync(&self) -> io::Result<()> {
        if self.owner.fail_syncs.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected fsync failure"));
        }
        self.inner.sync()?;
        self.owner.syncs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        self.inner.truncate(len)
    }
}

impl Storage for FaultyStorage {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>> {
        Ok(Arc::new(FaultyFile {
            inner: OsStorage.open(path, create)?,
            owner: self.clone(),
        }))
    }
    fn write_file_atomic(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        if self.fail_file_writes.load(Ordering::SeqCst) {
            return Err(io::Error::other(
                "injected state-file write failure (disk full)",
            ));
        }
        crate::layout::write_atomic(path, bytes)
    }
    fn read_file(&self, path: &Path, max_bytes: u64) -> io::Result<Option<Vec<u8>>> {
        if self.fail_file_reads.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected state-file read failure"));
        }
        read_bounded(path, max_bytes)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        if self.fail_removes.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected deletion failure"));
        }
        OsStorage.remove(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        OsStorage.sync_dir(dir)
    }
}

/// Test storage that simulates a power loss: it remembers how much of each
/// segment file is durable (fsynced) and which new files a directory fsync
/// has made durable, and [`CrashStorage::crash`] drops everything else, as
/// the disk would after the power went. Pre-existing bytes of a file opened
/// for the first time count as durable.
#[derive(Debug, Default, Clone)]
pub struct CrashStorage {
    state: Arc<std::sync::Mutex<CrashState>>,
}

#[derive(Debug, Default)]
struct CrashState {
    /// Durable length per file.
    synced: std::collections::BTreeMap<std::path::PathBuf, u64>,
    /// Files created since their directory was last fsynced.
    unlinked_on_crash: std::collections::BTreeSet<std::path::PathBuf>,
}

struct CrashFile {
    inner: Arc<dyn LogFile>,
    path: std::path::PathBuf,
    owner: CrashStorage,
}

impl CrashStorage {
    fn state(&self) -> std::sync::MutexGuard<'_, CrashState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes of `path` that would survive a crash now, if it is tracked.
    pub fn durable_len(&self, path: &Path) -> Option<u64> {
        self.state().synced.get(path).copied()
    }

    /// Bytes written to tracked files but not fsynced yet.
    pub fn unsynced_bytes(&self) -> u64 {
        self.unsynced_bytes_but("")
    }

    /// [`CrashStorage::unsynced_bytes`] of every file but those named
    /// `name` (a file the engine does not fsync on purpose, such as the
    /// finished jobs' history).
    pub fn unsynced_bytes_but(&self, name: &str) -> u64 {
        let st = self.state();
        st.synced
            .iter()
            .filter(|(path, _)| name.is_empty() || path.file_name() != Some(name.as_ref()))
            .map(|(path, &synced)| {
                fs::metadata(path)
                    .map(|m| m.len().saturating_sub(synced))
                    .unwrap_or(0)
            })
            .sum()
    }

    /// The power fails: every file is cut back to its durable length, keeping
    /// at most `keep_unsynced` of the bytes written after it (the disk may
    /// have written some back on its own, a prefix in order), and files
    /// whose directory entry was never fsynced disappear. Call after every
    /// handle using this storage is dropped; returns the bytes dropped.
    pub fn crash(&self, keep_unsynced: u64) -> io::Result<u64> {
        let mut st = self.state();
        let mut dropped = 0;
        for path in std::mem::take(&mut st.unlinked_on_crash) {
            if let Ok(m) = fs::metadata(&path) {
                dropped += m.len();
                fs::remove_file(&path)?;
            }
            st.synced.remove(&path);
        }
        for (path, &synced) in &st.synced {
            let Ok(m) = fs::metadata(path) else { continue };
            let keep = m.len().min(synced.saturating_add(keep_unsynced));
            if keep < m.len() {
                dropped += m.len() - keep;
                OpenOptions::new().write(true).open(path)?.set_len(keep)?;
            }
        }
        // What is left is what the disk holds: all of it durable now.
        let paths: Vec<std::path::PathBuf> = st.synced.keys().cloned().collect();
        for path in paths {
            let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            st.synced.insert(path, len);
        }
        Ok(dropped)
    }
}

impl LogFile for CrashFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn append(&self, data: &[u8]) -> io::Result<()> {
        self.inner.append(data)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(data, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()?;
        let len = self.inner.len()?;
        self.owner.state().synced.insert(self.path.clone(), len);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        self.inner.truncate(len)?;
        // A truncation is not durable until the next fsync either; the
        // conservative view keeps the durable length no longer than the file.
        let mut st = self.owner.state();
        if let Some(s) = st.synced.get_mut(&self.path) {
            *s = (*s).min(len);
        }
        Ok(())
    }
}

impl Storage for CrashStorage {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>> {
        let existed = path.exists();
        let inner = OsStorage.open(path, create)?;
        {
            let mut st = self.state();
            if !st.synced.contains_key(path) {
                let len = if existed { inner.len()? } else { 0 };
                st.synced.insert(path.to_path_buf(), len);
                if !existed {
                    st.unlinked_on_crash.insert(path.to_path_buf());
                }
            }
        }
        Ok(Arc::new(CrashFile {
            inner,
            path: path.to_path_buf(),
            owner: self.clone(),
        }))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        OsStorage.remove(path)?;
        let mut st = self.state();
        st.synced.remove(path);
        st.unlinked_on_crash.remove(path);
        Ok(())
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        OsStorage.sync_dir(dir)?;
        self.state()
            .unlinked_on_crash
            .retain(|p| p.parent() != Some(dir));
        Ok(())
    }
}
