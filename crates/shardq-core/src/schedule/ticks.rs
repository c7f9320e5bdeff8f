//! A schedule's tick times: cron in a zone, or an anchored interval, and
//! each tick's jitter.

use chrono::{TimeZone, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds};
use croner::Cron;

use super::{Schedule, When};
use crate::error::QueueError;

/// Parses a cron expression: five fields, or six with seconds first;
/// names of months and days, ranges, lists and steps.
pub fn parse_cron(expr: &str) -> Result<Cron, QueueError> {
    CronParser::builder()
        .seconds(Seconds::Optional)
        .build()
        .parse(expr)
        .map_err(|e| QueueError::InvalidOption {
            name: "cron",
            value: format!("{expr:?}"),
            allowed: format!(
                "a cron expression of 5 fields (minute hour day month weekday) or 6 with \
                 seconds first ({e})"
            ),
        })
}

/// Parses an IANA zone name (`Europe/Berlin`, `UTC`).
pub fn parse_zone(name: &str) -> Result<Tz, QueueError> {
    name.parse::<Tz>().map_err(|_| QueueError::InvalidOption {
        name: "tz",
        value: format!("{name:?}"),
        allowed: "an IANA time zone name such as UTC or Europe/Berlin".into(),
    })
}

enum Recur {
    Cron(Box<Cron>, Tz),
    Every { every_ms: u64, anchor_ms: u64 },
}

/// A schedule ready to give its ticks.
pub struct Compiled {
    recur: Recur,
    start_ms: Option<u64>,
    end_ms: Option<u64>,
    jitter_ms: u64,
    seed: u64,
}

impl Compiled {
    /// Compiles schedule `id`'s recurrence, refusing a cron field, a zone
    /// or an interval that is not valid (naming it and the value), and a
    /// cron expression that matches no time.
    pub fn new(id: &str, s: &Schedule) -> Result<Compiled, QueueError> {
        let recur = match &s.when {
            When::Cron { expr, tz } => {
                let cron = parse_cron(expr)?;
                let zone = parse_zone(tz)?;
                Recur::Cron(Box::new(cron), zone)
            }
            When::Every { every_ms } => {
                if !(super::EVERY_MS_MIN..=super::EVERY_MS_MAX).contains(every_ms) {
                    return Err(QueueError::InvalidOption {
                        name: "every",
                        value: format!("{every_ms} ms"),
                        allowed: format!(
                            "{} to {} ms (1 s to 366 days)",
                            super::EVERY_MS_MIN,
                            super::EVERY_MS_MAX
                        ),
                    });
                }
                Recur::Every {
                    every_ms: *every_ms,
                    anchor_ms: s.start_ms.unwrap_or(0),
                }
            }
        };
        let c = Compiled {
            recur,
            start_ms: s.start_ms,
            end_ms: s.end_ms,
            jitter_ms: s.jitter_ms,
            seed: seed_of(id),
        };
        if let Recur::Cron(_, _) = c.recur {
            c.cron_next(s.start_ms.unwrap_or(s.since_ms)).map_err(|e| {
                QueueError::InvalidOption {
                    name: "cron",
                    value: match &s.when {
                        When::Cron { expr, .. } => format!("{expr:?}"),
                        When::Every { .. } => String::new(),
                    },
                    allowed: format!("an expression that matches some time ({e})"),
                }
            })?;
        }
        Ok(c)
    }

    /// The first tick strictly after `after_ms`, within the start and end;
    /// `None` past the end.
    pub fn next_after(&self, after_ms: u64) -> Option<u64> {
        let floor = match self.start_ms {
            Some(s) if s > 0 => after_ms.max(s - 1),
            _ => after_ms,
        };
        let t = match &self.recur {
            Recur::Every {
                every_ms,
                anchor_ms,
            } => {
                if floor < *anchor_ms {
                    *anchor_ms
                } else {
                    let n = (floor - anchor_ms) / every_ms + 1;
                    anchor_ms.checked_add(n.checked_mul(*every_ms)?)?
                }
            }
            Recur::Cron(..) => self.cron_next(floor).ok()?,
        };
        match self.end_ms {
            Some(end) if t > end => None,
            _ => Some(t),
        }
    }

    /// The first cron match strictly after `after_ms`, on a whole second.
    /// `croner` keeps the milliseconds of the time it starts from, so the
    /// search starts from the whole second at or before `after_ms` (a tick
    /// must not depend on when it was asked for: its dedup id holds it);
    /// and at a fall-back change, asked from inside the repeated hour, it
    /// answers the first occurrence of a fixed local time (which fires
    /// once, at that occurrence) though `after_ms` is already past it: it
    /// is then asked again from an hour after that answer, past the
    /// repeated hour, until the answer is later than `after_ms`.
    fn cron_next(&self, after_ms: u64) -> Result<u64, String> {
        let Recur::Cron(cron, zone) = &self.recur else {
            return Err("not a cron schedule".into());
        };
        let mut from = after_ms - after_ms % 1000;
        for _ in 0..4 {
            let secs = i64::try_from(from / 1000).map_err(|_| "time out of range".to_string())?;
            let at = Utc
                .timestamp_opt(secs, 0)
                .single()
                .ok_or("time out of range")?
                .with_timezone(zone);
            let next = cron
                .find_next_occurrence(&at, false)
                .map_err(|e| e.to_string())?;
            let ms = u64::try_from(next.timestamp())
                .ok()
                .and_then(|s| s.checked_mul(1000))
                .ok_or("time out of range")?;
            if ms > after_ms {
                return Ok(ms);
            }
            from = ms.max(from).saturating_add(3_600_000);
        }
        Err(format!("no match after {after_ms} ms"))
    }

    /// The delay of tick `tick_ms`'s fire after the tick: a fixed function
    /// of the schedule id and the tick in `0..=jitter_ms`, so every process
    /// computes the same.
    pub fn jitter(&self, tick_ms: u64) -> u64 {
        if self.jitter_ms == 0 {
            return 0;
        }
        mix(self.seed ^ tick_ms) % (self.jitter_ms + 1)
    }
}

/// A stable 64-bit seed of a schedule id (FNV-1a, from the routing crate).
fn seed_of(id: &str) -> u64 {
    shardq_route::hash::fnv1a64(id.as_bytes())
}

/// The SplitMix64 finaliser: spreads a seed over all 64 bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use super::*;

    fn cron(expr: &str, tz: &str) -> Schedule {
        Schedule {
            key: "k".into(),
            when: When::Cron {
                expr: expr.into(),
                tz: tz.into(),
            },
            payload: String::new(),
            overlap: Overlap::All,
            catch_up_ms: CATCH_UP_MS_DEFAULT,
            jitter_ms: 0,
            start_ms: None,
            end_ms: None,
            max_attempts: 1,
            paused: false,
            since_ms: 0,
        }
    }

    fn ms(tz: &str, y: i32, mo: u32, d: u32, h: u32, mi: u32) -> u64 {
        let zone: Tz = tz.parse().unwrap();
        zone.with_ymd_and_hms(y, mo, d, h, mi, 0)
            .earliest()
            .unwrap()
            .timestamp_millis() as u64
    }

    fn ticks(c: &Compiled, from: u64, to: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut t = from;
        while let Some(n) = c.next_after(t) {
            if n > to {
                break;
            }
            out.push(n);
            t = n;
        }
        out
    }

    #[test]
    fn a_daily_0230_fires_once_on_both_daylight_saving_days_in_two_zones() {
        // Spring forward: 02:00-03:00 does not exist; the 02:30 tick fires
        // once, at 03:00 local. Fall back: 02:30 exists only once in Berlin
        // (the change is at 03:00 -> 02:00, so 02:30 occurs twice): one fire.
        for (tz, spring, fall) in [
            ("Europe/Berlin", (2026, 3, 29), (2026, 10, 25)),
            ("America/New_York", (2026, 3, 8), (2026, 11, 1)),
        ] {
            let s = cron("30 2 * * *", tz);
            let c = Compiled::new("daily", &s).unwrap();
            let day = |(y, m, d): (i32, u32, u32)| {
                let from = ms(tz, y, m, d, 0, 0);
                ticks(&c, from, from + 23 * 3600 * 1000)
            };
            let spring_ticks = day(spring);
            assert_eq!(
                spring_ticks,
                vec![ms(tz, spring.0, spring.1, spring.2, 3, 0)],
                "{tz}"
            );
            let fall_ticks = day(fall);
            assert_eq!(fall_ticks.len(), 1, "{tz}: {fall_ticks:?}");
            assert_eq!(fall_ticks[0], ms(tz, fall.0, fall.1, fall.2, 2, 30), "{tz}");
            // The days around keep one tick each.
            let from = ms(tz, fall.0, fall.1, fall.2, 0, 0) - 3 * 24 * 3600 * 1000;
            assert_eq!(
                ticks(&c, from, from + 7 * 24 * 3600 * 1000).len(),
                7,
                "{tz}"
            );
        }
    }

    #[test]
    fn a_cron_tick_is_on_a_whole_second_whatever_it_is_asked_from() {
        let c = Compiled::new("n", &cron("30 2 * * *", "Europe/Berlin")).unwrap();
        let tick = ms("Europe/Berlin", 2026, 3, 28, 2, 30);
        for after in [
            tick - 86_400_000 + 437,
            tick - 1,
            tick - 999,
            tick - 60_000 + 1,
        ] {
            assert_eq!(c.next_after(after), Some(tick), "from {after}");
        }
        assert_eq!(
            c.next_after(tick),
            Some(ms("Europe/Berlin", 2026, 3, 29, 3, 0))
        );
        let c = Compiled::new("s", &cron("*/15 * * * * *", "UTC")).unwrap();
        assert_eq!(c.next_after(15_001), Some(30_000));
        assert_eq!(c.next_after(14_999), Some(15_000));
    }

    #[test]
    fn after_a_repeated_local_time_the_next_tick_is_later_not_its_first_occurrence() {
        // Berlin, 2026-10-25: 02:00-03:00 CEST, then 02:00-03:00 CET again.
        // From 02:10 CET (the second 02:10), the 02:30 tick of that day is
        // past (it was 02:30 CEST): the next is the day after.
        let zone: Tz = "Europe/Berlin".parse().unwrap();
        let second_0210 = zone
            .with_ymd_and_hms(2026, 10, 25, 2, 10, 0)
            .latest()
            .unwrap()
            .timestamp_millis() as u64;
        let c = Compiled::new("f", &cron("30 2 * * *", "Europe/Berlin")).unwrap();
        let next = c.next_after(second_0210).unwrap();
        assert!(next > second_0210);
        assert_eq!(next, ms("Europe/Berlin", 2026, 10, 26, 2, 30));
        // Every five minutes through the repeated hour: strictly rising.
        let c = Compiled::new("f5", &cron("*/5 * * * *", "Europe/Berlin")).unwrap();
        let from = ms("Europe/Berlin", 2026, 10, 25, 1, 0);
        let all = ticks(&c, from, from + 4 * 3600 * 1000);
        assert!(all.windows(2).all(|w| w[1] > w[0]), "{all:?}");
    }

    #[test]
    fn cron_takes_seconds_names_and_ranges_and_refuses_bad_fields_by_name() {
        let c = Compiled::new("s", &cron("*/15 * * * * *", "UTC")).unwrap();
        assert_eq!(ticks(&c, 0, 60_000), vec![15_000, 30_000, 45_000, 60_000]);
        let c = Compiled::new("d", &cron("0 9 * JAN-MAR MON-FRI", "UTC")).unwrap();
        // 1970-01-01 was a Thursday: Jan 1, 2, 5, 6 ... at 09:00.
        let first = ticks(&c, 0, 6 * 24 * 3600 * 1000);
        assert_eq!(first.len(), 4, "{first:?}");
        for (expr, tz, name) in [
            ("61 * * * *", "UTC", "cron"),
            ("* * * *", "UTC", "cron"),
            ("0 0 30 2 *", "UTC", "cron"),
            ("0 0 * * *", "Mars/Olympus", "tz"),
        ] {
            let e = Compiled::new("x", &cron(expr, tz)).err().expect(expr);
            let text = e.to_string();
            assert!(text.contains(&format!("invalid {name}")), "{text}");
            assert!(
                text.contains(if name == "tz" { tz } else { expr }),
                "{text}"
            );
        }
    }

    #[test]
    fn every_is_anchored_and_bounded_by_start_and_end() {
        let mut s = cron("", "UTC");
        s.when = When::Every { every_ms: 1_000 };
        s.start_ms = Some(10_500);
        s.end_ms = Some(13_500);
        let c = Compiled::new("e", &s).unwrap();
        assert_eq!(ticks(&c, 0, 100_000), vec![10_500, 11_500, 12_500, 13_500]);
        // The Nth tick is anchor + N x every whatever the caller's cursor.
        assert_eq!(c.next_after(11_499), Some(11_500));
        assert_eq!(c.next_after(11_500), Some(12_500));
        s.when = When::Every { every_ms: 999 };
        let e = Compiled::new("e", &s).err().unwrap().to_string();
        assert!(e.contains("invalid every 999 ms"), "{e}");
        s.when = When::Every { every_ms: 1_000 };
        s.start_ms = Some(20_000);
        let e = s.validate("e").err().unwrap().to_string();
        assert!(e.contains("invalid start 20000 ms"), "{e}");
    }

    #[test]
    fn jitter_is_the_same_everywhere_and_within_its_bound() {
        let mut s = cron("* * * * *", "UTC");
        s.jitter_ms = 5_000;
        let a = Compiled::new("j", &s).unwrap();
        let b = Compiled::new("j", &s).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for t in 0..200u64 {
            let j = a.jitter(t * 60_000);
            assert_eq!(j, b.jitter(t * 60_000));
            assert!(j <= 5_000);
            seen.insert(j / 1000);
        }
        assert!(seen.len() >= 5, "jitter spreads over its range: {seen:?}");
    }
}
