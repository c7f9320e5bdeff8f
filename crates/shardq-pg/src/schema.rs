//! What `shardq pg install` writes into a database: the outbox table as
//! numbered migrations, recorded in `<schema>.migrations`, and the
//! `<schema>.enqueue` functions, written again by every install so that
//! their checks follow the deployment.
//!
//! # Why the relay can keep commit order
//!
//! `enqueue` takes a transaction-scoped advisory lock on its key (class
//! [`lock_class`], key `hashtext(key)`) *before* it draws the row's id
//! from the sequence. A second transaction enqueueing for the same key
//! waits on that lock until the first one ends, so of two committed rows
//! of one key the one with the smaller id committed first, and no
//! snapshot sees the later one without the earlier one (a transaction is
//! visible as committed before its locks are released). Reading rows by
//! id therefore reads each key's rows in commit order, and a row whose
//! transaction is still open holds back only the later rows of its own
//! key (they wait on its lock). Two keys whose hashes collide share a lock:
//! they are serialised too, which costs waiting, never order.

use postgres::GenericClient;

use crate::PgError;

/// One numbered change of the outbox's tables. From the first release
/// on, a change is a new entry here, never an edit of an applied one.
pub struct Migration {
    /// Its number; applied in order, recorded once applied.
    pub version: i32,
    /// What it does, recorded beside its number.
    pub name: &'static str,
    /// Its SQL; `{schema}` stands for the schema.
    pub sql: &'static str,
}

/// Every migration this build knows, in order.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "outbox table",
    sql: "CREATE TABLE {schema}.outbox (
        id bigserial PRIMARY KEY,
        key text NOT NULL,
        payload bytea NOT NULL,
        dedup_id text,
        delay_ms bigint,
        max_attempts integer,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp()
    );
    ALTER TABLE {schema}.outbox SET (autovacuum_vacuum_scale_factor = 0.0,
        autovacuum_vacuum_threshold = 10000, autovacuum_vacuum_cost_delay = 0);",
}];

/// The newest migration this build knows.
pub fn latest_version() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.version)
}

/// A schema name the outbox may live in: a plain lower-case SQL
/// identifier (it is written into statements, never quoted).
pub fn check_schema(schema: &str) -> Result<(), PgError> {
    let ok = !schema.is_empty()
        && schema.len() <= 48
        && schema
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && schema
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(PgError::BadInput(format!(
            "--schema {schema:?}: a lower-case SQL identifier (letters, digits, _; not starting with a digit), at most 48 bytes"
        )))
    }
}

/// The advisory lock class of `schema`'s outbox: its key locks are
/// `(class, hashtext(key))`, its install lock `(class, 0)` and the active
/// relay's lock `(class, 1)` (a key hashing to 0 or 1 shares those, which
/// only makes it wait).
pub fn lock_class(schema: &str) -> i32 {
    // FNV-1a, folded to 31 bits: stable across builds and platforms.
    let mut h: u32 = 0x811c_9dc5;
    for b in format!("shardq.outbox.{schema}").bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    (h & 0x7fff_ffff) as i32
}

/// The channel `enqueue` notifies at commit.
pub fn channel(schema: &str) -> String {
    format!("{schema}_outbox")
}

/// What the `enqueue` functions check, in the caller's transaction, and
/// how they wake the relay.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Largest payload, in bytes (the deployment's).
    pub payload_bytes_max: usize,
    /// Whether a transaction that enqueues wakes the relay at its commit.
    pub wake: Wake,
}

/// How the relay hears of committed rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// `enqueue` calls `pg_notify`: the relay reads as soon as the
    /// transaction commits. PostgreSQL then commits notifying transactions
    /// one at a time (a lock held from just before the commit until it is
    /// flushed), which costs the application's enqueueing transactions
    /// throughput when many commit at once (`docs/postgres.md`).
    Notify,
    /// `enqueue` does not notify: the relay finds rows by reading the
    /// table every `--poll-ms`, which bounds the added latency instead.
    Poll,
}

/// Applies the migrations `schema` lacks and writes the functions, in one
/// transaction under the install lock (concurrent installs wait for each
/// other). Returns the versions applied now (empty: it was up to date).
/// A schema whose recorded migrations are newer than this build knows is
/// refused, naming both versions.
pub fn install(
    client: &mut postgres::Client,
    schema: &str,
    bounds: Bounds,
) -> Result<Vec<i32>, PgError> {
    check_schema(schema)?;
    let mut tx = client.transaction()?;
    tx.execute(
        "SELECT pg_advisory_xact_lock($1, 0)",
        &[&lock_class(schema)],
    )?;
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {schema}.migrations (
             version integer PRIMARY KEY,
             name text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now());"
    ))?;
    let have: i32 = tx
        .query_one(
            &format!("SELECT coalesce(max(version), 0) FROM {schema}.migrations"),
            &[],
        )?
        .get(0);
    if have > latest_version() {
        return Err(PgError::BadInput(format!(
            "schema {schema} has outbox migrations up to {have}; this shardq knows up to {}: use the shardq that installed it, or a newer one",
            latest_version()
        )));
    }
    let mut applied = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| m.version > have) {
        tx.batch_execute(&m.sql.replace("{schema}", schema))?;
        tx.execute(
            &format!("INSERT INTO {schema}.migrations (version, name) VALUES ($1, $2)"),
            &[&m.version, &m.name],
        )?;
        applied.push(m.version);
    }
    tx.batch_execute(&functions_sql(schema, bounds))?;
    tx.commit()?;
    Ok(applied)
}

/// How `schema`'s installed `enqueue` wakes the relay; `None` when it has
/// none.
pub fn installed_wake(
    client: &mut impl GenericClient,
    schema: &str,
) -> Result<Option<Wake>, PgError> {
    check_schema(schema)?;
    let row = client.query_one(
        "SELECT count(*), coalesce(bool_or(prosrc LIKE '%pg_notify%'), false) FROM pg_proc
         WHERE proname = 'enqueue' AND pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = $1)",
        &[&schema],
    )?;
    let (functions, notifies): (i64, bool) = (row.get(0), row.get(1));
    Ok(match (functions, notifies) {
        (0, _) => None,
        (_, true) => Some(Wake::Notify),
        (_, false) => Some(Wake::Poll),
    })
}

/// The versions recorded in `schema` (none when it was never installed).
pub fn installed_version(client: &mut impl GenericClient, schema: &str) -> Result<i32, PgError> {
    check_schema(schema)?;
    let exists: bool = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{schema}.migrations")],
        )?
        .get(0);
    if !exists {
        return Ok(0);
    }
    Ok(client
        .query_one(
            &format!("SELECT coalesce(max(version), 0) FROM {schema}.migrations"),
            &[],
        )?
        .get(0))
}

/// A bracket expression of PostgreSQL's regular expressions matching each
/// character `pick` says yes to (NUL aside: no text holds it).
fn char_class(pick: impl Fn(char) -> bool) -> String {
    let mut out = String::from("[");
    let mut run: Option<(u32, u32)> = None;
    let push = |out: &mut String, (a, b): (u32, u32)| {
        let esc = |c: u32| {
            if c <= 0xffff {
                format!("\\u{c:04x}")
            } else {
                format!("\\U{c:08x}")
            }
        };
        if a == b {
            out.push_str(&esc(a));
        } else {
            out.push_str(&format!("{}-{}", esc(a), esc(b)));
        }
    };
    for c in (1u32..=0x10ffff).filter_map(char::from_u32) {
        let cp = c as u32;
        if pick(c) {
            run = match run {
                Some((a, b)) if b + 1 == cp => Some((a, cp)),
                Some(r) => {
                    push(&mut out, r);
                    Some((cp, cp))
                }
                None => Some((cp, cp)),
            };
        }
    }
    if let Some(r) = run {
        push(&mut out, r);
    }
    out.push(']');
    out
}

/// The `enqueue` functions of `schema`: the checks of core's key, dedup
/// id, payload, delay and attempts rules (the character classes written
/// from core's own predicates), the key's lock, the row, the
/// notification.
fn functions_sql(schema: &str, bounds: Bounds) -> String {
    use shardq_core::job::{
        has_unshowable, starts_with_mark, DEDUP_ID_BYTES_MAX, DELAY_MS_MAX, KEY_BYTES_MAX,
        MAX_ATTEMPTS_LIMIT,
    };
    let unshowable = char_class(|c| has_unshowable(c.encode_utf8(&mut [0; 4])));
    let marks = char_class(|c| starts_with_mark(c.encode_utf8(&mut [0; 4])));
    let class = lock_class(schema);
    let channel = channel(schema);
    let payload_max = bounds.payload_bytes_max;
    let notify = match bounds.wake {
        Wake::Notify => format!("  PERFORM pg_notify('{channel}', '');\n"),
        Wake::Poll => String::new(),
    };
    format!(
        r#"
CREATE OR REPLACE FUNCTION {schema}.enqueue(key text, payload bytea, dedup_id text DEFAULT NULL,
    delay_ms bigint DEFAULT NULL, max_attempts integer DEFAULT NULL)
RETURNS bigint LANGUAGE plpgsql AS $shardq$
#variable_conflict use_variable
DECLARE
  new_id bigint;
BEGIN
  IF key IS NULL OR key = '' THEN
    RAISE EXCEPTION 'shardq: key must not be empty' USING ERRCODE = '22023';
  END IF;
  IF octet_length(key) > {KEY_BYTES_MAX} THEN
    RAISE EXCEPTION 'shardq: key %... is % bytes, at most {KEY_BYTES_MAX}', left(key, 32), octet_length(key)
      USING ERRCODE = '22023';
  END IF;
  IF key ~ '{unshowable}' THEN
    RAISE EXCEPTION 'shardq: key % holds a control or invisible formatting character', quote_literal(left(key, 64))
      USING ERRCODE = '22023';
  END IF;
  IF key ~ '^{marks}' THEN
    RAISE EXCEPTION 'shardq: key % starts with a combining mark', quote_literal(left(key, 64))
      USING ERRCODE = '22023';
  END IF;
  IF payload IS NULL THEN
    RAISE EXCEPTION 'shardq: payload of key % is null', quote_literal(left(key, 64)) USING ERRCODE = '22023';
  END IF;
  IF octet_length(payload) > {payload_max} THEN
    RAISE EXCEPTION 'shardq: payload of key % is % bytes, at most {payload_max}', quote_literal(left(key, 64)),
      octet_length(payload) USING ERRCODE = '22023';
  END IF;
  IF dedup_id IS NOT NULL AND (dedup_id = '' OR octet_length(dedup_id) > {DEDUP_ID_BYTES_MAX}
      OR dedup_id ~ '{unshowable}') THEN
    RAISE EXCEPTION 'shardq: dedup_id % must be 1 to {DEDUP_ID_BYTES_MAX} bytes without control or invisible formatting characters',
      quote_literal(left(dedup_id, 64)) USING ERRCODE = '22023';
  END IF;
  IF dedup_id ~ '^(schedule|unique|debounce|pg|after):' THEN
    RAISE EXCEPTION 'shardq: dedup_id % starts with a prefix shardq keeps for itself (schedule:, unique:, debounce:, pg:, after:)',
      quote_literal(left(dedup_id, 64)) USING ERRCODE = '22023';
  END IF;
  IF delay_ms IS NOT NULL AND (delay_ms < 0 OR delay_ms > {DELAY_MS_MAX}) THEN
    RAISE EXCEPTION 'shardq: delay_ms % is out of range 0..={DELAY_MS_MAX}', delay_ms USING ERRCODE = '22023';
  END IF;
  IF max_attempts IS NOT NULL AND (max_attempts < 1 OR max_attempts > {MAX_ATTEMPTS_LIMIT}) THEN
    RAISE EXCEPTION 'shardq: max_attempts % is out of range 1..={MAX_ATTEMPTS_LIMIT}', max_attempts
      USING ERRCODE = '22023';
  END IF;
  -- The key's lock before the row's id: see the header of schema.rs.
  PERFORM pg_advisory_xact_lock({class}, hashtext(key));
  INSERT INTO {schema}.outbox (key, payload, dedup_id, delay_ms, max_attempts)
    VALUES (key, payload, dedup_id, delay_ms, max_attempts) RETURNING id INTO new_id;
{notify}  RETURN new_id;
END
$shardq$;

CREATE OR REPLACE FUNCTION {schema}.enqueue(key text, payload text, dedup_id text DEFAULT NULL,
    delay_ms bigint DEFAULT NULL, max_attempts integer DEFAULT NULL)
RETURNS bigint LANGUAGE sql AS $shardq$
  SELECT {schema}.enqueue(key, convert_to(payload, 'UTF8'), dedup_id, delay_ms, max_attempts)
$shardq$;

CREATE OR REPLACE FUNCTION {schema}.enqueue(key text, payload jsonb, dedup_id text DEFAULT NULL,
    delay_ms bigint DEFAULT NULL, max_attempts integer DEFAULT NULL)
RETURNS bigint LANGUAGE sql AS $shardq$
  SELECT {schema}.enqueue(key, convert_to(payload::text, 'UTF8'), dedup_id, delay_ms, max_attempts)
$shardq$;
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_classes_cover_runs_and_astral_planes() {
        let c = char_class(|c| c == 'a' || c == 'b' || c == 'd' || c as u32 == 0x1_0000);
        assert_eq!(c, "[\\u0061-\\u0062\\u0064\\U00010000]");
    }

    #[test]
    fn schemas_are_plain_identifiers() {
        for ok in ["shardq", "app_queue", "_x1"] {
            assert!(check_schema(ok).is_ok(), "{ok}");
        }
        for bad in ["", "1x", "Shardq", "a-b", "a;drop", "a.b", &"x".repeat(49)] {
            let e = check_schema(bad).unwrap_err().to_string();
            assert!(e.contains("--schema"), "{bad}: {e}");
        }
    }

    #[test]
    fn lock_classes_differ_by_schema_and_stay_positive() {
        assert_ne!(lock_class("shardq"), lock_class("other"));
        assert!(lock_class("shardq") >= 0);
        assert_eq!(lock_class("shardq"), lock_class("shardq"));
    }
}
