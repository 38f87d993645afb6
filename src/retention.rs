//! Retention: removes published rows older than `--retention`, on `--retention-interval`. A plain table
//! loses them 1,000 rows per short transaction (or moves them to `--archive-table`); a partitioned table
//! loses whole range partitions whose upper bound is older than the window and that hold no unpublished
//! row (DETACH, then DROP), which leaves no dead tuples behind. Never touches unpublished rows. With
//! `publish = 'insert'` none of this is streamed by the slot.

use std::sync::Arc;

use tokio_postgres::Client;

use crate::config::Retention;
use crate::error::Result;
use crate::pg::{self, slot};
use crate::table::OutboxTable;

/// Rows per statement: small enough to hold locks only briefly.
const BATCH: i64 = 1_000;

pub async fn run(
    database_url: crate::pg::PgUrl,
    tables: Vec<OutboxTable>,
    retention: Arc<Retention>,
) {
    loop {
        for table in &tables {
            let mut table = table.clone();
            match sweep_once(&database_url, &mut table, &retention).await {
                Ok(Removed {
                    rows: 0,
                    partitions,
                }) if partitions.is_empty() => {}
                Ok(Removed { rows, partitions }) => {
                    tracing::info!(table = %table.name, rows, partitions = ?partitions, archive = ?retention.archive_table.as_ref().map(|t| t.to_string()), "retention removed published rows")
                }
                Err(error) => {
                    tracing::warn!(table = %table.name, %error, "retention failed; will try again")
                }
            }
        }
        tokio::time::sleep(retention.interval).await;
    }
}

/// What one retention pass removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removed {
    pub rows: u64,
    /// Dropped partitions, schema-qualified.
    pub partitions: Vec<String>,
}

/// One pass over one table: batches until no published row older than the window is left, or, for a
/// partitioned table (without an archive table), drops the partitions that are wholly old and published.
pub async fn sweep_once(
    database_url: &crate::pg::PgUrl,
    table: &mut OutboxTable,
    retention: &Retention,
) -> Result<Removed> {
    let client = pg::connect(database_url).await?;
    slot::inspect(&client, table).await?;
    if !table.marks_published {
        tracing::warn!(table = %table.name, "--retention needs the published_at column to know what was published; nothing removed (run `outboxd migrate --add-polling-columns`)");
        return Ok(Removed::default());
    }
    if table.partitioned && retention.archive_table.is_none() {
        let partitions = drop_old_partitions(&client, table, retention).await?;
        return Ok(Removed {
            rows: 0,
            partitions,
        });
    }
    let t = table.name.quoted();
    let id = table.col(crate::table::Role::EventId);
    let pick = format!(
        "SELECT {id} FROM {t} WHERE published_at IS NOT NULL
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
                "WITH moved AS (DELETE FROM {t} WHERE {id} IN ({pick}) RETURNING *)
                 INSERT INTO {a} SELECT * FROM moved"
            )
        }
        None => format!("DELETE FROM {t} WHERE {id} IN ({pick})"),
    };
    let statement = client.prepare(&statement).await?;
    let keep = retention.keep.as_secs_f64();
    let mut total = 0;
    loop {
        let removed = client.execute(&statement, &[&keep, &BATCH]).await?;
        total += removed;
        if removed < BATCH as u64 {
            return Ok(Removed {
                rows: total,
                partitions: Vec::new(),
            });
        }
    }
}

/// Detaches and drops each range partition whose upper bound (a timestamp) is older than the window and
/// that holds no unpublished row. Partitions of other kinds (list, hash, default) are left alone.
async fn drop_old_partitions(
    client: &Client,
    outbox: &OutboxTable,
    retention: &Retention,
) -> Result<Vec<String>> {
    let table = &outbox.name;
    let rows = client
        .query(
            "SELECT format('%I.%I', n.nspname, c.relname),
                    substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \\(''([^'']+)''\\)')
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE i.inhparent = $1::text::regclass",
            &[&table.quoted()],
        )
        .await?;
    let keep = retention.keep.as_secs_f64();
    let mut dropped = Vec::new();
    for row in rows {
        let (partition, upper): (String, Option<String>) = (row.get(0), row.get(1));
        let Some(upper) = upper else { continue };
        // A bound that is no timestamp (e.g. an integer range) fails the cast: not ours to judge.
        let old = client
            .query_one(
                "SELECT $1::text::timestamptz <= now() - make_interval(secs => $2::float8)",
                &[&upper, &keep],
            )
            .await;
        if !matches!(old.map(|r| r.get::<_, bool>(0)), Ok(true)) {
            continue;
        }
        let unpublished: bool = client
            .query_one(
                &format!("SELECT EXISTS (SELECT 1 FROM {partition} WHERE published_at IS NULL)"),
                &[],
            )
            .await?
            .get(0);
        if unpublished {
            tracing::warn!(%partition, "partition is past --retention but still holds unpublished rows; kept");
            continue;
        }
        if detach_and_drop_if_published(client, outbox, &partition).await? {
            dropped.push(partition);
        }
    }
    Ok(dropped)
}

/// Detaches and drops `partition` unless, under its lock, it holds an unpublished row: a row committed (or
/// re-queued) after the unlocked check above is never dropped. The partition is locked first and checked
/// while only inserts routed to it wait (rows of an old range are rare); the parent's lock, which DETACH
/// needs, is taken only for the detach itself. Either lock not granted within the lock timeout (shorter than
/// `deadlock_timeout`, so outboxd, never the application, gives way) leaves the partition for the next pass.
/// (The connection is this pass's own: an error leaves nothing open behind.)
async fn detach_and_drop_if_published(
    client: &Client,
    table: &OutboxTable,
    partition: &str,
) -> Result<bool> {
    let parent = table.name.quoted();
    client
        .batch_execute("BEGIN; SET LOCAL lock_timeout = '500ms'")
        .await?;
    let partition_locked = client
        .batch_execute(&format!("LOCK TABLE {partition} IN ACCESS EXCLUSIVE MODE"))
        .await;
    if !lock_granted(client, partition, partition_locked).await? {
        return Ok(false);
    }
    let written_since: bool = client
        .query_one(
            &format!("SELECT EXISTS (SELECT 1 FROM {partition} WHERE published_at IS NULL)"),
            &[],
        )
        .await?
        .get(0);
    if written_since {
        client.batch_execute("ROLLBACK").await?;
        tracing::warn!(%partition, "an unpublished row arrived in the partition past --retention while it was checked; kept");
        return Ok(false);
    }
    let parent_locked = client
        .batch_execute(&format!("LOCK TABLE {parent} IN ACCESS EXCLUSIVE MODE"))
        .await;
    if !lock_granted(client, partition, parent_locked).await? {
        return Ok(false);
    }
    client
        .batch_execute(&format!(
            "ALTER TABLE {parent} DETACH PARTITION {partition}; DROP TABLE {partition}; COMMIT"
        ))
        .await?;
    Ok(true)
}

/// True when a LOCK TABLE succeeded; a lock timeout rolls back and says so (next pass), other errors
/// propagate.
async fn lock_granted(
    client: &Client,
    partition: &str,
    locked: std::result::Result<(), tokio_postgres::Error>,
) -> Result<bool> {
    let Err(error) = locked else {
        return Ok(true);
    };
    client.batch_execute("ROLLBACK").await?;
    if error.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
        tracing::info!(%partition, "partition past --retention is in use (no lock within 500ms); trying again next pass");
        return Ok(false);
    }
    Err(error.into())
}
