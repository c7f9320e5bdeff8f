//! Readers of what the scripts reply and store: a job record (`JobRecord`),
//! finished entries, start times, job views, moved jobs and dedup records.

use super::*;

/// One job's record in the shard's `jobs` hash:
/// `<not_before_ms>|<attempts>|<max_attempts>|<created_ms>|<key len>|<dedup id len>|<key><dedup id><payload>`
/// (the scripts in `scripts.rs` write it).
#[derive(Debug, PartialEq)]
pub(crate) struct JobRecord<'a> {
    pub(crate) not_before_ms: u64,
    /// Finished attempts (a job in flight is on attempt `attempts + 1`).
    pub(crate) attempts: u32,
    pub(crate) max_attempts: u32,
    pub(crate) created_ms: u64,
    pub(crate) key: String,
    /// The dedup id the job was enqueued with (`None` when empty).
    pub(crate) dedup_id: Option<String>,
    pub(crate) payload: &'a [u8],
}

impl JobRecord<'_> {
    /// `None` for anything but a well-formed record.
    pub(crate) fn parse(b: &[u8]) -> Option<JobRecord<'_>> {
        let mut rest = b;
        let mut num = || -> Option<u64> {
            let end = rest.iter().position(|&c| c == b'|')?;
            let v = std::str::from_utf8(&rest[..end]).ok()?.parse().ok()?;
            rest = &rest[end + 1..];
            Some(v)
        };
        let not_before_ms = num()?;
        let attempts = u32::try_from(num()?).ok()?;
        let max_attempts = u32::try_from(num()?).ok()?;
        let created_ms = num()?;
        let key_len = usize::try_from(num()?).ok()?;
        let dedup_len = usize::try_from(num()?).ok()?;
        if rest.len() < key_len.checked_add(dedup_len)? {
            return None;
        }
        let (key, rest) = rest.split_at(key_len);
        let (dedup, payload) = rest.split_at(dedup_len);
        Some(JobRecord {
            not_before_ms,
            attempts,
            max_attempts,
            created_ms,
            key: String::from_utf8(key.to_vec()).ok()?,
            dedup_id: match dedup_len {
                0 => None,
                _ => Some(String::from_utf8(dedup.to_vec()).ok()?),
            },
            payload,
        })
    }
}

/// One entry of a shard's `finished` list (see `keys::SHARD_PARTS`).
pub(super) fn parse_done(e: &[u8]) -> Option<FinishedJob> {
    let mut at = 0;
    let mut field = || {
        let end = at + e[at..].iter().position(|&b| b == b'|')?;
        let f = std::str::from_utf8(&e[at..end]).ok()?;
        at = end + 1;
        Some(f)
    };
    let id: u64 = field()?.parse().ok()?;
    let outcome = match field()? {
        "c" => Finish::Completed,
        "x" => Finish::Cancelled,
        _ => return None,
    };
    let attempts: u32 = field()?.parse().ok()?;
    let finished_ms: u64 = field()?.parse().ok()?;
    let starts = field()?;
    let key_len: usize = field()?.parse().ok()?;
    let reason_len: usize = field()?.parse().ok()?;
    let result_len: Option<usize> = match field()? {
        "" => None,
        n => Some(n.parse().ok()?),
    };
    let key = std::str::from_utf8(e.get(at..at.checked_add(key_len)?)?).ok()?;
    let at = at + key_len;
    let reason = String::from_utf8_lossy(e.get(at..at.checked_add(reason_len)?)?).into_owned();
    let at = at + reason_len;
    let result = match result_len {
        Some(n) => Some(e.get(at..at.checked_add(n)?)?.to_vec()),
        None => None,
    };
    let starts: Vec<u64> = (starts.split(',').filter(|t| !t.is_empty()))
        .map(|t| t.parse().ok())
        .collect::<Option<_>>()?;
    let cut = starts
        .len()
        .saturating_sub(shardq_core::FINISHED_STARTS_KEPT);
    Some(FinishedJob {
        id: JobId(id),
        key: key.to_string(),
        outcome,
        attempts,
        finished_ms,
        attempt_starts_ms: starts[cut..].to_vec(),
        reason: (!reason.is_empty()).then_some(reason),
        result,
    })
}

/// The start times of a job's attempts, as the scripts keep them (ms,
/// comma-separated, oldest first; empty for none); `None` when malformed.
pub(super) fn parse_starts(v: &Value) -> Option<Vec<u64>> {
    let text = reply::string(v)?;
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(',').map(|t| t.parse().ok()).collect()
}

/// A job from the six fields `state, record, reason, fence, lease, starts`
/// of the job scripts; `None` when malformed.
pub(super) fn job_info(id: JobId, f: &[Value]) -> Option<JobInfo> {
    if f.len() != 6 {
        return None;
    }
    let state = match reply::string(&f[0])?.as_str() {
        "RUN" => JobState::Running,
        "DEAD" => JobState::Dead,
        "DELAYED" => JobState::Delayed,
        "QUEUED" => JobState::Queued,
        _ => return None,
    };
    let rec = reply::bytes(&f[1]).and_then(JobRecord::parse)?;
    let reason = reply::string(&f[2]).filter(|r| !r.is_empty());
    let score = |v: &Value| {
        reply::u64(v).or_else(|| {
            reply::string(v)
                .and_then(|t| t.parse::<f64>().ok())
                .map(|x| x as u64)
        })
    };
    let run = (state == JobState::Running).then(|| Some((score(&f[3])?, score(&f[4])?)));
    Some(JobInfo {
        id,
        key: rec.key,
        state,
        attempts: rec.attempts,
        max_attempts: rec.max_attempts,
        created_ms: rec.created_ms,
        not_before_ms: rec.not_before_ms,
        run: match run {
            Some(r) => Some(r?),
            None => None,
        },
        reason,
        attempt_starts_ms: parse_starts(&f[5])?,
        payload: rec.payload.to_vec(),
        dedup_id: rec.dedup_id,
    })
}

/// One exported job (`id, record, reason` of the export scripts) of `key`
/// with an id above `after`; `None` for anything else.
pub(super) fn moved_job(
    id: &Value,
    rec: &Value,
    reason: &Value,
    key: &str,
    after: u64,
) -> Option<MovedJob> {
    let id = reply::u64(id)?;
    let rec = reply::bytes(rec).and_then(JobRecord::parse)?;
    if rec.key != key || id <= after {
        return None;
    }
    let reason = reply::string(reason).unwrap_or_default();
    Some(MovedJob {
        id: JobId(id),
        created_ms: rec.created_ms,
        not_before_ms: rec.not_before_ms,
        attempt: rec.attempts,
        max_attempts: rec.max_attempts,
        payload: rec.payload.to_vec(),
        dead: (!reason.is_empty()).then_some(reason),
        dedup_id: rec.dedup_id,
    })
}

/// The `dedup` hash field of `(key, id)`: the key's length, `|`, key, id.
pub(super) fn dedup_field(key: &str, id: &str) -> String {
    format!("{}|{key}{id}", key.len())
}

/// A `dedup` hash entry as a record (`shard` when the record names none).
pub(super) fn parse_dedup(shard: &str, field: &str, rec: &str) -> Option<DedupRecord> {
    let (len, rest) = field.split_once('|')?;
    let len: usize = len.parse().ok()?;
    let key = rest.get(..len)?;
    let id = rest.get(len..)?;
    let mut parts = rec.splitn(3, '|');
    let job = parts.next()?.parse().ok()?;
    let expires_ms = parts.next()?.parse().ok()?;
    let on = parts.next()?;
    Some(DedupRecord {
        key: key.to_string(),
        id: id.to_string(),
        shard: if on.is_empty() { shard } else { on }.to_string(),
        job: JobId(job),
        expires_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::JobRecord;

    pub(super) fn check(rec: &[u8], expected: Option<JobRecord<'_>>) {
        assert_eq!(
            JobRecord::parse(rec),
            expected,
            "{:?}",
            String::from_utf8_lossy(rec)
        );
    }

    pub(super) fn job(
        attempts: u32,
        key: &str,
        payload: &'static [u8],
    ) -> Option<JobRecord<'static>> {
        Some(JobRecord {
            not_before_ms: 5,
            attempts,
            max_attempts: 3,
            created_ms: 4,
            key: key.to_string(),
            dedup_id: None,
            payload,
        })
    }

    #[test]
    pub(super) fn job_records() {
        check(b"5|0|3|4|1|0|kp", job(0, "k", b"p"));
        // Keys and payloads may hold the separator; the lengths decide.
        check(b"5|1|3|4|3|0|a|b|x|", job(1, "a|b", b"|x|"));
        check(b"5|0|3|4|2|0|ab", job(0, "ab", b""));
        let with_id = job(0, "k", b"|p").map(|mut j| {
            j.dedup_id = Some("schedule:s@1|2".into());
            j
        });
        check(b"5|0|3|4|1|14|kschedule:s@1|2|p", with_id);
        check(b"5|0|3|4|3|0|ab", None);
        check(b"5|0|3|4|1|5|kab", None);
        check(b"5|0|3|4|1|kp", None);
        check(b"5|0|3|4|", None);
        check(b"5|x|3|4|1|0|k", None);
        check(b"", None);
    }
}
