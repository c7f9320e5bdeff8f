//! Dead letters on Redis: the per-key index `deadk` agrees with `dead` and
//! `deadn` after every operation that adds or removes a dead job, a key
//! moves off a shard that holds many other keys' dead letters in calls that
//! each touch a bounded number of them, and a move whose old shard stops
//! answering leaves the key unsealed and running there. Also the other
//! per-shard index a move keeps, of moved-in copies, trimmed with its list.

use std::io::{Read, Write};

use shardq_core::reshard::{self, MapStore, RebalanceEvent, RebalanceOptions};
use shardq_core::{
    CancelOutcome, DeadPolicy, ErrorKind, FailOutcome, InspectJobs, JobId, KeyCounts, ManualClock,
    MoveKeys, MovedJob, RunJobs,
};
use shardq_redis::{RedisBackend, RedisMapStore, RedisOptions};
use shardq_route::Router;
use shardq_testkit::redis::RedisServer;

use crate::common::{init, job, map_of, opts_manual, owner};

const T0: u64 = 1_700_000_000_000;
const LEASE: u64 = 60_000;

/// Checks inside the server that shard `shard`'s `deadk` holds exactly one
/// member per dead job, `<key>` NUL `<id in 16 digits>` at score 0, and
/// that `deadn` counts each key's dead jobs. Returns the dead jobs' count.
fn index_agrees(server: &RedisServer, b: &RedisBackend, shard: &str) -> u64 {
    const CHECK: &str = r#"
local dead, jobs, deadn, deadk = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ids = redis.call('ZRANGE', dead, 0, -1)
local per = {}
for _, id in ipairs(ids) do
  local r = redis.call('HGET', jobs, id)
  if not r then return {'dead job ' .. id .. ' has no record'} end
  local kl, p = string.match(r, '^%d+|%d+|%d+|%d+|(%d+)|%d+|()')
  local k = string.sub(r, p, p + tonumber(kl) - 1)
  per[k] = (per[k] or 0) + 1
  local m = k .. string.char(0) .. string.format('%016d', tonumber(id))
  if redis.call('ZSCORE', deadk, m) ~= '0' then return {'dead job ' .. id .. ' of ' .. k .. ' is not indexed'} end
end
if redis.call('ZCARD', deadk) ~= #ids then
  return {'deadk holds ' .. redis.call('ZCARD', deadk) .. ' members for ' .. #ids .. ' dead jobs'}
end
local counted = redis.call('HGETALL', deadn)
local keys = 0
for i = 1, #counted, 2 do
  keys = keys + 1
  if tonumber(counted[i + 1]) ~= per[counted[i]] then
    return {'deadn of ' .. counted[i] .. ' is ' .. counted[i + 1] .. ', not ' .. (per[counted[i]] or 0)}
  end
end
for _ in pairs(per) do keys = keys - 1 end
if keys ~= 0 then return {'deadn counts another set of keys'} end
return {'OK', #ids}
"#;
    let parts = b.shard_keys(shard).unwrap();
    let part = |name: &str| {
        let at = shardq_redis::keys::SHARD_PARTS
            .iter()
            .position(|p| *p == name)
            .unwrap();
        parts[at].clone()
    };
    let mut con = server.connection();
    let v: Vec<redis::Value> = redis::cmd("EVAL")
        .arg(CHECK)
        .arg(4)
        .arg(part("dead"))
        .arg(part("jobs"))
        .arg(part("deadn"))
        .arg(part("deadk"))
        .query(&mut con)
        .unwrap();
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        other => format!("{other:?}"),
    };
    assert_eq!(text(&v[0]), "OK", "shard {shard}: {}", text(&v[0]));
    match &v[1] {
        redis::Value::Int(n) => *n as u64,
        other => panic!("{other:?}"),
    }
}

fn counts(depth: u64, in_flight: u64, dead: u64) -> KeyCounts {
    KeyCounts {
        depth,
        in_flight,
        dead,
    }
}

/// A job of `key` as a move brings it, from source id `id`: dead with
/// `reason`, or waiting.
fn moved(id: u64, payload: &str, dead: Option<&str>) -> MovedJob {
    MovedJob {
        id: JobId(id),
        created_ms: T0,
        not_before_ms: T0,
        attempt: u32::from(dead.is_some()),
        max_attempts: 1,
        payload: payload.as_bytes().to_vec(),
        dead: dead.map(str::to_string),
        dedup_id: None,
    }
}

/// Every way a dead job comes or goes, the index checked after each: a
/// failed last attempt, a lapsed run's last attempt, an import, a cancel,
/// a retry and a purge by id and of all, and a purge of a moved key.
#[test]
fn the_dead_letter_index_follows_every_change() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let b = RedisBackend::open(
        &map,
        RedisOptions {
            dead_policy: DeadPolicy::Continue,
            ..opts_manual(&clock)
        },
    )
    .unwrap();
    let _c = owner(&b, "w1", 600_000);
    let agrees = |want: u64| assert_eq!(index_agrees(&server, &b, "r0"), want);
    let once = |k: &str, p: &str| {
        let mut j = job(k, p);
        j.max_attempts = 1;
        j
    };
    // Keys whose names are prefixes of each other, so their index ranges
    // neighbour: "a" never reads "ab"'s dead jobs.
    b.enqueue(
        "r0",
        1,
        &[once("a", "a1"), once("ab", "ab1"), once("a", "a2")],
    )
    .unwrap();
    agrees(0);
    // A failed last attempt.
    let run = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(run.len(), 2);
    for j in &run {
        assert_eq!(
            b.fail("r0", j.receipt(), "boom", None).unwrap(),
            FailOutcome::Dead
        );
    }
    agrees(2);
    // A run whose job lease lapsed, on its last attempt: the next claim buries it.
    let run = b.claim("r0", 10, 1_000).unwrap();
    assert_eq!(crate::common::payloads(&run), ["a2"]);
    clock.advance(2_000);
    assert!(b.claim("r0", 10, LEASE).unwrap().is_empty());
    agrees(3);
    assert_eq!(b.key_counts("r0", "a").unwrap(), counts(0, 0, 2));
    // Imported dead and waiting jobs.
    let brought = vec![
        moved(1, "m1", Some("old")),
        moved(2, "m2", None),
        moved(3, "m3", Some("older")),
    ];
    b.import_jobs("r0", "elsewhere", "a", &brought).unwrap();
    agrees(5);
    // The key's own list, in id order: its dead jobs among its waiting one.
    let listed: Vec<String> = b
        .key_jobs("r0", "a", 100)
        .unwrap()
        .iter()
        .map(|j| String::from_utf8_lossy(&j.payload).into_owned())
        .collect();
    assert_eq!(listed, ["a1", "a2", "m1", "m2", "m3"]);
    // A cancel of a dead job.
    let dead: std::collections::BTreeMap<String, JobId> = b
        .dead_list("r0", 100)
        .unwrap()
        .iter()
        .map(|d| {
            let j = b.job("r0", d.id).unwrap().unwrap();
            (String::from_utf8_lossy(&j.payload).into_owned(), d.id)
        })
        .collect();
    assert_eq!(dead.len(), 5);
    let id_of = |p: &str| dead[p];
    assert_eq!(
        b.cancel("r0", id_of("a1")).unwrap(),
        CancelOutcome::Cancelled
    );
    agrees(4);
    // A retry and a purge by id.
    assert_eq!(b.dead_retry("r0", Some(&[id_of("ab1")])).unwrap(), 1);
    agrees(3);
    assert_eq!(b.dead_purge("r0", Some(&[id_of("m1")])).unwrap(), 1);
    agrees(2);
    // A retry of all, then more dead jobs and a purge of all.
    assert_eq!(b.dead_retry("r0", None).unwrap(), 2);
    agrees(0);
    let run = b.claim("r0", 10, LEASE).unwrap();
    for j in &run {
        b.fail("r0", j.receipt(), "again", None).unwrap();
    }
    agrees(run.len() as u64);
    assert!(!run.is_empty());
    assert_eq!(b.dead_purge("r0", None).unwrap(), run.len());
    agrees(0);
    // A moved key's copies left behind: its waiting and dead jobs go, the
    // other keys' stay.
    let many: Vec<MovedJob> = (1..=300u64)
        .map(|i| moved(100 + i, &i.to_string(), (i % 3 == 0).then_some("dead")))
        .collect();
    b.import_jobs("r0", "elsewhere", "gone", &many).unwrap();
    b.import_jobs("r0", "elsewhere", "ab", &[moved(500, "ab-d", Some("x"))])
        .unwrap();
    agrees(101);
    let mut fence = b.fence("r0").unwrap();
    fence.sealed_keys.insert("gone".into(), "r9".into());
    b.set_fence("r0", &fence).unwrap();
    let purged = b.purge_key("r0", "gone").unwrap();
    assert!(purged >= 300, "{purged}");
    agrees(1);
    assert_eq!(b.key_counts("r0", "gone").unwrap(), counts(0, 0, 0));
    assert_eq!(b.key_counts("r0", "ab").unwrap().dead, 1);
}

/// Sum of the calls of every command the server ran (inside scripts too)
/// since its last `CONFIG RESETSTAT`.
fn commands_run(server: &RedisServer) -> u64 {
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let calls = l.split_once(":calls=")?.1;
            calls.split(',').next()?.parse::<u64>().ok()
        })
        .sum()
}

/// Other keys' dead letters loaded fast through the import script (the
/// path a move's dead letters take): `keys` keys of `each` dead letters.
fn load_dead_letters(b: &RedisBackend, shard: &str, keys: &[String], each: u64) {
    for k in keys {
        let jobs: Vec<MovedJob> = (1..=each)
            .map(|i| moved(i, "x", Some("dead long ago")))
            .collect();
        for chunk in jobs.chunks(1024) {
            b.import_jobs(shard, "elsewhere", k, chunk).unwrap();
        }
    }
}

/// A key with 200 queued jobs and 3 dead letters among them moves off a
/// shard that holds 200,000 dead letters of 500 other keys, all with
/// larger ids than the key's (the ones a walk from the key's cursor met).
/// The move succeeds; the old shard's server runs under 20,000 commands in
/// all for it (one walk over the other dead letters, as an unbounded
/// export, freeze or purge made, is 200,000 or more); the key's jobs and
/// dead letters arrive in their order; the index agrees on both shards.
#[test]
fn a_key_moves_off_a_shard_of_many_dead_letters_in_bounded_calls() {
    let servers = [RedisServer::start(), RedisServer::start()];
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", servers[0].url()), ("r1", servers[1].url())]);
    init(&map);
    let store = RedisMapStore::open(&servers[0].url()).unwrap();
    store.publish(&map, 0).unwrap();
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let _c = owner(&b, "w1", 600_000);
    let router = Router::new(map.clone()).unwrap();
    let mut on_r0 = (0..5_000)
        .map(|i| format!("t{i}"))
        .filter(|k| router.route(k) == "r0");
    let key = on_r0.next().unwrap();
    let others: Vec<String> = on_r0.take(500).collect();
    assert_eq!(others.len(), 500);

    // The key's jobs, in order: a dead letter, 100 waiting, a dead letter,
    // 50 waiting, a dead letter (brought by an earlier move), then 50
    // enqueued after the other keys' dead letters.
    let mut source = vec![moved(1, "d1", Some("first"))];
    source.extend((1..=100).map(|i| moved(1 + i, &format!("w{i}"), None)));
    source.push(moved(102, "d2", Some("second")));
    source.extend((101..=150).map(|i| moved(2 + i, &format!("w{i}"), None)));
    source.push(moved(153, "d3", Some("third")));
    b.import_jobs("r0", "elsewhere", &key, &source).unwrap();
    load_dead_letters(&b, "r0", &others, 400);
    let late: Vec<_> = (151..=200).map(|i| job(&key, &format!("w{i}"))).collect();
    b.enqueue("r0", 1, &late).unwrap();
    assert_eq!(b.key_counts("r0", &key).unwrap(), counts(200, 0, 3));
    assert_eq!(index_agrees(&servers[0], &b, "r0"), 200_003);

    reshard::pin(&store, &key, "r1").unwrap();
    servers[0].cli(&["CONFIG", "RESETSTAT"]);
    let report = reshard::rebalance(&b, &store, &RebalanceOptions::default(), &mut |_| {})
        .expect("the move succeeds");
    let run = commands_run(&servers[0]);
    assert_eq!(report.moved.len(), 1, "{report:?}");
    assert!(
        run < 20_000,
        "the move ran {run} commands on the old shard's server"
    );

    assert_eq!(b.key_counts("r0", &key).unwrap(), counts(0, 0, 0));
    assert_eq!(b.key_counts("r1", &key).unwrap(), counts(200, 0, 3));
    assert_eq!(index_agrees(&servers[0], &b, "r0"), 200_000);
    assert_eq!(index_agrees(&servers[1], &b, "r1"), 3);
    let mut want: Vec<String> = source
        .iter()
        .map(|j| String::from_utf8_lossy(&j.payload).into_owned())
        .collect();
    want.extend((151..=200).map(|i| format!("w{i}")));
    let got: Vec<String> = b
        .key_jobs("r1", &key, 1_000)
        .unwrap()
        .iter()
        .map(|j| String::from_utf8_lossy(&j.payload).into_owned())
        .collect();
    assert_eq!(got, want, "the key's jobs and dead letters, in order");
    let reasons: Vec<String> = b
        .dead_list("r1", 10)
        .unwrap()
        .into_iter()
        .map(|d| d.reason)
        .collect();
    assert_eq!(reasons, ["first", "second", "third"]);
    // Its waiting jobs run there, in order.
    let mut ran = Vec::new();
    loop {
        let jobs = b.claim("r1", 1, LEASE).unwrap();
        let Some(j) = jobs.first() else { break };
        ran.push(String::from_utf8_lossy(&j.payload).into_owned());
        b.ack("r1", &[j.receipt()]).unwrap();
    }
    let waiting: Vec<String> = (1..=200).map(|i| format!("w{i}")).collect();
    assert_eq!(ran, waiting);
}

/// A Redis script that keeps the server busy for ARGV[1] ms.
const BUSY: &str = r#"
local function ms() local t = redis.call('TIME'); return t[1] * 1000 + math.floor(t[2] / 1000) end
local start = ms()
while ms() - start < tonumber(ARGV[1]) do end
return 1
"#;

/// The old shard's server stops answering (a script keeps it busy past
/// the reply timeout and the retries) right after the key was sealed
/// there, before anything of it was copied: the rebalance fails as a
/// retryable error, and the key is left unsealed on its old shard, where
/// its jobs run again (none on its new one, the map unchanged for it). A
/// rerun then moves it with its whole backlog.
#[test]
fn a_move_whose_old_shard_times_out_leaves_the_key_running_there() {
    let servers = [RedisServer::start(), RedisServer::start()];
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", servers[0].url()), ("r1", servers[1].url())]);
    // The map store on the new shard's server, which keeps answering.
    shardq_redis::init_deployment(
        &map,
        &servers[1].url(),
        Some(shardq_redis::keys::NAMESPACE_DEFAULT),
        &RedisOptions::default(),
    )
    .unwrap();
    let store = RedisMapStore::open(&servers[1].url()).unwrap();
    store.publish(&map, 0).unwrap();
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let _c = owner(&b, "w1", 600_000);
    // The rebalance's backend gives up on a server after about a second.
    let impatient = RedisBackend::open(
        &map,
        RedisOptions {
            response_timeout_ms: 200,
            retry_budget_ms: 1_000,
            ..opts_manual(&clock)
        },
    )
    .unwrap();
    let router = Router::new(map.clone()).unwrap();
    let key = (0..100)
        .map(|i| format!("k{i}"))
        .find(|k| router.route(k) == "r0")
        .unwrap();
    let jobs: Vec<_> = (0..5).map(|i| job(&key, &i.to_string())).collect();
    b.enqueue("r0", 1, &jobs).unwrap();
    reshard::pin(&store, &key, "r1").unwrap();

    // Once the batch is sealed, the old shard's server is kept busy for
    // 1.3 s: the key's next calls there time out, and so may the probe
    // that follows; then it answers again. The busy script is written to
    // the server before the rebalance goes on, so it runs first.
    let mut busy = std::net::TcpStream::connect(("127.0.0.1", servers[0].port())).unwrap();
    // A PING on the probe goes unanswered while the script holds the server.
    let mut probe = std::net::TcpStream::connect(("127.0.0.1", servers[0].port())).unwrap();
    probe
        .set_read_timeout(Some(std::time::Duration::from_millis(100)))
        .unwrap();
    let mut sent = false;
    let err = reshard::rebalance(&impatient, &store, &RebalanceOptions::default(), &mut |e| {
        if matches!(e, RebalanceEvent::Moving { .. }) && !sent {
            sent = true;
            let arg = |a: &str| format!("${}\r\n{a}\r\n", a.len());
            let cmd = format!(
                "*4\r\n{}{}{}{}",
                arg("EVAL"),
                arg(BUSY),
                arg("0"),
                arg("1300")
            );
            busy.write_all(cmd.as_bytes()).unwrap();
            shardq_testkit::wait_until(
                "the busy script to hold the old shard's server",
                std::time::Duration::from_secs(10),
                || {
                    probe.write_all(b"PING\r\n").unwrap();
                    let mut pong = [0u8; 7];
                    probe.read_exact(&mut pong).is_err()
                },
            );
        }
    })
    .expect_err("the old shard stopped answering");
    assert!(sent, "no batch was sealed");
    let mut reply = [0u8; 4];
    busy.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b":1\r\n", "the busy script ran");
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
    // Left where it is, unsealed: it runs there again.
    let fence = b.fence("r0").unwrap();
    assert!(fence.sealed_keys.is_empty(), "{fence:?}");
    assert!(fence.paused_keys.is_empty(), "{fence:?}");
    let now = Router::new(store.load().unwrap()).unwrap();
    assert_eq!(now.route(&key), "r0");
    assert_eq!(b.key_counts("r1", &key).unwrap(), counts(0, 0, 0));
    let first = b.claim("r0", 10, LEASE).unwrap();
    assert_eq!(crate::common::payloads(&first), ["0"]);
    b.ack("r0", &[first[0].receipt()]).unwrap();

    // The rerun moves it with the rest of its backlog.
    let report = reshard::rebalance(&b, &store, &RebalanceOptions::default(), &mut |_| {})
        .expect("the rerun");
    assert_eq!(report.moved.len(), 1, "{report:?}");
    let mut ran = Vec::new();
    loop {
        let jobs = b.claim("r1", 1, LEASE).unwrap();
        let Some(j) = jobs.first() else { break };
        ran.push(String::from_utf8_lossy(&j.payload).into_owned());
        b.ack("r1", &[j.receipt()]).unwrap();
    }
    assert_eq!(ran, ["1", "2", "3", "4"]);
}

/// The index of moved-in copies keeps what the `movedin` list names and
/// no more: past MOVED_KEYS_KEPT imports the oldest import's copies are
/// forgotten (their `#` fields in `imported` deleted with the list entry),
/// the newest are found in one read, and source ids of another shard with
/// the same numbers find nothing.
#[test]
fn the_moved_in_index_is_trimmed_with_its_list() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let map = map_of(&[("r0", server.url())]);
    init(&map);
    let b = RedisBackend::open(&map, opts_manual(&clock)).unwrap();
    let _c = owner(&b, "w1", 600_000);
    let n = shardq_core::MOVED_KEYS_KEPT as u64 + 3;
    let mut copies = Vec::new();
    for i in 1..=n {
        let pairs = b
            .import_jobs("r0", "src", &format!("k{}", i % 50), &[moved(i, "p", None)])
            .unwrap();
        copies.push(pairs[0].1);
    }
    for i in 1..=3u64 {
        assert_eq!(
            b.imported_as("r0", "src", JobId(i)).unwrap(),
            None,
            "import {i} forgotten"
        );
    }
    for i in [4u64, n / 2, n] {
        assert_eq!(
            b.imported_as("r0", "src", JobId(i)).unwrap(),
            Some(copies[i as usize - 1]),
            "import {i}"
        );
        assert_eq!(b.imported_as("r0", "src2", JobId(i)).unwrap(), None);
        assert_eq!(b.imported_as("r0", "sr", JobId(i)).unwrap(), None);
    }
    let parts = b.shard_keys("r0").unwrap();
    let imported = &parts[shardq_redis::keys::part_index("imported").unwrap()];
    let mut con = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let fields: Vec<String> = redis::cmd("HKEYS").arg(imported).query(&mut con).unwrap();
    let index = fields.iter().filter(|f| f.starts_with('#')).count();
    assert_eq!(
        index,
        shardq_core::MOVED_KEYS_KEPT,
        "one index field per remembered copy"
    );
}
