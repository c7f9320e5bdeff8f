//! The operations on a run, by its receipt: `POST /v1/ack`, `/v1/fail`
//! and `/v1/extend`. A receipt that is not its job's current run changes
//! nothing and is listed in a 409. `POST /v1/stale` only reads: which runs
//! are no longer current (a cancel stopped them, or they ended).

use super::claims::book;
use super::*;

fn check_receipts(receipts: &[String]) -> Result<(), ApiError> {
    if receipts.is_empty() {
        return Err(ApiError::bad(
            "receipts: empty list; give 1 or more receipts",
        ));
    }
    if receipts.len() > RECEIPTS_PER_REQUEST_MAX {
        return Err(ApiError::bad(format!(
            "receipts: {} receipts, over the limit of {RECEIPTS_PER_REQUEST_MAX} per request",
            receipts.len()
        )));
    }
    Ok(())
}

/// `POST /v1/ack`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AckRequest {
    receipts: BoundedVec<String, RECEIPTS_PER_REQUEST_MAX>,
    /// One per receipt, when given: the job's result, kept with the
    /// finished job (null for none).
    #[serde(default)]
    results: Option<Vec<Option<AckResult>>>,
}

/// A job's result in `POST /v1/ack`: text, or bytes in base64.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AckResult {
    result: Option<String>,
    result_b64: Option<String>,
}

/// The bytes of each receipt's result (`results[i]` of an ack), checked:
/// as many as the receipts, one form each, within the bound on results.
fn ack_results(
    receipts: &[String],
    results: Option<Vec<Option<AckResult>>>,
) -> Result<Vec<Option<Vec<u8>>>, ApiError> {
    let Some(results) = results else {
        return Ok(Vec::new());
    };
    if results.len() != receipts.len() {
        return Err(ApiError::bad(format!(
            "results: {} results for {} receipts; give one per receipt (null for none)",
            results.len(),
            receipts.len()
        )));
    }
    let mut out = Vec::with_capacity(results.len());
    for (i, r) in results.into_iter().enumerate() {
        let bytes = match r {
            None => None,
            Some(AckResult {
                result: Some(t),
                result_b64: None,
            }) => Some(t.into_bytes()),
            Some(AckResult {
                result: None,
                result_b64: Some(b),
            }) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(&b)
                    .map_err(|e| {
                        ApiError::bad(format!("results[{i}].result_b64: invalid base64: {e}"))
                    })?,
            ),
            Some(_) => {
                return Err(ApiError::bad(format!(
                    "results[{i}]: give result (text) or result_b64 (bytes), one of them"
                )))
            }
        };
        if let Some(b) = &bytes {
            shardq_core::job::check_result(b, shardq_core::job::RESULT_BYTES_MAX)
                .map_err(|why| ApiError::bad(format!("results[{i}]: {why}")))?;
        }
        out.push(bytes);
    }
    Ok(out)
}

/// 409 listing refused receipts, or 200.
fn refused_or_ok(
    what: &str,
    count_field: &str,
    count: u64,
    stale: Vec<String>,
    not_owned: Vec<String>,
) -> ApiResult {
    if stale.is_empty() && not_owned.is_empty() {
        return ok(json!({ count_field: count }));
    }
    let mut parts = Vec::new();
    if !stale.is_empty() {
        parts.push(format!(
            "{} stale receipts (not their job's current run: late, lapsed or already finished; nothing was changed for them), first {:?}",
            stale.len(),
            stale[0]
        ));
    }
    if !not_owned.is_empty() {
        parts.push(format!(
            "{} receipts of shards not owned by this server, first {:?}",
            not_owned.len(),
            not_owned[0]
        ));
    }
    Err(ApiError::conflict(format!(
        "{what}: {}; {count} other receipts took effect",
        parts.join("; ")
    ))
    .with(count_field, json!(count))
    .with("stale", json!(stale))
    .with("not_owned", json!(not_owned)))
}

impl App {
    /// Fails every run past its job timeout (a claim's `timeout_ms`) as an
    /// attempt that timed out, whatever its extends: the server's side of
    /// a timeout an HTTP worker cannot be trusted to keep. Its late ack is
    /// then refused (409). Runs first, in ack and extend, so a result that
    /// comes after the deadline never counts.
    pub(crate) fn fail_timed_out(&self) {
        let now = self.clock.now_ms();
        if !book(&self.claims).any_timed_out(now) {
            return;
        }
        let due = book(&self.claims).timed_out(now);
        for (shard, r, ms) in due {
            self.backoffs.ended(&shard, r.id);
            let reason = format!("timed out: the run passed its job timeout of {ms} ms");
            match self.backend.fail(&shard, r, &reason, None) {
                Ok(o) => crate::metrics::failed(self, &shard, r, Ok(&o)),
                // Ended meanwhile, or no longer ours: nothing to fail.
                Err(QueueError::StaleReceipt { .. } | QueueError::NotOwner { .. }) => {}
                Err(e) => eprintln!(
                    "shardq serve: failing run {} of shard {shard} at its job timeout: {e}",
                    receipt_string(&shard, r)
                ),
            }
        }
        self.work_arrived();
    }
}

/// Fails runs past their job timeout every [`TIMEOUT_SWEEP_MS`], until the
/// server stops.
pub(crate) async fn sweep_timeouts(app: Arc<App>) {
    loop {
        tokio::time::sleep(Duration::from_millis(crate::limits::TIMEOUT_SWEEP_MS)).await;
        if book(&app.claims).any_timed_out(app.clock.now_ms()) {
            let a = Arc::clone(&app);
            let _ = blocking(move || {
                a.fail_timed_out();
                Ok(())
            })
            .await;
        }
    }
}

/// `POST /v1/ack`: the valid receipts are acked; any stale or not-owned
/// one makes the reply a 409 that lists them.
pub async fn ack(State(app): State<Arc<App>>, JsonBody(req): JsonBody<AckRequest>) -> ApiResult {
    check_receipts(&req.receipts.0)?;
    let results = ack_results(&req.receipts.0, req.results)?;
    let a = Arc::clone(&app);
    let (acked, stale, not_owned) = blocking(move || {
        a.fail_timed_out();
        let (groups, mut not_owned) = a.group_receipts(&req.receipts.0)?;
        let by_receipt: std::collections::HashMap<&str, Vec<u8>> = (req.receipts.0.iter())
            .zip(results)
            .filter_map(|(s, r)| r.map(|r| (s.as_str(), r)))
            .collect();
        let mut acked = 0u64;
        let mut stale = Vec::new();
        for (shard, rs) in groups {
            let receipts: Vec<Receipt> = rs.iter().map(|(r, _)| *r).collect();
            let results: Vec<Option<Vec<u8>>> = if by_receipt.is_empty() {
                Vec::new()
            } else {
                rs.iter()
                    .map(|(_, s)| by_receipt.get(s.as_str()).cloned())
                    .collect()
            };
            match shardq_core::backend::ack_ending_cancelled(
                &*a.backend,
                &shard,
                &receipts,
                &results,
            ) {
                Ok(out) => {
                    acked += out.acked;
                    crate::metrics::acked(&a, &shard, &receipts, &out.stale);
                    let mut b = book(&a.claims);
                    for r in &receipts {
                        b.finish(&shard, *r);
                    }
                    drop(b);
                    a.backoffs.ended_all(&shard, receipts.iter().map(|r| r.id));
                    stale.extend(out.stale.iter().map(|r| receipt_string(&shard, *r)));
                }
                Err(QueueError::NotOwner { .. }) => {
                    not_owned.extend(rs.into_iter().map(|(_, s)| s))
                }
                Err(e) => return Err(ApiError::from(e).with("acked", json!(acked))),
            }
        }
        Ok((acked, stale, not_owned))
    })
    .await?;
    app.work_arrived();
    refused_or_ok("ack", "acked", acked, stale, not_owned)
}

/// `POST /v1/fail`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailRequest {
    receipt: String,
    reason: Option<String>,
    retry_in_ms: Option<u64>,
    /// The handler backs off: its downstream limits it. The run ends
    /// without using an attempt and the key starts nothing for this long.
    backoff_ms: Option<u64>,
    /// With `backoff_ms`: hold the key's whole flow-control group.
    backoff_group: Option<bool>,
}

/// The back-off form of `POST /v1/fail`.
async fn back_off(app: Arc<App>, req: FailRequest, ms: u64) -> ApiResult {
    let (shard, r) = parse_receipt(&req.receipt, || "receipt".into()).map_err(ApiError::bad)?;
    if req.retry_in_ms.is_some() {
        return Err(ApiError::bad(
            "retry_in_ms: give it or backoff_ms, not both (a back-off uses no attempt)",
        ));
    }
    shardq_core::flow::validate_backoff_ms(ms)?;
    if let Err(why) = app.backoffs.note(&shard, r.id, ms) {
        // Past the bound of back-offs in a row: a failed attempt.
        return fail_run(app, req.receipt, shard, r, why, None).await;
    }
    let ms = shardq_core::backoff::floored_ms(ms);
    let group = req.backoff_group.unwrap_or(false);
    let done = end_run(
        &app,
        req.receipt,
        shard,
        r,
        move |a, shard| a.backend.back_off(shard, r, ms, group),
        move |a, shard, _| a.metrics.run_backed_off(shard, r),
    )
    .await?;
    app.work_arrived();
    ok(json!({ "outcome": "backoff", "retry_at_ms": done.at_ms, "group": done.group }))
}

/// `POST /v1/fail`: 200 with the outcome, 409 for a stale receipt.
pub async fn fail(State(app): State<Arc<App>>, JsonBody(req): JsonBody<FailRequest>) -> ApiResult {
    if let Some(ms) = req.backoff_ms {
        return back_off(app, req, ms).await;
    }
    if req.backoff_group.is_some() {
        return Err(ApiError::bad("backoff_group: only with backoff_ms"));
    }
    let (shard, r) = parse_receipt(&req.receipt, || "receipt".into()).map_err(ApiError::bad)?;
    let reason = req.reason.unwrap_or_default();
    if reason.len() > FAIL_REASON_BYTES_MAX {
        return Err(ApiError::bad(format!(
            "reason: {} bytes, over the limit of {FAIL_REASON_BYTES_MAX}",
            reason.len()
        )));
    }
    if let Some(ms) = req.retry_in_ms {
        if ms > shardq_core::job::DELAY_MS_MAX {
            return Err(ApiError::bad(format!(
                "retry_in_ms: {ms} is over the longest delay of {} ms",
                shardq_core::job::DELAY_MS_MAX
            )));
        }
    }
    fail_run(app, req.receipt, shard, r, reason, req.retry_in_ms).await
}

/// Ends run `r` as a failed attempt for `reason`.
async fn fail_run(
    app: Arc<App>,
    receipt: String,
    shard: String,
    r: Receipt,
    reason: String,
    retry_in_ms: Option<u64>,
) -> ApiResult {
    app.backoffs.ended(&shard, r.id);
    let outcome = end_run(
        &app,
        receipt,
        shard,
        r,
        move |a, shard| a.backend.fail(shard, r, &reason, retry_in_ms),
        move |a, shard, o| crate::metrics::failed(a, shard, r, Ok(o)),
    )
    .await?;
    app.work_arrived();
    match outcome {
        FailOutcome::Retry { at_ms } => ok(json!({ "outcome": "retry", "retry_at_ms": at_ms })),
        FailOutcome::Dead => ok(json!({ "outcome": "dead" })),
        _ => ok(json!({ "outcome": "unknown" })),
    }
}

/// Ends run `r` of `shard` (named by `receipt`) on a blocking thread with
/// `op`, if this server owns the shard: the run leaves the book of claims
/// and `on_ok` counts it; a stale receipt is counted and answered 409.
async fn end_run<T: Send + 'static>(
    app: &Arc<App>,
    receipt: String,
    shard: String,
    r: Receipt,
    op: impl FnOnce(&App, &str) -> Result<T, QueueError> + Send + 'static,
    on_ok: impl FnOnce(&App, &str, &T) + Send + 'static,
) -> Result<T, ApiError> {
    let a = Arc::clone(app);
    blocking(move || {
        let (groups, not_owned) = a.group_receipts(std::slice::from_ref(&receipt))?;
        if !not_owned.is_empty() || groups.is_empty() {
            return Err(not_owned_error(&receipt, &shard));
        }
        match op(&a, &shard) {
            Ok(o) => {
                book(&a.claims).finish(&shard, r);
                on_ok(&a, &shard, &o);
                Ok(o)
            }
            Err(QueueError::NotOwner { .. }) => Err(not_owned_error(&receipt, &shard)),
            Err(e @ QueueError::StaleReceipt { .. }) => {
                crate::metrics::failed(&a, &shard, r, Err(()));
                Err(ApiError::from(e).with("receipt", json!(receipt)))
            }
            Err(e) => Err(ApiError::from(e).with("receipt", json!(receipt))),
        }
    })
    .await
}

fn not_owned_error(receipt: &str, shard: &str) -> ApiError {
    ApiError::conflict(format!(
        "receipt {receipt:?}: shard {shard:?} is not owned by this server (its runs are handed out by the server that holds its lease)"
    ))
    .with("not_owned", json!([receipt]))
}

/// `POST /v1/extend`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExtendRequest {
    receipts: BoundedVec<String, RECEIPTS_PER_REQUEST_MAX>,
    lease_ms: Option<u64>,
}

/// `POST /v1/extend`: like ack, 409 listing stale or not-owned receipts.
pub async fn extend(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<ExtendRequest>,
) -> ApiResult {
    check_receipts(&req.receipts.0)?;
    let lease_ms = req.lease_ms.unwrap_or(JOB_LEASE_MS_DEFAULT);
    validate_job_lease_ms(lease_ms).map_err(|e| ApiError::bad(format!("lease_ms: {e}")))?;
    let (extended, stale, not_owned) = blocking(move || {
        app.fail_timed_out();
        let (groups, mut not_owned) = app.group_receipts(&req.receipts.0)?;
        let mut extended = 0u64;
        let mut stale = Vec::new();
        let until = app.clock.now_ms().saturating_add(lease_ms);
        for (shard, rs) in groups {
            let receipts: Vec<Receipt> = rs.iter().map(|(r, _)| *r).collect();
            match app.backend.extend(&shard, &receipts, lease_ms) {
                Ok(refused) => {
                    let mut b = book(&app.claims);
                    for r in &receipts {
                        if refused.contains(r) {
                            b.finish(&shard, *r);
                        } else {
                            extended += 1;
                            b.extend(&shard, *r, until);
                        }
                    }
                    stale.extend(refused.iter().map(|r| receipt_string(&shard, *r)));
                }
                Err(QueueError::NotOwner { .. }) => {
                    not_owned.extend(rs.into_iter().map(|(_, s)| s))
                }
                Err(e) => return Err(ApiError::from(e).with("extended", json!(extended))),
            }
        }
        Ok((extended, stale, not_owned))
    })
    .await?;
    refused_or_ok("extend", "extended", extended, stale, not_owned)
}

/// `POST /v1/stale`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaleRequest {
    receipts: BoundedVec<String, RECEIPTS_PER_REQUEST_MAX>,
}

/// `POST /v1/stale`: which of a worker's runs are no longer current
/// (`RunJobs::stale_runs`, one store read per shard): ended, followed by a
/// newer run, or asked to stop by a cancel (`DELETE /v1/jobs/{id}`). It
/// extends nothing and ends nothing, so a worker asks it about once a
/// second while handlers run and stops the stale runs' handlers long
/// before its next extend would say so; its `POST /v1/fail` of such a
/// receipt, once the handler returned, ends a cancelled run (409) and
/// frees the key. Receipts of shards this server does not own are listed
/// in `not_owned` and not asked about (their extend says so).
pub async fn stale(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<StaleRequest>,
) -> ApiResult {
    check_receipts(&req.receipts.0)?;
    let (stale, not_owned) = blocking(move || {
        // A run past its job timeout is failed first, as an extend would.
        app.fail_timed_out();
        let (groups, not_owned) = app.group_receipts(&req.receipts.0)?;
        let mut stale = Vec::new();
        for (shard, rs) in groups {
            let receipts: Vec<Receipt> = rs.iter().map(|(r, _)| *r).collect();
            let found = app.backend.stale_runs(&shard, &receipts)?;
            stale.extend(
                (rs.into_iter())
                    .filter(|(r, _)| found.contains(r))
                    .map(|(_, s)| s),
            );
        }
        Ok((stale, not_owned))
    })
    .await?;
    ok(json!({ "stale": stale, "not_owned": not_owned }))
}
