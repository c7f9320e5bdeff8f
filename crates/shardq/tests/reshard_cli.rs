//! Live resharding of the embedded engine with real processes: producer
//! processes (`shardq enqueue --stdin`) and a worker process (`shardq work`)
//! keep running while a shard is added, removed or reweighted, while the
//! rebalance coordinator is killed with SIGKILL and rerun, and while a second
//! rebalance tries to start.
//!
//! Every load test checks three things. The maps: how many of 10,000 tenants
//! change owner and where they go. The producers' placements (their
//! `KEY<TAB>SHARD:ID` lines): a key changes shard at most once, from its
//! old owner to its new one, so a producer on a stale map never put a job on
//! a shard the key had left. The runs (the worker's `KEY ID ATTEMPT SHARD`
//! lines, mapped back to each key's sequence number): every key ran
//! 0, 1, 2, ... in order with no gap, no repeat (no worker is killed here) and
//! nothing lost.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use shardq_core::producer::ProducerOptions;
use shardq_core::{InspectJobs, MoveKeys, NewJob};
use shardq_fs::layout::SHARD_MAP_FILE;
use shardq_fs::map_store::TARGET_FILE;
use shardq_fs::{Engine, EngineOptions};
use shardq_route::{Algorithm, Router, ShardMap, ShardState};

mod support;
use support::{ok as run_ok, output as run, BIN};

/// Bound on every wait in these tests.
const WAIT_MAX: Duration = Duration::from_secs(60);
/// Tenants `t-0..` over which the moved fraction is computed from the maps.
const TENANTS: usize = 10_000;
/// Allowed distance of the moved fraction from its expected value.
const FRACTION_TOLERANCE: f64 = 0.01;

// ---------------------------------------------------------------------------
// Processes and files.
// ---------------------------------------------------------------------------

/// A scratch directory holding a data dir and the worker's run log; removed
/// when the test passes, kept for a look when it fails.
struct Scratch {
    dir: PathBuf,
    data: PathBuf,
    runs: PathBuf,
}

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("shardq-reshard-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch {
            data: dir.join("data"),
            runs: dir.join("runs.txt"),
            dir,
        }
    }

    fn d(&self) -> &str {
        self.data.to_str().unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Kills the process on drop unless it already exited, so a failed test
/// leaves no worker or producer behind.
struct Proc {
    child: Child,
    what: String,
}

impl Proc {
    fn spawn(cmd: &mut Command, what: &str) -> Proc {
        Proc {
            child: cmd
                .spawn()
                .unwrap_or_else(|e| panic!("starting {what}: {e}")),
            what: what.to_string(),
        }
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    fn wait_bounded(&mut self) -> ExitStatus {
        support::wait_exit(&mut self.child, &self.what, WAIT_MAX)
    }

    fn signal(&self, sig: &str) {
        support::signal(self.child.id(), sig);
    }

    fn read_stderr(&mut self) -> String {
        let mut s = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut s);
        }
        s
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn wait_until(what: &str, cond: impl FnMut() -> bool) {
    support::wait_until(what, WAIT_MAX, cond)
}

fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout:?}"))
}

fn init(s: &Scratch, shards: usize) {
    run_ok(&["init", "--data", s.d(), "--shards", &shards.to_string()]);
}

fn load_map(data: &Path) -> ShardMap {
    let text = std::fs::read_to_string(data.join(SHARD_MAP_FILE)).unwrap();
    ShardMap::from_yaml(&text).unwrap()
}

fn router(map: &ShardMap) -> Router {
    let mut m = map.clone();
    m.version = m.version.max(1);
    Router::new(m).unwrap()
}

fn count_lines(path: &Path) -> usize {
    std::fs::read(path)
        .map(|b| b.iter().filter(|&&c| c == b'\n').count())
        .unwrap_or(0)
}

/// How the worker runs a job. Both write `KEY ID ATTEMPT SHARD PAYLOAD` lines.
enum Handler {
    /// `--handler-builtin append:FILE`: fast, in process.
    Builtin,
    /// A shell script per job that first waits while `GATES/KEY` exists, so a
    /// test can hold a key's jobs (and so its drain) for as long as it likes.
    Gated { gates: PathBuf },
}

struct Worker {
    proc: Proc,
}

fn start_worker(s: &Scratch, handler: &Handler, concurrency: usize) -> Worker {
    let mut args: Vec<String> = [
        "work",
        "--data",
        s.d(),
        "--max-local-shards",
        "all",
        "--concurrency",
        &concurrency.to_string(),
        "--lease-ms",
        "600",
        "--durability",
        "none",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    match handler {
        Handler::Builtin => {
            args.push("--handler-builtin".into());
            args.push(format!("append:{}", s.runs.display()));
        }
        Handler::Gated { gates } => {
            let script = s.dir.join("gated-handler.sh");
            std::fs::write(
                &script,
                "gate=\"$1/$SHARDQ_KEY\"\n\
                 if [ -e \"$gate\" ]; then\n\
                   : > \"$gate.blocked\"\n\
                   while [ -e \"$gate\" ]; do sleep 0.02; done\n\
                 fi\n\
                 p=$(cat)\n\
                 echo \"$SHARDQ_KEY $SHARDQ_JOB_ID $SHARDQ_ATTEMPT $SHARDQ_SHARD $p\" >> \"$2\"\n",
            )
            .unwrap();
            args.extend([
                "--".to_string(),
                "sh".into(),
                script.display().to_string(),
                gates.display().to_string(),
                s.runs.display().to_string(),
            ]);
        }
    }
    let proc = Proc::spawn(
        Command::new(BIN)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
        "worker",
    );
    Worker { proc }
}

impl Worker {
    /// SIGTERM (drain, release), bounded wait; returns its stderr.
    fn stop(mut self) -> String {
        self.proc.signal("-TERM");
        let status = self.proc.wait_bounded();
        let err = self.proc.read_stderr();
        assert!(status.success(), "worker failed: {err}");
        err
    }
}

/// A `shardq enqueue --stdin` process fed numbered jobs for its own keys:
/// `burst` jobs of one key back to back (so keys carry backlogs), key after
/// key, at `lines_per_s`, until stopped. Payload = the key's sequence number.
struct Producer {
    proc: Proc,
    stop: Arc<AtomicBool>,
    /// Full passes over the keys written so far.
    cycles: Arc<AtomicU64>,
    feeder: Option<JoinHandle<()>>,
    reader: Option<JoinHandle<Vec<Ack>>>,
}

/// A job a producer reported as stored.
#[derive(Debug, Clone)]
struct Ack {
    key: String,
    shard: String,
    id: u64,
}

fn start_producer(s: &Scratch, keys: Vec<String>, burst: u64, lines_per_s: u64) -> Producer {
    let mut proc = Proc::spawn(
        Command::new(BIN)
            .args([
                "enqueue",
                "--data",
                s.d(),
                "--stdin",
                "--durability",
                "none",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
        "producer",
    );
    let mut stdin = proc.child.stdin.take().unwrap();
    let stdout: ChildStdout = proc.child.stdout.take().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let cycles = Arc::new(AtomicU64::new(0));
    let feeder = {
        let stop = Arc::clone(&stop);
        let cycles = Arc::clone(&cycles);
        thread::spawn(move || {
            let mut next = vec![0u64; keys.len()];
            let started = Instant::now();
            let mut sent = 0u64;
            'feed: loop {
                for (i, key) in keys.iter().enumerate() {
                    if stop.load(Ordering::SeqCst) {
                        break 'feed;
                    }
                    let mut lines = String::new();
                    for _ in 0..burst {
                        lines.push_str(&format!("{key}\t{}\n", next[i]));
                        next[i] += 1;
                    }
                    if stdin.write_all(lines.as_bytes()).is_err() {
                        break 'feed;
                    }
                    sent += burst;
                    // Pacing, not synchronisation: hold the offered rate.
                    let due = Duration::from_secs_f64(sent as f64 / lines_per_s as f64);
                    if let Some(wait) = due.checked_sub(started.elapsed()) {
                        thread::sleep(wait);
                    }
                }
                cycles.fetch_add(1, Ordering::SeqCst);
            }
            // Dropping stdin closes it: the producer stores the rest and exits.
        })
    };
    let reader = thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .map(|l| {
                let (key, id) = l.split_once('\t').expect("KEY<TAB>SHARD:ID");
                let (shard, id) = id.rsplit_once(':').expect("SHARD:ID");
                Ack {
                    key: key.to_string(),
                    shard: shard.to_string(),
                    id: id.parse().unwrap(),
                }
            })
            .collect()
    });
    Producer {
        proc,
        stop,
        cycles,
        feeder: Some(feeder),
        reader: Some(reader),
    }
}

impl Producer {
    fn cycles(&self) -> u64 {
        self.cycles.load(Ordering::SeqCst)
    }

    /// Stops feeding, waits (bounded) for the process to store the rest and
    /// exit with success, and returns every job it reported.
    fn finish(mut self) -> Vec<Ack> {
        self.stop.store(true, Ordering::SeqCst);
        self.feeder.take().unwrap().join().unwrap();
        let status = self.proc.wait_bounded();
        let err = self.proc.read_stderr();
        assert!(status.success(), "producer failed: {err}");
        self.reader.take().unwrap().join().unwrap()
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Waits until every producer has written `cycles` full passes over its keys.
fn wait_cycles(producers: &[Producer], cycles: &[u64]) {
    wait_until("producers to write their keys again", || {
        producers.iter().zip(cycles).all(|(p, &c)| p.cycles() >= c)
    });
}

/// The end of a load test: every producer writes its keys twice more (so
/// each key has jobs after the change), stops, and reports what it stored;
/// the worker runs all of them and is stopped. The jobs acknowledged, and
/// the worker's stderr.
fn wind_down(s: &Scratch, producers: Vec<Producer>, worker: Worker) -> (Vec<Ack>, String) {
    let now: Vec<u64> = producers.iter().map(|p| p.cycles() + 2).collect();
    wait_cycles(&producers, &now);
    let acks: Vec<Ack> = producers.into_iter().flat_map(Producer::finish).collect();
    wait_all_ran(s, acks.len());
    (acks, worker.stop())
}

/// A run of the worker: (key, shard, id, payload). The payload is the
/// key's sequence number as its producer sent it (a job moved with its key
/// has a new id on its new shard, and the same payload).
fn parse_runs(path: &Path) -> Vec<(String, String, u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.splitn(5, ' ').collect();
            assert_eq!(f.len(), 5, "bad handler line {l:?}");
            (
                f[0].to_string(),
                f[3].to_string(),
                f[1].parse().unwrap(),
                f[4].parse().unwrap_or(u64::MAX),
            )
        })
        .collect()
}

/// Waits (bounded) until the run log has at least as many lines as jobs acked.
fn wait_all_ran(s: &Scratch, acked: usize) {
    wait_until(&format!("{acked} jobs to run"), || {
        count_lines(&s.runs) >= acked
    });
}

// ---------------------------------------------------------------------------
// Checks.
// ---------------------------------------------------------------------------

/// Tenants t-0..t-9999 whose owner differs between `before` and `after`:
/// (tenant, from, to).
fn moved_tenants(before: &ShardMap, after: &ShardMap) -> Vec<(String, String, String)> {
    let (b, a) = (router(before), router(after));
    (0..TENANTS)
        .map(|i| format!("t-{i}"))
        .filter_map(|t| {
            let (from, to) = (b.route(&t).to_string(), a.route(&t).to_string());
            (from != to).then_some((t, from, to))
        })
        .collect()
}

/// The moved fraction is `expected` within the tolerance and every move
/// satisfies `allowed(from, to)`.
fn check_moved_fraction(
    before: &ShardMap,
    after: &ShardMap,
    expected: f64,
    allowed: &dyn Fn(&str, &str) -> bool,
) {
    let moved = moved_tenants(before, after);
    let fraction = moved.len() as f64 / TENANTS as f64;
    assert!(
        (fraction - expected).abs() <= FRACTION_TOLERANCE,
        "{fraction:.4} of tenants moved; expected {expected} ± {FRACTION_TOLERANCE}"
    );
    if let Some(bad) = moved.iter().find(|(_, f, t)| !allowed(f, t)) {
        panic!(
            "tenant {} moved {} -> {}, which this change must not do",
            bad.0, bad.1, bad.2
        );
    }
}

/// Each key's placements, in the order its producer stored them, change
/// shard at most once: from the key's owner under `before` to its owner under
/// `after`. A key that moves had jobs on both sides of the change, so it must
/// show the switch; a key that does not move never leaves its shard. Returns
/// the keys that switched.
fn check_placements(acks: &[Ack], before: &ShardMap, after: &ShardMap) -> BTreeSet<String> {
    let (b, a) = (router(before), router(after));
    let mut by_key: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for ack in acks {
        let v = by_key.entry(&ack.key).or_default();
        if v.last() != Some(&ack.shard.as_str()) {
            v.push(&ack.shard);
        }
    }
    let mut switched = BTreeSet::new();
    for (key, shards) in by_key {
        let (from, to) = (b.route(key), a.route(key));
        assert_eq!(
            shards[0], from,
            "key {key}: first job stored on {}, but the map before routed it to {from}",
            shards[0]
        );
        if from == to {
            assert_eq!(
                shards,
                [from],
                "key {key} does not move but was stored on {shards:?}"
            );
        } else {
            assert_eq!(
                shards,
                [from, to],
                "key {key} moves {from} -> {to}: every job before the switch on {from}, \
                 every job after on {to}, nothing back on {from}"
            );
            switched.insert(key.to_string());
        }
    }
    switched
}

/// Maps every run back to its key's sequence number and checks that each key
/// ran 0, 1, 2, ... with no gap, no repeat, nothing missing and nothing
/// unknown. A run names its job by its payload, the number its producer
/// sent: the n-th job a producer reported for a key is the n-th it sent
/// (an `enqueue --stdin` stores its lines in order and stops at the first
/// it cannot store), and a job moved with its key keeps its payload.
fn check_runs(acks: &[Ack], runs: &[(String, String, u64, u64)]) {
    let mut acked: HashMap<&str, u64> = HashMap::new();
    let mut reported: HashSet<(&str, u64)> = HashSet::new();
    for ack in acks {
        *acked.entry(&ack.key).or_default() += 1;
        let dup = !reported.insert((&ack.shard, ack.id));
        assert!(!dup, "two jobs reported as {} {}", ack.shard, ack.id);
    }
    let mut next: HashMap<&str, u64> = HashMap::new();
    let mut problems: Vec<String> = Vec::new();
    for (key, shard, id, seq) in runs {
        let k = key.as_str();
        if *seq >= acked.get(k).copied().unwrap_or(0) {
            problems.push(format!(
                "job {shard} {id} of {key} (#{seq}) ran but no producer reported it"
            ));
            continue;
        }
        let seq = *seq;
        let n = next.entry(k).or_default();
        match seq.cmp(n) {
            std::cmp::Ordering::Equal => *n += 1,
            std::cmp::Ordering::Less => problems.push(format!(
                "key {k}: job {seq} ran again (no worker was killed)"
            )),
            std::cmp::Ordering::Greater => problems.push(format!(
                "key {k}: job {seq} ran when job {n} was next (order violation or gap)"
            )),
        }
    }
    for (key, &n) in &acked {
        let ran = next.get(key).copied().unwrap_or(0);
        if ran != n {
            problems.push(format!(
                "key {key}: {} of {n} reported jobs never ran",
                n - ran
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems over {} runs, e.g. {:?}",
        problems.len(),
        runs.len(),
        &problems[..problems.len().min(8)]
    );
}

/// The published map is the target: no overrides, every shard active, no
/// pending target, and nothing left queued or running.
fn check_finished(s: &Scratch, shards: &[&str]) -> ShardMap {
    let map = load_map(&s.data);
    assert!(
        map.overrides.is_empty(),
        "overrides left: {:?}",
        map.overrides
    );
    let names: Vec<&str> = map.shards.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, shards);
    assert!(map.shards.iter().all(|s| s.state == ShardState::Active));
    assert!(
        !s.data.join(TARGET_FILE).exists(),
        "a rebalance target is still pending"
    );
    let st = json(&run_ok(&["status", "--data", s.d(), "--json"]));
    assert_eq!(st["totals"]["ready"], 0, "{st}");
    assert_eq!(st["totals"]["in_flight"], 0, "{st}");
    map
}

/// Every `from -> to` pair in a rebalance report satisfies `allowed`; returns
/// the keys it drained and switched.
fn check_report(report: &serde_json::Value, allowed: &dyn Fn(&str, &str) -> bool) -> u64 {
    let moves = report["moves"].as_object().expect("moves");
    for (from, tos) in moves {
        for to in tos.as_object().unwrap().keys() {
            assert!(
                allowed(from, to),
                "the rebalance moved keys {from} -> {to}: {report}"
            );
        }
    }
    report["keys_moved"].as_u64().unwrap()
}

// ---------------------------------------------------------------------------
// Load.
// ---------------------------------------------------------------------------

/// Two producers with their own keys, each `keys` keys in bursts of `burst`.
fn start_producers(s: &Scratch, keys: usize, burst: u64, lines_per_s: u64) -> Vec<Producer> {
    (0..2)
        .map(|p| {
            let mine = (0..keys).map(|i| format!("t-{}", 2 * i + p)).collect();
            start_producer(s, mine, burst, lines_per_s)
        })
        .collect()
}

/// The map a change should reach: `shards` active shards (rendezvous), with
/// the given weights.
fn expected_map(shards: usize, weights: &[(&str, u32)]) -> ShardMap {
    let mut map = ShardMap::with_shards(
        Algorithm::Rendezvous,
        (0..shards).map(|i| format!("shard-{i}")),
    )
    .unwrap();
    for (name, w) in weights {
        map.shards
            .iter_mut()
            .find(|s| s.name == *name)
            .unwrap()
            .weight = *w;
    }
    map
}

/// Producer keys (`t-0..t-{keys}`) whose owner differs between the maps, in
/// the order a rebalance moves them (by key).
fn moving_keys(keys: usize, before: &ShardMap, target: &ShardMap) -> Vec<String> {
    let (b, t) = (router(before), router(target));
    let set: BTreeSet<String> = (0..keys)
        .map(|i| format!("t-{i}"))
        .filter(|k| b.route(k) != t.route(k))
        .collect();
    set.into_iter().collect()
}

/// Holds `keys` at the gate and waits until each has a job waiting there
/// (so each has work on its old shard that the rebalance must drain).
fn hold(gates: &Path, keys: &[&String]) {
    for k in keys {
        std::fs::write(gates.join(k), "").unwrap();
    }
    wait_until("the held keys to have a job waiting at the gate", || {
        keys.iter()
            .all(|k| gates.join(format!("{k}.blocked")).exists())
    });
}

fn release(gates: &Path, key: &str) {
    std::fs::remove_file(gates.join(key)).unwrap();
}

/// Producer keys per producer in the load tests (`t-0..t-119` in all).
const KEYS_PER_PRODUCER: usize = 60;

struct Outcome {
    before: ShardMap,
    report: serde_json::Value,
    acks: Vec<Ack>,
    worker_err: String,
}

/// Under load (two producer processes, one worker process), runs the
/// `prepare` commands, then `command` (which rebalances toward `target` and
/// prints a JSON report). The first and the last moving key are held at the
/// gate beforehand, so there is a backlog to drain whatever the timing; they
/// are released once the rebalance has pinned them to their old shards. The
/// load stays on for two more full passes over the keys afterwards, then
/// everything drains.
fn reshard_under_load(
    s: &Scratch,
    target: &ShardMap,
    prepare: &[&[&str]],
    command: &[&str],
) -> Outcome {
    let gates = s.dir.join("gates");
    std::fs::create_dir_all(&gates).unwrap();
    let worker = start_worker(
        s,
        &Handler::Gated {
            gates: gates.clone(),
        },
        4,
    );
    let producers = start_producers(s, KEYS_PER_PRODUCER, 3, 200);
    // Every key has jobs stored (and many have run) under the old map.
    wait_cycles(&producers, &[1, 1]);
    wait_until("the worker to run jobs", || count_lines(&s.runs) >= 100);
    let before = load_map(&s.data);
    let moving = moving_keys(2 * KEYS_PER_PRODUCER, &before, target);
    assert!(moving.len() >= 2, "too few producer keys move: {moving:?}");
    let held = [&moving[0], &moving[moving.len() - 1]];
    hold(&gates, &held);

    for args in prepare {
        run_ok(args);
    }
    let v0 = load_map(&s.data).version;
    let mut rebalance = Proc::spawn(
        Command::new(BIN)
            .args(command)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
        "rebalance",
    );
    wait_until("the intermediate map", || load_map(&s.data).version > v0);
    let pinned = load_map(&s.data);
    let b = router(&before);
    for k in held {
        assert_eq!(
            pinned.overrides.get(k).map(String::as_str),
            Some(b.route(k)),
            "{k} has work, so it stays pinned to its old shard until drained"
        );
    }
    // Every key, the held ones too, is offered new jobs while they are
    // held: the rebalance must still be waiting for the first held key to
    // drain (a switch before that would let its new jobs overtake its old ones).
    let more: Vec<u64> = producers.iter().map(|p| p.cycles() + 1).collect();
    wait_cycles(&producers, &more);
    assert!(
        rebalance.running(),
        "the rebalance finished while a pinned key still had work on its old shard"
    );
    for k in held {
        release(&gates, k);
    }
    let status = rebalance.wait_bounded();
    let mut stdout = String::new();
    rebalance
        .child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    assert!(status.success(), "{command:?}: {}", rebalance.read_stderr());
    let report = json(&stdout);

    let (acks, worker_err) = wind_down(s, producers, worker);
    Outcome {
        before,
        report,
        acks,
        worker_err,
    }
}

/// The final map routes every tenant as `target` does.
fn check_routes_as(after: &ShardMap, target: &ShardMap) {
    let differ = moved_tenants(target, after);
    assert!(
        differ.is_empty(),
        "routes differ from the target: {:?}",
        &differ[..differ.len().min(5)]
    );
}

// ---------------------------------------------------------------------------
// Tests.
// ---------------------------------------------------------------------------

#[test]
fn adding_a_shard_under_load_moves_a_fifth_of_tenants_to_it_in_order() {
    let s = Scratch::new("add");
    init(&s, 4);
    let target = expected_map(5, &[]);
    let out = reshard_under_load(
        &s,
        &target,
        &[&["add-shard", "--data", s.d(), "shard-4"]],
        &["rebalance", "--data", s.d(), "--batch", "8", "--json"],
    );
    let to_new = |_: &str, to: &str| to == "shard-4";
    let after = check_finished(&s, &["shard-0", "shard-1", "shard-2", "shard-3", "shard-4"]);
    check_routes_as(&after, &target);
    check_moved_fraction(&out.before, &after, 0.2, &to_new);
    assert!(check_report(&out.report, &to_new) >= 2, "{}", out.report);
    let switched = check_placements(&out.acks, &out.before, &after);
    assert!(switched.len() >= 2, "{switched:?}");
    // The running worker picked up the shard added after it started.
    assert!(
        out.worker_err.contains("claimed shard-4"),
        "{}",
        out.worker_err
    );
    let runs = parse_runs(&s.runs);
    assert!(runs.iter().any(|(_, shard, _, _)| shard == "shard-4"));
    check_runs(&out.acks, &runs);
}

#[test]
fn removing_a_shard_under_load_moves_only_its_keys_in_order() {
    let s = Scratch::new("remove");
    init(&s, 4);
    let target = expected_map(3, &[]);
    let out = reshard_under_load(
        &s,
        &target,
        &[],
        &[
            "remove-shard",
            "--data",
            s.d(),
            "shard-3",
            "--batch",
            "8",
            "--json",
        ],
    );
    let from_removed = |from: &str, to: &str| from == "shard-3" && to != "shard-3";
    let after = check_finished(&s, &["shard-0", "shard-1", "shard-2"]);
    check_routes_as(&after, &target);
    check_moved_fraction(&out.before, &after, 0.25, &from_removed);
    // Its keys spread over every remaining shard.
    let dests: BTreeSet<String> = moved_tenants(&out.before, &after)
        .into_iter()
        .map(|(_, _, to)| to)
        .collect();
    assert_eq!(dests.len(), 3, "{dests:?}");
    assert!(
        check_report(&out.report, &from_removed) >= 2,
        "{}",
        out.report
    );
    check_placements(&out.acks, &out.before, &after);
    check_runs(&out.acks, &parse_runs(&s.runs));
}

#[test]
fn reweighting_a_shard_under_load_moves_keys_only_to_it_in_order() {
    let s = Scratch::new("weight");
    init(&s, 4);
    let target = expected_map(4, &[("shard-0", 2)]);
    let out = reshard_under_load(
        &s,
        &target,
        &[],
        &[
            "set-weight",
            "--data",
            s.d(),
            "shard-0",
            "2",
            "--batch",
            "8",
            "--json",
        ],
    );
    let to_reweighted = |_: &str, to: &str| to == "shard-0";
    let after = check_finished(&s, &["shard-0", "shard-1", "shard-2", "shard-3"]);
    check_routes_as(&after, &target);
    // shard-0's share goes from 1/4 to 2/5.
    check_moved_fraction(&out.before, &after, 0.15, &to_reweighted);
    assert!(
        check_report(&out.report, &to_reweighted) >= 2,
        "{}",
        out.report
    );
    check_placements(&out.acks, &out.before, &after);
    check_runs(&out.acks, &parse_runs(&s.runs));
}

/// `shardq rebalance --batch 1` in the background (one key per batch, so
/// it runs long enough to be stopped or killed mid-way); its stderr goes
/// to `rebalance.err` in the scratch dir (appended, run after run).
fn spawn_rebalance(s: &Scratch) -> Proc {
    let err = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(s.dir.join("rebalance.err"))
        .unwrap();
    Proc::spawn(
        Command::new(BIN)
            .args(["rebalance", "--data", s.d(), "--batch", "1", "--json"])
            .stdout(Stdio::null())
            .stderr(err),
        "rebalance",
    )
}

#[test]
fn coordinator_killed_mid_rebalance_finishes_on_rerun_without_loss_or_reordering() {
    let s = Scratch::new("kill");
    init(&s, 4);
    let gates = s.dir.join("gates");
    std::fs::create_dir_all(&gates).unwrap();
    let worker = start_worker(
        &s,
        &Handler::Gated {
            gates: gates.clone(),
        },
        4,
    );
    let producers = start_producers(&s, KEYS_PER_PRODUCER, 3, 200);
    wait_cycles(&producers, &[1, 1]);
    wait_until("the worker to run jobs", || count_lines(&s.runs) >= 100);
    let before = load_map(&s.data);
    let target = expected_map(5, &[]);
    let moving = moving_keys(2 * KEYS_PER_PRODUCER, &before, &target);
    assert!(moving.len() >= 2, "too few producer keys move: {moving:?}");
    // Hold the first and the last moving key (batches go in key order): both
    // have work when the rebalance scans, so it pins both, and it cannot
    // finish while the last one is held.
    let (first, last) = (&moving[0], &moving[moving.len() - 1]);
    hold(&gates, &[first, last]);

    run_ok(&["add-shard", "--data", s.d(), "shard-4"]);
    let warming = load_map(&s.data).version;
    let mut coordinator = spawn_rebalance(&s);
    wait_until("the intermediate map", || {
        load_map(&s.data).version > warming
    });
    let pinned = load_map(&s.data);
    let b = router(&before);
    for k in [first, last] {
        assert_eq!(
            pinned.overrides.get(k).map(String::as_str),
            Some(b.route(k))
        );
    }
    // While the first and the last key are held, the other keys move on
    // (a key waits only for its own runs): the map switches past them, and
    // the held keys stay pinned to their old shards.
    wait_until("a switch of the keys not held", || {
        load_map(&s.data).version > warming + 1
    });
    assert!(coordinator.running(), "the rebalance ended with keys held");
    let mid = load_map(&s.data);
    for k in [first, last] {
        assert_eq!(
            mid.overrides.get(k).map(String::as_str),
            Some(b.route(k)),
            "a held key switched"
        );
    }
    release(&gates, first);
    // SIGKILL as soon as the first key has switched.
    wait_until("the first key's switch", || {
        !load_map(&s.data).overrides.contains_key(first)
    });
    assert!(coordinator.running(), "the rebalance ended before the kill");
    coordinator.child.kill().unwrap();
    coordinator.wait_bounded();

    let killed = load_map(&s.data);
    assert!(
        !killed.overrides.contains_key(first),
        "{first} should have switched"
    );
    assert_eq!(
        killed.overrides.get(last).map(String::as_str),
        Some(b.route(last))
    );
    assert!(s.data.join(TARGET_FILE).exists());

    // Rerun: the kernel dropped the dead coordinator's lock; it finishes.
    release(&gates, last);
    let report = json(&run_ok(&["rebalance", "--data", s.d(), "--json"]));
    assert_eq!(report["from_version"], killed.version, "{report}");
    let to_new = |_: &str, to: &str| to == "shard-4";
    assert!(check_report(&report, &to_new) >= 1, "{report}");

    let (acks, _) = wind_down(&s, producers, worker);

    let after = check_finished(&s, &["shard-0", "shard-1", "shard-2", "shard-3", "shard-4"]);
    check_routes_as(&after, &target);
    check_moved_fraction(&before, &after, 0.2, &to_new);
    let switched = check_placements(&acks, &before, &after);
    assert!(switched.contains(first) && switched.contains(last));
    check_runs(&acks, &parse_runs(&s.runs));
}

/// Whether process `pid` holds (not waits for) the flock of any shard's
/// `.append.lock` under `data`, by `/proc/locks` and the files' inodes.
fn holds_an_append_lock(pid: u32, data: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let inodes: HashSet<u64> = std::fs::read_dir(data)
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::metadata(e.path().join(".append.lock")).ok())
        .map(|m| m.ino())
        .collect();
    let locks = std::fs::read_to_string("/proc/locks").unwrap();
    locks.lines().any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // "N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE ..."; a waiter has "->".
        f.len() >= 6
            && f[1] == "FLOCK"
            && f[4] == pid.to_string()
            && f[5]
                .rsplit(':')
                .next()
                .and_then(|i| i.parse().ok())
                .is_some_and(|i| inodes.contains(&i))
    })
}

/// A rebalance stopped (SIGSTOP) while it holds a shard's append lock, as
/// an operator's Ctrl-Z or a frozen VM would: the producers and the worker
/// that need the lock wait their bound (1 s), find the holder stopped and
/// kill it, and go on; the rebalance, rerun, finishes. Twice, at moments
/// found by stopping the rebalance at random and letting it go on where it
/// held no append lock. No producer is refused (each exits 0 with every
/// line stored), and every acknowledged job runs once, in its key's order,
/// on the shard its key belongs to.
#[test]
fn a_rebalance_stopped_holding_an_append_lock_is_killed_and_nothing_else_stops() {
    let s = Scratch::new("stopped-holder");
    init(&s, 4);
    let worker = start_worker(&s, &Handler::Builtin, 4);
    let producers = start_producers(&s, KEYS_PER_PRODUCER, 20, 2_000);
    wait_cycles(&producers, &[1, 1]);
    let before = load_map(&s.data);
    run_ok(&["add-shard", "--data", s.d(), "shard-4"]);
    let mut rng = support::seed();
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut killed = 0;
    let mut tries = 0;
    loop {
        let mut coordinator = spawn_rebalance(&s);
        let pid = coordinator.child.id();
        while coordinator.running() {
            thread::sleep(Duration::from_micros(100 + next(3_000)));
            if killed == 2 {
                continue;
            }
            coordinator.signal("-STOP");
            tries += 1;
            if !holds_an_append_lock(pid, &s.data) {
                coordinator.signal("-CONT");
                continue;
            }
            // Stopped inside an append: someone needs that lock within a
            // few milliseconds; well within its bound plus the kill, the
            // stopped rebalance is dead.
            let status = support::wait_exit(
                &mut coordinator.child,
                "the rebalance stopped holding an append lock (to be killed by a process \
                 waiting for that lock)",
                Duration::from_secs(10),
            );
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(9), "the stopped holder was killed");
            killed += 1;
        }
        let status = coordinator.wait_bounded();
        if status.success() {
            break;
        }
        assert!(
            killed > 0,
            "the rebalance failed: {}",
            std::fs::read_to_string(s.dir.join("rebalance.err")).unwrap_or_default()
        );
    }
    assert_eq!(
        killed, 2,
        "the rebalance ended before it was caught holding an append lock twice \
         ({tries} stops)"
    );
    let (acks, _) = wind_down(&s, producers, worker);
    let after = check_finished(&s, &["shard-0", "shard-1", "shard-2", "shard-3", "shard-4"]);
    check_routes_as(&after, &expected_map(5, &[]));
    check_placements(&acks, &before, &after);
    check_runs(&acks, &parse_runs(&s.runs));
}

#[test]
fn a_second_rebalance_is_refused_while_one_runs() {
    let s = Scratch::new("busy");
    init(&s, 4);
    // Every key's first job held in flight by a worker: the first rebalance
    // waits for those runs before it moves any key.
    let gates = s.dir.join("gates");
    std::fs::create_dir_all(&gates).unwrap();
    for k in 0..40 {
        std::fs::write(gates.join(format!("t-{k}")), "").unwrap();
    }
    let lines: String = (0..400)
        .map(|j| format!("t-{}\t{}\n", j % 40, j / 40))
        .collect();
    let mut enq = Command::new(BIN)
        .args(["enqueue", "--data", s.d(), "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    enq.stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    let enq = enq.wait_with_output().unwrap();
    assert!(enq.status.success());
    let acks: Vec<Ack> = String::from_utf8(enq.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (key, id) = l.split_once('\t').expect("KEY<TAB>SHARD:ID");
            let (shard, id) = id.rsplit_once(':').expect("SHARD:ID");
            Ack {
                key: key.into(),
                shard: shard.into(),
                id: id.parse().unwrap(),
            }
        })
        .collect();
    assert_eq!(acks.len(), 400);
    let worker = start_worker(
        &s,
        &Handler::Gated {
            gates: gates.clone(),
        },
        40,
    );
    wait_until("every key's first run to be held", || {
        (0..40).all(|k| gates.join(format!("t-{k}.blocked")).exists())
    });

    run_ok(&["add-shard", "--data", s.d(), "shard-4"]);
    let warming = load_map(&s.data).version;
    let mut first = Proc::spawn(
        Command::new(BIN)
            .args(["rebalance", "--data", s.d(), "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
        "first rebalance",
    );
    wait_until("the first rebalance to pin keys", || {
        load_map(&s.data).version > warming
    });
    let target_before = std::fs::read(s.data.join(TARGET_FILE)).unwrap();
    let pid = format!("@{}", first.child.id());
    for args in [
        vec!["rebalance", "--data", s.d()],
        vec!["remove-shard", "--data", s.d(), "shard-0"],
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        // A busy rebalance is a conflict (exit 3), not bad input.
        assert_eq!(out.status.code(), Some(3), "{args:?}: {err}");
        assert!(
            err.contains("another rebalance is running") && err.contains(&pid),
            "{args:?}: {err}"
        );
    }
    assert_eq!(
        std::fs::read(s.data.join(TARGET_FILE)).unwrap(),
        target_before
    );
    assert!(first.running());
    assert_eq!(
        load_map(&s.data).version,
        warming + 1,
        "nothing switches while the moving keys' runs are in flight"
    );

    for k in 0..40 {
        std::fs::remove_file(gates.join(format!("t-{k}"))).unwrap();
    }
    let status = first.wait_bounded();
    let mut out = String::new();
    first
        .child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(status.success(), "{}", first.read_stderr());
    assert!(json(&out)["keys_moved"].as_u64().unwrap() > 0, "{out}");
    let again = json(&run_ok(&["rebalance", "--data", s.d(), "--json"]));
    assert_eq!(again["nothing_to_do"], true, "{again}");

    wait_all_ran(&s, acks.len());
    worker.stop();
    check_finished(&s, &["shard-0", "shard-1", "shard-2", "shard-3", "shard-4"]);
    check_runs(&acks, &parse_runs(&s.runs));
}

#[test]
fn a_producer_on_a_stale_map_is_fenced_and_lands_on_the_new_owner() {
    let s = Scratch::new("stale");
    init(&s, 4);
    let engine = Engine::open(&s.data, EngineOptions::default()).unwrap();
    // Never re-read the map on its own: only a fence can make it notice.
    engine
        .set_producer_options(ProducerOptions {
            refresh_ms: 3_600_000,
            ..ProducerOptions::default()
        })
        .unwrap();
    let before = load_map(&s.data);

    run_ok(&["add-shard", "--data", s.d(), "shard-4"]);
    let report = json(&run_ok(&["rebalance", "--data", s.d(), "--json"]));
    assert_eq!(report["keys_moved"], 0, "nothing had work: {report}");
    let after = check_finished(&s, &["shard-0", "shard-1", "shard-2", "shard-3", "shard-4"]);
    let (b, a) = (router(&before), router(&after));

    let keys: Vec<String> = (0..1_000).map(|i| format!("t-{i}")).collect();
    let jobs = keys.iter().map(|k| NewJob::new(k.clone(), "0")).collect();
    let placed = engine.enqueue_batch(jobs).unwrap();
    let mut moved = 0;
    for (key, (shard, _)) in keys.iter().zip(&placed) {
        assert_eq!(
            shard,
            a.route(key),
            "key {key} stored by the stale producer"
        );
        moved += usize::from(b.route(key) != a.route(key));
    }
    assert!(moved > 150, "only {moved} of 1000 keys move");
    // Nothing reached a shard the key left.
    let backend = engine.backend();
    for key in &keys {
        if b.route(key) != a.route(key) {
            assert_eq!(backend.key_counts(b.route(key), key).unwrap().depth, 0);
        }
    }
}

#[test]
fn a_key_paused_past_the_bound_is_refused_clearly_and_not_enqueued() {
    let s = Scratch::new("paused");
    init(&s, 2);
    let engine = Engine::open(&s.data, EngineOptions::default()).unwrap();
    let backend = engine.backend();
    let paused_shard = engine.router().route("t-held").to_string();
    let other = (0..)
        .map(|i| format!("t-{i}"))
        .find(|k| engine.router().route(k) != paused_shard)
        .unwrap();
    let mut fence = backend.fence(&paused_shard).unwrap();
    fence.paused_keys.insert("t-held".into());
    backend.set_fence(&paused_shard, &fence).unwrap();
    engine
        .set_producer_options(ProducerOptions {
            pause_wait_ms: 200,
            ..ProducerOptions::default()
        })
        .unwrap();

    let started = Instant::now();
    let err = engine
        .enqueue_batch(vec![
            NewJob::new(other.clone(), "0"),
            NewJob::new("t-held", "0"),
        ])
        .unwrap_err()
        .to_string();
    let waited = started.elapsed();
    assert!(
        err.contains("\"t-held\"") && err.contains("NOT enqueued") && err.contains("200 ms"),
        "{err}"
    );
    // At least the bound (less the 1 ms the wall clock's whole
    // milliseconds may cut off its start); and bounded (generously: a
    // loaded machine's fsyncs are slow, the point is that it does not wait
    // forever).
    assert!(
        waited >= Duration::from_millis(199) && waited < Duration::from_secs(60),
        "waited {waited:?}"
    );
    // The paused key's job is absent; the other key's went in.
    assert_eq!(
        backend.key_counts(&paused_shard, "t-held").unwrap().depth,
        0
    );
    let other_shard = engine.router().route(&other).to_string();
    assert_eq!(backend.key_counts(&other_shard, &other).unwrap().depth, 1);

    // Once the pause lifts, the key is accepted again.
    fence.paused_keys.clear();
    backend.set_fence(&paused_shard, &fence).unwrap();
    let (shard, _) = engine.enqueue(NewJob::new("t-held", "0")).unwrap();
    assert_eq!(shard, paused_shard);
    assert_eq!(
        backend.key_counts(&paused_shard, "t-held").unwrap().depth,
        1
    );
}

/// Piped (a log, a script), `rebalance` reports its progress as lines on
/// stderr, JSON lines with `--json`, and says when the shards holding the
/// keys to move have no owner. With no worker running anywhere the keys
/// still move, their backlogs with them: nothing has to drain.
#[test]
fn a_piped_rebalance_reports_progress_and_names_shards_without_an_owner() {
    let s = Scratch::new("piped");
    init(&s, 2);
    let lines: String = (0..200).map(|i| format!("t-{i}\tp\n")).collect();
    let out = Command::new(BIN)
        .args(["enqueue", "--data", s.d(), "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(lines.as_bytes())?;
            c.wait()
        })
        .unwrap();
    assert!(out.success());
    run_ok(&["add-shard", "--data", s.d(), "shard-9"]);
    let out = run(&["rebalance", "--data", s.d(), "--drain-timeout-ms", "300"]);
    let err = String::from_utf8_lossy(&out.stderr);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("keys with work to move with their backlogs"),
        "{err}"
    );
    assert!(
        err.contains("have no owner") && err.contains("shard-0"),
        "{err}"
    );
    assert!(err.contains("moving a batch of"), "{err}");
    let moved: usize = text
        .split_once(": ")
        .and_then(|(_, r)| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(moved > 0, "{text}");
    assert!(
        text.contains(&format!("({moved} jobs moved with them)")),
        "{text}"
    );
    // `status` says who moved what, after the run.
    let status = run_ok(&["status", "--data", s.d()]);
    let line = status
        .lines()
        .find(|l| l.starts_with("last rebalance: finished by shardq rebalance (pid "))
        .unwrap_or_else(|| panic!("no rebalance line in {status}"));
    assert!(line.contains(&format!("{moved} jobs moved")), "{line}");
    // The same as JSON lines, on the next move.
    run_ok(&["add-shard", "--data", s.d(), "shard-8"]);
    let out = run(&[
        "rebalance",
        "--data",
        s.d(),
        "--drain-timeout-ms",
        "300",
        "--json",
    ]);
    assert!(out.status.success());
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["jobs_moved"].as_u64().unwrap() > 0, "{report}");
    let status: serde_json::Value =
        serde_json::from_str(&run_ok(&["status", "--data", s.d(), "--json"])).unwrap();
    let last = &status["rebalance"];
    assert_eq!(last["phase"], "finished", "{status}");
    assert_eq!(last["jobs_moved"], report["jobs_moved"], "{status}");
    assert_eq!(last["to_version"], report["to_version"], "{status}");
    let err = String::from_utf8_lossy(&out.stderr);
    let events: Vec<serde_json::Value> = err
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let names: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
    assert!(
        names.contains(&"no_owner") && names.contains(&"moving"),
        "{err}"
    );
}

/// A hot tenant with a deep backlog and no worker anywhere is pinned to
/// another shard while its producer keeps writing: the rebalance finishes
/// without waiting for the backlog (nothing could run it), the producer is
/// never refused, and once a worker starts every job the producer reported
/// runs once, in order, on the new shard.
#[test]
fn a_hot_tenant_moves_with_its_backlog_while_its_producer_keeps_writing() {
    let s = Scratch::new("hot");
    init(&s, 4);
    let before = load_map(&s.data);
    let from = router(&before).route("hot").to_string();
    let to = if from == "shard-0" {
        "shard-1"
    } else {
        "shard-0"
    };
    // 2,000 jobs queued, then the producer keeps going at 2,000 lines/s.
    let producer = start_producer(&s, vec!["hot".to_string()], 100, 2_000);
    wait_cycles(std::slice::from_ref(&producer), &[20]);
    let out = run(&["pin", "--data", s.d(), "hot", to, "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let report = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(report["keys_moved"], 1, "{report}");
    assert!(report["jobs_moved"].as_u64().unwrap() >= 2_000, "{report}");
    assert!(
        report["pause_ms_max"].as_f64().unwrap() < 1_000.0,
        "{report}"
    );
    // The producer writes on, now to the new shard.
    let cycles = producer.cycles();
    wait_cycles(std::slice::from_ref(&producer), &[cycles + 6]);
    let acks = producer.finish();
    // Every job before the switch on the old shard, every one after on the new.
    let mut shards: Vec<&str> = Vec::new();
    for a in &acks {
        if shards.last() != Some(&a.shard.as_str()) {
            shards.push(&a.shard);
        }
    }
    assert_eq!(shards, [from.as_str(), to], "placements: {shards:?}");
    let worker = start_worker(&s, &Handler::Builtin, 4);
    wait_all_ran(&s, acks.len());
    worker.stop();
    let runs = parse_runs(&s.runs);
    assert!(
        runs.iter().all(|(_, shard, _, _)| shard == to),
        "a job ran on the old shard"
    );
    check_runs(&acks, &runs);
}
