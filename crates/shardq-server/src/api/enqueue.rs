//! `POST /v1/jobs`: validation of every job, dedup ids looked up and
//! reserved, the jobs stored through a pooled producer, the dedup records
//! made durable before the reply. It must never report a stored job as failed.

use super::*;

// ---------------------------------------------------------------------------
// Enqueue.
// ---------------------------------------------------------------------------

/// `POST /v1/jobs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnqueueRequest {
    jobs: BoundedVec<JobIn, JOBS_PER_REQUEST_LIMIT>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobIn {
    key: String,
    payload: Option<String>,
    payload_b64: Option<String>,
    delay_ms: Option<u64>,
    max_attempts: Option<u32>,
    dedup_id: Option<String>,
}

#[derive(Debug, Serialize)]
struct Enqueued {
    id: String,
    shard: String,
    key: String,
    duplicate: bool,
}

fn check_dedup_id(id: &str, field: &str) -> Result<(), ApiError> {
    if id.is_empty()
        || id.len() > DEDUP_ID_BYTES_MAX
        || id.chars().any(shardq_core::job::is_unshowable)
    {
        return Err(ApiError::bad(format!(
            "{field}: invalid dedup id {}: 1..={DEDUP_ID_BYTES_MAX} bytes without control or invisible formatting characters",
            shown(id)
        )));
    }
    Ok(())
}

fn to_new_job(
    i: usize,
    j: JobIn,
    payload_max: usize,
) -> Result<(NewJob, Option<String>), ApiError> {
    let f = |name: &str| format!("jobs[{i}].{name}");
    validate_key(&j.key).map_err(|e| ApiError::bad(format!("{}: {e}", f("key"))))?;
    let payload = match (j.payload, j.payload_b64) {
        (Some(p), None) => p.into_bytes(),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD
            .decode(b.as_bytes())
            .map_err(|e| {
                ApiError::bad(format!(
                    "{}: invalid base64 {}: {e}",
                    f("payload_b64"),
                    shown(&b)
                ))
            })?,
        (Some(_), Some(_)) => {
            return Err(ApiError::bad(format!(
                "jobs[{i}]: both payload and payload_b64 given; give exactly one"
            )))
        }
        (None, None) => {
            return Err(ApiError::bad(format!(
                "jobs[{i}]: no payload; give payload (UTF-8 text) or payload_b64 (bytes)"
            )))
        }
    };
    if payload.len() > payload_max {
        return Err(ApiError::bad(format!(
            "{}: {} bytes, over the limit of {payload_max} bytes",
            f("payload"),
            payload.len()
        )));
    }
    let job = NewJob {
        key: j.key,
        payload,
        delay_ms: j.delay_ms.unwrap_or(0),
        max_attempts: j.max_attempts.unwrap_or(MAX_ATTEMPTS_DEFAULT),
    };
    job.validate(payload_max).map_err(|e| {
        let field = match e {
            QueueError::InvalidMaxAttempts { .. } => "max_attempts",
            QueueError::InvalidDelay { .. } => "delay_ms",
            _ => "job",
        };
        ApiError::bad(format!("{}: {e}", f(field)))
    })?;
    if let Some(d) = &j.dedup_id {
        check_dedup_id(d, &f("dedup_id"))?;
    }
    Ok((job, j.dedup_id))
}

/// `POST /v1/jobs`: validate everything, look dedup ids up, enqueue the
/// rest through a producer, record the dedup ids durably, reply.
pub async fn enqueue(
    State(app): State<Arc<App>>,
    JsonBody(req): JsonBody<EnqueueRequest>,
) -> ApiResult {
    let jobs_in = req.jobs.into_inner();
    let n = jobs_in.len();
    if n == 0 {
        return Err(ApiError::bad("jobs: empty list; give 1 or more jobs"));
    }
    if n > app.limits.jobs_per_request_max {
        return Err(ApiError::bad(format!(
            "jobs: {n} jobs, over the limit of {} per request",
            app.limits.jobs_per_request_max
        )));
    }
    let mut jobs = Vec::with_capacity(n);
    let mut dedup: Vec<Option<String>> = Vec::with_capacity(n);
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for (i, j) in jobs_in.into_iter().enumerate() {
        let (job, d) = to_new_job(i, j, app.limits.payload_bytes_max)?;
        if let Some(id) = &d {
            if let Some(first) = seen.insert((job.key.clone(), id.clone()), i) {
                return Err(ApiError::bad(format!(
                    "jobs[{i}].dedup_id: {} already used by jobs[{first}] of this request, for the same key",
                    shown(id)
                )));
            }
        }
        jobs.push(job);
        dedup.push(d);
    }
    let a = Arc::clone(&app);
    let out = blocking(move || a.enqueue_blocking(jobs, dedup)).await?;
    app.work_arrived();
    ok_jobs(out)
}

impl App {
    fn enqueue_blocking(
        &self,
        jobs: Vec<NewJob>,
        dedup: Vec<Option<String>>,
    ) -> Result<Vec<Enqueued>, ApiError> {
        let now = self.clock.now_ms();
        let mut results: Vec<Option<Enqueued>> = (0..jobs.len()).map(|_| None).collect();
        // (index, key, dedup id) of the jobs that carry one: a dedup id
        // belongs to its key.
        let with_id: Vec<(usize, String, String)> = dedup
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.as_ref().map(|id| (i, jobs[i].key.clone(), id.clone())))
            .collect();
        let scoped = |list: &[&(usize, String, String)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(_, k, id)| (k.clone(), id.clone()))
                .collect()
        };
        let abort = |ids: &[(String, String)]| {
            let s: Vec<Scoped<'_>> = ids.iter().map(|(key, id)| Scoped { key, id }).collect();
            self.dedup.abort(&s);
        };
        let ids: Vec<Scoped<'_>> = with_id
            .iter()
            .map(|(_, key, id)| Scoped { key, id })
            .collect();
        let found = match self.dedup.begin_many(&ids, now) {
            Ok(found) => found,
            Err(e) => return Err(ApiError::unavailable(format!("dedup store: {e}"))),
        };
        drop(ids);
        // Every fresh id is reserved now: a busy one anywhere in the request
        // releases them all.
        let fresh: Vec<&(usize, String, String)> = with_id
            .iter()
            .zip(&found)
            .filter(|(_, b)| matches!(b, Begin::Fresh))
            .map(|(w, _)| w)
            .collect();
        let reserved: Vec<(String, String)> = scoped(&fresh);
        for ((i, _, id), begun) in with_id.iter().zip(found) {
            let i = *i;
            match begun {
                Begin::Fresh => {}
                Begin::Done(rec) => {
                    results[i] = Some(Enqueued {
                        id: job_string(&rec.shard, JobId(rec.job)),
                        shard: rec.shard,
                        key: rec.key,
                        duplicate: true,
                    })
                }
                Begin::Busy => {
                    abort(&reserved);
                    return Err(ApiError::conflict(format!(
                        "jobs[{i}].dedup_id: {} of key {} is being enqueued by another request right now; retry shortly",
                        shown(id),
                        shown(&jobs[i].key)
                    )));
                }
            }
        }
        let todo: Vec<usize> = (0..jobs.len()).filter(|&i| results[i].is_none()).collect();
        // The jobs to store, moved out (payloads are not copied).
        let batch: Vec<NewJob> = jobs
            .into_iter()
            .enumerate()
            .filter(|(i, _)| results[*i].is_none())
            .map(|(_, j)| j)
            .collect();
        let outcome = if batch.is_empty() {
            Ok(Vec::new())
        } else {
            let mut producer = match self.take_producer() {
                Ok(p) => p,
                Err(e) => {
                    abort(&reserved);
                    return Err(e);
                }
            };
            let r = producer.enqueue_batch(&batch);
            self.metrics.refusals(&producer.take_refusals());
            self.put_producer(producer);
            r
        };
        let (placed, error) = match outcome {
            Ok(p) => (p, None),
            Err(shardq_core::producer::ProduceError::Partial { placed, cause }) => {
                let e = ApiError::from(shardq_core::producer::ProduceError::Partial {
                    placed: placed.clone(),
                    cause,
                });
                (placed, Some(e))
            }
            Err(e @ shardq_core::producer::ProduceError::PausedTooLong { .. }) => {
                let placed = match &e {
                    shardq_core::producer::ProduceError::PausedTooLong { placed, .. } => {
                        placed.clone()
                    }
                    _ => Vec::new(),
                };
                (placed, Some(ApiError::from(e)))
            }
            Err(e) => (Vec::new(), Some(ApiError::from(e))),
        };
        crate::metrics::enqueued(self, &placed);
        let expires_ms = now.saturating_add(self.dedup_window_ms);
        let mut records = Vec::new();
        for p in &placed {
            let i = todo[p.index];
            if let Some(id) = &dedup[i] {
                records.push(DedupRecord::new(
                    &batch[p.index].key,
                    id,
                    &p.shard,
                    p.id.0,
                    expires_ms,
                ));
            }
            results[i] = Some(Enqueued {
                id: job_string(&p.shard, p.id),
                shard: p.shard.clone(),
                key: batch[p.index].key.clone(),
                duplicate: false,
            });
        }
        let recorded: std::collections::HashSet<(&str, &str)> = records
            .iter()
            .map(|r| (r.key.as_str(), r.id.as_str()))
            .collect();
        let unplaced: Vec<(String, String)> = reserved
            .iter()
            .filter(|(k, id)| !recorded.contains(&(k.as_str(), id.as_str())))
            .cloned()
            .collect();
        abort(&unplaced);
        let commit = self.dedup.commit(&records);
        if let Some(e) = error {
            let placed_json: Vec<Value> = results
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().map(|r| json!({"index": i, "id": r.id, "shard": r.shard, "duplicate": r.duplicate})))
                .collect();
            return Err(e.with("placed", Value::Array(placed_json)));
        }
        if let Err(e) = commit {
            // The jobs are stored: the reply says so (an error here would
            // make a client send them again). Memory keeps the records and
            // the next commit writes them; only a crash before then loses
            // them.
            eprintln!(
                "shardq serve: {} dedup records not written yet ({e}); memory answers for them and the next commit writes them",
                records.len()
            );
        }
        Ok(results.into_iter().flatten().collect())
    }
}
