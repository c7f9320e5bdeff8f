//! The Postgres outbox through the real binary and a real PostgreSQL: a
//! job exists if and only if the transaction that enqueued it committed;
//! bad input is refused inside the caller's transaction; each key's rows
//! run in commit order and an open transaction holds back only its own
//! key; relays SIGKILLed at any point, two at a time, store every
//! committed row exactly once and in order.

mod support;

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shardq_testkit::pg::PgServer;
use support::{init_shards, ok, run, temp_dir, BIN};

fn client(pg: &PgServer) -> postgres::Client {
    postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connects to the test server")
}

fn install(d: &str, pg: &PgServer) -> String {
    ok(&["pg", "install", "--data", d, "--postgres", &pg.url()])
}

/// `pg install` with `--wake WAKE`.
fn install_waking(d: &str, pg: &PgServer, wake: &str) -> String {
    ok(&[
        "pg",
        "install",
        "--data",
        d,
        "--postgres",
        &pg.url(),
        "--wake",
        wake,
    ])
}

fn status(pg: &PgServer) -> serde_json::Value {
    serde_json::from_str(&ok(&["pg", "status", "--postgres", &pg.url(), "--json"])).unwrap()
}

fn drain(d: &str, pg: &PgServer) -> serde_json::Value {
    let out = ok(&[
        "pg",
        "relay",
        "--data",
        d,
        "--postgres",
        &pg.url(),
        "--exit-when-empty",
        "--json",
    ]);
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

fn key_jobs(d: &str, key: &str) -> Vec<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(&ok(&[
        "jobs", "--data", d, "--key", key, "--limit", "1000", "--json",
    ]))
    .unwrap();
    v["jobs"].as_array().cloned().unwrap_or_default()
}

#[test]
fn an_outbox_job_exists_if_and_only_if_its_transaction_committed() {
    let pg = PgServer::start();
    let dir = temp_dir("pg-commit");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    assert!(install(d, &pg).contains("applied migration 1"));
    assert!(
        install(d, &pg).contains("up to date"),
        "a second install changes nothing"
    );
    let mut c = client(&pg);
    // Rolled back: no row, no job.
    let mut tx = c.transaction().unwrap();
    tx.execute("SELECT shardq.enqueue('k1', 'rolled back')", &[])
        .unwrap();
    tx.rollback().unwrap();
    // Committed: the three payload forms.
    let mut tx = c.transaction().unwrap();
    tx.execute("SELECT shardq.enqueue('k1', 'committed')", &[])
        .unwrap();
    tx.execute("SELECT shardq.enqueue('k1', '{\"n\": 1}'::jsonb)", &[])
        .unwrap();
    tx.execute(
        "SELECT shardq.enqueue('k2', '\\xff00'::bytea, dedup_id => 'order-7', max_attempts => 2)",
        &[],
    )
    .unwrap();
    tx.commit().unwrap();
    // Bad input: refused in the caller's transaction, naming the field.
    let big = "x".repeat((1 << 20) + 1);
    for (sql, says) in [
        (
            "SELECT shardq.enqueue('', 'p')".to_string(),
            "key must not be empty",
        ),
        (
            "SELECT shardq.enqueue(E'a\\tb', 'p')".into(),
            "control or invisible",
        ),
        (
            format!("SELECT shardq.enqueue('{}', 'p')", "k".repeat(1025)),
            "at most 1024",
        ),
        (
            format!("SELECT shardq.enqueue('kb', '{big}')"),
            "at most 1048576",
        ),
        (
            "SELECT shardq.enqueue('k', 'p', dedup_id => 'pg:shardq:1')".into(),
            "prefix shardq keeps",
        ),
        (
            "SELECT shardq.enqueue('k', 'p', delay_ms => -1)".into(),
            "delay_ms -1",
        ),
        (
            "SELECT shardq.enqueue('k', 'p', max_attempts => 0)".into(),
            "max_attempts 0",
        ),
    ] {
        let mut tx = c.transaction().unwrap();
        tx.execute(
            "SELECT shardq.enqueue('k1', 'lost with the failed transaction')",
            &[],
        )
        .unwrap();
        let e = tx.execute(sql.as_str(), &[]).expect_err(says);
        let text = e
            .as_db_error()
            .map(|d| d.message().to_string())
            .unwrap_or_default();
        assert!(text.contains(says), "{says}: {text}");
        tx.rollback().unwrap();
    }
    let st = status(&pg);
    assert_eq!(st["depth"], 3, "{st}");
    assert_eq!(st["relay_active"], false, "{st}");
    let report = drain(d, &pg);
    assert_eq!(
        (
            report["relayed"].as_u64(),
            report["already_stored"].as_u64()
        ),
        (Some(3), Some(0)),
        "{report}"
    );
    let k1 = key_jobs(d, "k1");
    let payloads: Vec<&str> = k1.iter().map(|j| j["payload"].as_str().unwrap()).collect();
    assert_eq!(payloads, ["committed", "{\"n\": 1}"], "{k1:?}");
    assert!(
        k1[0]["dedup_id"]
            .as_str()
            .unwrap()
            .starts_with("pg:shardq:"),
        "{k1:?}"
    );
    let k2 = key_jobs(d, "k2");
    assert_eq!(
        (
            k2[0]["payload_b64"].as_str(),
            k2[0]["dedup_id"].as_str(),
            k2[0]["max_attempts"].as_u64()
        ),
        (Some("/wA="), Some("order-7"), Some(2)),
        "{k2:?}"
    );
    assert_eq!(status(&pg)["depth"], 0);
    assert_eq!(drain(d, &pg)["relayed"], 0, "nothing is relayed twice");
    // Another schema name is refused before anything is written.
    let (good, _, err) = run(&[
        "pg",
        "install",
        "--data",
        d,
        "--postgres",
        &pg.url(),
        "--schema",
        "Bad-Name",
    ]);
    assert!(!good && err.contains("--schema"), "{err}");
}

#[test]
fn each_keys_rows_run_in_commit_order_and_an_open_transaction_holds_back_only_its_key() {
    let pg = PgServer::start();
    let dir = temp_dir("pg-order");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    install(d, &pg);
    let mut first = client(&pg);
    let mut t1 = first.transaction().unwrap();
    t1.execute("SELECT shardq.enqueue('k', 'first')", &[])
        .unwrap();
    // A second transaction of the same key waits for the first's lock.
    let url = pg.url();
    let second = std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let mut t2 = c.transaction().unwrap();
        t2.execute("SELECT shardq.enqueue('k', 'second')", &[])
            .unwrap();
        let enqueued = Instant::now();
        t2.commit().unwrap();
        enqueued
    });
    let mut other = client(&pg);
    shardq_testkit::wait_until(
        "the second transaction to wait on the key",
        Duration::from_secs(20),
        || {
            other
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%second%'",
                &[],
            )
            .map(|r| r.get::<_, i64>(0) == 1)
            .unwrap_or(false)
        },
    );
    other
        .execute("SELECT shardq.enqueue('other', 'free')", &[])
        .unwrap();
    let st = status(&pg);
    assert!(st["open_transactions"].as_i64() >= Some(1), "{st}");
    // Only the other key's row is committed: it goes, k's wait.
    assert_eq!(drain(d, &pg)["relayed"], 1);
    assert_eq!(key_jobs(d, "other").len(), 1);
    assert!(key_jobs(d, "k").is_empty());
    let committed_first = Instant::now();
    t1.commit().unwrap();
    let enqueued_second = second.join().unwrap();
    assert!(
        enqueued_second >= committed_first,
        "the second row was written only after the first committed"
    );
    assert_eq!(drain(d, &pg)["relayed"], 2);
    let k: Vec<String> = key_jobs(d, "k")
        .iter()
        .map(|j| j["payload"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(k, ["first", "second"]);
}

/// An outbox installed with `--wake poll` has an `enqueue` that does not
/// notify (`pg status` says so); a relay polling it every 100 ms still
/// relays each committed row; installing again without `--wake` keeps the
/// mode, and `--wake notify` puts the notification back.
#[test]
fn an_outbox_installed_to_poll_does_not_notify_and_its_relay_polls() {
    let pg = PgServer::start();
    let dir = temp_dir("pg-poll");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    install_waking(d, &pg, "poll");
    assert_eq!(status(&pg)["wake"], "poll");
    let mut c = client(&pg);
    let notifies = |c: &mut postgres::Client| -> bool {
        c.query_one(
            "SELECT bool_or(prosrc LIKE '%pg_notify%') FROM pg_proc WHERE proname = 'enqueue' AND pronamespace = 'shardq'::regnamespace",
            &[],
        )
        .unwrap()
        .get(0)
    };
    assert!(!notifies(&mut c));
    let mut relay = relay_with(d, &pg, "100", "100");
    for i in 0..3 {
        c.execute(
            "SELECT shardq.enqueue('polled', $1::text)",
            &[&i.to_string()],
        )
        .unwrap();
    }
    shardq_testkit::wait_until("the polled rows relayed", Duration::from_secs(20), || {
        key_jobs(d, "polled").len() == 3
    });
    relay.kill().unwrap();
    relay.wait().unwrap();
    let payloads: Vec<String> = key_jobs(d, "polled")
        .iter()
        .map(|j| j["payload"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(payloads, ["0", "1", "2"]);
    install(d, &pg);
    assert_eq!(
        status(&pg)["wake"],
        "poll",
        "an install without --wake keeps the mode"
    );
    assert!(!notifies(&mut c));
    install_waking(d, &pg, "notify");
    assert_eq!(status(&pg)["wake"], "notify");
    assert!(notifies(&mut c));
}

/// A relay process of the outbox (`--batch` small, so kills land mid-way).
fn relay(d: &str, pg: &PgServer) -> Child {
    relay_with(d, pg, "37", "50")
}

/// A relay process with `--batch` and `--poll-ms`, quiet.
fn relay_with(d: &str, pg: &PgServer, batch: &str, poll_ms: &str) -> Child {
    Command::new(BIN)
        .args(["pg", "relay", "--data", d, "--postgres", &pg.url()])
        .args(["--batch", batch, "--poll-ms", poll_ms])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts a relay")
}

/// Every committed row of `m-K` (`committed[K]` of them, payloads
/// `K:0`, `K:1`, ...) is one job of the key, in commit order.
fn assert_each_committed_row_once_in_order(d: &str, committed: &[usize]) {
    for (k, n) in committed.iter().enumerate() {
        let got: Vec<usize> = key_jobs(d, &format!("m-{k}"))
            .iter()
            .map(|j| {
                let p = j["payload"].as_str().unwrap();
                p.split_once(':').unwrap().1.parse().unwrap()
            })
            .collect();
        assert_eq!(
            got,
            (0..*n).collect::<Vec<_>>(),
            "m-{k}: each committed row once, in commit order"
        );
    }
}

#[test]
fn relays_sigkilled_at_any_point_store_every_committed_row_once_in_order() {
    const KEYS: usize = 12;
    const ROWS: usize = 1_500;
    let pg = PgServer::start();
    let dir = temp_dir("pg-kill");
    let data = dir.join("q");
    init_shards(&data, 3);
    let d = data.to_str().unwrap().to_string();
    install(&d, &pg);
    // A producer commits rows (some transactions rolled back) while
    // relays run two at a time and are SIGKILLed.
    let url = pg.url();
    let producer = std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let mut seq = vec![0usize; KEYS];
        let mut n = 0;
        let mut round = 0u64;
        while n < ROWS {
            round += 1;
            let mut tx = c.transaction().unwrap();
            let mut staged = Vec::new();
            for i in 0..5 {
                let k = (n + i * 7 + round as usize) % KEYS;
                let p = format!(
                    "{k}:{}",
                    seq[k] + staged.iter().filter(|&&s| s == k).count()
                );
                tx.execute("SELECT shardq.enqueue($1, $2)", &[&format!("key-{k}"), &p])
                    .unwrap();
                staged.push(k);
            }
            if round % 4 == 0 {
                tx.rollback().unwrap();
                continue;
            }
            tx.commit().unwrap();
            for k in staged {
                seq[k] += 1;
            }
            n += 5;
        }
        seq
    });
    let mut roll = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        roll ^= roll << 13;
        roll ^= roll >> 7;
        roll ^= roll << 17;
        roll
    };
    while !producer.is_finished() {
        let mut pair = [relay(&d, &pg), relay(&d, &pg)];
        std::thread::sleep(Duration::from_millis(60 + next() % 250));
        let victim = (next() % 2) as usize;
        support::signal(pair[victim].id(), "-KILL");
        std::thread::sleep(Duration::from_millis(next() % 120));
        for c in &mut pair {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    let committed = producer.join().unwrap();
    drain(&d, &pg);
    assert_eq!(status(&pg)["depth"], 0);
    // Every committed row is one job, each key's in commit order.
    let mut seen: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for k in 0..KEYS {
        for j in key_jobs(&d, &format!("key-{k}")) {
            let p = j["payload"].as_str().unwrap();
            let (kk, s) = p.split_once(':').unwrap();
            assert_eq!(kk.parse::<usize>().unwrap(), k);
            seen.entry(k).or_default().push(s.parse().unwrap());
        }
    }
    for (k, want) in committed.iter().enumerate() {
        let got = seen.remove(&k).unwrap_or_default();
        assert_eq!(
            got,
            (0..*want).collect::<Vec<_>>(),
            "key-{k}: every committed row once, in order"
        );
    }
}

/// `shardq serve` with an outbox to watch.
fn serve_with_outbox(d: &str, url: &str) -> (Child, u16) {
    let port = support::free_port();
    let child = Command::new(BIN)
        .args([
            "serve",
            "--data",
            d,
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--no-shards",
        ])
        .args(["--outbox-postgres", url])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts the server");
    shardq_testkit::wait_until("the server to answer", Duration::from_secs(30), || {
        ureq::get(&format!("http://127.0.0.1:{port}/healthz"))
            .call()
            .is_ok()
    });
    (child, port)
}

fn get_text(port: u16, path: &str) -> String {
    ureq::get(&format!("http://127.0.0.1:{port}{path}"))
        .call()
        .expect("answers")
        .into_string()
        .unwrap()
}

#[test]
fn the_server_shows_the_outbox_in_its_status_and_metrics_and_masks_its_password() {
    let pg = PgServer::start();
    let dir = temp_dir("pg-serve");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap();
    install(d, &pg);
    let mut c = client(&pg);
    c.execute(
        "SELECT shardq.enqueue('a', 'one'), shardq.enqueue('b', 'two')",
        &[],
    )
    .unwrap();
    let (mut server, port) = serve_with_outbox(d, &pg.url());
    let status: serde_json::Value = serde_json::from_str(&get_text(port, "/v1/status")).unwrap();
    let o = &status["outbox"];
    assert_eq!(
        (o["depth"].as_i64(), o["relay_active"].as_bool()),
        (Some(2), Some(false)),
        "{status}"
    );
    assert!(o["oldest_age_ms"].as_i64() >= Some(0), "{o}");
    let metrics = get_text(port, "/metrics");
    assert!(
        metrics.contains("shardq_outbox_depth 2") && metrics.contains("shardq_outbox_up 1"),
        "{metrics}"
    );
    // Relayed: the gauges follow within the metrics' cache time.
    drain(d, &pg);
    shardq_testkit::wait_until(
        "the metrics to show an empty outbox",
        Duration::from_secs(10),
        || get_text(port, "/metrics").contains("shardq_outbox_depth 0"),
    );
    let _ = server.kill();
    let _ = server.wait();
    // An outbox that cannot be reached: said in the status, its password
    // masked; the deployment's status is answered all the same.
    let (mut server, port) = serve_with_outbox(d, "postgres://app:s3cr3t-pw@127.0.0.1:1/app");
    let text = get_text(port, "/v1/status");
    let status: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(status["outbox"]["error"].is_string(), "{status}");
    assert!(
        status["shards"].is_array() || status["shards"].is_object(),
        "{status}"
    );
    let metrics = get_text(port, "/metrics");
    assert!(metrics.contains("shardq_outbox_up 0"), "{metrics}");
    assert!(!text.contains("s3cr3t-pw") && !metrics.contains("s3cr3t-pw"));
    let _ = server.kill();
    let _ = server.wait();
}

#[test]
fn a_relay_into_redis_keeps_order_and_one_that_cannot_reach_postgres_says_why_and_retries() {
    let pg = PgServer::start();
    let redis = shardq_testkit::redis::RedisServer::start();
    let dir = temp_dir("pg-redis");
    let data = dir.join("q");
    support::init_shards_with(&data, 3, &["--redis", &redis.url()]);
    let d = data.to_str().unwrap();
    install(d, &pg);
    let mut c = client(&pg);
    let mut tx = c.transaction().unwrap();
    for i in 0..300 {
        tx.execute(
            "SELECT shardq.enqueue($1, $2)",
            &[&format!("r-{}", i % 7), &i.to_string()],
        )
        .unwrap();
    }
    tx.commit().unwrap();
    assert_eq!(drain(d, &pg)["relayed"], 300);
    for k in 0..7 {
        let got: Vec<u64> = key_jobs(d, &format!("r-{k}"))
            .iter()
            .map(|j| j["payload"].as_str().unwrap().parse().unwrap())
            .collect();
        let want: Vec<u64> = (0..300).filter(|i| i % 7 == k).collect();
        assert_eq!(got, want, "r-{k}");
    }
    // Postgres unreachable: the relay says why and tries again, until
    // stopped.
    let mut relay = Command::new(BIN)
        .args([
            "pg",
            "relay",
            "--data",
            d,
            "--postgres",
            "postgres://app:pw@127.0.0.1:1/app",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = relay.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let failed: Vec<String> = (0..2)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(20))
                .expect("a failure line")
        })
        .collect();
    support::signal(relay.id(), "-TERM");
    let status = relay.wait().unwrap();
    reader.join().unwrap();
    let report: serde_json::Value =
        serde_json::from_str(&rx.try_iter().last().expect("a report")).unwrap();
    assert_eq!(report["relayed"], 0, "{report}");
    for l in &failed {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["event"], "failed", "{l}");
        assert!(
            v["retry_ms"].as_u64() > Some(0) && v["why"].as_str().unwrap().contains("postgres"),
            "{l}"
        );
        assert!(!l.contains(":pw@"), "{l}");
    }
    assert!(
        status.success(),
        "a stopped relay exits cleanly: {status:?}"
    );
}

/// A producer of outbox rows over `keys` keys in small transactions, as
/// long as `run` holds and not while `pause` does (it says so in
/// `paused`): a commit it saw succeed is counted in `committed[key]`.
/// After Postgres restarts, it connects again before its next
/// transaction (nothing it counted is in doubt: it never commits while
/// the server may go away).
struct Producer {
    run: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pause: std::sync::Arc<std::sync::atomic::AtomicBool>,
    paused: std::sync::Arc<std::sync::atomic::AtomicBool>,
    total: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    handle: std::thread::JoinHandle<Vec<usize>>,
}

fn producer(url: String, keys: usize) -> Producer {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    let run = Arc::new(AtomicBool::new(true));
    let pause = Arc::new(AtomicBool::new(false));
    let paused = Arc::new(AtomicBool::new(false));
    let total = Arc::new(AtomicUsize::new(0));
    let (r, p, pd, t) = (run.clone(), pause.clone(), paused.clone(), total.clone());
    let handle = std::thread::spawn(move || {
        let mut committed = vec![0usize; keys];
        let mut conn: Option<postgres::Client> = None;
        let mut round = 0usize;
        while r.load(SeqCst) {
            if p.load(SeqCst) {
                conn = None;
                pd.store(true, SeqCst);
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            pd.store(false, SeqCst);
            let c = match conn.as_mut() {
                Some(c) => c,
                None => match postgres::Client::connect(&url, postgres::NoTls) {
                    Ok(c) => conn.insert(c),
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                },
            };
            round += 1;
            let picked: Vec<usize> = (0..3).map(|i| (round * 5 + i * 3) % keys).collect();
            let mut next = committed.clone();
            let mut tx = c.transaction().expect("a transaction on a live server");
            for &k in &picked {
                let payload = format!("{k}:{}", next[k]);
                tx.execute(
                    "SELECT shardq.enqueue($1, $2)",
                    &[&format!("m-{k}"), &payload],
                )
                .expect("enqueue on a live server");
                next[k] += 1;
            }
            tx.commit().expect("commit on a live server");
            committed = next;
            t.fetch_add(picked.len(), SeqCst);
        }
        committed
    });
    Producer {
        run,
        pause,
        paused,
        total,
        handle,
    }
}

impl Producer {
    fn wait_for(&self, more: usize) {
        let want = self.total.load(std::sync::atomic::Ordering::SeqCst) + more;
        shardq_testkit::wait_until(
            "the producer to commit more rows",
            Duration::from_secs(60),
            || self.total.load(std::sync::atomic::Ordering::SeqCst) >= want,
        );
    }

    fn hold(&self) {
        self.pause.store(true, std::sync::atomic::Ordering::SeqCst);
        shardq_testkit::wait_until("the producer to pause", Duration::from_secs(20), || {
            self.paused.load(std::sync::atomic::Ordering::SeqCst)
        });
    }

    fn go_on(&self) {
        self.pause.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    fn finish(self) -> Vec<usize> {
        self.run.store(false, std::sync::atomic::Ordering::SeqCst);
        self.handle.join().unwrap()
    }
}

#[test]
fn the_relay_rides_out_a_postgres_restart_a_sigstop_and_a_rebalance_without_loss_or_reorder() {
    const KEYS: usize = 8;
    let mut pg = PgServer::start();
    let dir = temp_dir("pg-chaos");
    let data = dir.join("q");
    init_shards(&data, 2);
    let d = data.to_str().unwrap().to_string();
    install(&d, &pg);
    let mut relay = relay_with(&d, &pg, "50", "100");
    let p = producer(pg.url(), KEYS);
    p.wait_for(150);
    // Postgres stops for 5 s with rows waiting, and comes back.
    p.hold();
    pg.stop();
    // Real time: the relay must ride out an outage of this length.
    std::thread::sleep(Duration::from_secs(5));
    pg.start_again();
    p.go_on();
    p.wait_for(150);
    // The relay stopped (SIGSTOP) while rows keep coming.
    support::signal(relay.id(), "-STOP");
    p.wait_for(150);
    assert!(
        status(&pg)["depth"].as_i64() > Some(0),
        "rows wait while the relay is stopped"
    );
    support::signal(relay.id(), "-CONT");
    // A shard added and the keys moved while rows are relayed.
    ok(&["add-shard", "--data", &d, "shard-2"]);
    ok(&["rebalance", "--data", &d]);
    p.wait_for(150);
    let committed = p.finish();
    shardq_testkit::wait_until(
        "the relay to empty the outbox",
        Duration::from_secs(60),
        || status(&pg)["depth"] == 0,
    );
    support::signal(relay.id(), "-TERM");
    let _ = relay.wait();
    assert_each_committed_row_once_in_order(&d, &committed);
}

#[test]
fn rows_wait_in_the_outbox_while_the_store_is_down_and_go_once_it_is_back() {
    const KEYS: usize = 6;
    let pg = PgServer::start();
    let mut redis =
        shardq_testkit::redis::RedisServer::start_with(shardq_testkit::redis::ServerOptions {
            aof_always: true,
            ..Default::default()
        });
    let dir = temp_dir("pg-store-down");
    let data = dir.join("q");
    support::init_shards_with(&data, 2, &["--redis", &redis.url()]);
    let d = data.to_str().unwrap().to_string();
    install(&d, &pg);
    let mut relay = relay_with(&d, &pg, "40", "100");
    let p = producer(pg.url(), KEYS);
    p.wait_for(120);
    // The store crashes (SIGKILL; it keeps what it acknowledged, AOF on):
    // committed rows pile up in the outbox, none is lost or deleted.
    redis.kill();
    p.wait_for(120);
    shardq_testkit::wait_until(
        "rows to wait in the outbox",
        Duration::from_secs(20),
        || status(&pg)["depth"].as_i64() >= Some(60),
    );
    redis.restart();
    p.wait_for(60);
    let committed = p.finish();
    shardq_testkit::wait_until(
        "the relay to empty the outbox",
        Duration::from_secs(60),
        || status(&pg)["depth"] == 0,
    );
    support::signal(relay.id(), "-TERM");
    let _ = relay.wait();
    assert_each_committed_row_once_in_order(&d, &committed);
}
