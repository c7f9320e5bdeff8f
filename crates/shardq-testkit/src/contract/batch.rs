//! Batches over the backend: each callback of a batch is enqueued once,
//! when it is due, through a move of a job's key, jobs added after the
//! close by a job of the batch, two resolvers and a callback repeated as
//! after a crash.

use std::sync::Arc;

use shardq_core::clock::{Clock, ManualClock};
use shardq_core::job::NewJob;
use shardq_core::memory::MemoryMapStore;
use shardq_core::reshard::MapStore;
use shardq_core::workflow::{
    batch_counts, callback_dedup_id, release_dedup_id_of, CallbackKind, DepOutcome, NewBatch,
    Release, Resolver, WaitState, WaitingStore,
};

use super::workflow::OnShard;
use super::{claim, ContractHarness, LONG_LEASE_MS};

fn new_batch(kinds: &[CallbackKind], key: &str) -> NewBatch {
    NewBatch {
        key: key.into(),
        max_attempts: 3,
        callbacks: kinds
            .iter()
            .map(|k| (*k, format!("{key} on {}", k.as_str()).into_bytes()))
            .collect(),
        dedup_id: None,
    }
}

fn with_attempts(key: &str, attempts: u32) -> NewJob {
    let mut j = NewJob::new(key, format!("payload of {key}"));
    j.max_attempts = attempts;
    j
}

/// A batch's complete and success callbacks are enqueued once, only after
/// it is closed and every job ended, though one job's key moved to
/// another shard before it ran, two jobs were added after the close while
/// a job of the batch was still pending, two resolvers pass and a
/// callback is enqueued again as after a crash. A batch with a dead job
/// fires its death callback once while still open, then complete and
/// never success. A complete batch takes no more jobs.
/// Long on purpose: one scenario on one harness, the batches opened, the
/// move, the adds after the close, the resolver passes and the checks in
/// the order they happen, each on the state the step before left.
pub fn a_batch_fires_each_callback_once(h: &dyn ContractHarness) {
    let b = h.backend();
    let (sa, sb) = (h.fresh_shard(), h.fresh_shard());
    let map = shardq_route::ShardMap::with_shards(
        shardq_route::Algorithm::default(),
        [sa.clone(), sb.clone()],
    )
    .expect("map");
    let maps: Arc<dyn MapStore> = Arc::new(MemoryMapStore::new(map));
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let now = clock.now_ms();
    let all = [
        CallbackKind::Complete,
        CallbackKind::Success,
        CallbackKind::Death,
    ];
    let (bn, dup) = WaitingStore::open_batch(&*maps, now, &new_batch(&all, "bt-cb")).expect("open");
    assert!(!dup);
    let mut job1 = with_attempts("bt-1", 3);
    job1.dedup_id = Some("first".into());
    let added = WaitingStore::add_to_batch(
        &*maps,
        now,
        bn,
        &[
            job1.clone(),
            with_attempts("bt-2", 3),
            with_attempts("bt-3", 3),
        ],
    )
    .expect("add");
    // Sent again after a lost answer: stored once.
    let again = WaitingStore::add_to_batch(&*maps, now, bn, &[job1]).expect("add again");
    assert_eq!(again, vec![(added[0].0, true)]);
    let mut one = Resolver::new(Arc::clone(&maps), Arc::clone(&clock) as Arc<dyn Clock>);
    let mut two = Resolver::new(Arc::clone(&maps), Arc::clone(&clock) as Arc<dyn Clock>);
    let mut rel = OnShard {
        h,
        shard: sb.clone(),
        calls: 0,
    };
    let r = one.pass(b, &mut rel).expect("pass");
    assert_eq!(r.released.len(), 3, "{r:?}");
    assert!(r.fired.is_empty(), "{r:?}");
    let stored = WaitingStore::load(&*maps).expect("load");
    for (m, _) in &added {
        let jobs = b.key_jobs(&sb, &stored.jobs[m].key, 10).expect("key_jobs");
        assert_eq!(jobs.len(), 1, "{jobs:?}");
        assert_eq!(
            jobs[0].dedup_id.as_deref(),
            Some(release_dedup_id_of(*m, &stored.jobs[m]).as_str()),
            "a job of a batch says which"
        );
    }
    // bt-1 runs; bt-2's key moves to sa and its copy runs there.
    let runs = claim(h, &sb, 10, LONG_LEASE_MS);
    let r1 = runs.iter().find(|j| j.key == "bt-1").expect("bt-1 runs");
    b.ack_results(&sb, &[r1.receipt()], &[Some(b"one".to_vec())])
        .expect("ack 1");
    let r2 = runs.iter().find(|j| j.key == "bt-2").expect("bt-2 claimed");
    b.fail(&sb, r2.receipt(), "moving", Some(0))
        .expect("fail 2");
    let jobs = b.export_jobs(&sb, "bt-2", None, 10).expect("export");
    b.import_jobs(&sa, &sb, "bt-2", &jobs).expect("import");
    b.purge_key(&sb, "bt-2").expect("purge");
    let copy = claim(h, &sa, 10, LONG_LEASE_MS);
    let c2 = copy.iter().find(|j| j.key == "bt-2").expect("copy runs");
    b.ack_results(&sa, &[c2.receipt()], &[Some(b"two".to_vec())])
        .expect("ack 2");
    // Open, with bt-3 pending: nothing fires. Then a job is added while
    // open, the batch closes, and one more is added (bt-3 has not ended:
    // a job of the batch fanning out).
    for r in [&mut one, &mut two] {
        let rep = r.pass(b, &mut rel).expect("pass");
        assert!(rep.fired.is_empty(), "{rep:?}");
    }
    WaitingStore::add_to_batch(&*maps, now, bn, &[with_attempts("bt-4", 3)]).expect("add 4");
    WaitingStore::close_batch(&*maps, bn, now).expect("close");
    WaitingStore::add_to_batch(&*maps, now, bn, &[with_attempts("bt-5", 3)])
        .expect("a closed batch with a pending job takes jobs");
    let rep = one.pass(b, &mut rel).expect("pass");
    assert_eq!(rep.released.len(), 2, "{rep:?}");
    assert!(rep.fired.is_empty(), "{rep:?}");
    let r3 = runs.iter().find(|j| j.key == "bt-3").expect("bt-3 claimed");
    b.ack_results(&sb, &[r3.receipt()], &[None]).expect("ack 3");
    for _ in 0..3 {
        let runs = claim(h, &sb, 10, LONG_LEASE_MS);
        if runs.is_empty() {
            break;
        }
        for run in runs {
            assert_ne!(run.key, "bt-cb", "a callback ran before its batch ended");
            b.ack_results(&sb, &[run.receipt()], &[None]).expect("ack");
        }
    }
    let r1 = one.pass(b, &mut rel).expect("pass");
    let r2 = two.pass(b, &mut rel).expect("pass");
    let fired: Vec<CallbackKind> = r1.fired.iter().chain(&r2.fired).map(|f| f.1).collect();
    assert!(
        fired.contains(&CallbackKind::Complete) && fired.contains(&CallbackKind::Success),
        "{r1:?} {r2:?}"
    );
    assert!(!fired.contains(&CallbackKind::Death), "{fired:?}");
    let stored = WaitingStore::load(&*maps).expect("load");
    let w = &stored.jobs[&bn];
    assert_eq!(w.state, WaitState::Released, "the batch is done");
    let c = batch_counts(w);
    assert_eq!((c.jobs, c.completed, c.pending), (5, 5, 0), "{c:?}");
    assert_eq!(stored.callbacks_fired_total, 2);
    assert_eq!(
        w.after[0].result_b64.as_deref(),
        Some("b25l"),
        "base64 of one"
    );
    // A callback enqueued again (a resolver killed before its record)
    // stores nothing twice.
    let repeat = NewJob::new("bt-cb", "bt-cb on complete").with_dedup_id(callback_dedup_id(
        bn,
        &w.nonce,
        CallbackKind::Complete,
    ));
    let (_, id) = rel.release(&repeat).expect("repeat");
    let cbs = b.key_jobs(&sb, "bt-cb", 10).expect("key_jobs");
    assert_eq!(cbs.len(), 2, "complete and success, once each: {cbs:?}");
    let recorded = w.batch.as_ref().expect("batch").fired[&CallbackKind::Complete].clone();
    assert_eq!(format!("{sb}:{}", id.0), recorded);
    let mut ids: Vec<String> = cbs.iter().filter_map(|j| j.dedup_id.clone()).collect();
    ids.sort();
    assert_eq!(
        ids,
        vec![
            callback_dedup_id(bn, &w.nonce, CallbackKind::Complete),
            callback_dedup_id(bn, &w.nonce, CallbackKind::Success)
        ]
    );
    let e = WaitingStore::add_to_batch(&*maps, now, bn, &[with_attempts("bt-6", 3)])
        .expect_err("a complete batch takes no job")
        .to_string();
    assert!(e.contains(&format!("@{bn}")), "{e}");

    // A dead job: the death callback at once (the batch still open), then
    // complete once closed, never success.
    let (dn, _) = WaitingStore::open_batch(&*maps, now, &new_batch(&all, "bd-cb")).expect("open");
    WaitingStore::add_to_batch(
        &*maps,
        now,
        dn,
        &[with_attempts("bd-1", 1), with_attempts("bd-2", 3)],
    )
    .expect("add");
    one.pass(b, &mut rel).expect("pass");
    let runs = claim(h, &sb, 10, LONG_LEASE_MS);
    let d1 = runs.iter().find(|j| j.key == "bd-1").expect("bd-1 runs");
    b.fail(&sb, d1.receipt(), "boom", None).expect("fail");
    let rep = one.pass(b, &mut rel).expect("pass");
    assert_eq!(
        rep.fired.iter().map(|f| (f.0, f.1)).collect::<Vec<_>>(),
        vec![(dn, CallbackKind::Death)],
        "{rep:?}"
    );
    let rep = two.pass(b, &mut rel).expect("pass");
    assert!(rep.fired.is_empty(), "death fires once: {rep:?}");
    WaitingStore::close_batch(&*maps, dn, now).expect("close");
    let d2 = runs.iter().find(|j| j.key == "bd-2").expect("bd-2 runs");
    b.ack_results(&sb, &[d2.receipt()], &[None]).expect("ack");
    let rep = one.pass(b, &mut rel).expect("pass");
    assert_eq!(
        rep.fired.iter().map(|f| f.1).collect::<Vec<_>>(),
        vec![CallbackKind::Complete],
        "{rep:?}"
    );
    let w = &WaitingStore::load(&*maps).expect("load").jobs[&dn];
    assert_eq!(w.state, WaitState::Released);
    assert_eq!(w.after[0].outcome, Some(DepOutcome::Dead));
    assert_eq!(b.key_jobs(&sb, "bd-cb", 10).expect("key_jobs").len(), 2);
}
