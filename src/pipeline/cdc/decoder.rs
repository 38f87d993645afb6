//! The transaction decoder: turns one session's pgoutput messages into outbox events tagged with their
//! transaction, and says which need their row's state looked up first (the replay region: committed before
//! this session connected; re-sent transactions: confirmed before on this history).
//!
//! Pure: no I/O. It keeps the relation mappings and the transaction being decoded, and opens and commits
//! transactions in the [`Watermark`]. It does not count events against the in-flight window, look rows up,
//! publish or hand off: the session does, with what [`TransactionDecoder::decode`] returns.

use std::collections::HashMap;

use uuid::Uuid;

use crate::error::{Error, Result};
use crate::event::{MappingError, OutboxEvent, RowImage, RowMapping};
use crate::lsn::Lsn;
use crate::pg::outbox::{
    AggregateKey, HandOffNotice, HandedOffNotice, HANDED_OFF_MESSAGE, HANDOFF_MESSAGE,
};
use crate::pg::pgoutput::{Begin, Insert, Message, PgOutputMessage};
use crate::pipeline::backfill::CdcTag;
use crate::pipeline::watermark::{TxnId, Watermark};
use crate::progress::StreamPosition;
use crate::table::OutboxTable;

/// An event decoded from the stream, with what the CDC path attaches to it.
pub struct Pending {
    pub tag: CdcTag,
    pub event: OutboxEvent,
    pub event_id: Uuid,
    /// Where the stream carried it (for exactly-once progress).
    pub position: StreamPosition,
    /// The row as inserted: written back as a handed-off row should the event go to the polling path after
    /// its own transaction deleted it.
    pub row: RowImage,
}

/// What the session does with a decoded message.
pub enum Decoded {
    /// A transaction began. `left_replay_region`: the rows buffered in the replay region can be looked up
    /// now. `diverged`: it is below the highest confirmed position yet committed after everything confirmed
    /// (new WAL at old positions: a restore from a snapshot?); reported once per session.
    Begin {
        final_lsn: Lsn,
        left_replay_region: bool,
        diverged: bool,
    },
    /// An outbox row. `look_up`: publish it only if its row is not marked as done (see the module doc).
    Event { pending: Pending, look_up: bool },
    /// A row of a table with polling columns whose required column is NULL: the polling path
    /// dead-letters it (the placeholder carries only its id).
    Invalid {
        pending: Pending,
        column: &'static str,
    },
    /// A relation of outbox table `table` has columns it lacked at start-up (`gained`): the stream sends it
    /// before the first row inserted since the change, whose rows must be marked (and may be handed off),
    /// which the statements prepared at start-up cannot do. (Or an older description the slot sends again,
    /// of columns dropped since: the session asks the catalog.)
    TableGained { table: usize, gained: &'static str },
    /// A row inserted already handed to the polling path (written back by outboxd), or one `outboxd replay`
    /// re-queued (its message): the polling path publishes it, and its aggregate's later events wait behind it.
    WaitsInPollingPath {
        table: usize,
        aggregate: AggregateKey,
        /// A replay holds the aggregate's rows (see `HandOffNotice::held`): its later events hand off.
        held: bool,
        /// The transaction that says so: until it has ended on the server, what it wrote may not be visible
        /// yet (a commit waiting for a synchronous standby is decoded before it is visible).
        xid: u32,
    },
    /// A transaction ending at `end_lsn` committed that handed `events` (table index, event id) to the polling
    /// path, as its messages said (see `earlier_hand_offs`).
    HandOffsCommitted {
        end_lsn: Lsn,
        events: Vec<(usize, Uuid)>,
    },
    /// Nothing to do (a commit, a relation, a row of another table or of a skipped re-sent transaction).
    Nothing,
}

/// Most event ids of one transaction's [`HANDED_OFF_MESSAGE`]s kept (more than a hand-off names at the
/// default window, about 2 MiB): any login may emit such messages, and one naming more only bounds memory. An id
/// left out only makes an event wait longer for its hand-off (see `earlier_hand_offs`).
const HANDED_OFF_IDS_PER_TRANSACTION: usize = 50_000;

/// What a relation of the stream is to outboxd.
enum Mapped {
    /// An outbox table (index into the settings' tables) and how its rows map.
    Outbox(usize, RowMapping),
    /// Another table: its rows are ignored, with one warning when the first arrives. (The server may also
    /// describe partitions of an outbox table whose rows come as the parent's: those never warn.)
    Other { name: String, warned: bool },
}

/// The transaction being decoded.
#[derive(Clone, Copy)]
struct Current {
    txn: TxnId,
    xid: u32,
    /// Commit time (from Begin), for commit-to-ack latency.
    commit_micros: i64,
    /// Re-sent (see `Watermark::is_resent`).
    resent: bool,
    /// Commit LSN (Begin's `final_lsn`).
    final_lsn: Lsn,
    /// Outbox rows decoded so far.
    events: u64,
}

/// How far the stream has been decoded, as exactly-once progress records it: the last transaction begun
/// (its commit LSN and time) and how many of its outbox rows were decoded, `None` once it committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodedUpto {
    pub commit_lsn: Lsn,
    pub commit_micros: i64,
    pub events_decoded: Option<u64>,
}

pub struct TransactionDecoder {
    tables: Vec<OutboxTable>,
    /// Per table: whether the polling path can take its rows (it has the polling columns).
    can_hand_off: Vec<bool>,
    /// Transactions committed before this session connected may have been published by an earlier run.
    replay_end: Lsn,
    mappings: HashMap<u32, Mapped>,
    current: Option<Current>,
    in_replay_region: bool,
    /// A diverged transaction was reported in this session.
    warned_divergence: bool,
    /// The last transaction that committed in this session's stream.
    last_committed: Option<DecodedUpto>,
    /// The events the current transaction's messages say it handed off (see [`HANDED_OFF_MESSAGE`]).
    handed_off_here: Vec<(usize, Uuid)>,
}

impl TransactionDecoder {
    /// `replay_end`: the server's WAL end when the session connected.
    pub fn new(tables: Vec<OutboxTable>, can_hand_off: Vec<bool>, replay_end: Lsn) -> Self {
        TransactionDecoder {
            tables,
            can_hand_off,
            replay_end,
            mappings: HashMap::new(),
            current: None,
            in_replay_region: false,
            warned_divergence: false,
            last_committed: None,
            handed_off_here: Vec::new(),
        }
    }

    /// How far the stream has been decoded (see [`DecodedUpto`]); `None` before the first transaction.
    pub fn decoded_upto(&self) -> Option<DecodedUpto> {
        match self.current {
            Some(current) => Some(DecodedUpto {
                commit_lsn: current.final_lsn,
                commit_micros: current.commit_micros,
                events_decoded: Some(current.events),
            }),
            None => self.last_committed,
        }
    }

    /// True between a Begin and its Commit.
    pub fn in_transaction(&self) -> bool {
        self.current.is_some()
    }

    pub fn decode(
        &mut self,
        message: PgOutputMessage,
        watermark: &mut Watermark,
    ) -> Result<Decoded> {
        match message {
            PgOutputMessage::Begin(begin) => Ok(self.begin(begin, watermark)),
            PgOutputMessage::Commit(commit) => {
                if let Some(current) = self.current.take() {
                    tracing::trace!(end_lsn = %commit.end_lsn, "transaction decoded");
                    watermark.commit_at(current.txn, commit.end_lsn, current.commit_micros);
                    self.last_committed = Some(DecodedUpto {
                        commit_lsn: current.final_lsn,
                        commit_micros: current.commit_micros,
                        events_decoded: None,
                    });
                }
                if self.handed_off_here.is_empty() {
                    return Ok(Decoded::Nothing);
                }
                Ok(Decoded::HandOffsCommitted {
                    end_lsn: commit.end_lsn,
                    events: std::mem::take(&mut self.handed_off_here),
                })
            }
            PgOutputMessage::Relation(relation) => {
                let table = self.tables.iter().position(|t| {
                    relation.namespace == t.name.schema && relation.name == t.name.name
                });
                let mut decoded = Decoded::Nothing;
                let mapping = match table {
                    Some(index) => {
                        if let Some(gained) = gained_columns(&self.tables[index], &relation) {
                            decoded = Decoded::TableGained {
                                table: index,
                                gained,
                            };
                        }
                        Mapped::Outbox(
                            index,
                            RowMapping::from_relation(&self.tables[index], &relation)?,
                        )
                    }
                    None => Mapped::Other {
                        name: format!("{}.{}", relation.namespace, relation.name),
                        warned: false,
                    },
                };
                self.mappings.insert(relation.id, mapping);
                Ok(decoded)
            }
            PgOutputMessage::Insert(insert) => self.insert(insert),
            PgOutputMessage::Message(message) => Ok(self.message(&message)),
            PgOutputMessage::Skipped(_) => Ok(Decoded::Nothing),
        }
    }

    fn begin(&mut self, begin: Begin, watermark: &mut Watermark) -> Decoded {
        self.handed_off_here.clear();
        let resent = watermark.is_resent(begin.final_lsn, begin.commit_time_micros);
        let mut diverged = false;
        let mut left_replay_region = false;
        if resent {
            tracing::debug!(final_lsn = %begin.final_lsn, "re-sent transaction: looking its rows up");
        } else {
            if watermark.is_below_confirmed(begin.final_lsn) && !self.warned_divergence {
                diverged = true;
                self.warned_divergence = true;
            }
            self.in_replay_region = begin.final_lsn < self.replay_end;
            left_replay_region = !self.in_replay_region;
        }
        self.current = Some(Current {
            txn: watermark.begin(),
            xid: begin.xid,
            commit_micros: begin.commit_time_micros,
            resent,
            final_lsn: begin.final_lsn,
            events: 0,
        });
        Decoded::Begin {
            final_lsn: begin.final_lsn,
            left_replay_region,
            diverged,
        }
    }

    /// `outboxd replay` re-queued a dead event (see [`HandOffNotice`]): in this transaction, at its place in
    /// WAL order, the event's aggregate waits in the polling path. Other messages are not outboxd's, and
    /// neither is a notice for a table without a polling path (replay re-queues nothing there; any login may
    /// emit a message with outboxd's prefix, and blocking such a table's aggregate would stop the stream).
    fn message(&mut self, message: &Message) -> Decoded {
        if !message.transactional || self.current.is_none() {
            return Decoded::Nothing;
        }
        if message.prefix == HANDED_OFF_MESSAGE {
            self.handed_off_events(message);
            return Decoded::Nothing;
        }
        if message.prefix != HANDOFF_MESSAGE {
            return Decoded::Nothing;
        }
        let Ok(notice) = serde_json::from_slice::<HandOffNotice>(&message.content) else {
            tracing::warn!(prefix = %message.prefix, "a logical decoding message outboxd cannot read; ignored");
            return Decoded::Nothing;
        };
        match self
            .tables
            .iter()
            .position(|t| t.name.to_string() == notice.table)
        {
            Some(table) if self.can_hand_off[table] => Decoded::WaitsInPollingPath {
                table,
                aggregate: (notice.aggregate_type, notice.aggregate_id),
                held: notice.held,
                xid: self.current.map_or(0, |current| current.xid),
            },
            _ => Decoded::Nothing,
        }
    }

    /// The CDC path handed events off in this transaction (see [`HANDED_OFF_MESSAGE`]): reported at its
    /// Commit. A table outboxd does not stream is not its concern.
    fn handed_off_events(&mut self, message: &Message) {
        let Ok(notice) = serde_json::from_slice::<HandedOffNotice>(&message.content) else {
            tracing::warn!(prefix = %message.prefix, "a logical decoding message outboxd cannot read; ignored");
            return;
        };
        if let Some(table) = self
            .tables
            .iter()
            .position(|t| t.name.to_string() == notice.table)
        {
            let room = HANDED_OFF_IDS_PER_TRANSACTION.saturating_sub(self.handed_off_here.len());
            self.handed_off_here.extend(
                notice
                    .event_ids
                    .into_iter()
                    .take(room)
                    .map(|id| (table, id)),
            );
        }
    }

    fn insert(&mut self, insert: Insert) -> Result<Decoded> {
        let (Some(current), Some(mapping)) = (
            self.current.as_mut(),
            self.mappings.get_mut(&insert.relation_id),
        ) else {
            return Err(Error::bug(format!(
                "the replication stream sent a row of relation {} outside a transaction or before its Relation message",
                insert.relation_id
            )));
        };
        let (table, mapping) = match mapping {
            Mapped::Outbox(table, mapping) => (*table, &*mapping),
            Mapped::Other { name, warned } => {
                if !*warned {
                    tracing::warn!(relation = %name, "publication includes a table that is not an outbox table (--table); its rows are ignored");
                    *warned = true;
                }
                return Ok(Decoded::Nothing);
            }
        };
        // Counted before anything is skipped, so that every session numbers a transaction's rows alike.
        let position = StreamPosition {
            commit_lsn: current.final_lsn,
            commit_micros: current.commit_micros,
            index: current.events,
        };
        current.events += 1;
        let current = *current;
        // Without published_at nothing tells a re-sent row from a new one: it was published before.
        if current.resent && !self.tables[table].marks_published {
            return Ok(Decoded::Nothing);
        }
        if mapping.inserted_handed_off(&insert) {
            return Ok(Decoded::WaitsInPollingPath {
                table,
                aggregate: mapping.aggregate_key(&insert),
                held: false,
                xid: current.xid,
            });
        }
        let tag = CdcTag {
            txn: current.txn,
            table,
            xid: current.xid,
            commit_micros: current.commit_micros,
            hand_off: false,
            resent: current.resent,
            produced: 0,
        };
        let event = match mapping.event(&insert) {
            Ok(event) => event,
            // A user's table with a nullable column: the polling path dead-letters the row, in place.
            Err(MappingError::NullValue {
                event_id, column, ..
            }) if self.can_hand_off[table] && event_id.parse::<Uuid>().is_ok() => {
                return Ok(Decoded::Invalid {
                    pending: Pending {
                        tag,
                        event: placeholder_event(&event_id),
                        event_id: event_id.parse().unwrap_or_default(),
                        position,
                        row: mapping.image(insert),
                    },
                    column,
                });
            }
            Err(error) => return Err(error.into()),
        };
        let event_id = event.event_id.parse::<Uuid>().map_err(|_| {
            Error::setup(
                format!("event_id {:?} is not a UUID", event.event_id),
                "make event_id a uuid column",
            )
        })?;
        Ok(Decoded::Event {
            look_up: self.in_replay_region || tag.resent,
            pending: Pending {
                tag,
                event,
                event_id,
                position,
                row: mapping.image(insert),
            },
        })
    }
}

/// What a relation of an outbox table has that the table lacked when outboxd inspected it at start-up:
/// `published_at`, or every polling column (`outboxd migrate --add-polling-columns` while outboxd runs).
fn gained_columns(
    table: &OutboxTable,
    relation: &crate::pg::pgoutput::Relation,
) -> Option<&'static str> {
    let has = |column: &str| relation.columns.iter().any(|c| c.name == column);
    if !table.polling && crate::table::POLLING_COLUMNS.iter().all(|c| has(c)) {
        Some("the polling columns")
    } else if !table.marks_published && has("published_at") {
        Some("published_at")
    } else {
        None
    }
}

/// Stands for an event handed off without its content (the polling path reads the row itself): only its id.
pub fn placeholder_event(event_id: &str) -> OutboxEvent {
    OutboxEvent {
        event_id: event_id.into(),
        aggregate_type: Default::default(),
        aggregate_id: Default::default(),
        event_type: Default::default(),
        payload: None,
        created_at: None,
        headers: Vec::new(),
        replay: None,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::pg::pgoutput::tests::text;
    use crate::pg::pgoutput::{self, ColumnValue, Commit};

    const OUTBOX: u32 = 16_384;
    const OTHER: u32 = 16_390;

    fn table(marks_published: bool, polling: bool) -> OutboxTable {
        let mut table = OutboxTable::standard_for_tests();
        table.marks_published = marks_published;
        table.polling = polling;
        table
    }

    fn decoder(table: OutboxTable, replay_end: u64) -> TransactionDecoder {
        let polling = table.polling;
        TransactionDecoder::new(vec![table], vec![polling], Lsn(replay_end))
    }

    fn relation(id: u32, name: &str) -> PgOutputMessage {
        let columns = [
            "event_id",
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
            "created_at",
        ];
        PgOutputMessage::Relation(pgoutput::tests::relation(id, name, &columns))
    }

    fn insert(relation_id: u32, id: Uuid, aggregate: Option<&str>) -> PgOutputMessage {
        PgOutputMessage::Insert(Insert {
            relation_id,
            values: vec![
                text(&id.to_string()),
                text("Order"),
                aggregate.map_or(ColumnValue::Null, text),
                text("Created"),
                text("{}"),
                ColumnValue::Null,
            ],
        })
    }

    fn begin(final_lsn: u64, commit_micros: i64, xid: u32) -> PgOutputMessage {
        PgOutputMessage::Begin(Begin {
            final_lsn: Lsn(final_lsn),
            commit_time_micros: commit_micros,
            xid,
        })
    }

    fn commit(end_lsn: u64, commit_micros: i64) -> PgOutputMessage {
        PgOutputMessage::Commit(Commit {
            commit_lsn: Lsn(end_lsn - 8),
            end_lsn: Lsn(end_lsn),
            commit_time_micros: commit_micros,
        })
    }

    fn event(decoded: Decoded) -> (Pending, bool) {
        match decoded {
            Decoded::Event { pending, look_up } => (pending, look_up),
            _ => panic!("not an event"),
        }
    }

    #[test]
    fn a_row_is_tagged_with_its_transaction_and_confirmable_once_finished() {
        let mut watermark = Watermark::new(Lsn(100));
        let mut decoder = decoder(table(true, true), 0);
        decoder
            .decode(relation(OUTBOX, "outbox_event"), &mut watermark)
            .unwrap();
        decoder
            .decode(begin(200, 5_000, 42), &mut watermark)
            .unwrap();
        let id = Uuid::new_v4();
        let (pending, look_up) = event(
            decoder
                .decode(insert(OUTBOX, id, Some("order-1")), &mut watermark)
                .unwrap(),
        );
        assert!(!look_up, "committed after the session connected");
        assert_eq!(pending.event_id, id);
        assert_eq!(&*pending.event.aggregate_id, "order-1");
        assert_eq!((pending.tag.xid, pending.tag.commit_micros), (42, 5_000));
        assert!(!pending.tag.resent);
        watermark.event_started(pending.tag.txn);
        decoder.decode(commit(216, 5_000), &mut watermark).unwrap();
        assert_eq!(
            watermark.advance(),
            Lsn(100),
            "the event is not acknowledged yet"
        );
        watermark.event_finished(pending.tag.txn);
        assert_eq!(watermark.advance(), Lsn(216));
    }

    #[test]
    fn rows_are_numbered_within_their_transaction_and_other_tables_do_not_count() {
        let mut watermark = Watermark::new(Lsn(100));
        let mut decoder = decoder(table(true, true), 0);
        assert_eq!(decoder.decoded_upto(), None);
        for message in [relation(OUTBOX, "outbox_event"), relation(OTHER, "orders")] {
            decoder.decode(message, &mut watermark).unwrap();
        }
        decoder
            .decode(begin(200, 5_000, 42), &mut watermark)
            .unwrap();
        let mut indexes = Vec::new();
        for relation_id in [OUTBOX, OTHER, OUTBOX, OUTBOX] {
            if let Decoded::Event { pending, .. } = decoder
                .decode(
                    insert(relation_id, Uuid::new_v4(), Some("a")),
                    &mut watermark,
                )
                .unwrap()
            {
                assert_eq!(pending.position.commit_lsn, Lsn(200));
                assert_eq!(pending.position.commit_micros, 5_000);
                indexes.push(pending.position.index);
            }
        }
        assert_eq!(indexes, [0, 1, 2]);
        assert!(decoder.in_transaction());
        assert_eq!(
            decoder.decoded_upto(),
            Some(DecodedUpto {
                commit_lsn: Lsn(200),
                commit_micros: 5_000,
                events_decoded: Some(3),
            })
        );
        decoder.decode(commit(216, 5_000), &mut watermark).unwrap();
        assert!(!decoder.in_transaction());
        assert_eq!(
            decoder.decoded_upto().map(|upto| upto.events_decoded),
            Some(None),
            "a committed transaction is included whole"
        );
        decoder
            .decode(begin(300, 6_000, 43), &mut watermark)
            .unwrap();
        let (pending, _) = event(
            decoder
                .decode(insert(OUTBOX, Uuid::new_v4(), Some("a")), &mut watermark)
                .unwrap(),
        );
        assert_eq!(pending.position.index, 0, "numbering starts again");
    }

    /// A hand-off notice (any login may emit one with outboxd's prefix) counts only for a table with a polling
    /// path: on a table without one, blocking its aggregate stopped outboxd (review follow-up, finding 2).
    #[test]
    fn a_hand_off_notice_counts_only_for_a_table_with_a_polling_path() {
        let notice = || {
            PgOutputMessage::Message(Message {
                transactional: true,
                prefix: HANDOFF_MESSAGE.into(),
                content: bytes::Bytes::from_static(
                    br#"{"table":"public.outbox_event","aggregate_type":"Order","aggregate_id":"a"}"#,
                ),
            })
        };
        for (polling, blocks) in [(true, true), (false, false)] {
            let mut watermark = Watermark::new(Lsn(100));
            let mut decoder = decoder(table(true, polling), 0);
            decoder
                .decode(begin(200, 5_000, 42), &mut watermark)
                .unwrap();
            let decoded = decoder.decode(notice(), &mut watermark).unwrap();
            assert_eq!(
                matches!(decoded, Decoded::WaitsInPollingPath { .. }),
                blocks,
                "polling path: {polling}"
            );
        }
    }

    /// The events a transaction's messages say it handed off are reported at its Commit, with its end; a
    /// message naming another table, and a transaction without such messages, report nothing.
    #[test]
    fn the_events_a_transaction_handed_off_are_reported_at_its_commit() {
        let (first, second) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let named = |table: &str, ids: &[Uuid]| {
            PgOutputMessage::Message(Message {
                transactional: true,
                prefix: HANDED_OFF_MESSAGE.into(),
                content: serde_json::to_vec(&HandedOffNotice {
                    table: table.into(),
                    event_ids: ids.to_vec(),
                })
                .unwrap()
                .into(),
            })
        };
        let mut watermark = Watermark::new(Lsn(100));
        let mut decoder = decoder(table(true, true), 0);
        decoder
            .decode(begin(200, 5_000, 42), &mut watermark)
            .unwrap();
        for message in [
            named("public.outbox_event", &[first]),
            named("public.other", &[Uuid::from_u128(3)]),
            named("public.outbox_event", &[second]),
        ] {
            assert!(matches!(
                decoder.decode(message, &mut watermark).unwrap(),
                Decoded::Nothing
            ));
        }
        let Decoded::HandOffsCommitted { end_lsn, events } =
            decoder.decode(commit(216, 5_000), &mut watermark).unwrap()
        else {
            panic!("the hand-offs are reported at the commit");
        };
        assert_eq!(end_lsn, Lsn(216));
        assert_eq!(events, [(0, first), (0, second)]);
        decoder
            .decode(begin(300, 6_000, 43), &mut watermark)
            .unwrap();
        assert!(matches!(
            decoder.decode(commit(316, 6_000), &mut watermark).unwrap(),
            Decoded::Nothing
        ));
    }

    #[test]
    fn rows_of_other_tables_are_ignored_and_a_row_without_its_relation_is_a_bug() {
        let mut watermark = Watermark::new(Lsn(100));
        let mut decoder = decoder(table(true, true), 0);
        decoder
            .decode(relation(OTHER, "orders"), &mut watermark)
            .unwrap();
        decoder
            .decode(begin(200, 5_000, 42), &mut watermark)
            .unwrap();
        let other = decoder
            .decode(insert(OTHER, Uuid::new_v4(), Some("x")), &mut watermark)
            .unwrap();
        assert!(matches!(other, Decoded::Nothing));
        let error = decoder
            .decode(insert(OUTBOX, Uuid::new_v4(), Some("x")), &mut watermark)
            .err()
            .expect("an error");
        assert!(error.to_string().contains("before its Relation"), "{error}");
    }

    #[test]
    fn the_replay_region_is_looked_up_until_a_later_transaction_begins() {
        let mut watermark = Watermark::new(Lsn(100));
        let mut decoder = decoder(table(true, true), 1_000);
        decoder
            .decode(relation(OUTBOX, "outbox_event"), &mut watermark)
            .unwrap();
        let Decoded::Begin {
            left_replay_region, ..
        } = decoder.decode(begin(500, 1, 1), &mut watermark).unwrap()
        else {
            panic!()
        };
        assert!(!left_replay_region);
        let (_, look_up) = event(
            decoder
                .decode(insert(OUTBOX, Uuid::new_v4(), Some("a")), &mut watermark)
                .unwrap(),
        );
        assert!(look_up, "committed before the session connected");
        decoder.decode(commit(516, 1), &mut watermark).unwrap();
        let Decoded::Begin {
            left_replay_region, ..
        } = decoder.decode(begin(1_200, 2, 2), &mut watermark).unwrap()
        else {
            panic!()
        };
        assert!(left_replay_region);
        let (_, look_up) = event(
            decoder
                .decode(insert(OUTBOX, Uuid::new_v4(), Some("a")), &mut watermark)
                .unwrap(),
        );
        assert!(!look_up);
    }

    /// A watermark that confirmed a transaction at 300 (commit time 10) and resumed at the slot's older 100.
    fn resumed_below_confirmed() -> Watermark {
        let mut watermark = Watermark::new(Lsn(100));
        let txn = watermark.begin();
        watermark.commit_at(txn, Lsn(300), 10);
        assert_eq!(watermark.advance(), Lsn(300));
        watermark.resume_at(Lsn(100));
        watermark
    }

    #[test]
    fn a_re_sent_transaction_is_looked_up_or_skipped_without_published_at() {
        let mut watermark = resumed_below_confirmed();
        let mut with_marks = decoder(table(true, true), 0);
        with_marks
            .decode(relation(OUTBOX, "outbox_event"), &mut watermark)
            .unwrap();
        with_marks
            .decode(begin(200, 10, 7), &mut watermark)
            .unwrap();
        let (pending, look_up) = event(
            with_marks
                .decode(insert(OUTBOX, Uuid::new_v4(), Some("a")), &mut watermark)
                .unwrap(),
        );
        assert!(look_up && pending.tag.resent);

        let mut watermark = resumed_below_confirmed();
        let mut cdc_only = decoder(table(false, false), 0);
        cdc_only
            .decode(relation(OUTBOX, "outbox_event"), &mut watermark)
            .unwrap();
        cdc_only.decode(begin(200, 10, 7), &mut watermark).unwrap();
        let skipped = cdc_only
            .decode(insert(OUTBOX, Uuid::new_v4(), Some("a")), &mut watermark)
            .unwrap();
        assert!(
            matches!(skipped, Decoded::Nothing),
            "published before, and nothing tells"
        );
    }

    #[test]
    fn a_later_commit_below_the_confirmed_position_is_new_and_reported_once() {
        let mut watermark = resumed_below_confirmed();
        let mut decoder = decoder(table(true, true), 0);
        decoder
            .decode(relation(OUTBOX, "outbox_event"), &mut watermark)
            .unwrap();
        for (lsn, expect_report) in [(200, true), (250, false)] {
            let Decoded::Begin { diverged, .. } =
                decoder.decode(begin(lsn, 11, 7), &mut watermark).unwrap()
            else {
                panic!()
            };
            assert_eq!(diverged, expect_report);
            let (pending, _) = event(
                decoder
                    .decode(insert(OUTBOX, Uuid::new_v4(), Some("a")), &mut watermark)
                    .unwrap(),
            );
            assert!(!pending.tag.resent, "committed after everything confirmed");
            decoder
                .decode(commit(lsn + 16, 11), &mut watermark)
                .unwrap();
        }
    }

    #[test]
    fn a_null_required_column_goes_to_the_polling_path_or_is_an_error_without_it() {
        let mut watermark = Watermark::new(Lsn(100));
        let mut polling = decoder(table(true, true), 0);
        polling
            .decode(relation(OUTBOX, "outbox_event"), &mut watermark)
            .unwrap();
        polling.decode(begin(200, 1, 1), &mut watermark).unwrap();
        let id = Uuid::new_v4();
        let Decoded::Invalid { pending, column } = polling
            .decode(insert(OUTBOX, id, None), &mut watermark)
            .unwrap()
        else {
            panic!("not handed off")
        };
        assert_eq!((pending.event_id, column), (id, "aggregate_id"));

        let mut cdc_only = decoder(table(false, false), 0);
        cdc_only
            .decode(relation(OUTBOX, "outbox_event"), &mut watermark)
            .unwrap();
        cdc_only.decode(begin(300, 1, 2), &mut watermark).unwrap();
        assert!(cdc_only
            .decode(insert(OUTBOX, Uuid::new_v4(), None), &mut watermark)
            .is_err());
    }

    proptest! {
        /// Transactions of 0–3 events decoded in stream order while acknowledgements arrive in any order:
        /// the confirmed position never passes a transaction with an unacknowledged event, and reaches the
        /// last commit once everything is acknowledged.
        #[test]
        fn nothing_unfinished_is_ever_confirmed(
            sizes in proptest::collection::vec(0usize..4, 1..12),
            ack_order in proptest::collection::vec(any::<prop::sample::Index>(), 0..48),
        ) {
            let mut watermark = Watermark::new(Lsn(100));
            let mut decoder = decoder(table(true, true), 0);
            decoder.decode(relation(OUTBOX, "outbox_event"), &mut watermark).unwrap();
            // (txn's end LSN, its unacknowledged events)
            let mut txns: Vec<(u64, usize)> = Vec::new();
            let mut in_flight: Vec<(usize, TxnId)> = Vec::new();
            let mut acks = ack_order.into_iter();
            let check = |watermark: &mut Watermark, txns: &[(u64, usize)]| {
                let confirmed = watermark.advance();
                if let Some(&(end, _)) = txns.iter().find(|(_, open)| *open > 0) {
                    prop_assert!(confirmed < Lsn(end), "confirmed {confirmed} past unfinished {end}");
                }
                Ok(())
            };
            for (n, &size) in sizes.iter().enumerate() {
                let lsn = 1_000 + n as u64 * 100;
                decoder.decode(begin(lsn, n as i64, n as u32), &mut watermark).unwrap();
                txns.push((lsn + 16, size));
                for _ in 0..size {
                    let (pending, _) = event(
                        decoder
                            .decode(insert(OUTBOX, Uuid::new_v4(), Some("a")), &mut watermark)
                            .unwrap(),
                    );
                    watermark.event_started(pending.tag.txn);
                    in_flight.push((n, pending.tag.txn));
                    // Maybe an acknowledgement of any event in flight arrives now.
                    if let Some(index) = acks.next() {
                        let (txn_index, txn) = in_flight.swap_remove(index.index(in_flight.len()));
                        watermark.event_finished(txn);
                        txns[txn_index].1 -= 1;
                    }
                    check(&mut watermark, &txns)?;
                }
                decoder.decode(commit(lsn + 16, n as i64), &mut watermark).unwrap();
                check(&mut watermark, &txns)?;
            }
            while let Some((txn_index, txn)) = in_flight.pop() {
                watermark.event_finished(txn);
                txns[txn_index].1 -= 1;
                check(&mut watermark, &txns)?;
            }
            prop_assert_eq!(watermark.advance(), Lsn(txns.last().unwrap().0));
        }
    }
}
