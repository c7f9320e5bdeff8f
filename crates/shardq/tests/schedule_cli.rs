//! Schedules through the real binary: `schedule set|list|show|pause|
//! resume|trigger|backfill|delete`, and exactly one job per tick while
//! two workers are SIGKILLed, restarted and SIGSTOPped around the ticks,
//! on the embedded engine, on Redis instances and on a Redis Cluster. The invariant is read from the
//! handler's own log and from a backfill over the whole range: every tick
//! up to the last decided one stored exactly one job.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shardq_testkit::redis::{RedisCluster, RedisServer};
use support::{ok, run, side_by_side, temp_dir, wait_until, BIN, WAIT_MAX};

/// The handler's line per run: the job, then the schedule and the tick
/// the job names (`SHARDQ_SCHEDULE`, `SHARDQ_SCHEDULE_TIME_MS`).
fn handler_line(log: &Path) -> String {
    format!(
        "echo \"$SHARDQ_SHARD:$SHARDQ_JOB_ID $SHARDQ_SCHEDULE $SHARDQ_SCHEDULE_TIME_MS\" >> {}",
        log.display()
    )
}

fn worker(data: &Path, log: &Path, extra: &[&str]) -> Child {
    let line = handler_line(log);
    Command::new(BIN)
        .args([
            "work",
            "--data",
            data.to_str().unwrap(),
            "--max-local-shards",
            "all",
        ])
        .args(["--lease-ms", "2000"])
        .args(extra)
        .args(["--", "sh", "-c", &line])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts a worker")
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a child this test started and has not reaped.
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

fn show(data: &Path, id: &str) -> serde_json::Value {
    let out = ok(&[
        "schedule",
        "show",
        "--data",
        data.to_str().unwrap(),
        id,
        "--json",
    ]);
    serde_json::from_str(&out).unwrap()
}

/// SIGKILLs and restarts a worker, or SIGSTOPs one for up to 3 s, or
/// leaves them be (`roll` picks).
fn kill_or_stop(data: &Path) -> impl FnMut(&mut Vec<Child>, u64, &Path) + '_ {
    move |workers, roll, log| {
        let i = (roll % 2) as usize;
        match (roll >> 8) % 3 {
            0 => {
                signal(&workers[i], libc::SIGKILL);
                let _ = workers[i].wait();
                workers[i] = worker(data, log, &[]);
            }
            1 => {
                signal(&workers[i], libc::SIGSTOP);
                // Real time: the stall is the disturbance; its leases lapse meanwhile.
                std::thread::sleep(Duration::from_millis(500 + (roll >> 16) % 2500));
                signal(&workers[i], libc::SIGCONT);
            }
            _ => {}
        }
    }
}

fn ticks_survive_kills_and_stops(data: &Path, dir: &Path) {
    ticks_survive(data, dir, kill_or_stop(data));
}

/// Sets a 1 s schedule on an initialised data dir `data`, runs two workers
/// for 12 s while `disturb` (given the workers, a random number and the
/// handler log) acts every 0.3 to 1.2 s, then checks every decided tick
/// stored exactly one job.
/// Long on purpose: one run, its schedule, the workers and the disturbance
/// loop, the catch-up and the checks from the handler log, in the order
/// they happen.
fn ticks_survive(data: &Path, dir: &Path, mut disturb: impl FnMut(&mut Vec<Child>, u64, &Path)) {
    let d = data.to_str().unwrap();
    ok(&[
        "schedule",
        "set",
        "--data",
        d,
        "every-second",
        "--key",
        "tenant-42",
        "--every",
        "1s",
        "--overlap",
        "all",
        "--catch-up",
        "1m",
        "--payload",
        "tick",
    ]);
    let log = dir.join("handled.log");
    let mut workers = vec![worker(data, &log, &[]), worker(data, &log, &[])];
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(12) {
        std::thread::sleep(Duration::from_millis(300 + next() % 900));
        disturb(&mut workers, next(), &log);
    }
    for w in &mut workers {
        signal(w, libc::SIGKILL);
        let _ = w.wait();
    }
    // One worker catches up every due tick and stops cleanly (its last
    // pass recorded), then the schedule pauses and the backlog drains.
    let mut last = worker(data, &log, &[]);
    let before = show(data, "every-second")["state"]["decided_ms"]
        .as_u64()
        .unwrap();
    wait_until("the last worker catches up", WAIT_MAX, || {
        show(data, "every-second")["state"]["decided_ms"]
            .as_u64()
            .unwrap()
            > before + 2_000
    });
    signal(&last, libc::SIGTERM);
    assert!(last.wait().unwrap().success());
    ok(&["schedule", "pause", "--data", d, "every-second"]);
    let drained = Command::new(BIN)
        .args([
            "work",
            "--data",
            d,
            "--max-local-shards",
            "all",
            "--exit-when-idle",
        ])
        .args(["--", "sh", "-c"])
        .arg(handler_line(&log))
        .output()
        .unwrap();
    assert!(
        drained.status.success(),
        "{}",
        String::from_utf8_lossy(&drained.stderr)
    );

    let view = show(data, "every-second");
    let since = view["since_ms"].as_u64().unwrap();
    let decided = view["state"]["decided_ms"].as_u64().unwrap();
    let expected = decided / 1_000 - since / 1_000;
    assert!(expected >= 12, "ticks decided: {expected}");
    assert_eq!(
        view["state"]["missed"], 0,
        "no tick was past its catch-up: {view}"
    );
    // Every job that ran, once per job however many times it ran, and
    // the tick each names, from the handler's own log: the ticks that
    // produced a job are exactly the decided ones, each by one job.
    let text = std::fs::read_to_string(&log).unwrap();
    let mut runs: BTreeMap<&str, u64> = BTreeMap::new();
    for l in text.lines() {
        let mut f = l.split(' ');
        let (job, sched, tick) = (f.next().unwrap(), f.next(), f.next());
        assert_eq!(sched, Some("every-second"), "{l}");
        let tick: u64 = tick
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{l}"));
        let was = runs.insert(job, tick);
        assert!(was.is_none_or(|t| t == tick), "job {job} named two ticks");
    }
    assert_eq!(
        runs.len() as u64,
        expected,
        "jobs that ran vs ticks decided ({} runs in all)",
        text.lines().count()
    );
    let ticks: std::collections::BTreeSet<u64> = runs.values().copied().collect();
    let want: std::collections::BTreeSet<u64> = (since / 1_000 + 1..=decided / 1_000)
        .map(|s| s * 1_000)
        .collect();
    assert_eq!(ticks, want, "the ticks the handler saw vs the decided ones");
    // And no tick without its job: a backfill over every decided tick
    // stores nothing new.
    let out = ok(&[
        "schedule",
        "backfill",
        "--data",
        d,
        "every-second",
        "--from",
        &(since + 1).to_string(),
        "--to",
        &decided.to_string(),
        "--json",
    ]);
    let b: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(b["ticks"].as_u64(), Some(expected), "{b}");
    assert_eq!(b["stored"], 0, "a decided tick had no job: {b}");
}

/// How one trial of the schedule's ticks is disturbed, and where.
#[derive(Clone, Copy, Debug)]
enum TickTrial {
    /// Workers SIGKILLed and SIGSTOPped on the embedded engine.
    Embedded,
    /// The schedule's key pinned to another shard and rebalanced, again
    /// and again, while two workers fire its ticks: the key, its backlog
    /// and its ticks' dedup records move under the ticks.
    Pins,
    /// Workers SIGKILLed and SIGSTOPped on two Redis instances.
    Redis,
    /// The same on a 3-master Redis Cluster.
    Cluster,
}

fn tick_trial(trial: TickTrial) {
    let dir = temp_dir(&format!("schedule-{trial:?}").to_lowercase());
    let data = dir.join("data");
    let d = data.to_str().unwrap().to_string();
    match trial {
        TickTrial::Embedded => {
            ok(&["init", "--data", &d, "--shards", "2"]);
            ticks_survive_kills_and_stops(&data, &dir);
        }
        TickTrial::Pins => {
            ok(&["init", "--data", &d, "--shards", "3"]);
            let mut to = 0;
            let pins = d.clone();
            ticks_survive(&data, &dir, move |_, _, _| {
                to = (to + 1) % 3;
                ok(&["pin", "--data", &pins, "tenant-42", &format!("shard-{to}")]);
                ok(&["rebalance", "--data", &pins]);
            });
            let moved = std::fs::read_to_string(data.join("shardmap.yaml")).unwrap();
            assert!(moved.contains("tenant-42"), "the key was pinned: {moved}");
        }
        TickTrial::Redis => {
            let a = RedisServer::start();
            let b = RedisServer::start();
            let urls = format!("{},{}", a.url(), b.url());
            ok(&["init", "--data", &d, "--shards", "2", "--redis", &urls]);
            ticks_survive_kills_and_stops(&data, &dir);
        }
        TickTrial::Cluster => {
            let cluster = RedisCluster::start(3);
            let seeds: Vec<String> = cluster.nodes.iter().map(RedisServer::url).collect();
            ok(&[
                "init",
                "--data",
                &d,
                "--shards",
                "3",
                "--redis-cluster",
                &seeds.join(","),
            ]);
            ticks_survive_kills_and_stops(&data, &dir);
        }
    }
}

/// Every decided tick stores exactly one job through SIGKILLs and
/// SIGSTOPs of the workers on the embedded engine, Redis instances and a
/// Redis Cluster, and while pins move the key between shards. The four
/// trials wait on real time (12 s of disturbances each), so they run side
/// by side; a failure names its trial.
#[test]
fn each_tick_stores_one_job_through_kills_stops_and_moves_on_every_backend() {
    side_by_side(
        vec![
            TickTrial::Embedded,
            TickTrial::Pins,
            TickTrial::Redis,
            TickTrial::Cluster,
        ],
        |_, trial| {
            let _named = support::Named(format!("schedule trial {trial:?}"));
            tick_trial(trial);
        },
    );
}

/// Long on purpose: a table of bad commands, each refused the same way,
/// then one schedule managed through its commands, each step on the state
/// the one before left.
#[test]
fn schedule_commands_refuse_bad_input_by_name_and_manage_a_schedule() {
    let dir = temp_dir("schedule-commands");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    ok(&["init", "--data", d, "--shards", "2"]);
    let big_file = dir.join("big.txt").to_string_lossy().into_owned();
    std::fs::write(&big_file, "x".repeat((1 << 20) + 1)).unwrap();
    for (args, words) in [
        (vec!["--cron", "0 0 31 2 *"], "invalid cron \"0 0 31 2 *\""),
        (vec!["--cron", "* * *"], "invalid cron \"* * *\""),
        (
            vec!["--cron", "0 2 * * *", "--tz", "Europe/Atlantis"],
            "invalid tz \"Europe/Atlantis\"",
        ),
        (vec!["--every", "999ms"], "invalid every 999 ms"),
        (vec!["--every", "5 parsecs"], "invalid every \"5 parsecs\""),
        (
            vec![
                "--every",
                "1m",
                "--start",
                "2030-01-02T00:00:00Z",
                "--end",
                "2030-01-01T00:00:00Z",
            ],
            "invalid start",
        ),
        (
            vec!["--every", "1m", "--catch-up", "2d"],
            "invalid catch-up 172800000 ms",
        ),
        (
            vec!["--every", "1m", "--overlap", "sometimes"],
            "invalid overlap sometimes",
        ),
        (vec!["--every", "1m", "--max-attempts", "0"], "max"),
        (
            vec!["--every", "1m", "--jitter", "6m"],
            "invalid jitter 360000 ms: must be at most the catch-up (300000 ms)",
        ),
        (
            vec!["--every", "1m", "--payload-file", &big_file],
            "invalid payload of 1048577 bytes",
        ),
    ] {
        let mut all = vec!["schedule", "set", "--data", d, "s", "--key", "k"];
        all.extend(args.iter());
        let (good, _, err) = run(&all);
        assert!(!good, "{args:?} was accepted");
        assert!(err.contains(words), "{args:?}: {err}");
    }
    let (good, _, err) = run(&[
        "schedule", "set", "--data", d, "bad id", "--key", "k", "--every", "1m",
    ]);
    assert!(
        !good && err.contains("invalid schedule id \"bad id\""),
        "{err}"
    );
    // Nothing was stored by the refusals.
    assert_eq!(
        ok(&["schedule", "list", "--data", d]).trim(),
        "no schedules"
    );

    ok(&[
        "schedule",
        "set",
        "--data",
        d,
        "nightly",
        "--key",
        "tenant-1",
        "--cron",
        "30 2 * * *",
        "--tz",
        "Europe/Berlin",
        "--payload",
        "bill",
    ]);
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["schedule", "show", "--data", d, "nightly", "--json"])).unwrap();
    assert_eq!(v["when"]["cron"]["tz"], "Europe/Berlin");
    assert!(v["next_fire_ms"].as_u64().is_some());
    ok(&["schedule", "pause", "--data", d, "nightly"]);
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["schedule", "show", "--data", d, "nightly", "--json"])).unwrap();
    assert_eq!(v["paused"], true);
    assert!(v["next_fire_ms"].is_null());
    // A trigger enqueues one job now, paused or not.
    let t: serde_json::Value = serde_json::from_str(&ok(&[
        "schedule", "trigger", "--data", d, "nightly", "--json",
    ]))
    .unwrap();
    assert!(t["job"].as_u64().is_some(), "{t}");
    let jobs = ok(&["jobs", "--data", d, "--key", "tenant-1", "--json"]);
    assert!(
        jobs.contains("bill") || jobs.contains(&t["job"].to_string()),
        "{jobs}"
    );
    // A backfill of two nights stores two jobs, and again none.
    let range = [
        "--from",
        "2026-03-28T00:00:00Z",
        "--to",
        "2026-03-30T00:00:00Z",
        "--json",
    ];
    let mut args = vec!["schedule", "backfill", "--data", d, "nightly"];
    args.extend(range);
    let first: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
    assert_eq!(
        (first["ticks"].as_u64(), first["stored"].as_u64()),
        (Some(2), Some(2)),
        "{first}"
    );
    let again: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
    let (good, _, err) = run(&[
        "schedule",
        "backfill",
        "--data",
        d,
        "nightly",
        "--from",
        "2026-03-28T00:00:00Z",
        "--to",
        "2999-01-01T00:00:00Z",
    ]);
    assert!(!good && err.contains("invalid backfill end"), "{err}");
    assert_eq!(again["stored"], 0, "{again}");
    ok(&["schedule", "resume", "--data", d, "nightly"]);
    let (good, _, err) = run(&["schedule", "pause", "--data", d, "nope"]);
    assert!(!good && err.contains("invalid schedule \"nope\""), "{err}");
    assert!(ok(&["schedule", "delete", "--data", d, "nightly"]).contains("deleted"));
    assert_eq!(
        ok(&["schedule", "list", "--data", d]).trim(),
        "no schedules"
    );
}

/// `schedule apply --file`: a YAML or JSON file of schedules set in one
/// change, a dry run that stores nothing, `--prune`, and a bad file (an
/// unknown field, a bad schedule among good ones) refused naming the
/// field or the schedule, storing nothing.
#[test]
fn schedule_apply_sets_a_file_whole_or_not_at_all() {
    let dir = temp_dir("schedule-apply");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    ok(&["init", "--data", d, "--shards", "2"]);
    ok(&[
        "schedule", "set", "--data", d, "manual", "--key", "k0", "--every", "1m",
    ]);
    let file = dir.join("schedules.yaml");
    std::fs::write(
        &file,
        "schedules:\n  nightly:\n    key: tenant-1\n    cron: \"30 2 * * *\"\n    tz: Europe/Berlin\n    payload: bill\n  poll:\n    key: feeds\n    every: 5m\n    overlap: one\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let json = |args: &[&str]| -> serde_json::Value { serde_json::from_str(&ok(args)).unwrap() };
    let dry = json(&[
        "schedule",
        "apply",
        "--data",
        d,
        "--file",
        f,
        "--prune",
        "--dry-run",
        "--json",
    ]);
    assert_eq!(
        dry["applied"]["added"],
        serde_json::json!(["nightly", "poll"]),
        "{dry}"
    );
    assert_eq!(
        dry["applied"]["removed"],
        serde_json::json!(["manual"]),
        "{dry}"
    );
    let list = ok(&["schedule", "list", "--data", d]);
    assert!(
        list.contains("manual") && !list.contains("nightly"),
        "the dry run stored: {list}"
    );
    let done = ok(&["schedule", "apply", "--data", d, "--file", f]);
    assert!(
        done.contains("added 2, changed 0, unchanged 0, deleted 0"),
        "{done}"
    );
    let again = json(&[
        "schedule", "apply", "--data", d, "--file", f, "--prune", "--json",
    ]);
    assert_eq!(
        again["applied"]["unchanged"],
        serde_json::json!(["nightly", "poll"]),
        "{again}"
    );
    assert_eq!(
        again["applied"]["removed"],
        serde_json::json!(["manual"]),
        "{again}"
    );
    let v = show(&data, "nightly");
    assert_eq!(v["when"]["cron"]["tz"], "Europe/Berlin", "{v}");
    // JSON by its name; a bad schedule among good ones stores nothing.
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"schedules": {"fine": {"key": "k", "every": "1m"}, "broken": {"key": "k", "cron": "61 * * * *"}}}"#,
    )
    .unwrap();
    let (good, _, err) = run(&[
        "schedule",
        "apply",
        "--data",
        d,
        "--file",
        bad.to_str().unwrap(),
    ]);
    assert!(
        !good && err.contains("schedule \"broken\": invalid cron \"61 * * * *\""),
        "{err}"
    );
    let odd = dir.join("odd.yaml");
    std::fs::write(
        &odd,
        "schedules:\n  x:\n    key: k\n    every: 1m\n    colour: red\n",
    )
    .unwrap();
    let (good, _, err) = run(&[
        "schedule",
        "apply",
        "--data",
        d,
        "--file",
        odd.to_str().unwrap(),
    ]);
    assert!(!good && err.contains("unknown field `colour`"), "{err}");
    let list = ok(&["schedule", "list", "--data", d]);
    assert!(
        !list.contains("fine") && !list.contains("\nx\t"),
        "a refused file stored: {list}"
    );
}
