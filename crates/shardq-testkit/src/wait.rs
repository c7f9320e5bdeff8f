//! Bounded waits on a condition, for tests that must see something happen
//! in another thread or process: poll it at a short interval, and fail
//! naming what was awaited once a generous bound has passed. A test waits
//! on the condition, never for a fixed time in the hope that it holds.

use std::time::{Duration, Instant};

/// A bound for waits on something that happens at once on an idle
/// machine: generous, so a loaded one does not fail the test.
pub const WAIT_MAX: Duration = Duration::from_secs(30);

/// Polls `cond` every 10 ms until it holds; panics naming `what` once
/// `bound` has passed.
pub fn wait_until(what: &str, bound: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < bound,
            "gave up after {bound:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
