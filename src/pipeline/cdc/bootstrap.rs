//! A replication session's start: its connections (both on one server), the slot checked against the
//! server's history (lost, half-created, another history: see `history`), created with the hand-off of
//! older rows when missing, streaming started from the right position, and the aggregates that wait in the
//! polling path read into the gate.
//!
//! It decides which position the watermark starts from; it does not stream (see `session`).

use tokio_postgres::Client;

use super::decoder::Pending;
use super::gate::AggregateGate;
use super::{CdcPipeline, MAX_TRACKED_BLOCKED};
use crate::config::RunSettings;
use crate::error::{replication_error, Error, Result};
use crate::lsn::Lsn;
use crate::pg::outbox::{self, OutboxSql};
use crate::pg::replication::{
    ReplicationConnection, ReplicationError, ReplicationStream, SystemIdentity,
};
use crate::pg::version::ServerVersion;
use crate::pg::{self, slot};
use crate::pipeline::history::{self, HistoryChange, Reached, ServerHistory, SlotOnTimeline};
use crate::sink::Sinks;

/// What a session streams with.
pub(super) struct Bootstrapped {
    pub sql: Client,
    /// Statements per outbox table, in `settings.database.tables` order.
    pub outbox_sql: Vec<OutboxSql>,
    /// The server's WAL end when the session connected: transactions committed before it may have been
    /// published by an earlier run (the replay region).
    pub replay_end: Lsn,
    pub gate: AggregateGate<Pending>,
    /// The server history the session streams from.
    pub history: ServerHistory,
    /// Where the slot starts when this session created it.
    pub slot_created_at: Option<Lsn>,
}

impl<K: Sinks> CdcPipeline<K> {
    pub(super) async fn bootstrap(&mut self) -> Result<(ReplicationStream, Bootstrapped)> {
        let settings = self.settings.clone();
        let db = &settings.database;
        let (mut sql, outbox_sql, mut conn, identity, version) = connect(&settings).await?;
        // A lost slot is replaced only when every table's gap can be covered by the polling path.
        if crate::pipeline::has_polling_columns(&settings) {
            slot::drop_if_lost(&sql, &db.slot, &db.tables).await?;
        }
        // Rows the slot will never send can be handed to the polling path (of the tables that have it).
        if db.tables.iter().any(|t| t.polling) {
            slot::undo_interrupted_creation(&sql, &db.slot).await?;
        }
        let mut existing = slot::check_existing_slot(&sql, &db.slot).await?;
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
        let mut slot_position = existing
            .as_ref()
            .map(|state| state.confirmed_flush().unwrap_or(Lsn::ZERO));
        // A slot that moved on another timeline past where this one left it would skip this timeline's
        // transactions in between: a synchronised copy (PostgreSQL checks a copy against the WAL its standby
        // flushed, not what it replayed) on a standby promoted at a recovery target, or a restored copy of
        // one. Judged after a new timeline since this process streamed (any slot), and, by a process that
        // did not stream here (a restart, a standby instance taking over), for a synchronised copy; not on
        // a timeline where outboxd marked streaming (the slot moved on it), unless this process streamed on
        // a later timeline since (the server is an old primary). A slot that does not fit is
        // dropped and a new slot hands the unpublished rows to the polling path; without polling columns
        // nothing could cover it, and outboxd stops, naming why.
        let synced = existing.as_ref().is_some_and(|s| s.synced == Some(true));
        let marked = slot_position.is_some()
            && identity.timeline > 1
            && slot::marked_on_timeline(&sql, &db.slot, identity.timeline).await?;
        if let Some(position) = slot_position {
            let moved_on = match &change {
                // A server behind the timeline this process streamed on (an old primary, reached again
                // before it was fenced) is off the slot's history whatever outboxd once marked there.
                Some(HistoryChange::NewTimeline { old, .. }) if *old > identity.timeline => {
                    Some(Some(*old))
                }
                _ if marked => None,
                Some(HistoryChange::NewTimeline { old, .. }) => Some(Some(*old)),
                None if self.history.is_none() && identity.timeline > 1 && synced => Some(None),
                _ => None,
            };
            if let Some(moved_on) = moved_on {
                let verdict = if moved_on.is_some_and(|old| old > identity.timeline) {
                    SlotOnTimeline::OffHistory
                } else {
                    let file = conn
                        .timeline_history(identity.timeline)
                        .await
                        .map_err(replication_error)?;
                    history::slot_on_timeline(&file, moved_on, position)
                };
                match verdict {
                    SlotOnTimeline::Fits => {}
                    SlotOnTimeline::OffHistory => {
                        return Err(off_history(&db.slot, moved_on, identity.timeline))
                    }
                    SlotOnTimeline::PastFork(fork) => {
                        let problem = format!("replication slot {} is at {position}, past {fork}, where timeline {} left the timeline the slot moved on: streaming from it would skip this timeline's transactions in between", db.slot, identity.timeline);
                        if !crate::pipeline::has_polling_columns(&settings) {
                            return Err(Error::setup(problem, "publish (or re-insert) the rows committed on this timeline since it began yourself, drop the slot, then restart outboxd; `outboxd migrate --add-polling-columns` lets outboxd cover such gaps by itself"));
                        }
                        slot::check_free_slot_to_replace(&sql, &db.slot).await?;
                        tracing::warn!(
                            %problem,
                            "dropping the replication slot so a new slot hands the unpublished rows to the polling path"
                        );
                        // What the slot streamed of this timeline ends at the fork at most.
                        outbox::republish_history_a_lost_slot_owed(&sql, &db.tables, fork).await?;
                        slot::drop_own_slot(&sql, &db.slot).await?;
                        existing = None;
                        slot_position = None;
                    }
                }
            }
        }
        if let Some(change) = &change {
            match (change, existing.as_ref(), slot_position) {
                // A promoted standby that kept a copy of the slot (a failover slot, PostgreSQL 17+), within
                // where the new timeline began (checked above): logged as such, and otherwise the same as any
                // existing slot on a new timeline (streamed from its own position). CDC-only tables still stop
                // here (`history_changed`): the check above needs the polling path to cover a slot it drops.
                (HistoryChange::NewTimeline { old, new }, Some(state), Some(position))
                    if state.synced == Some(true)
                        && position <= identity.xlog_position
                        && crate::pipeline::has_polling_columns(&settings) =>
                {
                    tracing::info!(
                        slot = %db.slot,
                        old_timeline = old,
                        new_timeline = new,
                        %position,
                        "a promoted standby: continuing from the failover slot synchronised to it (no hand-off, nothing swept; events after its position are sent again)"
                    );
                    crate::metrics::failover_slot_used();
                }
                _ => self.history_changed(change, &here, identity.xlog_position)?,
            }
            // At once, before anything below can fail: the old position never pairs with the new history.
            self.watermark.reset(slot_position.unwrap_or(Lsn::ZERO));
            self.memory.failover_after = None;
        }
        // A slot on a timeline after the first that outboxd never streamed from there (not this process, not
        // one that marked it), and that PostgreSQL did not synchronise, was copied from an earlier timeline
        // by other means (Patroni's permanent slots, pg_failover_slots, a file-level copy). Such tools move a
        // copy as far as their standby replayed, so it may rest between an event and its hand-off on a
        // standby that lacked the hand-off: that event is owed to nobody. Every unpublished row goes to the
        // polling path (those the slot sends again are found handed off and skipped by the stream), and that
        // hand-off is protected as any other: nothing between the slot and its end is confirmed, and the slot
        // is not a failover slot until confirmed past it (a copy synchronised from here meanwhile could rest
        // before it on a standby that lacks it).
        let copied = slot_position.is_some()
            && identity.timeline > 1
            && !marked
            && !synced
            && self.history.as_ref() != Some(&here)
            && db.tables.iter().any(|t| t.polling);
        // Another process holds it (a tool advancing the copy, a client): nothing is swept or streamed until
        // it lets go, retried as a busy slot is (streaming first and sweeping never would lose the event).
        if copied && existing.as_ref().is_some_and(|s| s.active) {
            return Err(Error::Replication(ReplicationError::Server {
                severity: "ERROR".into(),
                code: "55006".into(),
                message: format!("replication slot \"{}\" is active: it was copied from an earlier timeline by other means, and outboxd hands its unpublished rows to the polling path before streaming from it", db.slot),
                detail: None,
            }));
        }
        let swept = if copied {
            let handed_off = outbox::hand_off_unpublished_rows(&mut sql, &db.tables).await?;
            let end = pg::current_wal_position(&sql).await?;
            tracing::warn!(
                slot = %db.slot,
                timeline = identity.timeline,
                handed_off_to_polling = handed_off,
                confirming_nothing_before = %end,
                "the replication slot was copied from an earlier timeline without PostgreSQL's slot synchronisation (Patroni, pg_failover_slots, a file copy): such a copy may rest past an event whose hand-off this server lacks, so every unpublished row was handed to the polling path (some are published twice)"
            );
            Some(end)
        } else {
            None
        };
        let conn = match slot_position {
            // The slot belongs to the server's own history: stream from its position (what lies between it
            // and a higher position confirmed before is re-sent and recognised).
            Some(position) => {
                self.watermark.resume_at(position);
                if let Some(end) = swept {
                    self.watermark.hold_until(end);
                }
                if let Some(state) = &existing {
                    self.set_failover(&mut conn, state, version, identity.xlog_position, swept)
                        .await?;
                }
                conn
            }
            None => self.create_slot(&mut sql, conn, version).await?,
        };
        let start = self.watermark.confirmed();
        let slot_created_at = slot_position.is_none().then_some(start);
        let stream = conn
            .start_replication(&db.slot, start, &db.publication)
            .await
            .map_err(replication_error)?;
        tracing::info!(slot = %db.slot, %start, server_wal_end = %identity.xlog_position, "streaming from replication slot");
        // This history is the position's from now on (not before: a session that fails before streaming
        // must not make a slot it never streamed from look like one that vanished). Marked on the server too,
        // before anything is confirmed, for a process that starts after this one.
        self.history = Some(here.clone());
        if let Err(error) = slot::mark_on_timeline(&sql, &db.slot, identity.timeline).await {
            tracing::warn!(%error, slot = %db.slot, timeline = identity.timeline, "could not mark streaming on this timeline (a physical slot that reserves no WAL; max_replication_slots?): each process started later cannot tell the slot from a copy made by other means, and hands every unpublished row to the polling path at its start (duplicates)");
        }
        // Read only now that this session holds the slot: an instance that led before may have handed off
        // rows until it let go of it.
        let mut gate = blocked_aggregates(&settings, &sql).await?;
        // Aggregates of events a session gave up after the broker refused them for good hand off from the
        // start: their events come again in the replay region, the refused one and earlier ones alike.
        for aggregate in self.memory.owed.aggregates() {
            let _ = gate.refused(aggregate.clone());
        }
        let boot = Bootstrapped {
            sql,
            outbox_sql,
            replay_end: identity.xlog_position,
            gate,
            history: here,
            slot_created_at,
        };
        Ok((stream, boot))
    }

    /// Creates the slot and hands the unpublished rows older than it to the polling path, through the
    /// slot's exported snapshot; the watermark starts at its consistent point.
    async fn create_slot(
        &mut self,
        sql: &mut Client,
        mut conn: ReplicationConnection,
        version: ServerVersion,
    ) -> Result<ReplicationConnection> {
        let db = &self.settings.database;
        let can_hand_off = db.tables.iter().any(|t| t.polling);
        slot::check_publication(sql, db).await?;
        if can_hand_off {
            slot::begin_creation(sql, &db.slot).await?;
        }
        // A slot whose older rows are handed off is not a failover slot before it is confirmed past the
        // hand-off: a standby's copy made at the consistent point could be promoted without the hand-off,
        // and nothing would publish those rows.
        let failover = db.failover_slot && version.has_failover_slots();
        let created = conn
            .create_logical_slot(&db.slot, version, failover && !can_hand_off)
            .await
            .map_err(replication_error)?;
        let mut hand_off_end = None;
        let handed_off = if can_hand_off {
            match outbox::hand_off_rows_older_than_slot(sql, &db.tables, &created.snapshot_name)
                .await
            {
                Ok(count) => {
                    slot::finish_creation(sql, &db.slot).await?;
                    if count > 0 {
                        hand_off_end = Some(pg::current_wal_position(sql).await?);
                    }
                    count
                }
                Err(error) => {
                    // Without the hand-off, rows older than the slot would never be published: drop the
                    // slot so that the next attempt creates it (and exports a snapshot) again.
                    drop(conn);
                    drop_slot_after_failed_creation(sql, &db.slot).await;
                    return Err(error);
                }
            }
        } else {
            tracing::warn!("the table has no polling columns: rows older than the slot are not published (run `outboxd migrate`)");
            0
        };
        // Never carry a position over to a new slot: anything between its consistent point and an older,
        // higher position would be skipped.
        self.watermark.reset(created.consistent_point);
        self.memory.failover_after = None;
        let failover_now = failover && (!can_hand_off || hand_off_end.is_none());
        // The hand-off was committed after the consistent point: no position in between is confirmed (see
        // `Watermark::hold_until`; a copy of the slot may be kept by other means than a failover slot).
        if let Some(end) = hand_off_end {
            self.watermark.hold_until(end);
        }
        if failover && can_hand_off {
            match hand_off_end {
                // The slot fails over once confirmed past the hand-off.
                Some(end) => self.memory.failover_after = Some(end),
                // Nothing handed off: a copy at the consistent point owes nothing.
                None => conn
                    .alter_slot_failover(&db.slot, true)
                    .await
                    .map_err(replication_error)?,
            }
        }
        tracing::info!(
            slot = %db.slot,
            consistent_point = %created.consistent_point,
            handed_off_to_polling = handed_off,
            failover = failover_now,
            failover_once_confirmed_past = ?self.memory.failover_after,
            "created replication slot"
        );
        Ok(conn)
    }

    /// Makes the existing slot a failover slot (17+), or not with `--no-failover-slot`, when it is not
    /// already. A failover slot only once it is confirmed past every hand-off written before
    /// (`SessionMemory::failover_after`, at the latest `wal_end`, the server's WAL end now): a standby's
    /// copy starts where the slot is, and one resting between an event and its hand-off, on a standby that
    /// lacks the hand-off, would be promoted with the event owed to nobody. Until then the session streams,
    /// and ends once it confirmed that position (see `session`).
    async fn set_failover(
        &mut self,
        conn: &mut ReplicationConnection,
        state: &slot::SlotState,
        version: ServerVersion,
        wal_end: Lsn,
        swept: Option<Lsn>,
    ) -> Result<()> {
        let wanted = self.settings.database.failover_slot;
        let Some(current) = state.failover else {
            return Ok(());
        };
        // Rows were just handed off (a slot copied by other means): a failover slot only once confirmed past
        // that hand-off, so one that is already goes back to being a plain slot (PostgreSQL then drops the
        // copies its standbys synchronised, which could rest before the hand-off).
        if let Some(end) = swept {
            if wanted && version.has_failover_slots() {
                self.memory.failover_after =
                    Some(self.memory.failover_after.map_or(end, |a| a.max(end)));
            }
            // Not held by another walsender: a copied slot that is held is not swept (see `bootstrap`).
            if current {
                conn.alter_slot_failover(&state.slot_name, false)
                    .await
                    .map_err(replication_error)?;
                tracing::info!(slot = %state.slot_name, failover_once_confirmed_past = %end, "the replication slot is a plain slot until confirmed past the rows just handed off");
            }
            return Ok(());
        }
        if current == wanted || !version.has_failover_slots() {
            self.memory.failover_after = None;
            return Ok(());
        }
        // A slot another walsender holds cannot be altered (PostgreSQL may wait for it): START_REPLICATION
        // then says who holds it, and the next session alters it (the position owed is kept).
        if state.active {
            return Ok(());
        }
        if wanted {
            let after = *self.memory.failover_after.get_or_insert(wal_end);
            let position = state.confirmed_flush().unwrap_or(Lsn::ZERO);
            if position < after {
                tracing::info!(slot = %state.slot_name, %position, failover_once_confirmed_past = %after, "the replication slot becomes a failover slot once confirmed past the hand-offs written before (a session ends then to change it)");
                return Ok(());
            }
        }
        conn.alter_slot_failover(&state.slot_name, wanted)
            .await
            .map_err(replication_error)?;
        self.memory.failover_after = None;
        tracing::info!(slot = %state.slot_name, failover = wanted, "changed the replication slot's failover setting");
        Ok(())
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
        if !crate::pipeline::has_polling_columns(&self.settings) {
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
}

/// The SQL connection (not to a standby) with each table's statements prepared, and the replication
/// connection, both on one server.
async fn connect(
    settings: &RunSettings,
) -> Result<(
    Client,
    Vec<OutboxSql>,
    ReplicationConnection,
    SystemIdentity,
    ServerVersion,
)> {
    let db = &settings.database;
    let sql = pg::connect(&db.database_url).await?;
    if pg::in_recovery(&sql).await? {
        return Err(Error::in_recovery());
    }
    let version = pg::server_version(&sql).await?;
    if !version.check_supported()? {
        tracing::warn!(%version, "outboxd is tested on PostgreSQL {} to {}; this newer major is not", pg::version::OLDEST_SUPPORTED, pg::version::NEWEST_TESTED);
    }
    let mut outbox_sql = Vec::with_capacity(db.tables.len());
    for table in &db.tables {
        outbox_sql.push(OutboxSql::prepare(&sql, table).await?);
    }
    // Dead-peer detection as on the leadership connection: a silent server ends the session.
    let url = crate::pipeline::liveness::with_dead_peer_detection(&db.replication_url);
    let mut conn = ReplicationConnection::connect(&url)
        .await
        .map_err(replication_error)?;
    let identity = conn.identify_system().await.map_err(replication_error)?;
    if conn.in_recovery().await.map_err(replication_error)? {
        return Err(Error::replication_on_standby(true));
    }
    // The slot is inspected over SQL and streamed from over replication: during a switchover the two
    // connections can reach two servers, of two clusters or of one (the old primary still answering while
    // its standby is promoted: the same system identifier).
    let sql_started = pg::server_started_at(&sql).await?;
    let replication_started = conn.server_started_at().await.map_err(replication_error)?;
    let sql_system = pg::system_identifier(&sql).await?;
    if sql_started != replication_started
        || sql_system
            .as_ref()
            .is_some_and(|system| *system != identity.system_id)
    {
        return Err(Error::NotReady {
            problem: format!(
                "the SQL connection and the replication connection reached two servers (SQL: system {}, postmaster started at {sql_started}; replication: system {}, started at {replication_started})",
                sql_system.as_deref().unwrap_or("unknown"),
                identity.system_id
            ),
            fix: "point --database-url and --replication-url at the same server".into(),
            waiting_for: "both connections to reach one server (a switchover under way)".into(),
        });
    }
    Ok((sql, outbox_sql, conn, identity, version))
}

/// The server is off the history the slot moved on (`moved_on`, when known): nothing is dropped or streamed.
fn off_history(slot: &str, moved_on: Option<u32>, timeline: u32) -> Error {
    let moved_on = moved_on
        .map(|t| format!("timeline {t}"))
        .unwrap_or_else(|| "an earlier timeline".into());
    Error::NotReady {
        problem: format!("the server is on timeline {timeline}, which does not descend from {moved_on}, where replication slot {slot} last moved (an old primary not fenced yet, or a sibling of a split brain)"),
        fix: "fence the old primary and point --database-url and --replication-url at the promoted server".into(),
        waiting_for: "the server of the slot's history (a switchover under way)".into(),
    }
}

/// The aggregates with rows waiting in the polling path, per table with polling columns; a table with more
/// than [`MAX_TRACKED_BLOCKED`] is held whole.
async fn blocked_aggregates(
    settings: &RunSettings,
    sql: &Client,
) -> Result<AggregateGate<Pending>> {
    // A blocked aggregate parks up to its share of the in-flight window, then hands off.
    let mut gate = AggregateGate::new(settings.cdc.max_in_flight_events / 8);
    let tables = settings.database.tables.iter().enumerate();
    for (index, table) in tables.filter(|(_, t)| t.polling) {
        let pending = outbox::aggregates_pending_hand_off(sql, table, MAX_TRACKED_BLOCKED).await?;
        if pending.len() > MAX_TRACKED_BLOCKED {
            tracing::info!(table = %table.name, "more than {MAX_TRACKED_BLOCKED} aggregates wait in the polling path: handing it every event of the table until it has drained them");
            gate.hold_table(index);
            continue;
        }
        for (aggregate, held) in pending {
            if held {
                gate.block_handing_off((index, aggregate));
            } else {
                gate.block((index, aggregate));
            }
        }
    }
    Ok(gate)
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
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(250)).await,
        }
    }
    tracing::error!(
        slot,
        "could not drop the half-created slot; drop it by hand and restart outboxd"
    );
}
