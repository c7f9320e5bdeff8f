//! Dependents through the real binary, tried as an attacker would: a
//! fan-in over children on many keys, a chain across shards, a dead child
//! under each policy, while keys move (`add-shard` + `rebalance`, `pin`)
//! and the worker is SIGKILLed and started again, on the embedded engine,
//! Redis instances and a Redis Cluster. The invariants are checked from the
//! handlers' own log: each dependent starts once, after every dependency's
//! last completion, with their results; a `fail` dependent of a dead job
//! never starts; nothing waits forever.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use shardq_testkit::redis::{RedisCluster, RedisServer};
use support::{
    init_shards, init_shards_with, ok, run, seed, signal, temp_dir, trial_worker, wait_until,
    Disturb, Lcg,
};

/// The keys a `Pin` trial moves.
const PIN: &[&str] = &["fan-in", "child-3", "link-2"];

/// The handler: logs `start`/`end` lines with a nanosecond clock, fails a
/// job whose payload is `die`, returns `r-PAYLOAD`.
const HANDLER: &str = r#"read p
echo "start $SHARDQ_SHARD:$SHARDQ_JOB_ID $SHARDQ_KEY ${SHARDQ_DEPENDENT:--} $p $(date +%s%N) $SHARDQ_ATTEMPT" >> "$LOG"
[ "$p" = die ] && exit 1
sleep 0.01
printf 'r-%s' "$p" > "$SHARDQ_RESULT_FILE"
echo "end $SHARDQ_SHARD:$SHARDQ_JOB_ID $SHARDQ_KEY ${SHARDQ_DEPENDENT:--} $p $(date +%s%N) $SHARDQ_ATTEMPT" >> "$LOG"
"#;

/// One line of the handlers' log.
#[derive(Debug, Clone)]
struct Line {
    start: bool,
    dependent: Option<String>,
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
                dependent: (f[3] != "-").then(|| f[3].to_string()),
                payload: f[4].to_string(),
                ns: f[5].parse().unwrap_or(0),
                attempt: f[6].parse().unwrap_or(0),
            })
        })
        .collect()
}

fn show(d: &str, id: &str) -> serde_json::Value {
    serde_json::from_str(&ok(&["job", "show", "--data", d, id, "--json"])).unwrap()
}

fn enqueue_after(d: &str, key: &str, payload: &str, after: &[String], policy: &str) -> String {
    ok(&[
        "enqueue",
        "--data",
        d,
        "--key",
        key,
        "--payload",
        payload,
        "--after",
        &after.join(","),
        "--on-dependency-failure",
        policy,
    ])
    .trim()
    .to_string()
}

/// One trial: the workflow, a disturbance at a random moment, the worker
/// SIGKILLed at another and a second worker to the end; then the
/// invariants.
/// Long on purpose: one trial, its workflow, its disturbance and kill at
/// seeded moments and the invariants read from the handlers' log, in the
/// order they happen.
fn trial(name: &str, d: &str, log: &Path, seed: u64, disturb: Disturb) {
    let mut rng = Lcg(seed);
    // 40 children over 8 keys.
    let mut lines = String::new();
    for i in 0..40 {
        lines.push_str(&format!("child-{}\tc{i}\n", i % 8));
    }
    let out = support::run_stdin(&["enqueue", "--data", d, "--stdin"], lines.as_bytes());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let children: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.rsplit('\t').next().unwrap().to_string())
        .collect();
    assert_eq!(children.len(), 40);
    let bad = ok(&[
        "enqueue",
        "--data",
        d,
        "--key",
        "bad",
        "--payload",
        "die",
        "--max-attempts",
        "1",
    ])
    .trim()
    .to_string();
    let fan_in = enqueue_after(d, "fan-in", "fan", &children, "fail");
    // A chain of 6 links on 6 keys, the first after child 0.
    let mut chain = vec![enqueue_after(d, "link-0", "l0", &children[..1], "fail")];
    for i in 1..6 {
        let prev = chain[i - 1].clone();
        chain.push(enqueue_after(
            d,
            &format!("link-{i}"),
            &format!("l{i}"),
            &[prev],
            "fail",
        ));
    }
    let failing = enqueue_after(d, "g", "gfail", &[bad.clone(), children[1].clone()], "fail");
    let running = enqueue_after(d, "h", "hrun", std::slice::from_ref(&bad), "run");
    let ignoring = enqueue_after(
        d,
        "i",
        "iign",
        &[bad.clone(), children[2].clone()],
        "ignore",
    );
    // A dependent after a failed one fails too.
    let after_failed = enqueue_after(d, "j", "jnext", std::slice::from_ref(&failing), "fail");

    let mut w = trial_worker(d, log, false, HANDLER);
    // The disturbance after 0-600 ms, the SIGKILL 200-900 ms after it.
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
    let log_lines = read_log(log);
    let last_end = |payload: &str| {
        log_lines
            .iter()
            .filter(|l| !l.start && l.payload == payload)
            .map(|l| l.ns)
            .max()
    };
    // A dependent's starts: one job, so each start is another attempt of
    // it (a run killed with the worker, or whose ack the kill lost, runs
    // again); a second release would start at attempt 1 again. The first
    // start only.
    let starts = |dep: &str| -> Vec<u128> {
        let all: Vec<&Line> = log_lines
            .iter()
            .filter(|l| l.start && l.dependent.as_deref() == Some(dep))
            .collect();
        let attempts: BTreeSet<u32> = all.iter().map(|l| l.attempt).collect();
        assert_eq!(
            attempts.len(),
            all.len(),
            "{name}: {dep} released more than once: {all:?}"
        );
        all.iter().map(|l| l.ns).min().into_iter().collect()
    };
    let children_end = (0..40)
        .map(|i| last_end(&format!("c{i}")).unwrap_or_else(|| panic!("child c{i} never ended")))
        .max()
        .unwrap();
    let fan = starts(&fan_in);
    assert_eq!(
        fan.len(),
        1,
        "{name}: the fan-in started {} times",
        fan.len()
    );
    assert!(
        fan[0] > children_end,
        "{name}: the fan-in started before its last child ended"
    );
    let v = show(d, &fan_in);
    assert_eq!(v["state"], "released", "{v}");
    let after = v["after"].as_array().unwrap();
    assert_eq!(after.len(), 40);
    for (i, a) in after.iter().enumerate() {
        assert_eq!(a["outcome"], "completed", "{name}: child {i}: {a}");
        assert_eq!(a["result"], format!("r-c{i}"), "{name}: child {i}: {a}");
    }
    let mut prev_end = last_end("c0").unwrap();
    for (i, link) in chain.iter().enumerate() {
        let s = starts(link);
        assert_eq!(
            s.len(),
            1,
            "{name}: link {i} ({link}) started {} times",
            s.len()
        );
        assert!(
            s[0] > prev_end,
            "{name}: link {i} started before the one before it ended"
        );
        prev_end = last_end(&format!("l{i}")).expect("the link ended");
    }
    let v = show(d, &failing);
    assert_eq!(v["state"], "failed", "{v}");
    let why = v["reason"].as_str().unwrap();
    assert!(why.contains(&bad) && why.contains("dead"), "{why}");
    assert!(
        starts(&failing).is_empty(),
        "{name}: a failed dependent ran"
    );
    let v = show(d, &after_failed);
    assert_eq!(v["state"], "failed", "{v}");
    assert!(v["reason"].as_str().unwrap().contains(&failing), "{v}");
    assert_eq!(
        starts(&running).len(),
        1,
        "{name}: the run-anyway dependent"
    );
    let v = show(d, &running);
    assert_eq!(v["after"][0]["outcome"], "dead", "{v}");
    assert_eq!(starts(&ignoring).len(), 1, "{name}: the ignoring dependent");
    // Nothing waits.
    let out = ok(&["jobs", "--data", d, "--key", "fan-in", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["waiting"].as_array().map(Vec::len), Some(0), "{v}");
    // status counts them: 9 released (the fan-in, 6 links, run, ignore)
    // and 2 failed in this trial, none waiting.
    let st = support::status_json(Path::new(d));
    let t = &st["dependents"];
    assert_eq!(t["waiting"], 0, "{t}");
    assert!(
        t["released"].as_u64() >= Some(9) && t["failed"].as_u64() >= Some(2),
        "{t}"
    );
    let _ = std::fs::remove_file(log);
}

#[test]
fn fan_in_and_chain_survive_moves_and_a_killed_worker_on_the_embedded_engine() {
    let dir = temp_dir("wf-embedded");
    // The two trials share nothing and mostly wait on leases: side by side.
    support::side_by_side(
        vec![Disturb::Grow(None), Disturb::Pin(PIN)],
        |i, disturb| {
            let data = dir.join(format!("q{i}"));
            init_shards(&data, 2);
            let log = dir.join(format!("log{i}"));
            let name = format!("embedded-{i}");
            let seed = seed();
            eprintln!("{name}: seed {seed}");
            trial(&name, data.to_str().unwrap(), &log, seed, disturb);
        },
    );
}

#[test]
fn fan_in_and_chain_survive_moves_and_a_killed_worker_on_redis() {
    let dir = temp_dir("wf-redis");
    let servers = [RedisServer::start(), RedisServer::start()];
    let urls = servers
        .iter()
        .map(|s| s.url())
        .collect::<Vec<_>>()
        .join(",");
    let data = dir.join("q");
    init_shards_with(&data, 2, &["--redis", &urls]);
    let grow = Disturb::Grow(Some(servers[1].url()));
    trial(
        "redis",
        data.to_str().unwrap(),
        &dir.join("log"),
        seed(),
        grow,
    );
}

#[test]
fn fan_in_and_chain_survive_moves_and_a_killed_worker_on_a_redis_cluster() {
    let dir = temp_dir("wf-cluster");
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
fn bad_dependencies_are_refused_naming_them() {
    let dir = temp_dir("wf-bad");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    let id = ok(&["enqueue", "--data", d, "--key", "k", "--payload", "p"]);
    let id = id.trim();
    for (after, says) in [
        ("shard-0:999999", "shard-0:999999"),
        ("@77", "@77"),
        ("nonsense", "\"nonsense\""),
        (&format!("{id},{id}") as &str, id),
    ] {
        let (good, _, err) = run(&["enqueue", "--data", d, "--key", "x", "--after", after]);
        assert!(!good, "--after {after} was taken");
        assert!(
            err.contains("after") && err.contains(says),
            "--after {after}: {err}"
        );
        assert!(
            err.contains("NOT enqueued") || err.contains("after"),
            "{err}"
        );
    }
    let (good, _, err) = run(&[
        "enqueue",
        "--data",
        d,
        "--key",
        "x",
        "--after",
        id,
        "--on-dependency-failure",
        "retry",
    ]);
    assert!(
        !good && err.contains("\"retry\"") && err.contains("fail, ignore or run"),
        "{err}"
    );
    let big = "x".repeat(70_000);
    let (good, _, err) = run(&[
        "enqueue",
        "--data",
        d,
        "--key",
        "x",
        "--payload",
        &big,
        "--after",
        id,
    ]);
    assert!(!good && err.contains("65536"), "{err}");
    // A waiting dependent is cancelled; its own dependent then fails.
    let a = enqueue_after(d, "a", "pa", &[id.to_string()], "fail");
    let b = enqueue_after(d, "b", "pb", std::slice::from_ref(&a), "fail");
    let out = ok(&["job", "cancel", "--data", d, &a]);
    assert!(out.contains("cancelled"), "{out}");
    let mut w = trial_worker(d, &dir.join("log"), true, HANDLER);
    let status = support::wait_exit(&mut w, "the worker", Duration::from_secs(60));
    assert!(status.success());
    wait_until(
        "the dependent of a cancelled one to fail",
        Duration::from_secs(10),
        || show(d, &b)["state"] == "failed",
    );
    let v = show(d, &b);
    assert!(v["reason"].as_str().unwrap().contains(&a), "{v}");
    let seen: BTreeSet<String> = read_log(&dir.join("log"))
        .into_iter()
        .map(|l| l.payload)
        .collect();
    assert!(!seen.contains("pa") && !seen.contains("pb"), "{seen:?}");
}

/// A dependent whose release the worker refuses for good (its payload is
/// over the worker's `--payload-bytes-max`, though not over what `enqueue`
/// took) ends as failed with a reason naming the payload, and its own
/// dependent fails by it, while a dependent released beside it runs:
/// nothing waits forever and one bad release holds up no other.
#[test]
fn a_release_the_worker_refuses_for_good_fails_that_dependent_only() {
    let dir = temp_dir("wf-refused");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    let id = ok(&["enqueue", "--data", d, "--key", "k", "--payload", "p"]);
    let id = id.trim().to_string();
    let big = "x".repeat(2_000);
    let bad = enqueue_after(d, "a", &big, std::slice::from_ref(&id), "fail");
    let next = enqueue_after(d, "b", "pb", std::slice::from_ref(&bad), "fail");
    let good = enqueue_after(d, "c", "pc", std::slice::from_ref(&id), "fail");
    let log = dir.join("log");
    let mut w = support::worker_with(d, &log, &["--payload-bytes-max", "1000"], HANDLER);
    wait_until(
        "the refused dependent and its own dependent to fail",
        Duration::from_secs(20),
        || show(d, &bad)["state"] == "failed" && show(d, &next)["state"] == "failed",
    );
    wait_until("the good dependent to run", Duration::from_secs(20), || {
        read_log(&log).iter().any(|l| !l.start && l.payload == "pc")
    });
    let _ = w.kill();
    let _ = w.wait();
    let v = show(d, &bad);
    let reason = v["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("refused") && reason.contains("1000"),
        "the reason names the refusal and the limit: {v}"
    );
    assert!(show(d, &good)["state"] != "failed", "{}", show(d, &good));
    let st = support::status_json(&data);
    assert_eq!(st["dependents"]["waiting"], 0, "{st}");
}
