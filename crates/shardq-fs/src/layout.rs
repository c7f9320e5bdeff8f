//! The data directory's layout: creating it, checking it, and reading and
//! writing `membership.json` under `.membership.lock`.
//!
//! ```text
//! DIR/
//!   .membership.lock     flock held while membership.json is read-modify-written
//!   membership.json      owners and leases (format "shardq-membership", version 1)
//!   shardmap.yaml        the shard map (shardq-route format)
//!   shard-0/
//!     .lock              flock held by the process that owns (runs) this shard
//!     .append.lock       flock held by any process while it appends
//!     fence.json         optional: map_version_min and paused keys
//!     reclaimed.json     optional: position ranges whose jobs are all finished
//!     00000000000000000000.seg   log segments, named by base position
//! ```
//!
//! This module never touches segment contents.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};
use serde::{Deserialize, Serialize};
use shardq_route::ShardMap;

use crate::error::FsError;
use crate::stalled::{self, Holder};
use crate::storage::segment_name;

/// Membership file name.
pub const MEMBERSHIP_FILE: &str = "membership.json";
/// Lock guarding the membership file.
pub const MEMBERSHIP_LOCK_FILE: &str = ".membership.lock";
/// Longest wait for `.membership.lock`, in ms (as for a shard's append
/// lock). Holders keep it for one read-modify-write of a small file; one
/// that holds it longer is stalled (SIGSTOP, a hung disk), and past this
/// bound a lease tick fails with `Unavailable` (transient) instead of
/// waiting for it forever. A worker pool ticks in its dispatch loop, so a
/// stalled holder delays the pool's dispatch by up to this much per tick.
pub const MEMBERSHIP_LOCK_WAIT_MS: u64 = 1_000;
/// Shard map file name.
pub const SHARD_MAP_FILE: &str = "shardmap.yaml";
/// Owner lock in each shard directory.
pub const SHARD_LOCK_FILE: &str = ".lock";
/// Value of the `format` field of membership.json.
pub const MEMBERSHIP_FORMAT: &str = "shardq-membership";
/// Current membership format version.
pub const MEMBERSHIP_VERSION: u32 = 1;
/// Largest membership.json read (1 MiB): bounds a corrupt or hostile file.
const MEMBERSHIP_BYTES_MAX: u64 = 1 << 20;

/// One shard's entry in membership.json.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberEntry {
    /// `host@pid` of the owner, if any.
    pub owner: Option<String>,
    /// When the owner's lease ends (ms since the epoch); 0 when unowned.
    pub lease_expires_ms: u64,
    /// Bumped at every change of owner.
    pub epoch: u64,
}

/// The contents of membership.json.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    /// Always [`MEMBERSHIP_FORMAT`].
    pub format: String,
    /// Always [`MEMBERSHIP_VERSION`].
    pub version: u32,
    /// Per shard.
    pub shards: BTreeMap<String, MemberEntry>,
}

/// Writes `bytes` to `path` atomically: temp file, fsync, rename, fsync dir.
///
/// The temp file's name is unique to this call (process id and a counter),
/// so writers in several threads or processes never share one: each
/// rename puts one whole file in place. The file is created with mode 0600
/// whatever the umask: the data dir's files may hold store URLs with
/// passwords (`remote.json`, `shardmap.yaml`).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    File::open(dir)?.sync_all()
}

/// Mode of every file [`write_atomic`] writes: the owner's only.
pub const FILE_MODE: u32 = 0o600;

/// Creates a data directory for `map` (all shards unowned, empty logs).
pub fn init(dir: &Path, map: &ShardMap) -> Result<(), FsError> {
    if dir.exists() {
        let mut entries =
            fs::read_dir(dir).map_err(|e| FsError::io(format!("reading {}", dir.display()), e))?;
        if entries.next().is_some() {
            return Err(FsError::InitRefused {
                dir: dir.to_path_buf(),
                reason: if dir.join(MEMBERSHIP_FILE).exists() {
                    "it is already a shardq data dir".into()
                } else {
                    "the directory is not empty".into()
                },
            });
        }
    }
    fs::create_dir_all(dir).map_err(|e| FsError::io(format!("creating {}", dir.display()), e))?;
    let mut shards = BTreeMap::new();
    for shard in &map.shards {
        let sdir = dir.join(&shard.name);
        fs::create_dir(&sdir)
            .map_err(|e| FsError::io(format!("creating {}", sdir.display()), e))?;
        for f in [SHARD_LOCK_FILE, crate::log::APPEND_LOCK_FILE] {
            File::create(sdir.join(f))
                .map_err(|e| FsError::io(format!("creating {}", sdir.join(f).display()), e))?;
        }
        create_first_segment(&sdir)?;
        shards.insert(shard.name.clone(), MemberEntry::default());
    }
    write_atomic(&dir.join(SHARD_MAP_FILE), map.to_yaml().as_bytes())
        .map_err(|e| FsError::io(format!("writing {}", dir.join(SHARD_MAP_FILE).display()), e))?;
    File::create(dir.join(MEMBERSHIP_LOCK_FILE)).map_err(|e| {
        FsError::io(
            format!("creating {}", dir.join(MEMBERSHIP_LOCK_FILE).display()),
            e,
        )
    })?;
    // membership.json last: its presence marks a complete data dir.
    let m = Membership {
        format: MEMBERSHIP_FORMAT.into(),
        version: MEMBERSHIP_VERSION,
        shards,
    };
    write_membership(dir, &m)
}

/// Creates the first segment of a new shard directory, with its header,
/// and makes it durable.
pub fn create_first_segment(sdir: &Path) -> Result<(), FsError> {
    let seg = sdir.join(segment_name(0));
    File::create(&seg)
        .and_then(|mut f| {
            f.write_all(&crate::record::segment_header())?;
            f.sync_all()
        })
        .map_err(|e| FsError::io(format!("creating {}", seg.display()), e))
}

/// Checks that `dir` is a shardq data dir.
pub fn check(dir: &Path) -> Result<(), FsError> {
    if !dir.exists() {
        return Err(FsError::Missing {
            dir: dir.to_path_buf(),
        });
    }
    if !dir.is_dir() {
        return Err(FsError::Foreign {
            dir: dir.to_path_buf(),
            reason: "it is not a directory".into(),
        });
    }
    for f in [MEMBERSHIP_FILE, SHARD_MAP_FILE] {
        if !dir.join(f).is_file() {
            return Err(FsError::Foreign {
                dir: dir.to_path_buf(),
                reason: format!("{f} is missing (was it created with `shardq init`?)"),
            });
        }
    }
    Ok(())
}

/// Reads and checks the shard map.
pub fn read_map(dir: &Path) -> Result<ShardMap, FsError> {
    parse_map(dir, &read_map_text(dir)?)
}

/// The text of the shard map file of `dir`.
pub fn read_map_text(dir: &Path) -> Result<String, FsError> {
    read_map_text_with(&crate::storage::OsStorage, dir)
}

/// Largest shard map file read.
pub const MAP_FILE_BYTES_MAX: u64 = 64 << 20;

/// [`read_map_text`] through `storage`.
pub fn read_map_text_with(
    storage: &dyn crate::storage::Storage,
    dir: &Path,
) -> Result<String, FsError> {
    let path = dir.join(SHARD_MAP_FILE);
    let bytes = storage
        .read_file(&path, MAP_FILE_BYTES_MAX)
        .map_err(|e| FsError::io(format!("reading {}", path.display()), e))?
        .ok_or_else(|| {
            FsError::io(
                format!("reading {}", path.display()),
                io::Error::from(io::ErrorKind::NotFound),
            )
        })?;
    if bytes.len() as u64 > MAP_FILE_BYTES_MAX {
        return Err(FsError::MapInvalid {
            path,
            reason: format!("over {MAP_FILE_BYTES_MAX} bytes"),
        });
    }
    String::from_utf8(bytes).map_err(|_| FsError::MapInvalid {
        path,
        reason: "not UTF-8 text".into(),
    })
}

/// Parses `text`, the shard map file of `dir`.
pub fn parse_map(dir: &Path, text: &str) -> Result<ShardMap, FsError> {
    ShardMap::from_yaml(text).map_err(|e| FsError::MapInvalid {
        path: dir.join(SHARD_MAP_FILE),
        reason: e.to_string(),
    })
}

/// Reads membership.json (the caller holds the lock when it will write).
pub fn read_membership(dir: &Path) -> Result<Membership, FsError> {
    read_membership_with(&crate::storage::OsStorage, dir)
}

/// [`read_membership`] through `storage`.
pub fn read_membership_with(
    storage: &dyn crate::storage::Storage,
    dir: &Path,
) -> Result<Membership, FsError> {
    let path = dir.join(MEMBERSHIP_FILE);
    let bytes = storage
        .read_file(&path, MEMBERSHIP_BYTES_MAX)
        .map_err(|e| FsError::io(format!("reading {}", path.display()), e))?
        .ok_or_else(|| {
            FsError::io(
                format!("opening {}", path.display()),
                io::Error::from(io::ErrorKind::NotFound),
            )
        })?;
    let len = bytes.len() as u64;
    if len > MEMBERSHIP_BYTES_MAX {
        return Err(FsError::MembershipCorrupt {
            path,
            reason: format!("{len} bytes, over the limit of {MEMBERSHIP_BYTES_MAX}"),
        });
    }
    let m: Membership = serde_json::from_slice(&bytes).map_err(|e| FsError::MembershipCorrupt {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    if m.format != MEMBERSHIP_FORMAT || m.version != MEMBERSHIP_VERSION {
        return Err(FsError::MembershipCorrupt {
            path,
            reason: format!(
                "format {:?} version {}, expected {MEMBERSHIP_FORMAT:?} version {MEMBERSHIP_VERSION}",
                m.format, m.version
            ),
        });
    }
    Ok(m)
}

/// Writes membership.json atomically.
pub fn write_membership(dir: &Path, m: &Membership) -> Result<(), FsError> {
    write_membership_with(&crate::storage::OsStorage, dir, m)
}

/// [`write_membership`] through `storage` (atomic: a failed write leaves
/// the old file).
pub fn write_membership_with(
    storage: &dyn crate::storage::Storage,
    dir: &Path,
    m: &Membership,
) -> Result<(), FsError> {
    let path = dir.join(MEMBERSHIP_FILE);
    let text = serde_json::to_string_pretty(m).expect("membership serialises");
    storage
        .write_file_atomic(&path, text.as_bytes())
        .map_err(|e| FsError::io(format!("writing {}", path.display()), e))
}

/// First pause between tries of a held lock; doubles up to
/// [`LOCK_POLL_MS_MAX`].
const LOCK_POLL_US_MIN: u64 = 100;
/// Longest pause between tries of a held lock.
const LOCK_POLL_MS_MAX: u64 = 10;

/// Longest wait for a killed holder's flock to come free (the kernel drops
/// it as the process exits).
const KILLED_HOLDER_WAIT_MS: u64 = 2_000;
/// How often a waiter looks at who holds the lock (a stopped holder is
/// killed at the first look that finds it stopped).
const HOLDER_CHECK_MS: u64 = 250;

/// Takes the exclusive flock of `f` (the lock file `what`, for messages),
/// waiting at most `bound`: `Ok(Ok(()))` once held. flock has no timed
/// wait, so this polls, backing off, never sleeping past the bound. Every
/// [`HOLDER_CHECK_MS`] of waiting, and at the bound, it looks at the
/// holder: one found stopped is killed ([`crate::stalled`]), and the wait
/// is then extended by up to [`KILLED_HOLDER_WAIT_MS`] for the lock to come
/// free. Otherwise, past the bound, `Ok(Err(holder))` says who holds it.
pub fn flock_within(f: &File, bound: Duration, what: &str) -> io::Result<Result<(), Holder>> {
    let start = Instant::now();
    let mut deadline = bound;
    let mut extended = false;
    let mut next_check = Duration::from_millis(HOLDER_CHECK_MS);
    let mut pause = Duration::from_micros(LOCK_POLL_US_MIN);
    loop {
        if try_flock(f)? {
            return Ok(Ok(()));
        }
        let waited = start.elapsed();
        if waited >= next_check || waited >= deadline {
            let holder = stalled::kill_if_stopped(f, what);
            // A holder killed now, or one gone from view (another waiter
            // killed it, or it let go meanwhile), frees the lock as it
            // exits: wait for that, once.
            if holder.going() && !extended {
                extended = true;
                deadline = deadline.max(waited + Duration::from_millis(KILLED_HOLDER_WAIT_MS));
            }
            if waited >= deadline {
                return Ok(Err(holder));
            }
            next_check = waited + Duration::from_millis(HOLDER_CHECK_MS);
        }
        let wake = next_check.min(deadline);
        std::thread::sleep(pause.min(wake.saturating_sub(waited)));
        pause = (pause * 2).min(Duration::from_millis(LOCK_POLL_MS_MAX));
    }
}

/// One non-blocking try of `f`'s exclusive flock.
fn try_flock(f: &File) -> io::Result<bool> {
    match flock(f, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::WOULDBLOCK) | Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Holds `.membership.lock` until dropped.
pub struct MembershipLock(File);

impl MembershipLock {
    /// Takes the lock, waiting at most [`MEMBERSHIP_LOCK_WAIT_MS`].
    pub fn acquire(dir: &Path) -> Result<MembershipLock, FsError> {
        MembershipLock::acquire_within(dir, MEMBERSHIP_LOCK_WAIT_MS)
    }

    /// Takes the lock, waiting at most `bound_ms`; past it, a transient
    /// [`shardq_core::QueueError::Unavailable`] (for every shard, `"*"`)
    /// naming the lock file and the bound.
    pub fn acquire_within(dir: &Path, bound_ms: u64) -> Result<MembershipLock, FsError> {
        let path = dir.join(MEMBERSHIP_LOCK_FILE);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| FsError::io(format!("opening {}", path.display()), e))?;
        let start = Instant::now();
        let what = path.display().to_string();
        if let Err(holder) = flock_within(&f, Duration::from_millis(bound_ms), &what)
            .map_err(|e| FsError::io(format!("locking {what}"), e))?
        {
            return Err(FsError::Queue(shardq_core::QueueError::Unavailable {
                shard: "*".into(),
                reason: format!(
                    "the membership lock {what} is held by another process ({holder}): not \
                     free after {} ms (bound {bound_ms} ms); membership changes (lease \
                     renewals, takeovers, new shards) wait until it is",
                    start.elapsed().as_millis()
                ),
            }));
        }
        Ok(MembershipLock(f))
    }
}

impl Drop for MembershipLock {
    fn drop(&mut self) {
        let _ = flock(&self.0, FlockOperation::Unlock);
    }
}

/// Tries to take a shard's owner lock without blocking.
pub fn try_lock_shard(dir: &Path, shard: &str) -> Result<Option<File>, FsError> {
    let path: PathBuf = dir.join(shard).join(SHARD_LOCK_FILE);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| FsError::io(format!("opening {}", path.display()), e))?;
    match flock(&f, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(Some(f)),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
        Err(e) => Err(FsError::io(format!("locking {}", path.display()), e.into())),
    }
}
