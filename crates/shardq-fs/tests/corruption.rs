//! What bad bytes at the end of a log mean: a record whose declared length
//! runs past the end of the file is a torn tail (a writer truncates it, a
//! reader stops before it); a checksum failure in a record wholly inside the
//! file is corruption, even in the last record. Read-only paths (`status`,
//! counts, dead lists) never change the disk.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use shardq_core::{InspectJobs, NewJob, QueueError, RunJobs};
use shardq_fs::record::{encode, Record};
use shardq_fs::storage::{list_segments, segment_name};
use shardq_fs::{Engine, EngineOptions, FsError};

mod support;

use support::data_dir;

fn last_segment(dir: &Path) -> PathBuf {
    let sdir = dir.join("shard-0");
    let bases = list_segments(&sdir).unwrap();
    sdir.join(segment_name(*bases.last().unwrap()))
}

/// Every file of the shard directory with its bytes, to prove nothing
/// changed.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir.join("shard-0"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| {
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn bit_flip_in_last_record_is_corruption_not_torn_tail() {
    let dir = data_dir("last-flip");
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    engine.enqueue(NewJob::new("k", "first")).unwrap();
    engine.enqueue(NewJob::new("k", "second")).unwrap();
    let (_, last) = engine.enqueue(NewJob::new("k", "third")).unwrap();
    drop(engine);
    let seg = last_segment(&dir);
    let mut bytes = std::fs::read(&seg).unwrap();
    // The last byte of the file: the last payload byte of the last record.
    *bytes.last_mut().unwrap() ^= 0x01;
    std::fs::write(&seg, &bytes).unwrap();
    let before = snapshot(&dir);

    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    let err = engine.status().unwrap_err();
    match &err {
        FsError::Queue(QueueError::Corrupt {
            shard,
            segment,
            offset,
            reason,
        }) => {
            assert_eq!(shard, "shard-0");
            assert_eq!(segment, &segment_name(0));
            assert_eq!(*offset, last.0, "the offset of the flipped record");
            assert!(reason.contains("checksum"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other}"),
    }
    assert_eq!(snapshot(&dir), before, "status changed the shard");
    // An appender holding the lock judges the same way and cuts nothing.
    let err = engine.enqueue(NewJob::new("k", "more")).unwrap_err();
    assert!(
        matches!(err, FsError::Queue(QueueError::Corrupt { .. })),
        "{err}"
    );
    drop(engine);
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert!(engine.enqueue(NewJob::new("k", "more")).is_err());
    assert_eq!(
        snapshot(&dir),
        before,
        "an appender truncated a whole record"
    );
    assert_eq!(engine.backend().torn_bytes_truncated("shard-0").unwrap(), 0);
    drop(engine);

    // Repair cuts it, saves it and says so.
    let report = shardq_fs::repair::repair(&dir, "shard-0").unwrap();
    assert_eq!(report.cuts.len(), 1);
    assert_eq!(report.cuts[0].offset, last.0);
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert_eq!(engine.status().unwrap().totals.ready, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bit_flip_in_a_record_ending_exactly_at_end_of_file_is_not_torn() {
    // The old rule also called a record "torn" when its declared length
    // ended exactly at the end of the file; such a record was written whole.
    let dir = data_dir("exact-end");
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    let (_, only) = engine.enqueue(NewJob::new("k", "only")).unwrap();
    drop(engine);
    let seg = last_segment(&dir);
    let mut bytes = std::fs::read(&seg).unwrap();
    // Flip a bit of the stored checksum.
    bytes[only.0 as usize + 5] ^= 0x80;
    std::fs::write(&seg, &bytes).unwrap();
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    let err = engine.enqueue(NewJob::new("k", "next")).unwrap_err();
    assert!(
        matches!(&err, FsError::Queue(QueueError::Corrupt { offset, .. }) if *offset == only.0),
        "{err}"
    );
    assert_eq!(std::fs::read(&seg).unwrap(), bytes);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn status_never_truncates() {
    let dir = data_dir("status-ro");
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    for i in 0..3 {
        engine.enqueue(NewJob::new("k", format!("p{i}"))).unwrap();
    }
    drop(engine);
    // A torn tail: a declared length of 40 bytes, and only 3 of them.
    let seg = last_segment(&dir);
    let mut f = OpenOptions::new().append(true).open(&seg).unwrap();
    f.write_all(&[40, 0, 0, 0, 1, 2, 3, 4, 1, 9, 9]).unwrap();
    drop(f);
    let before = snapshot(&dir);

    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    let b = engine.backend();
    for _ in 0..2 {
        assert_eq!(engine.status().unwrap().totals.ready, 3);
        assert_eq!(b.key_counts("shard-0", "k").unwrap().depth, 3);
        assert!(b.dead_list("shard-0", 10).unwrap().is_empty());
        assert!(b.next_due_ms("shard-0").unwrap().is_some());
    }
    assert_eq!(snapshot(&dir), before, "a read-only path changed the shard");
    assert_eq!(b.torn_bytes_truncated("shard-0").unwrap(), 0);

    // The next append (a writer) cuts the torn tail and carries on; the
    // reader sees the new record where the torn one was.
    let (_, id) = engine.enqueue(NewJob::new("k", "p3")).unwrap();
    assert_eq!(id.0, before_len(&before));
    assert!(b.torn_bytes_truncated("shard-0").unwrap() > 0);
    assert_eq!(engine.status().unwrap().totals.ready, 4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Length of the segment in a snapshot minus the 11 torn bytes.
fn before_len(snap: &[(String, Vec<u8>)]) -> u64 {
    let seg = snap
        .iter()
        .find(|(n, _)| n.ends_with(".seg"))
        .expect("a segment");
    seg.1.len() as u64 - 11
}

#[test]
fn status_does_not_create_the_segment_after_a_seal() {
    let dir = data_dir("status-seal");
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    engine.enqueue(NewJob::new("k", "p")).unwrap();
    drop(engine);
    // A roller that died between sealing and creating the next segment.
    let seg = last_segment(&dir);
    let mut seal = Vec::new();
    encode(&mut seal, &Record::Seal);
    let mut f = OpenOptions::new().append(true).open(&seg).unwrap();
    f.write_all(&seal).unwrap();
    drop(f);
    let before = snapshot(&dir);

    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert_eq!(engine.status().unwrap().totals.ready, 1);
    assert_eq!(engine.status().unwrap().totals.ready, 1);
    assert_eq!(snapshot(&dir), before, "status created a segment");
    // A writer creates it and appends there.
    engine.enqueue(NewJob::new("k", "q")).unwrap();
    assert_eq!(list_segments(&dir.join("shard-0")).unwrap().len(), 2);
    assert_eq!(engine.status().unwrap().totals.ready, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

fn status_err(dir: &Path) -> QueueError {
    let engine = Engine::open(dir, EngineOptions::default()).unwrap();
    match engine.status().unwrap_err() {
        FsError::Queue(q) => q,
        other => panic!("expected a queue error, got {other}"),
    }
}

#[test]
fn segment_with_wrong_magic_is_corrupt_naming_the_segment() {
    let dir = data_dir("magic");
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    engine.enqueue(NewJob::new("k", "p")).unwrap();
    drop(engine);
    let seg = last_segment(&dir);
    let mut bytes = std::fs::read(&seg).unwrap();
    assert_eq!(&bytes[..8], b"SHARDQLG");
    bytes[3] = b'X';
    std::fs::write(&seg, &bytes).unwrap();
    let before = snapshot(&dir);
    match status_err(&dir) {
        QueueError::Corrupt {
            segment,
            offset,
            reason,
            ..
        } => {
            assert_eq!((segment.as_str(), offset), (segment_name(0).as_str(), 0));
            assert!(reason.contains("magic"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other}"),
    }
    assert_eq!(snapshot(&dir), before);

    // A file that starts with a record instead of a header is refused
    // the same way.
    let mut headless = Vec::new();
    encode(
        &mut headless,
        &Record::Enqueue {
            created_ms: 1,
            not_before_ms: 1,
            max_attempts: 1,
            key: "k",
            dedup: None,
            payload: b"old",
        },
    );
    std::fs::write(&seg, &headless).unwrap();
    let err = status_err(&dir).to_string();
    assert!(err.contains("wrong magic"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn segment_with_unknown_version_is_unknown_format() {
    let dir = data_dir("version");
    let seg = last_segment(&dir);
    let mut header = std::fs::read(&seg).unwrap();
    assert_eq!(header.len(), shardq_fs::record::SEGMENT_HEADER_BYTES);
    // Version 1: what an earlier development build wrote (a Claim without
    // its start time). Refused, never read by a second path.
    header[8..12].copy_from_slice(&1u32.to_le_bytes());
    let crc = crc32c_of(&header[0..12]);
    header[12..16].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&seg, &header).unwrap();
    match status_err(&dir) {
        QueueError::UnknownFormat {
            what,
            found,
            supported,
        } => {
            assert!(what.contains(&segment_name(0)), "{what}");
            assert_eq!((found.as_str(), supported.as_str()), ("1", "2"));
        }
        other => panic!("expected UnknownFormat, got {other}"),
    }
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert!(engine.enqueue(NewJob::new("k", "p")).is_err());
    assert_eq!(std::fs::read(&seg).unwrap(), header, "nothing appended");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A log whose first segments are gone without a reclaimed range covering
/// them lost files: it is refused as corrupt, never read as if the missing
/// jobs had finished. A `reclaimed.json` of an earlier version is refused
/// naming both versions.
#[test]
fn a_missing_unrecorded_prefix_and_an_old_reclaimed_file_are_refused() {
    let dir = data_dir("lost-prefix");
    let small = EngineOptions {
        segment_bytes_max: 2048,
        ..EngineOptions::default()
    };
    let engine = Engine::open(&dir, small.clone()).unwrap();
    for i in 0..40 {
        engine
            .enqueue(NewJob::new("k", format!("job {i:03} {}", "x".repeat(100))))
            .unwrap();
    }
    drop(engine);
    let sdir = dir.join("shard-0");
    let bases = list_segments(&sdir).unwrap();
    assert!(bases.len() >= 3, "segments: {bases:?}");
    std::fs::remove_file(sdir.join(segment_name(0))).unwrap();
    match status_err(&dir) {
        QueueError::Corrupt { reason, .. } => {
            assert!(reason.contains("not recorded"), "{reason}");
            assert!(reason.contains(&segment_name(bases[1])), "{reason}");
        }
        other => panic!("expected Corrupt, got {other}"),
    }
    // Recording the gap (what compaction does before it deletes) makes the
    // log open; an earlier version of the same file is refused.
    let range = format!(
        r#"{{"format":"shardq-reclaimed","version":{{}},"ranges":[[0,{}]],"fence_high":0}}"#,
        bases[1]
    );
    std::fs::write(sdir.join("reclaimed.json"), range.replace("{}", "1")).unwrap();
    match status_err(&dir) {
        QueueError::UnknownFormat {
            found, supported, ..
        } => {
            assert_eq!((found.as_str(), supported.as_str()), ("1", "2"))
        }
        QueueError::Corrupt { reason, .. } => {
            assert!(
                reason.contains("version 1") && reason.contains("version 2"),
                "{reason}"
            )
        }
        other => panic!("expected the reclaimed file refused, got {other}"),
    }
    std::fs::write(sdir.join("reclaimed.json"), range.replace("{}", "2")).unwrap();
    let engine = Engine::open(&dir, small).unwrap();
    engine.status().expect("a recorded gap is stepped over");
    let _ = std::fs::remove_dir_all(&dir);
}

/// CRC32C, computed bit by bit (independent of the crate's own code).
fn crc32c_of(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn a_header_cut_short_is_completed_by_a_writer_only() {
    let dir = data_dir("short-header");
    let seg = last_segment(&dir);
    let header = std::fs::read(&seg).unwrap();
    std::fs::write(&seg, &header[..5]).unwrap();
    let before = snapshot(&dir);
    let engine = Engine::open(&dir, EngineOptions::default()).unwrap();
    assert_eq!(engine.status().unwrap().totals.ready, 0);
    assert_eq!(snapshot(&dir), before, "status wrote the header");
    engine.enqueue(NewJob::new("k", "p")).unwrap();
    assert_eq!(engine.status().unwrap().totals.ready, 1);
    assert_eq!(&std::fs::read(&seg).unwrap()[..16], &header[..]);
    let _ = std::fs::remove_dir_all(&dir);
}
