//! `shardq repair`: makes a corrupt shard serve again by cutting out the bad
//! bytes, saving them to `quarantine/` and reporting each cut.
//!
//! A bad record is replaced by a hole record of the same size (positions,
//! and so job ids, do not move) up to the next offset from which the rest of
//! the segment decodes cleanly. Jobs in a hole are lost and reported; records
//! elsewhere referring to them are then ignored. Repair refuses while a live
//! process owns the shard. It must never run silently or drop valid records.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::FsError;
use crate::layout;
use crate::log::APPEND_LOCK_FILE;
use crate::record::{
    check_segment_header, decode, encode, encode_hole, segment_header, DecodeError, HeaderError,
    Record, HEADER_BYTES, SEAL_BYTES, SEGMENT_FORMAT_VERSION, SEGMENT_HEADER_BYTES,
};
use crate::storage::{list_segments, segment_name, LogFile, OsStorage, Storage};

/// Folder in the shard directory where cut bytes are saved.
pub const QUARANTINE_DIR: &str = "quarantine";

/// One removed byte range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    /// Segment file name.
    pub segment: String,
    /// Offset of the cut in the segment.
    pub offset: u64,
    /// Bytes cut.
    pub bytes: u64,
    /// Why the bytes were bad.
    pub reason: String,
    /// Where the bytes were saved.
    pub saved_to: PathBuf,
}

/// What repair did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Every cut, in log order.
    pub cuts: Vec<Cut>,
}

/// Repairs shard `shard` of data dir `dir`. See the module docs.
pub fn repair(dir: &Path, shard: &str) -> Result<RepairReport, FsError> {
    layout::check(dir)?;
    let sdir = dir.join(shard);
    if !sdir.is_dir() {
        return Err(FsError::RepairRefused {
            shard: shard.into(),
            reason: format!("no shard directory {}", sdir.display()),
        });
    }
    let Some(_owner) = layout::try_lock_shard(dir, shard)? else {
        return Err(FsError::RepairRefused {
            shard: shard.into(),
            reason: "a running process owns it; stop it first".into(),
        });
    };
    let _append_lock = lock_appends(&sdir)?;
    let bases =
        list_segments(&sdir).map_err(|e| FsError::io(format!("listing {}", sdir.display()), e))?;
    let mut report = RepairReport::default();
    for (i, &base) in bases.iter().enumerate() {
        let last = i + 1 == bases.len();
        repair_segment(&sdir, shard, base, last, &mut report)?;
    }
    Ok(report)
}

/// Opens the shard's append lock file and holds its lock (released when the
/// file is dropped).
fn lock_appends(sdir: &Path) -> Result<fs::File, FsError> {
    let lock_file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(sdir.join(APPEND_LOCK_FILE))
        .map_err(|e| {
            FsError::io(
                format!("opening {}", sdir.join(APPEND_LOCK_FILE).display()),
                e,
            )
        })?;
    rustix::fs::flock(&lock_file, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| FsError::io("locking the append lock", e.into()))?;
    Ok(lock_file)
}

/// Repairs one segment (the shard's `last` one or not), adding its cuts to
/// `report`.
fn repair_segment(
    sdir: &Path,
    shard: &str,
    base: u64,
    last: bool,
    report: &mut RepairReport,
) -> Result<(), FsError> {
    let path = sdir.join(segment_name(base));
    let file = OsStorage
        .open(&path, false)
        .map_err(|e| FsError::io(format!("opening {}", path.display()), e))?;
    let bytes =
        fs::read(&path).map_err(|e| FsError::io(format!("reading {}", path.display()), e))?;
    let header = segment_header();
    if bytes.len() < SEGMENT_HEADER_BYTES && bytes[..] == header[..bytes.len()] && last {
        // A roll that died before its header was written: complete it.
        file.truncate(0)
            .and_then(|()| file.append(&header))
            .and_then(|()| file.sync())
            .map_err(|e| FsError::io(format!("writing the header of {}", path.display()), e))?;
        return Ok(());
    }
    refuse_bad_header(shard, base, &bytes)?;
    let mut off = SEGMENT_HEADER_BYTES;
    while off < bytes.len() {
        let reason = match decode(&bytes[off..]) {
            Ok((Record::Seal, _)) => break,
            Ok((_, n)) => {
                off += n;
                continue;
            }
            Err(DecodeError::Incomplete) => "record is cut short".to_string(),
            Err(DecodeError::Invalid(r)) => r,
        };
        let resync = (off + 1..bytes.len()).find(|&r| chains_to_end(&bytes[r..]));
        let end = resync.unwrap_or(bytes.len());
        let saved_to = quarantine(sdir, &segment_name(base), off, &bytes[off..end])?;
        let cut_len = (end - off) as u64;
        if resync.is_none() && last {
            // Nothing valid follows: cut the tail off.
            file.truncate(off as u64)
                .and_then(|()| file.sync())
                .map_err(|e| FsError::io(format!("truncating {}", path.display()), e))?;
        } else {
            let patch = hole_patch(shard, base, off, end, resync.is_none())?;
            write_patch(&*file, &patch, off as u64)
                .map_err(|e| FsError::io(format!("patching {}", path.display()), e))?;
        }
        report.cuts.push(Cut {
            segment: segment_name(base),
            offset: off as u64,
            bytes: cut_len,
            reason,
            saved_to,
        });
        off = end;
    }
    Ok(())
}

/// Refuses a segment whose header is of another format version or is
/// damaged (repair does not cut headers).
fn refuse_bad_header(shard: &str, base: u64, bytes: &[u8]) -> Result<(), FsError> {
    match check_segment_header(bytes) {
        Ok(()) => {}
        Err(HeaderError::UnknownVersion(v)) => {
            return Err(FsError::RepairRefused {
                shard: shard.into(),
                reason: format!(
                    "segment {} has format version {v}, this build reads version \
                     {SEGMENT_FORMAT_VERSION} (use the shardq that wrote it)",
                    segment_name(base)
                ),
            })
        }
        Err(HeaderError::Invalid(reason)) => {
            return Err(FsError::RepairRefused {
                shard: shard.into(),
                reason: format!(
                    "segment {} has a bad header ({reason}); it is not cut by repair: \
                     restore the file from a backup",
                    segment_name(base)
                ),
            })
        }
    }
    Ok(())
}

/// The bytes that replace the bad range `off..end`: a hole record, then a
/// seal when the range runs `to_end` of a segment that must end sealed.
fn hole_patch(
    shard: &str,
    base: u64,
    off: usize,
    end: usize,
    to_end: bool,
) -> Result<Vec<u8>, FsError> {
    let mut patch = Vec::new();
    let hole_len = if to_end {
        end - off - SEAL_BYTES
    } else {
        end - off
    };
    if hole_len <= HEADER_BYTES || (to_end && end - off < SEAL_BYTES + HEADER_BYTES + 1) {
        return Err(FsError::RepairRefused {
            shard: shard.into(),
            reason: format!(
                "the bad range at {} offset {off} is {} bytes, too short to replace with a hole record",
                segment_name(base),
                end - off
            ),
        });
    }
    patch.extend_from_slice(&encode_hole(hole_len));
    if to_end {
        // A sealed segment must still end with its seal.
        encode(&mut patch, &Record::Seal);
    }
    Ok(patch)
}

fn write_patch(file: &dyn LogFile, patch: &[u8], off: u64) -> std::io::Result<()> {
    file.write_at(patch, off)?;
    file.sync()
}

/// Whether `bytes` decode as whole records up to the end (or a seal).
fn chains_to_end(bytes: &[u8]) -> bool {
    let mut p = 0;
    while p < bytes.len() {
        match decode(&bytes[p..]) {
            Ok((Record::Seal, _)) => return true,
            Ok((_, n)) => p += n,
            Err(_) => return false,
        }
    }
    true
}

fn quarantine(sdir: &Path, segment: &str, off: usize, bytes: &[u8]) -> Result<PathBuf, FsError> {
    let qdir = sdir.join(QUARANTINE_DIR);
    fs::create_dir_all(&qdir)
        .map_err(|e| FsError::io(format!("creating {}", qdir.display()), e))?;
    let path = qdir.join(format!("{segment}.{off}.bin"));
    layout::write_atomic(&path, bytes)
        .map_err(|e| FsError::io(format!("writing {}", path.display()), e))?;
    Ok(path)
}
