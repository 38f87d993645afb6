//! The checks `run` must pass before a pipeline starts, in the order it makes them, each retried while
//! transient until `--startup-timeout`: the tables against the database, the mode the server allows,
//! the topic template, retention, the brokers. They are the functions `outboxd doctor` reports on (`pg::slot`,
//! `retention::check`, the configuration rules in this module's parent), so the two never disagree; here the
//! first that fails stops `run` with its fix. Also whether replication is available, which `auto` asks again
//! while it polls. Owns no state.

use std::time::{Duration, Instant};

use crate::backoff::Backoff;
use crate::config::{Mode, RunSettings};
use crate::error::{replication_error, Error, Result};
use crate::pg::replication::ReplicationConnection;
use crate::pg::{self, slot};
use crate::sink::Sinks;
use crate::table::{OutboxTable, TableSpec};

/// Every check `run` must pass, each retried while transient until `deadline`; returns the settings the
/// pipeline runs with (the tables as the database has them, the mode it allows).
pub async fn must_pass(
    configured: RunSettings<TableSpec>,
    sinks: &impl Sinks,
    deadline: Instant,
) -> Result<RunSettings> {
    let timeout = configured.startup_timeout;
    let tables = retry_until(timeout, deadline, || preflight_database(&configured)).await?;
    let mode = super::effective_mode(configured.mode, &tables);
    if mode != Mode::Poll && !tables.iter().all(|t| t.polling) {
        tracing::warn!(
            tables = %crate::table::names(tables.iter().filter(|t| !t.polling)),
            "running CDC only: without the polling columns there is no backfill of rows older than the slot, no polling fallback, no retry queue or dead letters{}; add them with `outboxd migrate --add-polling-columns`",
            if tables.iter().any(|t| !t.marks_published) { ", and no published_at (rows re-sent after a restart are published again)" } else { "" }
        );
    }
    let settings = configured.inspected(tables, mode);
    super::check_topic_template(&settings)?;
    let can_sweep = settings.database.tables.iter().all(|t| t.polling);
    match settings.mode {
        Mode::Cdc => {
            retry_until(timeout, deadline, || {
                require_replication(&settings, can_sweep)
            })
            .await?
        }
        // Configuration mistakes (missing publication, a slot of another plugin) stop `auto` too.
        Mode::Auto => {
            retry_until(timeout, deadline, || async {
                replication_availability(&settings, can_sweep, false)
                    .await
                    .map(|_| ())
            })
            .await?
        }
        Mode::Poll => {}
    }
    super::check_retention_columns(&settings)?;
    if let Some(retention) = &settings.retention {
        retry_until(timeout, deadline, || async {
            let client = pg::connect(&settings.database.database_url).await?;
            crate::retention::check(
                &client,
                &settings.database.tables,
                retention,
                &settings.database.publication,
            )
            .await
        })
        .await?;
    }
    retry_until(timeout, deadline, || sinks.check_ready(&settings)).await?;
    Ok(settings)
}

/// Database checks every mode needs: it answers, and every table has the columns its mapping names.
/// Returns the tables as the database has them.
async fn preflight_database(settings: &RunSettings<TableSpec>) -> Result<Vec<OutboxTable>> {
    let db = &settings.database;
    let sql = pg::connect(&db.database_url).await?;
    let tables = slot::inspect_all(&sql, &db.tables).await?;
    if settings.mode == Mode::Poll {
        for table in &tables {
            slot::check_polling_columns(table)?;
        }
    }
    for table in &tables {
        slot::check_row_level_security(&sql, table).await?;
    }
    Ok(tables)
}

/// Whether the CDC path can run here.
pub enum Availability {
    /// The server lets outboxd stream from its slot.
    Available,
    /// The server does not allow logical replication for us (wal_level, permission, pg_hba): `auto` polls.
    Unavailable(Error),
}

/// Can the CDC path run? Configuration mistakes (missing publication, a slot of another plugin) are errors;
/// what `auto` may work around by polling is `Unavailable`. A lost slot is dropped when the polling path
/// can cover what it missed (`can_sweep`). `running`: asked by a running pipeline, where a replication URL
/// that reaches a standby is a switchover to wait for (NotReady), not the start-up's definite refusal.
pub async fn replication_availability(
    settings: &RunSettings,
    can_sweep: bool,
    running: bool,
) -> Result<Availability> {
    let db = &settings.database;
    let sql = pg::connect(&db.database_url).await?;
    if let Err(error) = slot::check_wal_level(&sql).await {
        return unavailable(error);
    }
    slot::check_publication(&sql, db).await?;
    if can_sweep {
        slot::drop_if_lost(&sql, &db.slot, &db.tables).await?;
    }
    slot::check_existing_slot(&sql, &db.slot).await?;
    // Replication permission is tested by trying it: managed services grant it through roles.
    let identified = async {
        let mut conn = ReplicationConnection::connect(&db.replication_url).await?;
        conn.identify_system().await?;
        conn.in_recovery().await
    };
    match identified.await.map_err(replication_error) {
        Ok(true) if !pg::in_recovery(&sql).await? => Err(Error::replication_on_standby(running)),
        Ok(_) => Ok(Availability::Available),
        Err(error) => unavailable(error),
    }
}

fn unavailable(error: Error) -> Result<Availability> {
    match error {
        Error::ReplicationUnavailable { .. } => Ok(Availability::Unavailable(error)),
        other => Err(other),
    }
}

/// `--mode cdc` (or `auto` without polling columns): replication must be available.
async fn require_replication(settings: &RunSettings, can_sweep: bool) -> Result<()> {
    match replication_availability(settings, can_sweep, false).await? {
        Availability::Available => Ok(()),
        Availability::Unavailable(error) => Err(error),
    }
}

/// Runs `check` until it succeeds, retrying transient failures until `deadline` (`--startup-timeout`
/// from start).
pub async fn retry_until<T, F, Fut>(
    startup_timeout: Duration,
    deadline: Instant,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(5));
    loop {
        match check().await {
            Ok(value) => return Ok(value),
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
                        startup_timeout
                    ),
                    "make PostgreSQL and the brokers reachable, or raise --startup-timeout",
                ))
            }
            Err(error) => return Err(error),
        }
    }
}
