//! Retention: deletes (or moves to `--archive-table`) published rows older than `--retention`, 1,000 rows
//! per short transaction, on `--retention-interval`. Never touches unpublished rows. With
//! `publish = 'insert'` these deletes are not streamed by the slot.

use std::sync::Arc;

use crate::config::{Retention, TableName};
use crate::error::Result;
use crate::pg;

/// Rows per statement: small enough to hold locks only briefly.
const BATCH: i64 = 1_000;

pub async fn run(database_url: crate::pg::PgUrl, table: TableName, retention: Arc<Retention>) {
    loop {
        match sweep_once(&database_url, &table, &retention).await {
            Ok(0) => {}
            Ok(removed) => {
                tracing::info!(removed, archive = ?retention.archive_table.as_ref().map(|t| t.to_string()), "retention removed published rows")
            }
            Err(error) => tracing::warn!(%error, "retention failed; will try again"),
        }
        tokio::time::sleep(retention.interval).await;
    }
}

/// One pass: batches until no published row older than the window is left. Returns how many rows went.
pub async fn sweep_once(
    database_url: &crate::pg::PgUrl,
    table: &TableName,
    retention: &Retention,
) -> Result<u64> {
    let client = pg::connect(database_url).await?;
    let t = table.quoted();
    let pick = format!(
        "SELECT event_id FROM {t} WHERE published_at IS NOT NULL
           AND published_at < now() - make_interval(secs => $1::float8)
         LIMIT $2 FOR UPDATE SKIP LOCKED"
    );
    let statement = match &retention.archive_table {
        Some(archive) => {
            let a = archive.quoted();
            client
                .batch_execute(&format!("CREATE TABLE IF NOT EXISTS {a} (LIKE {t})"))
                .await?;
            format!(
                "WITH moved AS (DELETE FROM {t} WHERE event_id IN ({pick}) RETURNING *)
                 INSERT INTO {a} SELECT * FROM moved"
            )
        }
        None => format!("DELETE FROM {t} WHERE event_id IN ({pick})"),
    };
    let statement = client.prepare(&statement).await?;
    let keep = retention.keep.as_secs_f64();
    let mut total = 0;
    loop {
        let removed = client.execute(&statement, &[&keep, &BATCH]).await?;
        total += removed;
        if removed < BATCH as u64 {
            return Ok(total);
        }
    }
}
