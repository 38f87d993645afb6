//! Pure: whether outboxd's slot would survive a promotion of a standby (PostgreSQL 17 failover slots), from
//! what the primary and the standbys given with `--standby-url` report (`pg::failover` reads them). `status`,
//! `doctor`, `run`'s start-up and `/metrics` all judge with [`FailoverReadiness::findings`], so they never
//! disagree. Owns no I/O.

use serde::Serialize;

/// How much a finding matters: a warning is a promotion that would cost a hand-off (a sweep of the gap and
/// more duplicates), or events published that the new primary never had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Concern {
    /// Worth knowing, nothing at risk (failover slots turned off on purpose).
    Note,
    /// A promotion would not carry the slot over cleanly.
    Warning,
}

/// The failover state of the slot, on a primary of PostgreSQL 17 or newer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FailoverReadiness {
    /// The slot's `failover` flag; `None` while the slot does not exist.
    pub slot_failover: Option<bool>,
    /// The primary's `synchronized_standby_slots` (physical slots whose standbys must have received WAL
    /// before a logical walsender sends it).
    pub synchronized_standby_slots: Vec<String>,
    /// Entries of `synchronized_standby_slots` that are no physical slot on the primary.
    pub unknown_standby_slots: Vec<String>,
    /// The primary has a physical standby (a physical slot, or a physical walsender), or one was given
    /// with `--standby-url`: without one there is nothing to fail over to, and nothing to warn about.
    pub has_standbys: bool,
    /// What each `--standby-url` holds of the slot.
    pub standbys: Vec<StandbyCopy>,
}

/// The slot's copy on one standby.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StandbyCopy {
    /// host:port of the standby (never its URL, which may hold a password).
    pub standby: String,
    /// Why the standby could not be read (unreachable, not in recovery, an error); the rest is then unset.
    pub problem: Option<String>,
    /// The standby's `sync_replication_slots`.
    pub sync_replication_slots: bool,
    /// The slot exists on the standby.
    pub exists: bool,
    /// It was synchronised from the primary (`synced`): only such a copy can be used after promotion.
    pub synced: bool,
    /// It is temporary (not yet persisted: dropped at promotion).
    pub temporary: bool,
    /// Why PostgreSQL invalidated it (`invalidation_reason`), if it did.
    pub invalidation_reason: Option<String>,
    /// The primary's `confirmed_flush_lsn` minus the copy's, in bytes: what a promotion now would send again.
    pub behind_bytes: Option<i64>,
}

impl FailoverReadiness {
    /// True when a promotion of any standby outboxd was told about (or, with none given, of a standby that
    /// `synchronized_standby_slots` protects) would carry the slot over: a failover slot, a standby,
    /// protected, and every given standby holding a valid synchronised copy.
    pub fn ready(&self) -> bool {
        !self
            .findings()
            .iter()
            .any(|(concern, _)| *concern == Concern::Warning)
            && self.slot_failover == Some(true)
            && (self.has_standbys || !self.standbys.is_empty())
    }

    /// What stands between the slot and a clean promotion, each with what to do about it.
    pub fn findings(&self) -> Vec<(Concern, String)> {
        let mut findings = Vec::new();
        match self.slot_failover {
            None => return findings,
            Some(false) => {
                findings.push((Concern::Note, "the slot is no failover slot (--no-failover-slot, or another tool made it): after a promotion outboxd creates a new slot and sweeps the gap through the polling path".into()));
                return findings;
            }
            Some(true) => {}
        }
        if !self.has_standbys && self.standbys.is_empty() {
            findings.push((Concern::Note, "a failover slot, but the primary has no physical standby (no physical slot or walsender): nothing to fail over to yet; with one, set synchronized_standby_slots to its slot".into()));
            return findings;
        }
        if self.synchronized_standby_slots.is_empty() {
            findings.push((Concern::Warning, "the slot is a failover slot but synchronized_standby_slots is empty on the primary: outboxd may publish (and confirm) events a standby never received, so a promoted standby may lack events Kafka has and its copy of the slot may lag; fix: ALTER SYSTEM SET synchronized_standby_slots = '<the standby's physical slot>'; SELECT pg_reload_conf();".into()));
        }
        if !self.unknown_standby_slots.is_empty() {
            findings.push((
                Concern::Warning,
                format!(
                    "synchronized_standby_slots names {} but the primary has no such physical slot: logical walsenders wait for it, so outboxd receives nothing; fix: create the slot (SELECT pg_create_physical_replication_slot('<name>')) and set it as the standby's primary_slot_name, or remove the name",
                    self.unknown_standby_slots.join(", ")
                ),
            ));
        }
        for copy in &self.standbys {
            let standby = &copy.standby;
            if let Some(problem) = &copy.problem {
                findings.push((Concern::Warning, format!("standby {standby}: {problem}")));
                continue;
            }
            let problem = if !copy.sync_replication_slots {
                Some("sync_replication_slots is off: it keeps no copy of the slot; fix: set sync_replication_slots = on, hot_standby_feedback = on, a primary_slot_name, and dbname in primary_conninfo on the standby".to_string())
            } else if !copy.exists {
                Some("holds no copy of the slot yet (it syncs a slot once the slot has been used on the primary and the standby caught up)".to_string())
            } else if !copy.synced {
                Some("holds a slot of that name that was not synchronised from the primary: it cannot be used after promotion; drop it on the standby".to_string())
            } else if copy.temporary {
                Some("its copy of the slot is still temporary (not persisted until the standby caught up with the slot): a promotion now drops it".to_string())
            } else {
                copy.invalidation_reason.as_ref().map(|reason| {
                    format!("its copy of the slot is invalidated ({reason}): a promotion now would need a new slot")
                })
            };
            if let Some(problem) = problem {
                findings.push((Concern::Warning, format!("standby {standby}: {problem}")));
            }
        }
        findings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn protected() -> FailoverReadiness {
        FailoverReadiness {
            slot_failover: Some(true),
            synchronized_standby_slots: vec!["standby_1".into()],
            unknown_standby_slots: vec![],
            has_standbys: true,
            standbys: vec![StandbyCopy {
                standby: "10.0.0.2:5432".into(),
                sync_replication_slots: true,
                exists: true,
                synced: true,
                behind_bytes: Some(0),
                ..StandbyCopy::default()
            }],
        }
    }

    fn warnings(readiness: &FailoverReadiness) -> Vec<String> {
        readiness
            .findings()
            .into_iter()
            .filter(|(concern, _)| *concern == Concern::Warning)
            .map(|(_, text)| text)
            .collect()
    }

    #[test]
    fn a_protected_failover_slot_with_a_synced_copy_is_ready() {
        let readiness = protected();
        assert!(readiness.findings().is_empty());
        assert!(readiness.ready());
    }

    #[test]
    fn a_failover_slot_without_synchronized_standby_slots_is_a_warning_with_the_fix() {
        let readiness = FailoverReadiness {
            synchronized_standby_slots: vec![],
            ..protected()
        };
        let found = warnings(&readiness);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("synchronized_standby_slots"), "{found:?}");
        assert!(found[0].contains("ALTER SYSTEM SET"), "{found:?}");
        assert!(!readiness.ready());
    }

    #[test]
    fn without_any_standby_an_unprotected_failover_slot_is_only_a_note() {
        let alone = FailoverReadiness {
            synchronized_standby_slots: vec![],
            has_standbys: false,
            standbys: vec![],
            ..protected()
        };
        assert!(warnings(&alone).is_empty());
        assert_eq!(alone.findings()[0].0, Concern::Note);
        assert!(!alone.ready());
    }

    #[test]
    fn a_name_no_physical_slot_answers_to_is_a_warning() {
        let readiness = FailoverReadiness {
            unknown_standby_slots: vec!["gone".into()],
            ..protected()
        };
        assert!(warnings(&readiness)[0].contains("gone"));
        assert!(!readiness.ready());
    }

    #[test]
    fn each_unusable_standby_copy_is_named_with_why() {
        let copy = |change: fn(&mut StandbyCopy)| {
            let mut readiness = protected();
            change(&mut readiness.standbys[0]);
            warnings(&readiness)
        };
        assert!(
            copy(|c| c.sync_replication_slots = false)[0].contains("sync_replication_slots is off")
        );
        assert!(copy(|c| c.exists = false)[0].contains("no copy"));
        assert!(copy(|c| c.synced = false)[0].contains("not synchronised"));
        assert!(copy(|c| c.temporary = true)[0].contains("temporary"));
        assert!(
            copy(|c| c.invalidation_reason = Some("wal_removed".into()))[0]
                .contains("invalidated (wal_removed)")
        );
        assert!(copy(|c| c.problem = Some("cannot connect".into()))[0]
            .contains("10.0.0.2:5432: cannot connect"));
    }

    #[test]
    fn no_failover_slot_is_a_note_and_no_slot_says_nothing() {
        let off = FailoverReadiness {
            slot_failover: Some(false),
            ..protected()
        };
        assert!(warnings(&off).is_empty());
        assert_eq!(off.findings()[0].0, Concern::Note);
        assert!(!off.ready());
        let none = FailoverReadiness {
            slot_failover: None,
            ..protected()
        };
        assert!(none.findings().is_empty());
    }
}
