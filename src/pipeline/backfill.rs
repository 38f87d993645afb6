//! Backfill: turns broker acknowledgements into `published_at` writes, one UPDATE per batch, and reports
//! each event as finished only after its row is written (so the slot never runs ahead of the table).
//! Owns its own SQL connection and reconnects on failure; a failed delivery ends the session.

use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use uuid::Uuid;

use crate::backoff::Backoff;
use crate::config::TableName;
use crate::kafka::Delivery;
use crate::pg::{self, outbox::OutboxSql};
use crate::pipeline::watermark::TxnId;

/// Most events marked by one UPDATE.
pub const MAX_BATCH: usize = 2_000;

#[derive(Debug)]
pub enum Finished {
    /// Acknowledged by the broker and `published_at` written: (transaction, bytes) per event.
    Events(Vec<(TxnId, usize)>),
    /// The broker refused an event; the session must restart from the last confirmed position.
    DeliveryFailed { event_id: Uuid, reason: String },
}

pub async fn run(
    database_url: tokio_postgres::Config,
    table: TableName,
    mut deliveries: UnboundedReceiver<Delivery>,
    finished: UnboundedSender<Finished>,
) {
    let mut connection: Option<(tokio_postgres::Client, OutboxSql)> = None;
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut batch: Vec<Delivery> = Vec::with_capacity(MAX_BATCH);
    let mut ids: Vec<Uuid> = Vec::with_capacity(MAX_BATCH);
    loop {
        let Some(first) = deliveries.recv().await else { return };
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match deliveries.try_recv() {
                Ok(delivery) => batch.push(delivery),
                Err(_) => break,
            }
        }
        if let Some(failed) = batch.iter().find(|d| d.result.is_err()) {
            let reason = failed.result.clone().err().unwrap_or_default();
            let _ = finished.send(Finished::DeliveryFailed { event_id: failed.event_id, reason });
            return;
        }
        ids.clear();
        ids.extend(batch.iter().map(|d| d.event_id));
        loop {
            if connection.is_none() {
                match connect(&database_url, &table).await {
                    Ok(c) => connection = Some(c),
                    Err(error) => {
                        let delay = backoff.next_delay();
                        tracing::warn!(%error, retry_in = ?delay, "backfill cannot connect to PostgreSQL");
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                }
            }
            let Some((client, sql)) = &connection else { continue };
            match sql.mark_published(client, &ids).await {
                Ok(_) => {
                    backoff.reset();
                    break;
                }
                Err(error) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(%error, retry_in = ?delay, "cannot write published_at; retrying");
                    connection = None;
                    tokio::time::sleep(delay).await;
                }
            }
        }
        let events = batch.drain(..).map(|d| (d.txn, d.bytes)).collect();
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
