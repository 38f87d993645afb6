//! The CDC fast path: slot stream -> decode -> publish -> (ack + backfill) -> watermark -> confirm.
//!
//! One *session* is one replication connection. Transient failures end the session; the next one resumes
//! from the slot's own position, and recognises what it confirmed before by the highest confirmed position
//! kept in memory (PG 15 can move `confirmed_flush_lsn` back). A position is kept only for its own server
//! history (see `history`).
//! Reading stops while the in-flight window is full, but standby status updates keep flowing on a timer.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use uuid::Uuid;

use crate::backoff::Backoff;
use crate::config::RunSettings;
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::kafka::{Delivery, KnownTopics, PublishError, Publisher, Rejection};
use crate::lsn::Lsn;
use crate::pg::outbox::{self, AggregateKey, ClaimScope, OutboxSql};
use crate::pg::pgoutput;
use crate::pg::replication::{protocol, ReplicationConnection, ReplicationStream, ServerMessage};
use crate::pg::{self, slot};
use crate::pipeline::backfill::{self, CdcTag, Finished};
use crate::pipeline::history::{self, HistoryChange, Reached, ServerHistory};
use crate::pipeline::leader;
use crate::pipeline::replication_error;
use crate::pipeline::topic_holds::TopicHolds;
use crate::pipeline::watermark::{TxnId, Watermark};
use crate::table::OutboxTable;

mod decoder;
mod gate;
use decoder::{placeholder_event, Decoded, Pending, TransactionDecoder};
use gate::{Admission, AggregateGate};

/// Rows of re-sent transactions are checked against `published_at` in batches of this size.
const REPLAY_BATCH: usize = 1_000;
/// Least time between two status updates sent because the watermark moved.
const MIN_CONFIRM_GAP: Duration = Duration::from_millis(100);
/// How often, at most, a session with blocked aggregates asks whether the polling path has drained them.
const UNBLOCK_CHECK: Duration = Duration::from_millis(100);
/// The check waits at least this many times its own last duration, so that asking costs the database at
/// most ~5% of one backend however many aggregates are blocked.
const UNBLOCK_CHECK_COST_FACTOR: u32 = 20;
/// Most blocked aggregates tracked one by one. A table with more (a huge hand-off after a slot was
/// recreated) is held whole: all its events go to the polling path, in order, until few enough remain.
const MAX_TRACKED_BLOCKED: usize = 50_000;
/// Longest wait before asking again for a slot another walsender holds, while this instance leads.
const SLOT_BUSY_RETRY: Duration = Duration::from_secs(1);

pub struct CdcPipeline {
    settings: Arc<RunSettings>,
    watermark: Watermark,
    known_topics: KnownTopics,
    /// Whether a session of this process ever reached streaming (a slot held since start-up is an error).
    ever_streamed: bool,
    /// Whether the latest session reached streaming (ends a database outage).
    reached_streaming: bool,
    /// The server history `watermark`'s confirmed position belongs to (`None` before the first session).
    history: Option<ServerHistory>,
    /// When a session last stopped streaming: where a history change may have left a gap.
    last_streamed_at: Option<std::time::SystemTime>,
    /// Topics the broker refused outright: their events go to the polling path for a while.
    topic_holds: TopicHolds,
}

/// Why an event went to the polling path instead of the producer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HandOffReason {
    /// Its aggregate has earlier events in the polling path.
    Blocked,
    /// The producer refused it for good (e.g. too large): the polling path retries and dead-letters it.
    Refused,
    /// The broker refuses its topic outright (not authorised; see [`TopicHolds`]): the polling path retries
    /// it. Unlike an event too large, one whose row is gone is not given up but re-sent from the slot.
    TopicRefused,
    /// A required column is NULL: the polling path dead-letters it.
    Invalid,
}

/// An event handed to the polling path, kept until its `handoff_at` is written: if its row is gone (deleted
/// by its own transaction) the polling path will never see it, and the stream must publish it itself.
struct HandedOff {
    tag: CdcTag,
    event: OutboxEvent,
    reason: HandOffReason,
    /// What it counts against the in-flight window.
    bytes: usize,
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

/// Per-session state of the stream loop.
struct Session<'a> {
    settings: &'a RunSettings,
    watermark: &'a mut Watermark,
    sql: tokio_postgres::Client,
    /// Statements per outbox table, in `settings.database.tables` order.
    outbox_sql: Vec<OutboxSql>,
    publisher: Publisher<CdcTag>,
    decoder: TransactionDecoder,
    /// Rows of the replay region and of re-sent transactions, waiting for their rows' states.
    replay_buffer: Vec<Pending>,
    in_flight_events: usize,
    in_flight_bytes: usize,
    published: u64,
    skipped_already_published: u64,
    /// Events handed to the polling path travel to the backfill task on the delivery channel.
    hand_offs: mpsc::UnboundedSender<Delivery<CdcTag>>,
    /// Aggregates with rows waiting in the polling path (their later events are never published ahead), and
    /// tables with more of them than [`MAX_TRACKED_BLOCKED`] (every event of them is handed off).
    gate: AggregateGate<Pending>,
    /// Reading pauses until hand-offs in flight are written, so that a held table's check can run (under
    /// steady load some hand-off of it is almost always in flight).
    pausing_for_check: bool,
    /// A table outgrew [`MAX_TRACKED_BLOCKED`]: reading stops, and the session restarts once its hand-offs
    /// are written.
    restart_after_hand_offs: bool,
    hand_offs_in_flight: usize,
    /// Hand-offs whose `handoff_at` is not written yet, by event id.
    hand_offs_unwritten: HashMap<Uuid, HandedOff>,
    handed_off: u64,
    topic_holds: &'a mut TopicHolds,
    /// Events handed to the producer whose delivery report has not arrived: when each was handed over, by
    /// its `CdcTag::produced`.
    outstanding: BTreeMap<u64, tokio::time::Instant>,
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
}

impl CdcPipeline {
    pub fn new(settings: Arc<RunSettings>, known_topics: KnownTopics) -> Self {
        CdcPipeline {
            settings,
            watermark: Watermark::new(Lsn::ZERO),
            known_topics,
            ever_streamed: false,
            reached_streaming: false,
            history: None,
            last_streamed_at: None,
            topic_holds: TopicHolds::default(),
        }
    }

    /// Runs sessions until `shutdown` turns true, with the sweeper (the polling path restricted to rows
    /// handed off to it) alongside. Transient failures reconnect with capped backoff, forever.
    pub async fn run(&mut self, mut shutdown: watch::Receiver<bool>) -> Result<()> {
        loop {
            let Some(mut leadership) = leader::acquire(&self.settings, &mut shutdown).await? else {
                return Ok(());
            };
            // Stop streaming when the process stops or when leadership is lost (another instance may lead).
            let (stop, stop_rx) = watch::channel(false);
            let mut parent = shutdown.clone();
            let watcher = tokio::spawn(async move {
                let lost = tokio::select! {
                    _ = parent.wait_for(|stop| *stop) => None,
                    lost = leadership.lost() => Some(lost),
                };
                if let Some(Ok(why)) = &lost {
                    tracing::warn!(reason = %why, "lost the leadership lock: stopping streaming (another instance may lead now)");
                }
                let _ = stop.send(true);
                lost
            });
            let result = self.run_as_leader(stop_rx).await;
            // Ok means a stop was signalled, so the watcher has finished or is about to.
            let lost = match &result {
                Ok(()) => watcher.await.unwrap_or(None),
                Err(_) => {
                    watcher.abort();
                    None
                }
            };
            match lost {
                Some(Ok(_)) => {
                    tracing::info!(
                        "stopped streaming after losing the leadership lock; asking for it again"
                    );
                    continue;
                }
                Some(Err(error)) => return Err(error),
                None => return result,
            }
        }
    }

    async fn run_as_leader(&mut self, shutdown: watch::Receiver<bool>) -> Result<()> {
        let (stop_sweeper, mut sweeper_shutdown) = watch::channel(false);
        let (settings, topics) = (self.settings.clone(), self.known_topics.clone());
        // One sweeper per table with polling columns. It outlives its errors: it logs them and starts
        // again, so handed-off rows are never stranded.
        let sweeper = tokio::spawn(async move {
            loop {
                let sweep = crate::pipeline::poll::poll_all_tables(
                    settings.clone(),
                    ClaimScope::HandedOff,
                    topics.clone(),
                    sweeper_shutdown.clone(),
                );
                match sweep.await {
                    Ok(()) => return,
                    Err(error) => tracing::error!(%error, "sweeper failed; restarting it in 5s"),
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                    _ = sweeper_shutdown.wait_for(|stop| *stop) => return,
                }
            }
        });
        let result = self.sessions(shutdown).await;
        let _ = stop_sweeper.send(true);
        // A sweeper waiting on a connection that went silent (leadership lost to a partition) is abandoned:
        // its leases expire and the next leader's sweeper claims the rows.
        let mut sweeper = sweeper;
        match tokio::time::timeout(self.settings.shutdown_timeout, &mut sweeper).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "sweeper task failed"),
            Err(_) => {
                sweeper.abort();
                tracing::warn!(
                    "the sweeper did not stop within --shutdown-timeout; abandoned it (its leases expire)"
                );
            }
        }
        result
    }

    async fn sessions(&mut self, mut shutdown: watch::Receiver<bool>) -> Result<()> {
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        let mut outage = super::DatabaseOutage::new(self.settings.reconnect_timeout);
        let first_attempt = Instant::now();
        loop {
            let started = Instant::now();
            let result = self.session(&mut shutdown).await;
            if std::mem::take(&mut self.reached_streaming) {
                outage.ended();
            }
            match result {
                Ok(()) => return Ok(()),
                // Held by another client since start-up (not a walsender that is still dying): say so.
                Err(Error::Replication(error))
                    if error.code() == Some("55006")
                        && !self.ever_streamed
                        && first_attempt.elapsed() > self.settings.startup_timeout =>
                {
                    return Err(Error::setup(
                        format!("replication slot {} is in use by another client ({error})", self.settings.database.slot),
                        "stop that client (see pg_stat_replication / pg_replication_slots.active_pid), or give outboxd its own --slot",
                    ));
                }
                Err(error) if error.is_transient() || error.awaited_database().is_some() => {
                    crate::http::READINESS.set_mode("reconnecting");
                    if started.elapsed() > Duration::from_secs(60) {
                        backoff.reset();
                    }
                    let mut delay = backoff.next_delay();
                    if let Error::Replication(slot_busy) = &error {
                        if slot_busy.code() == Some("55006") {
                            // We hold the leadership lock: a walsender whose client went silent is the
                            // previous leader's, and is ended; a live one is asked again soon.
                            self.end_silent_walsender().await;
                            delay = delay.min(SLOT_BUSY_RETRY);
                        }
                    }
                    match outage.judge(&error)? {
                        Some(waiting_for) => {
                            tracing::warn!(%error, retry_in = ?delay, %waiting_for, "cannot stream: waiting for the database (up to --reconnect-timeout)")
                        }
                        None => {
                            tracing::warn!(%error, retry_in = ?delay, confirmed = %self.watermark.confirmed(), "replication session ended; reconnecting")
                        }
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
                    }
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// See [`leader::end_silent_walsender`]; failures only delay the takeover (logged at debug).
    async fn end_silent_walsender(&self) {
        let ended = async {
            let sql = pg::connect(&self.settings.database.database_url).await?;
            leader::end_silent_walsender(&sql, &self.settings.database.slot).await
        };
        match tokio::time::timeout(leader::HEALTH_TIMEOUT, ended).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::debug!(%error, "cannot check the slot for a silent walsender")
            }
            Err(_) => tracing::debug!("no answer when checking the slot for a silent walsender"),
        }
    }

    /// Counts and logs a history change once. With a table that has no polling columns, nothing could
    /// publish what the change may have skipped: stop, saying what may be missing and how to recover.
    fn history_changed(
        &self,
        change: &HistoryChange,
        here: &ServerHistory,
        wal_end: Lsn,
    ) -> Result<()> {
        crate::metrics::history_changed();
        let confirmed = self.watermark.highest_confirmed();
        let (old_system_id, old_timeline) = self
            .history
            .as_ref()
            .map(|h| (h.system_id.as_str(), h.timeline))
            .unwrap_or_default();
        if !super::has_polling_columns(&self.settings) {
            let since = self
                .last_streamed_at
                .map(|t| humantime::format_rfc3339_seconds(t).to_string())
                .unwrap_or_else(|| "start-up".into());
            let tables =
                crate::table::names(self.settings.database.tables.iter().filter(|t| !t.polling));
            return Err(Error::setup(
                format!(
                    "the database behind --database-url has another history: {change}. {tables} has no polling columns, so events committed there that the old position skips would never be published: those committed on this server since outboxd last streamed ({since}), up to its WAL end {wal_end} (outboxd had confirmed {confirmed} on system {old_system_id} timeline {old_timeline})"
                ),
                "publish (or re-insert) the rows of that table committed since then yourself, then restart outboxd, which streams from a new slot; `outboxd migrate --add-polling-columns` lets outboxd cover such gaps by itself",
            ));
        }
        tracing::warn!(
            %change,
            old_system_id,
            old_timeline,
            new_system_id = %here.system_id,
            new_timeline = here.timeline,
            old_confirmed = %confirmed,
            server_wal_end = %wal_end,
            "database history changed: the old position is dropped; streaming from the slot's own position (a new slot hands the unpublished rows older than it to the polling path)"
        );
        Ok(())
    }

    async fn session(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<()> {
        let settings = self.settings.clone();
        let db = &settings.database;
        let mut sql = pg::connect(&db.database_url).await?;
        if pg::in_recovery(&sql).await? {
            return Err(Error::in_recovery());
        }
        let mut outbox_sql = Vec::with_capacity(db.tables.len());
        for table in &db.tables {
            outbox_sql.push(OutboxSql::prepare(&sql, table).await?);
        }
        // Rows the slot will never send can be handed to the polling path (of the tables that have it).
        let can_hand_off = db.tables.iter().any(|t| t.polling);
        // Dead-peer detection as on the leadership connection: a silent server ends the session.
        let url = super::leader::with_dead_peer_detection(&db.replication_url);
        let mut conn = ReplicationConnection::connect(&url)
            .await
            .map_err(replication_error)?;
        let identity = conn.identify_system().await.map_err(replication_error)?;
        // The slot is inspected over SQL: during a switchover the two connections can reach two servers.
        if let Some(sql_system) = pg::system_identifier(&sql).await? {
            if sql_system != identity.system_id {
                return Err(Error::NotReady {
                    problem: format!("the SQL connection reached system {sql_system} but the replication connection system {}", identity.system_id),
                    fix: "point --database-url and --replication-url at the same server".into(),
                    waiting_for: "both connections to reach one server (a switchover under way)".into(),
                });
            }
        }
        // A lost slot is replaced only when every table's gap can be covered by the polling path.
        if super::has_polling_columns(&settings) {
            slot::drop_if_lost(&sql, &db.slot, &db.tables).await?;
        }
        if can_hand_off {
            slot::undo_interrupted_creation(&sql, &db.slot).await?;
        }
        let existing = slot::check_existing_slot(&sql, &db.slot).await?;
        let here = ServerHistory {
            system_id: identity.system_id.clone(),
            timeline: identity.timeline,
        };
        let reached = Reached {
            history: &here,
            wal_end: identity.xlog_position,
            slot_missing: existing.is_none(),
        };
        let change = history::judge(
            self.history.as_ref(),
            self.watermark.highest_confirmed(),
            &reached,
        );
        let slot_position = existing
            .as_ref()
            .map(|state| state.confirmed_flush().unwrap_or(Lsn::ZERO));
        if let Some(change) = &change {
            self.history_changed(change, &here, identity.xlog_position)?;
            // At once, before anything below can fail: the old position never pairs with the new history.
            self.watermark.reset(slot_position.unwrap_or(Lsn::ZERO));
        }
        match slot_position {
            // The slot belongs to the server's own history: stream from its position (what lies between it
            // and a higher position confirmed before is re-sent and recognised).
            Some(position) => self.watermark.resume_at(position),
            None => {
                slot::check_publication(&sql, db).await?;
                if can_hand_off {
                    slot::begin_creation(&sql, &db.slot).await?;
                }
                let created = conn
                    .create_logical_slot(&db.slot)
                    .await
                    .map_err(replication_error)?;
                let handed_off = if can_hand_off {
                    match outbox::hand_off_rows_older_than_slot(
                        &mut sql,
                        &db.tables,
                        &created.snapshot_name,
                    )
                    .await
                    {
                        Ok(count) => {
                            slot::finish_creation(&sql, &db.slot).await?;
                            count
                        }
                        Err(error) => {
                            // Without the hand-off, rows older than the slot would never be published: drop the
                            // slot so that the next attempt creates it (and exports a snapshot) again.
                            drop(conn);
                            drop_slot_after_failed_creation(&sql, &db.slot).await;
                            return Err(error);
                        }
                    }
                } else {
                    tracing::warn!("the table has no polling columns: rows older than the slot are not published (run `outboxd migrate`)");
                    0
                };
                tracing::info!(
                    slot = %db.slot,
                    consistent_point = %created.consistent_point,
                    handed_off_to_polling = handed_off,
                    "created replication slot"
                );
                // Never carry a position over to a new slot: anything between its consistent point and an
                // older, higher position would be skipped.
                self.watermark.reset(created.consistent_point);
            }
        }
        let start = self.watermark.confirmed();
        let mut stream = conn
            .start_replication(&db.slot, start, &db.publication)
            .await
            .map_err(replication_error)?;
        tracing::info!(slot = %db.slot, %start, server_wal_end = %identity.xlog_position, "streaming from replication slot");
        // This history is the position's from now on (not before: a session that fails before streaming
        // must not make a slot it never streamed from look like one that vanished).
        self.history = Some(here);
        // Read only now that this session holds the slot: an instance that led before may have handed off
        // rows until it let go of it.
        // A blocked aggregate parks up to its share of the in-flight window, then hands off.
        let mut gate = AggregateGate::new(settings.max_in_flight_events / 8);
        for (index, table) in db.tables.iter().enumerate().filter(|(_, t)| t.polling) {
            let pending =
                outbox::aggregates_pending_hand_off(&sql, table, MAX_TRACKED_BLOCKED).await?;
            if pending.len() > MAX_TRACKED_BLOCKED {
                tracing::info!(table = %table.name, "more than {MAX_TRACKED_BLOCKED} aggregates wait in the polling path: handing it every event of the table until it has drained them");
                gate.hold_table(index);
                continue;
            }
            for aggregate in pending {
                gate.block((index, aggregate));
            }
        }

        crate::http::READINESS.set_mode("cdc");
        self.ever_streamed = true;
        self.reached_streaming = true;

        let (delivery_tx, delivery_rx) = mpsc::unbounded_channel();
        let (finished_tx, mut finished_rx) = mpsc::unbounded_channel();
        let publisher = Publisher::new(&settings, self.known_topics.clone(), delivery_tx.clone())?;
        let backfill = tokio::spawn(backfill::run(
            db.database_url.clone(),
            db.tables.clone(),
            delivery_rx,
            finished_tx,
        ));

        let decoder = TransactionDecoder::new(
            db.tables.clone(),
            outbox_sql.iter().map(OutboxSql::can_hand_off).collect(),
            identity.xlog_position,
        );
        let mut session = Session {
            settings: &settings,
            watermark: &mut self.watermark,
            sql,
            outbox_sql,
            publisher,
            decoder,
            replay_buffer: Vec::new(),
            in_flight_events: 0,
            in_flight_bytes: 0,
            published: 0,
            skipped_already_published: 0,
            hand_offs: delivery_tx,
            gate,
            pausing_for_check: false,
            restart_after_hand_offs: false,
            hand_offs_in_flight: 0,
            hand_offs_unwritten: HashMap::new(),
            handed_off: 0,
            topic_holds: &mut self.topic_holds,
            outstanding: BTreeMap::new(),
            next_produced: 1,
            delivery_timeout: crate::kafka::delivery_timeout(
                &settings,
                crate::kafka::DEFAULT_DELIVERY_TIMEOUT,
            ),
            failing: None,
            refused_without_polling: None,
        };
        let result = session
            .stream(&mut stream, &mut finished_rx, shutdown)
            .await;
        backfill.abort();
        self.last_streamed_at = Some(std::time::SystemTime::now());
        tracing::info!(
            published = session.published,
            skipped_already_published = session.skipped_already_published,
            handed_off = session.handed_off,
            confirmed = %session.watermark.confirmed(),
            "replication session ended"
        );
        session.publisher.abandon();
        if result.is_ok() {
            stream.close().await;
        }
        result
    }
}

impl Session<'_> {
    async fn stream(
        &mut self,
        stream: &mut ReplicationStream,
        finished_rx: &mut mpsc::UnboundedReceiver<Finished>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<()> {
        let mut status_timer = tokio::time::interval(self.settings.status_interval);
        status_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sent = self.watermark.confirmed();
        let mut last_sent_at = Instant::now();
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        let mut next_unblock_check = tokio::time::Instant::now() + UNBLOCK_CHECK;
        stream.send_status(last_sent).await?;
        loop {
            let window_open = self.window_open();
            crate::metrics::in_flight(self.in_flight_events);
            let mut reply_now = false;
            tokio::select! {
                biased;
                _ = shutdown.wait_for(|stop| *stop), if drain_deadline.is_none() => {
                    tracing::info!(in_flight = self.in_flight_events, "shutting down: draining in-flight events");
                    self.drop_held_events();
                    drain_deadline = Some(tokio::time::Instant::now() + self.settings.shutdown_timeout);
                }
                finished = finished_rx.recv() => match finished {
                    Some(Finished::Events(events)) => {
                        let now = protocol::pg_timestamp_micros(std::time::SystemTime::now());
                        let mut published = 0;
                        for (tag, bytes) in events {
                            if tag.hand_off {
                                self.hand_offs_in_flight = self.hand_offs_in_flight.saturating_sub(1);
                            } else {
                                self.delivery_reported(tag.produced);
                                published += 1;
                                crate::metrics::commit_to_ack((now - tag.commit_micros).max(0) as f64 / 1e6);
                            }
                            self.finish_event(tag.txn, bytes);
                        }
                        crate::metrics::published("cdc", published);
                    }
                    Some(Finished::HandOffs { handed_off, rowless }) => {
                        self.publish_rowless_hand_offs(&handed_off, &rowless).await?;
                    }
                    Some(Finished::Undelivered(deliveries)) => self.undelivered(deliveries)?,
                    Some(Finished::Failed(error)) => {
                        crate::metrics::publish_error(match error {
                            Error::Kafka { .. } => "delivery",
                            _ => "database",
                        });
                        return Err(error);
                    }
                    None => return Err(Error::Kafka { message: "the backfill task stopped".into(), transient: true }),
                },
                message = stream.next_message(), if window_open && drain_deadline.is_none() && !self.pausing_for_check && !self.restart_after_hand_offs && self.failing.is_none() => {
                    reply_now = self.handle(message.map_err(replication_error)?).await?;
                }
                _ = status_timer.tick() => reply_now = true,
                _ = sleep_until_opt(self.oldest_outstanding().map(|at| at + self.delivery_timeout)), if self.failing.is_none() => {
                    let timeout = self.delivery_timeout;
                    self.give_up(format!("an event waited {timeout:?} (message.timeout.ms) for its delivery report; {} are outstanding", self.outstanding.len()));
                }
                _ = tokio::time::sleep_until(next_unblock_check), if self.gate.has_blocked() && drain_deadline.is_none() && self.failing.is_none() => {
                    let started = tokio::time::Instant::now();
                    self.unblock_drained_aggregates().await?;
                    next_unblock_check = tokio::time::Instant::now() + UNBLOCK_CHECK.max(started.elapsed() * UNBLOCK_CHECK_COST_FACTOR);
                }
                _ = sleep_until_opt(drain_deadline) => {
                    tracing::warn!(in_flight = self.in_flight_events, "shutdown timeout reached; unacknowledged events will be re-sent on the next start");
                    break;
                }
            }
            if let Some((failure, since)) = &self.failing {
                let reported = self.outstanding.is_empty() && self.hand_offs_in_flight == 0;
                if reported || since.elapsed() > self.delivery_timeout {
                    // Everything acknowledged before the failure is confirmed first.
                    let confirmed = self.watermark.advance();
                    stream.send_status(confirmed).await?;
                    self.watermark.reported();
                    if let Some(refused) = self.refused_without_polling.take() {
                        return Err(Error::Kafka {
                            message: refused,
                            transient: false,
                        });
                    }
                    return Err(Error::Kafka {
                        message: format!("{failure}; re-sending what was not acknowledged"),
                        transient: true,
                    });
                }
            }
            if self.restart_after_hand_offs && self.hand_offs_in_flight == 0 {
                return Err(Error::SessionRestart(format!(
                    "more than {MAX_TRACKED_BLOCKED} aggregates of one table wait in the polling path"
                )));
            }
            if self.pausing_for_check && self.hand_offs_in_flight == 0 {
                next_unblock_check = tokio::time::Instant::now();
            }
            // Buffered replayed rows count against the window: flush them before it can block reading.
            if !self.replay_buffer.is_empty()
                && self.failing.is_none()
                && (self.replay_buffer.len() >= REPLAY_BATCH || !self.window_open())
            {
                self.flush_replay_buffer().await?;
            }
            // A window full behind parked events (acknowledged ones waiting for them to be confirmable) opens
            // only once they finish: with nothing else in flight, hand them to the polling path.
            if self.gate.parked_len() > 0
                && self.failing.is_none()
                && !self.window_open()
                && self.in_flight_events <= self.gate.parked_len()
            {
                self.hand_off_every_parked()?;
            }
            let confirmed = self.watermark.advance();
            // A window full of acknowledged events opens only once the server is told: tell it now.
            let tell_now = last_sent_at.elapsed() >= MIN_CONFIRM_GAP || !self.window_open();
            if reply_now || (confirmed > last_sent && tell_now) {
                stream.send_status(confirmed).await?;
                self.watermark.reported();
                if confirmed > last_sent {
                    tracing::debug!(%confirmed, "confirmed");
                }
                last_sent = confirmed;
                last_sent_at = Instant::now();
            }
            if drain_deadline.is_some() && self.in_flight_events == 0 {
                break;
            }
        }
        stream.send_status(self.watermark.advance()).await?;
        self.watermark.reported();
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
                if left_replay_region {
                    self.flush_replay_buffer().await?;
                }
            }
            Decoded::Event { pending, look_up } => {
                self.start_event(pending.tag.txn, pending.event.size_bytes());
                // Re-sent and replayed rows are checked first (see `flush_replay_buffer`).
                if look_up {
                    self.replay_buffer.push(pending);
                } else {
                    self.publish(pending).await?;
                }
            }
            Decoded::Invalid { pending, column } => {
                tracing::warn!(event_id = %pending.event_id, column, "row has a NULL required column; handing it to the polling path to dead-letter");
                self.start_event(pending.tag.txn, pending.event.size_bytes());
                self.hand_off(
                    pending.tag,
                    &pending.event,
                    pending.event_id,
                    HandOffReason::Invalid,
                )?;
            }
            Decoded::Nothing => {}
        }
        Ok(())
    }

    /// Room for another event: the events window counts acknowledged events until the server was told (a
    /// crash re-sends them too, so the window bounds duplicates); the bytes window only what is in flight.
    fn window_open(&self) -> bool {
        let unreported = usize::try_from(self.watermark.unreported_events()).unwrap_or(usize::MAX);
        self.in_flight_events.saturating_add(unreported) < self.settings.max_in_flight_events
            && self.in_flight_bytes < self.settings.max_in_flight_bytes
    }

    fn start_event(&mut self, txn: TxnId, bytes: usize) {
        self.watermark.event_started(txn);
        self.in_flight_events += 1;
        self.in_flight_bytes += bytes;
    }

    fn finish_event(&mut self, txn: TxnId, bytes: usize) {
        self.watermark.event_finished(txn);
        self.in_flight_events = self.in_flight_events.saturating_sub(1);
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(bytes);
    }

    /// Publishes one event, or holds it back when its aggregate has events waiting in the polling path
    /// (see [`gate`]). An event the producer refuses for good (e.g. too large) goes to the polling path,
    /// which retries and dead-letters it; its aggregate is blocked behind it, so order per aggregate holds.
    async fn publish(&mut self, pending: Pending) -> Result<()> {
        match self
            .gate
            .admit(pending.tag.table, pending, |p| aggregate_of(&p.event))
        {
            Admission::Publish(p) => self.produce(p.tag, &p.event, p.event_id).await,
            Admission::Parked => Ok(()),
            Admission::HandOff(events) => self.hand_off_blocked(&events),
        }
    }

    /// Hands one event to the producer; a permanent refusal (or a topic the broker refused outright, see
    /// [`TopicHolds`]) sends it to the polling path.
    async fn produce(&mut self, tag: CdcTag, event: &OutboxEvent, event_id: Uuid) -> Result<()> {
        if self.failing.is_some() {
            // Given up: the event stays unfinished and is re-sent by the next session.
            return Ok(());
        }
        let topic = self
            .settings
            .topic
            .render_event(&self.settings.database.tables[tag.table].name, event);
        let held = self.outbox_sql[tag.table].can_hand_off()
            && self
                .topic_holds
                .is_held(&topic, tokio::time::Instant::now());
        let tag = CdcTag {
            produced: self.next_produced,
            ..tag
        };
        let published = if held {
            Err(PublishError::Rejected(Rejection {
                permanent: true,
                topic_wide: true,
                ..Rejection::transient(format!("topic {topic} was refused by the broker"))
            }))
        } else {
            self.publisher
                .publish(&topic, event, event_id, tag, None)
                .await
        };
        match published {
            Ok(()) => {
                self.outstanding
                    .insert(self.next_produced, tokio::time::Instant::now());
                self.next_produced += 1;
                self.published += 1;
                Ok(())
            }
            Err(PublishError::Rejected(rejection))
                if rejection.permanent && self.outbox_sql[tag.table].can_hand_off() =>
            {
                if !held {
                    tracing::warn!(%event_id, aggregate_id = %event.aggregate_id, error = %rejection.reason, "event refused by the producer; handing it and its aggregate to the polling path");
                }
                let parked = self.gate.refused((tag.table, aggregate_of(event)));
                let reason = if rejection.topic_wide {
                    HandOffReason::TopicRefused
                } else {
                    HandOffReason::Refused
                };
                self.hand_off(tag, event, event_id, reason)?;
                self.hand_off_blocked(&parked)?;
                if self.gate.blocked_in(tag.table) > MAX_TRACKED_BLOCKED {
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
                    "the producer did not take event {event_id}: {}",
                    rejection.reason
                ));
                Ok(())
            }
            Err(error) => Err(error.into()),
        }
    }

    /// A delivery report arrived for the event handed to the producer as `produced`.
    fn delivery_reported(&mut self, produced: u64) {
        self.outstanding.remove(&produced);
    }

    /// When the longest-waiting event still without a delivery report was handed to the producer.
    fn oldest_outstanding(&self) -> Option<tokio::time::Instant> {
        self.outstanding.first_key_value().map(|(_, at)| *at)
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
    /// order; an event the broker refused for good (too large, not authorised, invalid) would only be
    /// refused again, so it goes to the polling path first (its aggregate waits behind it there), and a
    /// topic refused outright is held (see [`TopicHolds`]).
    fn undelivered(&mut self, deliveries: Vec<Delivery<CdcTag>>) -> Result<()> {
        for delivery in deliveries {
            self.delivery_reported(delivery.tag.produced);
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
            tracing::warn!(event_id = %delivery.event_id, error = %rejection.reason, "event refused by the broker after the producer accepted it; handing it and its aggregate to the polling path");
            if let (true, Some(topic)) = (rejection.topic_wide, &rejection.topic) {
                let now = tokio::time::Instant::now();
                // Once per refusal, not once per event refused with it (all were in flight already).
                if !self.topic_holds.is_held(topic, now) {
                    let hold = self.topic_holds.hold(topic, now);
                    tracing::warn!(%topic, ?hold, error = %rejection.reason, "the broker refuses this topic: its events go to the polling path (retried with backoff) for a while");
                }
            }
            let placeholder = placeholder_event(&delivery.event_id.to_string());
            let reason = if rejection.topic_wide {
                HandOffReason::TopicRefused
            } else {
                HandOffReason::Refused
            };
            self.hand_off_sized(
                delivery.tag,
                &placeholder,
                delivery.event_id,
                delivery.bytes,
                reason,
            )?;
        }
        Ok(())
    }

    fn hand_off(
        &mut self,
        tag: CdcTag,
        event: &OutboxEvent,
        event_id: Uuid,
        reason: HandOffReason,
    ) -> Result<()> {
        self.hand_off_sized(tag, event, event_id, event.size_bytes(), reason)
    }

    /// `bytes`: what the event counts against the in-flight window.
    fn hand_off_sized(
        &mut self,
        tag: CdcTag,
        event: &OutboxEvent,
        event_id: Uuid,
        bytes: usize,
        reason: HandOffReason,
    ) -> Result<()> {
        let tag = CdcTag {
            hand_off: true,
            ..tag
        };
        let item = Delivery {
            tag,
            event_id,
            bytes,
            result: Ok(()),
        };
        self.hand_offs.send(item).map_err(|_| Error::Kafka {
            message: "the backfill task stopped".into(),
            transient: true,
        })?;
        self.hand_offs_in_flight += 1;
        self.handed_off += 1;
        self.hand_offs_unwritten.insert(
            event_id,
            HandedOff {
                tag,
                event: event.clone(),
                reason,
                bytes,
            },
        );
        Ok(())
    }

    /// The backfill wrote (or tried to write) `handoff_at` for `handed_off`; `rowless` had no row left. A
    /// blocked aggregate's event without a row is published from the stream now (possibly ahead of its
    /// aggregate's earlier events, which is better than never); a refused or invalid one cannot be retried
    /// or dead-lettered without its row, and is reported.
    async fn publish_rowless_hand_offs(
        &mut self,
        handed_off: &[Uuid],
        rowless: &[Uuid],
    ) -> Result<()> {
        let rowless: HashSet<&Uuid> = rowless.iter().collect();
        let mut rowless_events = Vec::new();
        for event_id in handed_off {
            if let Some(handed) = self.hand_offs_unwritten.remove(event_id) {
                if rowless.contains(event_id) {
                    rowless_events.push((*event_id, handed));
                }
            }
        }
        for (event_id, handed) in rowless_events {
            if handed.reason == HandOffReason::TopicRefused {
                // Nothing can retry it but the stream, once the broker lets its topic be written: kept
                // unfinished (the hand-off's finish is balanced here), so the slot stays before it.
                self.start_event(handed.tag.txn, handed.bytes);
                self.give_up(format!("event {event_id} has no row (deleted by its own transaction) and the broker refuses its topic: it stays unconfirmed and is re-sent from the slot"));
                continue;
            }
            if handed.reason != HandOffReason::Blocked {
                tracing::error!(%event_id, reason = ?handed.reason, "event could not be published and its row was deleted by its own transaction: it cannot be retried or dead-lettered");
                continue;
            }
            tracing::warn!(%event_id, aggregate_id = %handed.event.aggregate_id, "handed-off event has no row (deleted by its own transaction): publishing it from the stream, possibly ahead of earlier events of its aggregate");
            let tag = CdcTag {
                hand_off: false,
                ..handed.tag
            };
            self.start_event(tag.txn, handed.event.size_bytes());
            self.produce(tag, &handed.event, event_id).await?;
        }
        Ok(())
    }

    /// Hands held events of blocked aggregates to the polling path, in order.
    fn hand_off_blocked(&mut self, events: &[Pending]) -> Result<()> {
        for pending in events {
            self.hand_off(
                pending.tag,
                &pending.event,
                pending.event_id,
                HandOffReason::Blocked,
            )?;
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
        self.hand_off_blocked(&parked)
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
            pending.extend(aggregates.into_iter().map(|aggregate| (table, aggregate)));
        }
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
        let mut states: HashMap<(usize, Uuid), bool> = HashMap::new();
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
        for pending in std::mem::take(&mut self.replay_buffer) {
            // A row gone: a re-sent one was finished before (deleted after publishing, or by retention); a
            // replayed one may have been deleted by its own transaction and is published from the stream.
            // A re-sent row that exists unfinished lost its marks (a server restored from a snapshot taken
            // before they were written): it is published again.
            let finished = states
                .get(&(pending.tag.table, pending.event_id))
                .copied()
                .unwrap_or(pending.tag.resent);
            if finished {
                self.finish_event(pending.tag.txn, pending.event.size_bytes());
                self.skipped_already_published += 1;
            } else if self
                .gate
                .is_blocked(pending.tag.table, || aggregate_of(&pending.event))
            {
                // What waits in the polling path for this aggregate may be *later* than this replayed event
                // (handed off by the session that failed to deliver it): parking it would publish it after
                // them. The polling path orders it among them by position.
                self.hand_off_blocked(std::slice::from_ref(&pending))?;
            } else {
                self.publish(pending).await?;
            }
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
            self.in_flight_events = self.in_flight_events.saturating_sub(1);
            self.in_flight_bytes = self
                .in_flight_bytes
                .saturating_sub(pending.event.size_bytes());
        }
    }
}

/// Drops a slot whose creation could not be completed; failures are only logged (the next session sees a
/// slot without hand-off and the operator is told).
async fn drop_slot_after_failed_creation(sql: &tokio_postgres::Client, slot: &str) {
    for _ in 0..20 {
        match sql
            .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await
        {
            Ok(_) => return,
            // The walsender that created it may still hold it for a moment.
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
    tracing::error!(
        slot,
        "could not drop the half-created slot; drop it by hand and restart outboxd"
    );
}

async fn sleep_until_opt(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
