//! Backfill: turns broker acknowledgements into `published_at` writes, one UPDATE per batch, and reports
//! each event as finished only after its row is written (so the slot never runs ahead of the table).
//!
//! Failed deliveries go to the session as they are (it hands refused events to the polling path and
//! re-sends the rest). Any database failure ends the session instead of being retried here: while
//! PostgreSQL shuts down, its walsender waits for the client to confirm everything sent, so holding the
//! replication connection open while waiting for the database would stall the shutdown until
//! `wal_sender_timeout`.

use std::collections::HashSet;
use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use uuid::Uuid;

use crate::error::Error;
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

/// What the backfill task reports to the session.
#[derive(Debug)]
pub enum Finished {
    /// Acknowledged by the broker and `published_at` written, or handed off and `handoff_at` written:
    /// (tag, bytes) per event.
    Events(Vec<(CdcTag, usize)>),
    /// Sent before the `Events` of a batch with hand-offs: the handed-off events whose rows were gone
    /// (deleted by their own transaction, or already published), which the polling path will never see.
    HandOffs {
        /// Every handed-off event of the batch.
        handed_off: Vec<Uuid>,
        /// Those whose rows were gone.
        rowless: Vec<Uuid>,
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
        let mut rowless_hand_offs = Vec::new();
        if let Some((client, sql)) = &connection {
            for (table, sql) in sql.iter().enumerate() {
                let of_table: Vec<&Delivery<CdcTag>> =
                    batch.iter().filter(|d| d.tag.table == table).collect();
                if of_table.is_empty() {
                    continue;
                }
                match write_batch(client, sql, &of_table).await {
                    Ok(rowless) => rowless_hand_offs.extend(rowless),
                    Err(error) => {
                        let _ = finished.send(Finished::Failed(error));
                        return;
                    }
                }
            }
        }
        let handed_off: Vec<Uuid> = batch
            .iter()
            .filter(|d| d.tag.hand_off)
            .map(|d| d.event_id)
            .collect();
        if !handed_off.is_empty()
            && finished
                .send(Finished::HandOffs {
                    handed_off,
                    rowless: rowless_hand_offs,
                })
                .is_err()
        {
            return;
        }
        let events = batch.drain(..).map(|d| (d.tag, d.bytes)).collect();
        if finished.send(Finished::Events(events)).is_err() {
            return;
        }
    }
}

/// Writes `published_at` (or `handoff_at`) for every event of the batch. Rows not yet visible (their
/// transaction's commit was decoded before it became visible here) are retried until their transaction is
/// visible; rows still missing then are gone (already published, or deleted by their own transaction).
/// Returns the handed-off events whose rows were gone.
async fn write_batch(
    client: &tokio_postgres::Client,
    sql: &OutboxSql,
    batch: &[&Delivery<CdcTag>],
) -> Result<Vec<Uuid>, Error> {
    let mut pending: Vec<(Uuid, u32, bool)> = batch
        .iter()
        .map(|d| (d.event_id, d.tag.xid, d.tag.hand_off))
        .collect();
    let mut delay = Duration::from_millis(2);
    let mut rowless_hand_offs = Vec::new();
    loop {
        // Which transactions are visible *before* the UPDATE: their rows, if missing, are gone for good.
        let mut visible: HashSet<u32> = HashSet::new();
        if delay > Duration::from_millis(2) {
            for xid in pending.iter().map(|p| p.1).collect::<HashSet<u32>>() {
                if outbox::transaction_visible(client, xid).await? {
                    visible.insert(xid);
                }
            }
        }
        let publish: Vec<Uuid> = pending.iter().filter(|p| !p.2).map(|p| p.0).collect();
        let hand_off: Vec<Uuid> = pending.iter().filter(|p| p.2).map(|p| p.0).collect();
        let mut written: HashSet<Uuid> = HashSet::new();
        if !publish.is_empty() {
            written.extend(sql.mark_published(client, &publish).await?);
        }
        if !hand_off.is_empty() {
            written.extend(sql.hand_off(client, &hand_off).await?);
        }
        pending.retain(|(id, xid, hand_off)| {
            let gone = !written.contains(id) && visible.contains(xid);
            if gone && *hand_off {
                rowless_hand_offs.push(*id);
            }
            !written.contains(id) && !gone
        });
        if pending.is_empty() {
            return Ok(rowless_hand_offs);
        }
        tracing::debug!(
            rows = pending.len(),
            "rows of a decoded transaction are not visible yet; waiting"
        );
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(200));
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
