//! The token bucket: exact integer arithmetic, holds (see the recipe in
//! the [`flow`](super) module's header).

use serde::{Deserialize, Serialize};

use super::rate::Rate;

/// A token bucket (see the [`flow`](super) module header for the recipe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Units held (a token is `per_ms` units).
    pub units: u64,
    /// When `units` was last brought up to date.
    pub at_ms: u64,
    /// Nothing is given before this (a handler's back-off).
    #[serde(default)]
    pub held_until_ms: u64,
    /// The rate the units are counted in.
    pub count: u64,
    /// The rate's unit.
    pub per_ms: u64,
}

impl Bucket {
    /// A full bucket for `rate` and `burst` at `now_ms`.
    pub fn full(rate: Rate, burst: u64, now_ms: u64) -> Bucket {
        Bucket {
            units: burst.saturating_mul(rate.per_ms),
            at_ms: now_ms,
            held_until_ms: 0,
            count: rate.count,
            per_ms: rate.per_ms,
        }
    }

    /// Brings the bucket up to `now_ms` under `rate` and `burst` (a changed
    /// limit keeps the tokens held, up to the new burst).
    pub(super) fn refill(&mut self, rate: Rate, burst: u64, now_ms: u64) {
        if self.per_ms != rate.per_ms || self.count != rate.count {
            let tokens_x = self.units as u128 * rate.per_ms as u128 / self.per_ms.max(1) as u128;
            self.units = tokens_x.min(u64::MAX as u128) as u64;
            self.count = rate.count;
            self.per_ms = rate.per_ms;
        }
        if now_ms > self.at_ms {
            let add = (now_ms - self.at_ms).saturating_mul(rate.count);
            self.units = self.units.saturating_add(add);
            self.at_ms = now_ms;
        }
        self.units = self.units.min(burst.saturating_mul(rate.per_ms));
    }

    /// `Ok` if a token is there at `now_ms` (not taken), else when one will be.
    pub fn peek(&mut self, rate: Rate, burst: u64, now_ms: u64) -> Result<(), u64> {
        self.peek_after(rate, burst, now_ms, 0)
    }

    /// [`Bucket::peek`] with `reserved` tokens already promised to earlier
    /// starts (not yet taken): `Ok` if one more is there.
    pub fn peek_after(
        &mut self,
        rate: Rate,
        burst: u64,
        now_ms: u64,
        reserved: u64,
    ) -> Result<(), u64> {
        self.refill(rate, burst, now_ms);
        if now_ms < self.held_until_ms {
            return Err(self.held_until_ms);
        }
        let need = reserved.saturating_add(1).saturating_mul(rate.per_ms);
        if self.units >= need {
            Ok(())
        } else {
            let missing = need - self.units;
            Err(now_ms.saturating_add(missing.div_ceil(rate.count)))
        }
    }

    /// Takes a token at `now_ms`, or says when one will be there.
    pub fn take(&mut self, rate: Rate, burst: u64, now_ms: u64) -> Result<(), u64> {
        self.peek(rate, burst, now_ms)?;
        self.units -= rate.per_ms;
        Ok(())
    }

    /// Holds the bucket until `until_ms` (the later of two holds wins).
    pub fn hold(&mut self, until_ms: u64) {
        self.held_until_ms = self.held_until_ms.max(until_ms);
    }

    /// Lifts a hold: the bucket gives tokens again at once.
    pub fn resume(&mut self) {
        self.held_until_ms = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::testing::rate;

    /// The recipe, exactly: over any window the starts stay within
    /// burst + window x rate, and the waits named are exact.
    #[test]
    fn a_bucket_follows_the_recipe_to_the_millisecond() {
        let r = rate("50/s");
        let mut b = Bucket::full(r, 5, 1_000);
        for _ in 0..5 {
            assert_eq!(b.take(r, 5, 1_000), Ok(()));
        }
        assert_eq!(b.take(r, 5, 1_000), Err(1_020), "one token per 20 ms");
        assert_eq!(b.take(r, 5, 1_019), Err(1_020));
        assert_eq!(b.take(r, 5, 1_020), Ok(()));
        // Long idle refills to the burst, no further.
        assert_eq!(b.peek(r, 5, 100_000), Ok(()));
        assert_eq!(b.units, 5_000);
        // Every ms for 10 s: starts = burst + floor(10 000 x 50 / 1000).
        let mut b = Bucket::full(r, 5, 0);
        let starts = (0..=10_000u64).filter(|&t| b.take(r, 5, t).is_ok()).count();
        assert_eq!(starts, 5 + 500);
        // A hold gives nothing before it ends, then what refilled.
        let mut b = Bucket::full(r, 2, 0);
        b.hold(500);
        assert_eq!(b.take(r, 2, 10), Err(500));
        assert_eq!(b.take(r, 2, 500), Ok(()));
        // A changed rate keeps the tokens held.
        let mut b = Bucket::full(r, 10, 0);
        let slower = rate("60/m");
        assert_eq!(b.peek(slower, 10, 0), Ok(()));
        assert_eq!(b.units, 10 * 60_000);
    }
}
