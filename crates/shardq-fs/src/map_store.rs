//! The shard map of a data directory as a [`MapStore`], and the deployment
//! of a new shard directory, for live resharding.
//!
//! Files (beside `shardmap.yaml`):
//! - `.shardmap.lock`: flock held for each compare-and-set publish, so two
//!   writers can never both publish version N+1.
//! - `shardmap.target.yaml`: the map a pending rebalance must reach (absent
//!   when none is pending).
//! - `settings.NAME.json`: a deployment setting (retry, retention, flow,
//!   rebalance progress), written whole and renamed into place like the
//!   map, each change a compare-and-set under `.settings.lock` (a flock).
//! - `.rebalance.lock`: flock held by the one running rebalance; it holds the
//!   holder's `host@pid` for the error a second one gets. The kernel drops a
//!   flock when its holder dies, so a killed coordinator never blocks a rerun.
//!
//! Publishing writes a whole new file and renames it over the old one
//! (`Storage::write_file_atomic`), so a reader sees either version, never a
//! mix, and a failed write (a full disk) leaves the old one. The publish
//! lock is taken with a bounded wait ([`MAP_LOCK_WAIT_MS`]).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};
use shardq_core::reshard::{MapStore, ReshardError};
use shardq_route::{validate_shard_name, ShardMap};

use crate::error::FsError;
use crate::layout::{self, MemberEntry, MembershipLock, SHARD_LOCK_FILE, SHARD_MAP_FILE};
use crate::storage::{OsStorage, Storage, SEGMENT_SUFFIX};

/// Lock file guarding publishes of the shard map.
pub const MAP_LOCK_FILE: &str = ".shardmap.lock";
/// The pending rebalance target.
pub const TARGET_FILE: &str = "shardmap.target.yaml";
/// Lock file held for each compare-and-set of a deployment setting.
pub const SETTINGS_LOCK_FILE: &str = ".settings.lock";
/// Lock file held by the running rebalance.
pub const REBALANCE_LOCK_FILE: &str = ".rebalance.lock";
/// Longest wait for [`MAP_LOCK_FILE`], in ms: a publish holds it for one
/// read and one small write; past this its holder is stalled and the
/// publish fails, naming the lock, instead of hanging.
pub const MAP_LOCK_WAIT_MS: u64 = 5_000;

/// The shard map of a data directory.
#[derive(Debug, Clone)]
pub struct FileMapStore {
    dir: PathBuf,
    /// Where the map files are written (tests inject a full disk).
    storage: std::sync::Arc<dyn Storage>,
    /// The last map read and the text it was parsed from: a load whose file
    /// reads the same is not parsed again (status and producers load often).
    parsed: std::sync::Arc<std::sync::Mutex<Option<(String, ShardMap)>>>,
}

impl FileMapStore {
    /// The store of data dir `dir` (which must exist).
    pub fn open(dir: &Path) -> Result<FileMapStore, FsError> {
        layout::check(dir)?;
        Ok(FileMapStore {
            dir: dir.to_path_buf(),
            storage: std::sync::Arc::new(OsStorage),
            parsed: Default::default(),
        })
    }

    /// Writes the map files through `storage` (the engine's).
    pub fn with_storage(mut self, storage: std::sync::Arc<dyn Storage>) -> FileMapStore {
        self.storage = storage;
        self
    }

    fn open_lock(&self, name: &str) -> Result<File, ReshardError> {
        let path = self.dir.join(name);
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| ReshardError::io(format!("opening {}", path.display()), e))
    }
}

impl FileMapStore {
    /// Takes flock `file` (the `what` lock) within [`MAP_LOCK_WAIT_MS`];
    /// past it the holder is stalled and the caller's change is refused,
    /// saying nothing was `done`.
    fn lock_within(&self, file: &str, what: &str, done: &str) -> Result<FlockGuard, ReshardError> {
        let lock = self.open_lock(file)?;
        let lock_path = self.dir.join(file);
        let shown = lock_path.display().to_string();
        let held = layout::flock_within(
            &lock,
            std::time::Duration::from_millis(MAP_LOCK_WAIT_MS),
            &shown,
        )
        .map_err(|e| ReshardError::io(format!("locking {shown}"), e))?;
        if let Err(holder) = held {
            return Err(ReshardError::Unavailable(format!(
                "the {what} lock {shown} is held by another process ({holder}): not free \
                 after {MAP_LOCK_WAIT_MS} ms; nothing was {done}"
            )));
        }
        Ok(FlockGuard(lock))
    }
}

fn store_err(e: FsError) -> ReshardError {
    ReshardError::store(e.kind(), e)
}

struct FlockGuard(File);

impl Drop for FlockGuard {
    fn drop(&mut self) {
        let _ = flock(&self.0, FlockOperation::Unlock);
    }
}

impl MapStore for FileMapStore {
    fn load(&self) -> Result<ShardMap, ReshardError> {
        let text = layout::read_map_text_with(&*self.storage, &self.dir).map_err(store_err)?;
        let mut parsed = self.parsed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((t, map)) = parsed.as_ref() {
            if *t == text {
                return Ok(map.clone());
            }
        }
        let map = layout::parse_map(&self.dir, &text).map_err(store_err)?;
        *parsed = Some((text, map.clone()));
        Ok(map)
    }

    fn publish(&self, map: &ShardMap, expected_version: u64) -> Result<(), ReshardError> {
        map.validate()?;
        let _guard = self.lock_within(MAP_LOCK_FILE, "map", "published")?;
        let current = self.load()?;
        if current.version != expected_version {
            return Err(ReshardError::Conflict {
                expected: expected_version,
                found: current.version,
            });
        }
        if map.version <= expected_version {
            return Err(ReshardError::Invalid(format!(
                "new map version {} must be greater than {expected_version}",
                map.version
            )));
        }
        let path = self.dir.join(SHARD_MAP_FILE);
        self.storage
            .write_file_atomic(&path, map.to_yaml().as_bytes())
            .map_err(|e| ReshardError::io(format!("writing {}", path.display()), e))
    }

    fn load_target(&self) -> Result<Option<ShardMap>, ReshardError> {
        let path = self.dir.join(TARGET_FILE);
        match self.storage.read_file(&path, layout::MAP_FILE_BYTES_MAX) {
            Ok(Some(bytes)) => std::str::from_utf8(&bytes)
                .map_err(|e| e.to_string())
                .and_then(|text| ShardMap::from_yaml(text).map_err(|e| e.to_string()))
                .map(Some)
                .map_err(|reason| ReshardError::BadTarget {
                    location: path.display().to_string(),
                    reason,
                }),
            Ok(None) => Ok(None),
            Err(e) => Err(ReshardError::io(format!("reading {}", path.display()), e)),
        }
    }

    fn store_target(&self, target: &ShardMap) -> Result<(), ReshardError> {
        let path = self.dir.join(TARGET_FILE);
        self.storage
            .write_file_atomic(&path, target.to_yaml().as_bytes())
            .map_err(|e| ReshardError::io(format!("writing {}", path.display()), e))
    }

    /// Read, compare, remove: every writer of the target holds the
    /// rebalance lock (a flock, held exactly as long as its holder lives),
    /// and so does the rebalance that clears it.
    fn clear_target(&self, reached: &ShardMap) -> Result<bool, ReshardError> {
        if let Some(pending) = self.load_target()? {
            if !shardq_core::reshard::same_target(&pending, reached) {
                return Ok(false);
            }
        }
        let path = self.dir.join(TARGET_FILE);
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(ReshardError::io(format!("removing {}", path.display()), e)),
        }
    }

    fn load_setting(&self, name: &str) -> Result<Option<String>, ReshardError> {
        shardq_core::reshard::validate_setting_name(name)?;
        let path = self.dir.join(format!("settings.{name}.json"));
        match fs::read_to_string(&path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ReshardError::io(format!("reading {}", path.display()), e)),
        }
    }

    /// Under [`SETTINGS_LOCK_FILE`] (a flock, so every thread and process
    /// of the data dir takes turns, and a dead holder frees it): read,
    /// compare, write whole and rename. Readers take no lock: the rename
    /// shows them the old text or the new one.
    fn swap_setting(
        &self,
        name: &str,
        expected: Option<&str>,
        value: Option<&str>,
    ) -> Result<bool, ReshardError> {
        shardq_core::reshard::validate_setting_name(name)?;
        let _guard = self.lock_within(SETTINGS_LOCK_FILE, "settings", "stored")?;
        if self.load_setting(name)?.as_deref() != expected {
            return Ok(false);
        }
        let path = self.dir.join(format!("settings.{name}.json"));
        match value {
            Some(v) => self
                .storage
                .write_file_atomic(&path, v.as_bytes())
                .map_err(|e| ReshardError::io(format!("writing {}", path.display()), e))?,
            None => match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(ReshardError::io(format!("removing {}", path.display()), e)),
            },
        }
        Ok(true)
    }

    fn try_lock_rebalance(&self) -> Result<Box<dyn Send>, ReshardError> {
        let mut f = self.open_lock(REBALANCE_LOCK_FILE)?;
        match flock(&f, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {
                let me = format!("{}@{}", host_name(), std::process::id());
                let _ = f
                    .set_len(0)
                    .and_then(|_| f.rewind())
                    .and_then(|_| f.write_all(me.as_bytes()));
                Ok(Box::new(FlockGuard(f)))
            }
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let mut holder = String::new();
                let _ = f.read_to_string(&mut holder);
                Err(ReshardError::Busy {
                    holder: if holder.is_empty() {
                        "unknown holder".into()
                    } else {
                        holder
                    },
                })
            }
            Err(e) => Err(ReshardError::io(
                format!("locking {}", self.dir.join(REBALANCE_LOCK_FILE).display()),
                e.into(),
            )),
        }
    }
}

fn host_name() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// Suffixes of the data dir's own files (and of files people keep beside
/// them): no shard directory takes such a name.
pub const RESERVED_SUFFIXES: [&str; 6] = [".json", ".yaml", ".yml", ".lock", ".seg", ".tmp"];
/// Names of files a data dir may hold besides those suffixes.
pub const RESERVED_NAMES: [&str; 1] = ["tokens"];

/// Refuses a shard name that would collide with what data dir `dir` holds
/// or may hold: a hidden name, a name of the data dir's files (by
/// [`RESERVED_SUFFIXES`] and [`RESERVED_NAMES`]), or a path that exists
/// and is not a shard's directory (one with its lock file, as an add that
/// died halfway leaves it, is taken again).
pub fn check_free_name(dir: &Path, name: &str) -> Result<(), FsError> {
    let refused = |reason: String| FsError::Foreign {
        dir: dir.join(name),
        reason: format!("shard name {name:?} {reason}; choose another name"),
    };
    let lower = name.to_ascii_lowercase();
    if name.starts_with('.') {
        return Err(refused(
            "starts with `.`, as the data dir's lock files do".into(),
        ));
    }
    if let Some(sfx) = RESERVED_SUFFIXES.iter().find(|s| lower.ends_with(*s)) {
        return Err(refused(format!(
            "ends with {sfx:?}, as the data dir's files do"
        )));
    }
    if RESERVED_NAMES.contains(&lower.as_str()) {
        return Err(refused("is the name of a file a data dir may hold".into()));
    }
    let path = dir.join(name);
    match fs::symlink_metadata(&path) {
        Ok(m) if m.is_dir() && path.join(SHARD_LOCK_FILE).exists() => Ok(()),
        Ok(m) if m.is_dir() => Err(refused(format!(
            "names a directory of {} that is no shard's",
            dir.display()
        ))),
        Ok(_) => Err(refused(format!("names a file of {}", dir.display()))),
        Err(_) => Ok(()),
    }
}

/// Makes shard directory `name` in data dir `dir` (its lock files and
/// first segment) and a membership entry for it, refusing a name that
/// collides with the data dir's files ([`check_free_name`]). Idempotent:
/// a rerun after a crash finishes what the first run began.
pub fn deploy_shard(dir: &Path, name: &str) -> Result<(), FsError> {
    validate_shard_name(name).map_err(|reason| FsError::Foreign {
        dir: dir.join(name),
        reason: format!("invalid shard name {name:?}: {reason}"),
    })?;
    layout::check(dir)?;
    check_free_name(dir, name)?;
    let sdir = dir.join(name);
    fs::create_dir_all(&sdir)
        .map_err(|e| FsError::io(format!("creating {}", sdir.display()), e))?;
    for f in [SHARD_LOCK_FILE, crate::log::APPEND_LOCK_FILE] {
        let p = sdir.join(f);
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&p)
            .map_err(|e| FsError::io(format!("creating {}", p.display()), e))?;
    }
    let has_segment = fs::read_dir(&sdir)
        .map_err(|e| FsError::io(format!("reading {}", sdir.display()), e))?
        .filter_map(Result::ok)
        .any(|e| e.file_name().to_string_lossy().ends_with(SEGMENT_SUFFIX));
    if !has_segment {
        layout::create_first_segment(&sdir)?;
    }
    let _lock = MembershipLock::acquire(dir)?;
    let mut m = layout::read_membership(dir)?;
    if !m.shards.contains_key(name) {
        m.shards.insert(name.to_string(), MemberEntry::default());
        layout::write_membership(dir, &m)?;
    }
    Ok(())
}
