//! Batches through the real binary, tried as an attacker would: jobs on
//! many keys, a job that adds to its batch after the close (and may run
//! twice), a dead job, while keys move (`add-shard` + `rebalance`, `pin`)
//! and the worker is SIGKILLed and started again, on the embedded engine,
//! Redis instances and a Redis Cluster. The invariants are checked from the handlers' own log: each
//! callback starts once, and only after every job of its batch ended; the
//! success callback never starts for a batch with a dead job; the death
//! callback starts once; jobs added from inside a job are stored once.

mod support;

use std::path::Path;
use std::time::Duration;

use shardq_testkit::redis::{RedisCluster, RedisServer};
use support::{
    init_shards, init_shards_with, ok, run, seed, signal, temp_dir, trial_worker, Disturb, Lcg,
};

/// The keys a `Pin` trial moves.
const PIN: &[&str] = &["cb-a", "a-3", "fan-k1"];

/// The handler: logs `start`/`end` lines with a nanosecond clock; a job
/// whose payload is `die` fails; `fan` adds four jobs to its batch (with
/// dedup ids: run again, it adds nothing twice); a result `r-PAYLOAD`.
const HANDLER: &str = r#"read p
echo "start $SHARDQ_KEY ${SHARDQ_BATCH:--} ${SHARDQ_BATCH_CALLBACK:--} $p $(date +%s%N) $SHARDQ_ATTEMPT" >> "$LOG"
[ "$p" = die ] && exit 1
if [ "$p" = fan ]; then
  for i in 0 1 2 3; do
    "$SHARDQ_BIN" enqueue --data "$DATA" --key "fan-k$i" --payload "f$i" --batch "$SHARDQ_BATCH" --dedup-id "fan-$i" > /dev/null || exit 1
  done
fi
sleep 0.01
printf 'r-%s' "$p" > "$SHARDQ_RESULT_FILE"
echo "end $SHARDQ_KEY ${SHARDQ_BATCH:--} ${SHARDQ_BATCH_CALLBACK:--} $p $(date +%s%N) $SHARDQ_ATTEMPT" >> "$LOG"
"#;

/// One line of the handlers' log.
#[derive(Debug, Clone)]
struct Line {
    start: bool,
    batch: Option<String>,
    callback: Option<String>,
    payload: String,
    ns: u128,
    attempt: u32,
}

fn read_log(log: &Path) -> Vec<Line> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() == 7).then(|| Line {
                start: f[0] == "start",
                batch: (f[2] != "-").then(|| f[2].to_string()),
                callback: (f[3] != "-").then(|| f[3].to_string()),
                payload: f[4].to_string(),
                ns: f[5].parse().unwrap_or(0),
                attempt: f[6].parse().unwrap_or(0),
            })
        })
        .collect()
}

fn show(d: &str, id: &str) -> serde_json::Value {
    serde_json::from_str(&ok(&["batch", "show", "--data", d, id, "--json"])).unwrap()
}

fn add(d: &str, batch: &str, key: &str, payload: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "enqueue",
        "--data",
        d,
        "--key",
        key,
        "--payload",
        payload,
        "--batch",
        batch,
    ];
    args.extend(extra);
    ok(&args).trim().to_string()
}

fn open_batch(d: &str, key: &str) -> String {
    ok(&[
        "batch",
        "open",
        "--data",
        d,
        "--key",
        key,
        "--on-complete",
        "complete",
        "--on-success",
        "success",
        "--on-death",
        "death",
    ])
    .trim()
    .to_string()
}

/// One trial: two batches, a disturbance at a random moment, the worker
/// SIGKILLed at another and a second worker to the end; then the
/// invariants.
/// Long on purpose: one trial, its batches, its disturbance and kill at
/// seeded moments and the invariants read from the handlers' log, in the
/// order they happen.
fn trial(name: &str, d: &str, log: &Path, seed: u64, disturb: Disturb) {
    let mut rng = Lcg(seed);
    // Batch a: 24 jobs over 6 keys and a job that fans out after the
    // close. Batch b: 3 jobs and one that dies.
    let a = open_batch(d, "cb-a");
    for i in 0..24 {
        add(d, &a, &format!("a-{}", i % 6), &format!("a{i}"), &[]);
    }
    add(d, &a, "fanner", "fan", &[]);
    ok(&["batch", "close", "--data", d, &a]);
    let b = open_batch(d, "cb-b");
    for i in 0..3 {
        add(d, &b, &format!("b-{i}"), &format!("b{i}"), &[]);
    }
    add(d, &b, "b-dead", "die", &["--max-attempts", "1"]);
    ok(&["batch", "close", "--data", d, &b]);

    let mut w = trial_worker(d, log, false, HANDLER);
    std::thread::sleep(Duration::from_millis(rng.below(600)));
    support::disturb(d, name, &disturb);
    std::thread::sleep(Duration::from_millis(200 + rng.below(700)));
    signal(w.id(), "-KILL");
    let _ = w.wait();
    let mut w2 = trial_worker(d, log, true, HANDLER);
    let status = support::wait_exit(&mut w2, "the second worker", Duration::from_secs(90));
    assert!(
        status.success(),
        "the second worker failed: {status:?}: {}",
        std::fs::read_to_string(log.with_extension("err")).unwrap_or_default()
    );

    // The invariants, from the handlers' own log.
    let lines = read_log(log);
    // A callback's starts: one job, so each start is another attempt of
    // it (a run killed with the worker, or whose ack the kill lost, runs
    // again); two jobs would both start at attempt 1. The first start
    // only, and the attempts seen.
    let callbacks = |batch: &str, kind: &str| -> Vec<u128> {
        let starts: Vec<&Line> = lines
            .iter()
            .filter(|l| {
                l.start && l.batch.as_deref() == Some(batch) && l.callback.as_deref() == Some(kind)
            })
            .collect();
        let attempts: std::collections::BTreeSet<u32> = starts.iter().map(|l| l.attempt).collect();
        assert_eq!(
            attempts.len(),
            starts.len(),
            "{name}: {batch}'s {kind} callback enqueued more than once: {starts:?}"
        );
        starts.iter().map(|l| l.ns).min().into_iter().collect()
    };
    let last_end = |p: &str| {
        lines
            .iter()
            .filter(|l| !l.start && l.payload == p && l.callback.is_none())
            .map(|l| l.ns)
            .max()
            .unwrap_or_else(|| panic!("{name}: job {p} never ended"))
    };
    let mut a_jobs: Vec<String> = (0..24).map(|i| format!("a{i}")).collect();
    a_jobs.push("fan".into());
    a_jobs.extend((0..4).map(|i| format!("f{i}")));
    let a_end = a_jobs.iter().map(|p| last_end(p)).max().unwrap();
    for kind in ["complete", "success"] {
        let s = callbacks(&a, kind);
        assert_eq!(s.len(), 1, "{name}: {a}'s {kind} callback started {s:?}");
        assert!(
            s[0] > a_end,
            "{name}: {a}'s {kind} callback started before its last job ended"
        );
    }
    assert!(
        callbacks(&a, "death").is_empty(),
        "{name}: no job of {a} died"
    );
    let v = show(d, &a);
    assert_eq!(v["state"], "complete", "{v}");
    assert_eq!(
        v["counts"]["jobs"], 29,
        "{name}: the fan-out stored once: {v}"
    );
    assert_eq!(v["counts"]["completed"], 29, "{v}");
    for j in v["jobs"].as_array().unwrap() {
        let r = j["result"].as_str().unwrap_or("");
        assert!(r.starts_with("r-"), "{name}: a job's result is kept: {j}");
    }
    // Batch b: death once, then complete once all ended; never success.
    let b_end = (0..3).map(|i| last_end(&format!("b{i}"))).max().unwrap();
    let died = lines
        .iter()
        .filter(|l| l.start && l.payload == "die")
        .map(|l| l.ns)
        .max()
        .expect("the dying job ran");
    let death = callbacks(&b, "death");
    assert_eq!(death.len(), 1, "{name}: {b}'s death callback {death:?}");
    assert!(death[0] > died, "{name}: death before the job died");
    let complete = callbacks(&b, "complete");
    assert_eq!(complete.len(), 1, "{name}: {b}'s complete {complete:?}");
    assert!(complete[0] > b_end.max(died), "{name}: {b} complete early");
    assert!(
        callbacks(&b, "success").is_empty(),
        "{name}: a batch with a dead job succeeded"
    );
    let v = show(d, &b);
    assert_eq!(v["state"], "complete", "{v}");
    assert_eq!(
        (
            v["counts"]["dead"].clone(),
            v["counts"]["completed"].clone()
        ),
        (1.into(), 3.into()),
        "{v}"
    );
    // A complete batch takes no job; nothing waits.
    let (good, _, err) = run(&["enqueue", "--data", d, "--key", "late", "--batch", &a]);
    assert!(
        !good && err.contains(&a) && err.contains("complete"),
        "{err}"
    );
    let st = support::status_json(Path::new(d));
    assert_eq!(st["dependents"]["waiting"], 0, "{st}");
    assert_eq!(st["dependents"]["batches"], 0, "{st}");
    // Batch jobs are counted as batch jobs, not as dependents: 29 of a and
    // 4 of b, each released once.
    assert_eq!(st["dependents"]["released"], 0, "{st}");
    assert_eq!(st["dependents"]["batch_jobs_waiting"], 0, "{st}");
    assert_eq!(st["dependents"]["batch_jobs_released"], 33, "{st}");
    let _ = std::fs::remove_file(log);
}

#[test]
fn batches_fire_each_callback_once_through_moves_and_a_killed_worker_on_the_embedded_engine() {
    let dir = temp_dir("batch-embedded");
    // The two trials share nothing and mostly wait on leases: side by side.
    support::side_by_side(
        vec![Disturb::Grow(None), Disturb::Pin(PIN)],
        |i, disturb| {
            let data = dir.join(format!("q{i}"));
            init_shards(&data, 2);
            let name = format!("embedded-{i}");
            let seed = seed();
            eprintln!("{name}: seed {seed}");
            trial(
                &name,
                data.to_str().unwrap(),
                &dir.join(format!("log{i}")),
                seed,
                disturb,
            );
        },
    );
}

#[test]
fn batches_fire_each_callback_once_through_moves_and_a_killed_worker_on_redis() {
    let dir = temp_dir("batch-redis");
    let servers = [RedisServer::start(), RedisServer::start()];
    let urls = servers
        .iter()
        .map(|s| s.url())
        .collect::<Vec<_>>()
        .join(",");
    let data = dir.join("q");
    init_shards_with(&data, 2, &["--redis", &urls]);
    trial(
        "redis",
        data.to_str().unwrap(),
        &dir.join("log"),
        seed(),
        Disturb::Grow(Some(servers[1].url())),
    );
}

#[test]
fn batches_fire_each_callback_once_through_moves_and_a_killed_worker_on_a_redis_cluster() {
    let dir = temp_dir("batch-cluster");
    let cluster = RedisCluster::start(3);
    let data = dir.join("q");
    init_shards_with(&data, 2, &["--redis-cluster", &cluster.url()]);
    trial(
        "cluster",
        data.to_str().unwrap(),
        &dir.join("log"),
        seed(),
        Disturb::Pin(PIN),
    );
}

#[test]
fn bad_batches_are_refused_naming_them() {
    let dir = temp_dir("batch-bad");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    let (good, _, err) = run(&["batch", "open", "--data", d, "--key", "k"]);
    assert!(!good && err.contains("callbacks"), "{err}");
    for (batch, says) in [("7", "\"7\""), ("@x", "\"@x\""), ("@99", "@99")] {
        let (good, _, err) = run(&[
            "enqueue",
            "--data",
            d,
            "--key",
            "k",
            "--payload",
            "p",
            "--batch",
            batch,
        ]);
        assert!(!good, "--batch {batch} was taken");
        assert!(err.contains("batch") && err.contains(says), "{err}");
    }
    let a = open_batch(d, "cb");
    let (good, _, err) = run(&[
        "enqueue",
        "--data",
        d,
        "--key",
        "k",
        "--batch",
        &a,
        "--dedup-id",
        "batch:@1:complete",
    ]);
    assert!(!good && err.contains("dedup id"), "{err}");
    let (good, _, err) = run(&["batch", "show", "--data", d, "@12345"]);
    assert!(!good && err.contains("@12345"), "{err}");
    // A dependent is not a batch.
    let job = ok(&["enqueue", "--data", d, "--key", "x", "--payload", "p"]);
    let dep = ok(&["enqueue", "--data", d, "--key", "y", "--after", job.trim()]);
    let (good, _, err) = run(&["batch", "close", "--data", d, dep.trim()]);
    assert!(!good && err.contains("dependent"), "{err}");
    let (good, _, err) = run(&["job", "cancel", "--data", d, &a]);
    assert!(!good && err.contains("batch"), "{err}");
}

#[test]
fn stdin_lines_join_a_batch_chunk_by_chunk_and_a_bad_line_is_named() {
    let dir = temp_dir("batch-stdin");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    let a = open_batch(d, "cb");
    let lines: String = (0..5000).map(|i| format!("k{}\tp{i}\n", i % 50)).collect();
    let out = support::run_stdin(
        &["enqueue", "--data", d, "--stdin", "--batch", &a],
        lines.as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let ids: std::collections::BTreeSet<&str> = printed
        .lines()
        .map(|l| l.split('\t').nth(1).unwrap())
        .collect();
    assert_eq!(ids.len(), 5000, "one @M per line");
    assert!(ids.iter().all(|i| i.starts_with('@')), "{printed:.200}");
    assert_eq!(show(d, &a)["counts"]["jobs"], 5000);
    // A bad line: the lines before it joined, the error names it.
    let out = support::run_stdin(
        &["enqueue", "--data", d, "--stdin", "--batch", &a],
        b"k\tfine\nno tab here\nk\tlater\n",
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line") && err.contains("2"), "{err}");
    assert_eq!(show(d, &a)["counts"]["jobs"], 5001);
}

/// A callback the worker refuses for good (a complete callback's payload
/// over the worker's `--payload-bytes-max`, though `batch open` took it)
/// is recorded as refused, naming the limit, and is not tried again; the
/// success callback starts once and the batch completes. It waited
/// forever before.
#[test]
fn a_callback_the_worker_refuses_for_good_is_shown_refused_and_the_batch_completes() {
    let dir = temp_dir("batch-refused");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    let big = "x".repeat(2_000);
    let b = ok(&[
        "batch",
        "open",
        "--data",
        d,
        "--key",
        "cb",
        "--on-complete",
        &big,
        "--on-success",
        "success",
    ])
    .trim()
    .to_string();
    add(d, &b, "k1", "one", &[]);
    ok(&["batch", "close", "--data", d, &b]);
    let log = dir.join("log");
    let mut w = support::worker_with(d, &log, &["--payload-bytes-max", "1000"], HANDLER);
    support::wait_until("the batch to complete", Duration::from_secs(20), || {
        show(d, &b)["state"] == "complete"
    });
    support::wait_until(
        "the success callback to end",
        Duration::from_secs(20),
        || {
            read_log(&log)
                .iter()
                .any(|l| !l.start && l.callback.as_deref() == Some("success"))
        },
    );
    let _ = w.kill();
    let _ = w.wait();
    let v = show(d, &b);
    let refused = v["callbacks"]["complete"]["refused"].as_str().unwrap_or("");
    assert!(refused.contains("1000"), "names the limit: {v}");
    assert!(v["callbacks"]["complete"]["fired"].is_null(), "{v}");
    assert!(v["callbacks"]["success"]["fired"].is_string(), "{v}");
    let starts: Vec<Line> = read_log(&log).into_iter().filter(|l| l.start).collect();
    let callbacks: Vec<&str> = starts
        .iter()
        .filter_map(|l| l.callback.as_deref())
        .collect();
    assert_eq!(callbacks, vec!["success"], "{starts:?}");
    let text = ok(&["batch", "show", "--data", d, &b]);
    assert!(text.contains("refused for good"), "{text}");
}
