//! Backfill: turns broker acknowledgements into `published_at` writes, one UPDATE per batch, and reports
//! each event as finished only after its row is written (so the slot never runs ahead of the table).
//!
//! Any failure ends the session instead of being retried here: while PostgreSQL shuts down, its walsender
//! waits for the client to confirm everything sent, so holding the replication connection open while
//! waiting for the database would stall the shutdown until `wal_sender_timeout`.

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use uuid::Uuid;

use crate::config::TableName;
use crate::error::Error;
use crate::kafka::Delivery;
use crate::pg::{self, outbox::OutboxSql};
use crate::pipeline::watermark::TxnId;

/// What the CDC path attaches to each event it hands to the producer or to the polling path.
#[derive(Debug, Clone, Copy)]
pub struct CdcTag {
    pub txn: TxnId,
    /// True: not published; set `handoff_at` so the polling path publishes it.
    pub hand_off: bool,
}

/// Most events marked by one UPDATE.
pub const MAX_BATCH: usize = 2_000;

#[derive(Debug)]
pub enum Finished {
    /// Acknowledged by the broker and `published_at` written, or handed off and `handoff_at` written:
    /// (tag, bytes) per event.
    Events(Vec<(CdcTag, usize)>),
    /// A delivery or a `published_at` write failed; the session must restart from the confirmed position.
    Failed(Error),
}

pub async fn run(
    database_url: tokio_postgres::Config,
    table: TableName,
    mut deliveries: UnboundedReceiver<Delivery<CdcTag>>,
    finished: UnboundedSender<Finished>,
) {
    let mut batch: Vec<Delivery<CdcTag>> = Vec::with_capacity(MAX_BATCH);
    let mut ids: Vec<Uuid> = Vec::with_capacity(MAX_BATCH);
    let mut handed_off: Vec<Uuid> = Vec::new();
    let mut connection: Option<(tokio_postgres::Client, OutboxSql)> = None;
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
        if let Some(failed) = batch.iter().find(|d| d.result.is_err()) {
            let reason = failed
                .result
                .clone()
                .err()
                .map(|r| r.reason)
                .unwrap_or_default();
            let message = format!("delivery of event {} failed: {reason}", failed.event_id);
            let _ = finished.send(Finished::Failed(Error::Kafka {
                message,
                transient: true,
            }));
            return;
        }
        ids.clear();
        ids.extend(batch.iter().filter(|d| !d.tag.hand_off).map(|d| d.event_id));
        handed_off.clear();
        handed_off.extend(batch.iter().filter(|d| d.tag.hand_off).map(|d| d.event_id));
        if connection.is_none() {
            match connect(&database_url, &table).await {
                Ok(c) => connection = Some(c),
                Err(error) => {
                    let _ = finished.send(Finished::Failed(error));
                    return;
                }
            }
        }
        if let Some((client, sql)) = &connection {
            let written = async {
                if !ids.is_empty() {
                    sql.mark_published(client, &ids).await?;
                }
                if !handed_off.is_empty() {
                    sql.hand_off(client, &handed_off).await?;
                }
                Ok::<_, Error>(())
            };
            if let Err(error) = written.await {
                let _ = finished.send(Finished::Failed(error));
                return;
            }
        }
        let events = batch.drain(..).map(|d| (d.tag, d.bytes)).collect();
        if finished.send(Finished::Events(events)).is_err() {
            return;
        }
    }
}

async fn connect(
    database_url: &tokio_postgres::Config,
    table: &TableName,
) -> crate::error::Result<(tokio_postgres::Client, OutboxSql)> {
    let client = pg::connect(database_url).await?;
    let sql = OutboxSql::prepare(&client, table).await?;
    Ok((client, sql))
}
