//! Periodic figures that need SQL or a broker round trip: slot lag, retained and safe WAL, wal_status,
//! backlog and its oldest age; and the readiness flags. Runs on its own interval, never per event.

use std::time::Duration;

use metrics::gauge;
use tokio::sync::mpsc;

use crate::config::RunSettings;
use crate::http::READINESS;
use crate::kafka::{KnownTopics, Publisher};
use crate::metrics as m;
use crate::pg::{self, outbox, slot};
use crate::sink::{Delivery, Sink};
use crate::table::TableSpec;

/// How often the gauges and readiness are refreshed.
pub const INTERVAL: Duration = Duration::from_secs(5);

/// The longest one refresh may take, connecting included: a database that stopped answering (a blackholed
/// network) reads as down within this, instead of leaving the last answer standing.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(4);

/// Refreshes the gauges and readiness every [`INTERVAL`] until the process ends.
pub async fn run(settings: std::sync::Arc<RunSettings<TableSpec>>) {
    let (deliveries, _) = mpsc::unbounded_channel::<Delivery<()>>();
    let publisher = Publisher::new(&settings, KnownTopics::default(), deliveries).ok();
    let mut client: Option<tokio_postgres::Client> = None;
    loop {
        let refreshed = tokio::time::timeout(REFRESH_TIMEOUT, async {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = pg::connect_for_figures(&settings.database.database_url, REFRESH_TIMEOUT)
                    .await
                    .ok();
            }
            match &client {
                Some(client) => refresh(client, &settings).await.is_ok(),
                None => false,
            }
        })
        .await;
        let database_ok = refreshed.unwrap_or_else(|_| {
            client = None; // a connection that stopped answering is dropped, not reused
            false
        });
        READINESS.set_database(database_ok);
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
        tracing::trace!(database_ok, broker_ok, "readiness refreshed");
        tokio::time::sleep(INTERVAL).await;
    }
}

async fn refresh(
    client: &tokio_postgres::Client,
    settings: &RunSettings<TableSpec>,
) -> crate::Result<()> {
    let db = &settings.database;
    let state = slot::slot_state(client, &db.slot).await?;
    let bytes = |v: Option<i64>| v.unwrap_or(0) as f64;
    gauge!(m::SLOT_LAG_BYTES).set(bytes(state.as_ref().and_then(|s| s.lag_bytes)));
    gauge!(m::SLOT_RETAINED_WAL_BYTES)
        .set(bytes(state.as_ref().and_then(|s| s.retained_wal_bytes)));
    gauge!(m::SLOT_SAFE_WAL_BYTES).set(bytes(state.as_ref().and_then(|s| s.safe_wal_bytes)));
    m::set_wal_status(state.as_ref().and_then(|s| s.wal_status.as_deref()));
    // The backlog is the fleet's, not this instance's: the active instance reports it, standbys do not
    // add the load (they report 0).
    if !READINESS.is_active() {
        gauge!(m::UNPUBLISHED_EVENTS).set(0.0);
        gauge!(m::OLDEST_UNPUBLISHED_AGE).set(0.0);
        return Ok(());
    }
    let tables = slot::inspect_all(client, &db.tables).await?;
    let backlog = outbox::backlog(client, &tables).await?;
    gauge!(m::UNPUBLISHED_EVENTS).set(backlog.unpublished_events as f64);
    gauge!(m::OLDEST_UNPUBLISHED_AGE).set(backlog.oldest_unpublished_age_seconds.unwrap_or(0.0));
    Ok(())
}
