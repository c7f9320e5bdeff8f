//! The backend contract (`shardq_testkit::contract`) on Redis with a manual
//! clock: one test per check, each on a redis-server of its own (`cargo
//! test -p shardq-redis --test integration one_run_per_key` runs one). The
//! store is rewound by `FLUSHALL` and `RESTORE` of the shard's keys as
//! `DUMP`ed earlier (what a restore from an older snapshot or a promoted
//! lagging replica shows).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use shardq_core::{Clock, InspectJobs, ManualClock, MoveKeys, QueueBackend, RunJobs};
use shardq_redis::{RedisBackend, RedisCoordinator};
use shardq_testkit::contract::{self, ContractHarness, RewindHarness};
use shardq_testkit::redis::{RedisServer, ServerOptions};

use crate::common::{init, map_of, opts_manual, owner};

const SHARDS: usize = 40;

struct Redis {
    backend: RedisBackend,
    clock: ManualClock,
    next: AtomicUsize,
    _owner: RedisCoordinator,
    server: RedisServer,
    flow: std::sync::Arc<shardq_core::FlowControl>,
    /// Every key of the server and its `DUMP`, at the last checkpoint.
    saved: Mutex<Vec<(String, Vec<u8>)>>,
}

impl RewindHarness for Redis {
    fn checkpoint(&self, _shard: &str) {
        let mut con = self.server.connection();
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).expect("KEYS");
        let mut saved = Vec::new();
        for k in keys {
            let dump: Vec<u8> = redis::cmd("DUMP").arg(&k).query(&mut con).expect("DUMP");
            saved.push((k, dump));
        }
        *self.saved.lock().unwrap() = saved;
    }
    fn rewind(&self, _shard: &str) {
        let mut con = self.server.connection();
        let () = redis::cmd("FLUSHALL").query(&mut con).expect("FLUSHALL");
        for (k, dump) in self.saved.lock().unwrap().drain(..) {
            let () = redis::cmd("RESTORE")
                .arg(&k)
                .arg(0)
                .arg(dump)
                .query(&mut con)
                .expect("RESTORE");
        }
    }
}

impl ContractHarness for Redis {
    fn backend(&self) -> &dyn QueueBackend {
        &self.backend
    }
    fn fresh_shard(&self) -> String {
        let i = self.next.fetch_add(1, Ordering::SeqCst);
        assert!(i < SHARDS, "the harness has {SHARDS} shards");
        format!("c-{i}")
    }
    fn pass_ms(&self, ms: u64) {
        self.clock.advance(ms);
    }
    fn flow(&self) -> Option<&shardq_core::FlowControl> {
        Some(&self.flow)
    }
}

/// The contract's harness on `server`: `SHARDS` shards, flow control with
/// `settings` and its group buckets in the map store's Redis (as a
/// deployment has them).
fn harness(server: RedisServer, settings: shardq_core::flow::FlowSettings) -> Redis {
    let names: Vec<(String, String)> = (0..SHARDS)
        .map(|i| (format!("c-{i}"), server.url()))
        .collect();
    let refs: Vec<(&str, String)> = names.iter().map(|(n, u)| (n.as_str(), u.clone())).collect();
    let map = map_of(&refs);
    init(&map);
    let clock = ManualClock::new(1_700_000_000_000);
    let mut opts = opts_manual(&clock);
    opts.retry_rules = std::sync::Arc::new(contract::retry_rules());
    let groups = shardq_redis::RedisMapStore::open(&server.url()).expect("map store");
    let flow = std::sync::Arc::new(shardq_core::FlowControl::new(
        settings,
        std::sync::Arc::new(groups),
    ));
    opts.flow = Some(std::sync::Arc::clone(&flow));
    let backend = RedisBackend::open(&map, opts).expect("open");
    let coordinator = owner(&backend, "contract", 600_000);
    Redis {
        backend,
        clock,
        next: AtomicUsize::new(0),
        _owner: coordinator,
        server,
        saved: Mutex::default(),
        flow,
    }
}

/// Ranking over shards with weights alone, no limit set (the claim's
/// limits path then never runs): the shards still share one virtual time.
#[test]
fn redis_ranks_over_shards_with_weights_alone() {
    let mut settings = contract::flow_settings();
    settings.groups.clear();
    settings.prefixes.retain(|_, p| {
        p.group = None;
        p.rate = None;
        p.burst = None;
        p.weight != 1 || p.priority != 0
    });
    settings.default = Default::default();
    assert!(settings.ranks_keys() && !settings.limits_starts());
    let h = harness(RedisServer::start(), settings);
    contract::ranks_compare_across_the_shards_of_a_process(&h);
}

shardq_testkit::contract_tests!(
    harness(RedisServer::start(), contract::flow_settings()),
    rewind,
    after = group_state_reads_back,
);

/// The checks that start runs of keys in the group `contract-group` (rate
/// limited), and of keys in `contract-slots` (two runs at once): each
/// leaves that group's state stored.
const RATE_GROUP_CHECKS: &[&str] = &[
    "rate_limits_hold_across_every_claim",
    "a_backed_off_run_keeps_its_attempt_and_holds_its_key",
];
const SLOT_GROUP_CHECKS: &[&str] = &["a_groups_concurrency_caps_its_runs_over_every_shard"];

/// After each check, the group state it left in the map store's Redis (as
/// a deployment keeps it), read as `shardq status` reads it: the rate
/// group's bucket has its rate and at most its burst; the slot group holds
/// no more run slots than its two (every run a check started was acked,
/// failed, backed off or lapsed); a group no key names has no state.
fn group_state_reads_back(h: &Redis, check: &str) {
    use shardq_core::GroupBuckets;
    let groups = shardq_redis::RedisMapStore::open(&h.server.url()).expect("map store");
    match groups.peek("contract-group").expect("peek") {
        Some(state) => {
            let b = state.bucket;
            assert_eq!((b.count, b.per_ms), (20, 1_000), "after {check}: {b:?}");
            assert!(
                b.units <= 3 * 1_000,
                "at most the burst after {check}: {b:?}"
            );
        }
        None => assert!(
            !RATE_GROUP_CHECKS.contains(&check),
            "{check} started runs in contract-group, yet it has no bucket"
        ),
    }
    match groups.peek("contract-slots").expect("peek") {
        Some(slots) => assert!(slots.slots.len() <= 2, "after {check}: {slots:?}"),
        None => assert!(
            !SLOT_GROUP_CHECKS.contains(&check),
            "{check} started runs in contract-slots, yet no slot was taken"
        ),
    }
    assert!(groups.peek("no-such-group").expect("peek").is_none());
}

/// Dedup records are shard keys: a server restarted from its AOF and a
/// backend opened afresh still answer with the original job, until the
/// window ends; the enqueue script prunes expired records as it goes.
#[test]
fn redis_dedup_records_survive_a_restart_for_their_window() {
    let mut server = RedisServer::start_with(ServerOptions {
        aof_always: true,
        ..Default::default()
    });
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let clock = ManualClock::new(1_700_000_000_000);
    let window = 60_000;
    let job = |d: &str| shardq_core::NewJob::new("k", "p").with_dedup_id(d);
    let first = {
        let b = RedisBackend::open(&map, opts_manual(&clock)).expect("open");
        b.enqueue_dedup("r0", 1, &[job("inv-1"), job("inv-2")], window)
            .unwrap()
    };
    assert!(first.iter().all(|s| !s.duplicate));
    server.restart();
    clock.advance(window / 2);
    let b = RedisBackend::open(&map, opts_manual(&clock)).expect("open");
    let again = b
        .enqueue_dedup("r0", 1, &[job("inv-1"), job("inv-2")], window)
        .unwrap();
    assert!(again.iter().all(|s| s.duplicate), "{again:?}");
    assert_eq!(again[0].id, first[0].id);
    assert_eq!(again[1].id, first[1].id);
    assert_eq!(b.key_counts("r0", "k").unwrap().depth, 2);
    clock.advance(window);
    let later = b.enqueue_dedup("r0", 1, &[job("inv-1")], window).unwrap();
    assert!(!later[0].duplicate, "an expired record frees the id");
    // The expired record of inv-2 was pruned by that enqueue; inv-1's new
    // one is the only record left.
    let records = b.dedup_export("r0", "k").unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].id, "inv-1");
    let fields = server.cli(&["HLEN", &b.shard_keys("r0").unwrap()[13]]);
    assert_eq!(fields.trim(), "1", "expired records are pruned");
}

/// Dedup records expire through one index, `dedupm`: a mark per enqueue
/// batch, and per expiry among the records one import call stored (a
/// move's). Each enqueue forgets at most two expired marks, oldest first,
/// and a mark forgets only the records still expired: an id stored again
/// keeps its new record. Imported records are answered as duplicates
/// within their window and forgotten once expired, as enqueued ones are.
#[test]
fn redis_dedup_marks_forget_only_what_expired() {
    use shardq_core::{DedupRecord, JobId};
    let server = RedisServer::start();
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let clock = ManualClock::new(1_700_000_000_000);
    let window = 60_000;
    let job = |d: &str| shardq_core::NewJob::new("k", "p").with_dedup_id(d);
    let b = RedisBackend::open(&map, opts_manual(&clock)).expect("open");
    let parts = b.shard_keys("r0").unwrap();
    let part = |name: &str| &parts[shardq_redis::keys::part_index(name).expect(name)];
    let (dedup, dedupm) = (part("dedup"), part("dedupm"));
    let count = |cmd: &str, key: &str| -> u64 { server.cli(&[cmd, key]).trim().parse().unwrap() };
    let mut first = Vec::new();
    for d in ["a", "b", "c"] {
        first.extend(b.enqueue_dedup("r0", 1, &[job(d)], window).unwrap());
    }
    assert_eq!(count("ZCARD", dedupm), 3, "a mark per batch");
    // A move brings records of two expiries, and one for c, whose live
    // record here stays.
    let t0 = clock.now_ms();
    let rec = |d: &str, expires_ms: u64, job: u64| DedupRecord {
        key: "k".into(),
        id: d.into(),
        shard: "elsewhere".into(),
        job: JobId(job),
        expires_ms,
    };
    b.dedup_import(
        "r0",
        &[
            rec("i1", t0 + 1_000, 900),
            rec("i2", t0 + 1_000, 901),
            rec("old", t0 + 2_000, 902),
            rec("c", t0 + 5_000, 903),
        ],
    )
    .unwrap();
    assert_eq!(count("HLEN", dedup), 6);
    let marks = server.cli(&["ZRANGE", dedupm, "0", "-1"]);
    let imported = marks.lines().filter(|l| l.starts_with('@')).count();
    assert_eq!(imported, 2, "a mark per expiry of the import: {marks}");
    let dups = b
        .enqueue_dedup("r0", 1, &[job("c"), job("i1")], window)
        .unwrap();
    assert!(dups.iter().all(|s| s.duplicate), "{dups:?}");
    assert_eq!((dups[0].id, dups[0].shard.as_str()), (first[2].id, "r0"));
    assert_eq!(
        (dups[1].id, dups[1].shard.as_str()),
        (JobId(900), "elsewhere")
    );

    clock.advance(window + 1);
    // Every record expired. This enqueue forgets the two oldest marks (the
    // import's: i1, i2 and old), then stores c and old again over their
    // expired records.
    let again = b
        .enqueue_dedup("r0", 1, &[job("c"), job("old")], window)
        .unwrap();
    assert!(again.iter().all(|s| !s.duplicate), "{again:?}");
    assert_eq!(count("ZCARD", dedupm), 4, "two forgotten, one written");
    assert_eq!(count("HLEN", dedup), 4, "a, b (expired), c, old");
    // The next ones forget a's and b's batches, then c's old one, which
    // keeps c's new record.
    b.enqueue_dedup("r0", 1, &[job("d")], window).unwrap();
    assert_eq!(count("HLEN", dedup), 3, "c, old, d");
    b.enqueue_dedup("r0", 1, &[job("e")], window).unwrap();
    assert_eq!(count("ZCARD", dedupm), 3, "the live batches' marks");
    let retry = b
        .enqueue_dedup("r0", 1, &[job("c"), job("old")], window)
        .unwrap();
    assert!(retry.iter().all(|s| s.duplicate), "{retry:?}");
    assert_eq!((retry[0].id, retry[1].id), (again[0].id, again[1].id));
    let mut left: Vec<String> = b
        .dedup_export("r0", "k")
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    left.sort();
    assert_eq!(left, ["c", "d", "e", "old"]);
    assert_eq!(count("HLEN", dedup), 4, "expired records are forgotten");
}

/// The map store's Redis put back to an older state, holding a group's run
/// slots (two runs at once, `contract-slots`). Slots that come back from
/// runs long over hold the group only until those runs' leases lapse, then
/// it runs again; slots that are lost while their runs go on are taken back
/// by the runs' next heartbeat, after which the cap holds again. (Between
/// the loss and that heartbeat a claim may start runs beyond the cap: the
/// store no longer knows of the live ones.)
#[test]
fn a_groups_run_slots_come_back_from_an_older_store_within_a_lease() {
    let server = RedisServer::start();
    let map = map_of(&[("g0", server.url())]);
    init(&map);
    let clock = ManualClock::new(1_700_000_000_000);
    let mut opts = opts_manual(&clock);
    let groups = shardq_redis::RedisMapStore::open(&server.url()).expect("map store");
    opts.flow = Some(std::sync::Arc::new(shardq_core::FlowControl::new(
        contract::flow_settings(),
        std::sync::Arc::new(groups),
    )));
    let backend = RedisBackend::open(&map, opts).expect("open");
    let _owner = owner(&backend, "slots", 600_000);
    for k in ["a", "b", "c", "d"] {
        for p in ["1", "2"] {
            let job = shardq_core::NewJob::new(format!("contract-slot:{k}"), p);
            backend.enqueue("g0", 1, &[job]).expect("enqueue");
        }
    }
    let lease = 10_000;
    let mut con = server.connection();
    let slot_keys = |con: &mut redis::Connection| -> Vec<String> {
        redis::cmd("KEYS")
            .arg("*flowslots*")
            .query(con)
            .expect("KEYS")
    };
    let runs = backend.claim("g0", 10, lease).expect("claim");
    assert_eq!(runs.len(), 2, "two runs of the group at once");
    let keys = slot_keys(&mut con);
    assert_eq!(keys.len(), 1, "{keys:?}");
    let saved: Vec<u8> = redis::cmd("DUMP")
        .arg(&keys[0])
        .query(&mut con)
        .expect("DUMP");

    // 1. Ghosts: the store comes back with the slots of two runs that are
    // over (acked since). The group starts nothing until their leases end.
    let receipts: Vec<_> = runs.iter().map(|r| r.receipt()).collect();
    backend.ack("g0", &receipts).expect("ack");
    let () = redis::cmd("RESTORE")
        .arg(&keys[0])
        .arg(0)
        .arg(&saved)
        .arg("REPLACE")
        .query(&mut con)
        .expect("RESTORE");
    for step in [50, 1_000, 5_000] {
        clock.advance(step);
        assert!(
            backend.claim("g0", 10, lease).expect("claim").is_empty(),
            "the old slots hold the group while their leases run"
        );
    }
    clock.advance(lease);
    let runs = backend.claim("g0", 10, lease).expect("claim");
    assert_eq!(runs.len(), 2, "once the old slots lapsed, two runs again");

    // 2. Lost: the store comes back without the slots of the two runs that
    // go on. Their heartbeat takes the slots back; the cap holds again.
    let () = redis::cmd("DEL")
        .arg(&keys[0])
        .query(&mut con)
        .expect("DEL");
    let receipts: Vec<_> = runs.iter().map(|r| r.receipt()).collect();
    let stale = backend.extend("g0", &receipts, lease).expect("extend");
    assert!(stale.is_empty(), "the runs are current: {stale:?}");
    clock.advance(50);
    assert!(
        backend.claim("g0", 10, lease).expect("claim").is_empty(),
        "after the live runs' heartbeat the group is full again"
    );
    backend.ack("g0", &receipts).expect("ack");
    clock.advance(50);
    assert_eq!(backend.claim("g0", 10, lease).expect("claim").len(), 2);
}

/// The claim script resolves each key's run limit as its policy does (the
/// key's own, else its longest prefix's, else the default): one claim of
/// every key's ten jobs starts exactly that many of each, whatever order
/// the policies were written in, with multi-byte keys and prefixes.
#[test]
fn the_claim_script_gives_every_key_the_concurrency_of_its_policy() {
    let server = RedisServer::start();
    let map = map_of(&[("l0", server.url())]);
    init(&map);
    let clock = ManualClock::new(1_700_000_000_000);
    let settings = contract::mixed_concurrency_settings();
    let opts = crate::common::opts_with_flow(&clock, settings.clone(), &server.url());
    let b = RedisBackend::open(&map, opts).expect("open");
    let _owner = owner(&b, "limits", 600_000);
    let keys = [
        "a", "ab", "abc", "abcd", "abx", "abcx", "x", "xa", "z", "é", "éa", "éb", "b", "abcé",
    ];
    for k in keys {
        let jobs: Vec<_> = (0..10)
            .map(|i| crate::common::job(k, &i.to_string()))
            .collect();
        b.enqueue("l0", 1, &jobs).expect("enqueue");
    }
    let runs = b.claim("l0", 1000, 600_000).expect("claim");
    for k in keys {
        let started: Vec<String> = (runs.iter())
            .filter(|r| r.key == k)
            .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
            .collect();
        let want = settings.for_key(k).concurrency as usize;
        let first: Vec<String> = (0..want).map(|i| i.to_string()).collect();
        assert_eq!(started, first, "key {k:?}: its first {want} jobs, in order");
    }
    assert!(
        b.claim("l0", 1000, 600_000).expect("claim").is_empty(),
        "every key is at its limit"
    );
}

/// Flow settings changed in their store are used by the first claim after
/// they are due to be read again, however long no claim ran: a key's
/// concurrency raised from 1 to 3 while its one run goes on starts two
/// more at that claim.
#[test]
fn a_claim_reads_changed_settings_before_it_starts_anything() {
    use shardq_core::flow::{FlowPolicy, FlowSettings, FLOW_RECHECK_MS};
    let server = RedisServer::start();
    let map = map_of(&[("f0", server.url())]);
    init(&map);
    let clock = ManualClock::new(1_700_000_000_000);
    let stored = std::sync::Arc::new(Mutex::new(FlowSettings::default()));
    let source = {
        let stored = std::sync::Arc::clone(&stored);
        Box::new(move || Ok(Some(stored.lock().unwrap().clone()))) as shardq_core::flow::FlowSource
    };
    let groups = shardq_redis::RedisMapStore::open(&server.url()).expect("map store");
    let flow = shardq_core::FlowControl::new(FlowSettings::default(), std::sync::Arc::new(groups))
        .with_source(source);
    let mut opts = opts_manual(&clock);
    opts.flow = Some(std::sync::Arc::new(flow));
    let b = RedisBackend::open(&map, opts).expect("open");
    let _owner = owner(&b, "settings", 600_000);
    let jobs: Vec<_> = (0..5)
        .map(|i| crate::common::job("k", &i.to_string()))
        .collect();
    b.enqueue("f0", 1, &jobs).expect("enqueue");
    let first = b.claim("f0", 10, 600_000).expect("claim");
    assert_eq!(crate::common::payloads(&first), ["0"]);
    stored.lock().unwrap().default = FlowPolicy {
        concurrency: 3,
        ..FlowPolicy::default()
    };
    clock.advance(FLOW_RECHECK_MS * 10);
    let more = b.claim("f0", 10, 600_000).expect("claim");
    assert_eq!(
        crate::common::payloads(&more),
        ["1", "2"],
        "the new limit, at once"
    );
}
