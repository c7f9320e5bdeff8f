//! A failover to a lagging replica, on real processes: a primary and its
//! replica behind a TCP proxy that the deployment's URL points at; the
//! replica is stopped while the primary acknowledges more work, the primary
//! is SIGKILLed, the replica resumed and promoted (`REPLICAOF NO ONE`) and
//! the proxy switched to it. Without `wait_replicas` the store went back in
//! time and the next operation must say so (`StoreLost`) instead of handing
//! out job ids twice; with `wait_replicas: 1` nothing the primary
//! acknowledged is lost.

use std::collections::BTreeSet;

use shardq_core::{ErrorKind, QueueError, Receipt, RunJobs};
use shardq_redis::{RedisBackend, RedisOptions};
use shardq_route::ShardMap;
use shardq_testkit::redis::{RedisServer, TcpProxy};

use crate::common::{init, job, map_of, owner};

const SHARD: &str = "f0";
const LEASE_MS: u64 = 600_000;
const KEYS: usize = 5;
/// The replica's `WAIT` bound in the replicated test (short: each write
/// made while the replica is stopped costs it).
const WAIT_MS: u64 = 300;

struct Pair {
    primary: RedisServer,
    replica: RedisServer,
    proxy: TcpProxy,
    map: ShardMap,
}

fn pair() -> Pair {
    let primary = RedisServer::start();
    let replica = primary.start_replica();
    let proxy = TcpProxy::start(primary.port());
    let map = map_of(&[(SHARD, proxy.url())]);
    init(&map);
    Pair {
        primary,
        replica,
        proxy,
        map,
    }
}

impl Pair {
    /// Stops the replica (SIGSTOP) and cuts its replication link, so the
    /// primary's next writes reach only the primary (what is already in the
    /// replica's socket buffer it applies when resumed).
    fn replica_lags(&self) {
        self.replica.pause();
        let out = self.primary.cli(&["client", "kill", "type", "replica"]);
        assert!(out.trim() == "1", "CLIENT KILL TYPE replica: {out}");
    }

    /// SIGKILLs the primary, resumes and promotes the stopped replica and
    /// points the proxy at it.
    fn fail_over(&mut self) {
        self.primary.kill();
        self.replica.resume();
        self.replica.promote();
        self.proxy.switch_to(self.replica.port());
    }
}

/// Enqueues `key/i` for i in `range`, one job per call; the payloads of
/// the calls that returned Ok.
fn enqueue_each(b: &RedisBackend, range: std::ops::Range<usize>) -> Vec<String> {
    let mut acked = Vec::new();
    for i in range {
        let p = format!("k{}/{i}", i % KEYS);
        if b.enqueue(SHARD, 1, &[job(&format!("k{}", i % KEYS), &p)])
            .is_ok()
        {
            acked.push(p);
        }
    }
    acked
}

#[test]
fn a_promoted_lagging_replica_is_refused_rather_than_reused() {
    let mut p = pair();
    let b = RedisBackend::open(&p.map, RedisOptions::default()).expect("open");
    let _owner = owner(&b, "w", LEASE_MS);
    assert_eq!(enqueue_each(&b, 0..10).len(), 10);
    let runs = b.claim(SHARD, 4, LEASE_MS).expect("claim");
    assert_eq!(runs.len(), 4);
    b.ack(SHARD, &[runs[0].receipt()]).expect("ack");
    p.primary.wait_replicated(1);

    p.replica_lags();
    // Acknowledged by the primary alone.
    assert_eq!(enqueue_each(&b, 10..45).len(), 35);
    let more = b.claim(SHARD, 10, LEASE_MS).expect("claim");
    assert!(!more.is_empty());
    p.fail_over();

    // The promoted replica's job-id sequence is 10: handing out id 11 again
    // (for another job) is what must not happen silently.
    let err = b
        .enqueue(SHARD, 1, &[job("k0", "after")])
        .expect_err("an enqueue to a store that went back in time must fail");
    assert!(
        matches!(err, QueueError::StoreLost(_)),
        "expected StoreLost, got {err}"
    );
    let msg = err.to_string();
    for part in [SHARD, &p.proxy.url(), "went back in time", " 10,", "45"] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
    assert_eq!(err.kind(), ErrorKind::Lost);
    let err = b.claim(SHARD, 10, LEASE_MS).expect_err("claim on it too");
    assert!(
        matches!(err, QueueError::StoreLost(_)),
        "expected StoreLost, got {err}"
    );
}

#[test]
fn with_wait_replicas_acknowledged_work_survives_the_failover() {
    let mut p = pair();
    let b = RedisBackend::open(
        &p.map,
        RedisOptions {
            wait_replicas: 1,
            wait_replicas_timeout_ms: WAIT_MS,
            ..RedisOptions::default()
        },
    )
    .expect("open");
    let _owner = owner(&b, "w", LEASE_MS);
    let acked = enqueue_each(&b, 0..10);
    assert_eq!(acked.len(), 10);
    let runs = b.claim(SHARD, 4, LEASE_MS).expect("claim");
    assert_eq!(runs.len(), 4);
    let mut ran: Vec<String> = Vec::new();
    b.ack(SHARD, &[runs[0].receipt(), runs[1].receipt()])
        .expect("ack");
    ran.extend(runs[..2].iter().map(payload));

    // No write is confirmed while the replica is stopped: none is reported
    // done, with an error that says why and may be retried.
    p.replica_lags();
    for i in 10..13 {
        let err = b
            .enqueue(SHARD, 1, &[job("k0", &format!("k0/{i}"))])
            .expect_err("an enqueue no replica confirmed must not be reported stored");
        let msg = err.to_string();
        assert!(
            matches!(err, QueueError::Unavailable { .. }) && err.kind() == ErrorKind::Retryable,
            "expected a retryable Unavailable, got {msg}"
        );
        assert!(
            msg.contains("0 of 1 replicas") && msg.contains(SHARD),
            "the error must name the shard and the replica count: {msg}"
        );
    }
    let err = b
        .ack(SHARD, &[runs[2].receipt()])
        .expect_err("an ack no replica confirmed");
    assert!(err.to_string().contains("0 of 1 replicas"), "{err}");
    p.fail_over();
    let _next = p.replica.start_replica();

    // Every acknowledged claim survived: the runs not acked (in the store's
    // view) are still current on the promoted replica.
    let left: Vec<Receipt> = runs[2..].iter().map(|r| r.receipt()).collect();
    let out = b.ack(SHARD, &left).expect("ack after the failover");
    assert_eq!(out.acked, 2, "claims made before the failover were lost");
    ran.extend(runs[2..].iter().map(payload));
    // Every acknowledged enqueue survived and runs, once.
    loop {
        let jobs = b
            .claim(SHARD, 100, LEASE_MS)
            .expect("claim after the failover");
        if jobs.is_empty() {
            break;
        }
        let rs: Vec<Receipt> = jobs.iter().map(|j| j.receipt()).collect();
        assert_eq!(b.ack(SHARD, &rs).expect("ack").acked, rs.len() as u64);
        ran.extend(jobs.iter().map(payload));
    }
    let unique: BTreeSet<&String> = ran.iter().collect();
    assert_eq!(unique.len(), ran.len(), "a job ran twice: {ran:?}");
    assert_eq!(
        unique,
        acked.iter().collect::<BTreeSet<_>>(),
        "the jobs that ran are not the acknowledged ones"
    );
    // And the deployment goes on.
    assert_eq!(enqueue_each(&b, 20..21).len(), 1);
}

fn payload(j: &shardq_core::ClaimedJob) -> String {
    String::from_utf8_lossy(&j.payload).into_owned()
}
