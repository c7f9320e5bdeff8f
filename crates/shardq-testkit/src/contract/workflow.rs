//! Dependencies over the backend: a dependent runs once, after every
//! dependency ended, with their outcomes and results, through a move of a
//! dependency's key, a second resolver and a release repeated after a
//! crash; a dependency that did not complete decides by the policy.

use std::sync::Arc;

use shardq_core::backend::{find_job, finished_job, JobLookup};
use shardq_core::clock::{Clock, ManualClock};
use shardq_core::job::{JobId, NewJob};
use shardq_core::memory::MemoryMapStore;
use shardq_core::reshard::MapStore;
use shardq_core::workflow::{
    release_dedup_id, DepOutcome, DepRef, NewDependent, OnDependencyFailure, Release, ReleaseError,
    Released, Resolver, WaitState, WaitingStore, FORGOTTEN_AFTER_MS, FORGOTTEN_MOVED_AFTER_MS,
    RELEASE_DEDUP_WINDOW_MS,
};

use super::{claim, enqueue, ContractHarness, LONG_LEASE_MS};

/// Releases onto one shard with the backend's own dedup, counting calls
/// (the batches' check uses it too).
pub(super) struct OnShard<'a> {
    pub(super) h: &'a dyn ContractHarness,
    pub(super) shard: String,
    pub(super) calls: usize,
}

impl Release for OnShard<'_> {
    fn release(&mut self, job: &NewJob) -> Released {
        self.calls += 1;
        let stored = self
            .h
            .backend()
            .enqueue_dedup(
                &self.shard,
                u64::MAX,
                std::slice::from_ref(job),
                RELEASE_DEDUP_WINDOW_MS,
            )
            .map_err(|e| ReleaseError::again(e.to_string()))?;
        Ok((self.shard.clone(), stored[0].id))
    }
}

fn only_job(h: &dyn ContractHarness, shard: &str, key: &str) -> JobId {
    let jobs = h.backend().key_jobs(shard, key, 10).expect("key_jobs");
    assert_eq!(jobs.len(), 1, "key {key} on {shard}: {jobs:?}");
    jobs[0].id
}

fn dependent(key: &str, after: Vec<DepRef>, on_failure: OnDependencyFailure) -> NewDependent {
    NewDependent {
        job: NewJob::new(key, format!("payload of {key}")),
        after,
        on_failure,
    }
}

/// A dependent starts once, after all its dependencies ended, with their
/// results, though one dependency's key moved to another shard before it
/// finished, a second resolver runs the same passes and a release is
/// repeated (a resolver killed between its enqueue and its record). A
/// chain link waits for the dependent before it. A cancelled dependency
/// fails a `fail` dependent naming it and runs a `run` one; a purged one
/// is `forgotten` once it has been missing for a while.
/// Long on purpose: one scenario on one harness, the dependents set up, the
/// move, the cancel and the purge, the resolver passes and the checks in
/// the order they happen, each on the state the step before left.
pub fn dependents_run_once_after_their_dependencies(h: &dyn ContractHarness) {
    let b = h.backend();
    let (sa, sb) = (h.fresh_shard(), h.fresh_shard());
    let map = shardq_route::ShardMap::with_shards(
        shardq_route::Algorithm::default(),
        [sa.clone(), sb.clone()],
    )
    .expect("map");
    let maps: Arc<dyn MapStore> = Arc::new(MemoryMapStore::new(map));
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let shards = [sa.clone(), sb.clone()];
    let no_route = |_: &str| None;
    let mut lookup = |s: &str, id: JobId| {
        let mut finished = |s: &str, id| finished_job(b, s, id);
        find_job(b, &shards, &no_route, &mut finished, s, id)
    };
    for (s, k) in [(&sa, "wf-a"), (&sb, "wf-b"), (&sa, "wf-x"), (&sb, "wf-y")] {
        enqueue(h, s, k, k, 3);
    }
    let a = DepRef::Job(sa.clone(), only_job(h, &sa, "wf-a"));
    let bb = DepRef::Job(sb.clone(), only_job(h, &sb, "wf-b"));
    let x = DepRef::Job(sa.clone(), only_job(h, &sa, "wf-x"));
    let y = DepRef::Job(sb.clone(), only_job(h, &sb, "wf-y"));
    // An id no shard knows is refused, naming it.
    let ghost = DepRef::Job(sa.clone(), JobId(u64::MAX / 2));
    let e = WaitingStore::add(
        &*maps,
        &mut lookup,
        clock.now_ms(),
        &[dependent(
            "wf-c",
            vec![ghost.clone()],
            OnDependencyFailure::Fail,
        )],
    )
    .expect_err("an unknown dependency must be refused")
    .to_string();
    assert!(e.contains(&ghost.to_string()), "{e}");
    // c after a and b; d after c (a chain link); e after a and x (run);
    // f after x (fail); g after y (fail).
    let ns = WaitingStore::add(
        &*maps,
        &mut lookup,
        clock.now_ms(),
        &[
            dependent(
                "wf-c",
                vec![a.clone(), bb.clone()],
                OnDependencyFailure::Fail,
            ),
            dependent("wf-d", vec![DepRef::Node(0)], OnDependencyFailure::Fail),
            dependent("wf-e", vec![a.clone(), x.clone()], OnDependencyFailure::Run),
            dependent("wf-f", vec![x.clone()], OnDependencyFailure::Fail),
            dependent("wf-g", vec![y.clone()], OnDependencyFailure::Fail),
        ],
    )
    .expect("add");
    assert!(ns.iter().all(|(_, dup)| !dup), "{ns:?}");
    let (c, d, e_, f, g) = (ns[0].0, ns[1].0, ns[2].0, ns[3].0, ns[4].0);
    // A dependent sent again with its dedup id is stored once; the same
    // id under another key is another dependent.
    let with_id = |key: &str| {
        let mut d = dependent(key, vec![a.clone()], OnDependencyFailure::Fail);
        d.job.dedup_id = Some("graph-1".into());
        d
    };
    let first =
        WaitingStore::add(&*maps, &mut lookup, clock.now_ms(), &[with_id("wf-u")]).expect("add u");
    let again = WaitingStore::add(&*maps, &mut lookup, clock.now_ms(), &[with_id("wf-u")])
        .expect("add u again");
    assert_eq!((first[0].1, again[0]), (false, (first[0].0, true)));
    let other =
        WaitingStore::add(&*maps, &mut lookup, clock.now_ms(), &[with_id("wf-v")]).expect("add v");
    assert!(!other[0].1 && other[0].0 != first[0].0, "{other:?}");
    let mut one = Resolver::new(Arc::clone(&maps), Arc::clone(&clock) as Arc<dyn Clock>);
    let mut two = Resolver::new(Arc::clone(&maps), Arc::clone(&clock) as Arc<dyn Clock>);
    let mut rel = OnShard {
        h,
        shard: sb.clone(),
        calls: 0,
    };
    let r = one.pass(b, &mut rel).expect("pass");
    assert!(r.released.is_empty() && r.failed.is_empty(), "{r:?}");
    assert_eq!(b.purge_key(&sb, "wf-y").expect("purge y"), 1);
    assert!(b.key_jobs(&sb, "wf-c", 10).expect("key_jobs").is_empty());
    // a runs and returns a result; b's key moves to sa, then its copy runs.
    let run = claim(h, &sa, 1, LONG_LEASE_MS).remove(0);
    assert_eq!(run.key, "wf-a");
    b.ack_results(&sa, &[run.receipt()], &[Some(b"ra".to_vec())])
        .expect("ack a");
    let jobs = b.export_jobs(&sb, "wf-b", None, 10).expect("export");
    b.import_jobs(&sa, &sb, "wf-b", &jobs).expect("import");
    b.purge_key(&sb, "wf-b").expect("purge");
    let r = two.pass(b, &mut rel).expect("pass");
    assert!(
        r.released.iter().all(|p| p.0 != c),
        "c released before b ended: {r:?}"
    );
    // x runs? No: it is cancelled while queued.
    assert_eq!(
        b.cancel(&sa, only_job(h, &sa, "wf-x")).expect("cancel"),
        shardq_core::job::CancelOutcome::Cancelled
    );
    let copy = claim(h, &sa, 4, LONG_LEASE_MS);
    let copy = copy
        .into_iter()
        .find(|j| j.key == "wf-b")
        .expect("b's copy runs");
    b.ack_results(&sa, &[copy.receipt()], &[Some(b"rb".to_vec())])
        .expect("ack b");
    // Both resolvers pass; c, e released once, f failed naming x.
    let r1 = one.pass(b, &mut rel).expect("pass");
    let r2 = two.pass(b, &mut rel).expect("pass");
    let released: Vec<u64> = r1
        .released
        .iter()
        .chain(&r2.released)
        .map(|p| p.0)
        .collect();
    assert!(
        released.contains(&c) && released.contains(&e_),
        "{r1:?} {r2:?}"
    );
    let stored = WaitingStore::load(&*maps).expect("load");
    let wc = &stored.jobs[&c];
    assert_eq!(wc.state, WaitState::Released);
    assert_eq!(
        wc.after.iter().map(|d| d.outcome).collect::<Vec<_>>(),
        vec![Some(DepOutcome::Completed); 2]
    );
    assert!(
        wc.after[1].at.is_some(),
        "b's copy is named: {:?}",
        wc.after[1]
    );
    let results: Vec<Option<&str>> = wc.after.iter().map(|d| d.result_b64.as_deref()).collect();
    assert_eq!(
        results,
        vec![Some("cmE="), Some("cmI=")],
        "base64 of ra, rb"
    );
    let wf = &stored.jobs[&f];
    assert_eq!(wf.state, WaitState::Failed);
    let why = wf.reason.as_deref().unwrap_or("");
    assert!(
        why.contains(&x.to_string()) && why.contains("cancelled"),
        "{why}"
    );
    assert_eq!(stored.jobs[&e_].state, WaitState::Released);
    assert_eq!(
        stored.jobs[&e_].after[1].outcome,
        Some(DepOutcome::Cancelled)
    );
    assert_eq!(
        stored.jobs[&d].state,
        WaitState::Waiting,
        "d waits for c's run"
    );
    // A release repeated after a crash stores nothing twice.
    let calls = rel.calls;
    let again =
        NewJob::new("wf-c", "payload of wf-c").with_dedup_id(release_dedup_id(c, &wc.nonce));
    let (_, dup) = rel.release(&again).expect("release again");
    assert_eq!(
        format!("{sb}:{}", dup.0),
        wc.released.clone().unwrap_or_default(),
        "a repeated release answers the first job"
    );
    assert_eq!(rel.calls, calls + 1);
    let cjobs = b.key_jobs(&sb, "wf-c", 10).expect("key_jobs");
    assert_eq!(cjobs.len(), 1, "c is stored once: {cjobs:?}");
    assert_eq!(
        cjobs[0].dedup_id.as_deref(),
        Some(release_dedup_id(c, &wc.nonce).as_str())
    );
    assert_eq!(cjobs[0].payload, b"payload of wf-c");
    // c runs; then d, the next link, is released.
    let run = claim(h, &sb, 10, LONG_LEASE_MS);
    let crun = run.iter().find(|j| j.key == "wf-c").expect("c runs");
    b.ack_results(&sb, &[crun.receipt()], &[Some(b"rc".to_vec())])
        .expect("ack c");
    let r = one.pass(b, &mut rel).expect("pass");
    assert_eq!(r.released.iter().map(|p| p.0).collect::<Vec<_>>(), vec![d]);
    let wd = &WaitingStore::load(&*maps).expect("load").jobs[&d];
    assert_eq!(wd.after[0].at, wc.released, "d's dependency ran as c's job");
    assert_eq!(wd.after[0].result_b64.as_deref(), Some("cmM="));
    // y was purged before it ran, as a move purges what it copied: its
    // shard remembers it as moved away with its key, and no copy is found;
    // g fails as forgotten, only once y has been missing for the longer
    // grace of a moved job (its new shard may be down).
    assert_eq!(
        stored.jobs[&g].state,
        WaitState::Waiting,
        "forgotten at once"
    );
    clock.advance(FORGOTTEN_AFTER_MS + 1);
    let r = one.pass(b, &mut rel).expect("pass");
    assert!(
        r.failed.is_empty(),
        "forgotten after the short grace: {r:?}"
    );
    clock.advance(FORGOTTEN_MOVED_AFTER_MS);
    let r = one.pass(b, &mut rel).expect("pass");
    assert_eq!(
        r.failed.iter().map(|p| p.0).collect::<Vec<_>>(),
        vec![g],
        "{r:?}"
    );
    assert!(r.failed[0].1.contains("forgotten"), "{r:?}");
    assert_eq!(r.waiting, 0);
    // Every released dependent's job exists once: c finished, d and e
    // queued.
    let done = b.finished(&sb, None, 100).expect("finished");
    assert_eq!(done.iter().filter(|j| j.key == "wf-c").count(), 1);
    for (key, n) in [("wf-d", d), ("wf-e", e_)] {
        let jobs = b.key_jobs(&sb, key, 10).expect("key_jobs");
        assert_eq!(jobs.len(), 1, "{key}: {jobs:?}");
        assert_eq!(
            jobs[0].dedup_id.as_deref(),
            Some(release_dedup_id(n, &stored.jobs[&n].nonce).as_str())
        );
    }
    assert!(matches!(
        lookup(&sa, JobId(u64::MAX / 2)),
        Ok(JobLookup::Unknown)
    ));
}
