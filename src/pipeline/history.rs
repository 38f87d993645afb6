//! Pure: whether a confirmed position may be carried over to the server a new replication session reached.
//!
//! An LSN means something only on the server history it was confirmed on: one system identifier and one
//! timeline (`IDENTIFY_SYSTEM`). A failover to a standby, a restore from a backup or another cluster behind
//! the same URL presents a different history, and START_REPLICATION at the old position would be honoured
//! there, silently skipping everything in between. This module decides when the old position must be
//! dropped, and whether a slot's own position fits the timeline a session reached (`TIMELINE_HISTORY`,
//! [`slot_on_timeline`]); `cdc` does the I/O (identify, slot, snapshot hand-off) and logs what it found. Owns
//! no I/O.

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

/// Where this timeline began (the last switch point in its history file); `None` for a file that names none.
pub fn timeline_start(history_file: &str) -> Option<Lsn> {
    history_file
        .lines()
        .filter_map(|line| line.split_whitespace().nth(1)?.parse::<Lsn>().ok())
        .max()
}

/// What a slot's position means on the timeline a session reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotOnTimeline {
    /// Within the WAL this timeline shares with the one the slot moved on: stream from it.
    Fits,
    /// Past where this timeline left the one the slot moved on (the fork, given): streaming from it would
    /// skip this timeline's transactions in between (a synchronised copy on a standby promoted at a recovery
    /// target, a restored copy of one), and its decoding would start amid WAL it never saw. Replace it.
    PastFork(Lsn),
    /// This timeline does not descend from the one the slot moved on (an older one: an old primary not
    /// fenced yet; a sibling of a split brain): wait for the server of the slot's history.
    OffHistory,
}

/// Judges a slot at `position` on the timeline whose history is `history_file`. `moved_on`: the timeline the
/// slot last moved on, when known (this process streamed there); `None` when it is not known but was never
/// this one (no outboxd session marked streaming on it), so the slot is valid only up to where this timeline
/// began.
pub fn slot_on_timeline(
    history_file: &str,
    moved_on: Option<u32>,
    position: Lsn,
) -> SlotOnTimeline {
    let fork = match moved_on {
        Some(old) => fork_point(history_file, old),
        None => timeline_start(history_file),
    };
    match fork {
        Some(fork) if position <= fork => SlotOnTimeline::Fits,
        Some(fork) => SlotOnTimeline::PastFork(fork),
        None => SlotOnTimeline::OffHistory,
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
        let file = "1\t0/3000158\tno recovery target specified\n2\t0/5000000\tat restore point\n";
        let judge = |moved_on, position| slot_on_timeline(file, moved_on, Lsn(position));
        assert_eq!(judge(Some(1), 0x3000000), SlotOnTimeline::Fits);
        assert_eq!(judge(Some(1), 0x3000158), SlotOnTimeline::Fits);
        assert_eq!(
            judge(Some(1), 0x3000159),
            SlotOnTimeline::PastFork(Lsn(0x3000158))
        );
        assert_eq!(judge(Some(2), 0x4000000), SlotOnTimeline::Fits);
        assert_eq!(
            judge(Some(4), 1),
            SlotOnTimeline::OffHistory,
            "a timeline the history does not name (a sibling) proves nothing"
        );
    }

    #[test]
    fn a_slot_never_moved_on_this_timeline_fits_only_up_to_its_start() {
        let file = "1\t0/3000158\tno recovery target specified\n2\t0/5000000\tat restore point\n";
        assert_eq!(timeline_start(file), Some(Lsn(0x5000000)));
        assert_eq!(
            slot_on_timeline(file, None, Lsn(0x5000000)),
            SlotOnTimeline::Fits
        );
        assert_eq!(
            slot_on_timeline(file, None, Lsn(0x5000001)),
            SlotOnTimeline::PastFork(Lsn(0x5000000))
        );
        assert_eq!(
            slot_on_timeline("", None, Lsn(1)),
            SlotOnTimeline::OffHistory
        );
    }
}
