//! Recurring schedules: a durable object that enqueues one job per tick.
//!
//! A [`Schedule`] names a key, a recurrence ([`When`]: a cron expression in
//! an IANA time zone, or a fixed interval anchored to a start), a payload
//! and policies. Schedules are a deployment setting (`schedules`, changed
//! by compare-and-set like every setting, so no acknowledged change is
//! lost), read again by every worker within [`SCHEDULE_RECHECK_MS`].
//!
//! **Who fires a tick.** No leader: each worker fires the schedules whose
//! key routes to a shard it owns ([`Scheduler::pass`]), so a schedule
//! follows its key through a rebalance and is run by whoever owns the
//! key's shard now.
//!
//! **Exactly one job per tick.** The job of tick `t` of schedule `id`
//! carries the dedup id `schedule:{id}@{t}` ([`tick_dedup_id`]) and is
//! enqueued with the schedule's dedup window ([`Schedule::dedup_window_ms`]:
//! its catch-up, its jitter and [`SCHEDULE_DEDUP_MARGIN_MS`], so as long
//! as the tick could be fired at all, plus a margin). The dedup
//! check is atomic with the append on every backend and dedup records move
//! with their key (the backend contract), so any number of fires of one
//! tick (a worker killed after the enqueue and before it recorded the
//! fire, two processes that both believe they own the shard, a stale map
//! sending the fire to the key's old shard, a backfill over fired ticks)
//! store one job. A worker records the ticks it decided in the
//! `schedule-state` setting ([`ScheduleState::decided_ms`], merged by
//! maximum, so concurrent writers never move it back) and keeps the same
//! cursor in memory: a tick at or below the cursor is never considered
//! again, whatever the clock does afterwards.
//!
//! **Catch-up.** A tick is due at `t + jitter(t)`. A tick found due more
//! than `catch_up_ms` after `t` (every worker was down) is not fired and is
//! counted in [`ScheduleState::missed`]; one within it fires as the
//! [`Overlap`] policy allows. The jitter of a tick is a fixed function of
//! the schedule id and `t`, so every process agrees on it.
//!
//! **Time.** Cron expressions are parsed by `croner` (five fields, or six
//! with seconds first; names of months and days; ranges, lists, steps)
//! and evaluated in the schedule's zone (`chrono-tz`, the IANA database).
//! At daylight-saving changes: a local time skipped by the spring-forward
//! change fires once, at the first instant after the gap (02:30 fires at
//! 03:00 when 02:00-03:00 does not exist); a local time that occurs twice
//! at the fall-back change fires once, at its first occurrence. An
//! interval (`every_ms`) is anchored: the Nth tick is `anchor + N x every`
//! (the anchor is the start time, else the Unix epoch), never the last
//! run plus the interval, so it does not drift.

mod runner;
mod ticks;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::QueueError;

pub use runner::{
    backfill, run_scheduler, trigger, Applied, FireReport, ScheduleStore, Scheduler,
    SchedulerOptions, KEY_CHANGE_GAP_MS,
};
pub use ticks::{parse_cron, parse_zone, Compiled};

/// Most schedules a deployment may hold.
pub const SCHEDULES_MAX: usize = 10_000;
/// Longest schedule id, in bytes.
pub const SCHEDULE_ID_BYTES_MAX: usize = 128;
/// Shortest interval of an `every` schedule (1 s).
pub const EVERY_MS_MIN: u64 = 1_000;
/// Longest interval of an `every` schedule (366 days).
pub const EVERY_MS_MAX: u64 = 366 * 24 * 3600 * 1000;
/// Default catch-up window (5 minutes): a tick found due later than this
/// after its time is counted missed, not fired.
pub const CATCH_UP_MS_DEFAULT: u64 = 5 * 60 * 1000;
/// Longest catch-up window (1 day).
pub const CATCH_UP_MS_MAX: u64 = 24 * 3600 * 1000;
/// Longest jitter (1 hour).
pub const JITTER_MS_MAX: u64 = 3600 * 1000;
/// How much longer than a tick can still be fired (its catch-up and
/// jitter) the dedup id of its job is remembered (10 minutes): room for a
/// process that fired it and stalled before recording it, and for a
/// recorded state put back to an older copy. The window is kept short
/// because every tick's record is kept that long: a 1 s schedule with the
/// default catch-up keeps about 900 records, a 1 min schedule 15.
pub const SCHEDULE_DEDUP_MARGIN_MS: u64 = 10 * 60 * 1000;
/// How often a worker reads the schedules again (a change takes effect
/// within this on every worker).
pub const SCHEDULE_RECHECK_MS: u64 = 1_000;
/// Most ticks one schedule fires in one pass (a backfill or an `all`
/// catch-up longer than this continues at the next pass).
pub const TICKS_PER_PASS_MAX: usize = 1_000;
/// Most ticks a backfill may ask for.
pub const BACKFILL_TICKS_MAX: usize = 10_000;
/// The deployment setting holding the schedules ([`Schedules`]).
pub const SETTING_SCHEDULES: &str = "schedules";
/// The deployment setting holding each schedule's fire state
/// ([`ScheduleStates`]).
pub const SETTING_SCHEDULE_STATE: &str = "schedule-state";
/// Format version of both schedule documents: a document of another
/// version is refused, naming both.
pub const SCHEDULES_VERSION: u64 = 1;

/// What a schedule does while the job of its previous tick is still live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// No tick while the previous job is queued, delayed or running (the
    /// default); of several ticks due at once only the newest fires.
    #[default]
    Skip,
    /// At most one job waiting: a tick fires while the previous job runs
    /// (the new one waits behind it in its key), not while it waits.
    One,
    /// Every tick fires.
    All,
}

impl Overlap {
    /// Parses `skip`, `one` or `all`.
    pub fn parse(s: &str) -> Result<Overlap, QueueError> {
        match s {
            "skip" => Ok(Overlap::Skip),
            "one" => Ok(Overlap::One),
            "all" => Ok(Overlap::All),
            _ => Err(QueueError::InvalidOption {
                name: "overlap",
                value: s.to_string(),
                allowed: "skip, one or all".into(),
            }),
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Overlap::Skip => "skip",
            Overlap::One => "one",
            Overlap::All => "all",
        }
    }
}

/// When a schedule ticks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum When {
    /// A cron expression evaluated in an IANA zone (`UTC` by default).
    Cron {
        /// The expression, as given.
        expr: String,
        /// The zone's IANA name.
        tz: String,
    },
    /// Every `every_ms`, anchored at the schedule's start (else the epoch).
    Every {
        /// The interval, in ms ([`EVERY_MS_MIN`]..=[`EVERY_MS_MAX`]).
        every_ms: u64,
    },
}

/// One recurring schedule, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// The key whose jobs it enqueues (and whose shard runs it).
    pub key: String,
    /// When it ticks.
    pub when: When,
    /// The payload of every job, as UTF-8 text.
    pub payload: String,
    /// What a tick does while the previous job is live.
    #[serde(default)]
    pub overlap: Overlap,
    /// How late a tick may still fire, in ms.
    pub catch_up_ms: u64,
    /// Largest delay added to a tick's fire (0..=[`JITTER_MS_MAX`]), the
    /// same for every process.
    #[serde(default)]
    pub jitter_ms: u64,
    /// No tick before this (ms since the epoch).
    #[serde(default)]
    pub start_ms: Option<u64>,
    /// No tick after this (ms since the epoch).
    #[serde(default)]
    pub end_ms: Option<u64>,
    /// Attempts of each job.
    pub max_attempts: u32,
    /// Paused: no tick fires.
    #[serde(default)]
    pub paused: bool,
    /// Ticks at or before this never fire (ms): the time the schedule was
    /// set or last resumed, so neither fires ticks of the past.
    pub since_ms: u64,
}

impl Schedule {
    /// How long the dedup id of one of its ticks' jobs is remembered: its
    /// catch-up, its jitter and [`SCHEDULE_DEDUP_MARGIN_MS`].
    pub fn dedup_window_ms(&self) -> u64 {
        self.catch_up_ms
            .saturating_add(self.jitter_ms)
            .saturating_add(SCHEDULE_DEDUP_MARGIN_MS)
    }

    /// Checks every field, naming the field and the value it refuses.
    pub fn validate(&self, id: &str) -> Result<(), QueueError> {
        validate_schedule_id(id)?;
        crate::job::validate_key(&self.key)?;
        Compiled::new(id, self)?;
        let bad = |name: &'static str, value: String, allowed: String| {
            Err(QueueError::InvalidOption {
                name,
                value,
                allowed,
            })
        };
        if self.catch_up_ms > CATCH_UP_MS_MAX {
            return bad(
                "catch-up",
                format!("{} ms", self.catch_up_ms),
                format!("0 to {CATCH_UP_MS_MAX} ms (1 day)"),
            );
        }
        if self.jitter_ms > JITTER_MS_MAX {
            return bad(
                "jitter",
                format!("{} ms", self.jitter_ms),
                format!("0 to {JITTER_MS_MAX} ms (1 hour)"),
            );
        }
        // Ticks fire in order: a tick waits for the one before it, which
        // may draw up to the whole jitter; with a jitter under the catch-up
        // no tick is ever found past its catch-up while workers run.
        if self.jitter_ms > self.catch_up_ms {
            return bad(
                "jitter",
                format!("{} ms", self.jitter_ms),
                format!("at most the catch-up ({} ms)", self.catch_up_ms),
            );
        }
        if let (Some(s), Some(e)) = (self.start_ms, self.end_ms) {
            if s > e {
                return bad(
                    "start",
                    format!("{s} ms (after the end, {e} ms)"),
                    "a time at or before the end".into(),
                );
            }
        }
        if self.max_attempts == 0 || self.max_attempts > crate::job::MAX_ATTEMPTS_LIMIT {
            return Err(QueueError::InvalidMaxAttempts {
                value: self.max_attempts,
                max: crate::job::MAX_ATTEMPTS_LIMIT,
            });
        }
        Ok(())
    }
}

/// Checks a schedule id: 1..=[`SCHEDULE_ID_BYTES_MAX`] bytes of ASCII
/// letters, digits and `-_.:`, so it fits in a dedup id, a URL path and a
/// file name alike.
pub fn validate_schedule_id(id: &str) -> Result<(), QueueError> {
    let ok = !id.is_empty()
        && id.len() <= SCHEDULE_ID_BYTES_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    if ok {
        return Ok(());
    }
    Err(QueueError::InvalidOption {
        name: "schedule id",
        value: format!("{id:?}"),
        allowed: format!("1 to {SCHEDULE_ID_BYTES_MAX} bytes of ASCII letters, digits and - _ . :"),
    })
}

/// The start of every dedup id a schedule's job carries. Producers'
/// own dedup ids may not start with it (the CLI and the server refuse
/// one), so a job that carries it was enqueued by a schedule.
pub const SCHEDULE_DEDUP_PREFIX: &str = "schedule:";

/// The dedup id of the job of tick `tick_ms` of schedule `id`.
pub fn tick_dedup_id(id: &str, tick_ms: u64) -> String {
    format!("{SCHEDULE_DEDUP_PREFIX}{id}@{tick_ms}")
}

/// The dedup id of a manual trigger of schedule `id` at `now_ms`.
pub fn trigger_dedup_id(id: &str, now_ms: u64) -> String {
    format!("{SCHEDULE_DEDUP_PREFIX}{id}!{now_ms}")
}

/// Refuses a producer's dedup id in the schedules' namespace
/// ([`SCHEDULE_DEDUP_PREFIX`]): a job enqueued with one would tell its
/// handler it came from a schedule.
pub fn refuse_schedule_dedup_id(id: &str) -> Result<(), QueueError> {
    if id.starts_with(SCHEDULE_DEDUP_PREFIX) {
        return Err(QueueError::InvalidOption {
            name: "dedup id",
            value: format!("{id:?}"),
            allowed: format!(
                "an id not starting with {SCHEDULE_DEDUP_PREFIX:?} (kept for the jobs of schedules)"
            ),
        });
    }
    Ok(())
}

/// The schedule and tick a scheduled job was enqueued for, read from its
/// dedup id: what a handler is told (`SHARDQ_SCHEDULE`,
/// `SHARDQ_SCHEDULE_TIME`, the `schedule` fields of a claim).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScheduleTick {
    /// The schedule's id.
    pub id: String,
    /// The tick (ms since the epoch), or the time of a manual trigger.
    pub tick_ms: u64,
    /// Whether an operator triggered it (`schedule trigger`) rather than a
    /// tick (a backfilled tick is a tick).
    pub triggered: bool,
}

impl ScheduleTick {
    /// The tick a job's dedup id names, if it is a schedule's.
    pub fn of_dedup_id(dedup_id: &str) -> Option<ScheduleTick> {
        let rest = dedup_id.strip_prefix(SCHEDULE_DEDUP_PREFIX)?;
        // Schedule ids hold neither `@` nor `!`: the last one splits.
        let at = rest.rfind(['@', '!'])?;
        let (id, ms) = (&rest[..at], &rest[at + 1..]);
        validate_schedule_id(id).ok()?;
        if ms.is_empty() || !ms.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(ScheduleTick {
            id: id.to_string(),
            tick_ms: ms.parse().ok()?,
            triggered: rest.as_bytes()[at] == b'!',
        })
    }
}

/// Every schedule of a deployment, by id (the `schedules` setting).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedules {
    /// The schedules.
    #[serde(default)]
    pub schedules: BTreeMap<String, Schedule>,
}

impl Schedules {
    /// Checks every schedule and the bound on their number.
    pub fn validate(&self) -> Result<(), QueueError> {
        self.validate_changes(&Schedules::default())
    }

    /// Parses the stored text (with its `version`), checked.
    pub fn parse(text: &str) -> Result<Schedules, QueueError> {
        let s = Schedules::read(text)?;
        s.validate()?;
        Ok(s)
    }

    /// Parses the stored text (with its `version`) without checking each
    /// schedule: for an edit, which then checks what it changed
    /// ([`Schedules::validate_changes`]).
    pub fn read(text: &str) -> Result<Schedules, QueueError> {
        parse_versioned(SETTING_SCHEDULES, text)
    }

    /// Checks the bound on their number and every schedule that is not as
    /// in `before`: an edit of one schedule among 10,000 checks one.
    pub fn validate_changes(&self, before: &Schedules) -> Result<(), QueueError> {
        if self.schedules.len() > SCHEDULES_MAX {
            return Err(QueueError::InvalidOption {
                name: "schedules",
                value: self.schedules.len().to_string(),
                allowed: format!("at most {SCHEDULES_MAX} per deployment"),
            });
        }
        for (id, s) in &self.schedules {
            if before.schedules.get(id) != Some(s) {
                s.validate(id)?;
            }
        }
        Ok(())
    }

    /// The text to store (`None` when there is no schedule).
    pub fn to_text(&self) -> Option<String> {
        (!self.schedules.is_empty()).then(|| versioned_text(self))
    }
}

/// Where the job of a schedule's latest fire went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LastFire {
    /// The tick it was fired for (ms), or the time of a trigger.
    pub tick_ms: u64,
    /// When it was enqueued (ms).
    pub at_ms: u64,
    /// The shard that stored it.
    pub shard: String,
    /// Its id there.
    pub job: u64,
}

/// What workers recorded of one schedule's fires.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleState {
    /// Every tick at or before this has been decided (fired, skipped by the
    /// overlap policy, or missed) and is never considered again.
    pub decided_ms: u64,
    /// The latest fire, if any.
    #[serde(default)]
    pub last: Option<LastFire>,
    /// Ticks that stored a job.
    #[serde(default)]
    pub fired: u64,
    /// Ticks not fired because the previous job was live ([`Overlap`]).
    #[serde(default)]
    pub skipped: u64,
    /// Ticks found past their catch-up window (every worker was down).
    #[serde(default)]
    pub missed: u64,
}

impl ScheduleState {
    /// Keeps whichever of `self` and `other` decided further (two writers'
    /// states of one schedule never move it back).
    pub fn merge(&mut self, other: &ScheduleState) {
        if other.decided_ms > self.decided_ms
            || (other.decided_ms == self.decided_ms && other.fired > self.fired)
        {
            *self = other.clone();
        }
    }
}

/// A schedule as operators read it: the schedule, what workers recorded
/// of it, and when it fires next.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScheduleView {
    /// Its id.
    pub id: String,
    /// The schedule.
    #[serde(flatten)]
    pub schedule: Schedule,
    /// Its fires, skips and misses.
    pub state: ScheduleState,
    /// When its next tick is due (ms; in the past while overdue), none while
    /// paused or past its end.
    pub next_fire_ms: Option<u64>,
}

/// Every schedule's state (the `schedule-state` setting).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleStates {
    /// The states, by schedule id.
    #[serde(default)]
    pub states: BTreeMap<String, ScheduleState>,
}

impl ScheduleStates {
    /// Parses the stored text (with its `version`).
    pub fn parse(text: &str) -> Result<ScheduleStates, QueueError> {
        parse_versioned(SETTING_SCHEDULE_STATE, text)
    }

    /// The text to store.
    pub fn to_text(&self) -> Option<String> {
        (!self.states.is_empty()).then(|| versioned_text(self))
    }
}

fn versioned_text<T: Serialize>(value: &T) -> String {
    let mut doc = serde_json::Map::new();
    doc.insert("version".into(), SCHEDULES_VERSION.into());
    if let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(value) {
        doc.extend(fields);
    }
    serde_json::Value::Object(doc).to_string()
}

fn parse_versioned<T: serde::de::DeserializeOwned>(
    name: &str,
    text: &str,
) -> Result<T, QueueError> {
    let refused = |reason: String| QueueError::BadFile {
        path: format!("the deployment's {name:?} setting"),
        what: "schedules document",
        reason,
    };
    let mut doc: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| refused(format!("does not parse ({e})")))?;
    match doc.remove("version") {
        Some(v) if v.as_u64() == Some(SCHEDULES_VERSION) => {}
        found => {
            return Err(QueueError::UnknownFormat {
                what: format!("the deployment's {name:?} setting"),
                found: found.map_or("none".to_string(), |v| v.to_string()),
                supported: SCHEDULES_VERSION.to_string(),
            });
        }
    }
    serde_json::from_value(serde_json::Value::Object(doc))
        .map_err(|e| refused(format!("does not parse ({e})")))
}

/// Parses a duration as people write it: a whole number and a unit, `ms`,
/// `s`, `m`, `h` or `d` (`250ms`, `30s`, `5m`, `2h`, `1d`), or `0`.
/// `name` is the option, for the error.
pub fn parse_duration_ms(name: &'static str, text: &str) -> Result<u64, QueueError> {
    let bad = || QueueError::InvalidOption {
        name,
        value: format!("{text:?}"),
        allowed: "a whole number and a unit: ms, s, m, h or d (250ms, 30s, 5m, 2h, 1d)".into(),
    };
    let t = text.trim();
    if t == "0" {
        return Ok(0);
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let per = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    n.checked_mul(per).ok_or_else(bad)
}

/// Parses a time: RFC 3339 (`2026-12-06T02:00:00Z`, `2026-12-06T02:00:00+01:00`)
/// or ms since the Unix epoch. `name` is the option, for the error.
pub fn parse_time_ms(name: &'static str, text: &str) -> Result<u64, QueueError> {
    if let Ok(ms) = text.trim().parse::<u64>() {
        return Ok(ms);
    }
    chrono::DateTime::parse_from_rfc3339(text.trim())
        .ok()
        .and_then(|t| u64::try_from(t.timestamp_millis()).ok())
        .ok_or_else(|| QueueError::InvalidOption {
            name,
            value: format!("{text:?}"),
            allowed: "an RFC 3339 time (2026-12-06T02:00:00Z) or ms since the Unix epoch".into(),
        })
}

/// `ms` since the epoch as an RFC 3339 UTC time, for people.
pub fn show_time(ms: u64) -> String {
    i64::try_from(ms)
        .ok()
        .and_then(chrono::DateTime::from_timestamp_millis)
        .map_or_else(
            || format!("{ms} ms"),
            |t| t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(),
        )
}

/// A time as a caller gives it: ms since the epoch, or RFC 3339 text.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum TimeArg {
    /// Ms since the Unix epoch.
    Ms(u64),
    /// RFC 3339, or ms as text.
    Text(String),
}

impl TimeArg {
    /// The time in ms; `name` is the field, for the error.
    pub fn ms(&self, name: &'static str) -> Result<u64, QueueError> {
        match self {
            TimeArg::Ms(ms) => Ok(*ms),
            TimeArg::Text(t) => parse_time_ms(name, t),
        }
    }
}

/// A schedule as people write it (the CLI's flags, the API's body): the
/// recurrence and the policies in words and durations (`5m`), turned into
/// a checked [`Schedule`] by [`ScheduleSpec::build`], one reading for
/// every front end.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    /// The key its jobs are enqueued for.
    pub key: String,
    /// A cron expression (exclusive with `every`).
    #[serde(default)]
    pub cron: Option<String>,
    /// The cron expression's IANA zone (default `UTC`).
    #[serde(default)]
    pub tz: Option<String>,
    /// A fixed interval (`30s`, `5m`).
    #[serde(default)]
    pub every: Option<String>,
    /// The payload of every job (UTF-8 text).
    #[serde(default)]
    pub payload: String,
    /// `skip` (default), `one` or `all`.
    #[serde(default)]
    pub overlap: Option<String>,
    /// How late a tick may still fire (default 5m).
    #[serde(default)]
    pub catch_up: Option<String>,
    /// Largest delay added to a fire (default 0).
    #[serde(default)]
    pub jitter: Option<String>,
    /// No tick before this.
    #[serde(default)]
    pub start: Option<TimeArg>,
    /// No tick after this.
    #[serde(default)]
    pub end: Option<TimeArg>,
    /// Attempts of each job (default 5).
    #[serde(default)]
    pub max_attempts: Option<u32>,
}

impl ScheduleSpec {
    /// The schedule it describes, checked (`since_ms` and `paused` are set
    /// where it is stored, [`ScheduleStore::put`]).
    pub fn build(&self, id: &str) -> Result<Schedule, QueueError> {
        let when = match (&self.cron, &self.every, &self.tz) {
            (Some(expr), None, tz) => When::Cron {
                expr: expr.clone(),
                tz: tz.clone().unwrap_or_else(|| "UTC".into()),
            },
            (None, Some(every), None) => When::Every {
                every_ms: parse_duration_ms("every", every)?,
            },
            (c, e, tz) => {
                return Err(QueueError::InvalidOption {
                    name: "recurrence",
                    value: format!("cron {c:?}, every {e:?}, tz {tz:?}",),
                    allowed: "either cron (with an optional tz) or every, not both or neither"
                        .into(),
                })
            }
        };
        let dur = |name, v: &Option<String>, default| match v {
            Some(t) => parse_duration_ms(name, t),
            None => Ok(default),
        };
        let s = Schedule {
            key: self.key.clone(),
            when,
            payload: self.payload.clone(),
            overlap: match &self.overlap {
                Some(o) => Overlap::parse(o)?,
                None => Overlap::default(),
            },
            catch_up_ms: dur("catch-up", &self.catch_up, CATCH_UP_MS_DEFAULT)?,
            jitter_ms: dur("jitter", &self.jitter, 0)?,
            start_ms: self.start.as_ref().map(|t| t.ms("start")).transpose()?,
            end_ms: self.end.as_ref().map(|t| t.ms("end")).transpose()?,
            max_attempts: self
                .max_attempts
                .unwrap_or(crate::job::MAX_ATTEMPTS_DEFAULT),
            paused: false,
            since_ms: 0,
        };
        s.validate(id)?;
        Ok(s)
    }
}

/// A file of schedules (`shardq schedule apply --file`, the body of
/// `PUT /v1/schedules`): each schedule as people write it, by id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleFile {
    /// The schedules, by id.
    pub schedules: BTreeMap<String, ScheduleSpec>,
}

/// A schedule of a [`ScheduleFile`] that does not build: its id and why.
#[derive(Debug, thiserror::Error)]
#[error("schedule {id:?}: {error}")]
pub struct BadSchedule {
    /// The schedule's id in the file.
    pub id: String,
    /// What is wrong with it.
    pub error: QueueError,
}

impl ScheduleFile {
    /// Every schedule, checked; the first that does not build is named.
    /// More than [`SCHEDULES_MAX`] is refused before any is built.
    pub fn build(&self) -> Result<BTreeMap<String, Schedule>, BadSchedule> {
        if self.schedules.len() > SCHEDULES_MAX {
            return Err(BadSchedule {
                id: format!("{} schedules", self.schedules.len()),
                error: QueueError::InvalidOption {
                    name: "schedules",
                    value: self.schedules.len().to_string(),
                    allowed: format!("at most {SCHEDULES_MAX} per deployment"),
                },
            });
        }
        self.schedules
            .iter()
            .map(|(id, spec)| {
                spec.build(id)
                    .map(|s| (id.clone(), s))
                    .map_err(|error| BadSchedule {
                        id: id.clone(),
                        error,
                    })
            })
            .collect()
    }
}

/// Sums over every schedule of a deployment, for `status` and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct ScheduleTotals {
    /// Schedules.
    pub schedules: u64,
    /// Of them, paused.
    pub paused: u64,
    /// Ticks that stored a job.
    pub fired: u64,
    /// Ticks not fired by an overlap policy.
    pub skipped: u64,
    /// Ticks past their catch-up window.
    pub missed: u64,
}

impl ScheduleTotals {
    /// The sums of `schedules` and `states`.
    pub fn of(schedules: &Schedules, states: &ScheduleStates) -> ScheduleTotals {
        let mut t = ScheduleTotals {
            schedules: schedules.schedules.len() as u64,
            paused: schedules.schedules.values().filter(|s| s.paused).count() as u64,
            ..ScheduleTotals::default()
        };
        for (id, s) in &states.states {
            if schedules.schedules.contains_key(id) {
                t.fired += s.fired;
                t.skipped += s.skipped;
                t.missed += s.missed;
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_dedup_id_names_its_schedule_and_tick_only_when_it_is_one() {
        let tick = ScheduleTick::of_dedup_id(&tick_dedup_id("bill:eu.1", 1_800_000_000_000));
        assert_eq!(
            tick,
            Some(ScheduleTick {
                id: "bill:eu.1".into(),
                tick_ms: 1_800_000_000_000,
                triggered: false
            })
        );
        let t = ScheduleTick::of_dedup_id(&trigger_dedup_id("x", 5)).unwrap();
        assert!(t.triggered && t.tick_ms == 5 && t.id == "x");
        for other in [
            "order-17",
            "schedule:",
            "schedule:x",
            "schedule:x@",
            "schedule:x@12a",
            "schedule:@12",
            "schedule:a b@12",
            "schedule:x@99999999999999999999999",
        ] {
            assert_eq!(ScheduleTick::of_dedup_id(other), None, "{other}");
        }
        assert!(refuse_schedule_dedup_id("schedule:x@1").is_err());
        assert!(refuse_schedule_dedup_id("order-17").is_ok());
    }
}
