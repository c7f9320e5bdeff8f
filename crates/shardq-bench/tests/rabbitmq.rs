//! The consistent-hash harness against a real RabbitMQ broker with the
//! `rabbitmq_consistent_hash_exchange` plugin.
//!
//! The broker's URL comes from `SHARDQ_TEST_RABBITMQ_URL`. Without it the test
//! fails and says how to start one (`scripts/rabbitmq.sh start`), because a
//! silently skipped broker test reads as a pass; set `SHARDQ_SKIP_RABBITMQ=1`
//! to skip on purpose. Sizes keep the run to a few seconds.

use shardq_bench::chx::{self, Params, Quiet, RabbitTarget, Target};

const URL_ENV: &str = "SHARDQ_TEST_RABBITMQ_URL";
const SKIP_ENV: &str = "SHARDQ_SKIP_RABBITMQ";

/// The broker URL, `None` when skipping was asked for; panics otherwise.
fn broker_url() -> Option<String> {
    if let Some(url) = std::env::var(URL_ENV).ok().filter(|u| !u.is_empty()) {
        return Some(url);
    }
    if std::env::var(SKIP_ENV).as_deref() == Ok("1") {
        eprintln!(
            "skipped: {SKIP_ENV}=1 and {URL_ENV} is unset; the RabbitMQ harness test did not run"
        );
        return None;
    }
    panic!(
        "{URL_ENV} is not set. Start a loopback broker and point the test at it:\n\
         \n    scripts/rabbitmq.sh start 5673\n    export {URL_ENV}=amqp://127.0.0.1:5673\n\n\
         (stop it with `scripts/rabbitmq.sh stop 5673`), or set {SKIP_ENV}=1 to skip this test on purpose."
    );
}

/// A: 2,500 messages per queue; B: 2,000 keys; C: 500 keys x 4.
fn params() -> Params {
    Params {
        queues: 8,
        messages: 20_000,
        keys: 10_000,
        rebalance_keys: 2_000,
        affinity_keys: 500,
        copies: 4,
    }
}

#[test]
fn consistent_hash_exchange() {
    let Some(url) = broker_url() else { return };
    let mut target = RabbitTarget::connect(&url).unwrap_or_else(|e| panic!("{e}"));
    let version = target.version();
    assert!(version.starts_with("RabbitMQ "), "{version}");
    let r = chx::run_system(&mut target, &params(), &mut Quiet);
    target.close();
    assert!(r.complete(), "{:?}", r.note);

    let d = r.distribution.as_ref().unwrap();
    let add = r.add.as_ref().unwrap();
    let remove = r.remove.as_ref().unwrap();
    let c = r.affinity.as_ref().unwrap();
    eprintln!(
        "{version}: A max/min {:.3}, max/ideal {:.3}; B add moved {:.2}% (to new {:.1}%); \
         B2 remove moved {:.2}% ({} on the removed queue, {} others); C split {}",
        d.max_min(),
        d.max_ideal(),
        add.moved_pct(),
        add.moved_to_new_pct().unwrap_or(0.0),
        remove.moved_pct(),
        remove.on_removed,
        remove.needless,
        c.split_keys
    );

    // A: every message was counted, and weight-1 queues are close to even.
    assert_eq!(d.total(), params().messages);
    assert!(d.max_min() < 1.20, "A max/min {:.3}", d.max_min());
    // B: about 1/9 of the keys move, all of them to the new queue.
    let ideal = 100.0 / 9.0;
    assert!(
        (add.moved_pct() - ideal).abs() <= 3.0,
        "B moved {:.2}%",
        add.moved_pct()
    );
    assert_eq!(
        add.moved_to_new, add.moved,
        "B moved keys between old queues"
    );
    // B2: the removed queue's keys all moved. Whether others move is the
    // broker's design, measured and printed above, not asserted.
    assert!(remove.on_removed > 0);
    assert!(remove.moved >= remove.on_removed);
    // C: each key on exactly one queue.
    assert_eq!(c.split_keys, 0);
    assert_eq!(c.messages, 2_000);
}

#[test]
fn missing_broker_is_an_error_not_a_pass() {
    // Runs whether or not a broker is configured: port 1 never has one.
    let err = RabbitTarget::connect("amqp://127.0.0.1:1")
        .unwrap_err()
        .to_string();
    assert!(err.contains("no broker at amqp://127.0.0.1:1"), "{err}");
    assert!(err.contains("scripts/rabbitmq.sh start"), "{err}");
}
