//! Pure: whether a confirmed position may be carried over to the server a new replication session reached.
//!
//! An LSN means something only on the server history it was confirmed on: one system identifier and one
//! timeline (`IDENTIFY_SYSTEM`). A failover to a standby, a restore from a backup or another cluster behind
//! the same URL presents a different history, and START_REPLICATION at the old position would be honoured
//! there, silently skipping everything in between. This module decides when the old position must be
//! dropped; `cdc` does the I/O (identify, slot, snapshot hand-off) and logs what [`judge`] found. Owns no I/O.

use std::fmt;

use crate::lsn::Lsn;

/// One server history: a position is valid only within it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerHistory {
    /// System identifier of the cluster (`IDENTIFY_SYSTEM`'s systemid).
    pub system_id: String,
    /// Timeline the server is on (`IDENTIFY_SYSTEM`'s timeline).
    pub timeline: u32,
}

/// What a session found when it connected, next to what the previous sessions of this process confirmed.
#[derive(Debug, Clone)]
pub struct Reached<'a> {
    /// The server history the session reached.
    pub history: &'a ServerHistory,
    /// The server's WAL flush position (`IDENTIFY_SYSTEM`'s xlogpos).
    pub wal_end: Lsn,
    /// True when the slot did not exist and outboxd has to create it.
    pub slot_missing: bool,
}

/// Why the confirmed position cannot be carried over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HistoryChange {
    /// Another cluster behind the same URL (a blue/green switch, a new cluster).
    OtherSystem {
        /// System identifier the position was confirmed on.
        old: String,
        /// System identifier of the server reached now.
        new: String,
    },
    /// The same cluster on a new timeline (a promoted standby, a point-in-time restore).
    NewTimeline {
        /// Timeline the position was confirmed on.
        old: u32,
        /// Timeline of the server reached now.
        new: u32,
    },
    /// The server's WAL ends before the confirmed position (a restore of an earlier backup).
    WalBehind {
        /// The server's WAL flush position now.
        wal_end: Lsn,
        /// The position confirmed earlier, beyond that end.
        confirmed: Lsn,
    },
    /// The slot is gone (dropped, or a server that never had it): a new slot starts where it is created.
    SlotMissing,
}

impl fmt::Display for HistoryChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HistoryChange::OtherSystem { old, new } => write!(
                f,
                "another PostgreSQL cluster answers (system identifier {old} before, {new} now)"
            ),
            HistoryChange::NewTimeline { old, new } => write!(
                f,
                "the server is on a new timeline ({old} before, {new} now: a promoted standby or a point-in-time restore)"
            ),
            HistoryChange::WalBehind { wal_end, confirmed } => write!(
                f,
                "the server's WAL ends at {wal_end}, before the position {confirmed} confirmed earlier (a restore of an earlier backup)"
            ),
            HistoryChange::SlotMissing => write!(
                f,
                "the replication slot is gone (dropped, or a server that never had it)"
            ),
        }
    }
}

/// Decides whether `confirmed`, confirmed on `known`, may be carried over to the server `now` reached.
/// `None` means carry it over (the same history, or the first session of this process, which has nothing
/// to carry). A change means: forget `confirmed`, start from the slot's own position, and treat the slot
/// like a new one.
pub fn judge(
    known: Option<&ServerHistory>,
    confirmed: Lsn,
    now: &Reached,
) -> Option<HistoryChange> {
    let known = known?;
    if known.system_id != now.history.system_id {
        return Some(HistoryChange::OtherSystem {
            old: known.system_id.clone(),
            new: now.history.system_id.clone(),
        });
    }
    if known.timeline != now.history.timeline {
        return Some(HistoryChange::NewTimeline {
            old: known.timeline,
            new: now.history.timeline,
        });
    }
    if now.wal_end < confirmed {
        return Some(HistoryChange::WalBehind {
            wal_end: now.wal_end,
            confirmed,
        });
    }
    if now.slot_missing {
        return Some(HistoryChange::SlotMissing);
    }
    None
}

/// Where `timeline` ended in the history of a newer timeline (the content of its history file, as
/// `TIMELINE_HISTORY` returns it: one `parent_timeline<TAB>switch_point<TAB>reason` line per ancestor). WAL up
/// to that point is the same on both timelines; past it, the newer timeline holds other WAL at the same
/// positions. `None` when `timeline` is not an ancestor, or the file says nothing readable about it.
pub fn fork_point(history_file: &str, timeline: u32) -> Option<Lsn> {
    history_file
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            let parent: u32 = fields.next()?.parse().ok()?;
            let switch_point: Lsn = fields.next()?.parse().ok()?;
            (parent == timeline).then_some(switch_point)
        })
}

/// Whether a slot at `position`, last moved on timeline `old`, still means the WAL the slot decoded, on the
/// timeline whose history is `history_file`: only up to where `old` ended. Past that point (a standby
/// promoted at a recovery target, or from a restore, behind its synchronised copy of the slot), streaming
/// from the slot would skip the new timeline's transactions in between, and its decoding would start amid
/// WAL it never saw.
pub fn slot_fits_timeline(history_file: &str, old: u32, position: Lsn) -> Result<(), Lsn> {
    match fork_point(history_file, old) {
        Some(fork) if position <= fork => Ok(()),
        Some(fork) => Err(fork),
        None => Err(Lsn::ZERO),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(system_id: &str, timeline: u32) -> ServerHistory {
        ServerHistory {
            system_id: system_id.into(),
            timeline,
        }
    }

    fn reached(history: &ServerHistory, wal_end: u64, slot_missing: bool) -> Reached<'_> {
        Reached {
            history,
            wal_end: Lsn(wal_end),
            slot_missing,
        }
    }

    #[test]
    fn first_session_carries_nothing_over() {
        let now = history("7", 1);
        assert_eq!(judge(None, Lsn(0), &reached(&now, 100, true)), None);
    }

    #[test]
    fn same_history_keeps_the_position_even_when_the_slot_moved_back() {
        // PG 15 can move confirmed_flush_lsn back after a restart: that alone is no history change.
        let known = history("7", 1);
        assert_eq!(
            judge(Some(&known), Lsn(500), &reached(&known, 900, false)),
            None
        );
        assert_eq!(
            judge(Some(&known), Lsn(500), &reached(&known, 500, false)),
            None
        );
    }

    #[test]
    fn another_cluster_is_a_change_whatever_its_positions() {
        let known = history("7", 1);
        let other = history("8", 1);
        assert_eq!(
            judge(Some(&known), Lsn(500), &reached(&other, 900, false)),
            Some(HistoryChange::OtherSystem {
                old: "7".into(),
                new: "8".into()
            })
        );
    }

    #[test]
    fn a_promoted_standby_is_a_change_even_when_it_caught_up() {
        let known = history("7", 1);
        let promoted = history("7", 2);
        assert_eq!(
            judge(Some(&known), Lsn(500), &reached(&promoted, 900, false)),
            Some(HistoryChange::NewTimeline { old: 1, new: 2 })
        );
    }

    #[test]
    fn a_server_behind_the_confirmed_position_is_a_change() {
        let known = history("7", 1);
        assert_eq!(
            judge(Some(&known), Lsn(500), &reached(&known, 499, false)),
            Some(HistoryChange::WalBehind {
                wal_end: Lsn(499),
                confirmed: Lsn(500)
            })
        );
    }

    #[test]
    fn a_slot_that_must_be_created_again_is_a_change() {
        let known = history("7", 1);
        assert_eq!(
            judge(Some(&known), Lsn(500), &reached(&known, 900, true)),
            Some(HistoryChange::SlotMissing)
        );
    }

    #[test]
    fn messages_name_both_sides() {
        let change = HistoryChange::OtherSystem {
            old: "7".into(),
            new: "8".into(),
        };
        let text = change.to_string();
        assert!(text.contains('7') && text.contains('8'), "{text}");
        let text = HistoryChange::WalBehind {
            wal_end: Lsn(0x10),
            confirmed: Lsn(0x20),
        }
        .to_string();
        assert!(text.contains("0/10") && text.contains("0/20"), "{text}");
    }

    #[test]
    fn the_fork_point_is_where_the_old_timeline_ended() {
        let file =
            "1\t0/3000158\tno recovery target specified\n\n2\t0/5000000\tat restore point \"x\"\n";
        assert_eq!(fork_point(file, 1), Some(Lsn(0x3000158)));
        assert_eq!(fork_point(file, 2), Some(Lsn(0x5000000)));
        assert_eq!(fork_point(file, 3), None, "not an ancestor");
        assert_eq!(fork_point("# comment\nrubbish\n", 1), None);
    }

    #[test]
    fn a_slot_past_the_fork_does_not_fit_the_new_timeline() {
        let file = "1\t0/3000158\tno recovery target specified\n";
        assert_eq!(slot_fits_timeline(file, 1, Lsn(0x3000000)), Ok(()));
        assert_eq!(slot_fits_timeline(file, 1, Lsn(0x3000158)), Ok(()));
        assert_eq!(
            slot_fits_timeline(file, 1, Lsn(0x3000159)),
            Err(Lsn(0x3000158))
        );
        assert_eq!(
            slot_fits_timeline(file, 2, Lsn(1)),
            Err(Lsn::ZERO),
            "a timeline the history does not know proves nothing"
        );
    }
}
