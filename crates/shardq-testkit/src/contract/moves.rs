//! The contract's checks of keys moving with their backlogs: seals and
//! freezes, exports and imports, purges and what an old id finds after.

use super::*;

/// A key sealed for a move freezes only when no job of it is left above
/// its cursor (what its new shard took), atomically: a job that arrived
/// after the last copy keeps it unfrozen. A frozen key's
/// enqueues are refused whole, naming the new shard, and store nothing,
/// with or without dedup ids; other keys' go in. A key not sealed never
/// freezes, and lifting the seal lifts the freeze.
pub fn a_moving_key_freezes_only_once_copied(h: &dyn ContractHarness) {
    let b = h.backend();
    let (from, to) = (h.fresh_shard(), h.fresh_shard());
    enqueue(h, &from, "k", "a", 5);
    enqueue(h, &from, "k", "b", 1);
    enqueue(h, &from, "free", "f", 5);
    let mut fence = b.fence(&from).expect("fence");
    fence.sealed_keys.insert("k".into(), to.clone());
    b.set_fence(&from, &fence).expect("seal");
    let items = |after: Option<JobId>| vec![("k".to_string(), after), ("free".to_string(), None)];
    let frozen = b.freeze_caught_up(&from, &items(None)).expect("freeze");
    assert!(
        frozen.is_empty(),
        "froze a key whose jobs were not copied: {frozen:?}"
    );
    let jobs = b.export_jobs(&from, "k", None, 10).expect("export");
    assert_eq!(jobs.len(), 2);
    let mut cursor = Some(jobs[1].id);
    // A job that arrives after the copy keeps the key unfrozen.
    enqueue(h, &from, "k", "c", 5);
    let frozen = b.freeze_caught_up(&from, &items(cursor)).expect("freeze");
    assert!(frozen.is_empty(), "froze a key with a job above its cursor");
    let late = b.export_jobs(&from, "k", cursor, 10).expect("export");
    assert_eq!(late.len(), 1);
    cursor = Some(late[0].id);
    let frozen = b.freeze_caught_up(&from, &items(cursor)).expect("freeze");
    assert_eq!(
        frozen,
        ["k"],
        "a caught-up sealed key must freeze; an unsealed one never"
    );
    assert!(b.fence(&from).expect("fence").is_frozen("k"));
    // Frozen: enqueues of the key are refused whole and store nothing.
    let before = depth(h, &from, "k");
    let batch = [NewJob::new("free", "g"), NewJob::new("k", "d")];
    match b.enqueue(&from, u64::MAX, &batch) {
        Err(QueueError::Moved { key, to: went, .. }) => {
            assert_eq!((key.as_str(), went.as_str()), ("k", to.as_str()));
        }
        other => panic!("a frozen key's enqueue must be refused as moved, got {other:?}"),
    }
    let with_id = [NewJob::new("k", "d").with_dedup_id("x")];
    assert!(
        matches!(
            b.enqueue_dedup(&from, u64::MAX, &with_id, 60_000),
            Err(QueueError::Moved { .. })
        ),
        "a frozen key's dedup enqueue must be refused as moved"
    );
    assert_eq!(
        depth(h, &from, "k"),
        before,
        "a refused enqueue stored a job"
    );
    assert_eq!(
        depth(h, &from, "free"),
        1,
        "a refused batch stored part of itself"
    );
    enqueue(h, &from, "free", "g", 5);
    // Freezing again is harmless; unsealing ends the freeze.
    assert_eq!(
        b.freeze_caught_up(&from, &items(cursor)).expect("freeze"),
        ["k"]
    );
    let mut fence = b.fence(&from).expect("fence");
    fence.unseal("k");
    b.set_fence(&from, &fence).expect("unseal");
    assert!(!b.fence(&from).expect("fence").is_frozen("k"));
    enqueue(h, &from, "k", "e", 5);
    assert_eq!(depth(h, &from, "k"), before + 1);
}

/// A key's backlog moves to another shard whole: a sealed key starts no
/// run where it is, its queued, delayed, retried and dead jobs are exported
/// in key order and imported with their payloads, times and attempts, a
/// second import stores nothing twice, and the purge leaves the other keys
/// alone. A backend without the capability says so.
pub fn backlogs_move_with_their_key(h: &dyn ContractHarness) {
    let b = h.backend();
    let (from, to) = (h.fresh_shard(), h.fresh_shard());
    // a: a dead letter; b: retried once, at the head; c: queued; d: delayed.
    enqueue(h, &from, "k", "a", 1);
    let run = claim(h, &from, 1, LONG_LEASE_MS).remove(0);
    b.fail(&from, run.receipt(), "boom", None).expect("fail");
    enqueue(h, &from, "k", "b", 5);
    let run = claim(h, &from, 1, LONG_LEASE_MS).remove(0);
    b.fail(&from, run.receipt(), "again", Some(0))
        .expect("fail");
    enqueue(h, &from, "k", "c", 5);
    let mut d = NewJob::new("k", "d");
    d.delay_ms = 3_600_000;
    b.enqueue(&from, u64::MAX, &[d]).expect("enqueue");
    enqueue(h, &from, "other", "o", 5);

    let mut fence = b.fence(&from).expect("fence");
    fence.sealed_keys.insert("k".into(), to.clone());
    b.set_fence(&from, &fence).expect("seal");
    let ran: Vec<String> = claim(h, &from, 10, LONG_LEASE_MS)
        .into_iter()
        .map(|j| j.key)
        .collect();
    assert_eq!(ran, ["other"], "a sealed key started a run");

    let first = b.export_jobs(&from, "k", None, 2).expect("export");
    let rest = b
        .export_jobs(&from, "k", Some(first[1].id), 10)
        .expect("export");
    let all: Vec<_> = first.into_iter().chain(rest).collect();
    let payloads: Vec<&[u8]> = all.iter().map(|j| &j.payload[..]).collect();
    assert_eq!(payloads, [b"a", b"b", b"c", b"d"], "export in key order");
    assert_eq!(
        all[0].dead.as_deref(),
        Some("boom"),
        "the dead letter and its reason"
    );
    assert_eq!((all[1].attempt, all[1].dead.is_none()), (1, true));
    assert!(all[3].not_before_ms > all[2].not_before_ms + 3_000_000);

    let stored = b.import_jobs(&to, &from, "k", &all).expect("import");
    assert_eq!(stored.len(), 4);
    assert!(
        b.import_jobs(&to, &from, "k", &all)
            .expect("import")
            .is_empty(),
        "a second import of the same jobs stored them twice"
    );
    assert_eq!(
        b.imported_up_to(&to, &from, "k").expect("cursor"),
        Some(all[3].id)
    );
    let c = b.key_counts(&to, "k").expect("counts");
    assert_eq!((c.depth, c.dead), (3, 1));
    let dead = b.dead_list(&to, 10).expect("dead list");
    assert_eq!((dead.len(), dead[0].reason.as_str()), (1, "boom"));
    let next = claim(h, &to, 10, LONG_LEASE_MS);
    assert_eq!(next.len(), 1);
    assert_eq!((&next[0].payload[..], next[0].attempt), (&b"b"[..], 2));
    ack_one(h, &to, next[0].receipt());
    let next = claim(h, &to, 10, LONG_LEASE_MS);
    assert_eq!(&next[0].payload[..], b"c");
    ack_one(h, &to, next[0].receipt());
    assert!(
        claim(h, &to, 10, LONG_LEASE_MS).is_empty(),
        "a delayed job moved ahead of its time"
    );

    assert_eq!(b.purge_key(&from, "k").expect("purge"), 4);
    let c = b.key_counts(&from, "k").expect("counts");
    assert_eq!((c.depth, c.in_flight, c.dead), (0, 0, 0));
    let c = b.key_counts(&from, "other").expect("counts");
    assert_eq!(c.in_flight, 1, "the purge touched another key");

    several_keys_move_in_one_import(h, &from, &to);
    an_unsealed_key_runs_where_it_is(h, &from, &to);
}

/// The batched export and import of [`backlogs_move_with_their_key`], from
/// `from` to `to`.
fn several_keys_move_in_one_import(h: &dyn ContractHarness, from: &str, to: &str) {
    let b = h.backend();
    // Several keys in one import: each key's jobs land in order, once.
    for i in 0..3 {
        enqueue(h, from, "m1", &format!("x{i}"), 5);
        enqueue(h, from, "m2", &format!("y{i}"), 5);
    }
    let items: Vec<(String, Vec<shardq_core::job::MovedJob>)> = ["m1", "m2"]
        .into_iter()
        .map(|k| {
            (
                k.to_string(),
                b.export_jobs(from, k, None, 10).expect("export"),
            )
        })
        .collect();
    // The batched export gives what the per-key one gives, from each cursor.
    let m2_after = items[1].1[0].id;
    let many = b
        .export_many(
            from,
            &[("m1".to_string(), None), ("m2".to_string(), Some(m2_after))],
        )
        .expect("export many");
    assert_eq!(many.len(), 2);
    assert_eq!((many[0].0.as_str(), &many[0].1), ("m1", &items[0].1));
    assert_eq!(
        (many[1].0.as_str(), &many[1].1[..]),
        ("m2", &items[1].1[1..])
    );
    assert_eq!(b.import_many(to, from, &items).expect("import").len(), 6);
    assert!(b.import_many(to, from, &items).expect("import").is_empty());
    let mut ran: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    loop {
        let jobs = claim(h, to, 10, LONG_LEASE_MS);
        if jobs.is_empty() {
            break;
        }
        for j in jobs {
            ran.entry(j.key.clone())
                .or_default()
                .push(String::from_utf8_lossy(&j.payload).into_owned());
            ack_one(h, to, j.receipt());
        }
    }
    for (k, first) in [("m1", "x"), ("m2", "y")] {
        let want: Vec<String> = (0..3).map(|i| format!("{first}{i}")).collect();
        assert_eq!(ran.get(k), Some(&want), "key {k} after a batched import");
    }
}

/// The move given up of [`backlogs_move_with_their_key`], on `to` (sealed
/// towards `from`).
fn an_unsealed_key_runs_where_it_is(h: &dyn ContractHarness, from: &str, to: &str) {
    let b = h.backend();
    // A move given up: unsealed, a key runs where it is again, one run at a
    // time, whether a claim passed it by while sealed ("u") or not ("w").
    for (k, p) in [("u", "u0"), ("u", "u1"), ("w", "w0"), ("w", "w1")] {
        enqueue(h, to, k, p, 5);
    }
    let seal = |keys: &[&str]| {
        let mut f = b.fence(to).expect("fence");
        f.sealed_keys = keys
            .iter()
            .map(|k| (k.to_string(), from.to_string()))
            .collect();
        b.set_fence(to, &f).expect("fence");
    };
    seal(&["u"]);
    let mut order: Vec<String> = Vec::new();
    for j in claim(h, to, 10, LONG_LEASE_MS) {
        assert_eq!(j.key, "w", "a sealed key started a run");
        order.push(String::from_utf8_lossy(&j.payload).into_owned());
        ack_one(h, to, j.receipt());
    }
    seal(&["w"]);
    seal(&[]);
    assert!(b.fence(to).expect("fence").sealed_keys.is_empty());
    loop {
        let jobs = claim(h, to, 10, LONG_LEASE_MS);
        if jobs.is_empty() {
            break;
        }
        let mut keys: Vec<&str> = jobs.iter().map(|j| j.key.as_str()).collect();
        keys.sort_unstable();
        let n = keys.len();
        keys.dedup();
        assert_eq!(keys.len(), n, "one claim started two runs of a key");
        for j in jobs {
            order.push(String::from_utf8_lossy(&j.payload).into_owned());
            ack_one(h, to, j.receipt());
        }
    }
    for k in ["u", "w"] {
        let mine: Vec<&String> = order.iter().filter(|p| p.starts_with(k)).collect();
        assert_eq!(
            mine,
            [&format!("{k}0"), &format!("{k}1")],
            "key {k} after its unseal"
        );
    }
}

/// A job keeps the dedup id it was enqueued with, and its claim, its view
/// and its copy in a move carry it: a retried run, a dead letter and a
/// job moved to another shard still name it (a schedule's job, its
/// schedule and tick). A job enqueued without one has none.
pub fn a_jobs_dedup_id_follows_it_through_claims_and_moves(h: &dyn ContractHarness) {
    use shardq_core::schedule::{tick_dedup_id, ScheduleTick};
    let b = h.backend();
    let (from, to) = (h.fresh_shard(), h.fresh_shard());
    let tick = tick_dedup_id("nightly", 1_800_000_000_000);
    let mut dies = NewJob::new("dk", "dead").with_dedup_id("order-17");
    dies.max_attempts = 1;
    let jobs = [
        dies,
        NewJob::new("dk", "tick").with_dedup_id(tick.clone()),
        NewJob::new("dk", "plain"),
    ];
    let stored = b
        .enqueue_dedup(&from, u64::MAX, &jobs, DEDUP_WINDOW_MS)
        .expect("enqueue");
    let dedup_of = |shard: &str, id| b.job(shard, id).expect("job").expect("live").dedup_id;
    assert_eq!(dedup_of(&from, stored[0].id).as_deref(), Some("order-17"));
    assert_eq!(dedup_of(&from, stored[2].id), None);
    // The first dies on its one attempt; the second's run lapses and it
    // runs again: every claim names its id.
    let run = claim(h, &from, 1, LONG_LEASE_MS).remove(0);
    assert_eq!(run.dedup_id.as_deref(), Some("order-17"));
    b.fail(&from, run.receipt(), "boom", None).expect("fail");
    let dead = b.job(&from, stored[0].id).expect("job").expect("kept");
    assert_eq!(
        (dead.state, dead.dedup_id.as_deref()),
        (JobState::Dead, Some("order-17"))
    );
    let first = claim(h, &from, 1, 1_000).remove(0);
    assert_eq!(first.dedup_id.as_deref(), Some(tick.as_str()));
    h.pass_ms(1_001);
    let again = claim(h, &from, 1, LONG_LEASE_MS).remove(0);
    assert_eq!(
        (again.id, again.attempt),
        (first.id, 2),
        "the lapsed run again"
    );
    let named =
        ScheduleTick::of_dedup_id(again.dedup_id.as_deref().expect("kept")).expect("a schedule's");
    assert_eq!(
        (named.id.as_str(), named.tick_ms),
        ("nightly", 1_800_000_000_000)
    );
    b.fail(&from, again.receipt(), "later", Some(3_600_000))
        .expect("fail");
    // Moved: the copies keep their ids, dead letter included.
    let moved = b.export_jobs(&from, "dk", None, 10).expect("export");
    let ids: Vec<Option<&str>> = moved.iter().map(|j| j.dedup_id.as_deref()).collect();
    assert_eq!(ids, [Some("order-17"), Some(tick.as_str()), None]);
    let pairs = b.import_jobs(&to, &from, "dk", &moved).expect("import");
    assert_eq!(pairs.len(), 3);
    for ((_, new), want) in pairs.iter().zip(&ids) {
        assert_eq!(dedup_of(&to, *new).as_deref(), *want);
    }
    // A moved job with a dedup id no backend could hold is refused whole.
    let mut bad = moved[2].clone();
    bad.id = JobId(bad.id.0 + 1_000);
    bad.dedup_id = Some("x".repeat(shardq_core::job::DEDUP_ID_BYTES_MAX + 1));
    assert!(b.import_jobs(&to, &from, "dk", &[bad]).is_err());
}

/// A key's records exported from one shard and imported into another make
/// the other shard answer with the original job (on the first shard); an
/// import again changes nothing, and a record the target already holds is
/// kept.
pub fn dedup_records_move_with_export_and_import(h: &dyn ContractHarness) {
    let from = h.fresh_shard();
    let to = h.fresh_shard();
    let orig = enqueue_dedup(
        h,
        &from,
        &[("m", "1"), ("m", "2"), ("other", "1")],
        DEDUP_WINDOW_MS,
    );
    let on_to = enqueue_dedup(h, &to, &[("m", "2")], DEDUP_WINDOW_MS);
    let records = h.backend().dedup_export(&from, "m").expect("export");
    let mut ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["1", "2"], "export gives the key's records only");
    assert!(records.iter().all(|r| r.key == "m" && r.shard == from));
    for _ in 0..2 {
        h.backend().dedup_import(&to, &records).expect("import");
    }
    let after = enqueue_dedup(
        h,
        &to,
        &[("m", "1"), ("m", "2"), ("other", "1")],
        DEDUP_WINDOW_MS,
    );
    assert!(after[0].duplicate, "an imported record suppresses the job");
    assert_eq!(
        (after[0].shard.as_str(), after[0].id),
        (from.as_str(), orig[0].id)
    );
    assert!(after[1].duplicate);
    assert_eq!(
        (after[1].shard.as_str(), after[1].id),
        (to.as_str(), on_to[0].id),
        "a record the target held is kept"
    );
    assert!(!after[2].duplicate, "another key's records did not move");
    assert_eq!(depth(h, &to, "m"), 1);
    let keys = h.backend().dedup_keys(&from).expect("dedup_keys");
    assert!(keys.contains(&"m".to_string()) && keys.contains(&"other".to_string()));
}

/// A dead letter of a key sealed for a move is neither retried nor purged
/// (its copy goes with the key; a change here would be lost with the
/// copies left behind), by id or with "all"; other keys' are, and once the
/// seal is lifted, so is it.
pub fn dead_letters_of_a_sealed_key_stay_as_they_are(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    enqueue(h, &shard, "s", "a", 1);
    enqueue(h, &shard, "f", "a", 1);
    let mut sealed_id = None;
    for run in claim(h, &shard, 10, LONG_LEASE_MS) {
        if run.key == "s" {
            sealed_id = Some(run.id);
        }
        b.fail(&shard, run.receipt(), "dead", None).expect("fail");
    }
    let sealed_id = sealed_id.expect("the key's head was claimed");
    let mut fence = b.fence(&shard).expect("fence");
    fence.sealed_keys.insert("s".into(), "elsewhere".into());
    b.set_fence(&shard, &fence).expect("seal");
    assert_eq!(b.dead_purge(&shard, Some(&[sealed_id])).expect("purge"), 0);
    assert_eq!(
        b.dead_retry(&shard, None).expect("retry all"),
        1,
        "only the other key's"
    );
    let dead = |k: &str| b.key_counts(&shard, k).expect("counts").dead;
    assert_eq!((dead("s"), dead("f")), (1, 0));
    // What a caller reports as left for a rerun, for every and for named ids.
    let left = |ids: Option<&[JobId]>| {
        shardq_core::backend::dead_left_moving(b, &shard, ids).expect("left")
    };
    assert_eq!(left(None), (1, vec!["s".to_string()]));
    assert_eq!(left(Some(&[sealed_id])), (1, vec!["s".to_string()]));
    fence.sealed_keys.remove("s");
    b.set_fence(&shard, &fence).expect("unseal");
    assert_eq!(b.dead_retry(&shard, Some(&[sealed_id])).expect("retry"), 1);
    assert_eq!(dead("s"), 0);
    assert_eq!(left(None), (0, Vec::new()));
}

/// An export from a cursor returns every job of the key above it, in id
/// order, even when dead letters retried around a retried head left the
/// key's queue out of id order (a skipped job would be purged by the move
/// that copied the others).
pub fn exports_find_every_job_above_a_cursor(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    for (payload, attempts) in [("1", 1), ("2", 1), ("3", 5), ("4", 5)] {
        enqueue(h, &shard, "x", payload, attempts);
    }
    let mut ids = Vec::new();
    for _ in 0..2 {
        let run = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
        ids.push(run.id);
        b.fail(&shard, run.receipt(), "dead", None).expect("fail");
    }
    let third = claim(h, &shard, 1, LONG_LEASE_MS).remove(0);
    ids.push(third.id);
    // The second dead letter goes back behind the running third job, the
    // third is retried (it stays the head), then the first goes back in
    // front of it.
    assert_eq!(b.dead_retry(&shard, Some(&ids[1..2])).expect("retry"), 1);
    b.fail(&shard, third.receipt(), "again", Some(0))
        .expect("fail");
    assert_eq!(b.dead_retry(&shard, Some(&ids[0..1])).expect("retry"), 1);
    let mut all: Vec<JobId> = b
        .key_jobs(&shard, "x", 10)
        .expect("key_jobs")
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(all.len(), 4, "every job is live: {all:?}");
    all.sort_unstable();
    for cursor in std::iter::once(None).chain(all.iter().copied().map(Some)) {
        let got: Vec<JobId> = b
            .export_jobs(&shard, "x", cursor, 100)
            .expect("export")
            .iter()
            .map(|j| j.id)
            .collect();
        let want: Vec<JobId> = all
            .iter()
            .copied()
            .filter(|&id| cursor.is_none_or(|c| id > c))
            .collect();
        assert_eq!(got, want, "export after {cursor:?}");
    }
}

/// The jobs a move's purge deleted (queued and dead) answer which key they
/// left with; a finished job, another key's live job and an id never
/// handed out answer nothing.
pub fn purged_jobs_say_they_moved_away(h: &dyn ContractHarness) {
    let shard = h.fresh_shard();
    let b = h.backend();
    enqueue(h, &shard, "m", "a", 1);
    enqueue(h, &shard, "o", "a", 5);
    enqueue(h, &shard, "m", "b", 5);
    enqueue(h, &shard, "m", "c", 5);
    let mut finished = None;
    for run in claim(h, &shard, 10, LONG_LEASE_MS) {
        if run.key == "m" {
            b.fail(&shard, run.receipt(), "dead", None).expect("fail");
        } else {
            finished = Some(run.id);
            ack_one(h, &shard, run.receipt());
        }
    }
    let finished = finished.expect("both keys' heads were claimed");
    enqueue(h, &shard, "o", "b", 5);
    let ids = |key: &str| -> Vec<JobId> {
        b.key_jobs(&shard, key, 10)
            .expect("key_jobs")
            .iter()
            .map(|j| j.id)
            .collect()
    };
    let (moving, other) = (ids("m"), ids("o"));
    assert_eq!((moving.len(), other.len()), (3, 1), "{moving:?} {other:?}");
    assert_eq!(b.purge_key(&shard, "m").expect("purge"), 3);
    for id in &moving {
        assert_eq!(
            b.moved_away(&shard, *id).expect("moved_away").as_deref(),
            Some("m"),
            "job {id} was deleted as its key moved"
        );
    }
    for id in [other[0], finished, JobId(u64::MAX / 2)] {
        assert_eq!(
            b.moved_away(&shard, id).expect("moved_away"),
            None,
            "job {id}"
        );
    }
}

/// An id from before a move finds its job's copy, through two moves
/// (a -> b -> c), with [`shardq_core::backend::follow_moves`] over the
/// backend's `moved_away` and `imported_as`; the copy's result is kept
/// under its new id. A job that never moved, and an id never handed out,
/// follow to nothing; a shard answers only for its own imports.
pub fn an_old_id_finds_its_copy_after_moves(h: &dyn ContractHarness) {
    use shardq_core::backend::follow_moves;
    let b = h.backend();
    let (sa, sb, sc) = (h.fresh_shard(), h.fresh_shard(), h.fresh_shard());
    let shards = [sa.clone(), sb.clone(), sc.clone()];
    // No map here: every shard is asked in turn.
    let no_route = |_: &str| None;
    for p in ["1", "2", "3"] {
        enqueue(h, &sa, "mv", p, 3);
    }
    enqueue(h, &sa, "st", "s", 3);
    let old: Vec<JobId> = b
        .key_jobs(&sa, "mv", 10)
        .expect("key_jobs")
        .iter()
        .map(|j| j.id)
        .collect();
    let stays = b.key_jobs(&sa, "st", 1).expect("key_jobs")[0].id;
    let move_key = |from: &str, to: &str| -> Vec<(JobId, JobId)> {
        let jobs = b.export_jobs(from, "mv", None, 10).expect("export");
        let pairs = b.import_jobs(to, from, "mv", &jobs).expect("import");
        b.purge_key(from, "mv").expect("purge");
        pairs
    };
    let ab = move_key(&sa, &sb);
    assert_eq!(ab.len(), 3);
    for (src, new) in &ab {
        assert_eq!(
            follow_moves(b, &shards, &no_route, &sa, *src).expect("follow"),
            Some((sb.clone(), *new)),
            "job {src} of {sa} after one move"
        );
        assert_eq!(
            b.imported_as(&sb, &sa, *src).expect("imported_as"),
            Some(*new)
        );
        assert_eq!(b.imported_as(&sc, &sa, *src).expect("imported_as"), None);
    }
    let bc = move_key(&sb, &sc);
    let now: Vec<(String, JobId)> = old
        .iter()
        .map(|id| {
            follow_moves(b, &shards, &no_route, &sa, *id)
                .expect("follow")
                .expect("found")
        })
        .collect();
    let want: Vec<(String, JobId)> = bc.iter().map(|(_, new)| (sc.clone(), *new)).collect();
    assert_eq!(now, want, "each old id follows to its copy on {sc}");
    // The copy runs and finishes with a result: the old id reaches it.
    let run = claim(h, &sc, 1, LONG_LEASE_MS).remove(0);
    assert_eq!((run.key.as_str(), run.id), ("mv", now[0].1));
    b.ack_results(&sc, &[run.receipt()], &[Some(b"r1".to_vec())])
        .expect("ack");
    let (at, id) = follow_moves(b, &shards, &no_route, &sa, old[0])
        .expect("follow")
        .expect("found");
    let f = shardq_core::backend::finished_job(b, &at, id)
        .expect("finished")
        .expect("kept");
    assert_eq!(f.result.as_deref(), Some(&b"r1"[..]));
    for id in [stays, JobId(u64::MAX / 2)] {
        assert_eq!(
            follow_moves(b, &shards, &no_route, &sa, id).expect("follow"),
            None,
            "job {id}"
        );
    }
}
