//! The contract's checks of dedup ids, schedule ticks and keyed
//! (unique and debounced) jobs.

use super::*;

/// A dedup id is scoped to its key: a second enqueue of one `(key, id)` is
/// told the first job's id and stores nothing; another key's job with the
/// same id is stored; two jobs of one batch with one `(key, id)` store one;
/// past the window the id is free again; a fenced batch stores nothing and
/// records nothing.
pub fn dedup_ids_belong_to_their_key(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let first = enqueue_dedup(h, &shard, &[("a", "inv-1")], DEDUP_WINDOW_MS);
    assert!(!first[0].duplicate, "a fresh id stores its job");
    assert_eq!(first[0].shard, shard);
    let again = enqueue_dedup(
        h,
        &shard,
        &[("a", "inv-1"), ("b", "inv-1")],
        DEDUP_WINDOW_MS,
    );
    assert!(
        again[0].duplicate,
        "the same (key, id) again is a duplicate"
    );
    assert_eq!(again[0].id, first[0].id, "a duplicate names the first job");
    assert!(
        !again[1].duplicate,
        "another key's job with the same id is stored"
    );
    assert_eq!(depth(h, &shard, "a"), 1, "the duplicate was not stored");
    assert_eq!(depth(h, &shard, "b"), 1);
    let twice = enqueue_dedup(
        h,
        &shard,
        &[("c", "x"), ("c", "x"), ("c", "y")],
        DEDUP_WINDOW_MS,
    );
    assert!(!twice[0].duplicate && twice[1].duplicate && !twice[2].duplicate);
    assert_eq!(
        twice[1].id, twice[0].id,
        "the second of a batch names the first"
    );
    assert_eq!(depth(h, &shard, "c"), 2);
    // A plain enqueue does not take dedup ids (they would go unchecked).
    let plain = h.backend().enqueue(
        &shard,
        u64::MAX,
        &[NewJob::new("a", "p").with_dedup_id("inv-1")],
    );
    assert!(plain.is_err(), "enqueue must refuse a job with a dedup id");
    assert_eq!(depth(h, &shard, "a"), 1);
    // A bad id is refused, naming it, and stores nothing.
    let bad = h.backend().enqueue_dedup(
        &shard,
        u64::MAX,
        &[NewJob::new("d", "p").with_dedup_id("a\nb")],
        DEDUP_WINDOW_MS,
    );
    assert!(
        matches!(bad, Err(QueueError::InvalidDedupId { .. })),
        "{bad:?}"
    );
    assert_eq!(depth(h, &shard, "d"), 0);
    // A fenced batch records nothing: the id is fresh afterwards.
    let mut fence = h.backend().fence(&shard).expect("fence");
    fence.map_version_min = 10;
    h.backend().set_fence(&shard, &fence).expect("set_fence");
    let fenced = h.backend().enqueue_dedup(
        &shard,
        9,
        &[NewJob::new("e", "p").with_dedup_id("z")],
        DEDUP_WINDOW_MS,
    );
    assert!(
        matches!(fenced, Err(QueueError::Fenced { .. })),
        "{fenced:?}"
    );
    assert!(!enqueue_dedup(h, &shard, &[("e", "z")], DEDUP_WINDOW_MS)[0].duplicate);
    // Past its window an id is free again.
    let short = enqueue_dedup(h, &shard, &[("f", "w")], 200);
    assert!(!short[0].duplicate);
    h.pass_ms(400);
    let later = enqueue_dedup(h, &shard, &[("f", "w")], 200);
    assert!(
        !later[0].duplicate,
        "an expired record no longer suppresses a job"
    );
    assert_ne!(later[0].id, short[0].id);
    assert_eq!(depth(h, &shard, "f"), 2);
}

/// What schedules stand on (`shardq_core::schedule`): a tick's job, fired
/// again and again with its tick's dedup id and a schedule's window (the
/// default catch-up plus the margin), is stored once, and is read back live while it waits and runs
/// (the overlap policies ask for it by id).
pub fn schedule_ticks_store_once(h: &dyn ContractHarness) {
    use shardq_core::schedule::{tick_dedup_id, CATCH_UP_MS_DEFAULT, SCHEDULE_DEDUP_MARGIN_MS};
    let shard = h.fresh_shard();
    let fire = |tick: u64| {
        h.backend()
            .enqueue_dedup(
                &shard,
                u64::MAX,
                &[NewJob::new("sched-key", "tick").with_dedup_id(tick_dedup_id("s-1", tick))],
                CATCH_UP_MS_DEFAULT + SCHEDULE_DEDUP_MARGIN_MS,
            )
            .expect("fire")
            .remove(0)
    };
    let first = fire(1_000);
    assert!(!first.duplicate);
    h.pass_ms(300);
    let again = fire(1_000);
    assert!(again.duplicate, "a tick fired again is not stored again");
    assert_eq!(again.id, first.id);
    assert!(!fire(2_000).duplicate, "the next tick is its own job");
    assert_eq!(depth(h, &shard, "sched-key"), 2);
    let info = h
        .backend()
        .job(&shard, first.id)
        .expect("job")
        .expect("live");
    assert_eq!(info.state, shardq_core::JobState::Queued);
    let run = claim(h, &shard, 1, 30_000);
    assert_eq!(run.len(), 1);
    let info = h
        .backend()
        .job(&shard, first.id)
        .expect("job")
        .expect("live");
    assert_eq!(info.state, shardq_core::JobState::Running);
    ack_one(h, &shard, run[0].receipt());
    assert!(h.backend().job(&shard, first.id).expect("job").is_none());
    assert!(
        fire(1_000).duplicate,
        "an ended tick's job is still not stored again"
    );
}

/// One keyed job through `enqueue_dedup`.
fn put_keyed(h: &dyn ContractHarness, shard: &str, job: NewJob) -> shardq_core::job::Stored {
    h.backend()
        .enqueue_dedup(shard, u64::MAX, &[job], DEDUP_WINDOW_MS)
        .unwrap_or_else(|e| panic!("keyed enqueue to {shard}: {e}"))
        .remove(0)
}

/// A unique job is not stored while the key's newest job with its id
/// waits (or, asked for, runs): the enqueue answers that job. The id is
/// scoped to its key; a dead job frees it; a job that runs frees it for
/// `--unique-while queued`; moved with its key, the job holds its id on
/// its new shard.
pub fn unique_jobs_hold_their_id_while_they_wait_or_run(h: &dyn ContractHarness) {
    let b = h.backend();
    let shard = h.fresh_shard();
    let u = |p: &str, running: bool| NewJob::new("uk", p).unique("sync", running);
    let first = put_keyed(h, &shard, u("a", false));
    assert!(!first.duplicate, "a fresh id stores its job");
    let again = put_keyed(h, &shard, u("b", true));
    assert!(
        again.duplicate && again.id == first.id,
        "a waiting job holds its id: {again:?}"
    );
    assert!(!put_keyed(h, &shard, NewJob::new("uk2", "c").unique("sync", false)).duplicate);
    assert!(!put_keyed(h, &shard, NewJob::new("uk3", "d").unique("other", false)).duplicate);
    assert_eq!(depth(h, &shard, "uk"), 1);
    let runs = claim(h, &shard, 10, LONG_LEASE_MS);
    let run = runs.iter().find(|r| r.key == "uk").expect("uk runs");
    assert_eq!(run.id, first.id);
    let held = put_keyed(h, &shard, u("e", true));
    assert!(
        held.duplicate && held.id == first.id,
        "a running job holds it when asked"
    );
    let mut queued_only = u("f", false);
    queued_only.max_attempts = 1;
    let second = put_keyed(h, &shard, queued_only);
    assert!(
        !second.duplicate,
        "a running job does not hold it for queued-only"
    );
    let third = put_keyed(h, &shard, u("g", true));
    assert!(
        third.duplicate && third.id == second.id,
        "the newest job holds it"
    );
    ack_one(h, &shard, run.receipt());
    let fourth = put_keyed(h, &shard, u("h", false));
    assert!(fourth.duplicate && fourth.id == second.id);
    // The second dies on its one attempt: the id is free.
    let run = claim(h, &shard, 10, LONG_LEASE_MS)
        .into_iter()
        .find(|r| r.key == "uk")
        .expect("the second runs");
    assert_eq!(run.id, second.id);
    b.fail(&shard, run.receipt(), "boom", None).expect("fail");
    let fresh = put_keyed(h, &shard, u("i", false));
    assert!(!fresh.duplicate, "a dead job does not hold its id");
    // Moved with its key: the copy holds the id on the new shard.
    let to = h.fresh_shard();
    let moved = b.export_jobs(&shard, "uk", None, 100).expect("export");
    let pairs = b.import_jobs(&to, &shard, "uk", &moved).expect("import");
    let (_, copy) = pairs
        .iter()
        .find(|(old, _)| *old == fresh.id)
        .copied()
        .expect("the waiting job was copied");
    let there = put_keyed(h, &to, u("j", false));
    assert!(there.duplicate && there.id == copy, "{there:?} vs {copy:?}");
}

/// A debounced job whose key holds a waiting job with its id is not
/// stored: that job takes the new payload and starts `delay` after this
/// enqueue, never later than `max` after its first; once it runs, the
/// next enqueue starts a new burst. Moved with its key, the waiting job
/// still takes the burst's enqueues on its new shard.
pub fn debounced_jobs_take_the_last_payload_and_run_once(h: &dyn ContractHarness) {
    let b = h.backend();
    let shard = h.fresh_shard();
    let d = |p: &str| NewJob::new("dk", p).debounced("recalc", 5_000, 20_000);
    let info = |shard: &str, id| b.job(shard, id).expect("job").expect("live");
    let first = put_keyed(h, &shard, d("v1"));
    assert!(!first.duplicate);
    let created = info(&shard, first.id).created_ms;
    assert_eq!(info(&shard, first.id).not_before_ms, created + 5_000);
    let mut starts = vec![created + 5_000];
    for (n, p) in ["v2", "v3", "v4", "v5"].iter().enumerate() {
        h.pass_ms(6_000);
        let st = put_keyed(h, &shard, d(p));
        assert_eq!((st.id, st.duplicate), (first.id, false), "{p}: {st:?}");
        let j = info(&shard, first.id);
        assert_eq!(j.payload, p.as_bytes(), "the last payload");
        starts.push(j.not_before_ms);
        // 6 s apart: each pushes the start by 5 s past its enqueue, up to
        // the first enqueue + 20 s.
        let want = (created + 6_000 * (n as u64 + 1) + 5_000).min(created + 20_000);
        assert_eq!(j.not_before_ms, want, "{p}");
    }
    assert_eq!(depth(h, &shard, "dk"), 1, "one job for the burst");
    assert!(
        put_keyed(
            h,
            &shard,
            NewJob::new("dk", "x").debounced("other", 1_000, 1_000)
        )
        .id != first.id,
        "another id is another burst"
    );
    // Due: it runs with the last payload; a debounce while it runs starts
    // a new burst.
    h.pass_ms(1_000);
    let run = claim(h, &shard, 10, LONG_LEASE_MS)
        .into_iter()
        .find(|r| r.id == first.id)
        .expect("the burst's job runs");
    assert_eq!(run.payload, b"v5");
    let next = put_keyed(h, &shard, d("w1"));
    assert!(
        next.id != first.id && !next.duplicate,
        "a running job takes no more"
    );
    ack_one(h, &shard, run.receipt());
    // Moved: the waiting job on the new shard takes the next enqueue.
    let to = h.fresh_shard();
    let moved = b.export_jobs(&shard, "dk", None, 100).expect("export");
    let pairs = b.import_jobs(&to, &shard, "dk", &moved).expect("import");
    let (_, copy) = pairs
        .iter()
        .find(|(old, _)| *old == next.id)
        .copied()
        .expect("copied");
    let st = put_keyed(h, &to, d("w2"));
    assert_eq!((st.id, st.duplicate), (copy, false));
    assert_eq!(info(&to, copy).payload, b"w2");
    // A debounce on a key being copied away waits for the move (paused).
    let mut fence = b.fence(&shard).expect("fence");
    fence.sealed_keys.insert("dk".into(), to.clone());
    b.set_fence(&shard, &fence).expect("seal");
    let err = b
        .enqueue_dedup(&shard, u64::MAX, &[d("w3")], DEDUP_WINDOW_MS)
        .expect_err("paused while copied");
    assert!(matches!(err, QueueError::Paused { .. }), "{err}");
}

/// Many threads enqueueing one `(key, id)` at once store exactly one job,
/// and every one of them is told its id.
pub fn dedup_is_atomic_with_the_append(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let backend = h.backend();
    let results: Vec<Vec<shardq_core::job::Stored>> = std::thread::scope(|sc| {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let shard = &shard;
                sc.spawn(move || {
                    (0..10)
                        .flat_map(|_| {
                            backend
                                .enqueue_dedup(
                                    shard,
                                    u64::MAX,
                                    &[NewJob::new("k", "p").with_dedup_id("once")],
                                    DEDUP_WINDOW_MS,
                                )
                                .expect("enqueue_dedup")
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .collect()
    });
    let all: Vec<&shardq_core::job::Stored> = results.iter().flatten().collect();
    assert_eq!(all.len(), 40);
    assert_eq!(
        all.iter().filter(|s| !s.duplicate).count(),
        1,
        "exactly one enqueue of a (key, id) stores its job"
    );
    let id = all[0].id;
    assert!(all.iter().all(|s| s.id == id && s.shard == shard));
    assert_eq!(depth(h, &shard, "k"), 1, "one job stored");
}
