//! What `outboxd audit` found: the kinds of finding, the counts, the verdict and its exit code, and the
//! summary as text or JSON. Pure; the reading and comparing is `audit`'s.

use serde::Serialize;

/// One kind of finding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A published event no topic holds, published within its topic's retention.
    Missing,
    /// A published event no topic holds, published before its topic's `retention.ms` could keep it.
    Expired,
    /// An event held more than once (each copy past the first is one).
    Duplicated,
    /// An event on another topic, or on another partition than its key hashes to.
    Misplaced,
    /// An event after a later event of its aggregate in its partition (by the rows' insert position).
    Reordered,
    /// A record no row explains: no event id, or one of no row in the table.
    Unexplained,
}

/// One finding, written as a JSON line to `--details`.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// What kind of finding.
    pub kind: Kind,
    /// The event's id (none for a record without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// The topic it is about (the event's, or the record's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// The record's partition, for findings about a record.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<i32>,
    /// The record's offset, for findings about a record.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<i64>,
    /// What it means here, in a sentence.
    pub detail: String,
}

/// The counts of one audit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// Published events in the range (rows with `published_at`; those marked published before outboxd, with
    /// `-infinity`, are not counted: nothing says where they went).
    pub checked: u64,
    /// Of them, held by their topic at least once.
    pub present: u64,
    /// Published within their topic's retention, held by no topic.
    pub missing: u64,
    /// Published before their topic's retention could keep them.
    pub expired: u64,
    /// Events held more than once.
    pub duplicated: u64,
    /// Their copies past the first.
    pub extra_copies: u64,
    /// Copies on another topic, or on another partition than their key hashes to.
    pub misplaced: u64,
    /// Events after a later event of their aggregate.
    pub reordered: u64,
    /// Records without an event id (another producer).
    pub unexplained_without_id: u64,
    /// Records of an event id no row has, older than the table's oldest published row (deleted by retention).
    pub unexplained_deleted: u64,
    /// Records of an event id no row has, within the table's span (another producer, or a row deleted by
    /// hand).
    pub unexplained_foreign: u64,
    /// Records that republish an event (an `outboxd-replay` header: `outboxd replay --published` to the live
    /// topic, or `--heal`): no duplicates, and not in the order check (a republished event comes after its
    /// aggregate's later ones by design).
    pub replayed: u64,
    /// Topics and records read.
    pub topics: u64,
    /// Records read.
    pub records: u64,
    /// Missing events handed back to the polling path (`--heal`).
    pub healed: u64,
}

/// The verdict, as `status` gives it: 0 clean, 1 findings, 2 could not audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing that fails the audit.
    Clean = 0,
    /// Something missing, misplaced, reordered or unexplained.
    Findings = 1,
    /// The audit could not be made.
    CouldNotAudit = 2,
}

impl Summary {
    /// Findings that fail the audit: anything missing, misplaced, reordered or unexplained; duplicates only
    /// when `fail_on_duplicates` (at-least-once delivery makes some, and consumers dedupe them). Expired
    /// events are the topic's retention at work.
    pub fn verdict(&self, fail_on_duplicates: bool) -> Verdict {
        let failing = self.failing()
            + if fail_on_duplicates {
                self.duplicated
            } else {
                0
            };
        if failing > 0 {
            Verdict::Findings
        } else {
            Verdict::Clean
        }
    }

    /// Findings that fail every audit: missing, misplaced, reordered and unexplained (not retention's).
    pub fn failing(&self) -> u64 {
        self.missing
            + self.misplaced
            + self.reordered
            + self.unexplained_without_id
            + self.unexplained_foreign
    }

    /// The summary a person reads.
    pub fn to_text(&self, fail_on_duplicates: bool) -> String {
        let verdict = match self.verdict(fail_on_duplicates) {
            Verdict::Clean => "CLEAN",
            Verdict::Findings => "FINDINGS",
            Verdict::CouldNotAudit => "COULD NOT AUDIT",
        };
        let mut text = format!(
            "{verdict}: {} published events checked against {} records of {} topics\n",
            self.checked, self.records, self.topics
        );
        let lines = [
            (self.present, "present in their topic"),
            (self.missing, "MISSING: published, but no topic holds them (their event ids: --details FILE)"),
            (self.expired, "expired: published before their topic's retention.ms could keep them"),
            (self.duplicated, "duplicated (at least once delivery: consumers dedupe by event id)"),
            (self.replayed, "republished records (an outboxd-replay header: a replay or a heal), not counted as duplicates or in the order check"),
            (self.misplaced, "MISPLACED: on another topic, or on another partition than their key hashes to"),
            (self.reordered, "REORDERED: after a later event of their aggregate"),
            (self.unexplained_without_id, "UNEXPLAINED records without an event id (another producer writes to the topic)"),
            (self.unexplained_foreign, "UNEXPLAINED records whose event id no row has (another producer, or rows deleted by hand)"),
            (self.unexplained_deleted, "records whose rows retention deleted (older than the table's oldest published row)"),
        ];
        for (count, what) in lines {
            if count > 0 || what.starts_with("present") {
                text.push_str(&format!("  {count:>10}  {what}\n"));
            }
        }
        if self.healed > 0 {
            text.push_str(&format!(
                "  {:>10}  missing events handed back to the polling path (--heal): outboxd publishes them again\n",
                self.healed
            ));
        }
        if self.extra_copies > 0 {
            text.push_str(&format!(
                "  {:>10}  copies past the first of the duplicated events\n",
                self.extra_copies
            ));
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_fail_only_when_asked() {
        let summary = Summary {
            checked: 10,
            present: 10,
            duplicated: 2,
            extra_copies: 3,
            ..Summary::default()
        };
        assert_eq!(summary.verdict(false), Verdict::Clean);
        assert_eq!(summary.verdict(true), Verdict::Findings);
    }

    #[test]
    fn expired_and_retention_deleted_records_are_no_findings() {
        let summary = Summary {
            checked: 10,
            present: 7,
            expired: 3,
            unexplained_deleted: 4,
            ..Summary::default()
        };
        assert_eq!(summary.verdict(true), Verdict::Clean);
        let text = summary.to_text(false);
        assert!(text.starts_with("CLEAN: 10 published events"), "{text}");
        assert!(text.contains("expired"), "{text}");
        assert!(!text.contains("MISSING"), "{text}");
    }

    #[test]
    fn a_missing_event_is_a_finding_named_with_its_fix() {
        let summary = Summary {
            checked: 5,
            present: 4,
            missing: 1,
            ..Summary::default()
        };
        assert_eq!(summary.verdict(false), Verdict::Findings);
        let text = summary.to_text(false);
        assert!(text.contains("MISSING"), "{text}");
        assert!(text.contains("--details"), "{text}");
    }
}
