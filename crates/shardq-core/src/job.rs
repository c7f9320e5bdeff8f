//! Jobs and the values that describe them, shared by every backend.
//!
//! Plain data with validation of caller input; it must never decide where a
//! job lives or touch storage.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::QueueError;

/// Longest routing key, in bytes. Keys are kept in memory per pending job and
/// in every enqueue record, so they stay short.
pub const KEY_BYTES_MAX: usize = 1024;
/// Default largest payload, in bytes (1 MiB). Configurable per data dir or
/// queue up to [`PAYLOAD_BYTES_LIMIT`].
pub const PAYLOAD_BYTES_MAX_DEFAULT: usize = 1 << 20;
/// Hard upper bound for a configured payload limit (64 MiB): one record must
/// fit comfortably in memory when it is read back.
pub const PAYLOAD_BYTES_LIMIT: usize = 64 << 20;
/// Default attempts before a job goes to the dead-letter list.
pub const MAX_ATTEMPTS_DEFAULT: u32 = 5;
/// Largest `max_attempts` a job may ask for.
pub const MAX_ATTEMPTS_LIMIT: u32 = 1000;
/// Longest failure reason kept with a failed attempt, in bytes; longer reasons
/// are cut (on a character boundary), never rejected.
pub const FAIL_REASON_BYTES_MAX: usize = 1024;
/// Longest delay a job may ask for (one year), so `now + delay` never overflows
/// and a typo does not park a job forever.
pub const DELAY_MS_MAX: u64 = 365 * 24 * 3600 * 1000;

/// A job's identity, unique within its shard. Ids of one shard grow in the
/// order their enqueues completed, which is what per-key order is built on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct JobId(pub u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A job as a producer hands it in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewJob {
    /// Routing key: picks the shard and orders the key's jobs.
    pub key: String,
    /// Opaque bytes given to the handler.
    pub payload: Vec<u8>,
    /// Earliest start, as a delay from the moment of enqueue.
    pub delay_ms: u64,
    /// Attempts before the job is dead-lettered (1..=[`MAX_ATTEMPTS_LIMIT`]).
    pub max_attempts: u32,
    /// Idempotency id, scoped to the key: a second job with the same
    /// `(key, dedup_id)` within the dedup window is not stored again (see
    /// [`crate::RunJobs::enqueue_dedup`]); 1..=[`DEDUP_ID_BYTES_MAX`]
    /// bytes without unshowable characters ([`is_unshowable`]).
    pub dedup_id: Option<String>,
    /// A unique or debounced job ([`Keyed`]): its `dedup_id` is then the
    /// job's id within its key ([`keyed_id`]), checked against the key's
    /// live job with that id instead of a dedup window.
    pub keyed: Option<Keyed>,
}

/// What an enqueue of a keyed job does when its key has a live job with
/// the same id (see [`RunJobs::enqueue_dedup`](crate::RunJobs::enqueue_dedup)).
/// The check is atomic with the append, on every backend, and the id moves
/// with its job when its key moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keyed {
    /// A unique job: while the key's job with this id waits (queued or
    /// delayed, a retry's wait included) or, with `running`, runs, the
    /// enqueue stores nothing and answers that job (`duplicate`). A dead
    /// or finished job does not count.
    Unique {
        /// Whether a running job counts too (`--unique-while running`).
        running: bool,
    },
    /// A debounced job: the key's job with this id that waits (not
    /// running) takes the new payload and starts at `now + delay_ms`, but
    /// never later than `max_ms` after the first enqueue of the burst (its
    /// `created_ms`); it keeps its id and its place. With none waiting (or
    /// one running) the job is stored, starting at `now + min(delay_ms,
    /// max_ms)`.
    Debounce {
        /// The longest a burst may hold its job back, in ms.
        max_ms: u64,
    },
}

/// The key's newest live job with a keyed id, as a backend finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyedLive {
    /// Its id.
    pub job: JobId,
    /// When it was enqueued (a debounce burst's first enqueue).
    pub created_ms: u64,
    /// Whether a run of it is in flight.
    pub running: bool,
}

/// What a keyed enqueue does ([`Keyed`]), decided once for every backend
/// by [`keyed_meets`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyedMeets {
    /// Nothing stored: the answer is this job, a duplicate.
    Duplicate(JobId),
    /// Nothing stored: this waiting job takes the payload and starts at
    /// `not_before_ms` (refused as paused while its key is copied away).
    Debounce {
        /// The waiting job.
        job: JobId,
        /// Its start now.
        not_before_ms: u64,
    },
    /// A new job, starting at `not_before_ms`.
    Store {
        /// Its start.
        not_before_ms: u64,
    },
}

/// The decision of [`RunJobs::enqueue_dedup`](crate::RunJobs::enqueue_dedup)
/// for a job in `mode` with a delay of `delay_ms`, when the key's newest
/// live job with its id is `live`, at `now_ms`.
pub fn keyed_meets(mode: Keyed, live: Option<KeyedLive>, delay_ms: u64, now_ms: u64) -> KeyedMeets {
    match (mode, live) {
        (Keyed::Unique { running }, Some(e)) if running || !e.running => {
            KeyedMeets::Duplicate(e.job)
        }
        (Keyed::Debounce { max_ms }, Some(e)) if !e.running => KeyedMeets::Debounce {
            job: e.job,
            not_before_ms: now_ms
                .saturating_add(delay_ms)
                .min(e.created_ms.saturating_add(max_ms)),
        },
        (Keyed::Debounce { max_ms }, _) => KeyedMeets::Store {
            not_before_ms: now_ms.saturating_add(delay_ms.min(max_ms)),
        },
        (Keyed::Unique { .. }, _) => KeyedMeets::Store {
            not_before_ms: now_ms.saturating_add(delay_ms),
        },
    }
}

/// The start of a unique job's id (see [`keyed_id`]).
pub const UNIQUE_PREFIX: &str = "unique:";
/// The start of a debounced job's id (see [`keyed_id`]).
pub const DEBOUNCE_PREFIX: &str = "debounce:";
/// Longest unique or debounce id a caller gives, in bytes (its dedup id,
/// with the prefix, stays within [`DEDUP_ID_BYTES_MAX`]).
pub const KEYED_ID_BYTES_MAX: usize = 128;
/// Longest debounce window or max, in ms (one day).
pub const DEBOUNCE_MS_MAX: u64 = 24 * 3600 * 1000;

/// The dedup id a keyed job carries for the caller's id `id`: `unique:ID`
/// or `debounce:ID`, so a backend (and a replay) knows a keyed job by its
/// id alone, and a unique and a debounced id never meet.
pub fn keyed_id(mode: &Keyed, id: &str) -> String {
    match mode {
        Keyed::Unique { .. } => format!("{UNIQUE_PREFIX}{id}"),
        Keyed::Debounce { .. } => format!("{DEBOUNCE_PREFIX}{id}"),
    }
}

/// Whether `dedup_id` is a keyed job's id ([`keyed_id`]).
pub fn is_keyed_id(dedup_id: &str) -> bool {
    dedup_id.starts_with(UNIQUE_PREFIX) || dedup_id.starts_with(DEBOUNCE_PREFIX)
}

/// The keyed options of one enqueue as people give them (the CLI's
/// flags, the API's fields), read once for every front end by
/// [`KeyedSpec::apply`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyedSpec {
    /// `--unique-id`: the job's id within its key.
    pub unique_id: Option<String>,
    /// `--unique-while`: `queued` (the default) or `running`.
    pub unique_while: Option<String>,
    /// `--debounce-id`: the burst's id within its key.
    pub debounce_id: Option<String>,
    /// `--debounce`: how long after the burst's last enqueue it runs (ms).
    pub debounce_ms: Option<u64>,
    /// `--debounce-max`: the longest a burst holds its job back (ms;
    /// default [`debounce_max_default_ms`]).
    pub debounce_max_ms: Option<u64>,
}

/// The `--debounce-max` of a debounce of `debounce_ms` when none is
/// given: ten times the debounce, within 1 s and a day.
pub fn debounce_max_default_ms(debounce_ms: u64) -> u64 {
    debounce_ms.saturating_mul(10).clamp(1_000, DEBOUNCE_MS_MAX)
}

impl KeyedSpec {
    /// Whether any keyed option is given.
    pub fn is_empty(&self) -> bool {
        *self == KeyedSpec::default()
    }

    /// `job` made unique or debounced as asked (unchanged when nothing
    /// is); a mix, a missing half or a bad value is refused naming the
    /// option. A job with its own dedup id cannot be keyed.
    pub fn apply(&self, job: NewJob) -> Result<NewJob, QueueError> {
        let bad = |name: &'static str, value: String, allowed: &str| QueueError::InvalidOption {
            name,
            value,
            allowed: allowed.to_string(),
        };
        if self.is_empty() {
            return Ok(job);
        }
        if job.dedup_id.is_some() {
            return Err(bad(
                "dedup id",
                format!("{:?}", job.dedup_id.as_deref().unwrap_or("")),
                "absent on a unique or debounced job (its id is its dedup id)",
            ));
        }
        for (name, id) in [
            ("unique id", &self.unique_id),
            ("debounce id", &self.debounce_id),
        ] {
            if let Some(id) = id {
                if id.is_empty() || id.len() > KEYED_ID_BYTES_MAX || has_unshowable(id) {
                    return Err(bad(
                        name,
                        format!("{:?}", shown_key(cut_at_char(id, 64))),
                        &format!(
                            "1..={KEYED_ID_BYTES_MAX} bytes without control or invisible formatting characters"
                        ),
                    ));
                }
            }
        }
        let unique = self.unique_id.is_some() || self.unique_while.is_some();
        let debounce = self.debounce_id.is_some()
            || self.debounce_ms.is_some()
            || self.debounce_max_ms.is_some();
        let job = match (unique, debounce) {
            (true, true) => {
                return Err(bad(
                    "unique id",
                    format!(
                        "{:?} with debounce id {:?}",
                        self.unique_id, self.debounce_id
                    ),
                    "either a unique job or a debounced one, not both",
                ))
            }
            (true, false) => {
                let Some(id) = &self.unique_id else {
                    return Err(bad(
                        "unique while",
                        format!("{:?}", self.unique_while),
                        "given with a unique id",
                    ));
                };
                let running = match self.unique_while.as_deref().unwrap_or("queued") {
                    "queued" => false,
                    "running" => true,
                    other => {
                        return Err(bad(
                            "unique while",
                            format!("{other:?}"),
                            "queued or running",
                        ))
                    }
                };
                job.unique(id, running)
            }
            _ => {
                let (Some(id), Some(ms)) = (&self.debounce_id, self.debounce_ms) else {
                    return Err(bad(
                        "debounce",
                        format!(
                            "id {:?}, debounce {:?} ms",
                            self.debounce_id, self.debounce_ms
                        ),
                        "a debounce id and a debounce duration, both",
                    ));
                };
                let max = self
                    .debounce_max_ms
                    .unwrap_or_else(|| debounce_max_default_ms(ms));
                if job.delay_ms != 0 {
                    return Err(bad(
                        "delay",
                        format!("{} ms", job.delay_ms),
                        "0 on a debounced job (its delay is the debounce)",
                    ));
                }
                job.debounced(id, ms, max)
            }
        };
        if let Some(d) = &job.dedup_id {
            validate_dedup_id(&job.key, d)?;
        }
        job.validate_keyed()?;
        Ok(job)
    }
}

/// Refuses a producer's plain dedup id in the namespaces of keyed and
/// scheduled jobs: such an id would be taken for what it is not.
pub fn refuse_reserved_dedup_id(id: &str) -> Result<(), QueueError> {
    crate::schedule::refuse_schedule_dedup_id(id)?;
    if id.starts_with(OUTBOX_PREFIX) {
        return Err(QueueError::InvalidOption {
            name: "dedup id",
            value: format!("{id:?}"),
            allowed: format!(
                "an id not starting with {OUTBOX_PREFIX:?} (kept for the Postgres outbox's rows)"
            ),
        });
    }
    if id.starts_with(crate::workflow::AFTER_PREFIX) {
        return Err(QueueError::InvalidOption {
            name: "dedup id",
            value: format!("{id:?}"),
            allowed: format!(
                "an id not starting with {:?} (kept for released dependents)",
                crate::workflow::AFTER_PREFIX
            ),
        });
    }
    if id.starts_with(crate::workflow::BATCH_PREFIX) {
        return Err(QueueError::InvalidOption {
            name: "dedup id",
            value: format!("{id:?}"),
            allowed: format!(
                "an id not starting with {:?} (kept for batches' callbacks)",
                crate::workflow::BATCH_PREFIX
            ),
        });
    }
    if is_keyed_id(id) {
        return Err(QueueError::InvalidOption {
            name: "dedup id",
            value: format!("{id:?}"),
            allowed: format!(
                "an id not starting with {UNIQUE_PREFIX:?} or {DEBOUNCE_PREFIX:?} (kept for unique and debounced jobs)"
            ),
        });
    }
    Ok(())
}

impl NewJob {
    /// A job to run now, with the default attempt limit.
    pub fn new(key: impl Into<String>, payload: impl Into<Vec<u8>>) -> NewJob {
        NewJob {
            key: key.into(),
            payload: payload.into(),
            delay_ms: 0,
            max_attempts: MAX_ATTEMPTS_DEFAULT,
            dedup_id: None,
            keyed: None,
        }
    }

    /// The same job with dedup id `id` (scoped to its key).
    pub fn with_dedup_id(mut self, id: impl Into<String>) -> NewJob {
        self.dedup_id = Some(id.into());
        self
    }

    /// The same job made unique under `id` within its key ([`Keyed::Unique`]).
    pub fn unique(mut self, id: &str, while_running: bool) -> NewJob {
        let mode = Keyed::Unique {
            running: while_running,
        };
        self.dedup_id = Some(keyed_id(&mode, id));
        self.keyed = Some(mode);
        self
    }

    /// The same job debounced under `id` within its key: held back
    /// `delay_ms` after the burst's last enqueue, at most `max_ms` after its
    /// first ([`Keyed::Debounce`]).
    pub fn debounced(mut self, id: &str, delay_ms: u64, max_ms: u64) -> NewJob {
        let mode = Keyed::Debounce { max_ms };
        self.dedup_id = Some(keyed_id(&mode, id));
        self.keyed = Some(mode);
        self.delay_ms = delay_ms;
        self
    }

    /// Checks the job against the limits; `payload_bytes_max` is the queue's
    /// configured payload limit.
    pub fn validate(&self, payload_bytes_max: usize) -> Result<(), QueueError> {
        validate_key(&self.key)?;
        if let Some(id) = &self.dedup_id {
            validate_dedup_id(&self.key, id)?;
        }
        self.validate_keyed()?;
        if self.payload.len() > payload_bytes_max {
            return Err(QueueError::PayloadTooLarge {
                key: self.key.clone(),
                bytes: self.payload.len(),
                max: payload_bytes_max,
            });
        }
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS_LIMIT {
            return Err(QueueError::InvalidMaxAttempts {
                value: self.max_attempts,
                max: MAX_ATTEMPTS_LIMIT,
            });
        }
        if self.delay_ms > DELAY_MS_MAX {
            return Err(QueueError::InvalidDelay {
                delay_ms: self.delay_ms,
                max: DELAY_MS_MAX,
            });
        }
        Ok(())
    }
}

impl NewJob {
    /// A keyed job's id and mode agree ([`keyed_id`]), and a debounce's
    /// bounds hold; a job that is not keyed has no keyed id.
    fn validate_keyed(&self) -> Result<(), QueueError> {
        let id = self.dedup_id.as_deref().unwrap_or("");
        let (prefix, ok) = match self.keyed {
            None => {
                return match is_keyed_id(id) {
                    true => Err(QueueError::InvalidDedupId {
                        key: cut_at_char(&self.key, 64).to_string(),
                        id: shown_key(cut_at_char(id, 64)),
                        reason: "a keyed job's id on a job that is not keyed".into(),
                    }),
                    false => Ok(()),
                }
            }
            Some(Keyed::Unique { .. }) => (UNIQUE_PREFIX, true),
            Some(Keyed::Debounce { max_ms }) => (
                DEBOUNCE_PREFIX,
                max_ms > 0 && max_ms <= DEBOUNCE_MS_MAX && self.delay_ms <= DEBOUNCE_MS_MAX,
            ),
        };
        if id.len() <= prefix.len() || !id.starts_with(prefix) {
            return Err(QueueError::InvalidDedupId {
                key: cut_at_char(&self.key, 64).to_string(),
                id: shown_key(cut_at_char(id, 64)),
                reason: format!("a keyed job's id starts with {prefix:?} and names something"),
            });
        }
        if !ok {
            let Some(Keyed::Debounce { max_ms }) = self.keyed else {
                unreachable!("only a debounce has bounds")
            };
            return Err(QueueError::InvalidOption {
                name: "debounce",
                value: format!("{} ms, max {max_ms} ms", self.delay_ms),
                allowed: format!(
                    "a debounce and a max of 0..={DEBOUNCE_MS_MAX} ms, the max above 0"
                ),
            });
        }
        Ok(())
    }
}

/// Whether `c` may not appear in a name shown to people (keys, dedup ids,
/// worker and group names): a control character (Unicode category Cc: NUL,
/// tab, newline, ESC, DEL, C1 controls), a line or paragraph separator (Zl,
/// Zp), any format character (Cf: zero-width spaces and joiners, the soft
/// hyphen, the byte-order mark, the bidirectional controls, tags,
/// interlinear annotations), or one of the [`BLANKS`].
pub fn is_unshowable(c: char) -> bool {
    use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};
    c.is_control()
        || BLANKS.contains(&c)
        || matches!(
            c.general_category(),
            GeneralCategory::Format
                | GeneralCategory::LineSeparator
                | GeneralCategory::ParagraphSeparator
        )
}

/// Characters that are letters or symbols by category but show as nothing
/// (a name made of them looks empty or like another): the Hangul fillers
/// U+115F, U+1160, U+3164 and U+FFA0, the braille blank U+2800, and the
/// Mongolian vowel separator U+180E.
pub const BLANKS: [char; 6] = [
    '\u{115F}', '\u{1160}', '\u{180E}', '\u{2800}', '\u{3164}', '\u{FFA0}',
];

/// Whether `s` starts with a combining mark (categories Mn, Mc, Me): a
/// mark with nothing to combine with draws over what is shown before it.
pub fn starts_with_mark(s: &str) -> bool {
    use unicode_properties::{GeneralCategoryGroup, UnicodeGeneralCategory};
    s.chars()
        .next()
        .is_some_and(|c| c.general_category_group() == GeneralCategoryGroup::Mark)
}

/// Whether `s` holds an unshowable character ([`is_unshowable`]). ASCII
/// text, the common case, is checked byte by byte (its only unshowable
/// characters are the controls).
pub fn has_unshowable(s: &str) -> bool {
    if s.is_ascii() {
        s.bytes().any(|b| b < 0x20 || b == 0x7f)
    } else {
        s.chars().any(is_unshowable)
    }
}

/// The dedup id prefix of a job relayed from the Postgres outbox
/// (`pg:<schema>:<row id>`, when its row named no dedup id of its own):
/// refused from producers, so no producer's job takes a row's id.
pub const OUTBOX_PREFIX: &str = "pg:";

/// Longest dedup id, in bytes.
pub const DEDUP_ID_BYTES_MAX: usize = 256;
/// Default dedup window (5 minutes): how long a dedup id is remembered.
pub const DEDUP_WINDOW_MS_DEFAULT: u64 = 5 * 60 * 1000;
/// Longest dedup window a backend accepts (7 days).
pub const DEDUP_WINDOW_MS_MAX: u64 = 7 * 24 * 3600 * 1000;

/// Checks a dedup id (of a job of `key`): 1..=[`DEDUP_ID_BYTES_MAX`] bytes
/// without unshowable characters ([`is_unshowable`]).
pub fn validate_dedup_id(key: &str, id: &str) -> Result<(), QueueError> {
    if id.is_empty() || id.len() > DEDUP_ID_BYTES_MAX || has_unshowable(id) {
        return Err(QueueError::InvalidDedupId {
            key: cut_at_char(key, 64).to_string(),
            id: shown_key(cut_at_char(id, 64)),
            reason: format!(
                "1..={DEDUP_ID_BYTES_MAX} bytes without control or invisible formatting characters ({} bytes given)",
                id.len()
            ),
        });
    }
    Ok(())
}

/// Checks a dedup window: 1..=[`DEDUP_WINDOW_MS_MAX`] ms.
pub fn validate_dedup_window_ms(window_ms: u64) -> Result<(), QueueError> {
    if window_ms == 0 || window_ms > DEDUP_WINDOW_MS_MAX {
        return Err(QueueError::InvalidOption {
            name: "dedup window",
            value: format!("{window_ms} ms"),
            allowed: format!("1..={DEDUP_WINDOW_MS_MAX} ms"),
        });
    }
    Ok(())
}

/// Refuses jobs carrying a dedup id in a plain enqueue: they go through
/// [`crate::RunJobs::enqueue_dedup`], which checks the id.
pub fn refuse_dedup_ids(jobs: &[NewJob]) -> Result<(), QueueError> {
    match jobs.iter().find(|j| j.dedup_id.is_some()) {
        Some(j) => Err(QueueError::InvalidDedupId {
            key: cut_at_char(&j.key, 64).to_string(),
            id: shown_key(cut_at_char(j.dedup_id.as_deref().unwrap_or(""), 64)),
            reason: "a job with a dedup id goes through enqueue_dedup, not enqueue".into(),
        }),
        None => Ok(()),
    }
}

/// A dedup record: job `job` of shard `shard` was enqueued as `(key, id)`,
/// remembered until `expires_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupRecord {
    /// The job's key.
    pub key: String,
    /// The dedup id.
    pub id: String,
    /// Shard that stored the job (another shard than the record's after a move).
    pub shard: String,
    /// The job's id on `shard`.
    pub job: JobId,
    /// Forgotten at this time (ms since the epoch).
    pub expires_ms: u64,
}

/// What [`crate::RunJobs::enqueue_dedup`] did with one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The job's id: the new job, or for a duplicate the one it was enqueued as.
    pub id: JobId,
    /// Shard holding `id` (for a duplicate, maybe another shard after a move).
    pub shard: String,
    /// True when the job was not stored: its `(key, dedup_id)` was.
    pub duplicate: bool,
}

/// Checks a routing key. The grammar: 1 to [`KEY_BYTES_MAX`] bytes of
/// UTF-8 without control characters, line separators or invisible
/// formatting characters ([`is_unshowable`]), so that a key can never end
/// a line, a field or a terminal sequence where it is shown, nor look like
/// another key.
pub fn validate_key(key: &str) -> Result<(), QueueError> {
    if key.is_empty() {
        return Err(QueueError::InvalidKey {
            key: String::new(),
            reason: "a key must not be empty".into(),
        });
    }
    if key.len() > KEY_BYTES_MAX {
        return Err(QueueError::InvalidKey {
            key: format!("{}...", cut_at_char(key, 32)),
            reason: format!(
                "a key is at most {KEY_BYTES_MAX} bytes, this one has {}",
                key.len()
            ),
        });
    }
    if !key.is_ascii() && starts_with_mark(key) {
        let c = key.chars().next().unwrap_or_default();
        return Err(QueueError::InvalidKey {
            key: shown_key(cut_at_char(key, 64)),
            reason: format!(
                "a key does not start with a combining mark; this one starts with U+{:04X}",
                c as u32
            ),
        });
    }
    if !has_unshowable(key) {
        return Ok(());
    }
    if let Some((at, c)) = key.char_indices().find(|(_, c)| is_unshowable(*c)) {
        return Err(QueueError::InvalidKey {
            key: cut_at_char(key, 64).to_string(),
            reason: format!(
                "a key holds no control character, line separator or invisible formatting character; this one has {:?} (U+{:04X}) at byte {at}",
                c, c as u32
            ),
        });
    }
    Ok(())
}

/// A key as shown to a person: itself when printable, otherwise with its
/// unshowable characters ([`is_unshowable`]) escaped as `\u{...}` (a key stored before the grammar
/// refused them may hold some).
pub fn shown_key(key: &str) -> String {
    if has_unshowable(key) {
        key.chars()
            .map(|c| {
                if is_unshowable(c) {
                    c.escape_unicode().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect()
    } else {
        key.to_string()
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character
/// boundary.
pub fn cut_at_char(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A job handed to a worker by [`crate::RunJobs::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedJob {
    /// Shard the job lives on.
    pub shard: String,
    /// The job's id within the shard.
    pub id: JobId,
    /// Routing key.
    pub key: String,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    /// Attempts allowed before dead-lettering.
    pub max_attempts: u32,
    /// When the job was enqueued (ms since the Unix epoch).
    pub created_ms: u64,
    /// Earliest start the job asked for (ms since the Unix epoch).
    pub not_before_ms: u64,
    /// This run's fencing token: larger than the fence of every earlier run
    /// of the same key, across attempts, owners, rebalances and store
    /// restarts (see [`crate::backend`]). A handler can make its own writes
    /// conditional on it (`UPDATE ... WHERE fence < $this`), so a stale
    /// runner's late write loses.
    pub fence: u64,
    /// When this run's job lease ends (ms, on the backend's clock) unless it
    /// is extended with [`crate::RunJobs::extend`].
    pub lease_until_ms: u64,
    /// The dedup id the job was enqueued with, if any: the handler's own
    /// idempotency key, and the schedule and tick of a scheduled job
    /// ([`crate::schedule::ScheduleTick::of_dedup_id`]). Kept through
    /// retries and moves.
    pub dedup_id: Option<String>,
}

impl ClaimedJob {
    /// The receipt that finishes this run.
    pub fn receipt(&self) -> Receipt {
        Receipt {
            id: self.id,
            fence: self.fence,
        }
    }
}

/// Names one run of one job: what [`crate::RunJobs::ack`], `fail` and
/// `extend` finish or prolong. A receipt is valid only while its run is the
/// job's current run; any other receipt is refused and changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Receipt {
    /// The job.
    pub id: JobId,
    /// The run's fencing token ([`ClaimedJob::fence`]).
    pub fence: u64,
}

impl fmt::Display for Receipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.id.0, self.fence)
    }
}

impl std::str::FromStr for Receipt {
    type Err = String;

    /// Parses `ID.FENCE`, as [`Receipt`]'s `Display` writes it.
    fn from_str(s: &str) -> Result<Receipt, String> {
        let bad = || format!("invalid receipt {s:?}: expected ID.FENCE (two decimal numbers)");
        let (id, fence) = s.split_once('.').ok_or_else(bad)?;
        Ok(Receipt {
            id: JobId(id.parse().map_err(|_| bad())?),
            fence: fence.parse().map_err(|_| bad())?,
        })
    }
}

/// What [`crate::RunJobs::ack`] did with a batch of receipts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AckOutcome {
    /// Runs finished by this call.
    pub acked: u64,
    /// Receipts refused because they are not their job's current run (late,
    /// lapsed or already finished); nothing was changed for them.
    pub stale: Vec<Receipt>,
}

/// The next fence a shard issues: at least the backend clock in
/// microseconds, above the last fence it issued and at least the floor a
/// rebalance raised it to. Time makes fences grow across a store that lost
/// its counter; the counter makes them grow when the clock steps back.
pub fn next_fence(now_us: u64, last_issued: u64, floor: u64) -> u64 {
    now_us.max(last_issued.saturating_add(1)).max(floor)
}

/// Default job lease (30 s): how long a claimed run stays the job's run
/// without an [`crate::RunJobs::extend`]. A lapsed run's job goes back
/// to the head of its key with attempt + 1.
pub const JOB_LEASE_MS_DEFAULT: u64 = 30_000;
/// Shortest job lease accepted (100 ms).
pub const JOB_LEASE_MS_MIN: u64 = 100;
/// Longest job lease accepted (one day); longer jobs extend theirs.
pub const JOB_LEASE_MS_MAX: u64 = 24 * 3600 * 1000;

/// Shortest job timeout accepted (`work --job-timeout-ms`, a claim's
/// `timeout_ms`), in ms.
pub const JOB_TIMEOUT_MS_MIN: u64 = 1;
/// Longest job timeout accepted (7 days).
pub const JOB_TIMEOUT_MS_MAX: u64 = 7 * 24 * 3600 * 1000;

/// Checks a job timeout against [`JOB_TIMEOUT_MS_MIN`]..=[`JOB_TIMEOUT_MS_MAX`].
pub fn validate_job_timeout_ms(ms: u64) -> Result<(), QueueError> {
    if !(JOB_TIMEOUT_MS_MIN..=JOB_TIMEOUT_MS_MAX).contains(&ms) {
        return Err(QueueError::InvalidOption {
            name: "job timeout",
            value: format!("{ms} ms"),
            allowed: format!("{JOB_TIMEOUT_MS_MIN}..={JOB_TIMEOUT_MS_MAX} ms"),
        });
    }
    Ok(())
}

/// Checks a job lease length against [`JOB_LEASE_MS_MIN`]..=[`JOB_LEASE_MS_MAX`].
pub fn validate_job_lease_ms(lease_ms: u64) -> Result<(), QueueError> {
    if !(JOB_LEASE_MS_MIN..=JOB_LEASE_MS_MAX).contains(&lease_ms) {
        return Err(QueueError::InvalidOption {
            name: "job lease",
            value: format!("{lease_ms} ms"),
            allowed: format!("{JOB_LEASE_MS_MIN}..={JOB_LEASE_MS_MAX} ms"),
        });
    }
    Ok(())
}

/// What happened to a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailOutcome {
    /// The job runs again, before any later job of its key, not before `at_ms`.
    Retry {
        /// Earliest start of the next attempt.
        at_ms: u64,
    },
    /// Out of attempts: the job is on the dead-letter list.
    Dead,
}

/// What a key does after one of its jobs is dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadPolicy {
    /// Later jobs of the key keep running (the default).
    #[default]
    Continue,
    /// The key stops until its dead jobs are retried or purged.
    Halt,
}

/// Per-key counts; drain-then-switch waits until both are zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KeyCounts {
    /// Jobs of the key not yet started or waiting for a retry (ready or delayed).
    pub depth: u64,
    /// Jobs of the key claimed by a worker and not yet acked or failed (0 or 1).
    pub in_flight: u64,
    /// Dead-lettered jobs of the key.
    pub dead: u64,
}

/// Per-shard counts for `status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardStats {
    /// Shard name.
    pub name: String,
    /// Pending jobs whose start time has come.
    pub ready: u64,
    /// Pending jobs waiting for their start time (delayed jobs and retries).
    pub delayed: u64,
    /// Claimed jobs without an ack or failure yet.
    pub in_flight: u64,
    /// Dead-lettered jobs.
    pub dead: u64,
    /// Distinct keys with pending, in-flight or dead jobs.
    pub keys: u64,
    /// The largest run fence this shard has issued (0 if none).
    #[serde(default)]
    pub fence_high: u64,
}

/// A job on the dead-letter list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadJob {
    /// Shard the job lives on.
    pub shard: String,
    /// The job's id.
    pub id: JobId,
    /// Routing key.
    pub key: String,
    /// Attempts made.
    pub attempts: u32,
    /// Reason given by the last failed attempt.
    pub reason: String,
    /// When each attempt started (ms since the epoch), oldest first; empty
    /// where the backend did not see them start (a job moved with its key
    /// keeps its attempt count, not their times).
    pub attempt_starts_ms: Vec<u64>,
}

/// Where a live job stands, as [`crate::InspectJobs::job`] shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting its turn in its key, due now.
    Queued,
    /// Waiting for its start time (a delay, or a retry's backoff).
    Delayed,
    /// A run of it is in flight.
    Running,
    /// Out of attempts, on the dead-letter list.
    Dead,
}

/// One live job (queued, delayed, running or dead), as an operator reads it.
/// A job that finished (acked, cancelled, purged, or moved away with its
/// key) is not live: its backend answers `None` for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInfo {
    /// The job's id on its shard.
    pub id: JobId,
    /// Routing key.
    pub key: String,
    /// Where it stands.
    pub state: JobState,
    /// Attempts made and finished (a run in flight is attempt + 1).
    pub attempts: u32,
    /// Attempt limit.
    pub max_attempts: u32,
    /// Enqueue time (ms since the epoch).
    pub created_ms: u64,
    /// Earliest start of its next attempt (ms since the epoch).
    pub not_before_ms: u64,
    /// The run in flight: its fence and job lease deadline.
    pub run: Option<(u64, u64)>,
    /// Reason given by the last failed attempt, if any.
    pub reason: Option<String>,
    /// When each attempt started (ms since the epoch), oldest first, the
    /// run in flight's included; empty where the backend did not see them
    /// start (a job moved with its key keeps its attempt count only).
    pub attempt_starts_ms: Vec<u64>,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// The dedup id it was enqueued with, if any.
    pub dedup_id: Option<String>,
}

/// How a finished job ended, as [`FinishedJob`] records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// A run of it was acked.
    Completed,
    /// It was cancelled (`job cancel`, `DELETE /v1/jobs/{id}`) before or
    /// while it ran.
    Cancelled,
}

/// A job that finished, kept for a while so that an operator can see what
/// happened to it ([`crate::InspectJobs::finished`]; the retention is
/// [`Retention`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinishedJob {
    /// The job's id on its shard.
    pub id: JobId,
    /// Routing key.
    pub key: String,
    /// How it ended.
    pub outcome: Finish,
    /// Attempts started (0 for a job cancelled before it ran).
    pub attempts: u32,
    /// When it finished (ms since the epoch, the backend's clock).
    pub finished_ms: u64,
    /// When each attempt started, oldest first (as [`JobInfo`] keeps them;
    /// empty where the backend did not see them start).
    pub attempt_starts_ms: Vec<u64>,
    /// The reason of its last failed attempt, if one failed.
    pub reason: Option<String>,
    /// What its handler returned with its ack (a completed job only; at
    /// most [`RESULT_BYTES_MAX`]). Stored as base64 where a finished job
    /// is written as JSON.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "result_base64"
    )]
    pub result: Option<Vec<u8>>,
}

/// A result's bytes as one base64 string in JSON.
mod result_base64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        match Option::<String>::deserialize(d)? {
            Some(t) => base64::engine::general_purpose::STANDARD
                .decode(t)
                .map(Some)
                .map_err(serde::de::Error::custom),
            None => Ok(None),
        }
    }
}

/// Most bytes of one job's result ([`FinishedJob::result`]): 64 KiB. A
/// handler that returns more fails its attempt with a reason that says
/// so ([`check_result`]); a result is kept with the finished job for the
/// shard's [`Retention`], so its bound bounds what the retention holds.
pub const RESULT_BYTES_MAX: usize = 64 * 1024;

/// Refuses a result over [`RESULT_BYTES_MAX`] (or over a smaller `max`
/// the caller set), naming both sizes: the reason its attempt fails with.
pub fn check_result(result: &[u8], max: usize) -> Result<(), String> {
    let max = max.min(RESULT_BYTES_MAX);
    if result.len() > max {
        return Err(format!(
            "the handler's result is {} bytes, over the {max}-byte bound on results",
            result.len()
        ));
    }
    Ok(())
}

/// The checks of [`crate::RunJobs::ack_results`]' arguments, for every
/// backend: `results` empty or one per receipt, each within
/// [`RESULT_BYTES_MAX`].
pub fn check_ack_results(
    receipts: &[Receipt],
    results: &[Option<Vec<u8>>],
) -> Result<(), QueueError> {
    if !results.is_empty() && results.len() != receipts.len() {
        return Err(QueueError::InvalidOption {
            name: "results",
            value: format!("{} for {} receipts", results.len(), receipts.len()),
            allowed: "none, or one per receipt".into(),
        });
    }
    for r in results.iter().flatten() {
        if r.len() > RESULT_BYTES_MAX {
            return Err(QueueError::InvalidOption {
                name: "result",
                value: format!("{} bytes", r.len()),
                allowed: format!("at most {RESULT_BYTES_MAX} bytes"),
            });
        }
    }
    Ok(())
}

/// The result given for receipt `i` of an ack, if any.
pub fn result_at(results: &[Option<Vec<u8>>], i: usize) -> Option<Vec<u8>> {
    results.get(i).cloned().flatten()
}

/// Most finished jobs a shard keeps ([`Retention::finished_jobs`]).
pub const FINISHED_JOBS_KEPT_MAX: usize = 100_000;
/// Default of [`Retention::finished_jobs`].
pub const FINISHED_JOBS_KEPT_DEFAULT: usize = 1000;
/// Default of [`Retention::finished_age_ms`] (one day).
pub const FINISHED_AGE_MS_DEFAULT: u64 = 86_400_000;
/// Most attempt start times a [`FinishedJob`] keeps (the last ones).
pub const FINISHED_STARTS_KEPT: usize = 16;

/// How long finished jobs are kept per shard, for
/// [`crate::InspectJobs::finished`]: the newest `finished_jobs` of them,
/// none older than `finished_age_ms`. Then they are forgotten (compacted
/// away). `finished_jobs: 0` keeps none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Retention {
    /// Newest finished jobs kept per shard (0 to [`FINISHED_JOBS_KEPT_MAX`]).
    pub finished_jobs: usize,
    /// Oldest a kept finished job may be, in ms (1 to [`DELAY_MS_MAX`]).
    pub finished_age_ms: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            finished_jobs: FINISHED_JOBS_KEPT_DEFAULT,
            finished_age_ms: FINISHED_AGE_MS_DEFAULT,
        }
    }
}

impl Retention {
    /// Checks both fields, naming the one out of range and its value.
    pub fn validate(&self) -> Result<(), QueueError> {
        if self.finished_jobs > FINISHED_JOBS_KEPT_MAX {
            return Err(QueueError::InvalidOption {
                name: "finished jobs kept",
                value: self.finished_jobs.to_string(),
                allowed: format!("0 to {FINISHED_JOBS_KEPT_MAX} per shard"),
            });
        }
        if self.finished_age_ms == 0 || self.finished_age_ms > DELAY_MS_MAX {
            return Err(QueueError::InvalidOption {
                name: "finished job age",
                value: format!("{} ms", self.finished_age_ms),
                allowed: format!("1 to {DELAY_MS_MAX} ms"),
            });
        }
        Ok(())
    }

    /// Whether a job finished at `finished_ms` is still kept at `now_ms`.
    pub fn keeps(&self, finished_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(finished_ms) <= self.finished_age_ms
    }
}

/// Most live jobs one [`crate::InspectJobs::key_jobs`] call returns.
pub const KEY_JOBS_MAX: usize = 1000;

/// What [`crate::InspectJobs::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CancelOutcome {
    /// The job was queued, delayed or dead, and is deleted: it never runs
    /// (again).
    Cancelled,
    /// A run of it is in flight; nothing changed. Its run must end first
    /// (an ack, a fail, or its job lease lapsing). A backend that can stop
    /// a run answers [`CancelOutcome::Stopping`] instead.
    Running,
    /// A run of it is in flight and is asked to stop: from now its results
    /// (ack, fail, extend) are refused as stale and
    /// [`crate::RunJobs::stale_runs`] names it, so its worker stops the
    /// handler within about a second ([`crate::pool::CANCEL_CHECK_MS`]).
    /// The job is deleted, never retried, when the run ends: the refused
    /// failure its worker sends once the handler is gone, else its job
    /// lease lapsing. The key's next job starts only then, so no two runs
    /// of the key overlap.
    Stopping,
    /// Its key is moving to another shard, which may already hold a copy
    /// of the job; nothing changed. Cancel it again once the move is done
    /// (on the key's new shard).
    Moving,
    /// No live job has that id (it finished, was cancelled, moved away with
    /// its key, or never existed).
    NotFound,
}

/// Most keys moved away whose job ids a shard remembers
/// ([`MovedAway`]): the oldest are forgotten first.
pub const MOVED_KEYS_KEPT: usize = 4096;
/// Most job ids of keys moved away a shard remembers, over all its keys
/// (8 bytes each; a single key's move is remembered whole even above it).
pub const MOVED_IDS_KEPT: usize = 2_000_000;

/// The job ids a shard deleted when their keys moved away (their copies
/// run on each key's new shard), so that an id from before a move still
/// answers where it went: for each of the last [`MOVED_KEYS_KEPT`] purges,
/// at most [`MOVED_IDS_KEPT`] ids in all, the key and its ids.
#[derive(Debug, Clone, Default)]
pub struct MovedAway {
    purges: std::collections::VecDeque<(Box<str>, Box<[u64]>)>,
    ids: usize,
}

impl MovedAway {
    /// Remembers that `ids` of `key` left with it; forgets the oldest
    /// purges beyond the bounds.
    pub fn note(&mut self, key: &str, mut ids: Vec<u64>) {
        if ids.is_empty() {
            return;
        }
        ids.sort_unstable();
        self.ids += ids.len();
        self.purges.push_back((key.into(), ids.into_boxed_slice()));
        while self.purges.len() > 1
            && (self.purges.len() > MOVED_KEYS_KEPT || self.ids > MOVED_IDS_KEPT)
        {
            if let Some((_, old)) = self.purges.pop_front() {
                self.ids -= old.len();
            }
        }
    }

    /// The key job `id` left with, if remembered.
    pub fn key_of(&self, id: u64) -> Option<&str> {
        self.purges
            .iter()
            .rev()
            .find(|(_, ids)| ids.binary_search(&id).is_ok())
            .map(|(k, _)| &**k)
    }
}

/// One import [`MovedIn`] remembers: the shard copied from, and (source
/// id, new id) per job, by source id.
type Import = (Box<str>, Box<[(u64, u64)]>);

/// The jobs a shard stored as copies of other shards' jobs (a move's
/// imports), so that an id from before a move still finds its copy: for
/// each of the last [`MOVED_KEYS_KEPT`] imports, at most [`MOVED_IDS_KEPT`]
/// jobs in all, the shard copied from and (source id, new id) per job.
#[derive(Debug, Clone, Default)]
pub struct MovedIn {
    imports: std::collections::VecDeque<Import>,
    ids: usize,
}

impl MovedIn {
    /// Remembers that the jobs `pairs` (source id, new id) came from
    /// `from`; forgets the oldest imports beyond the bounds.
    pub fn note(&mut self, from: &str, mut pairs: Vec<(u64, u64)>) {
        if pairs.is_empty() {
            return;
        }
        pairs.sort_unstable();
        self.ids += pairs.len();
        self.imports
            .push_back((from.into(), pairs.into_boxed_slice()));
        while self.imports.len() > 1
            && (self.imports.len() > MOVED_KEYS_KEPT || self.ids > MOVED_IDS_KEPT)
        {
            if let Some((_, old)) = self.imports.pop_front() {
                self.ids -= old.len();
            }
        }
    }

    /// The id of the copy of job `source_id` of shard `from`, if
    /// remembered.
    pub fn new_id_of(&self, from: &str, source_id: u64) -> Option<u64> {
        self.imports
            .iter()
            .rev()
            .filter(|(f, _)| &**f == from)
            .find_map(|(_, pairs)| {
                pairs
                    .binary_search_by_key(&source_id, |&(src, _)| src)
                    .ok()
                    .map(|i| pairs[i].1)
            })
    }
}

/// What a shard accepts, set by resharding (drain-then-switch).
///
/// An enqueue carries the map version it routed with. A shard refuses it with
/// [`QueueError::Fenced`] when that version is older than
/// `map_version_min` (the producer must reload the map and route again), and
/// with [`QueueError::Paused`] when the key is paused (the producer retries
/// later; the key is being moved).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fence {
    /// Oldest map version whose routing this shard still trusts.
    pub map_version_min: u64,
    /// Keys whose enqueues are refused on this shard: a key also in
    /// `sealed_keys` is *frozen* (its backlog has moved; its enqueues are
    /// sent on with [`QueueError::Moved`]), any other is paused
    /// ([`QueueError::Paused`]: retry shortly).
    pub paused_keys: BTreeSet<String>,
    /// The smallest run fence this shard may issue: a rebalance raises it
    /// above the fences of the shards a key moved from, so a key's fences
    /// keep growing when it changes shard.
    pub run_fence_min: u64,
    /// Keys being moved away, each with the shard its backlog goes to: no
    /// run of theirs starts here (claims pass them by), while their
    /// enqueues are still taken. Set by a rebalance before it copies a
    /// key's backlog and cleared once the copies here are deleted; a rerun
    /// finishes every transfer listed (see `reshard`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sealed_keys: BTreeMap<String, String>,
}

/// A job copied from one shard to another with its key (a move that takes
/// the backlog along): everything a run of it needs, as its old shard held it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovedJob {
    /// Its id on the shard it comes from (the copy's order and the
    /// import's idempotency follow it).
    pub id: JobId,
    /// Enqueue time.
    pub created_ms: u64,
    /// Earliest start (its delay, or its retry's backoff, kept).
    pub not_before_ms: u64,
    /// Attempts already made.
    pub attempt: u32,
    /// Attempt limit.
    pub max_attempts: u32,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// `Some(reason)` for a dead letter.
    pub dead: Option<String>,
    /// The dedup id it was enqueued with, if any (the copy keeps it, so a
    /// scheduled job still names its schedule and tick after a move).
    pub dedup_id: Option<String>,
}

impl Fence {
    /// Checks one enqueue against the fence.
    pub fn check(&self, shard: &str, map_version: u64, key: &str) -> Result<(), QueueError> {
        if map_version < self.map_version_min {
            return Err(QueueError::Fenced {
                shard: shard.to_string(),
                key: key.to_string(),
                map_version,
                map_version_min: self.map_version_min,
            });
        }
        if self.paused_keys.contains(key) {
            if let Some(to) = self.sealed_keys.get(key) {
                return Err(QueueError::Moved {
                    shard: shard.to_string(),
                    key: key.to_string(),
                    to: to.clone(),
                });
            }
            return Err(QueueError::Paused {
                shard: shard.to_string(),
                key: key.to_string(),
            });
        }
        Ok(())
    }

    /// Whether `key` is frozen here: sealed for a move and paused, which
    /// means its whole backlog is on the shard it moves to, and its
    /// enqueues are sent there ([`QueueError::Moved`]).
    pub fn is_frozen(&self, key: &str) -> bool {
        self.paused_keys.contains(key) && self.sealed_keys.contains_key(key)
    }

    /// Lifts `key`'s seal and, with it, its freeze: the end of its move.
    pub fn unseal(&mut self, key: &str) {
        if self.sealed_keys.remove(key).is_some() {
            self.paused_keys.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys holding a format character (any of category Cf, not a fixed
    /// list), a blank or a leading combining mark are refused by name;
    /// ordinary letters of every script, marks after a letter, emoji and
    /// spaces are not.
    #[test]
    fn invisible_blank_and_lone_mark_keys_are_refused() {
        for (key, what) in [
            ("a\u{00AD}b", "U+00AD"),
            ("tenant\u{E0061}", "U+E0061"),
            ("x\u{FFF9}y", "U+FFF9"),
            ("\u{3164}", "U+3164"),
            ("a\u{2800}", "U+2800"),
            ("\u{0301}abc", "U+0301"),
            ("id\u{200D}", "U+200D"),
            ("k\u{1B}[2J", "U+001B"),
        ] {
            let e = validate_key(key).unwrap_err().to_string();
            assert!(e.contains(what), "{key:?}: {e}");
        }
        for key in [
            "tenant-1",
            "テナント",
            "e\u{0301}cole",
            "ünïcode",
            "a b",
            "🙂",
            "имя",
        ] {
            validate_key(key).unwrap_or_else(|e| panic!("{key:?}: {e}"));
        }
        assert!(validate_dedup_id("k", "a\u{00AD}").is_err());
        assert!(crate::flow::validate_group_name("g\u{E0061}").is_err());
    }

    #[test]
    fn the_ascii_fast_path_agrees_with_every_character() {
        // Every ASCII character, alone and inside text, and some others.
        for b in 0u8..=0x7f {
            let c = char::from(b);
            for s in [c.to_string(), format!("ab{c}cd")] {
                assert_eq!(has_unshowable(&s), is_unshowable(c), "{s:?}");
            }
        }
        for s in ["ä\u{200B}", "ä", "\u{FEFF}x", "x\u{85}"] {
            assert_eq!(has_unshowable(s), s.chars().any(is_unshowable), "{s:?}");
        }
    }

    #[test]
    fn the_key_grammar_refuses_control_characters() {
        for ok in ["t-1", "tenant/ä/🦀", "a b", "{user1000}.following"] {
            assert!(validate_key(ok).is_ok(), "{ok:?}");
        }
        for bad in [
            "a\0b",
            "line\nfake",
            "tab\there",
            "\u{1b}[2J",
            "del\u{7f}",
            "c1\u{85}",
        ] {
            let e = validate_key(bad).unwrap_err().to_string();
            assert!(e.contains("control character"), "{bad:?}: {e}");
            assert!(
                !e.contains('\u{1b}') && !e.contains('\n'),
                "the message is escaped: {e:?}"
            );
        }
        assert_eq!(shown_key("plain"), "plain");
        assert_eq!(shown_key("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(shown_key("ä\u{202E}b"), "ä\\u{202e}b");
    }

    fn check(job: NewJob, max: usize, expect_err: Option<&str>) {
        match (job.validate(max), expect_err) {
            (Ok(()), None) => {}
            (Err(e), Some(needle)) => {
                assert!(e.to_string().contains(needle), "{e} lacks {needle}")
            }
            (got, want) => panic!("got {got:?}, want error containing {want:?}"),
        }
    }

    #[test]
    fn validation_names_the_value() {
        check(NewJob::new("k", "p"), 10, None);
        check(NewJob::new("", "p"), 10, Some("must not be empty"));
        check(NewJob::new("x".repeat(1025), "p"), 10, Some("1025"));
        check(NewJob::new("x".repeat(1024), "p"), 10, None);
        check(NewJob::new("k", vec![0; 11]), 10, Some("11 bytes"));
        let mut j = NewJob::new("k", "p");
        j.max_attempts = 0;
        check(j, 10, Some("max attempts 0"));
        let mut j = NewJob::new("k", "p");
        j.delay_ms = u64::MAX;
        check(j, 10, Some("delay"));
    }

    #[test]
    fn fence_refuses_old_versions_and_paused_keys() {
        let mut f = Fence {
            map_version_min: 3,
            ..Fence::default()
        };
        f.paused_keys.insert("t-42".into());
        assert!(f.check("s", 3, "a").is_ok());
        assert!(matches!(
            f.check("s", 2, "a"),
            Err(QueueError::Fenced { .. })
        ));
        assert!(matches!(
            f.check("s", 3, "t-42"),
            Err(QueueError::Paused { .. })
        ));
    }
}

/// How the delays of a job's retries grow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackoffKind {
    /// `base_ms * 2^(attempt-1)`, capped at `max_ms`.
    #[default]
    Exponential,
    /// `base_ms` after every failed attempt.
    Fixed,
}

/// A deployment's retry backoff: the delay before the attempt after a
/// failed one (a handler that names its own delay, `retry_in_ms`, overrides
/// it). `jitter_pct` takes up to that share off each delay, the same for a
/// given run (so a crash replay agrees) and spread across jobs, so jobs
/// that failed together do not all come back at once. A job's number of
/// attempts is its own `max_attempts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Backoff {
    /// Delay after the first failed attempt (every one, when fixed).
    pub base_ms: u64,
    /// Longest delay.
    pub max_ms: u64,
    /// Exponential or fixed.
    #[serde(default)]
    pub kind: BackoffKind,
    /// Up to this percentage taken off each delay (0 to 100).
    #[serde(default)]
    pub jitter_pct: u8,
}

/// Default first retry delay (10 s): a job of the default five attempts
/// keeps being tried for about two and a half minutes (10 + 20 + 40 + 80 s,
/// less the jitter), near Celery's default of three retries three minutes
/// apart, so a short outage downstream does not dead-letter its work.
pub const BACKOFF_BASE_MS_DEFAULT: u64 = 10_000;
/// Default longest retry delay (1 h), reached at the ninth failure.
pub const BACKOFF_MAX_MS_DEFAULT: u64 = 3_600_000;
/// Default jitter (up to 20% off each wait), so jobs that failed together
/// (one outage) come back spread out.
pub const BACKOFF_JITTER_PCT_DEFAULT: u8 = 20;

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base_ms: BACKOFF_BASE_MS_DEFAULT,
            max_ms: BACKOFF_MAX_MS_DEFAULT,
            kind: BackoffKind::Exponential,
            jitter_pct: BACKOFF_JITTER_PCT_DEFAULT,
        }
    }
}

impl Backoff {
    /// Delay before the attempt after `failed_attempt` (from 1), jitter
    /// left out.
    pub fn delay_ms(&self, failed_attempt: u32) -> u64 {
        match self.kind {
            BackoffKind::Fixed => self.base_ms.min(self.max_ms),
            BackoffKind::Exponential => {
                let shift = failed_attempt.saturating_sub(1).min(40);
                self.base_ms.saturating_mul(1u64 << shift).min(self.max_ms)
            }
        }
    }

    /// [`Backoff::delay_ms`] with the jitter of run `seed` (a job's id and
    /// run fence mixed): up to `jitter_pct` percent less.
    pub fn delay_for(&self, failed_attempt: u32, seed: u64) -> u64 {
        let d = self.delay_ms(failed_attempt);
        d - (d as u128 * self.jitter_share(seed) as u128 / JITTER_SCALE as u128) as u64
    }

    /// The share of a delay the jitter of run `seed` takes off, in
    /// millionths (0 to `jitter_pct` * 10,000): what the Redis scripts get.
    pub fn jitter_share(&self, seed: u64) -> u64 {
        // splitmix64: a well-spread 64-bit value from the seed.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let pct = u64::from(self.jitter_pct.min(100));
        // z / 2^64 of pct percent, in millionths.
        ((z as u128 * (pct * JITTER_SCALE / 100) as u128) >> 64) as u64
    }

    /// Checks every field, naming the one out of range and its value.
    pub fn validate(&self) -> Result<(), QueueError> {
        if self.base_ms == 0 || self.base_ms > DELAY_MS_MAX {
            return Err(QueueError::InvalidOption {
                name: "retry base",
                value: format!("{} ms", self.base_ms),
                allowed: format!("1 to {DELAY_MS_MAX} ms"),
            });
        }
        if self.max_ms < self.base_ms || self.max_ms > DELAY_MS_MAX {
            return Err(QueueError::InvalidOption {
                name: "retry max",
                value: format!("{} ms", self.max_ms),
                allowed: format!("{} (the base) to {DELAY_MS_MAX} ms", self.base_ms),
            });
        }
        if self.jitter_pct > 100 {
            return Err(QueueError::InvalidOption {
                name: "retry jitter",
                value: format!("{}%", self.jitter_pct),
                allowed: "0 to 100%".into(),
            });
        }
        Ok(())
    }
}

/// The jitter seed of a run: its job id and fence mixed.
pub fn run_seed(receipt: Receipt) -> u64 {
    receipt.id.0 ^ receipt.fence.rotate_left(32)
}

/// The scale of [`Backoff::jitter_share`]: millionths.
pub const JITTER_SCALE: u64 = 1_000_000;

#[cfg(test)]
mod backoff_tests {
    use super::Backoff;

    #[test]
    fn backoff_doubles_and_caps() {
        let b = Backoff {
            base_ms: 10,
            max_ms: 100,
            ..Backoff::default()
        };
        let got: Vec<u64> = (1..=6).map(|a| b.delay_ms(a)).collect();
        assert_eq!(got, [10, 20, 40, 80, 100, 100]);
        assert_eq!(b.delay_ms(u32::MAX), 100);
        let fixed = Backoff {
            kind: super::BackoffKind::Fixed,
            ..b
        };
        assert_eq!(fixed.delay_ms(5), 10);
    }

    /// Jitter only shortens a delay, by at most its share, the same for one
    /// run and spread over runs; none without it.
    #[test]
    fn jitter_stays_within_its_share_and_spreads() {
        let b = Backoff {
            base_ms: 10_000,
            max_ms: 10_000,
            jitter_pct: 20,
            ..Backoff::default()
        };
        let delays: Vec<u64> = (0..1000u64).map(|seed| b.delay_for(1, seed)).collect();
        assert!(
            delays.iter().all(|&d| (8_000..=10_000).contains(&d)),
            "{delays:?}"
        );
        let low = delays.iter().filter(|&&d| d < 9_000).count();
        assert!(
            (350..=650).contains(&low),
            "not spread: {low} of 1000 below 9 s"
        );
        assert_eq!(b.delay_for(1, 7), b.delay_for(1, 7));
        let none = Backoff { jitter_pct: 0, ..b };
        assert!((0..100).all(|s| none.delay_for(1, s) == 10_000));
        assert!(Backoff {
            jitter_pct: 101,
            ..b
        }
        .validate()
        .is_err());
        assert!(Backoff { max_ms: 5, ..b }.validate().is_err());
        assert!(Backoff { base_ms: 0, ..b }.validate().is_err());
        assert!(b.validate().is_ok());
    }
}
