//! The string forms of job ids and receipts on the wire: a job is
//! `SHARD:ID` (e.g. `shard-2:17`), a receipt `SHARD:ID.FENCE` (e.g.
//! `shard-2:17.1700000000044000`, core's `Receipt` after the shard). Shard
//! names never hold `:`, so the forms are unambiguous. Pure parsing; it must
//! never look a shard up.

use shardq_core::{JobId, Receipt};

/// A job id as clients see it.
pub fn job_string(shard: &str, id: JobId) -> String {
    WireId {
        shard,
        id,
        fence: None,
    }
    .to_string()
}

/// A receipt as clients see it.
pub fn receipt_string(shard: &str, r: Receipt) -> String {
    WireId {
        shard,
        id: r.id,
        fence: Some(r.fence),
    }
    .to_string()
}

/// A job id (`SHARD:ID`, no fence) or a receipt (`SHARD:ID.FENCE`, the
/// fence after core's `Receipt` id), the one place their forms are
/// written: as a `String` ([`job_string`], [`receipt_string`]) or straight
/// into an answer (serialised as that string) without one.
#[derive(Debug, Clone, Copy)]
pub struct WireId<'a> {
    /// The job's shard.
    pub shard: &'a str,
    /// The job's id within it.
    pub id: JobId,
    /// The run's fence, for a receipt.
    pub fence: Option<u64>,
}

impl std::fmt::Display for WireId<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.fence {
            None => write!(f, "{}:{}", self.shard, self.id.0),
            Some(fence) => write!(f, "{}:{}.{fence}", self.shard, self.id.0),
        }
    }
}

impl serde::Serialize for WireId<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Parses `SHARD:ID`; `field` names the input in the error.
pub fn parse_job(s: &str, field: &str) -> Result<(String, JobId), String> {
    let bad = || format!("{field}: invalid job id {s:?}: expected SHARD:ID, e.g. \"shard-2:17\"");
    let (shard, id) = s.rsplit_once(':').ok_or_else(bad)?;
    if shard.is_empty() {
        return Err(bad());
    }
    Ok((shard.to_string(), JobId(id.parse().map_err(|_| bad())?)))
}

/// Parses `SHARD:ID.FENCE`; `field` names the input in the error.
pub fn parse_receipt(s: &str, field: impl Fn() -> String) -> Result<(String, Receipt), String> {
    split_receipt(s, field).map(|(shard, r)| (shard.to_string(), r))
}

/// [`parse_receipt`], the shard's name borrowed from `s`.
pub fn split_receipt(s: &str, field: impl Fn() -> String) -> Result<(&str, Receipt), String> {
    // The field's name is formatted only for an error.
    let bad = || {
        format!(
            "{}: invalid receipt {s:?}: expected SHARD:ID.FENCE, e.g. \"shard-2:17.1700000000044000\"",
            field()
        )
    };
    let (shard, rest) = s.rsplit_once(':').ok_or_else(bad)?;
    if shard.is_empty() {
        return Err(bad());
    }
    let r: Receipt = rest.parse().map_err(|_| bad())?;
    Ok((shard, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_round_trip_and_bad_ones_are_named() {
        let r = Receipt {
            id: JobId(17),
            fence: 1_700_000_000_044_000,
        };
        let s = receipt_string("shard-2", r);
        assert_eq!(s, "shard-2:17.1700000000044000");
        assert_eq!(
            parse_receipt(&s, || "r".into()).unwrap(),
            ("shard-2".into(), r)
        );
        assert_eq!(
            parse_job(&job_string("a.b", JobId(3)), "j").unwrap(),
            ("a.b".into(), JobId(3))
        );
        for bad in ["", "17.1", ":17.1", "s:17", "s:x.1", "s:1.2.3"] {
            let e = parse_receipt(bad, || "receipts[0]".into()).unwrap_err();
            assert!(
                e.contains("receipts[0]") && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
        assert!(parse_job("s:1.2", "ids[0]").is_err());
    }

    #[test]
    fn wire_ids_are_the_string_forms() {
        let r = Receipt {
            id: JobId(17),
            fence: 1_700_000_000_044_000,
        };
        let job = WireId {
            shard: "shard-2",
            id: r.id,
            fence: None,
        };
        let receipt = WireId {
            fence: Some(r.fence),
            ..job
        };
        assert_eq!(job.to_string(), job_string("shard-2", r.id));
        assert_eq!(receipt.to_string(), receipt_string("shard-2", r));
        // A receipt's tail is core's `Receipt` form.
        assert_eq!(receipt_string("shard-2", r), format!("shard-2:{r}"));
        assert_eq!(
            serde_json::to_string(&[job, receipt]).unwrap(),
            r#"["shard-2:17","shard-2:17.1700000000044000"]"#
        );
    }
}
