//! Backfill: turns broker acknowledgements into `published_at` writes, one UPDATE per batch, and reports
//! each event as finished only after its row is written (so the slot never runs ahead of the table), with
//! the end of the hand-offs among them (so that no copy of a failover slot runs ahead of a standby's table).
//!
//! Failed deliveries go to the session as they are (it hands refused events to the polling path and
//! re-sends the rest). Any database failure ends the session instead of being retried here: while
//! PostgreSQL shuts down, its walsender waits for the client to confirm everything sent, so holding the
//! replication connection open while waiting for the database would stall the shutdown until
//! `wal_sender_timeout`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use uuid::Uuid;

use crate::error::Error;
use crate::event::RowImage;
use crate::lsn::Lsn;
use crate::pg::{self, outbox, outbox::OutboxSql};
use crate::pipeline::watermark::TxnId;
use crate::sink::Delivery;
use crate::table::OutboxTable;

/// What the CDC path attaches to each event it hands to the producer or to the polling path.
#[derive(Debug, Clone, Copy)]
pub struct CdcTag {
    /// The transaction of the event in the watermark.
    pub txn: TxnId,
    /// Index of the event's outbox table in `settings.database.tables`.
    pub table: usize,
    /// The PostgreSQL transaction that inserted the event.
    pub xid: u32,
    /// Its commit time (microseconds since 2000-01-01), for commit-to-ack latency.
    pub commit_micros: i64,
    /// True: not published; set `handoff_at` so the polling path publishes it.
    pub hand_off: bool,
    /// True: of a transaction the server re-sends (confirmed before on this history): produced again only
    /// if its row exists without the marks of what was done with it (a server restored from an older
    /// snapshot).
    pub resent: bool,
    /// Which hand-over to the producer this is (see the session's outstanding deliveries); 0 before.
    pub produced: u64,
}

/// Most events marked by one UPDATE.
pub const MAX_BATCH: usize = 2_000;

/// The rows (as inserted) of events on their way to the polling path, by event id: the session puts each in
/// before it sends the hand-off, the backfill takes it out once the hand-off is written, and writes it back
/// should its row be gone.
pub type HandOffRows = Arc<Mutex<HashMap<Uuid, RowImage>>>;

/// How the session reaches the backfill task with what it does not produce: hand-offs (and events already in
/// Kafka to mark) on the delivery channel, and the rows of the hand-offs beside it.
#[derive(Clone)]
pub struct ToBackfill {
    /// The backfill task's delivery channel (the producer's reports travel on it too).
    pub deliveries: UnboundedSender<Delivery<CdcTag>>,
    /// The rows of hand-offs on their way.
    pub rows: HandOffRows,
}

/// What the backfill task reports to the session.
#[derive(Debug)]
pub enum Finished {
    /// Acknowledged by the broker and `published_at` written, or handed off and `handoff_at` written (the
    /// row written back where it was gone).
    Events {
        /// (tag, bytes) per event.
        events: Vec<(CdcTag, usize)>,
        /// With hand-offs among them: the server's WAL position once they were committed. Their rows are
        /// the only record that these events are still owed, and were written after the events'
        /// transactions: the slot must not be confirmed between the two (see `Watermark::hold_until`).
        hand_offs_end: Option<Lsn>,
    },
    /// The broker (or librdkafka) failed these deliveries after the producer accepted them; the session
    /// decides what becomes of them.
    Undelivered(Vec<Delivery<CdcTag>>),
    /// A `published_at` write failed; the session must restart from the confirmed position.
    Failed(Error),
}

/// The backfill task: writes the marks of acknowledged events in batches and reports what finished.
pub async fn run(
    database_url: crate::pg::PgUrl,
    tables: Vec<OutboxTable>,
    mut deliveries: UnboundedReceiver<Delivery<CdcTag>>,
    finished: UnboundedSender<Finished>,
    hand_off_rows: HandOffRows,
) {
    let mut batch: Vec<Delivery<CdcTag>> = Vec::with_capacity(MAX_BATCH);
    let mut connection: Option<(tokio_postgres::Client, Vec<OutboxSql>)> = None;
    loop {
        let Some(first) = deliveries.recv().await else {
            return;
        };
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match deliveries.try_recv() {
                Ok(delivery) => batch.push(delivery),
                Err(_) => break,
            }
        }
        if batch.iter().any(|d| d.result.is_err()) {
            let (failed, delivered): (Vec<_>, Vec<_>) =
                batch.drain(..).partition(|d| d.result.is_err());
            batch = delivered;
            if finished.send(Finished::Undelivered(failed)).is_err() {
                return;
            }
            if batch.is_empty() {
                continue;
            }
        }
        if connection.is_none() {
            match connect(&database_url, &tables).await {
                Ok(c) => connection = Some(c),
                Err(error) => {
                    let _ = finished.send(Finished::Failed(error));
                    return;
                }
            }
        }
        let mut hand_offs_end = None;
        if let Some((client, sql)) = &mut connection {
            for (table, sql) in sql.iter().enumerate() {
                let of_table: Vec<&Delivery<CdcTag>> =
                    batch.iter().filter(|d| d.tag.table == table).collect();
                if of_table.is_empty() {
                    continue;
                }
                let written = write_batch(client, &tables[table], sql, &of_table, &hand_off_rows);
                if let Err(error) = written.await {
                    let _ = finished.send(Finished::Failed(error));
                    return;
                }
            }
            if batch.iter().any(|d| d.tag.hand_off) {
                match pg::current_wal_position(client).await {
                    Ok(end) => hand_offs_end = Some(end),
                    Err(error) => {
                        let _ = finished.send(Finished::Failed(error));
                        return;
                    }
                }
            }
        }
        let events = batch.drain(..).map(|d| (d.tag, d.bytes)).collect();
        let report = Finished::Events {
            events,
            hand_offs_end,
        };
        if finished.send(report).is_err() {
            return;
        }
    }
}

/// Writes `published_at` for the acknowledged events of the batch, and `handoff_at` for the handed-off ones.
async fn write_batch(
    client: &mut tokio_postgres::Client,
    table: &OutboxTable,
    sql: &OutboxSql,
    batch: &[&Delivery<CdcTag>],
    hand_off_rows: &HandOffRows,
) -> Result<(), Error> {
    let of = |hand_off: bool| -> Vec<(Uuid, u32)> {
        batch
            .iter()
            .filter(|d| d.tag.hand_off == hand_off)
            .map(|d| (d.event_id, d.tag.xid))
            .collect()
    };
    let published = of(false);
    if !published.is_empty() {
        mark_published(client, sql, published).await?;
    }
    let handed_off = of(true);
    if !handed_off.is_empty() {
        hand_off_together(client, table, sql, handed_off, hand_off_rows).await?;
    }
    Ok(())
}

/// Rows not yet visible (their transaction's commit was decoded before it became visible here) are retried
/// until their transaction is visible; rows still missing then are gone (already published, or deleted by
/// their own transaction). Which transactions are visible is asked *before* the statement: their rows, if
/// missing, are gone for good.
async fn visible_transactions(
    client: &tokio_postgres::Client,
    pending: &[(Uuid, u32)],
) -> Result<HashSet<u32>, Error> {
    let mut visible = HashSet::new();
    for xid in pending.iter().map(|p| p.1).collect::<HashSet<u32>>() {
        if outbox::transaction_visible(client, xid).await? {
            visible.insert(xid);
        }
    }
    Ok(visible)
}

async fn mark_published(
    client: &tokio_postgres::Client,
    sql: &OutboxSql,
    mut pending: Vec<(Uuid, u32)>,
) -> Result<(), Error> {
    let mut delay = Duration::from_millis(2);
    let mut visible = HashSet::new();
    loop {
        let ids: Vec<Uuid> = pending.iter().map(|p| p.0).collect();
        let written: HashSet<Uuid> = sql
            .mark_published(client, &ids)
            .await?
            .into_iter()
            .collect();
        pending.retain(|(id, xid)| !written.contains(id) && !visible.contains(xid));
        if pending.is_empty() {
            return Ok(());
        }
        tracing::debug!(
            rows = pending.len(),
            "rows of a decoded transaction are not visible yet; waiting"
        );
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(200));
        visible = visible_transactions(client, &pending).await?;
    }
}

/// Hands the batch's events to the polling path in one transaction, writing back those whose rows their own
/// transaction deleted: the polling path never sees a later event of an aggregate handed off before an
/// earlier one exists as a row. While a row is not visible yet the transaction is rolled back and tried again.
async fn hand_off_together(
    client: &mut tokio_postgres::Client,
    table: &OutboxTable,
    sql: &OutboxSql,
    pending: Vec<(Uuid, u32)>,
    hand_off_rows: &HandOffRows,
) -> Result<(), Error> {
    let ids: Vec<Uuid> = pending.iter().map(|p| p.0).collect();
    let mut delay = Duration::from_millis(2);
    let mut visible = HashSet::new();
    loop {
        let tx = client.transaction().await?;
        let written: HashSet<Uuid> = sql.hand_off(&tx, &ids).await?.into_iter().collect();
        let missing: Vec<&(Uuid, u32)> =
            pending.iter().filter(|p| !written.contains(&p.0)).collect();
        if missing.iter().any(|(_, xid)| !visible.contains(xid)) {
            tx.rollback().await?;
            tracing::debug!(
                rows = missing.len(),
                "rows of a decoded transaction are not visible yet; waiting"
            );
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(200));
            visible = visible_transactions(client, &pending).await?;
            continue;
        }
        if !missing.is_empty() {
            let images: Vec<(Uuid, RowImage)> = {
                let rows = hand_off_rows
                    .lock()
                    .map_err(|_| Error::bug("the hand-off rows' lock is poisoned"))?;
                missing
                    .iter()
                    .map(|(id, _)| {
                        rows.get(id).cloned().map(|row| (*id, row)).ok_or_else(|| {
                            Error::bug(format!("event {id} was handed off without its row"))
                        })
                    })
                    .collect::<Result<_, _>>()?
            };
            let rows: Vec<(Uuid, &RowImage)> = images.iter().map(|(id, row)| (*id, row)).collect();
            outbox::write_back_handed_off(&tx, table, sql, &rows).await?;
            tracing::info!(table = %table.name, rows = rows.len(), "events handed to the polling path whose rows their own transaction deleted were written back, handed off");
        }
        // Where this hand-off ends, for a process that meets these events again (see
        // `pipeline::cdc::earlier_hand_offs`).
        outbox::name_handed_off_events(&tx, table, &ids).await?;
        tx.commit().await?;
        if let Ok(mut rows) = hand_off_rows.lock() {
            for id in &ids {
                rows.remove(id);
            }
        }
        return Ok(());
    }
}

async fn connect(
    database_url: &crate::pg::PgUrl,
    tables: &[OutboxTable],
) -> crate::error::Result<(tokio_postgres::Client, Vec<OutboxSql>)> {
    let client = pg::connect(database_url).await?;
    let mut sql = Vec::with_capacity(tables.len());
    for table in tables {
        sql.push(OutboxSql::prepare(&client, table).await?);
    }
    Ok((client, sql))
}
