//! The log record format: encoding and a decoder that never panics.
//!
//! Layout (all integers little-endian), see `docs/design.md`:
//!
//! ```text
//! 0  u32  body_len   bytes of body, 1..=RECORD_BODY_BYTES_MAX
//! 4  u32  crc        CRC32C over bytes 0..4 (body_len) followed by the body
//! 8  u8   type       first byte of the body
//! 9  ...  fields     per type
//! ```
//!
//! Every segment file starts with a 16-byte header, before its first record:
//!
//! ```text
//! 0   8 bytes  magic      "SHARDQLG"
//! 8   u32      version    SEGMENT_FORMAT_VERSION (1)
//! 12  u32      crc        CRC32C over bytes 0..12
//! ```
//!
//! This module only turns bytes into records and back; it must never decide
//! what a bad record means (torn tail or corruption): the log does that while
//! holding the append lock.

/// Bytes before the body: length and checksum.
pub const HEADER_BYTES: usize = 8;
/// Largest record body: a payload at the hard limit plus key and fields.
pub const RECORD_BODY_BYTES_MAX: usize = shardq_core::PAYLOAD_BYTES_LIMIT + 4096;
/// Bytes of a seal record (header + type byte).
pub const SEAL_BYTES: usize = HEADER_BYTES + 1;

/// First bytes of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"SHARDQLG";
/// The segment format this build reads and writes.
pub const SEGMENT_FORMAT_VERSION: u32 = 2;
/// Bytes of the segment header: magic, version, checksum.
pub const SEGMENT_HEADER_BYTES: usize = 16;

/// The header this build writes at the start of every segment.
pub fn segment_header() -> [u8; SEGMENT_HEADER_BYTES] {
    let mut h = [0u8; SEGMENT_HEADER_BYTES];
    h[0..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_FORMAT_VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&h[0..12]);
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    h
}

/// What is wrong with a segment header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    /// Not a shardq segment (or not one with a header): the reason says what
    /// was found.
    Invalid(String),
    /// A well-formed header of a version this build does not read.
    UnknownVersion(u32),
}

/// Checks the header at the start of `buf` (at least
/// [`SEGMENT_HEADER_BYTES`] long, else it is invalid); never panics.
pub fn check_segment_header(buf: &[u8]) -> Result<(), HeaderError> {
    let Some(h) = buf.get(0..SEGMENT_HEADER_BYTES) else {
        return Err(HeaderError::Invalid(format!(
            "segment header is {} bytes, needs {SEGMENT_HEADER_BYTES}",
            buf.len()
        )));
    };
    if h[0..8] != SEGMENT_MAGIC {
        return Err(HeaderError::Invalid(format!(
            "wrong magic {:02x?}, expected {:?}",
            &h[0..8],
            std::str::from_utf8(&SEGMENT_MAGIC).unwrap_or("?")
        )));
    }
    let stored = u32::from_le_bytes(h[12..16].try_into().expect("4 bytes"));
    let actual = crc32c::crc32c(&h[0..12]);
    if stored != actual {
        return Err(HeaderError::Invalid(format!(
            "segment header checksum mismatch: stored {stored:#010x}, computed {actual:#010x}"
        )));
    }
    let version = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
    if version != SEGMENT_FORMAT_VERSION {
        return Err(HeaderError::UnknownVersion(version));
    }
    Ok(())
}

const T_ENQUEUE: u8 = 1;
const T_CLAIM: u8 = 2;
const T_ACK: u8 = 3;
const T_FAIL: u8 = 4;
const T_SEAL: u8 = 5;
const T_DEAD_RETRY: u8 = 6;
const T_DEAD_PURGE: u8 = 7;
const T_HOLE: u8 = 8;
const T_DEDUP: u8 = 9;
const T_IMPORT: u8 = 10;
const T_PURGE_KEY: u8 = 11;
const T_CANCEL: u8 = 12;
const T_CANCEL_RUN: u8 = 13;
const T_ENQUEUE_DEDUP: u8 = 14;
const T_BACK_OFF: u8 = 15;
const T_RESUME: u8 = 16;
const T_DEBOUNCE: u8 = 17;

/// The dedup id an Enqueue record carries: the job and its id are one
/// record, so one append, one checksum and one header hold both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnqueueDedup<'a> {
    /// The dedup id, scoped to the job's key.
    pub id: &'a str,
    /// Forgotten at this time.
    pub expires_ms: u64,
}

/// One decoded record. Borrowed fields point into the read buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record<'a> {
    /// A new job; its id is the record's position in the shard's log.
    /// With a dedup id it is written as type 14, and stands for a Dedup
    /// record of `(key, id)` naming this job as well.
    Enqueue {
        /// Enqueue time.
        created_ms: u64,
        /// Earliest start.
        not_before_ms: u64,
        /// Attempt limit.
        max_attempts: u32,
        /// Routing key (UTF-8 checked on decode).
        key: &'a str,
        /// The job's dedup id and its expiry, if it has one.
        dedup: Option<EnqueueDedup<'a>>,
        /// Payload.
        payload: &'a [u8],
    },
    /// The owner started attempt `attempt` of `job` at `started_ms`: a run
    /// with fence `fence`.
    Claim {
        /// Job id.
        job: u64,
        /// Attempt number, from 1.
        attempt: u32,
        /// The run's fencing token (the shard's high-water after it).
        fence: u64,
        /// When the attempt started (ms since the epoch).
        started_ms: u64,
        /// The job's key.
        key: &'a str,
    },
    /// The job finished.
    Ack {
        /// Job id.
        job: u64,
        /// The job's key.
        key: &'a str,
    },
    /// An attempt failed: retry at `retry_at_ms`, or dead-letter.
    Fail {
        /// Job id.
        job: u64,
        /// Earliest retry.
        retry_at_ms: u64,
        /// Out of attempts.
        dead: bool,
        /// The job's key.
        key: &'a str,
        /// Why.
        reason: &'a str,
    },
    /// A run ended without using an attempt (its handler backed off): the
    /// job goes back to the head of its key with the attempt count it had
    /// before the run, not before `retry_at_ms`.
    BackOff {
        /// Job id.
        job: u64,
        /// Earliest start again.
        retry_at_ms: u64,
        /// The job's key.
        key: &'a str,
    },
    /// An operator lifted a handler's back-off (`shardq key resume`): the
    /// waiting job `job`, put back by a BackOff record, is due from `at_ms`
    /// (the time of the resume) instead of its back-off's end.
    Resume {
        /// Job id.
        job: u64,
        /// Its earliest start now.
        at_ms: u64,
        /// The job's key.
        key: &'a str,
    },
    /// A debounced enqueue met waiting job `job` of its key with its id:
    /// the job's payload is this record's from now on, and it is due from
    /// `not_before_ms`.
    Debounce {
        /// Job id.
        job: u64,
        /// Its earliest start now.
        not_before_ms: u64,
        /// The job's key.
        key: &'a str,
        /// Its payload now.
        payload: &'a [u8],
    },
    /// End of this segment; the log continues in the next one.
    Seal,
    /// A dead job goes back to its key.
    DeadRetry {
        /// Job id.
        job: u64,
    },
    /// A dead job is deleted.
    DeadPurge {
        /// Job id.
        job: u64,
    },
    /// Bytes cut out by `shardq repair`: records in them are lost (and were
    /// reported, and saved to the quarantine folder, by the repair).
    Hole {
        /// Total size of the hole record, header included.
        bytes: u64,
    },
    /// `(key, id)` was enqueued as job `job` of shard `shard` (empty: this
    /// shard), remembered until `expires_ms`. Written in the same append as
    /// its job's Enqueue record, or by a move's import.
    Dedup {
        /// The job's id on its shard.
        job: u64,
        /// Forgotten at this time.
        expires_ms: u64,
        /// The job's key.
        key: &'a str,
        /// The dedup id.
        id: &'a str,
        /// The shard holding the job; empty for this shard.
        shard: &'a str,
    },
    /// A job copied here from shard `from` with its key (a move): a new
    /// job, its id the record's position, with its attempts, times and
    /// dead letter state as it had them there.
    Import {
        /// Its id on `from` (a second copy of it is refused).
        source_id: u64,
        /// Enqueue time.
        created_ms: u64,
        /// Earliest start.
        not_before_ms: u64,
        /// Attempts already made.
        attempt: u32,
        /// Attempt limit.
        max_attempts: u32,
        /// A dead letter: its reason is `reason`.
        dead: bool,
        /// The shard it was copied from.
        from: &'a str,
        /// Routing key.
        key: &'a str,
        /// Why it died (empty when not dead).
        reason: &'a str,
        /// The dedup id it was enqueued with (empty: none). Data of the
        /// job only: the dedup *record* moves on its own (a Dedup record).
        dedup_id: &'a str,
        /// Payload.
        payload: &'a [u8],
    },
    /// Every job of `key` not in flight, queued, delayed or dead, is deleted
    /// (the copies a move left behind).
    PurgeKey {
        /// The key.
        key: &'a str,
    },
    /// A queued or delayed job of `key`, not in flight, is cancelled by an
    /// operator: it leaves its key's queue and never runs.
    Cancel {
        /// Job id.
        job: u64,
        /// The job's key.
        key: &'a str,
    },
    /// The run `fence` of job `job`, in flight, is cancelled by an
    /// operator: its results are refused from now, and its owner deletes
    /// the job (with a Cancel record) once the run's job lease lapses.
    CancelRun {
        /// Job id.
        job: u64,
        /// The run's fence.
        fence: u64,
    },
}

/// Why bytes do not decode to a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// Fewer bytes than the record needs (maybe still being written).
    Incomplete,
    /// The bytes are complete but wrong.
    Invalid(String),
}

/// Appends a record to `out`.
///
/// Long on purpose: one arm per record type, in the order of design.md's
/// byte table, so each type's bytes read in one place beside the others
/// (the decoder mirrors it).
pub fn encode(out: &mut Vec<u8>, rec: &Record<'_>) {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_BYTES]);
    match rec {
        Record::Enqueue {
            created_ms,
            not_before_ms,
            max_attempts,
            key,
            dedup,
            payload,
        } => {
            out.push(if dedup.is_some() {
                T_ENQUEUE_DEDUP
            } else {
                T_ENQUEUE
            });
            out.extend_from_slice(&created_ms.to_le_bytes());
            out.extend_from_slice(&not_before_ms.to_le_bytes());
            out.extend_from_slice(&max_attempts.to_le_bytes());
            if let Some(d) = dedup {
                out.extend_from_slice(&d.expires_ms.to_le_bytes());
            }
            put_str16(out, key);
            if let Some(d) = dedup {
                put_str16(out, d.id);
            }
            out.extend_from_slice(payload);
        }
        Record::Claim {
            job,
            attempt,
            fence,
            started_ms,
            key,
        } => {
            out.push(T_CLAIM);
            out.extend_from_slice(&job.to_le_bytes());
            out.extend_from_slice(&attempt.to_le_bytes());
            out.extend_from_slice(&fence.to_le_bytes());
            out.extend_from_slice(&started_ms.to_le_bytes());
            put_str16(out, key);
        }
        Record::Ack { job, key } => {
            out.push(T_ACK);
            out.extend_from_slice(&job.to_le_bytes());
            put_str16(out, key);
        }
        Record::Fail {
            job,
            retry_at_ms,
            dead,
            key,
            reason,
        } => {
            out.push(T_FAIL);
            out.extend_from_slice(&job.to_le_bytes());
            out.extend_from_slice(&retry_at_ms.to_le_bytes());
            out.push(u8::from(*dead));
            put_str16(out, key);
            put_str16(out, reason);
        }
        Record::BackOff {
            job,
            retry_at_ms,
            key,
        } => {
            out.push(T_BACK_OFF);
            out.extend_from_slice(&job.to_le_bytes());
            out.extend_from_slice(&retry_at_ms.to_le_bytes());
            put_str16(out, key);
        }
        Record::Resume { job, at_ms, key } => {
            out.push(T_RESUME);
            out.extend_from_slice(&job.to_le_bytes());
            out.extend_from_slice(&at_ms.to_le_bytes());
            put_str16(out, key);
        }
        Record::Debounce {
            job,
            not_before_ms,
            key,
            payload,
        } => {
            out.push(T_DEBOUNCE);
            out.extend_from_slice(&job.to_le_bytes());
            out.extend_from_slice(&not_before_ms.to_le_bytes());
            put_str16(out, key);
            out.extend_from_slice(payload);
        }
        Record::Seal => out.push(T_SEAL),
        Record::DeadRetry { job } => {
            out.push(T_DEAD_RETRY);
            out.extend_from_slice(&job.to_le_bytes());
        }
        Record::DeadPurge { job } => {
            out.push(T_DEAD_PURGE);
            out.extend_from_slice(&job.to_le_bytes());
        }
        Record::Hole { .. } => out.push(T_HOLE),
        Record::Dedup {
            job,
            expires_ms,
            key,
            id,
            shard,
        } => {
            out.push(T_DEDUP);
            out.extend_from_slice(&job.to_le_bytes());
            out.extend_from_slice(&expires_ms.to_le_bytes());
            put_str16(out, key);
            put_str16(out, id);
            put_str16(out, shard);
        }
        Record::Import {
            source_id,
            created_ms,
            not_before_ms,
            attempt,
            max_attempts,
            dead,
            from,
            key,
            reason,
            dedup_id,
            payload,
        } => {
            out.push(T_IMPORT);
            out.extend_from_slice(&source_id.to_le_bytes());
            out.extend_from_slice(&created_ms.to_le_bytes());
            out.extend_from_slice(&not_before_ms.to_le_bytes());
            out.extend_from_slice(&attempt.to_le_bytes());
            out.extend_from_slice(&max_attempts.to_le_bytes());
            out.push(u8::from(*dead));
            put_str16(out, from);
            put_str16(out, key);
            put_str16(out, reason);
            put_str16(out, dedup_id);
            out.extend_from_slice(payload);
        }
        Record::PurgeKey { key } => {
            out.push(T_PURGE_KEY);
            put_str16(out, key);
        }
        Record::Cancel { job, key } => {
            out.push(T_CANCEL);
            out.extend_from_slice(&job.to_le_bytes());
            put_str16(out, key);
        }
        Record::CancelRun { job, fence } => {
            out.push(T_CANCEL_RUN);
            out.extend_from_slice(&job.to_le_bytes());
            out.extend_from_slice(&fence.to_le_bytes());
        }
    }
    seal_header(out, start);
}

/// Writes a hole record of exactly `total` bytes (at least a header and a
/// type byte) into `out`, for repair.
pub fn encode_hole(total: usize) -> Vec<u8> {
    assert!(total > HEADER_BYTES, "a hole record needs at least 9 bytes");
    let mut out = vec![0u8; total];
    out[HEADER_BYTES] = T_HOLE;
    seal_header(&mut out, 0);
    out
}

fn seal_header(out: &mut [u8], start: usize) {
    let body_len = out.len() - start - HEADER_BYTES;
    assert!(
        (1..=RECORD_BODY_BYTES_MAX).contains(&body_len),
        "record body of {body_len} bytes is out of bounds"
    );
    let len_bytes = (body_len as u32).to_le_bytes();
    out[start..start + 4].copy_from_slice(&len_bytes);
    let crc = checksum(&len_bytes, &out[start + HEADER_BYTES..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

fn checksum(len_bytes: &[u8; 4], body: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(len_bytes), body)
}

fn put_str16(out: &mut Vec<u8>, s: &str) {
    // Keys (<= 1 KiB) and reasons (cut to 1 KiB) always fit in a u16.
    let len = u16::try_from(s.len()).expect("string field over 64 KiB");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Decodes the record at the start of `buf`; returns it and its total size.
pub fn decode(buf: &[u8]) -> Result<(Record<'_>, usize), DecodeError> {
    if buf.len() < HEADER_BYTES {
        return Err(DecodeError::Incomplete);
    }
    let len_bytes: [u8; 4] = buf[0..4].try_into().expect("4 bytes");
    let body_len = u32::from_le_bytes(len_bytes) as usize;
    if body_len == 0 || body_len > RECORD_BODY_BYTES_MAX {
        return Err(DecodeError::Invalid(format!(
            "record length {body_len} is out of bounds (1..={RECORD_BODY_BYTES_MAX})"
        )));
    }
    let total = HEADER_BYTES + body_len;
    if buf.len() < total {
        return Err(DecodeError::Incomplete);
    }
    let crc = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
    let body = &buf[HEADER_BYTES..total];
    let actual = checksum(&len_bytes, body);
    if crc != actual {
        return Err(DecodeError::Invalid(format!(
            "checksum mismatch: stored {crc:#010x}, computed {actual:#010x}"
        )));
    }
    let rec = decode_body(body).map_err(DecodeError::Invalid)?;
    Ok((rec, total))
}

struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!("record body too short: needs {n} more bytes"));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn str16(&mut self) -> Result<&'a str, String> {
        let len = u16::from_le_bytes(self.take(2)?.try_into().expect("2")) as usize;
        std::str::from_utf8(self.take(len)?).map_err(|e| format!("string field is not UTF-8: {e}"))
    }
    fn end(&self) -> Result<(), String> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} unexpected bytes after the fields",
                self.buf.len()
            ))
        }
    }
}

/// The record a body (the bytes after the record header) holds.
///
/// Long on purpose: a flat match with one arm per record type, the decoding
/// side of [`encode`], so each type's fields read in one place beside the
/// others.
fn decode_body(body: &[u8]) -> Result<Record<'_>, String> {
    let mut c = Cursor { buf: body };
    let ty = c.u8()?;
    let rec = match ty {
        T_ENQUEUE | T_ENQUEUE_DEDUP => {
            let created_ms = c.u64()?;
            let not_before_ms = c.u64()?;
            let max_attempts = c.u32()?;
            let expires_ms = if ty == T_ENQUEUE_DEDUP {
                Some(c.u64()?)
            } else {
                None
            };
            let key = c.str16()?;
            let dedup = match expires_ms {
                Some(expires_ms) => Some(EnqueueDedup {
                    id: c.str16()?,
                    expires_ms,
                }),
                None => None,
            };
            let payload = c.buf;
            c.buf = &[];
            Record::Enqueue {
                created_ms,
                not_before_ms,
                max_attempts,
                key,
                dedup,
                payload,
            }
        }
        T_CLAIM => Record::Claim {
            job: c.u64()?,
            attempt: c.u32()?,
            fence: c.u64()?,
            started_ms: c.u64()?,
            key: c.str16()?,
        },
        T_ACK => Record::Ack {
            job: c.u64()?,
            key: c.str16()?,
        },
        T_FAIL => Record::Fail {
            job: c.u64()?,
            retry_at_ms: c.u64()?,
            dead: c.u8()? != 0,
            key: c.str16()?,
            reason: c.str16()?,
        },
        T_BACK_OFF => Record::BackOff {
            job: c.u64()?,
            retry_at_ms: c.u64()?,
            key: c.str16()?,
        },
        T_RESUME => Record::Resume {
            job: c.u64()?,
            at_ms: c.u64()?,
            key: c.str16()?,
        },
        T_DEBOUNCE => {
            let job = c.u64()?;
            let not_before_ms = c.u64()?;
            let key = c.str16()?;
            let payload = c.buf;
            c.buf = &[];
            Record::Debounce {
                job,
                not_before_ms,
                key,
                payload,
            }
        }
        T_SEAL => Record::Seal,
        T_DEAD_RETRY => Record::DeadRetry { job: c.u64()? },
        T_DEAD_PURGE => Record::DeadPurge { job: c.u64()? },
        // A hole's body is whatever bytes were cut out, zeroed.
        T_HOLE => {
            c.buf = &[];
            Record::Hole {
                bytes: (body.len() + HEADER_BYTES) as u64,
            }
        }
        T_DEDUP => Record::Dedup {
            job: c.u64()?,
            expires_ms: c.u64()?,
            key: c.str16()?,
            id: c.str16()?,
            shard: c.str16()?,
        },
        T_IMPORT => {
            let source_id = c.u64()?;
            let created_ms = c.u64()?;
            let not_before_ms = c.u64()?;
            let attempt = c.u32()?;
            let max_attempts = c.u32()?;
            let dead = c.u8()? != 0;
            let from = c.str16()?;
            let key = c.str16()?;
            let reason = c.str16()?;
            let dedup_id = c.str16()?;
            let payload = c.buf;
            c.buf = &[];
            Record::Import {
                source_id,
                created_ms,
                not_before_ms,
                attempt,
                max_attempts,
                dead,
                from,
                key,
                reason,
                dedup_id,
                payload,
            }
        }
        T_PURGE_KEY => Record::PurgeKey { key: c.str16()? },
        T_CANCEL => Record::Cancel {
            job: c.u64()?,
            key: c.str16()?,
        },
        T_CANCEL_RUN => Record::CancelRun {
            job: c.u64()?,
            fence: c.u64()?,
        },
        other => return Err(format!("unknown record type {other}")),
    };
    c.end()?;
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(rec: Record<'_>) {
        let mut buf = Vec::new();
        encode(&mut buf, &rec);
        let (got, n) = decode(&buf).expect("decodes");
        assert_eq!(n, buf.len());
        assert_eq!(got, rec);
        // Every strict prefix is incomplete, never an error or a panic.
        for cut in 0..buf.len() {
            assert_eq!(
                decode(&buf[..cut]),
                Err(DecodeError::Incomplete),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn records_roundtrip() {
        roundtrip(Record::Enqueue {
            created_ms: 1,
            not_before_ms: 2,
            max_attempts: 3,
            key: "k",
            dedup: None,
            payload: b"payload",
        });
        roundtrip(Record::Enqueue {
            created_ms: 1,
            not_before_ms: 2,
            max_attempts: 3,
            key: "tenant-1",
            dedup: Some(EnqueueDedup {
                id: "invoice/2026-0001",
                expires_ms: 1_700_000_000_000,
            }),
            payload: b"",
        });
        roundtrip(Record::Claim {
            job: 9,
            attempt: 3,
            fence: 1_700_000_000_000_001,
            started_ms: 1_700_000_000_123,
            key: "tenant-1",
        });
        roundtrip(Record::Ack { job: 9, key: "kk" });
        roundtrip(Record::Fail {
            job: 9,
            retry_at_ms: 5,
            dead: true,
            key: "k",
            reason: "boom",
        });
        roundtrip(Record::BackOff {
            job: 9,
            retry_at_ms: 77,
            key: "k",
        });
        roundtrip(Record::Resume {
            job: 9,
            at_ms: 78,
            key: "tenant-1",
        });
        roundtrip(Record::Debounce {
            job: 9,
            not_before_ms: 1_700_000_005_000,
            key: "tenant-1",
            payload: b"{\"v\":5}",
        });
        roundtrip(Record::Seal);
        roundtrip(Record::DeadRetry { job: 1 });
        roundtrip(Record::DeadPurge { job: 1 });
        roundtrip(Record::Dedup {
            job: 16,
            expires_ms: 1_700_000_000_000,
            key: "tenant-1",
            id: "invoice/2026-0001",
            shard: "",
        });
        roundtrip(Record::Dedup {
            job: u64::MAX,
            expires_ms: 0,
            key: "k",
            id: "é",
            shard: "shard-3",
        });
        roundtrip(Record::Import {
            source_id: 4096,
            created_ms: 1,
            not_before_ms: 2,
            attempt: 3,
            max_attempts: 5,
            dead: true,
            from: "shard-1",
            key: "tenant-1",
            reason: "exited with status 3",
            dedup_id: "schedule:nightly@1800000000000",
            payload: b"{\"n\":1}",
        });
        roundtrip(Record::PurgeKey { key: "tenant-1" });
        roundtrip(Record::Cancel {
            job: 4096,
            key: "tenant-1",
        });
        roundtrip(Record::CancelRun {
            job: 4096,
            fence: 1_700_000_000_000_001,
        });
        let mut seal = Vec::new();
        encode(&mut seal, &Record::Seal);
        assert_eq!(seal.len(), SEAL_BYTES);
        let hole = encode_hole(40);
        assert_eq!(decode(&hole), Ok((Record::Hole { bytes: 40 }, 40)));
    }

    #[test]
    fn flipped_bits_are_invalid() {
        for rec in [
            Record::Ack { job: 7, key: "key" },
            Record::Claim {
                job: 7,
                attempt: 1,
                fence: 99,
                started_ms: 5,
                key: "key",
            },
            Record::Enqueue {
                created_ms: 5,
                not_before_ms: 6,
                max_attempts: 3,
                key: "key",
                dedup: Some(EnqueueDedup {
                    id: "id",
                    expires_ms: 99,
                }),
                payload: b"{}",
            },
            Record::Dedup {
                job: 7,
                expires_ms: 99,
                key: "key",
                id: "id",
                shard: "s1",
            },
        ] {
            flipped_bits_are_invalid_in(&rec);
        }
    }

    fn flipped_bits_are_invalid_in(rec: &Record<'_>) {
        let mut buf = Vec::new();
        encode(&mut buf, rec);
        for i in 0..buf.len() {
            for bit in 0..8 {
                let mut b = buf.clone();
                b[i] ^= 1 << bit;
                assert!(
                    decode(&b).is_err(),
                    "flip byte {i} bit {bit} went unnoticed"
                );
            }
        }
    }

    #[test]
    fn segment_header_checks() {
        let h = segment_header();
        assert_eq!(check_segment_header(&h), Ok(()));
        assert_eq!(&h[0..8], b"SHARDQLG");
        let mut bad = h;
        bad[0] ^= 1;
        assert!(
            matches!(check_segment_header(&bad), Err(HeaderError::Invalid(r)) if r.contains("magic"))
        );
        // A segment of any other format version, lower or higher, is
        // refused by its version, not read.
        for other in [SEGMENT_FORMAT_VERSION - 1, SEGMENT_FORMAT_VERSION + 1] {
            let mut v = h;
            v[8..12].copy_from_slice(&other.to_le_bytes());
            let crc = crc32c::crc32c(&v[0..12]);
            v[12..16].copy_from_slice(&crc.to_le_bytes());
            assert_eq!(
                check_segment_header(&v),
                Err(HeaderError::UnknownVersion(other))
            );
        }
        let mut flipped = h;
        flipped[9] ^= 4;
        assert!(
            matches!(check_segment_header(&flipped), Err(HeaderError::Invalid(r)) if r.contains("checksum"))
        );
        assert!(check_segment_header(&h[..15]).is_err());
    }

    proptest! {
        #[test]
        fn segment_header_check_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = check_segment_header(&bytes);
        }

        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn decoder_never_panics_with_valid_header(body in proptest::collection::vec(any::<u8>(), 1..256)) {
            // A correct length and checksum over arbitrary bodies reaches the
            // field decoder, which must refuse cleanly.
            let mut buf = vec![0u8; HEADER_BYTES];
            buf.extend_from_slice(&body);
            let len = (body.len() as u32).to_le_bytes();
            buf[0..4].copy_from_slice(&len);
            let crc = checksum(&len, &body);
            buf[4..8].copy_from_slice(&crc.to_le_bytes());
            let _ = decode(&buf);
        }

        #[test]
        fn dedup_records_roundtrip_and_truncated_bodies_are_refused(
            job in any::<u64>(),
            expires_ms in any::<u64>(),
            key in "[a-z0-9]{1,40}",
            id in "\\PC{1,60}",
            shard in "[a-z0-9-]{0,20}",
            cut in 1usize..40,
        ) {
            let rec = Record::Dedup { job, expires_ms, key: &key, id: &id, shard: &shard };
            let mut buf = Vec::new();
            encode(&mut buf, &rec);
            let (got, n) = decode(&buf).expect("decodes");
            prop_assert_eq!(n, buf.len());
            prop_assert_eq!(got, rec);
            // A body cut short, with a correct length and checksum, is
            // invalid (never a panic, never another record).
            let body = &buf[HEADER_BYTES..buf.len() - cut.min(buf.len() - HEADER_BYTES - 1)];
            let mut short = vec![0u8; HEADER_BYTES];
            short.extend_from_slice(body);
            let len = (body.len() as u32).to_le_bytes();
            short[0..4].copy_from_slice(&len);
            let crc = checksum(&len, body);
            short[4..8].copy_from_slice(&crc.to_le_bytes());
            prop_assert!(matches!(decode(&short), Err(DecodeError::Invalid(_))));
        }
    }
}
