//! One replication session's stream loop: reads the stream while the in-flight window has room, decodes
//! (see `decoder`), asks the gate (see `gate`) whether each event goes to the producer, waits or goes to the
//! polling path, carries delivery reports and written hand-offs back into the watermark, and confirms what
//! it allows. A delivery that fails after the producer accepted it ends the session once every report is
//! in (the next one re-sends from the slot, handing what the broker refused for good to the polling path,
//! see `owed`).
//!
//! It owns no connection set-up (see `bootstrap`) and no reconnecting (see the module above).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use uuid::Uuid;

use super::bootstrap::Bootstrapped;
use super::decoder::{Decoded, Pending, TransactionDecoder};
use super::earlier_hand_offs::{EarlierHandOffs, RowKey};
use super::gate::{Admission, AggregateGate, GateKey};
use super::window::InFlightWindow;
use super::{SessionMemory, MAX_TRACKED_BLOCKED};
use crate::config::{ExactlyOnceSettings, RunSettings};
use crate::error::{replication_error, Error, Result};
use crate::event::{OutboxEvent, Text};
use crate::lsn::Lsn;
use crate::pg::outbox::{self, AggregateKey, OutboxSql, RowState};
use crate::pg::replication::{protocol, ReplicationStream, ServerMessage};
use crate::pg::{self, pgoutput};
use crate::pipeline::backfill::{CdcTag, Finished, ToBackfill};
use crate::pipeline::watermark::{TxnId, Watermark};
use crate::progress::{Progress, ProgressKey};
use crate::sink::{Delivery, PublishError, Rejection, Sink};
use crate::table::OutboxTable;

/// Rows of re-sent transactions are checked against `published_at` in batches of this size.
const REPLAY_BATCH: usize = 1_000;
/// How often, while a hold keeps confirmations back, the standbys' flush positions are asked for.
const STANDBY_CHECK: Duration = Duration::from_millis(200);
/// Least time between two status updates sent because the watermark moved.
const MIN_CONFIRM_GAP: Duration = Duration::from_millis(100);
/// How often, at most, a session with blocked aggregates asks whether the polling path has drained them.
const UNBLOCK_CHECK: Duration = Duration::from_millis(100);
/// The check waits at least this many times its own last duration, so that asking costs the database at
/// most ~5% of one backend however many aggregates are blocked.
const UNBLOCK_CHECK_COST_FACTOR: u32 = 20;

/// Why an event went to the polling path instead of the producer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HandOffReason {
    /// Its aggregate has earlier events in the polling path.
    Blocked,
    /// The producer refused it for good (e.g. too large): the polling path retries and dead-letters it.
    Refused,
    /// The broker refuses its topic outright (not authorised; see
    /// [`TopicHolds`](crate::pipeline::topic_holds::TopicHolds)): the polling path retries it.
    TopicRefused,
    /// A required column is NULL: the polling path dead-letters it.
    Invalid,
}

/// The aggregate an event belongs to, as the polling path names it.
fn aggregate_of(event: &OutboxEvent) -> AggregateKey {
    (
        event
            .aggregate_type
            .as_deref()
            .unwrap_or_default()
            .to_string(),
        event.aggregate_id.to_string(),
    )
}

/// An event handed to the producer and not reported yet: when, and of which aggregate (cheap clones of the
/// event's text, turned into a [`GateKey`] only when a refusal needs it). Any topic: the gate holds an
/// aggregate back in all of them.
struct Outstanding {
    since: tokio::time::Instant,
    table: usize,
    aggregate_type: Option<Text>,
    aggregate_id: Text,
}

impl Outstanding {
    /// Of the aggregate of `event` in `table`.
    fn of(&self, table: usize, event: &OutboxEvent) -> bool {
        self.table == table
            && self.aggregate_id == event.aggregate_id
            && self.aggregate_type == event.aggregate_type
    }

    /// Of `aggregate`.
    fn of_aggregate(&self, aggregate: &GateKey) -> bool {
        self.table == aggregate.0
            && *self.aggregate_id == *aggregate.1 .1
            && self.aggregate_type.as_deref().unwrap_or_default() == aggregate.1 .0
    }

    fn aggregate(&self) -> GateKey {
        (
            self.table,
            (
                self.aggregate_type
                    .as_deref()
                    .unwrap_or_default()
                    .to_string(),
                self.aggregate_id.to_string(),
            ),
        )
    }
}

/// `--delivery exactly-once`: the Kafka transaction being filled, and what the last one committed before
/// this session covered.
pub(super) struct ExactlyOnce {
    key: ProgressKey,
    timeline: u32,
    /// The tables streamed, as progress records name them.
    tables: Vec<String>,
    /// What the last Kafka transaction committed before this session covered: those events are in Kafka
    /// already, and are marked published without being produced again.
    committed_before: Option<Progress>,
    /// `--transaction-interval`.
    interval: Duration,
    /// A Kafka transaction open this long commits even in the middle of a PostgreSQL transaction: a
    /// third of `transaction.timeout.ms`, after which the broker would abort it (a transaction that
    /// takes minutes to stream would otherwise never get through).
    max_open: Duration,
    /// When the open Kafka transaction took its first event; `None` while it holds none.
    open_since: Option<tokio::time::Instant>,
    /// Events produced into the open Kafka transaction.
    open_events: usize,
    /// A transaction holding this many events commits at the next transaction boundary, before
    /// `interval`: a quarter of the in-flight window, so that one transaction's marks are written while the
    /// next fills (a full window would wait for both).
    batch: usize,
    /// A commit is due but waits for this session's hand-offs to be written (reading pauses meanwhile):
    /// the progress record must not cover an event still on its way to the polling path.
    waiting_for_hand_offs: bool,
}

impl ExactlyOnce {
    pub(super) fn new(
        key: ProgressKey,
        timeline: u32,
        tables: Vec<String>,
        committed_before: Option<Progress>,
        settings: &ExactlyOnceSettings,
        transaction_timeout: Duration,
        max_in_flight_events: usize,
    ) -> Self {
        ExactlyOnce {
            key,
            timeline,
            tables,
            committed_before,
            interval: settings.transaction_interval,
            max_open: transaction_timeout / 3,
            open_since: None,
            open_events: 0,
            batch: (max_in_flight_events / 4).max(1),
            waiting_for_hand_offs: false,
        }
    }
}

/// What the server was last told, and when.
struct StatusUpdates {
    last_sent: Lsn,
    last_sent_at: Instant,
}

impl StatusUpdates {
    /// When the next confirmation may go out: [`MIN_CONFIRM_GAP`] after the last status update.
    fn gap_ends_at(&self) -> Instant {
        self.last_sent_at + MIN_CONFIRM_GAP
    }

    /// When a confirmation of `confirmed` that the gap held back is due: once the gap has passed, not at the
    /// next status tick (up to `--status-interval` later, at the end of a burst). The loop then sends a status
    /// update whatever the gap says, so a due time in the past cannot keep waking it.
    fn held_back_until(&self, confirmed: Lsn) -> Option<tokio::time::Instant> {
        (confirmed > self.last_sent).then(|| tokio::time::Instant::from_std(self.gap_ends_at()))
    }
}

/// How long a session confirmed past `SessionMemory::failover_after` waits for the aggregates waiting in the
/// polling path to drain before it ends anyway to make the slot a failover slot.
const FAILOVER_RESTART_PATIENCE: Duration = Duration::from_secs(300);

/// Per-session state of the stream loop, publishing into `S`.
pub(super) struct Session<'a, S> {
    settings: &'a RunSettings,
    watermark: &'a mut Watermark,
    sql: tokio_postgres::Client,
    /// Statements per outbox table, in `settings.database.tables` order.
    outbox_sql: Vec<OutboxSql>,
    publisher: S,
    decoder: TransactionDecoder,
    /// Rows of the replay region and of re-sent transactions, waiting for their rows' states.
    replay_buffer: Vec<Pending>,
    /// Events met again whose rows were handed off before: nothing between them and their hand-off is
    /// confirmed (see [`earlier_hand_offs`](super::earlier_hand_offs)).
    earlier_hand_offs: EarlierHandOffs,
    window: InFlightWindow,
    published: u64,
    skipped_already_published: u64,
    /// Events handed to the polling path travel to the backfill task on the delivery channel.
    to_backfill: ToBackfill,
    /// Aggregates with rows waiting in the polling path (their later events are never published ahead), and
    /// tables with more of them than [`MAX_TRACKED_BLOCKED`] (every event of them is handed off).
    gate: AggregateGate<Pending>,
    /// Reading pauses until hand-offs in flight are written, so that a held table's check can run (under
    /// steady load some hand-off of it is almost always in flight).
    pausing_for_check: bool,
    /// A table outgrew [`MAX_TRACKED_BLOCKED`]: reading stops, and the session restarts once its hand-offs
    /// are written.
    restart_after_hand_offs: bool,
    /// The slot is confirmed past `SessionMemory::failover_after`: reading stops, and the session ends once
    /// nothing is in flight, for the next one to make the slot a failover slot.
    restart_for_failover: bool,
    /// Since when the slot has been confirmed past `SessionMemory::failover_after` while aggregates waited
    /// in the polling path (see [`FAILOVER_RESTART_PATIENCE`]).
    failover_due_since: Option<tokio::time::Instant>,
    hand_offs_in_flight: usize,
    handed_off: u64,
    /// Topics held and refused events owed to the polling path, kept across sessions.
    memory: &'a mut SessionMemory,
    /// Events handed to the producer whose delivery report has not arrived, by their `CdcTag::produced`.
    outstanding: BTreeMap<u64, Outstanding>,
    next_produced: u64,
    /// How long an event may wait for its delivery report (from the producer, then its `published_at`
    /// write) before the session gives its deliveries up.
    delivery_timeout: Duration,
    /// A delivery failed after the producer accepted it: the producer was purged, nothing more is read or
    /// produced, and the session ends (re-sending from the slot) once every report is in and the refused
    /// events are handed off, or at the latest one delivery timeout later. Holds the first failure and when.
    failing: Option<(String, tokio::time::Instant)>,
    /// An event was refused for good where nothing can retry it (a table without polling columns): the
    /// session ends with a definite error, as when the producer refuses one at hand-over.
    refused_without_polling: Option<String>,
    /// Events this session owed to the polling path: it ends to hand them over (a restart without backoff).
    owed_here: usize,
    /// `--delivery exactly-once`; `None`: at least once.
    exactly_once: Option<ExactlyOnce>,
    /// The last transaction found ended on the server: its further hand-off notices are checked at once.
    ended_xid: Option<u32>,
    /// Aggregates blocked by a hand-off notice (or handed-off insert) whose transaction had not ended when
    /// it was decoded (a commit waiting for a synchronous standby): what it wrote was not visible yet, so
    /// they stay blocked until it ended, then as any other (see `unblock_drained_aggregates`).
    awaiting_visibility: Vec<(u32, GateKey)>,
}

impl<'a, S: Sink<CdcTag>> Session<'a, S> {
    pub(super) fn new(
        settings: &'a RunSettings,
        watermark: &'a mut Watermark,
        memory: &'a mut SessionMemory,
        boot: Bootstrapped,
        publisher: S,
        to_backfill: ToBackfill,
        exactly_once: Option<ExactlyOnce>,
    ) -> Self {
        let tables = &settings.database.tables;
        let decoder = TransactionDecoder::new(
            tables.clone(),
            boot.outbox_sql
                .iter()
                .map(OutboxSql::can_hand_off)
                .collect(),
            boot.replay_end,
        );
        Session {
            settings,
            watermark,
            sql: boot.sql,
            outbox_sql: boot.outbox_sql,
            publisher,
            decoder,
            replay_buffer: Vec::new(),
            earlier_hand_offs: EarlierHandOffs::default(),
            window: InFlightWindow::new(
                settings.cdc.max_in_flight_events,
                settings.cdc.max_in_flight_bytes,
            ),
            published: 0,
            skipped_already_published: 0,
            to_backfill,
            gate: boot.gate,
            pausing_for_check: false,
            restart_after_hand_offs: false,
            restart_for_failover: false,
            failover_due_since: None,
            hand_offs_in_flight: 0,
            handed_off: 0,
            memory,
            outstanding: BTreeMap::new(),
            next_produced: 1,
            delivery_timeout: crate::kafka::delivery_timeout(
                settings,
                crate::kafka::DEFAULT_DELIVERY_TIMEOUT,
            ),
            failing: None,
            refused_without_polling: None,
            owed_here: 0,
            exactly_once,
            ended_xid: None,
            awaiting_visibility: Vec::new(),
        }
    }

    /// Logs what the session did and drops what its producer still holds (the slot was not confirmed past
    /// it).
    pub(super) fn end(self) {
        tracing::info!(
            published = self.published,
            skipped_already_published = self.skipped_already_published,
            handed_off = self.handed_off,
            confirmed = %self.watermark.confirmed(),
            "replication session ended"
        );
        self.publisher.abandon();
    }
}

impl<S: Sink<CdcTag>> Session<'_, S> {
    pub(super) async fn stream(
        &mut self,
        stream: &mut ReplicationStream,
        finished_rx: &mut mpsc::UnboundedReceiver<Finished>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<()> {
        let mut status_timer = tokio::time::interval(self.settings.cdc.status_interval);
        status_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut status = StatusUpdates {
            last_sent: self.watermark.confirmed(),
            last_sent_at: Instant::now(),
        };
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        let mut next_unblock_check = tokio::time::Instant::now() + UNBLOCK_CHECK;
        let mut next_standby_check = tokio::time::Instant::now();
        stream.send_status(status.last_sent).await?;
        loop {
            let window_open = self.window_open();
            crate::metrics::in_flight(self.window.events());
            let mut reply_now = false;
            tokio::select! {
                biased;
                _ = crate::pipeline::stopped(shutdown), if drain_deadline.is_none() => {
                    tracing::info!(in_flight = self.window.events(), "shutting down: draining in-flight events");
                    // With exactly-once they are handed on before the last commit instead: its progress
                    // record covers everything decoded.
                    if self.exactly_once.is_none() {
                        self.drop_held_events();
                    }
                    drain_deadline = Some(tokio::time::Instant::now() + self.settings.shutdown_timeout);
                }
                finished = finished_rx.recv() => self.finished(finished).await?,
                message = stream.next_message(), if window_open && drain_deadline.is_none() && !self.pausing_for_check && !self.restart_after_hand_offs && !self.restart_for_failover && self.failing.is_none() && !self.commit_waits_for_hand_offs() => {
                    reply_now = self.handle(message.map_err(replication_error)?).await?;
                }
                _ = status_timer.tick() => reply_now = true,
                _ = sleep_until_opt(status.held_back_until(self.watermark.confirmed())) => reply_now = true,
                _ = sleep_until_opt(self.oldest_outstanding().map(|at| at + self.delivery_timeout)), if self.failing.is_none() => {
                    let timeout = self.delivery_timeout;
                    self.give_up(format!("an event waited {timeout:?} (message.timeout.ms) for its delivery report; {} are outstanding", self.outstanding.len()));
                }
                _ = sleep_until_opt(self.commit_due_at()) => {}
                _ = tokio::time::sleep_until(next_unblock_check), if self.gate.has_blocked() && drain_deadline.is_none() && self.failing.is_none() => {
                    let started = tokio::time::Instant::now();
                    self.unblock_drained_aggregates().await?;
                    next_unblock_check = tokio::time::Instant::now() + UNBLOCK_CHECK.max(started.elapsed() * UNBLOCK_CHECK_COST_FACTOR);
                }
                _ = tokio::time::sleep_until(next_standby_check), if self.watermark.holding() => {
                    self.end_holds_the_standbys_flushed().await?;
                    next_standby_check = tokio::time::Instant::now() + STANDBY_CHECK;
                }
                _ = sleep_until_opt(drain_deadline) => {
                    tracing::warn!(in_flight = self.window.events(), "shutdown timeout reached; unacknowledged events will be re-sent on the next start");
                    break;
                }
            }
            self.end_if_given_up(stream).await?;
            if self.pausing_for_check && self.hand_offs_in_flight == 0 {
                next_unblock_check = tokio::time::Instant::now();
            }
            self.unclog_window().await?;
            self.commit_if_due(drain_deadline.is_some()).await?;
            self.confirm(stream, &mut status, reply_now).await?;
            if drain_deadline.is_some() && self.window.events() == 0 {
                break;
            }
        }
        stream.send_status(self.watermark.advance()).await?;
        self.watermark.reported();
        Ok(())
    }

    /// A report from the backfill task: events finished (acknowledged and marked, or handed off and
    /// marked), hand-offs written, deliveries that failed after hand-over, or its own failure.
    async fn finished(&mut self, finished: Option<Finished>) -> Result<()> {
        match finished {
            Some(Finished::Events {
                events,
                hand_offs_end,
            }) => {
                // Nothing between these events and the end of their hand-off is confirmed: a standby's copy
                // of a failover slot would follow to a position its standby flushed without the hand-off.
                if let Some(end) = hand_offs_end {
                    self.watermark.hold_until(end);
                    tracing::debug!(%end, "hand-offs written: confirming nothing before the stream passes their end");
                }
                let now = protocol::pg_timestamp_micros(std::time::SystemTime::now());
                let mut published = 0;
                for (tag, bytes) in events {
                    if tag.hand_off {
                        self.hand_offs_in_flight = self.hand_offs_in_flight.saturating_sub(1);
                    } else if tag.produced == 0 {
                        // In Kafka before this session (see `mark_covered`): marked, not produced.
                        self.skipped_already_published += 1;
                    } else {
                        self.delivery_reported(tag.produced);
                        published += 1;
                        crate::metrics::commit_to_ack(
                            (now - tag.commit_micros).max(0) as f64 / 1e6,
                        );
                    }
                    self.finish_event(tag.txn, bytes);
                }
                crate::metrics::published("cdc", published);
                Ok(())
            }
            Some(Finished::Undelivered(deliveries)) => self.undelivered(deliveries),
            Some(Finished::Failed(error)) => {
                crate::metrics::publish_error(match error {
                    Error::Kafka { .. } => "delivery",
                    _ => "database",
                });
                Err(error)
            }
            None => Err(Error::Kafka {
                message: "the backfill task stopped".into(),
                transient: true,
            }),
        }
    }

    /// Ends the session once its deliveries were given up and every report is in (or one delivery timeout
    /// later), confirming first what was acknowledged before; or once a table outgrew the blocked
    /// aggregates tracked and its hand-offs are written.
    async fn end_if_given_up(&mut self, stream: &mut ReplicationStream) -> Result<()> {
        if let Some((failure, since)) = &self.failing {
            let reported = self.outstanding.is_empty() && self.hand_offs_in_flight == 0;
            if reported || since.elapsed() > self.delivery_timeout {
                let confirmed = self.watermark.advance();
                stream.send_status(confirmed).await?;
                self.watermark.reported();
                if let Some(refused) = self.refused_without_polling.take() {
                    return Err(Error::Kafka {
                        message: refused,
                        transient: false,
                    });
                }
                let message = format!("{failure}; re-sending what was not acknowledged");
                // A refusal is no outage: the next session starts at once and hands the refused on.
                return Err(match self.owed_here {
                    0 => Error::Kafka {
                        message,
                        transient: true,
                    },
                    _ => Error::SessionRestart(message),
                });
            }
        }
        if self.restart_after_hand_offs && self.hand_offs_in_flight == 0 {
            return Err(Error::SessionRestart(format!(
                "more than {MAX_TRACKED_BLOCKED} aggregates of one table wait in the polling path"
            )));
        }
        // Parked events were never produced: the slot sends them again.
        if self.restart_for_failover
            && self.window.events() == self.gate.parked_len()
            && self.hand_offs_in_flight == 0
        {
            let confirmed = self.watermark.advance();
            stream.send_status(confirmed).await?;
            self.watermark.reported();
            return Err(Error::SessionRestart(format!(
                "the replication slot is confirmed at {confirmed}, past the hand-offs written before: reconnecting to make it a failover slot"
            )));
        }
        Ok(())
    }

    /// What can fill the window without finishing by itself is moved on: buffered replayed rows are looked
    /// up, and parked events are handed to the polling path once nothing else is in flight (acknowledged
    /// events behind them cannot be confirmed until they finish).
    async fn unclog_window(&mut self) -> Result<()> {
        if !self.replay_buffer.is_empty()
            && self.failing.is_none()
            && (self.replay_buffer.len() >= REPLAY_BATCH
                || !self.window_open()
                || self.restart_for_failover)
        {
            self.flush_replay_buffer().await?;
        }
        if self.gate.parked_len() > 0
            && self.failing.is_none()
            && !self.window_open()
            && self.window.events() <= self.gate.parked_len()
        {
            self.hand_off_every_parked()?;
        }
        Ok(())
    }

    /// Sends a status update when the server asked for one (or the timer fired), or when the watermark
    /// moved: at most every [`MIN_CONFIRM_GAP`], at once when the window is full (a window full of
    /// acknowledged events opens only once the server is told).
    async fn confirm(
        &mut self,
        stream: &mut ReplicationStream,
        status: &mut StatusUpdates,
        reply_now: bool,
    ) -> Result<()> {
        let confirmed = self.watermark.advance();
        if self
            .memory
            .failover_after
            .is_some_and(|after| confirmed >= after)
        {
            // The next session hands the events it is sent again of aggregates waiting in the polling path to
            // that path (their order there is by position): ending while none waits spares those hand-offs,
            // and ending anyway after a while keeps an aggregate that waits for good (behind a dead letter)
            // from keeping the slot a plain one.
            let due_since = *self
                .failover_due_since
                .get_or_insert_with(tokio::time::Instant::now);
            if !self.gate.has_blocked() || due_since.elapsed() >= FAILOVER_RESTART_PATIENCE {
                self.restart_for_failover = true;
            }
        }
        let tell_now = Instant::now() >= status.gap_ends_at() || !self.window_open();
        if reply_now || (confirmed > status.last_sent && tell_now) {
            stream.send_status(confirmed).await?;
            self.watermark.reported();
            if confirmed > status.last_sent {
                tracing::debug!(%confirmed, "confirmed");
            }
            status.last_sent = confirmed;
            status.last_sent_at = Instant::now();
        }
        Ok(())
    }

    /// Handles one server message; returns true when the server wants a status update now.
    async fn handle(&mut self, message: ServerMessage) -> Result<bool> {
        match message {
            ServerMessage::Keepalive {
                wal_end,
                reply_requested,
            } => {
                self.flush_replay_buffer().await?;
                let ended = self.earlier_hand_offs.passed(wal_end);
                self.hold_for_earlier_hand_offs(ended);
                self.watermark.keepalive(wal_end);
                Ok(reply_requested)
            }
            ServerMessage::XLogData { data, .. } => {
                self.handle_pgoutput(data).await?;
                Ok(false)
            }
        }
    }

    async fn handle_pgoutput(&mut self, data: Bytes) -> Result<()> {
        match self
            .decoder
            .decode(pgoutput::decode(data)?, self.watermark)?
        {
            Decoded::Begin {
                final_lsn,
                left_replay_region,
                diverged,
            } => {
                if diverged {
                    tracing::warn!(%final_lsn, highest_confirmed = %self.watermark.highest_confirmed(), "the server sends a transaction below the confirmed position that committed after it: its WAL diverged from what was confirmed (a restore from a snapshot?); publishing what it holds");
                    crate::metrics::history_changed();
                }
                let ended = self.earlier_hand_offs.passed(final_lsn);
                self.hold_for_earlier_hand_offs(ended);
                if left_replay_region {
                    self.flush_replay_buffer().await?;
                    // Whatever was sent again has passed: events owed to the polling path that did not come
                    // with it never will (the slot was recreated, or the server's history changed).
                    for event_id in self.memory.owed.forget_unmet() {
                        tracing::warn!(%event_id, "an event the broker refused was not sent again by the slot (recreated, or another server history): it is not handed to the polling path");
                    }
                }
            }
            Decoded::Event { pending, look_up } => {
                self.start_event(pending.tag.txn, pending.event.size_bytes());
                // Re-sent and replayed rows are checked first (see `flush_replay_buffer`), and so are rows
                // an earlier Kafka transaction covered.
                if look_up || self.covered_before(&pending) {
                    self.replay_buffer.push(pending);
                } else {
                    self.publish(pending).await?;
                }
            }
            Decoded::Invalid { pending, column } => {
                tracing::warn!(event_id = %pending.event_id, column, "row has a NULL required column; handing it to the polling path to dead-letter");
                self.start_event(pending.tag.txn, pending.event.size_bytes());
                self.hand_off(pending, HandOffReason::Invalid)?;
            }
            Decoded::TableGained { table, gained } => {
                let outbox_table = &self.settings.database.tables[table];
                let now = crate::pg::slot::inspect(&self.sql, outbox_table.spec()).await?;
                if (now.polling && !outbox_table.polling)
                    || (now.marks_published && !outbox_table.marks_published)
                {
                    return Err(Error::TablesChanged(format!(
                        "{} gained {gained} while outboxd streamed it (outboxd migrate --add-polling-columns): starting the pipeline over to use them",
                        outbox_table.name
                    )));
                }
                tracing::debug!(table = %outbox_table.name, gained, "the stream describes columns the table no longer has (sent again from before they were dropped)");
            }
            Decoded::WaitsInPollingPath {
                table,
                aggregate,
                held,
                xid,
            } => {
                // Re-queued by `outboxd replay` (its UPDATE committed with the notice): later events of its
                // aggregate must not overtake it. Any login may emit a notice, so it counts only while the
                // aggregate has rows waiting in the polling path; one sent again after they drained, or a
                // forged one, would otherwise restart the session or route the aggregate through polling.
                // A commit is decoded once it is on disk, which can be before others see it (a synchronous
                // standby it waits for): then the aggregate is blocked until the transaction ended, without
                // waiting here (the stream's replies, shutdown and reports go on).
                let outbox_table = &self.settings.database.tables[table];
                let running = self.ended_xid != Some(xid)
                    && outbox::transaction_running(&self.sql, xid).await?;
                if running {
                    self.awaiting_visibility
                        .push((xid, (table, aggregate.clone())));
                    self.block_met_in_stream((table, aggregate), held)?;
                    return Ok(());
                }
                self.ended_xid = Some(xid);
                if outbox::aggregate_pending_hand_off(&self.sql, outbox_table, &aggregate).await? {
                    self.block_met_in_stream((table, aggregate), held)?;
                } else {
                    tracing::debug!(table = %outbox_table.name, "a hand-off notice for an aggregate with nothing waiting in the polling path: ignored");
                }
            }
            Decoded::HandOffsCommitted { end_lsn, events } => {
                let buffered: HashSet<RowKey> = self
                    .replay_buffer
                    .iter()
                    .map(|pending| (pending.tag.table, pending.event_id))
                    .collect();
                let met = self
                    .earlier_hand_offs
                    .hand_offs_committed(events, end_lsn, &buffered);
                self.hold_for_earlier_hand_offs(met.then_some(end_lsn));
            }
            Decoded::Nothing => {}
        }
        Ok(())
    }

    /// A hold protects the standbys that could keep a copy of the slot and lack the write it stands for:
    /// once each of them flushed past it (as their physical slots on this server say), it ends, and so does
    /// the wait of events found handed off before (their hand-offs ended before the position read then).
    /// Otherwise the stream must pass it, which after a backlog takes until the backlog is read.
    async fn end_holds_the_standbys_flushed(&mut self) -> Result<()> {
        let flushed = pg::standbys_flushed(&self.sql)
            .await?
            .unwrap_or(Lsn(u64::MAX));
        let ended = self.earlier_hand_offs.passed(flushed);
        self.hold_for_earlier_hand_offs(ended);
        self.watermark.standbys_flushed(flushed);
        Ok(())
    }

    /// Events found handed off before: nothing below `hold` (the end of a hand-off of theirs, or a position
    /// past it) is confirmed from now on, nor below the provisional hold of those still waiting for theirs
    /// (see [`earlier_hand_offs`](super::earlier_hand_offs)).
    fn hold_for_earlier_hand_offs(&mut self, hold: Option<Lsn>) {
        if let Some(hold) = hold {
            self.watermark.hold_until(hold);
        }
        self.watermark
            .provisional_hold(self.earlier_hand_offs.provisional_hold());
    }

    /// Room for another event (see [`window`]). Under a hold (see [`Watermark::hold_until`]) finished
    /// events do not count: they can be reported only once the stream passes the hold, so reading must go on.
    fn window_open(&self) -> bool {
        let unreported = if self.watermark.holding() {
            0
        } else {
            self.watermark.unreported_events()
        };
        self.window.is_open(unreported)
    }

    fn start_event(&mut self, txn: TxnId, bytes: usize) {
        self.watermark.event_started(txn);
        self.window.start(bytes);
    }

    fn finish_event(&mut self, txn: TxnId, bytes: usize) {
        self.watermark.event_finished(txn);
        self.window.finish(bytes);
    }

    /// Publishes one event, or holds it back when its aggregate has events waiting in the polling path
    /// (see [`gate`]). An event the producer refuses for good (e.g. too large) goes to the polling path,
    /// which retries and dead-letters it; its aggregate is blocked behind it, so order per aggregate holds.
    async fn publish(&mut self, pending: Pending) -> Result<()> {
        if self.memory.owed.is_owed(&pending.event_id) {
            return self.hand_off_owed(pending);
        }
        match self
            .gate
            .admit(pending.tag.table, pending, |p| aggregate_of(&p.event))
        {
            Admission::Publish(p) => self.produce(p).await,
            Admission::Parked => Ok(()),
            Admission::HandOff(events) => self.hand_off_blocked(events),
        }
    }

    /// An event the broker refused for good in an earlier session, sent again by the slot: it goes to the
    /// polling path, and its aggregate with it (see `owed`).
    fn hand_off_owed(&mut self, pending: Pending) -> Result<()> {
        let parked = self
            .gate
            .refused((pending.tag.table, aggregate_of(&pending.event)));
        self.hand_off_blocked(parked)?;
        self.hand_off(pending, HandOffReason::Refused)
    }

    /// Hands one event to the producer; a permanent refusal (or a topic the broker refused outright, see
    /// [`TopicHolds`](crate::pipeline::topic_holds::TopicHolds)) sends it to the polling path.
    async fn produce(&mut self, pending: Pending) -> Result<()> {
        if self.failing.is_some() {
            // Given up: the event stays unfinished and is re-sent by the next session.
            return Ok(());
        }
        let table = pending.tag.table;
        let topic = self
            .settings
            .topic
            .render_event(&self.settings.database.tables[table].name, &pending.event);
        let held = self.outbox_sql[table].can_hand_off()
            && self
                .memory
                .topic_holds
                .is_held(&topic, tokio::time::Instant::now());
        let tag = CdcTag {
            produced: self.next_produced,
            ..pending.tag
        };
        let published = if held {
            Err(PublishError::Rejected(Rejection {
                permanent: true,
                topic_wide: true,
                ..Rejection::transient(format!("topic {topic} was refused by the broker"))
            }))
        } else {
            self.publisher
                .publish(
                    &self.settings.database.tables[table],
                    &topic,
                    &pending.event,
                    pending.event_id,
                    tag,
                    None,
                )
                .await
        };
        match published {
            Ok(()) => {
                if let Some(eos) = self.exactly_once.as_mut() {
                    eos.open_since.get_or_insert_with(tokio::time::Instant::now);
                    eos.open_events += 1;
                }
                self.outstanding.insert(
                    self.next_produced,
                    Outstanding {
                        since: tokio::time::Instant::now(),
                        table,
                        aggregate_type: pending.event.aggregate_type.clone(),
                        aggregate_id: pending.event.aggregate_id.clone(),
                    },
                );
                self.next_produced += 1;
                self.published += 1;
                Ok(())
            }
            Err(PublishError::Rejected(rejection))
                if rejection.permanent && self.outbox_sql[table].can_hand_off() =>
            {
                let event_id = pending.event_id;
                if !held {
                    tracing::warn!(%event_id, aggregate_id = %pending.event.aggregate_id, error = %rejection.reason, "event refused by the producer; handing it and its aggregate to the polling path");
                }
                let aggregate = (table, aggregate_of(&pending.event));
                if rejection.topic_wide && !held {
                    self.hold_topic(&topic, &rejection.reason);
                }
                if self
                    .outstanding
                    .values()
                    .any(|o| o.of(table, &pending.event))
                {
                    // An earlier event of its aggregate is still on its way (with exactly-once: in the open
                    // Kafka transaction). Should that one fail, it would be re-sent from the slot after this one
                    // reached Kafka through the polling path: give the session up instead, and hand both (in
                    // order) to the polling path when the slot sends them again.
                    self.owe(event_id, aggregate);
                    self.give_up(format!("event {event_id} was refused for good while an earlier event of its aggregate was on its way"));
                    return Ok(());
                }
                let parked = self.gate.refused(aggregate);
                let reason = if rejection.topic_wide {
                    HandOffReason::TopicRefused
                } else {
                    HandOffReason::Refused
                };
                // Parked events of the aggregate (none in practice: it was not blocked) came before it.
                self.hand_off_blocked(parked)?;
                self.hand_off(pending, reason)?;
                if self.gate.blocked_in(table) > MAX_TRACKED_BLOCKED {
                    // Events of these aggregates may still be in flight: holding the table in place could let
                    // a later one overtake them through the polling path. The next session holds it from
                    // its start, when nothing is in flight, once this hand-off is written (so that it
                    // finds the aggregates waiting).
                    self.restart_after_hand_offs = true;
                }
                Ok(())
            }
            // The producer stopped (the gap-less guarantee after a refusal whose report is still on its
            // way) or cannot take it now: the event stays unfinished, and is re-sent by the next session
            // once the reports already on their way are in (a refused one is handed off first).
            Err(PublishError::Rejected(rejection)) if !rejection.permanent => {
                self.give_up(format!(
                    "the producer did not take event {}: {}",
                    pending.event_id, rejection.reason
                ));
                Ok(())
            }
            Err(error) => Err(error.into()),
        }
    }

    /// The stream says `aggregate` waits in the polling path (a row inserted handed off, or one sent again
    /// and found handed off): its later events wait behind it. Should an earlier event of it still be on its
    /// way (it could fail and come back from the slot after them), the session ends instead, and the next
    /// one hands the aggregate to the polling path from its start.
    fn block_met_in_stream(&mut self, aggregate: GateKey, held: bool) -> Result<()> {
        if self
            .outstanding
            .values()
            .any(|o| o.of_aggregate(&aggregate))
        {
            self.memory.owed.owe_aggregate(aggregate);
            self.owed_here += 1;
            self.give_up(
                "an aggregate with events on their way to Kafka waits in the polling path".into(),
            );
        } else if held {
            let parked = self.gate.block_handing_off(aggregate);
            self.hand_off_blocked(parked)?;
        } else {
            self.gate.block(aggregate);
        }
        Ok(())
    }

    /// `event_id` of `aggregate` goes to the polling path when the slot sends it again (see `owed`).
    fn owe(&mut self, event_id: Uuid, aggregate: GateKey) {
        self.memory.owed.owe(event_id, aggregate);
        self.owed_here += 1;
    }

    /// Holds `topic` (see [`TopicHolds`](crate::pipeline::topic_holds::TopicHolds)), once per refusal.
    fn hold_topic(&mut self, topic: &str, reason: &str) {
        let now = tokio::time::Instant::now();
        if !self.memory.topic_holds.is_held(topic, now) {
            let hold = self.memory.topic_holds.hold(topic, now);
            tracing::warn!(%topic, ?hold, error = %reason, "the broker refuses this topic: its events go to the polling path (retried with backoff) for a while");
        }
    }

    /// A delivery report arrived for the event handed to the producer as `produced`.
    fn delivery_reported(&mut self, produced: u64) -> Option<Outstanding> {
        self.outstanding.remove(&produced)
    }

    /// When the longest-waiting event still without a delivery report was handed to the producer.
    fn oldest_outstanding(&self) -> Option<tokio::time::Instant> {
        self.outstanding.first_key_value().map(|(_, o)| o.since)
    }

    /// Gives this session's deliveries up: the producer fails at once whatever it still holds (so nothing
    /// after a failure can still reach Kafka ahead of it), and the session ends once every report is in.
    fn give_up(&mut self, failure: String) {
        if self.failing.is_none() {
            tracing::warn!(%failure, in_flight = self.outstanding.len(), "giving up this session's deliveries: purging the producer; what it did not deliver is re-sent from the slot");
            self.publisher.purge();
            self.failing = Some((failure, tokio::time::Instant::now()));
        }
    }

    /// Deliveries that failed after the producer accepted them. Under the gap-less guarantee nothing after
    /// a failed event in its partition was written, so re-sending from the slot keeps every aggregate's
    /// order. An event the broker refused for good (too large, not authorised, invalid, or refused with a
    /// batch-mate that was) would only be refused again: it is owed to the polling path, which the next
    /// session hands it to when the slot sends it again (with the rest of its aggregate, see `owed`); a
    /// topic refused outright is held (see [`TopicHolds`](crate::pipeline::topic_holds::TopicHolds)).
    fn undelivered(&mut self, deliveries: Vec<Delivery<CdcTag>>) -> Result<()> {
        for delivery in deliveries {
            let outstanding = self.delivery_reported(delivery.tag.produced);
            let Err(rejection) = delivery.result else {
                continue;
            };
            crate::metrics::publish_error("delivery");
            self.give_up(format!(
                "delivery of event {} failed: {}",
                delivery.event_id, rejection.reason
            ));
            if !rejection.permanent {
                continue;
            }
            if !self.outbox_sql[delivery.tag.table].can_hand_off() {
                self.refused_without_polling.get_or_insert(format!(
                    "the broker refused event {} for good ({}) and its table has no polling columns to retry and dead-letter it: fix the cause, or run `outboxd migrate` to add them",
                    delivery.event_id, rejection.reason
                ));
                continue;
            }
            tracing::warn!(event_id = %delivery.event_id, error = %rejection.reason, "event refused by the broker after the producer accepted it; the next session hands it and its aggregate to the polling path");
            if let (true, Some(topic)) = (rejection.topic_wide, &rejection.topic) {
                self.hold_topic(&topic.clone(), &rejection.reason);
            }
            match outstanding {
                Some(outstanding) => self.owe(delivery.event_id, outstanding.aggregate()),
                // Not expected; the event stays unfinished: sent again, refused again, owed then.
                None => {
                    tracing::warn!(event_id = %delivery.event_id, "a refusal of an event this session did not hand over; it is sent again")
                }
            }
        }
        Ok(())
    }

    /// Hands one event to the polling path: its `handoff_at` is written by the backfill task (or the row
    /// written back, should it be gone).
    fn hand_off(&mut self, pending: Pending, reason: HandOffReason) -> Result<()> {
        if self.failing.is_some() {
            // Given up: an earlier event of its aggregate may be sent again from the slot; the event stays
            // unfinished and the next session decides.
            return Ok(());
        }
        tracing::debug!(event_id = %pending.event_id, ?reason, "handing the event to the polling path");
        let tag = CdcTag {
            hand_off: true,
            ..pending.tag
        };
        let item = Delivery {
            tag,
            event_id: pending.event_id,
            bytes: pending.event.size_bytes(),
            result: Ok(()),
        };
        if let Ok(mut rows) = self.to_backfill.rows.lock() {
            rows.insert(pending.event_id, pending.row);
        }
        self.to_backfill
            .deliveries
            .send(item)
            .map_err(|_| Error::Kafka {
                message: "the backfill task stopped".into(),
                transient: true,
            })?;
        self.memory.owed.met(&pending.event_id);
        self.hand_offs_in_flight += 1;
        self.handed_off += 1;
        Ok(())
    }

    /// Hands held events of blocked aggregates to the polling path, in order.
    fn hand_off_blocked(&mut self, events: Vec<Pending>) -> Result<()> {
        for pending in events {
            self.hand_off(pending, HandOffReason::Blocked)?;
        }
        Ok(())
    }

    /// Hands every parked event to the polling path, in order, its aggregate with it.
    fn hand_off_every_parked(&mut self) -> Result<()> {
        let parked = self.gate.hand_off_every_parked();
        tracing::debug!(
            events = parked.len(),
            "the window is full behind parked events: handing them to the polling path"
        );
        self.hand_off_blocked(parked)
    }

    /// Lets the CDC path publish an aggregate again once the polling path has nothing of it left, then
    /// publishes what it parked, in order. Asked only while none of this session's hand-offs are unwritten,
    /// so the query sees all of them; aggregates handing off go back to parking first, so that happens.
    async fn unblock_drained_aggregates(&mut self) -> Result<()> {
        self.gate.begin_check();
        if self.hand_offs_in_flight > 0 {
            self.pausing_for_check = self.gate.has_held_tables();
            return Ok(());
        }
        self.pausing_for_check = false;
        // A held table whose pending aggregates are few enough again is tracked one by one from now on
        // (from exactly what was just read: it is not asked again below).
        let mut released: HashSet<usize> = HashSet::new();
        for table in self.gate.held_tables() {
            let outbox_table: &OutboxTable = &self.settings.database.tables[table];
            let pending =
                outbox::aggregates_pending_hand_off(&self.sql, outbox_table, MAX_TRACKED_BLOCKED)
                    .await?;
            if pending.len() <= MAX_TRACKED_BLOCKED {
                tracing::info!(table = %outbox_table.name, blocked = pending.len(), "few enough aggregates wait in the polling path: tracking them one by one again");
                self.gate.release_table(table, pending);
                released.insert(table);
            }
        }
        let mut pending: HashSet<(usize, AggregateKey)> = HashSet::new();
        // A table whose answer was cut at the limit cannot tell which aggregates drained: none unblocks.
        let mut cut: HashSet<usize> = HashSet::new();
        for table in self.gate.blocked_tables() {
            if released.contains(&table) {
                continue;
            }
            let outbox_table: &OutboxTable = &self.settings.database.tables[table];
            let aggregates =
                outbox::aggregates_pending_hand_off(&self.sql, outbox_table, MAX_TRACKED_BLOCKED)
                    .await?;
            if aggregates.len() > MAX_TRACKED_BLOCKED {
                cut.insert(table);
            }
            pending.extend(aggregates.into_keys().map(|aggregate| (table, aggregate)));
        }
        // Aggregates with events owed to the polling path stay blocked until the slot sent those again.
        pending.extend(self.memory.owed.aggregates().cloned());
        // And those a transaction not visible yet handed off, until it is.
        let mut still_running = Vec::new();
        for (xid, aggregate) in std::mem::take(&mut self.awaiting_visibility) {
            if outbox::transaction_running(&self.sql, xid).await? {
                pending.insert(aggregate.clone());
                still_running.push((xid, aggregate));
            }
        }
        self.awaiting_visibility = still_running;
        // Unblocked (or blocked again by a refusal among them): publish decides.
        for unblocked in self.gate.drained(&pending, &cut, &released) {
            self.publish(unblocked).await?;
        }
        Ok(())
    }

    /// Publishes buffered replayed rows, except those an earlier run already published (one lookup).
    async fn flush_replay_buffer(&mut self) -> Result<()> {
        if self.replay_buffer.is_empty() {
            return Ok(());
        }
        let mut states: HashMap<(usize, Uuid), RowState> = HashMap::new();
        for (table, sql) in self.outbox_sql.iter().enumerate() {
            let ids: Vec<Uuid> = self
                .replay_buffer
                .iter()
                .filter(|p| p.tag.table == table)
                .map(|p| p.event_id)
                .collect();
            if !ids.is_empty() {
                let answer = sql.row_states(&self.sql, &ids).await?;
                states.extend(answer.into_iter().map(|(id, state)| ((table, id), state)));
            }
        }
        // Rows handed off before whose hand-off the stream did not pass yet wait for it, or for the WAL
        // position read now (past their hand-offs, which committed before their rows were read).
        let past_the_hand_offs = if states
            .values()
            .any(|state| *state == RowState::WaitingInPollingPath)
        {
            pg::current_wal_position(&self.sql).await?
        } else {
            Lsn::ZERO
        };
        let mut marked_covered = 0;
        let mut found_handed_off = 0;
        for pending in std::mem::take(&mut self.replay_buffer) {
            let key = (pending.tag.table, pending.event_id);
            let state = states.get(&key).copied();
            // A row gone: a re-sent one was finished before (deleted after publishing, or by retention); a
            // replayed one may have been deleted by its own transaction and is published from the stream.
            // A re-sent row that exists unfinished lost its marks (a server restored from a snapshot taken
            // before they were written): it is published again.
            let finished = state.map_or(pending.tag.resent, RowState::is_finished);
            if state == Some(RowState::WaitingInPollingPath) {
                // Handed off by an earlier session or leader, possibly after this session read the
                // aggregates waiting in the polling path: its aggregate's later events wait behind it.
                self.block_met_in_stream((pending.tag.table, aggregate_of(&pending.event)), false)?;
            }
            if state == Some(RowState::WaitingInPollingPath) {
                self.memory.owed.met(&pending.event_id);
                self.finish_event(pending.tag.txn, pending.event.size_bytes());
                self.skipped_already_published += 1;
                let hand_off_end = self
                    .earlier_hand_offs
                    .found_handed_off(key, past_the_hand_offs);
                self.hold_for_earlier_hand_offs(hand_off_end);
                found_handed_off += 1;
            } else if finished || (state.is_none() && self.covered_before(&pending)) {
                self.memory.owed.met(&pending.event_id);
                self.finish_event(pending.tag.txn, pending.event.size_bytes());
                self.skipped_already_published += 1;
            } else if self.covered_before(&pending) {
                self.mark_covered(pending)?;
                marked_covered += 1;
            } else if self.memory.owed.is_owed(&pending.event_id) {
                self.hand_off_owed(pending)?;
            } else if self
                .gate
                .is_blocked(pending.tag.table, || aggregate_of(&pending.event))
            {
                // What waits in the polling path for this aggregate may be *later* than this replayed event
                // (handed off by the session that failed to deliver it): parking it would publish it after
                // them. The polling path orders it among them by position.
                self.hand_off_blocked(vec![pending])?;
            } else {
                self.publish(pending).await?;
            }
        }
        self.earlier_hand_offs.looked_up();
        if found_handed_off > 0 {
            tracing::debug!(
                events = found_handed_off,
                waiting = self.earlier_hand_offs.waiting(),
                "events met again were found handed off before: confirming nothing before the stream passes their hand-off"
            );
        }
        if marked_covered > 0 {
            tracing::info!(
                events = marked_covered,
                "events already in Kafka (committed before this session) marked published without producing them again"
            );
        }
        Ok(())
    }

    /// True when the last Kafka transaction committed before this session holds this event.
    fn covered_before(&self, pending: &Pending) -> bool {
        self.exactly_once
            .as_ref()
            .and_then(|eos| eos.committed_before.as_ref())
            .is_some_and(|progress| {
                let table = self.settings.database.tables[pending.tag.table]
                    .name
                    .to_string();
                progress.covers(&table, &pending.position)
            })
    }

    /// An event already in Kafka (committed before this session) whose row is not marked yet: it is
    /// marked published as if acknowledged now, and never produced again. (`produced: 0` tells the
    /// report from a producer's.)
    fn mark_covered(&mut self, pending: Pending) -> Result<()> {
        let delivery = Delivery {
            tag: CdcTag {
                produced: 0,
                hand_off: false,
                ..pending.tag
            },
            event_id: pending.event_id,
            bytes: pending.event.size_bytes(),
            result: Ok(()),
        };
        self.to_backfill
            .deliveries
            .send(delivery)
            .map_err(|_| Error::Kafka {
                message: "the backfill task stopped".into(),
                transient: true,
            })
    }

    /// Reading waits while a due commit waits for hand-offs.
    fn commit_waits_for_hand_offs(&self) -> bool {
        self.exactly_once
            .as_ref()
            .is_some_and(|eos| eos.waiting_for_hand_offs)
    }

    /// When the open Kafka transaction should commit, if the loop has nothing else to wake it: between
    /// PostgreSQL transactions, and not while waiting for hand-offs (their reports wake it).
    fn commit_due_at(&self) -> Option<tokio::time::Instant> {
        let eos = self.exactly_once.as_ref()?;
        if self.failing.is_some() || eos.waiting_for_hand_offs || self.decoder.in_transaction() {
            return None;
        }
        eos.open_since.map(|since| since + eos.interval)
    }

    /// Commits the open Kafka transaction when it is due: `--transaction-interval` after its first event,
    /// at the end of a PostgreSQL transaction (mid-transaction only when the window is full, or at
    /// shutdown). Its progress record covers everything decoded, so first every decoded event must be
    /// produced into it or handed to the polling path and written: buffered replayed rows are looked up,
    /// parked events handed off, and it waits for hand-offs to be written.
    async fn commit_if_due(&mut self, draining: bool) -> Result<()> {
        let Some(eos) = &self.exactly_once else {
            return Ok(());
        };
        if self.failing.is_some() {
            return Ok(());
        }
        // At shutdown what waits is handed on even when nothing is open, so that the window empties.
        if draining && eos.open_since.is_none() {
            return self.hand_on_held_events().await;
        }
        let Some(since) = eos.open_since else {
            return Ok(());
        };
        // Once a commit waited for hand-offs it happens as soon as they are written, wherever the
        // stream is (reading paused meanwhile, so the window may have room again).
        let cannot_wait = draining
            || !self.window_open()
            || eos.waiting_for_hand_offs
            || since.elapsed() >= eos.max_open;
        let due = since.elapsed() >= eos.interval || eos.open_events >= eos.batch;
        if !cannot_wait && (!due || self.decoder.in_transaction()) {
            return Ok(());
        }
        self.hand_on_held_events().await?;
        let hand_offs_pending = self.hand_offs_in_flight > 0;
        let Some(eos) = self.exactly_once.as_mut() else {
            return Ok(());
        };
        eos.waiting_for_hand_offs = hand_offs_pending;
        if hand_offs_pending || self.failing.is_some() {
            return Ok(());
        }
        let Some(upto) = self.decoder.decoded_upto() else {
            return Ok(());
        };
        let progress = Progress::new(
            eos.key.clone(),
            eos.timeline,
            upto.commit_lsn,
            upto.commit_micros,
            upto.events_decoded,
            eos.tables.clone(),
        );
        eos.open_since = None;
        eos.open_events = 0;
        if let Err(rejection) = self.publisher.commit(&progress).await {
            if rejection.permanent {
                // Every commit would fail alike (the progress topic refused): a person must act.
                self.refused_without_polling
                    .get_or_insert(rejection.reason.clone());
            }
            self.give_up(format!(
                "the Kafka transaction did not commit: {}",
                rejection.reason
            ));
        }
        Ok(())
    }

    /// Before a commit (or at shutdown): buffered replayed rows are looked up and parked events handed
    /// to the polling path, so that everything decoded is produced or handed off.
    async fn hand_on_held_events(&mut self) -> Result<()> {
        if !self.replay_buffer.is_empty() {
            self.flush_replay_buffer().await?;
        }
        if self.gate.parked_len() > 0 {
            self.hand_off_every_parked()?;
        }
        Ok(())
    }

    /// At shutdown, buffered and parked rows are simply left for the next run (the slot was not confirmed
    /// past them).
    fn drop_held_events(&mut self) {
        let parked = self.gate.take_every_parked();
        for pending in std::mem::take(&mut self.replay_buffer)
            .into_iter()
            .chain(parked)
        {
            self.window.finish(pending.event.size_bytes());
        }
    }
}

async fn sleep_until_opt(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn told(at: Instant) -> StatusUpdates {
        StatusUpdates {
            last_sent: Lsn(100),
            last_sent_at: at,
        }
    }

    #[test]
    fn a_confirmation_held_back_by_the_gap_is_due_once_the_gap_passed() {
        let at = Instant::now();
        let status = told(at);
        assert_eq!(
            status.held_back_until(Lsn(200)),
            Some(tokio::time::Instant::from_std(at + MIN_CONFIRM_GAP))
        );
    }

    #[test]
    fn nothing_is_due_when_the_server_was_told_the_watermark() {
        let status = told(Instant::now());
        assert_eq!(status.held_back_until(Lsn(100)), None);
        assert_eq!(status.held_back_until(Lsn(50)), None);
    }
}
