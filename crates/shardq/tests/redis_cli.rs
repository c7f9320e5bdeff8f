//! The command line on Redis shards, with real `redis-server` processes the
//! tests start on free loopback ports (`shardq_testkit::redis`; a missing
//! `redis-server` fails the tests with a message saying what to install):
//! init over four instances, enqueue, work, status; two workers with
//! different data dirs sharing the shards, one of them SIGKILLed; a live
//! rebalance from four instances to five under a producer and a worker
//! process; an unreachable server named with its shard and URL.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use shardq_route::{Router, ShardMap};
use shardq_testkit::redis::RedisServer;

mod support;
use support::{ok, output as shardq, signal, status_json, temp_dir, BIN};

/// Bound on every wait in these tests.
const WAIT_MAX: Duration = Duration::from_secs(60);
/// Worker lease: short, so a killed worker's shards are taken over quickly
/// and a new shard is noticed within a third of it.
const LEASE_MS: &str = "1000";
/// Producer rounds (one job per tenant each) after the rebalance returned.
const ROUNDS_AFTER: usize = 5;
/// Interval between producer rounds, in ms.
const FEED_EVERY_MS: u64 = 100;
/// Short Redis bounds (`shardq`'s own flags, docs/redis.md) for the
/// commands run while a server is down or hung: each call gives up within
/// a fraction of a second instead of the default 5 s of retries.
const SHORT_BOUNDS: [&str; 6] = [
    "--redis-connect-timeout-ms",
    "300",
    "--redis-reply-timeout-ms",
    "500",
    "--redis-retry-budget-ms",
    "300",
];
/// What a command given [`SHORT_BOUNDS`] takes at most against a server
/// that is down: well below the default retry budget alone (5 s).
const SHORT_BOUNDED: Duration = Duration::from_secs(4);

/// `args` followed by [`SHORT_BOUNDS`].
fn bounded<'a>(args: &[&'a str]) -> Vec<&'a str> {
    args.iter().copied().chain(SHORT_BOUNDS).collect()
}

fn servers(n: usize) -> Vec<RedisServer> {
    (0..n).map(|_| RedisServer::start()).collect()
}

fn urls(servers: &[RedisServer]) -> String {
    servers
        .iter()
        .map(RedisServer::url)
        .collect::<Vec<_>>()
        .join(",")
}

fn init(data: &Path, shards: usize, servers: &[RedisServer]) -> String {
    ok(&[
        "init",
        "--data",
        data.to_str().unwrap(),
        "--shards",
        &shards.to_string(),
        "--redis",
        &urls(servers),
    ])
}

fn worker(data: &Path, out: &Path, max_shards: &str, exit_when_idle: bool) -> Child {
    worker_with(data, out, max_shards, exit_when_idle, &[])
}

/// [`worker`] with more flags.
fn worker_with(
    data: &Path,
    out: &Path,
    max_shards: &str,
    exit_when_idle: bool,
    extra: &[&str],
) -> Child {
    let mut args = vec![
        "work".to_string(),
        "--data".into(),
        data.to_str().unwrap().into(),
        "--max-local-shards".into(),
        max_shards.into(),
        "--concurrency".into(),
        "4".into(),
        "--lease-ms".into(),
        LEASE_MS.into(),
        "--handler-builtin".into(),
        format!("append:{}", out.display()),
    ];
    if exit_when_idle {
        args.push("--exit-when-idle".into());
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    // Its log goes next to its output, for the failure messages.
    let log = std::fs::File::create(out.with_extension("log")).unwrap();
    Command::new(BIN)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

fn worker_log(out: &Path) -> String {
    std::fs::read_to_string(out.with_extension("log")).unwrap_or_default()
}

/// One line of the append handler: key, job id, attempt, shard.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    key: String,
    id: u64,
    attempt: u32,
    shard: String,
    /// The job's payload, which names it: a job that moved with its key
    /// has a new id on its new shard.
    payload: String,
}

fn runs(path: &Path) -> Vec<Run> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut p = l.split(' ');
            Some(Run {
                key: p.next()?.to_string(),
                id: p.next()?.parse().ok()?,
                attempt: p.next()?.parse().ok()?,
                shard: p.next()?.to_string(),
                payload: p.next()?.to_string(),
            })
        })
        .collect()
}

/// Per key, the jobs in the order their enqueues were reported, from
/// `KEY<TAB>SHARD:ID` lines of `enqueue --stdin`.
fn enqueued(stdout: &str) -> BTreeMap<String, Vec<(String, u64)>> {
    let mut out: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
    for l in stdout.lines() {
        let Some((k, (s, id))) = l
            .split_once('\t')
            .and_then(|(k, id)| Some((k, id.rsplit_once(':')?)))
        else {
            panic!("bad enqueue line {l:?}");
        };
        out.entry(k.to_string())
            .or_default()
            .push((s.to_string(), id.parse().unwrap()));
    }
    out
}

/// Per key, the payloads of `KEY<TAB>PAYLOAD` lines in input order (each
/// payload names one job of its key).
fn payloads_of(input: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for l in input.lines() {
        let (k, p) = l.split_once('\t').expect("KEY<TAB>PAYLOAD");
        out.entry(k.to_string()).or_default().push(p.to_string());
    }
    out
}

/// What the runs say about the enqueued jobs.
#[derive(Debug, Default, PartialEq, Eq)]
struct Verdict {
    lost: usize,
    order_violations: usize,
    /// Runs beyond a job's first.
    reruns: usize,
    /// Re-runs that were not a retry (attempt 1 seen twice).
    reruns_at_attempt_one: usize,
}

/// Jobs are named by (key, payload): `expected` from [`payloads_of`].
fn verdict(expected: &BTreeMap<String, Vec<String>>, runs: &[Run]) -> Verdict {
    let mut pos: HashMap<(String, String), (String, usize)> = HashMap::new();
    for (k, jobs) in expected {
        for (i, p) in jobs.iter().enumerate() {
            pos.insert((k.clone(), p.clone()), (k.clone(), i));
        }
    }
    let mut v = Verdict::default();
    let mut seen: HashMap<(String, String), u32> = HashMap::new();
    let mut last: HashMap<String, usize> = HashMap::new();
    for r in runs {
        let job = (r.key.clone(), r.payload.clone());
        let (key, i) = pos
            .get(&job)
            .unwrap_or_else(|| panic!("run of a job never enqueued: {r:?}"));
        let n = seen.entry(job).or_default();
        *n += 1;
        if *n > 1 {
            v.reruns += 1;
            if r.attempt == 1 {
                v.reruns_at_attempt_one += 1;
            }
            continue;
        }
        // First runs of a key must follow enqueue order with no gap.
        let want = last.get(key).map_or(0, |l| l + 1);
        if *i != want {
            v.order_violations += 1;
        }
        last.insert(key.clone(), *i);
    }
    v.lost = pos.len() - seen.len();
    v
}

/// [`support::wait_until`] within this file's bound.
fn wait_until(what: &str, done: impl FnMut() -> bool) {
    support::wait_until(what, WAIT_MAX, done)
}

fn sigterm_and_wait(child: &mut Child) {
    signal(child.id(), "-TERM");
    support::wait_exit(child, &format!("worker {}", child.id()), WAIT_MAX);
}

/// `enqueue --stdin` of `input` (KEY<TAB>PAYLOAD lines), which must succeed.
fn enqueue_all(data: &str, input: &str) {
    let mut p = Command::new(BIN)
        .args(["enqueue", "--data", data, "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    p.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    assert!(p.wait().unwrap().success());
}

fn jobs_text(keys: usize, per_key: usize) -> String {
    let mut s = String::new();
    for n in 0..per_key {
        for k in 0..keys {
            s.push_str(&format!("tenant-{k}\t{n}\n"));
        }
    }
    s
}

#[test]
fn init_over_four_instances_then_enqueue_work_and_status() {
    let servers = servers(4);
    let dir = temp_dir("basic");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    let said = init(&data, 4, &servers);
    assert!(said.contains("4 shards on Redis"), "{said}");
    assert!(data.join("remote.json").exists() && data.join("shardmap.yaml").exists());

    let mut p = Command::new(BIN)
        .args(["enqueue", "--data", d, "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let input = jobs_text(40, 10);
    p.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    assert!(out.status.success());
    let stored = enqueued(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(stored.values().map(Vec::len).sum::<usize>(), 400);
    let mut expected = payloads_of(&input);
    let solo = ok(&["enqueue", "--data", d, "--key", "solo", "--payload", "x"]);
    assert!(solo.trim().rsplit_once(':').is_some(), "{solo}");
    expected.insert("solo".into(), vec!["x".into()]);

    // Shard i lives on instance i: its keys are there and nowhere else.
    for (i, server) in servers.iter().enumerate() {
        for (j, other) in servers.iter().enumerate() {
            let exists = other.cli(&["EXISTS", &format!("sq:{{default:default:shard-{i}}}:meta")]);
            assert_eq!(exists.trim() == "1", i == j, "shard-{i} on instance {j}");
        }
        let _ = server;
    }
    let st = status_json(&data);
    assert_eq!(st["totals"]["ready"], 401, "{st}");
    assert_eq!(st["shards"].as_array().unwrap().len(), 4);

    let runs_file = dir.join("runs.txt");
    let mut w = worker(&data, &runs_file, "all", true);
    let start = Instant::now();
    while w.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < WAIT_MAX, "worker did not exit when idle");
        thread::sleep(Duration::from_millis(20));
    }
    assert!(w.wait().unwrap().success());
    let all = runs(&runs_file);
    let v = verdict(&expected, &all[..]);
    assert_eq!(v.lost, 0, "{v:?}");
    assert_eq!(v.order_violations, 0, "{v:?}");
    assert_eq!(all.len(), 401);
    let st = status_json(&data);
    assert_eq!(st["totals"]["ready"], 0, "{st}");
    assert_eq!(st["totals"]["in_flight"], 0, "{st}");
    // The worker released its leases on exit.
    assert!(st["shards"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["owner"].is_null()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_workers_with_different_data_dirs_share_the_shards() {
    let servers = servers(4);
    let dir = temp_dir("two");
    let (d1, d2) = (dir.join("one"), dir.join("two"));
    init(&d1, 4, &servers);
    // A second init in the same namespace is refused, naming the way out;
    // --join attaches another data dir to the deployment in Redis.
    let again = shardq(&[
        "init",
        "--data",
        dir.join("three").to_str().unwrap(),
        "--shards",
        "3",
        "--redis",
        &urls(&servers),
    ]);
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && err.contains("--join") && err.contains("--namespace"),
        "{err}"
    );
    let joined = ok(&[
        "init",
        "--data",
        d2.to_str().unwrap(),
        "--shards",
        "4",
        "--redis",
        &urls(&servers),
        "--join",
    ]);
    assert!(joined.contains("joined"), "{joined}");

    let mut p = Command::new(BIN)
        .args(["enqueue", "--data", d1.to_str().unwrap(), "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let input = jobs_text(100, 60);
    p.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    assert!(out.status.success());
    let total: usize = enqueued(&String::from_utf8_lossy(&out.stdout))
        .values()
        .map(Vec::len)
        .sum();
    assert_eq!(total, 6000);
    let expected = payloads_of(&input);

    // A takes two shards; B (the other data dir) the rest, then A's too
    // once A is killed and its leases lapse.
    let (f1, f2) = (dir.join("runs-1.txt"), dir.join("runs-2.txt"));
    let mut a = worker(&d1, &f1, "2", false);
    wait_until("worker A to claim two shards", || {
        status_json(&d1)["shards"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| !s["owner"].is_null())
            .count()
            == 2
    });
    let mut b = worker(&d2, &f2, "all", false);
    wait_until("worker B to run jobs", || !runs(&f2).is_empty());
    a.kill().unwrap();
    a.wait().unwrap();
    wait_until("every job to run", || {
        let mut all = runs(&f1);
        all.extend(runs(&f2));
        verdict(&expected, &all).lost == 0
    });
    sigterm_and_wait(&mut b);
    // B's lines come after A's: A was killed before B took its shards.
    let mut all = runs(&f1);
    all.extend(runs(&f2));
    let v = verdict(&expected, &all);
    assert_eq!(v.lost, 0, "{v:?}");
    assert_eq!(v.order_violations, 0, "{v:?}");
    assert_eq!(v.reruns_at_attempt_one, 0, "{v:?}");
    // Only jobs in flight at the kill run again: 4 slots per worker and
    // the runs its pool claimed ahead for them.
    assert!(v.reruns <= 4 * shardq_core::pool::CLAIM_AHEAD, "{v:?}");
    assert!(!runs(&f1).is_empty() && !runs(&f2).is_empty());
    let st = status_json(&d2);
    assert_eq!(st["totals"]["ready"], 0, "{st}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn load_map(data: &Path) -> ShardMap {
    ShardMap::from_yaml(&std::fs::read_to_string(data.join("shardmap.yaml")).unwrap()).unwrap()
}

/// Feeds `enqueue --stdin` a round over every tenant per step.
fn feed_text(tenants: usize, round: usize) -> String {
    (0..tenants)
        .map(|k| format!("tenant-{k}\t{round}\n"))
        .collect()
}

fn feed(stdin: &mut ChildStdin, tenants: usize, round: usize) {
    stdin
        .write_all(feed_text(tenants, round).as_bytes())
        .unwrap();
    stdin.flush().unwrap();
}

/// Long on purpose: one scenario, the instances and the producer's load,
/// the rebalance under it, then the map and placement checks, in the order
/// they happen.
#[test]
fn rebalance_from_four_instances_to_five_under_load() {
    let servers = servers(5);
    let dir = temp_dir("rebalance");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    init(&data, 4, &servers[..4]);
    let before = load_map(&data);

    let runs_file = dir.join("runs.txt");
    let mut w = worker(&data, &runs_file, "all", false);
    let mut producer = Command::new(BIN)
        .args(["enqueue", "--data", d, "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = producer.stdin.take().unwrap();
    let stdout = producer.stdout.take().unwrap();
    // Read what the producer stored while it runs, so its pipe never fills.
    let reader = thread::spawn(move || {
        let mut lines = String::new();
        for l in BufReader::new(stdout).lines() {
            lines.push_str(&l.unwrap());
            lines.push('\n');
        }
        lines
    });
    // 2,000 jobs/s offered: below what a debug-build worker runs on two
    // shared cores, so backlogs stay short and each batch drains quickly.
    let tenants = 200;
    let rebalanced = Arc::new(AtomicBool::new(false));
    let feeder = {
        let rebalanced = Arc::clone(&rebalanced);
        thread::spawn(move || {
            // A steady stream before and during the rebalance, and a few
            // rounds after it.
            let mut round = 0;
            let mut after = 0;
            while after < ROUNDS_AFTER {
                feed(&mut stdin, tenants, round);
                round += 1;
                if rebalanced.load(Ordering::SeqCst) {
                    after += 1;
                }
                thread::sleep(Duration::from_millis(FEED_EVERY_MS));
            }
            round
        })
    };
    wait_until("jobs to run before the change", || {
        runs(&runs_file).len() > 1_000
    });
    let added = ok(&[
        "add-shard",
        "--data",
        d,
        "shard-4",
        "--url",
        &servers[4].url(),
    ]);
    assert!(added.contains("warming"), "{added}");
    let rb_out = shardq(&[
        "rebalance",
        "--data",
        d,
        "--json",
        "--batch",
        "16",
        "--drain-timeout-ms",
        "30000",
    ]);
    assert!(
        rb_out.status.success(),
        "rebalance failed: {}\nworker log:\n{}",
        String::from_utf8_lossy(&rb_out.stderr),
        worker_log(&runs_file)
    );
    let report: serde_json::Value = serde_json::from_slice(&rb_out.stdout).unwrap();
    rebalanced.store(true, Ordering::SeqCst);
    let rounds = feeder.join().unwrap();
    let out = producer.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "producer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stored = enqueued(&reader.join().unwrap());
    let total: usize = stored.values().map(Vec::len).sum();
    assert_eq!(total, rounds * tenants);
    let input: String = (0..rounds).map(|r| feed_text(tenants, r)).collect();
    let expected = payloads_of(&input);
    wait_until("every job to run", || {
        verdict(&expected, &runs(&runs_file)).lost == 0
    });
    sigterm_and_wait(&mut w);

    let v = verdict(&expected, &runs(&runs_file));
    assert_eq!(v, Verdict::default(), "no loss, no reordering, no re-run");

    // The maps: 1 in 5 tenants moves, every one of them to the new shard.
    let after = load_map(&data);
    assert_eq!(after.shards.len(), 5);
    assert!(after.overrides.is_empty(), "{:?}", after.overrides);
    assert_eq!(after.version, report["to_version"].as_u64().unwrap());
    let (rb, ra) = (Router::new(before).unwrap(), Router::new(after).unwrap());
    let n = 10_000;
    let mut moved = 0;
    for i in 0..n {
        let key = format!("tenant-{i}");
        if rb.route(&key) != ra.route(&key) {
            moved += 1;
            assert_eq!(ra.route(&key), "shard-4", "{key}");
            // Jobs enqueued after the switch went to the new shard.
            if let Some(jobs) = stored.get(&key) {
                assert_eq!(jobs.last().unwrap().0, "shard-4", "{key}");
            }
        }
    }
    let fraction = moved as f64 / n as f64;
    assert!((fraction - 0.2).abs() <= 0.01, "moved fraction {fraction}");
    // Keys drained and switched live all went to the new shard.
    for (from, tos) in report["moves"].as_object().unwrap() {
        for to in tos.as_object().unwrap().keys() {
            assert_eq!(to, "shard-4", "{from} -> {to}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unreachable_server_is_named_with_its_shard_and_url() {
    let mut servers = servers(2);
    let dir = temp_dir("unreachable");
    let data = dir.join("data");
    let d = data.to_str().unwrap().to_string();
    init(&data, 2, &servers);
    // Shards on Redis need a Redis url, and no embedded one.
    let out = shardq(&["add-shard", "--data", &d, "shard-9"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--url is required"));
    let out = shardq(&["add-shard", "--data", &d, "shard-9", "--url", "file:"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not supported"));

    // The bounds are checked before anything is opened, naming the flag
    // and the value.
    for (flag, value) in [
        ("--redis-retry-budget-ms", "600001"),
        ("--redis-reply-timeout-ms", "0"),
        ("--redis-connect-timeout-ms", "60001"),
    ] {
        let out = shardq(&["status", "--data", &d, flag, value]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(flag) && err.contains(value), "{err}");
    }

    // A new shard on a server that does not answer: refused before it joins
    // the map, after the bounded retries (here the short ones given).
    let spare = RedisServer::start();
    let spare_url = spare.url();
    drop(spare);
    let started = Instant::now();
    let add = shardq(&bounded(&[
        "add-shard",
        "--data",
        &d,
        "shard-9",
        "--url",
        &spare_url,
    ]));
    assert!(
        started.elapsed() < SHORT_BOUNDED,
        "add-shard did not keep to --redis-retry-budget-ms: {:?}",
        started.elapsed()
    );
    // A shard whose server died: every command names it.
    let dead_url = servers[1].url();
    servers[1].kill();
    let status = shardq(&bounded(&["status", "--data", &d]));
    // `status` still shows the table, the dead shard marked (exit 2, as
    // for any shard that cannot be read), naming the shard and its URL.
    let err = String::from_utf8_lossy(&status.stderr);
    assert_eq!(status.status.code(), Some(2), "{err}");
    assert!(
        err.contains("shard \"shard-1\"") && err.contains(dead_url.as_str()),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&status.stdout).contains("shard-0"));
    let err = String::from_utf8_lossy(&add.stderr);
    // An unreachable store is "retry later" (EX_TEMPFAIL), not bad input.
    assert_eq!(add.status.code(), Some(75), "{err}");
    assert!(
        err.contains("shard \"shard-9\"")
            && err.contains(spare_url.as_str())
            && err.contains("Redis unreachable"),
        "{err}"
    );
    // Nothing was published for the shard that could not be reached.
    assert_eq!(load_map(&data).shards.len(), 2);
    // The map store itself down (it lives on the first server): still
    // "retry later", naming the map store's URL, not bad input.
    let map_url = servers[0].url();
    servers[0].kill();
    let out = shardq(&bounded(&[
        "add-shard",
        "--data",
        &d,
        "shard-8",
        "--url",
        &spare_url,
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{err}");
    assert!(err.contains(map_url.as_str()), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A failover to a lagging replica under a running `shardq work`: the
/// replica is stopped and cut off, `enqueue` with `--redis-wait-replicas 1`
/// is refused as retryable (exit 75) naming the replica count, `enqueue`
/// without it is acknowledged by the primary alone and the worker runs the
/// jobs; then the primary is SIGKILLed and the replica promoted behind the
/// proxy, and the worker stops with the store lost (exit 76) instead of
/// handing out job ids again.
#[test]
fn a_worker_stops_on_a_promoted_lagging_replica_and_wait_replicas_refuses_unconfirmed_enqueues() {
    use shardq_testkit::redis::TcpProxy;
    let mut primary = RedisServer::start();
    let replica = primary.start_replica();
    let proxy = TcpProxy::start(primary.port());
    let dir = temp_dir("failover");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    ok(&[
        "init",
        "--data",
        d,
        "--shards",
        "1",
        "--redis",
        &proxy.url(),
    ]);
    let enqueue = |payload: &str, wait: &str| {
        shardq(&[
            "enqueue",
            "--data",
            d,
            "--key",
            "t",
            "--payload",
            payload,
            "--redis-wait-replicas",
            wait,
        ])
    };
    let out = enqueue("1", "1");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ran = dir.join("runs.txt");
    let mut w = worker(&data, &ran, "1", false);
    wait_until("the first job to run", || runs(&ran).len() == 1);

    replica.pause();
    let cut = primary.cli(&["client", "kill", "type", "replica"]);
    assert_eq!(cut.trim(), "1", "CLIENT KILL TYPE replica: {cut}");
    let out = enqueue("2", "1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{err}");
    assert!(err.contains("0 of 1 replicas"), "{err}");
    for p in ["3", "4", "5"] {
        let out = enqueue(p, "0");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The unconfirmed enqueue is on the primary too: 5 jobs.
    wait_until("the primary's jobs to run", || runs(&ran).len() == 5);

    primary.kill();
    replica.resume();
    replica.promote();
    proxy.switch_to(replica.port());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = w.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < WAIT_MAX,
            "the worker ran on a store that went back in time: {}",
            worker_log(&ran)
        );
        thread::sleep(Duration::from_millis(20));
    };
    let log = worker_log(&ran);
    assert_eq!(status.code(), Some(76), "{log}");
    assert!(log.contains("went back in time"), "{log}");
    assert_eq!(runs(&ran).len(), 5, "a job ran on the rewound store");
}

/// Two instances holding `keys` keys of `per_key` jobs each, and a third
/// added (warming): its servers, temp dir, data dir (and as a string), and
/// the jobs as enqueued.
fn a_third_instance_added(
    name: &str,
    keys: usize,
    per_key: usize,
) -> (Vec<RedisServer>, PathBuf, PathBuf, String, String) {
    let servers = servers(3);
    let dir = temp_dir(name);
    let data = dir.join("data");
    let d = data.to_str().unwrap().to_string();
    init(&data, 2, &servers[..2]);
    let input = jobs_text(keys, per_key);
    enqueue_all(&d, &input);
    ok(&[
        "add-shard",
        "--data",
        &d,
        "shard-2",
        "--url",
        &servers[2].url(),
    ]);
    (servers, dir, data, d, input)
}

/// A rebalance while one instance is hung (SIGSTOP): it fails within its
/// bounds, naming that shard and its URL, as "retry later" (exit 75), and
/// leaves every key where it was: the jobs enqueued before all run, in
/// order, once the instance answers and the rerun finishes the move.
#[test]
fn a_rebalance_past_a_hung_instance_names_it_and_the_rerun_finishes() {
    let (servers, dir, data, d, input) = a_third_instance_added("hung-rebalance", 40, 5);
    servers[1].pause();
    let started = std::time::Instant::now();
    let out = shardq(&bounded(&["rebalance", "--data", &d]));
    let took = started.elapsed();
    servers[1].resume();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{err}");
    assert!(
        err.contains("shard \"shard-1\"") && err.contains(servers[1].url().as_str()),
        "the error names the hung shard and its URL: {err}"
    );
    assert!(
        took < std::time::Duration::from_secs(60),
        "not bounded: {took:?}"
    );
    let before = status_json(&data);
    assert_eq!(before["totals"]["ready"], 200, "{before}");
    ok(&["rebalance", "--data", &d]);
    assert_eq!(load_map(&data).shards.len(), 3);
    let runs_file = dir.join("runs");
    let mut w = worker(&data, &runs_file, "all", true);
    let status = w.wait().unwrap();
    assert!(status.success(), "{}", worker_log(&runs_file));
    let v = verdict(&payloads_of(&input), &runs(&runs_file));
    assert_eq!((v.lost, v.order_violations, v.reruns), (0, 0, 0), "{v:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// One of two instances down costs only its own shard: `status` prints
/// the table with that shard marked failed and the other counted, an
/// enqueue of a key on the live shard is stored at once while one on the
/// dead shard is refused as "retry later" (exit 75, not stored), and a
/// worker runs the live shard's jobs.
#[test]
fn one_instance_down_costs_only_its_own_shard() {
    let mut servers = servers(2);
    let dir = temp_dir("one-down");
    let data = dir.join("data");
    let d = data.to_str().unwrap().to_string();
    init(&data, 2, &servers);
    let map = load_map(&data);
    let router = shardq_route::Router::new(map).unwrap();
    let key_on = |shard: &str| {
        (0..)
            .map(|i| format!("t-{i}"))
            .find(|k| router.route(k) == shard)
            .unwrap()
    };
    let (live, dead) = (key_on("shard-0"), key_on("shard-1"));
    for k in [&live, &dead] {
        ok(&["enqueue", "--data", &d, "--key", k, "--payload", "before"]);
    }
    servers[1].kill();

    let started = Instant::now();
    let out = shardq(&bounded(&["status", "--data", &d, "--json"]));
    assert!(
        started.elapsed() < SHORT_BOUNDED,
        "status did not keep to --redis-retry-budget-ms: {:?}",
        started.elapsed()
    );
    assert_eq!(out.status.code(), Some(2));
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["shards"][0]["ready"], 1, "{st}");
    assert!(
        st["shards"][1]["error"]
            .as_str()
            .unwrap()
            .contains("shard-1"),
        "{st}"
    );
    assert_eq!(st["failed"], serde_json::json!(["shard-1"]), "{st}");

    let started = Instant::now();
    ok(&[
        "enqueue",
        "--data",
        &d,
        "--key",
        &live,
        "--payload",
        "after",
    ]);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "an enqueue to the live shard waited on the dead one: {:?}",
        started.elapsed()
    );
    let out = shardq(&bounded(&[
        "enqueue",
        "--data",
        &d,
        "--key",
        &dead,
        "--payload",
        "after",
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{err}");
    assert!(
        err.contains("NOT enqueued") && err.contains("shard-1"),
        "{err}"
    );

    let runs_file = dir.join("runs");
    let mut w = worker_with(&data, &runs_file, "all", true, &SHORT_BOUNDS);
    let start = Instant::now();
    while w.try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < WAIT_MAX,
            "worker did not exit: {}",
            worker_log(&runs_file)
        );
        thread::sleep(Duration::from_millis(20));
    }
    let ran: Vec<(String, String)> = runs(&runs_file)
        .into_iter()
        .map(|r| (r.key, r.payload))
        .collect();
    assert_eq!(
        ran,
        [
            (live.clone(), "before".into()),
            (live.clone(), "after".into())
        ],
        "{}",
        worker_log(&runs_file)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two instances holding 12 keys of 1,500 jobs, a third added, and a
/// `rebalance` (batches of one key) running onto it, returned once the
/// new instance holds copies and before the moves finish.
struct MidTransfer {
    servers: Vec<RedisServer>,
    dir: PathBuf,
    data: PathBuf,
    d: String,
    input: String,
    rebalance: Child,
}

impl MidTransfer {
    fn start(name: &str, stderr: Stdio) -> MidTransfer {
        let (servers, dir, data, d, input) = a_third_instance_added(name, 12, 1500);
        let warming = load_map(&data).version;
        let mut rebalance = Command::new(BIN)
            .args(["rebalance", "--data", &d, "--batch", "1"])
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let copied = || {
            let st = status_json(&data);
            st["shards"][2]["ready"].as_u64().unwrap_or(0) > 0
        };
        let start = Instant::now();
        while !(load_map(&data).version > warming && copied()) {
            assert!(
                rebalance.try_wait().unwrap().is_none(),
                "the rebalance ended before it was interrupted"
            );
            assert!(start.elapsed() < WAIT_MAX, "the rebalance copied nothing");
            thread::sleep(Duration::from_millis(2));
        }
        assert!(
            rebalance.try_wait().unwrap().is_none(),
            "the rebalance ended before it was interrupted"
        );
        MidTransfer {
            servers,
            dir,
            data,
            d,
            input,
            rebalance,
        }
    }

    /// Reruns `rebalance` until the interrupted one's lock lapses
    /// (REBALANCE_LOCK_MS) and a run finishes; returns the final map.
    fn rerun_once_the_lock_lapses(&self) -> ShardMap {
        assert!(
            !load_map(&self.data).overrides.is_empty(),
            "the moves had finished before the interruption"
        );
        let start = Instant::now();
        loop {
            let out = shardq(&["rebalance", "--data", &self.d]);
            if out.status.success() {
                break;
            }
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("another rebalance is running"), "{err}");
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the lock never lapsed: {err}"
            );
            thread::sleep(Duration::from_millis(500));
        }
        let map = load_map(&self.data);
        assert!(map.overrides.is_empty(), "{:?}", map.overrides);
        map
    }

    /// Every job is stored once; a worker then runs each once, in its
    /// key's order, on the shard `map` routes its key to. Returns the runs.
    fn run_every_job_once(&self, map: ShardMap) -> Vec<Run> {
        let st = status_json(&self.data);
        assert_eq!(
            st["totals"]["ready"],
            12 * 1500,
            "jobs lost or stored twice: {st}"
        );
        let runs_file = self.dir.join("runs");
        let mut w = worker(&self.data, &runs_file, "all", true);
        let start = Instant::now();
        while w.try_wait().unwrap().is_none() {
            assert!(
                start.elapsed() < WAIT_MAX,
                "worker did not finish: {}",
                worker_log(&runs_file)
            );
            thread::sleep(Duration::from_millis(20));
        }
        let all = runs(&runs_file);
        let v = verdict(&payloads_of(&self.input), &all);
        assert_eq!((v.lost, v.order_violations, v.reruns), (0, 0, 0), "{v:?}");
        let router = Router::new(map).unwrap();
        assert!(
            all.iter().all(|r| router.route(&r.key) == r.shard),
            "a job ran off its key's shard"
        );
        let _ = std::fs::remove_dir_all(&self.dir);
        all
    }
}

/// A rebalance onto a new instance SIGSTOPped while it copies backlogs,
/// long enough for its lock to lapse, while a second rebalance takes the
/// lock over and finishes; then the first wakes. It fails (a write refused:
/// the second raised each shard's rebalance epoch past its own; or, woken
/// inside a call, its retry budget spent), changes nothing, and every job
/// still exists exactly once, runs once, in its key's order, on the shard
/// its key routes to.
#[test]
fn a_rebalance_stopped_past_its_lock_cannot_write_behind_the_one_that_took_over() {
    use std::io::Read;
    let mut t = MidTransfer::start("stop-transfer", Stdio::piped());
    let pid = t.rebalance.id() as libc::pid_t;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let after = t.rerun_once_the_lock_lapses();
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let mut err = String::new();
    let mut pipe = t.rebalance.stderr.take().unwrap();
    pipe.read_to_string(&mut err).unwrap();
    let status = t.rebalance.wait().unwrap();
    assert!(!status.success(), "the woken rebalance succeeded: {err}");
    // Read where it is published: the data dir's copy is a cache, which a
    // process woken in the middle of writing it may leave older.
    let published = shardq_redis::RedisMapStore::open(&t.servers[0].url())
        .unwrap()
        .load_map()
        .unwrap()
        .unwrap();
    assert_eq!(published, after, "the woken rebalance changed the map");
    t.run_every_job_once(after);
}

/// A rebalance onto a new instance SIGKILLed while it copies backlogs (once
/// the new instance holds copies, before the moves finish), then rerun once
/// the dead holder's lock lapses: every job exists exactly once, runs once,
/// in its key's order, and the keys that moved run on the new instance.
#[test]
fn a_rebalance_killed_mid_transfer_on_redis_finishes_on_rerun_with_every_job_once() {
    let mut t = MidTransfer::start("kill-transfer", Stdio::null());
    t.rebalance.kill().unwrap();
    let _ = t.rebalance.wait();
    let map = t.rerun_once_the_lock_lapses();
    let all = t.run_every_job_once(map);
    assert!(
        all.iter().any(|r| r.shard == "shard-2"),
        "no key moved to the new instance"
    );
}

/// A deployment is written at this build's key layout, and one whose
/// record or any shard holds another layout (an older or newer build's) is
/// refused at open, naming the version found and the one this build reads;
/// a policy letting a key run several jobs at once changes no record.
#[test]
fn a_deployment_of_another_layout_is_refused_by_name() {
    let servers = servers(1);
    let dir = temp_dir("layout");
    let data = dir.join("data");
    let d = data.to_str().unwrap();
    init(&data, 2, &servers);
    let cli = |args: &[&str]| servers[0].cli(args);
    let records = || -> Vec<String> {
        let mut keys: Vec<String> = cli(&["KEYS", "sq:*:meta"])
            .lines()
            .map(String::from)
            .collect();
        keys.extend(cli(&["KEYS", "sq:{=dep:*}:info"]).lines().map(String::from));
        keys.retain(|k| !k.trim().is_empty());
        keys
    };
    let layouts = || -> Vec<String> {
        (records().iter())
            .map(|k| cli(&["HGET", k, "layout"]).trim().to_string())
            .collect()
    };
    let v = shardq_redis::keys::LAYOUT_VERSION.to_string();
    assert_eq!(
        layouts(),
        [v.as_str(); 3],
        "a new deployment is written at this build's layout"
    );
    ok(&[
        "policy",
        "set",
        "--data",
        d,
        "--prefix",
        "c:",
        "--concurrency",
        "3",
    ]);
    assert_eq!(layouts(), [v.as_str(); 3], "a policy changes no record");
    ok(&["enqueue", "--data", d, "--key", "c:k", "--payload", "0"]);
    let meta = &records()[0];
    cli(&["HSET", meta, "layout", "9"]);
    let err = shardq(&["status", "--data", d]);
    assert!(!err.status.success());
    let text = String::from_utf8_lossy(&err.stderr);
    assert!(text.contains("9") && text.contains(&v), "{text}");
}
