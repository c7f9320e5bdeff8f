//! The text output for a small fixed state, and the status cache bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use shardq_core::JobId;
use shardq_deploy::{ShardRow, StatusReport};

use super::*;

fn row(name: &str, ready: u64, error: Option<&str>) -> ShardRow {
    let ok = error.is_none();
    ShardRow {
        name: name.into(),
        ready: ok.then_some(ready),
        delayed: ok.then_some(1),
        in_flight: ok.then_some(2),
        dead: ok.then_some(3),
        keys: ok.then_some(4),
        fence_high: ok.then_some(1_700_000_000_123),
        owner: Some("host-a:42".into()),
        lease_expires_ms: Some(1_700_000_005_500),
        error: error.map(str::to_string),
    }
}

fn fixed() -> StatusSnapshot {
    StatusSnapshot {
        map_version: 7,
        report: StatusReport {
            shards: vec![
                row("s0", 5, None),
                row("s1", 0, Some("no answer in 2000 ms")),
            ],
            totals: Default::default(),
            failed: vec!["s1".into()],
            schedules: Some(shardq_core::schedule::ScheduleTotals {
                schedules: 3,
                paused: 1,
                fired: 40,
                skipped: 2,
                missed: 5,
            }),
            dependents: Some(shardq_core::workflow::DependentTotals {
                waiting: 4,
                released: 11,
                failed: 1,
                batches: 2,
                batch_jobs_waiting: 3,
                batch_jobs_released: 30,
                callbacks_fired: 7,
            }),
        },
    }
}

fn lines_of<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| {
            l.starts_with(&format!("{name} "))
                || l.starts_with(&format!("{name}{{"))
                || l.starts_with(&format!("# TYPE {name} "))
        })
        .collect()
}

/// One fixed state, then the lines of every family it renders.
///
/// Long on purpose: it reads as one story, the state built up and then each
/// family's lines in turn, checked against the same state.
#[test]
fn a_fixed_state_renders_as_documented() {
    let m = Metrics::new(Some(Arc::new(|| Ok(fixed()))), STATUS_TTL);
    let r = |id| Receipt {
        id: JobId(id),
        fence: 9,
    };
    m.enqueued("s0", 3);
    m.pool_event(&PoolEvent::RunStarted {
        shard: "s0".into(),
        wait_ms: 250,
    });
    m.pool_event(&PoolEvent::RunFinished {
        shard: "s0".into(),
        outcome: RunOutcome::Acked,
        wait_ms: 250,
        run_ms: 2000,
    });
    m.run_claimed("s1", r(1), 1_000, 1_500);
    m.run_claimed("s1", r(2), 1_000, 1_500);
    m.run_acked("s1", &[r(1), r(2)], &[r(2)], 2_000);
    m.run_claimed("s1", r(3), 1_000, 1_500);
    m.run_failed("s1", r(3), true, 4_500);
    m.refusals(&Refusals {
        fenced: [("s0".to_string(), 2)].into(),
        paused: [("s1".to_string(), 5)].into(),
        moved: [("s1".to_string(), 3)].into(),
    });
    m.rebalance_started();
    m.rebalance_event(&RebalanceEvent::Pinned {
        pinned: 4,
        version: 8,
    });
    m.rebalance_event(&RebalanceEvent::Moving { keys: 2 });
    let t = m.render();
    assert_eq!(
        lines_of(&t, "shardq_rebalance_keys_paused"),
        [
            "# TYPE shardq_rebalance_keys_paused gauge",
            "shardq_rebalance_keys_paused 2"
        ]
    );
    m.rebalance_event(&RebalanceEvent::Switched {
        done: 2,
        total: 4,
        keys: 2,
        pause_ms: 30.0,
        jobs: 0,
    });
    let t = m.render();
    let expect = |name: &str, want: &[&str]| {
        let mut got = lines_of(&t, name);
        got.sort();
        let mut want = want.to_vec();
        want.sort();
        assert_eq!(got, want, "{name} in:\n{t}");
    };
    expect(
        "shardq_shard_up",
        &[
            "# TYPE shardq_shard_up gauge",
            "shardq_shard_up{shard=\"s0\"} 1",
            "shardq_shard_up{shard=\"s1\"} 0",
        ],
    );
    expect(
        "shardq_shard_ready",
        &[
            "# TYPE shardq_shard_ready gauge",
            "shardq_shard_ready{shard=\"s0\"} 5",
        ],
    );
    expect(
        "shardq_shard_fence_high",
        &[
            "# TYPE shardq_shard_fence_high gauge",
            "shardq_shard_fence_high{shard=\"s0\"} 1700000000123",
        ],
    );
    expect(
        "shardq_shard_owner",
        &[
            "# TYPE shardq_shard_owner gauge",
            "shardq_shard_owner{shard=\"s0\",owner=\"host-a:42\"} 1",
            "shardq_shard_owner{shard=\"s1\",owner=\"host-a:42\"} 1",
        ],
    );
    expect(
        "shardq_shard_lease_expires_seconds",
        &[
            "# TYPE shardq_shard_lease_expires_seconds gauge",
            "shardq_shard_lease_expires_seconds{shard=\"s0\"} 1700000005.5",
            "shardq_shard_lease_expires_seconds{shard=\"s1\"} 1700000005.5",
        ],
    );
    expect(
        "shardq_map_version",
        &["# TYPE shardq_map_version gauge", "shardq_map_version 7"],
    );
    expect(
        "shardq_status_up",
        &["# TYPE shardq_status_up gauge", "shardq_status_up 1"],
    );
    for (name, v) in [
        ("shardq_schedules", 3),
        ("shardq_schedules_paused", 1),
        ("shardq_schedule_ticks_fired", 40),
        ("shardq_schedule_ticks_skipped", 2),
        ("shardq_schedule_ticks_missed", 5),
        ("shardq_dependents_waiting", 4),
        ("shardq_dependents_released", 11),
        ("shardq_dependents_failed", 1),
        ("shardq_batches_pending", 2),
        ("shardq_batch_jobs_waiting", 3),
        ("shardq_batch_jobs_released", 30),
        ("shardq_batch_callbacks_fired", 7),
    ] {
        expect(
            name,
            &[&format!("# TYPE {name} gauge"), &format!("{name} {v}")],
        );
    }
    expect(
        "shardq_jobs_enqueued_total",
        &[
            "# TYPE shardq_jobs_enqueued_total counter",
            "shardq_jobs_enqueued_total{shard=\"s0\"} 3",
        ],
    );
    expect(
        "shardq_jobs_claimed_total",
        &[
            "# TYPE shardq_jobs_claimed_total counter",
            "shardq_jobs_claimed_total{shard=\"s0\"} 1",
            "shardq_jobs_claimed_total{shard=\"s1\"} 3",
        ],
    );
    expect(
        "shardq_jobs_acked_total",
        &[
            "# TYPE shardq_jobs_acked_total counter",
            "shardq_jobs_acked_total{shard=\"s0\"} 1",
            "shardq_jobs_acked_total{shard=\"s1\"} 1",
        ],
    );
    expect(
        "shardq_results_stale_total",
        &[
            "# TYPE shardq_results_stale_total counter",
            "shardq_results_stale_total{shard=\"s1\"} 1",
        ],
    );
    expect(
        "shardq_jobs_dead_lettered_total",
        &[
            "# TYPE shardq_jobs_dead_lettered_total counter",
            "shardq_jobs_dead_lettered_total{shard=\"s1\"} 1",
        ],
    );
    // A family with no series yet prints nothing.
    expect("shardq_jobs_retried_total", &[]);
    expect(
        "shardq_enqueue_fenced_total",
        &[
            "# TYPE shardq_enqueue_fenced_total counter",
            "shardq_enqueue_fenced_total{shard=\"s0\"} 2",
        ],
    );
    expect(
        "shardq_enqueue_paused_total",
        &[
            "# TYPE shardq_enqueue_paused_total counter",
            "shardq_enqueue_paused_total{shard=\"s1\"} 5",
        ],
    );
    // Waits: 0.25 s (pool) and 3 x 0.5 s (remote claims).
    expect(
        "shardq_job_wait_seconds_count",
        &["shardq_job_wait_seconds_count 4"],
    );
    expect(
        "shardq_job_wait_seconds_sum",
        &["shardq_job_wait_seconds_sum 1.75"],
    );
    assert!(
        t.contains("shardq_job_wait_seconds_bucket{le=\"0.25\"} 1\n")
            && t.contains("shardq_job_wait_seconds_bucket{le=\"0.5\"} 4\n")
            && t.contains("shardq_job_wait_seconds_bucket{le=\"+Inf\"} 4\n"),
        "{t}"
    );
    // Runs: 2 s (pool), 0.5 s (remote ack) and 3 s (remote fail); the
    // stale ack is not a run time.
    expect(
        "shardq_job_run_seconds_count",
        &["shardq_job_run_seconds_count 3"],
    );
    expect(
        "shardq_job_run_seconds_sum",
        &["shardq_job_run_seconds_sum 5.5"],
    );
    expect(
        "shardq_rebalance_phase",
        &[
            "# TYPE shardq_rebalance_phase gauge",
            "shardq_rebalance_phase{phase=\"idle\"} 0",
            "shardq_rebalance_phase{phase=\"pinning\"} 0",
            "shardq_rebalance_phase{phase=\"moving\"} 1",
            "shardq_rebalance_phase{phase=\"finished\"} 0",
            "shardq_rebalance_phase{phase=\"failed\"} 0",
        ],
    );
    expect(
        "shardq_rebalance_keys_moved",
        &[
            "# TYPE shardq_rebalance_keys_moved gauge",
            "shardq_rebalance_keys_moved 2",
        ],
    );
    expect(
        "shardq_rebalance_keys_to_move",
        &[
            "# TYPE shardq_rebalance_keys_to_move gauge",
            "shardq_rebalance_keys_to_move 4",
        ],
    );
    expect(
        "shardq_rebalance_keys_paused",
        &[
            "# TYPE shardq_rebalance_keys_paused gauge",
            "shardq_rebalance_keys_paused 0",
        ],
    );
    expect(
        "shardq_rebalance_key_pause_seconds_count",
        &["shardq_rebalance_key_pause_seconds_count 2"],
    );
    assert!(
        t.contains("shardq_rebalance_key_pause_seconds_bucket{le=\"0.025\"} 0\n")
            && t.contains("shardq_rebalance_key_pause_seconds_bucket{le=\"0.05\"} 2\n"),
        "{t}"
    );
    m.rebalance_ended(Ok(4));
    let t = m.render();
    assert!(
        t.contains("shardq_rebalance_phase{phase=\"finished\"} 1\n"),
        "{t}"
    );
    assert!(t.contains("shardq_rebalance_keys_moved 4\n"), "{t}");
    // Every series has its HELP and TYPE lines.
    for l in t.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = l.split(' ').nth(2).unwrap();
        assert!(t.contains(&format!("# HELP {name} ")), "no HELP for {name}");
    }
}

#[test]
fn a_scrape_storm_reads_the_status_once_per_ttl() {
    let reads = Arc::new(AtomicUsize::new(0));
    let source: StatusSource = {
        let reads = Arc::clone(&reads);
        Arc::new(move || {
            reads.fetch_add(1, Ordering::SeqCst);
            Ok(fixed())
        })
    };
    let m = Arc::new(Metrics::new(Some(source), STATUS_TTL));
    let started = Instant::now();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let m = Arc::clone(&m);
            std::thread::spawn(move || {
                for _ in 0..50 {
                    assert!(m.render().contains("shardq_shard_ready{shard=\"s0\"} 5"));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = started.elapsed();
    let n = reads.load(Ordering::SeqCst);
    // One read, plus one more per full TTL the 200 scrapes took.
    let allowed = 1 + (elapsed.as_millis() / STATUS_TTL.as_millis()) as usize;
    assert!(n >= 1 && n <= allowed, "{n} reads in {elapsed:?}");
}

#[test]
fn an_unreadable_status_drops_the_shard_series_and_says_so() {
    let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let source: StatusSource = {
        let fail = Arc::clone(&fail);
        Arc::new(move || {
            if fail.load(Ordering::SeqCst) {
                Err("reading the status of data dir /x: the map is unreadable".into())
            } else {
                Ok(fixed())
            }
        })
    };
    let m = Metrics::new(Some(source), Duration::ZERO);
    assert!(m.render().contains("shardq_shard_ready{shard=\"s0\"} 5\n"));
    fail.store(true, Ordering::SeqCst);
    let t = m.render();
    assert!(t.contains("shardq_status_up 0\n"), "{t}");
    assert!(!t.contains("shardq_shard_ready{"), "{t}");
    assert!(!t.contains("shardq_shard_up{"), "{t}");
}

#[test]
fn without_a_source_there_are_no_shard_series() {
    let m = Metrics::new(None, STATUS_TTL);
    let t = m.render();
    assert!(!t.contains("shardq_shard_"), "{t}");
    assert!(
        t.contains("shardq_rebalance_phase{phase=\"idle\"} 1\n"),
        "{t}"
    );
}

#[test]
fn every_per_shard_counter_exists_at_zero_before_its_first_event() {
    let m = Metrics::new(None, STATUS_TTL);
    m.start_at_zero(&["s0".to_string(), "s1".to_string()]);
    let text = m.render();
    for name in [
        "shardq_jobs_enqueued_total",
        "shardq_jobs_claimed_total",
        "shardq_jobs_acked_total",
        "shardq_jobs_retried_total",
        "shardq_jobs_dead_lettered_total",
        "shardq_results_stale_total",
        "shardq_enqueue_fenced_total",
        "shardq_enqueue_paused_total",
    ] {
        for s in ["s0", "s1"] {
            let series = format!("{name}{{shard=\"{s}\"}} 0");
            assert!(text.contains(&series), "{series} missing:\n{text}");
        }
    }
}
