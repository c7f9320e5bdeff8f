//! The server's bounds: every limit a request can hit, as a named constant
//! with its default, gathered in [`Limits`] so flags can change them. This
//! module only holds numbers; it must never enforce anything itself.

/// Default largest request body (16 MiB): a full batch of jobs with
/// payloads near the engine's 1 MiB default is refused before it is read.
pub const BODY_BYTES_MAX_DEFAULT: usize = 16 << 20;
/// Default most jobs in one `POST /v1/jobs`.
pub const JOBS_PER_REQUEST_MAX_DEFAULT: usize = 1000;
/// Hard upper bound for `--jobs-per-request-max`.
pub const JOBS_PER_REQUEST_LIMIT: usize = 10_000;
/// Most receipts in one ack or extend.
pub const RECEIPTS_PER_REQUEST_MAX: usize = 1000;
/// Longest long-poll a claim may ask for (`wait_ms`), 30 s.
pub const WAIT_MS_MAX: u64 = 30_000;
/// Largest `max` of one claim.
pub const CLAIM_MAX_LIMIT: usize = 1000;
/// Default requests served at once (a tower concurrency limit; further
/// requests wait for a slot).
pub const CONCURRENCY_MAX_DEFAULT: usize = 1024;
/// Default claims served at once (`/v1/claim`, long polls included): a
/// budget of their own, so idle long polls never take the slots of
/// [`CONCURRENCY_MAX_DEFAULT`] that enqueues, acks and reads need.
pub const POLLS_MAX_DEFAULT: usize = 1024;
/// Default most bytes of request bodies being read at once, over every
/// request (64 MiB, four bodies of the largest default size): a request
/// whose body (its `Content-Length`, or the largest body when it gives
/// none) does not fit is answered 503 with `Retry-After` before its body
/// is read, so buffered bodies cannot take the machine's memory.
pub const BODY_BYTES_IN_FLIGHT_MAX_DEFAULT: usize = 4 * BODY_BYTES_MAX_DEFAULT;
/// Default most runs one `worker` name may hold at once.
pub const CLAIMS_PER_WORKER_MAX_DEFAULT: usize = 10_000;
/// Default dedup window (5 minutes): how long a `dedup_id` is remembered.
pub const DEDUP_WINDOW_MS_DEFAULT: u64 = shardq_core::DEDUP_WINDOW_MS_DEFAULT;
/// Longest dedup window accepted (7 days).
pub const DEDUP_WINDOW_MS_MAX: u64 = shardq_core::DEDUP_WINDOW_MS_MAX;
/// Longest `dedup_id`, in bytes.
pub const DEDUP_ID_BYTES_MAX: usize = shardq_core::DEDUP_ID_BYTES_MAX;
/// Longest `worker` name, in bytes.
pub const WORKER_NAME_BYTES_MAX: usize = 256;
/// Interval between claim attempts while a claim long-polls, in ms (an
/// enqueue through this server wakes the pollers sooner).
pub const CLAIM_POLL_MS: u64 = 10;
/// Longest interval between the claim attempts of a long poll that found
/// nothing, in ms: the interval doubles from [`CLAIM_POLL_MS`] up to this,
/// so work enqueued through another process is seen within about this.
pub const CLAIM_POLL_MAX_MS: u64 = 100;
/// Default and largest `limit` of `GET /v1/dead`.
pub const DEAD_LIST_DEFAULT: usize = 100;
/// Largest `limit` of `GET /v1/dead`.
pub const DEAD_LIST_MAX: usize = 10_000;
/// Default `limit` of `GET /v1/keys/{key}/jobs` (the largest is core's
/// `KEY_JOBS_MAX`).
pub const KEY_JOBS_DEFAULT: usize = 100;
/// Default `finished` of `GET /v1/keys/{key}/jobs`: the key's finished jobs
/// shown, newest first (0 to core's `KEY_JOBS_MAX`).
pub const KEY_FINISHED_DEFAULT: usize = 20;
/// Longest a request may take before the server answers 408 (the longest
/// long-poll plus room for the store's own bounds).
pub const REQUEST_TIMEOUT_MS: u64 = WAIT_MS_MAX + 60_000;
/// Longest a failure reason accepted in `POST /v1/fail`, in bytes (the
/// backend keeps at most its own 1 KiB of it).
pub const FAIL_REASON_BYTES_MAX: usize = 64 << 10;

/// Default longest time a request body may take to arrive (30 s): a
/// client that trickles its body holds a request slot no longer than this.
pub const BODY_READ_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Default most runs held by all the workers of one token (or of every
/// worker, without tokens): a client cannot pass the per-worker bound by
/// inventing worker names.
pub const CLAIMS_PER_TOKEN_MAX_DEFAULT: usize = 50_000;
/// Scrapes of `/metrics` served at once (outside `--concurrency-max`, so
/// the metrics answer while the server is busy; bounded, so a flood of
/// scrapes cannot take the threads every other request needs).
pub const METRICS_SCRAPES_MAX: usize = 4;
/// How often the server looks for runs past their job timeout, in ms.
pub const TIMEOUT_SWEEP_MS: u64 = 50;

/// The limits one server applies.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest request body, in bytes.
    pub body_bytes_max: usize,
    /// Most jobs per enqueue request.
    pub jobs_per_request_max: usize,
    /// Requests served at once (claims aside).
    pub concurrency_max: usize,
    /// Claims served at once, long polls included.
    pub polls_max: usize,
    /// Bytes of request bodies read at once, over every request.
    pub body_bytes_in_flight_max: usize,
    /// Most runs held by one worker name.
    pub claims_per_worker_max: usize,
    /// Most runs held by the workers of one token.
    pub claims_per_token_max: usize,
    /// Longest time a request body may take to arrive, in ms.
    pub body_read_timeout_ms: u64,
    /// Largest payload, in bytes (the deployment's own limit).
    pub payload_bytes_max: usize,
    /// Job timeout of runs claimed without `timeout_ms`, in ms (`serve
    /// --job-timeout-ms`; `None`: none, a run lasts while it is extended).
    pub job_timeout_ms: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            body_bytes_max: BODY_BYTES_MAX_DEFAULT,
            jobs_per_request_max: JOBS_PER_REQUEST_MAX_DEFAULT,
            concurrency_max: CONCURRENCY_MAX_DEFAULT,
            polls_max: POLLS_MAX_DEFAULT,
            body_bytes_in_flight_max: BODY_BYTES_IN_FLIGHT_MAX_DEFAULT,
            claims_per_worker_max: CLAIMS_PER_WORKER_MAX_DEFAULT,
            claims_per_token_max: CLAIMS_PER_TOKEN_MAX_DEFAULT,
            body_read_timeout_ms: BODY_READ_TIMEOUT_MS_DEFAULT,
            payload_bytes_max: shardq_core::PAYLOAD_BYTES_MAX_DEFAULT,
            job_timeout_ms: None,
        }
    }
}
