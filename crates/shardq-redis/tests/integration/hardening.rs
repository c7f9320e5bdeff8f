//! Failure modes of the store itself, each against a real `redis-server`:
//! a store that lost its state (FLUSHALL, a restart from an old snapshot),
//! an evicting server, a full server, a hung server, two deployments on one
//! server, and keys whose only jobs are dead letters.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use shardq_core::reshard::KeyInventory;
use shardq_core::{
    Coordinator, FailOutcome, InspectJobs, KeyCounts, QueueError, RunJobs,
    JOB_LEASE_MS_DEFAULT as LEASE,
};
use shardq_redis::{
    init_deployment, CoordinatorOptions, RedisBackend, RedisCoordinator, RedisError, RedisOptions,
};
use shardq_testkit::redis::{RedisServer, ServerOptions};

use crate::common::{init, job, map_of, payloads, tick_adopt};

fn coordinator(b: &RedisBackend, name: &str, lease_ms: u64) -> RedisCoordinator {
    RedisCoordinator::new(
        b,
        CoordinatorOptions {
            owner: Some(name.to_string()),
            lease_ms,
            shards: None,
            max_shards: 0,
        },
    )
    .expect("coordinator")
}

fn store_lost<T: std::fmt::Debug>(r: Result<T, QueueError>, url: &str) -> String {
    match r {
        Err(QueueError::StoreLost(m)) => {
            assert!(m.contains(url), "the error names the server: {m}");
            m
        }
        other => panic!("expected StoreLost, got {other:?}"),
    }
}

/// FLUSHALL mid-run: the lease counter and every record are gone. The
/// worker's tick, claim and enqueue stop with StoreLost naming the server
/// and the missing record; a second coordinator does not get the shard.
#[test]
fn split_brain_after_flushall_is_refused_with_store_lost() {
    let server = RedisServer::start();
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let a = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    let mut ca = coordinator(&a, "host-a@1", 10_000);
    assert_eq!(tick_adopt(&a, &mut ca), ["r0"]);
    a.enqueue("r0", 1, &[job("k", "k1"), job("k", "k2")])
        .unwrap();
    let run = a.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&run), ["k1"]);

    server.cli(&["flushall"]);

    // Every script checks the record before it writes.
    let m = store_lost(a.claim("r0", 10, LEASE), &server.url());
    assert!(m.contains("dep"), "names what is missing: {m}");
    store_lost(a.ack("r0", &[run[0].receipt()]), &server.url());
    store_lost(a.enqueue("r0", 1, &[job("k", "k3")]), &server.url());
    // The tick stops the worker and drops the shard.
    store_lost(ca.tick(), &server.url());
    assert_eq!(ca.token("r0"), None, "the lost shard is dropped");
    assert!(matches!(
        a.claim("r0", 10, LEASE),
        Err(QueueError::NotOwner { .. })
    ));
    // A second worker neither opens the store nor takes the shard.
    let err = RedisBackend::open(&map, RedisOptions::default()).unwrap_err();
    store_lost(Err::<(), _>(err.into()), &server.url());
    let mut cb = coordinator(&a, "host-b@2", 10_000);
    store_lost(cb.tick(), &server.url());
    assert_eq!(cb.token("r0"), None, "no two coordinators hold r0");
    // Nothing was re-created behind the operator's back.
    assert_eq!(server.cli(&["dbsize"]).trim(), "0");
}

/// A restart from an old RDB snapshot rewinds the lease: the first worker's
/// token is not in the store any more. Its renewal fails (the shard is
/// reported lost), a second worker gains the shard with a different token,
/// and the first one's claims are refused.
#[test]
fn split_brain_after_restart_from_an_old_snapshot_is_refused() {
    let mut server = RedisServer::start();
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let a = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    a.enqueue("r0", 1, &[job("k", "k1")]).unwrap();
    let old = server.snapshot("before-lease.rdb");

    let mut ca = coordinator(&a, "host-a@1", 10_000);
    assert_eq!(tick_adopt(&a, &mut ca), ["r0"]);
    let token_a = ca.token("r0").unwrap().to_string();
    let run_a = a.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&run_a), ["k1"]);

    server.restart_from_snapshot(&old);

    let own = ca.tick().unwrap();
    assert_eq!(own.lost, ["r0"], "A's renewal finds another token");
    assert!(own.owned.is_empty());
    let b = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    let mut cb = coordinator(&b, "host-b@2", 10_000);
    assert_eq!(tick_adopt(&b, &mut cb), ["r0"]);
    let token_b = cb.token("r0").unwrap().to_string();
    assert_ne!(token_a, token_b, "tokens are unique across store restarts");
    assert!(matches!(
        a.claim("r0", 10, LEASE),
        Err(QueueError::NotOwner { .. })
    ));
    // A does not take the shard back while B holds it.
    assert!(ca.tick().unwrap().owned.is_empty());
    assert_eq!(ca.token("r0"), None);
    let run_b = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&run_b), ["k1"], "the snapshot's job runs again");
    assert!(
        run_b[0].fence > run_a[0].fence,
        "fences grow across a store restart ({} then {})",
        run_a[0].fence,
        run_b[0].fence
    );
}

/// A server whose `maxmemory-policy` may evict keys is refused at init and
/// at open, with the policy and the fix; a server with CONFIG renamed is
/// refused with that reason.
#[test]
fn evicting_redis_is_refused_naming_the_policy_and_the_fix() {
    let server = RedisServer::start();
    let map = map_of(&[("r0", server.url())]);
    server.cli(&["config", "set", "maxmemory-policy", "allkeys-lru"]);
    let err = init_deployment(&map, &server.url(), None, &RedisOptions::default()).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("allkeys-lru"), "{text}");
    assert!(
        text.contains("CONFIG SET maxmemory-policy noeviction"),
        "{text}"
    );
    assert!(text.contains(&server.url()), "{text}");
    server.cli(&["config", "set", "maxmemory-policy", "noeviction"]);
    init(&map);
    server.cli(&["config", "set", "maxmemory-policy", "volatile-ttl"]);
    let text = RedisBackend::open(&map, RedisOptions::default())
        .unwrap_err()
        .to_string();
    assert!(text.contains("volatile-ttl"), "{text}");

    let hidden = RedisServer::start_with(ServerOptions {
        extra_args: &["--rename-command", "CONFIG", ""],
        ..ServerOptions::default()
    });
    let map = map_of(&[("r0", hidden.url())]);
    let text = init_deployment(&map, &hidden.url(), None, &RedisOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("CONFIG command is disabled or renamed"),
        "{text}"
    );
}

fn used_memory(server: &RedisServer) -> u64 {
    let info = server.cli(&["info", "memory"]);
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no used_memory in {info}"))
}

/// A full server (maxmemory reached, noeviction): enqueue is refused with
/// StoreFull, while claims, acks, fails, extends and lease renewals still
/// run, so a worker drains the store.
#[test]
fn full_redis_refuses_enqueue_but_a_worker_still_drains_it() {
    const BATCHES_MAX: usize = 2_000;
    let server = RedisServer::start();
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let b = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    let mut c = coordinator(&b, "w@1", 10_000);
    assert_eq!(tick_adopt(&b, &mut c), ["r0"]);
    let limit = used_memory(&server) + (2 << 20);
    server.cli(&["config", "set", "maxmemory", &limit.to_string()]);
    let payload = "p".repeat(2_000);
    let mut enqueued = 0usize;
    let mut full = None;
    for i in 0..BATCHES_MAX {
        let jobs: Vec<_> = (0..50)
            .map(|j| job(&format!("k{}", (i * 50 + j) % 200), &payload))
            .collect();
        match b.enqueue("r0", 1, &jobs) {
            Ok(ids) => enqueued += ids.len(),
            Err(e) => {
                full = Some(e);
                break;
            }
        }
    }
    match full {
        Some(QueueError::StoreFull {
            ref shard,
            ref reason,
        }) => {
            assert_eq!(shard, "r0");
            assert!(reason.contains(&server.url()), "{reason}");
        }
        other => panic!("expected StoreFull within {BATCHES_MAX} batches, got {other:?}"),
    }
    assert!(enqueued > 0);
    // Still full: the worker drains everything without one error.
    let mut done = 0usize;
    let mut first = true;
    loop {
        assert!(
            c.tick().unwrap().owned == ["r0"],
            "lease renewal works when full"
        );
        let got = b.claim("r0", 64, LEASE).expect("claim on a full store");
        if got.is_empty() {
            break;
        }
        let receipts: Vec<_> = got.iter().map(|j| j.receipt()).collect();
        assert!(b.extend("r0", &receipts, LEASE).unwrap().is_empty());
        if first {
            // A retry writes too; it must not be refused either.
            first = false;
            assert!(matches!(
                b.fail("r0", receipts[0], "once", Some(0)).unwrap(),
                FailOutcome::Retry { .. }
            ));
            let out = b.ack("r0", &receipts[1..]).expect("ack on a full store");
            done += out.acked as usize;
            continue;
        }
        let out = b.ack("r0", &receipts).expect("ack on a full store");
        assert!(out.stale.is_empty());
        done += out.acked as usize;
    }
    assert_eq!(done, enqueued, "every job ran and was acked");
    assert_eq!(b.shard_stats("r0").unwrap().in_flight, 0);
}

/// A hung server (SIGSTOP) hosting one of two shards: calls to it fail
/// within the bound with Unavailable naming its URL, calls to the other
/// shard work, and after SIGCONT it recovers.
#[test]
fn bounded_calls_to_a_hung_server_fail_with_unavailable_and_recover() {
    let hung = RedisServer::start();
    let fine = RedisServer::start();
    let map = map_of(&[("s0", hung.url()), ("s1", fine.url())]);
    init(&map);
    let opts = RedisOptions {
        retry_budget_ms: 1_000,
        connect_timeout_ms: 300,
        response_timeout_ms: 300,
        ..RedisOptions::default()
    };
    // Budget plus one attempt's timeouts, plus slack for a loaded machine.
    let bound = Duration::from_millis(1_000 + 300 + 300 + 1_500);
    let b = RedisBackend::open(&map, opts).unwrap();
    let mut c = coordinator(&b, "w@1", 3_000);
    assert_eq!(tick_adopt(&b, &mut c).len(), 2);

    hung.pause();
    let t = Instant::now();
    let err = b.enqueue("s0", 1, &[job("k", "x")]).unwrap_err();
    assert!(t.elapsed() < bound, "enqueue took {:?}", t.elapsed());
    assert!(err.is_transient(), "{err}");
    match &err {
        QueueError::Unavailable { shard, reason } => {
            assert_eq!(shard, "s0");
            assert!(reason.contains(&hung.url()), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let t = Instant::now();
    assert!(b.claim("s0", 10, LEASE).unwrap_err().is_transient());
    assert!(t.elapsed() < bound, "claim took {:?}", t.elapsed());
    // The other shard is unaffected.
    b.enqueue("s1", 1, &[job("k", "y")]).unwrap();
    assert_eq!(payloads(&b.claim("s1", 10, LEASE).unwrap()), ["y"]);
    // A tick gives up the hung shard's renewal within its interval and
    // keeps the other lease.
    let t = Instant::now();
    let own = c.tick().unwrap();
    assert!(t.elapsed() < bound, "tick took {:?}", t.elapsed());
    assert_eq!(own.lost, ["s0"]);
    assert_eq!(own.owned, ["s1"]);

    hung.resume();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let owned = tick_adopt(&b, &mut c);
        if owned.len() == 2 && b.enqueue("s0", 1, &[job("k", "z")]).is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "s0 did not recover");
        std::thread::sleep(Duration::from_millis(100));
    }
    let got = b.claim("s0", 10, LEASE).unwrap();
    assert!(!got.is_empty(), "s0 works again");
}

/// Two deployments on one server keep separate keys; init refuses an
/// existing namespace; a namespace that was never initialised, and a shard
/// of an unknown layout version, are refused at open.
#[test]
fn namespaces_keep_two_deployments_on_one_server_apart() {
    let server = RedisServer::start();
    let map = map_of(&[("r0", server.url())]);
    let d1 = init_deployment(&map, &server.url(), None, &RedisOptions::default()).unwrap();
    let d2 = init_deployment(&map, &server.url(), None, &RedisOptions::default()).unwrap();
    assert_ne!(d1.namespace, d2.namespace);
    assert_ne!(d1.id, d2.id);
    let open = |d: &shardq_redis::Deployment| {
        RedisBackend::open(
            &map,
            RedisOptions {
                namespace: d.namespace.clone(),
                deployment: Some(d.id.clone()),
                ..RedisOptions::default()
            },
        )
        .unwrap()
    };
    let (b1, b2) = (open(&d1), open(&d2));
    b1.enqueue("r0", 1, &[job("k", "one"), job("k", "two")])
        .unwrap();
    b2.enqueue("r0", 1, &[job("k", "other")]).unwrap();
    assert_eq!(b1.key_counts("r0", "k").unwrap().depth, 2);
    assert_eq!(b2.key_counts("r0", "k").unwrap().depth, 1);

    let err = init_deployment(
        &map,
        &server.url(),
        Some(&d1.namespace),
        &RedisOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains(&d1.namespace) && err.contains(&server.url()),
        "{err}"
    );
    // Shard keys without a deployment record are refused too.
    server.cli(&["del", &shardq_redis::keys::deployment_key(&d1.namespace)]);
    let err = init_deployment(
        &map,
        &server.url(),
        Some(&d1.namespace),
        &RedisOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("already has key"), "{err}");
    assert_eq!(
        b1.key_counts("r0", "k").unwrap().depth,
        2,
        "nothing overwritten"
    );

    // The wrong deployment id, or a namespace never initialised.
    let wrong = RedisBackend::open(
        &map,
        RedisOptions {
            namespace: d1.namespace.clone(),
            deployment: Some(d2.id.clone()),
            ..RedisOptions::default()
        },
    );
    assert!(matches!(
        wrong.map_err(QueueError::from),
        Err(QueueError::StoreLost(m)) if m.contains(&d1.id)
    ));
    let never = RedisBackend::open(
        &map,
        RedisOptions {
            namespace: "never-init".into(),
            ..RedisOptions::default()
        },
    );
    assert!(matches!(
        never.map_err(QueueError::from),
        Err(QueueError::StoreLost(m)) if m.contains("never-init")
    ));

    // A layout version this build does not know, older or newer.
    let meta = &b2.shard_keys("r0").unwrap()[0];
    for found_layout in ["1", "2", "3", "4", "5", "99"] {
        server.cli(&["hset", meta, "layout", found_layout]);
        match RedisBackend::open(
            &map,
            RedisOptions {
                namespace: d2.namespace.clone(),
                ..RedisOptions::default()
            },
        ) {
            Err(RedisError::Queue(QueueError::UnknownFormat {
                found, supported, ..
            })) => {
                assert_eq!(found, found_layout);
                assert_eq!(supported, shardq_redis::keys::LAYOUT_VERSION.to_string());
            }
            other => panic!("expected UnknownFormat, got {other:?}"),
        }
    }
}

/// A key whose only jobs are dead letters stays in the inventory (dead
/// count 1, nothing queued or in flight), so a rebalance keeps it pinned
/// instead of moving it away from its dead letters.
#[test]
fn dead_only_keys_stay_in_the_key_inventory() {
    let server = RedisServer::start();
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let b = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    let mut c = coordinator(&b, "w@1", 10_000);
    tick_adopt(&b, &mut c);
    let mut once = job("dead-only", "x");
    once.max_attempts = 1;
    b.enqueue("r0", 1, &[once, job("live", "y")]).unwrap();
    for j in b.claim("r0", 10, LEASE).unwrap() {
        if j.key == "dead-only" {
            assert_eq!(
                b.fail("r0", j.receipt(), "bad", None).unwrap(),
                FailOutcome::Dead
            );
        }
    }
    let inv: BTreeMap<String, KeyCounts> = b.keys_with_work("r0").unwrap().into_iter().collect();
    assert_eq!(
        inv.get("dead-only"),
        Some(&KeyCounts {
            depth: 0,
            in_flight: 0,
            dead: 1
        }),
        "{inv:?}"
    );
    assert_eq!(inv["live"].in_flight, 1);
    assert_eq!(inv.len(), 2);
    // Purged, the key has nothing left and leaves the inventory.
    assert_eq!(b.dead_purge("r0", None).unwrap(), 1);
    let inv = b.keys_with_work("r0").unwrap();
    assert_eq!(inv.len(), 1, "{inv:?}");
}

/// A local server (`shardq_redis::local`, what the demo runs on) asked for
/// a port that another process holds (a listener, or another
/// redis-server) fails to start with an error naming the port, never a
/// panic, and never takes the other server for its own.
#[test]
fn a_taken_port_is_an_error_not_a_panic_nor_someone_elses_server() {
    use shardq_redis::local::{LocalOptions, LocalServer};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let held = listener.local_addr().unwrap().port();
    let other = RedisServer::start();
    for port in [held, other.port()] {
        let err = LocalServer::start(LocalOptions {
            port: Some(port),
            ..LocalOptions::default()
        })
        .map(|s| s.port())
        .unwrap_err();
        assert!(err.contains(&format!("port {port}")), "{err}");
    }
    drop(listener);
}

/// A plain connection to the server at `url`.
fn connect(url: &str) -> redis::Connection {
    redis::Client::open(url).unwrap().get_connection().unwrap()
}

/// The Redis key of part `part` (`keys`, `reason`, ...) of shard `r0` of
/// the default deployment.
fn r0_part(part: &str) -> String {
    let keys =
        shardq_redis::keys::shard_keys(shardq_redis::keys::NAMESPACE_DEFAULT, "default", "r0");
    let suffix = format!(":{part}");
    keys.into_iter().find(|k| k.ends_with(&suffix)).unwrap()
}

/// A server holding one initialised shard `r0` (its map), a backend on
/// `opts`, and a coordinator (`w@1`) that owns and adopted the shard.
fn owned_r0(
    opts: RedisOptions,
) -> (
    RedisServer,
    String,
    shardq_route::ShardMap,
    RedisBackend,
    RedisCoordinator,
) {
    let server = RedisServer::start();
    let url = server.url();
    let map = map_of(&[("r0", url.clone())]);
    init(&map);
    let b = RedisBackend::open(&map, opts).unwrap();
    let mut c = coordinator(&b, "w@1", 10_000);
    tick_adopt(&b, &mut c);
    (server, url, map, b, c)
}

/// Field `f` of hash `h`, raw (empty when missing).
fn hget(con: &mut redis::Connection, h: &str, f: &str) -> Vec<u8> {
    redis::cmd("HGET").arg(h).arg(f).query(con).unwrap()
}

/// Writes field `f` of hash `h` as it is, as a foreign writer (or a
/// flipped byte) would.
fn hset(con: &mut redis::Connection, h: &str, f: &str, v: &[u8]) {
    let _: () = redis::cmd("HSET").arg(h).arg(f).arg(v).query(con).unwrap();
}

/// `e` is a corrupt-record error of shard `r0` whose text holds `what`.
fn assert_corrupt(e: QueueError, what: &str) {
    assert_eq!(e.kind(), shardq_core::ErrorKind::Corrupt, "{e}");
    let text = e.to_string();
    assert!(text.contains(what) && text.contains("\"r0\""), "{text}");
}

/// The server's clock in ms, as the scripts read it.
fn server_ms(url: &str) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(&mut connect(url)).unwrap();
    s * 1000 + us / 1000
}

/// On the server's clock (no caller clock), a claim writes no start time:
/// a running attempt's start is its fence's millisecond. Every attempt's
/// start still reads back within the claim that made it (the fence's
/// millisecond may be the next one), through a failure, a back-off (whose
/// start is dropped), a cancel while running and a lapse; and nothing is
/// left in the reason hash once the jobs are gone.
#[test]
fn start_times_on_the_servers_clock_hold_through_fail_back_off_cancel_and_ack() {
    let (_server, url, _map, b, _c) = owned_r0(RedisOptions::default());
    let within = |start: u64, (lo, hi): (u64, u64)| start >= lo && start <= hi + 1;
    let claim = |max: usize, lease: u64| {
        let lo = server_ms(&url);
        let jobs = b.claim("r0", max, lease).unwrap();
        (jobs, (lo, server_ms(&url)))
    };
    b.enqueue("r0", 1, &[job("a", "a1"), job("b", "b1"), job("c", "c1")])
        .unwrap();

    // a fails once, b backs off, c is cancelled while it runs (its run
    // lapses after SHORT ms).
    const SHORT: u64 = 1_500;
    let (first, w1) = claim(10, SHORT);
    assert_eq!(first.len(), 3);
    let by = |k: &str| first.iter().find(|j| j.key == k).unwrap().clone();
    let (a, bb, cc) = (by("a"), by("b"), by("c"));
    let running = b.job("r0", a.id).unwrap().unwrap();
    assert_eq!(running.attempt_starts_ms.len(), 1, "{running:?}");
    assert!(
        within(running.attempt_starts_ms[0], w1),
        "{running:?} {w1:?}"
    );
    assert!(matches!(
        b.fail("r0", a.receipt(), "flaky", Some(0)).unwrap(),
        FailOutcome::Retry { .. }
    ));
    b.back_off("r0", bb.receipt(), 0, false).unwrap();
    let backed = b.job("r0", bb.id).unwrap().unwrap();
    assert!(backed.attempt_starts_ms.is_empty(), "{backed:?}");
    assert_eq!(
        b.cancel("r0", cc.id).unwrap(),
        shardq_core::CancelOutcome::Stopping
    );
    // The cleared fence no longer tells the start; the cancel kept it.
    let stopping = b.job("r0", cc.id).unwrap().unwrap();
    assert_eq!(stopping.attempt_starts_ms, running_start(&b, cc.id, w1));

    // The second round: a's retry and b's run, then both acked.
    let (second, w2) = claim(10, LEASE);
    let ids: Vec<_> = second.iter().map(|j| j.id).collect();
    assert!(ids.contains(&a.id) && ids.contains(&bb.id), "{second:?}");
    let a2 = b.job("r0", a.id).unwrap().unwrap();
    assert_eq!(a2.attempt_starts_ms.len(), 2, "{a2:?}");
    assert!(within(a2.attempt_starts_ms[0], w1), "{a2:?}");
    assert!(within(a2.attempt_starts_ms[1], w2), "{a2:?} {w2:?}");
    let receipts: Vec<_> = second.iter().map(|j| j.receipt()).collect();
    assert!(b.ack("r0", &receipts).unwrap().stale.is_empty());
    let done = b.finished("r0", None, 10).unwrap();
    let of = |id| done.iter().find(|f| f.id == id).unwrap().clone();
    assert_eq!(of(a.id).attempt_starts_ms, a2.attempt_starts_ms);
    let b_done = of(bb.id);
    assert_eq!(b_done.attempt_starts_ms.len(), 1, "{b_done:?}");
    assert!(within(b_done.attempt_starts_ms[0], w2), "{b_done:?}");

    // c's run ends when its lease lapses: it finishes cancelled, with the
    // start its cancel kept.
    while server_ms(&url) <= w1.1 + SHORT + 1 {
        std::thread::sleep(Duration::from_millis(50));
    }
    let (none, _) = claim(10, LEASE);
    assert!(none.is_empty(), "{none:?}");
    let done = b.finished("r0", None, 10).unwrap();
    let c_done = done.iter().find(|f| f.id == cc.id).expect("c finished");
    assert_eq!(c_done.attempt_starts_ms, stopping.attempt_starts_ms);
    assert!(within(c_done.attempt_starts_ms[0], w1), "{c_done:?}");

    // No reason, start or explicit start is left behind.
    let left: Vec<String> = (redis::cmd("HKEYS").arg(r0_part("reason")))
        .query(&mut connect(&url))
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
}

/// The start of job `id`'s running attempt, checked to fall in `window`.
fn running_start(b: &RedisBackend, id: shardq_core::JobId, window: (u64, u64)) -> Vec<u64> {
    let info = b.job("r0", id).unwrap().unwrap();
    assert_eq!(info.attempt_starts_ms.len(), 1, "{info:?}");
    let s = info.attempt_starts_ms[0];
    assert!(s >= window.0 && s <= window.1 + 1, "{info:?} {window:?}");
    info.attempt_starts_ms
}

/// A shard's `keys` hash keeps the hash-table encoding from init on (its
/// pin), so a key's lookup never walks every key; counts and the key
/// inventory leave the pin out; a shard written without it (an older
/// build) gets it from the next owner's adopt.
#[test]
fn the_keys_hash_stays_a_hash_table_and_its_pin_is_never_a_key() {
    let server = RedisServer::start();
    let url = server.url();
    let map = map_of(&[("r0", url.clone())]);
    init(&map);
    let hash = r0_part("keys");
    let mut con = connect(&url);
    let encoding = |con: &mut redis::Connection| -> String {
        redis::cmd("OBJECT")
            .arg("ENCODING")
            .arg(&hash)
            .query(con)
            .unwrap()
    };
    assert_eq!(encoding(&mut con), "hashtable");
    let b = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    let mut c = coordinator(&b, "w@1", 10_000);
    tick_adopt(&b, &mut c);
    b.enqueue("r0", 1, &[job("a", "1"), job("b", "2"), job("b", "3")])
        .unwrap();
    assert_eq!(encoding(&mut con), "hashtable");
    assert_eq!(b.shard_stats("r0").unwrap().keys, 2);
    let inv: Vec<String> = b
        .keys_with_work("r0")
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(inv.len(), 2, "{inv:?}");
    // Drained, the shard counts no key, and the hash is still a table.
    let jobs = b.claim("r0", 10, LEASE).unwrap();
    b.ack("r0", &jobs.iter().map(|j| j.receipt()).collect::<Vec<_>>())
        .unwrap();
    let jobs = b.claim("r0", 10, LEASE).unwrap();
    b.ack("r0", &jobs.iter().map(|j| j.receipt()).collect::<Vec<_>>())
        .unwrap();
    assert_eq!(b.shard_stats("r0").unwrap().keys, 0);
    assert!(b.keys_with_work("r0").unwrap().is_empty());
    assert_eq!(encoding(&mut con), "hashtable");

    // A shard whose keys hash is gone (deleted, or lost with the hash):
    // the next owner's adopt writes the pin again.
    let _: () = redis::cmd("DEL").arg(&hash).query(&mut con).unwrap();
    c.release_all().unwrap();
    let b2 = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    let mut c2 = coordinator(&b2, "w@2", 10_000);
    assert_eq!(tick_adopt(&b2, &mut c2), ["r0"]);
    assert_eq!(encoding(&mut con), "hashtable");
    let pin: Option<String> = redis::cmd("HGET")
        .arg(&hash)
        .arg("\0")
        .query(&mut con)
        .unwrap();
    let pin = pin.expect("the pin");
    assert!(
        pin.len() > 64 && pin.starts_with("0 0 0 0 0"),
        "{}",
        pin.len()
    );
    assert_eq!(b2.shard_stats("r0").unwrap().keys, 0);
}

/// Start times stay right across an adopt and a stale record: the run a
/// dead owner left is counted once when the next owner puts it back, and
/// a leftover `<id>^` naming another run is not taken for this run's.
#[test]
fn start_times_are_counted_once_and_a_stale_start_is_ignored() {
    let (_server, url, map, b, mut c) = owned_r0(RedisOptions::default());
    b.enqueue("r0", 1, &[job("old", "x")]).unwrap();
    let run = b.claim("r0", 10, LEASE).unwrap().remove(0);
    let reason = r0_part("reason");
    let mut con = connect(&url);
    // The owner goes; the next one adopts the shard and puts the run back.
    c.release_all().unwrap();
    let b2 = RedisBackend::open(&map, RedisOptions::default()).unwrap();
    let mut c2 = coordinator(&b2, "w@2", 10_000);
    assert_eq!(tick_adopt(&b2, &mut c2), ["r0"]);
    let back = b2.job("r0", run.id).unwrap().unwrap();
    assert_eq!(back.attempts, 1, "{back:?}");
    assert_eq!(back.attempt_starts_ms.len(), 1, "{back:?}");
    let _: () = redis::cmd("HSET")
        .arg(&reason)
        .arg(format!("{}^", run.id.0))
        .arg("12345678:42")
        .query(&mut con)
        .unwrap();
    let again = b2.claim("r0", 10, LEASE).unwrap().remove(0);
    // A leftover `^` of another run is not this run's.
    let running = b2.job("r0", run.id).unwrap().unwrap();
    assert_eq!(running.attempt_starts_ms.len(), 2, "{running:?}");
    assert_ne!(running.attempt_starts_ms[1], 42, "a stale `^` was used");
    b2.ack("r0", &[again.receipt()]).unwrap();
    let done = b2.finished("r0", None, 10).unwrap();
    assert_eq!(done[0].attempt_starts_ms, running.attempt_starts_ms);
    assert_eq!(done[0].attempts, 2);
}

/// A flipped byte in a key's queue record or in a job record is refused by
/// name (kind corrupt: the record's key and its text), once: the record's
/// key (or run) is set aside for a minute, so the shard's other keys run
/// meanwhile, and nothing is lost; put right, the shard works on with every
/// job, in order.
#[test]
fn a_flipped_byte_in_a_record_is_a_named_corrupt_error_and_loses_nothing() {
    let clock = shardq_core::ManualClock::new(1_700_000_000_000);
    let (_server, url, _map, b, _c) = owned_r0(crate::common::opts_manual(&clock));
    b.enqueue("r0", 1, &[job("tenant-a", "a1"), job("tenant-a", "a2")])
        .unwrap();
    b.enqueue("r0", 1, &[job("tenant-b", "b1"), job("tenant-b", "b2")])
        .unwrap();
    let mut con = connect(&url);
    let keys_hash = r0_part("keys");
    let good = hget(&mut con, &keys_hash, "tenant-a");
    let mut flipped = good.clone();
    let space = flipped.iter().position(|&c| c == b' ').unwrap();
    flipped[space] = 1;
    hset(&mut con, &keys_hash, "tenant-a", &flipped);
    assert_corrupt(b.claim("r0", 10, LEASE).unwrap_err(), "key \"tenant-a\"");
    assert_corrupt(
        b.enqueue("r0", 1, &[job("tenant-a", "a3")]).unwrap_err(),
        "key \"tenant-a\"",
    );
    // The next claim goes on with the other key.
    const LONG: u64 = 200_000;
    let b_runs = b.claim("r0", 10, LONG).unwrap();
    assert_eq!(payloads(&b_runs), ["b1"]);
    // Put right, the key runs again once its minute aside is over.
    hset(&mut con, &keys_hash, "tenant-a", &good);
    clock.advance(60_001);
    let first = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&first), ["a1"], "{first:?}");

    // A job record: the next head's, while b1's run lapses with a corrupt
    // record of its own.
    let jobs_hash = r0_part("jobs");
    let flip = |con: &mut redis::Connection, id: u64| -> Vec<u8> {
        let rec = hget(con, &jobs_hash, &id.to_string());
        let mut bad = rec.clone();
        bad[0] = b'x';
        hset(con, &jobs_hash, &id.to_string(), &bad);
        rec
    };
    let put_back = |con: &mut redis::Connection, id: u64, rec: &[u8]| {
        hset(con, &jobs_hash, &id.to_string(), rec);
    };
    let a2 = first[0].id.0 + 1;
    let a2_rec = flip(&mut con, a2);
    b.ack("r0", &[first[0].receipt()]).unwrap();
    assert_corrupt(b.claim("r0", 10, LEASE).unwrap_err(), "a job record");
    put_back(&mut con, a2, &a2_rec);
    let b1 = b_runs[0].id.0;
    let b1_rec = flip(&mut con, b1);
    clock.advance(LONG);
    // b1's lapsed run meets its corrupt record: refused once, then set
    // aside while a2 runs.
    assert_corrupt(b.claim("r0", 10, LEASE).unwrap_err(), "a job record");
    let second = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&second), ["a2"], "{second:?}");
    b.ack("r0", &[second[0].receipt()]).unwrap();
    put_back(&mut con, b1, &b1_rec);
    clock.advance(60_001);
    let last: Vec<_> = (0..3)
        .flat_map(|_| b.claim("r0", 10, LEASE).unwrap())
        .collect();
    assert_eq!(payloads(&last), ["b1"], "b1 runs again: {last:?}");
    assert_eq!(last[0].attempt, 2);
    b.ack("r0", &[last[0].receipt()]).unwrap();
    let tail = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&tail), ["b2"]);
}

/// A flipped byte anywhere in a head's job record (not only its first
/// field), or in the link to the key's next job, is refused before the
/// claim hands anything out, and nothing of the key is lost.
#[test]
fn a_claim_checks_the_whole_record_and_the_next_link_before_it_starts() {
    let clock = shardq_core::ManualClock::new(1_700_000_000_000);
    let (_server, url, _map, b, _c) = owned_r0(crate::common::opts_manual(&clock));
    let ids = b
        .enqueue("r0", 1, &[job("k", "one"), job("k", "two")])
        .unwrap();
    let (one, two) = (ids[0].to_string(), ids[1].to_string());
    let mut con = connect(&url);
    let (jobs, next) = (r0_part("jobs"), r0_part("next"));
    // The attempts field, then the key's length (past the record's end).
    let rec = hget(&mut con, &jobs, &one);
    let text = String::from_utf8(rec.clone()).unwrap();
    let fields: Vec<&str> = text.splitn(6, '|').collect();
    for bad in [
        format!("{}|x|{}", fields[0], fields[2..].join("|")),
        format!("{}|999|{}", fields[..4].join("|"), fields[5]),
    ] {
        hset(&mut con, &jobs, &one, bad.as_bytes());
        assert_corrupt(b.claim("r0", 10, LEASE).unwrap_err(), "a job record");
        hset(&mut con, &jobs, &one, &rec);
        clock.advance(60_001);
    }
    // The link to the next job.
    let link = hget(&mut con, &next, &one);
    hset(&mut con, &next, &one, b"zz");
    assert_corrupt(b.claim("r0", 10, LEASE).unwrap_err(), "the next job after");
    hset(&mut con, &next, &one, &link);
    clock.advance(60_001);
    let first = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&first), ["one"]);
    b.ack("r0", &[first[0].receipt()]).unwrap();
    let second = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(payloads(&second), ["two"]);
    assert_eq!(second[0].id.to_string(), two);
}
