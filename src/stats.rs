//! Periodic figures that need SQL or a broker round trip: slot lag, retained and safe WAL, wal_status,
//! backlog, its oldest age and the dead letters; and the readiness flags. Runs on its own interval, never
//! per event. Whether PostgreSQL answers (readiness) is checked apart from the backlog figures: slow figures
//! are a warning in the log, not an unreachable database; and a backlog no index can count is not counted
//! (a whole-table read every 5 s would load the application's database). A failure of this task itself is
//! reported by readiness, never left as a frozen last answer.

use std::collections::BTreeSet;
use std::time::Duration;

use metrics::gauge;
use tokio::sync::mpsc;

use crate::config::RunSettings;
use crate::http::READINESS;
use crate::kafka::{KnownTopics, Publisher};
use crate::metrics as m;
use crate::pg::{self, outbox, slot};
use crate::sink::{Delivery, Sink};
use crate::table::{OutboxTable, TableSpec};

/// How often the gauges and readiness are refreshed.
pub const INTERVAL: Duration = Duration::from_secs(5);

/// The longest one check may take, connecting included: a database that stopped answering (a blackholed
/// network) reads as down within this, instead of leaving the last answer standing. The backlog figures
/// have as long again, on their own.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(4);

/// Refreshes the gauges and readiness every [`INTERVAL`] until the process ends. Should the checks fail
/// (a bug), `/readyz` says so until they run again, [`INTERVAL`] later.
pub async fn run(settings: std::sync::Arc<RunSettings<TableSpec>>) {
    loop {
        let failure = match tokio::spawn(check_forever(settings.clone())).await {
            Ok(()) => return,
            Err(failure) => failure,
        };
        READINESS.set_checks_running(false);
        tracing::error!(error = %failure, "the readiness checks failed (a bug in outboxd: please report it with the lines above); /readyz reports it until they run again");
        tokio::time::sleep(INTERVAL).await;
    }
}

async fn check_forever(settings: std::sync::Arc<RunSettings<TableSpec>>) {
    let (deliveries, _) = mpsc::unbounded_channel::<Delivery<()>>();
    let publisher = Publisher::new(&settings, KnownTopics::default(), deliveries).ok();
    let mut client: Option<tokio_postgres::Client> = None;
    let mut figures = Figures::default();
    loop {
        let reached = tokio::time::timeout(REFRESH_TIMEOUT, async {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = pg::connect_for_figures(&settings.database.database_url, REFRESH_TIMEOUT)
                    .await
                    .ok();
            }
            match &client {
                Some(client) => refresh_slot(client, &settings).await.is_ok(),
                None => false,
            }
        })
        .await;
        let database_ok = reached.unwrap_or_else(|_| {
            client = None; // a connection that stopped answering is dropped, not reused
            false
        });
        READINESS.set_database(database_ok);
        match &client {
            // The backlog is the fleet's, not this instance's: standbys do not add the load (they report 0).
            // Every other instance reports it, also while it starts or reconnects: a backlog growing while
            // the pipeline cannot stream is what the alerts are for.
            Some(client) if database_ok && !READINESS.is_standby() => {
                let refreshed =
                    tokio::time::timeout(REFRESH_TIMEOUT, figures.refresh(client, &settings)).await;
                figures.report(refreshed.unwrap_or_else(|_| Err("took longer than 4 s".into())));
            }
            _ if READINESS.is_standby() => {
                for name in [
                    m::UNPUBLISHED_EVENTS,
                    m::OLDEST_UNPUBLISHED_AGE,
                    m::DEAD_EVENTS,
                ] {
                    gauge!(name).set(0.0);
                }
            }
            _ => {}
        }
        // Bounded here too: an answer that never comes reads as down, not as the last answer standing.
        let broker_ok = match &publisher {
            Some(p) => {
                tokio::time::timeout(REFRESH_TIMEOUT, p.check_brokers(Duration::from_secs(2)))
                    .await
                    .is_ok_and(|answer| answer.is_ok())
            }
            None => false,
        };
        READINESS.set_broker(broker_ok);
        READINESS.set_checks_running(true);
        tracing::trace!(database_ok, broker_ok, "readiness refreshed");
        tokio::time::sleep(INTERVAL).await;
    }
}

/// The slot's gauges; an error means PostgreSQL did not answer as it should.
async fn refresh_slot(
    client: &tokio_postgres::Client,
    settings: &RunSettings<TableSpec>,
) -> crate::Result<()> {
    let state = slot::slot_state(client, &settings.database.slot).await?;
    let bytes = |v: Option<i64>| v.unwrap_or(0) as f64;
    gauge!(m::SLOT_LAG_BYTES).set(bytes(state.as_ref().and_then(|s| s.lag_bytes)));
    gauge!(m::SLOT_RETAINED_WAL_BYTES)
        .set(bytes(state.as_ref().and_then(|s| s.retained_wal_bytes)));
    gauge!(m::SLOT_SAFE_WAL_BYTES).set(bytes(state.as_ref().and_then(|s| s.safe_wal_bytes)));
    m::set_wal_status(state.as_ref().and_then(|s| s.wal_status.as_deref()));
    Ok(())
}

/// The backlog gauges, and what was said about them in the log (each change said once).
#[derive(Default)]
struct Figures {
    /// Tables whose backlog is not counted: no index serves the count.
    uncounted: BTreeSet<String>,
    /// Why the last refresh failed, while it fails.
    failing: Option<String>,
}

impl Figures {
    async fn refresh(
        &mut self,
        client: &tokio_postgres::Client,
        settings: &RunSettings<TableSpec>,
    ) -> Result<(), String> {
        let failed = |e: crate::Error| e.to_string();
        let tables = slot::inspect_all(client, &settings.database.tables)
            .await
            .map_err(failed)?;
        let mut counted: Vec<OutboxTable> = Vec::new();
        let mut dead = 0;
        for table in tables.into_iter().filter(|t| t.marks_published) {
            let countable = outbox::countable(client, &table).await.map_err(failed)?;
            let (backlog_scans, dead_scans) =
                (!countable.backlog, table.polling && !countable.dead);
            // The dead letters on their own: their index may serve where the backlog's does not.
            if countable.dead {
                dead += outbox::dead_count(client, &table).await.map_err(failed)?;
            }
            let name = table.name.to_string();
            if backlog_scans || dead_scans {
                if self.uncounted.insert(name) {
                    tracing::warn!(table = %table.name, backlog_counted = !backlog_scans, dead_letters_counted = !dead_scans, fix = %outbox::backlog_index_fix(&table), "figures of this table are not counted (outboxd_unpublished_events and outboxd_oldest_unpublished_age_seconds, or outboxd_dead_events): no index serves them, and reading the whole table every 5 s would load the database");
                }
            } else if self.uncounted.remove(&name) {
                tracing::info!(table = %table.name, "indexes serve the figures of this table: it is counted again");
            }
            if !backlog_scans {
                counted.push(table);
            }
        }
        let backlog = outbox::backlog(client, &counted).await.map_err(failed)?;
        gauge!(m::UNPUBLISHED_EVENTS).set(backlog.unpublished_events as f64);
        gauge!(m::OLDEST_UNPUBLISHED_AGE)
            .set(backlog.oldest_unpublished_age_seconds.unwrap_or(0.0));
        gauge!(m::DEAD_EVENTS).set(dead as f64);
        Ok(())
    }

    /// Logs a failure when it starts and when it ends; the gauges keep their last values meanwhile.
    fn report(&mut self, refreshed: Result<(), String>) {
        match (refreshed, self.failing.is_some()) {
            (Ok(()), true) => {
                self.failing = None;
                tracing::info!("the backlog figures are refreshed again");
            }
            (Err(error), false) => {
                tracing::warn!(%error, "the backlog figures could not be refreshed; their gauges keep their last values (readiness is not affected: PostgreSQL answers)");
                self.failing = Some(error);
            }
            _ => {}
        }
    }
}
