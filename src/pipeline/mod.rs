//! Pipelines that move events from PostgreSQL to Kafka. `cdc` is the logical-replication fast path,
//! `backfill` writes `published_at` after broker acks, `watermark` decides what the slot may confirm.
//! `run` is `outboxd run`: pre-flight checks (retried for `--startup-timeout`), then the CDC pipeline.

pub mod backfill;
pub mod cdc;
pub mod watermark;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use crate::backoff::Backoff;
use crate::config::RunSettings;
use crate::error::{Error, Result};
use crate::kafka::{KnownTopics, Publisher};
use crate::pg::replication::{ReplicationConnection, ReplicationError};
use crate::pg::{self, slot};

/// Maps replication-connection failures a person must fix to setup errors that say how.
pub fn replication_error(error: ReplicationError) -> Error {
    let message = error.to_string();
    match error.code() {
        Some("42501") => Error::setup(
            format!("the user may not open a replication connection ({message})"),
            "ALTER ROLE <user> WITH REPLICATION (managed services: GRANT rds_replication TO <user> or the provider's equivalent)",
        ),
        Some("28000") => Error::setup(
            format!("PostgreSQL refused the replication connection ({message})"),
            "add a pg_hba.conf line for this user and database (a logical replication connection matches the database column)",
        ),
        Some("28P01") => Error::setup(
            format!("PostgreSQL rejected the password of the replication connection ({message})"),
            "check the password in --replication-url / --database-url",
        ),
        Some("3D000") => Error::setup(format!("the database does not exist ({message})"), "fix the database name in the URL"),
        Some("55000") if message.contains("wal_level") => Error::setup(
            format!("logical decoding is not enabled ({message})"),
            "set wal_level = logical and restart PostgreSQL",
        ),
        Some("42704") => Error::setup(
            format!("a replication object is missing ({message})"),
            "run `outboxd migrate` to create the publication, or check --publication and --slot",
        ),
        _ => Error::Replication(error),
    }
}

/// Everything `run` checks before streaming. Each failure is either transient (retried) or names its fix.
async fn preflight(settings: &RunSettings) -> Result<()> {
    let db = &settings.database;
    let sql = pg::connect(&db.database_url).await?;
    slot::check_wal_level(&sql).await?;
    slot::check_table(&sql, &db.table).await?;
    slot::check_publication(&sql, db).await?;
    slot::check_existing_slot(&sql, &db.slot).await?;
    // Replication permission is tested by trying it: managed services grant it through roles.
    let mut conn = ReplicationConnection::connect(&db.replication_url)
        .await
        .map_err(replication_error)?;
    conn.identify_system().await.map_err(replication_error)?;
    let (deliveries, _) = mpsc::unbounded_channel();
    let publisher = Publisher::new(settings, KnownTopics::default(), deliveries)?;
    publisher.check_brokers(Duration::from_secs(5)).await?;
    Ok(())
}

/// `outboxd run`: retries transient start-up failures for `--startup-timeout`, then streams until shutdown.
pub async fn run(settings: RunSettings, shutdown: watch::Receiver<bool>) -> Result<()> {
    let deadline = Instant::now() + settings.startup_timeout;
    let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(5));
    loop {
        match preflight(&settings).await {
            Ok(()) => break,
            Err(error) if error.is_transient() && Instant::now() < deadline => {
                let delay = backoff
                    .next_delay()
                    .min(deadline.saturating_duration_since(Instant::now()));
                tracing::warn!(%error, retry_in = ?delay, "start-up check failed; retrying");
                tokio::time::sleep(delay).await;
            }
            Err(error) if error.is_transient() => {
                return Err(Error::setup(
                    format!(
                        "gave up after --startup-timeout {:?}: {error}",
                        settings.startup_timeout
                    ),
                    "make PostgreSQL and the brokers reachable, or raise --startup-timeout",
                ))
            }
            Err(error) => return Err(error),
        }
    }
    tracing::info!(
        table = %settings.database.table,
        slot = %settings.database.slot,
        publication = %settings.database.publication,
        "start-up checks passed"
    );
    cdc::CdcPipeline::new(Arc::new(settings))
        .run(shutdown)
        .await
}
