//! shardq's Postgres outbox: a job exists if and only if the transaction
//! that enqueued it committed.
//!
//! An application calls `shardq.enqueue(key, payload, ...)` inside its own
//! transaction ([`schema`]: a SQL function over an outbox table, installed
//! by `shardq pg install` as numbered migrations); the function checks the
//! job as shardq would, in that transaction, and writes a row. The
//! [`relay`] (`shardq pg relay`) moves committed rows into the deployment
//! (embedded or Redis, any routing), each key's rows in commit order, and
//! deletes them; a row's id is its job's dedup id, so a relay that dies
//! halfway stores nothing twice. [`status`] reads the outbox's depth, its
//! oldest row and the relay's state.

pub mod relay;
pub mod schema;

use schema::{check_schema, installed_version, latest_version, lock_class};

/// What the outbox's commands fail with.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// Bad input or a state only an operator can change (an option out of
    /// range, a schema not installed or installed by a newer build).
    #[error("{0}")]
    BadInput(String),
    /// Postgres refused or could not be reached; worth another try.
    #[error("postgres: {0}")]
    Postgres(#[from] postgres::Error),
    /// The deployment refused or could not be reached.
    #[error("the deployment: {0}")]
    Store(String),
}

impl PgError {
    /// Its kind, for exit codes: bad input, or worth another try.
    pub fn kind(&self) -> shardq_core::ErrorKind {
        match self {
            PgError::BadInput(_) => shardq_core::ErrorKind::BadInput,
            PgError::Postgres(e)
                if e.as_db_error()
                    .is_some_and(|d| d.code().code().starts_with("22")) =>
            {
                shardq_core::ErrorKind::BadInput
            }
            PgError::Postgres(_) | PgError::Store(_) => shardq_core::ErrorKind::Retryable,
        }
    }
}

impl From<shardq_deploy::DeployError> for PgError {
    fn from(e: shardq_deploy::DeployError) -> Self {
        PgError::Store(e.to_string())
    }
}

/// Connects to `url` (a `postgres://` URL or a key=value string), without
/// TLS: the relay is meant to run beside its database.
pub fn connect(url: &str) -> Result<postgres::Client, PgError> {
    Ok(postgres::Client::connect(url, postgres::NoTls)?)
}

/// The outbox's state, as `shardq pg status` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Status {
    /// The schema.
    pub schema: String,
    /// Migrations applied, and the newest this build knows.
    pub installed_version: i32,
    /// The newest migration this build knows.
    pub latest_version: i32,
    /// Committed rows not yet relayed.
    pub depth: i64,
    /// Age of the oldest committed row, in ms (the relay's lag); `None`
    /// when the outbox is empty.
    pub oldest_age_ms: Option<i64>,
    /// Whether a relay holds the schema's relay lock (is active).
    pub relay_active: bool,
    /// Transactions holding a key's outbox lock now: their rows are not
    /// visible yet, and later rows of their keys wait for them.
    pub open_transactions: i64,
    /// How long the oldest of those has been open, in ms.
    pub oldest_open_transaction_ms: Option<i64>,
    /// Dead tuples of the outbox table as the statistics collector counts
    /// them (a table that grows them without bound needs vacuum).
    pub dead_tuples: i64,
    /// Whether `enqueue` notifies the relay at commit (`pg install
    /// --wake notify`) or the relay polls (`--wake poll`).
    pub wake: String,
}

/// Reads the outbox's state in `schema`.
pub fn status(client: &mut postgres::Client, schema: &str) -> Result<Status, PgError> {
    check_schema(schema)?;
    let installed = installed_version(client, schema)?;
    if installed == 0 {
        return Err(PgError::BadInput(format!(
            "schema {schema} has no outbox: run `shardq pg install`"
        )));
    }
    let row = client.query_one(
        &format!(
            "SELECT count(*), (extract(epoch FROM clock_timestamp() - min(created_at)) * 1000)::bigint FROM {schema}.outbox"
        ),
        &[],
    )?;
    let class = lock_class(schema);
    let relay_active: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid = $1::int::oid AND objid = 1 AND objsubid = 2 AND granted)",
            &[&class],
        )?
        .get(0);
    let open = client.query_one(
        "SELECT count(DISTINCT l.pid), (extract(epoch FROM clock_timestamp() - min(a.xact_start)) * 1000)::bigint
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.classid = $1::int::oid AND l.objsubid = 2 AND l.objid > 1 AND l.granted
           AND l.virtualtransaction IS NOT NULL AND a.xact_start IS NOT NULL AND a.backend_type = 'client backend'",
        &[&class],
    )?;
    let dead: i64 = client
        .query_one(
            "SELECT coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'outbox'), 0)",
            &[&schema],
        )?
        .get(0);
    let wake = match crate::schema::installed_wake(client, schema)? {
        Some(crate::schema::Wake::Poll) => "poll",
        _ => "notify",
    };
    Ok(Status {
        wake: wake.to_string(),
        schema: schema.to_string(),
        installed_version: installed,
        latest_version: latest_version(),
        depth: row.get(0),
        oldest_age_ms: row.get(1),
        relay_active,
        open_transactions: open.get(0),
        oldest_open_transaction_ms: open.get(1),
        dead_tuples: dead,
    })
}

/// Reads [`status`] again and again over one connection, made again after
/// a failure (for a server's status and metrics).
pub struct StatusReader {
    url: String,
    schema: String,
    client: std::sync::Mutex<Option<postgres::Client>>,
}

impl StatusReader {
    /// A reader of `schema`'s outbox at `url` (connects at its first read).
    pub fn new(url: &str, schema: &str) -> Result<StatusReader, PgError> {
        check_schema(schema)?;
        Ok(StatusReader {
            url: url.to_string(),
            schema: schema.to_string(),
            client: std::sync::Mutex::new(None),
        })
    }

    /// The outbox's state now; an error drops the connection, so the next
    /// read connects again.
    pub fn read(&self) -> Result<Status, PgError> {
        let mut slot = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(connect(&self.url)?);
        }
        let Some(client) = slot.as_mut() else {
            return Err(PgError::BadInput("no connection".into()));
        };
        let read = status(client, &self.schema);
        if read.is_err() {
            *slot = None;
        }
        read
    }
}
