//! What `outboxd doctor` found: one finding per check, its verdict, what it saw and the fix, printed as a
//! table or JSON, with the exit code of the worst verdict (as `outboxd status` and monitoring plugins use
//! them). Pure: the checks that make findings are `doctor`'s.

use serde::Serialize;

use crate::error::Error;
use crate::status::Level;

/// How one check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// As outboxd needs it.
    Ok,
    /// Worth knowing, nothing to fix (e.g. a limit PostgreSQL leaves unset by default).
    Note,
    /// outboxd runs, but this will hurt: a slot at risk, a topic that refuses large events.
    Warning,
    /// outboxd refuses to start, or would lose or stall events, until it is fixed.
    Failed,
    /// The check could not be made (its server did not answer).
    Unknown,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Note => "note",
            Outcome::Warning => "WARNING",
            Outcome::Failed => "FAILED",
            Outcome::Unknown => "UNKNOWN",
        }
    }
}

/// One check's finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// The check, e.g. `postgres.wal_level` or `kafka.topic outbox.Order`.
    pub check: String,
    /// How it came out.
    pub outcome: Outcome,
    /// What the check saw.
    pub detail: String,
    /// What to change; `None` when nothing needs changing.
    pub fix: Option<String>,
}

impl Finding {
    /// A check that passed, with what it saw.
    pub fn ok(check: impl Into<String>, detail: impl Into<String>) -> Self {
        Finding {
            check: check.into(),
            outcome: Outcome::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    /// A finding of `outcome` with its fix.
    pub fn with_fix(
        check: impl Into<String>,
        outcome: Outcome,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Finding {
            check: check.into(),
            outcome,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    /// A check's error: a set-up error is `Failed` with its fix; a server that did not answer (or any other
    /// error that may pass) is `Unknown`.
    pub fn of_error(check: impl Into<String>, error: &Error) -> Self {
        let check = check.into();
        match error {
            Error::Setup { problem, fix } | Error::ReplicationUnavailable { problem, fix } => {
                Finding::with_fix(check, Outcome::Failed, problem.clone(), fix.clone())
            }
            other if other.is_transient() => Finding {
                check,
                outcome: Outcome::Unknown,
                detail: format!("could not check: {other}"),
                fix: None,
            },
            other => Finding {
                check,
                outcome: Outcome::Failed,
                detail: other.to_string(),
                fix: None,
            },
        }
    }

    /// `Ok(finding)` as it is, an error as [`Finding::of_error`].
    pub fn from_result(check: &str, result: crate::error::Result<Finding>) -> Self {
        result.unwrap_or_else(|error| Finding::of_error(check, &error))
    }
}

/// Every finding, in the order the checks ran.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The findings.
    pub findings: Vec<Finding>,
}

impl Report {
    /// Adds a finding.
    pub fn push(&mut self, finding: Finding) {
        self.findings.push(finding);
    }

    /// The worst finding's level, as `outboxd status` has them: OK (notes too), WARNING, CRITICAL (a check
    /// failed), UNKNOWN (a check could not be made, and none failed).
    pub fn level(&self) -> Level {
        let worst = self.findings.iter().map(|f| f.outcome).max();
        match worst {
            None | Some(Outcome::Ok) | Some(Outcome::Note) => Level::Ok,
            Some(Outcome::Warning) => Level::Warning,
            Some(Outcome::Failed) => Level::Critical,
            Some(Outcome::Unknown) => {
                if self.findings.iter().any(|f| f.outcome == Outcome::Failed) {
                    Level::Critical
                } else {
                    Level::Unknown
                }
            }
        }
    }

    /// How many findings have `outcome`.
    pub fn count(&self, outcome: Outcome) -> usize {
        self.findings
            .iter()
            .filter(|f| f.outcome == outcome)
            .count()
    }

    /// The report as a person reads it: one line per check, the fix under each that has one, the verdict last.
    pub fn to_text(&self) -> String {
        let width = self
            .findings
            .iter()
            .map(|f| f.check.len())
            .max()
            .unwrap_or(0);
        let mut text = String::new();
        // Names in details come from catalogs other roles write: a line break or a terminal escape in one
        // must not forge a line.
        let escape = crate::logging::escape_controls;
        for finding in &self.findings {
            text.push_str(&format!(
                "{:<8} {:<width$}  {}\n",
                finding.outcome.as_str(),
                escape(&finding.check),
                escape(&finding.detail)
            ));
            if let Some(fix) = &finding.fix {
                text.push_str(&format!("{:<8} {:<width$}  fix: {}\n", "", "", escape(fix)));
            }
        }
        text.push_str(&format!(
            "{}: {} failed, {} warnings, {} not checked, {} notes\n",
            self.level().as_str(),
            self.count(Outcome::Failed),
            self.count(Outcome::Warning),
            self.count(Outcome::Unknown),
            self.count(Outcome::Note),
        ));
        text
    }

    /// The report as JSON: `{"level": "OK", "findings": [...]}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "level": self.level(),
            "findings": self.findings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finding(outcome: Outcome) -> Finding {
        Finding::with_fix("postgres.x", outcome, "seen", "do this")
    }

    #[test]
    fn the_worst_finding_decides_and_a_failure_outranks_what_could_not_be_checked() {
        let mut report = Report::default();
        assert_eq!(report.level(), Level::Ok);
        report.push(Finding::ok("postgres.a", "fine"));
        report.push(finding(Outcome::Note));
        assert_eq!(report.level(), Level::Ok);
        report.push(finding(Outcome::Warning));
        assert_eq!(report.level(), Level::Warning);
        report.push(finding(Outcome::Unknown));
        assert_eq!(report.level(), Level::Unknown);
        report.push(finding(Outcome::Failed));
        assert_eq!(report.level(), Level::Critical);
    }

    #[test]
    fn errors_become_failures_with_their_fix_or_unknowns() {
        let failed = Finding::of_error(
            "postgres.wal_level",
            &Error::replication_unavailable("wal_level = replica", "set it to logical"),
        );
        assert_eq!(failed.outcome, Outcome::Failed);
        assert_eq!(failed.fix.as_deref(), Some("set it to logical"));
        let unreachable = Error::Kafka {
            message: "all brokers down".into(),
            transient: true,
        };
        let unknown = Finding::of_error("kafka.brokers", &unreachable);
        assert_eq!(unknown.outcome, Outcome::Unknown, "{unknown:?}");
    }

    #[test]
    fn text_puts_each_fix_under_its_finding_and_json_keeps_every_field() {
        let mut report = Report::default();
        report.push(Finding::ok("postgres.connection", "connected"));
        report.push(finding(Outcome::Failed));
        let text = report.to_text();
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("ok ") && lines[0].contains("connected"),
            "{text}"
        );
        assert!(
            lines[1].starts_with("FAILED") && lines[1].contains("seen"),
            "{text}"
        );
        assert!(lines[2].trim_start().starts_with("fix: do this"), "{text}");
        assert_eq!(
            lines[3],
            "CRITICAL: 1 failed, 0 warnings, 0 not checked, 0 notes"
        );
        let json = report.to_json();
        assert_eq!(json["level"], "CRITICAL");
        assert_eq!(json["findings"][1]["outcome"], "failed");
        assert_eq!(json["findings"][1]["fix"], "do this");
        assert_eq!(json["findings"][0]["fix"], serde_json::Value::Null);
    }

    #[test]
    fn a_name_with_a_line_break_cannot_forge_a_line() {
        let mut report = Report::default();
        report.push(Finding::with_fix(
            "postgres.publication",
            Outcome::Failed,
            "owned by role x\nok       postgres.everything  fine",
            "drop it\u{1b}[2K",
        ));
        let text = report.to_text();
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(!text.contains('\u{1b}'), "{text}");
    }
}
