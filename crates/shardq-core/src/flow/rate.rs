//! Rates: starts per unit of time (`50/s`, `600/m`, `1000/h`), their
//! parsing, display and range check.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::QueueError;

/// Most starts a rate may allow per unit of time.
pub const RATE_COUNT_MAX: u64 = 1_000_000;

/// Starts per unit of time: `50/s`, `600/m`, `1000/h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Rate {
    /// Starts allowed per `per_ms`.
    pub count: u64,
    /// The unit: 1000 (s), 60 000 (m) or 3 600 000 (h).
    pub per_ms: u64,
}

impl Rate {
    /// One second of this rate, rounded up, at least 1: the default burst.
    pub fn default_burst(&self) -> u64 {
        (self.count * 1000).div_ceil(self.per_ms).max(1)
    }

    pub(super) fn check(&self) -> Result<(), QueueError> {
        if self.count == 0 || self.count > RATE_COUNT_MAX {
            return Err(QueueError::InvalidOption {
                name: "rate",
                value: self.to_string(),
                allowed: format!("1 to {RATE_COUNT_MAX} per unit"),
            });
        }
        if ![1_000, 60_000, 3_600_000].contains(&self.per_ms) {
            return Err(QueueError::InvalidOption {
                name: "rate",
                value: format!("{} per {} ms", self.count, self.per_ms),
                allowed: "a unit of s, m or h".into(),
            });
        }
        Ok(())
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.per_ms {
            1_000 => "s",
            60_000 => "m",
            3_600_000 => "h",
            other => return write!(f, "{}/{}ms", self.count, other),
        };
        write!(f, "{}/{unit}", self.count)
    }
}

impl FromStr for Rate {
    type Err = QueueError;

    fn from_str(text: &str) -> Result<Rate, QueueError> {
        let bad = |why: &str| QueueError::InvalidOption {
            name: "rate",
            value: format!("{text:?}"),
            allowed: format!("N/s, N/m or N/h with N from 1 to {RATE_COUNT_MAX} ({why})"),
        };
        let (n, unit) = text.trim().split_once('/').ok_or_else(|| bad("no unit"))?;
        let per_ms = match unit.trim() {
            "s" | "sec" | "second" => 1_000,
            "m" | "min" | "minute" => 60_000,
            "h" | "hour" => 3_600_000,
            _ => return Err(bad("unknown unit")),
        };
        let count: u64 = n.trim().parse().map_err(|_| bad("not a whole number"))?;
        let r = Rate { count, per_ms };
        r.check().map_err(|_| bad("out of range"))?;
        Ok(r)
    }
}

impl TryFrom<String> for Rate {
    type Error = QueueError;
    fn try_from(s: String) -> Result<Rate, QueueError> {
        s.parse()
    }
}

impl From<Rate> for String {
    fn from(r: Rate) -> String {
        r.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::testing::rate;

    #[test]
    fn rates_parse_and_bad_ones_name_the_value() {
        assert_eq!(
            rate("50/s"),
            Rate {
                count: 50,
                per_ms: 1000
            }
        );
        assert_eq!(
            rate(" 600 / m"),
            Rate {
                count: 600,
                per_ms: 60_000
            }
        );
        assert_eq!(rate("7/hour").to_string(), "7/h");
        for bad in ["0/s", "-1/s", "5/d", "5", "x/s", "2000000/s", ""] {
            let e = bad.parse::<Rate>().unwrap_err().to_string();
            assert!(
                e.contains("rate") && e.contains(&format!("{bad:?}")),
                "{bad}: {e}"
            );
        }
        assert_eq!(rate("1/h").default_burst(), 1);
        assert_eq!(rate("50/s").default_burst(), 50);
        assert_eq!(rate("90/m").default_burst(), 2);
    }
}
