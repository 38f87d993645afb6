//! Exactly-once progress: what a slot's last committed Kafka transaction covered, as its progress record
//! says (written in the same Kafka transaction as the events, so the two commit or abort together), and
//! whether a decoded event is covered by it (already in Kafka: never produced again).
//!
//! Pure: the record's key and value codec and the comparisons. Writing and reading records is the
//! transactional producer's (`kafka::transaction`); what a covered event means for its row is the CDC
//! session's.

use serde::{Deserialize, Serialize};

use crate::lsn::Lsn;

/// A transaction that committed this much later than the one the progress record names, yet lies below
/// it in the WAL, is not the one recorded but new WAL at old positions (a restore from a snapshot): not
/// covered. Concurrent commits can take their timestamps in a different order than their WAL positions by
/// far less than this.
const COMMIT_TIME_SLACK_MICROS: i64 = 1_000_000;

/// `--progress-topic` when it is not given.
pub const DEFAULT_PROGRESS_TOPIC: &str = "outboxd.progress";

/// Where in the stream an event was decoded: its transaction and its place among that transaction's
/// outbox rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPosition {
    /// The transaction's commit LSN (Begin's `final_lsn`).
    pub commit_lsn: Lsn,
    /// The transaction's commit time (µs since 2000-01-01, as pgoutput sends it).
    pub commit_micros: i64,
    /// The event's index among its transaction's outbox rows, from 0.
    pub index: u64,
}

/// The server history and slot a progress record belongs to: only a record of the same one is used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressKey {
    /// The cluster's system identifier.
    pub system_id: String,
    /// The replication slot.
    pub slot: String,
}

impl ProgressKey {
    /// The record key in the progress topic (compaction keeps the latest record per key).
    pub fn record_key(&self) -> String {
        format!("{}/{}", self.system_id, self.slot)
    }

    /// The producer's `transactional.id` for progress records written to `progress_topic`: stable per slot
    /// and progress topic, so that a new leader fences a paused old one, while a clone of the database
    /// (the same system identifier and slot name) given a progress topic of its own does not fence this
    /// one's producer, nor this one its.
    ///
    /// On the default topic it is `outboxd-<system id>-<slot>`, the id of earlier versions (a rolling
    /// upgrade still fences the previous leader); on another topic `outboxd-<system id>-<slot>-<topic>`.
    /// A slot name has no `-` and a system identifier is digits, so no two (slot, topic) pairs share an id.
    pub fn transactional_id(&self, progress_topic: &str) -> String {
        if progress_topic == DEFAULT_PROGRESS_TOPIC {
            format!("outboxd-{}-{}", self.system_id, self.slot)
        } else {
            format!("outboxd-{}-{}-{progress_topic}", self.system_id, self.slot)
        }
    }
}

/// What one committed Kafka transaction covered: every event of the stream up to and including a point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Format version of the record.
    pub version: u32,
    /// Whose progress it is.
    #[serde(flatten)]
    pub key: ProgressKey,
    /// The timeline the server was on (a new timeline is another history).
    pub timeline: u32,
    /// Commit LSN of the last transaction included (wholly or in part), as text (`X/Y`).
    pub commit_lsn: String,
    /// That transaction's commit time (µs since 2000-01-01).
    pub commit_micros: i64,
    /// How many of that transaction's outbox rows were included: all (`None`), or the first n (a
    /// transaction larger than the in-flight window is committed in parts).
    pub events_included: Option<u64>,
    /// The outbox tables streamed (`--table`, in order). A record covers only their rows: a table added
    /// since was not produced from. And rows are numbered among theirs, so a part (`events_included`)
    /// means the same rows only to an instance streaming the same tables.
    pub tables: Vec<String>,
    /// A replay to another topic (`outboxd replay --published --to-topic` under `--delivery exactly-once`):
    /// how far its committed Kafka transactions got, as the replay writes it (the positions are `0/0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_cursor: Option<String>,
}

/// Why a progress record read at start-up cannot be used (its events are then published again if their
/// rows say so: at least once across that change).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProgressUnusable {
    /// The record is not one outboxd can read.
    #[error("the progress record cannot be read ({0})")]
    Unreadable(String),
    /// Another timeline: a promoted standby or a point-in-time restore.
    #[error("the progress record is from timeline {recorded}, the server is on timeline {now}")]
    OtherTimeline {
        /// Timeline in the record.
        recorded: u32,
        /// Timeline now.
        now: u32,
    },
    /// The server's WAL ends before the recorded position: a restore of an earlier backup.
    #[error("the progress record names {recorded}, beyond the server's WAL end {wal_end}")]
    WalBehind {
        /// Position in the record.
        recorded: Lsn,
        /// The server's WAL end now.
        wal_end: Lsn,
    },
    /// The slot was created after the recorded position was streamed (dropped or lost in between): it
    /// starts at its own consistent point, and nothing below that can be covered twice.
    #[error("the slot was created at {created_at}, at or below the recorded {recorded}")]
    SlotRecreated {
        /// Position in the record.
        recorded: Lsn,
        /// Where the new slot starts.
        created_at: Lsn,
    },
}

impl Progress {
    /// The record for `key` covering everything up to `upto` (`events_included: None`: the whole of that
    /// transaction).
    pub fn new(
        key: ProgressKey,
        timeline: u32,
        commit_lsn: Lsn,
        commit_micros: i64,
        events_included: Option<u64>,
        tables: Vec<String>,
    ) -> Self {
        Progress {
            version: 1,
            key,
            timeline,
            commit_lsn: commit_lsn.to_string(),
            commit_micros,
            events_included,
            replay_cursor: None,
            tables,
        }
    }

    /// The record as an instance streaming `tables` may use it: a part of a transaction counted among
    /// other tables' rows names other rows, so none of that transaction counts as covered (it is
    /// published again: duplicates, never a row skipped).
    pub fn for_tables(mut self, tables: &[String]) -> Progress {
        if self.events_included.is_some() && self.tables != tables {
            self.events_included = Some(0);
        }
        self
    }

    /// The record's value (JSON).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record's value, checked to belong to `key`.
    pub fn decode(value: &[u8], key: &ProgressKey) -> Result<Progress, ProgressUnusable> {
        let progress: Progress = serde_json::from_slice(value)
            .map_err(|e| ProgressUnusable::Unreadable(e.to_string()))?;
        if progress.version != 1 {
            return Err(ProgressUnusable::Unreadable(format!(
                "version {} (this outboxd writes version 1)",
                progress.version
            )));
        }
        progress.position()?;
        if &progress.key != key {
            return Err(ProgressUnusable::Unreadable(format!(
                "it belongs to {}",
                progress.key.record_key()
            )));
        }
        Ok(progress)
    }

    fn position(&self) -> Result<Lsn, ProgressUnusable> {
        self.commit_lsn
            .parse()
            .map_err(|e: crate::lsn::ParseLsnError| ProgressUnusable::Unreadable(e.to_string()))
    }

    /// Whether this record may be trusted on the server a session reached: the same timeline, WAL that
    /// reaches the recorded position, and a slot that was not created after it (see
    /// [`ProgressUnusable`]). The key already names the system.
    pub fn usable_on(
        &self,
        timeline: u32,
        wal_end: Lsn,
        slot_created_at: Option<Lsn>,
    ) -> Result<(), ProgressUnusable> {
        let recorded = self.position()?;
        if timeline != self.timeline {
            return Err(ProgressUnusable::OtherTimeline {
                recorded: self.timeline,
                now: timeline,
            });
        }
        if wal_end < recorded {
            return Err(ProgressUnusable::WalBehind { recorded, wal_end });
        }
        if let Some(created_at) = slot_created_at.filter(|at| *at <= recorded) {
            return Err(ProgressUnusable::SlotRecreated {
                recorded,
                created_at,
            });
        }
        Ok(())
    }

    /// True when the event of `table` decoded at `position` is in Kafka already (committed with this
    /// record). A table the record does not name was not streamed then: none of its rows is covered.
    pub fn covers(&self, table: &str, position: &StreamPosition) -> bool {
        let Ok(recorded) = self.position() else {
            return false;
        };
        if !self.tables.iter().any(|t| t == table) {
            return false;
        }
        if position.commit_micros > self.commit_micros + COMMIT_TIME_SLACK_MICROS {
            return false;
        }
        match position.commit_lsn.cmp(&recorded) {
            std::cmp::Ordering::Less => true,
            std::cmp::Ordering::Equal => self.events_included.is_none_or(|n| position.index < n),
            std::cmp::Ordering::Greater => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: &str = "public.outbox_event";

    fn t() -> Vec<String> {
        vec![T.to_string()]
    }

    fn key() -> ProgressKey {
        ProgressKey {
            system_id: "7311".into(),
            slot: "outboxd".into(),
        }
    }

    fn at(lsn: u64, micros: i64, index: u64) -> StreamPosition {
        StreamPosition {
            commit_lsn: Lsn(lsn),
            commit_micros: micros,
            index,
        }
    }

    #[test]
    fn covers_everything_up_to_the_recorded_point() {
        let whole = Progress::new(key(), 1, Lsn(100), 5_000_000, None, t());
        assert!(whole.covers(T, &at(50, 4_000_000, 7)));
        assert!(whole.covers(T, &at(100, 5_000_000, 999)));
        assert!(!whole.covers(T, &at(101, 5_000_001, 0)));
        let part = Progress::new(key(), 1, Lsn(100), 5_000_000, Some(3), t());
        assert!(part.covers(T, &at(100, 5_000_000, 2)));
        assert!(
            !part.covers(T, &at(100, 5_000_000, 3)),
            "the 4th row was not included"
        );
        assert!(part.covers(T, &at(99, 4_000_000, 10_000)));
    }

    #[test]
    fn a_part_counted_among_other_tables_covers_none_of_its_transaction() {
        let part = Progress::new(key(), 1, Lsn(100), 5_000_000, Some(3), t());
        let same = part.clone().for_tables(&t());
        assert!(same.covers(T, &at(100, 5_000_000, 2)));
        let other = part.for_tables(&[T.to_string(), "public.orders_outbox".to_string()]);
        assert!(!other.covers(T, &at(100, 5_000_000, 0)));
        assert!(
            other.covers(T, &at(99, 4_000_000, 0)),
            "whole earlier transactions do not depend on numbering"
        );
        let whole =
            Progress::new(key(), 1, Lsn(100), 5_000_000, None, t()).for_tables(&["x".to_string()]);
        assert!(whole.covers(T, &at(100, 5_000_000, 7)));
    }

    #[test]
    fn rows_of_a_table_the_record_does_not_name_are_not_covered() {
        // Streamed since: its rows below the recorded position were never produced.
        let whole = Progress::new(key(), 1, Lsn(100), 5_000_000, None, t());
        assert!(whole.covers(T, &at(50, 4_000_000, 0)));
        assert!(!whole.covers("public.orders_outbox", &at(50, 4_000_000, 0)));
    }

    #[test]
    fn a_transaction_committed_much_later_below_the_point_is_new_wal() {
        let progress = Progress::new(key(), 1, Lsn(100), 5_000_000, None, t());
        assert!(!progress.covers(T, &at(50, 5_000_000 + COMMIT_TIME_SLACK_MICROS + 1, 0)));
        assert!(
            progress.covers(T, &at(50, 5_000_000 + 10, 0)),
            "concurrent commits may take their times slightly out of WAL order"
        );
    }

    #[test]
    fn the_transactional_id_is_the_same_for_every_instance_of_a_slot() {
        assert_eq!(
            key().transactional_id(DEFAULT_PROGRESS_TOPIC),
            "outboxd-7311-outboxd",
            "on the default progress topic: the id of earlier versions (a rolling upgrade fences the old leader)"
        );
        assert_eq!(key().record_key(), "7311/outboxd");
    }

    #[test]
    fn a_progress_topic_of_its_own_gives_a_transactional_id_of_its_own() {
        let on_own_topic = key().transactional_id("clone.progress");
        assert_eq!(on_own_topic, "outboxd-7311-outboxd-clone.progress");
        assert_ne!(on_own_topic, key().transactional_id(DEFAULT_PROGRESS_TOPIC));
        assert_ne!(on_own_topic, key().transactional_id("other-progress"));
        assert_ne!(
            key().transactional_id("outboxd.progress-x"),
            key().transactional_id(DEFAULT_PROGRESS_TOPIC)
        );
    }

    #[test]
    fn round_trips_and_refuses_another_key_or_version() {
        let progress = Progress::new(key(), 2, Lsn(0x1_0000_0010), 42, Some(5), t());
        let value = progress.encode();
        assert_eq!(Progress::decode(&value, &key()), Ok(progress.clone()));
        let other = ProgressKey {
            slot: "other".into(),
            ..key()
        };
        assert!(matches!(
            Progress::decode(&value, &other),
            Err(ProgressUnusable::Unreadable(_))
        ));
        let future = serde_json::to_vec(&Progress {
            version: 2,
            ..progress
        })
        .unwrap();
        assert!(Progress::decode(&future, &key()).is_err());
        assert!(Progress::decode(b"not json", &key()).is_err());
    }

    #[test]
    fn unusable_on_another_history() {
        let progress = Progress::new(key(), 1, Lsn(100), 0, None, t());
        assert_eq!(progress.usable_on(1, Lsn(200), None), Ok(()));
        assert_eq!(
            progress.usable_on(1, Lsn(200), Some(Lsn(150))),
            Ok(()),
            "a slot created after the record (this process made it anew at 150): everything it sends is past 100 anyway"
        );
        assert!(matches!(
            progress.usable_on(2, Lsn(200), None),
            Err(ProgressUnusable::OtherTimeline { .. })
        ));
        assert!(matches!(
            progress.usable_on(1, Lsn(99), None),
            Err(ProgressUnusable::WalBehind { .. })
        ));
        assert!(matches!(
            progress.usable_on(1, Lsn(200), Some(Lsn(80))),
            Err(ProgressUnusable::SlotRecreated { .. })
        ));
    }
}
