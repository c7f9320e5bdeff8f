//! Time, behind a trait, so that leases, delays and retries can be tested
//! deterministically with [`ManualClock`].
//!
//! Nothing in the engine may read the system time except through a [`Clock`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Now, in ms since the Unix epoch.
    fn now_ms(&self) -> u64;

    /// Waits `ms` of this clock's time: a real sleep on the system clock; a
    /// manual clock moves itself forward instead, so waits in code under
    /// test (drains, producer retries) cost no real time.
    fn sleep_ms(&self, ms: u64) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }

    /// How long, in real time, to block for an event (a finished run, a
    /// wake-up) that may come before `ms` of this clock's time have passed.
    /// The system clock: `ms`. A manual clock moves only when its test
    /// moves it, so a wait on it is one short real slice
    /// ([`MANUAL_WAIT_SLICE_MS`]): the waiter looks at the time again
    /// soon, and a test that advances the clock never waits out a real
    /// timeout.
    fn event_wait(&self, ms: u64) -> std::time::Duration {
        std::time::Duration::from_millis(ms)
    }
}

/// The real time a wait on a [`ManualClock`] blocks before its waiter
/// reads the clock again.
pub const MANUAL_WAIT_SLICE_MS: u64 = 1;

/// The system's clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        // A clock before 1970 is a broken host; 0 keeps arithmetic sane.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
}

/// A clock that moves only when told; clones share the same time.
#[derive(Debug, Default, Clone)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `now_ms` until advanced.
    pub fn new(now_ms: u64) -> ManualClock {
        ManualClock {
            now_ms: Arc::new(AtomicU64::new(now_ms)),
        }
    }

    /// Moves time forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now_ms.fetch_add(ms, Ordering::SeqCst);
    }

    /// Sets the time.
    pub fn set(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }

    fn sleep_ms(&self, ms: u64) {
        self.advance(ms);
        std::thread::yield_now();
    }

    fn event_wait(&self, ms: u64) -> std::time::Duration {
        std::time::Duration::from_millis(ms.min(MANUAL_WAIT_SLICE_MS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new(10);
        let b = a.clone();
        a.advance(5);
        assert_eq!(b.now_ms(), 15);
        b.set(3);
        assert_eq!(a.now_ms(), 3);
        assert!(SystemClock.now_ms() > 1_600_000_000_000);
    }
}
