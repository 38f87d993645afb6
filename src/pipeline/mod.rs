//! Pipelines that move events from PostgreSQL to Kafka. `cdc` is the logical-replication fast path,
//! `backfill` writes `published_at` (or `handoff_at`) after broker acks, `watermark` decides what the slot
//! may confirm, `poll` is the lease-based polling path (fallback, sweeper, retry queue).
//! `run` is `outboxd run`: pre-flight checks (retried for `--startup-timeout`), then the configured mode —
//! `poll`, `cdc`, or `auto`, which switches between them as replication becomes (un)available.

pub mod backfill;
pub mod cdc;
pub mod fleet;
pub mod history;
pub mod leader;
pub mod liveness;
pub mod poll;
pub mod topic_holds;
pub mod watermark;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::config::{Mode, RunSettings};
use crate::doctor;
use crate::error::{Error, Result};
use crate::kafka::KafkaSinks;
use crate::pg::outbox::ClaimScope;
use crate::pg::{self, slot};
use crate::sink::Sinks;
use crate::table::TableSpec;

/// A running pipeline's patience with its database: after a failover, restore or switchover the server
/// behind the URL may refuse connections for a while, lack the database, or still be a standby in recovery.
/// Such failures are waited out for `--reconnect-timeout` from the first of an unbroken run of them.
pub struct DatabaseOutage {
    limit: Duration,
    since: Option<Instant>,
}

impl DatabaseOutage {
    /// No outage yet; `limit`: how long one may last (`--reconnect-timeout`).
    pub fn new(limit: Duration) -> Self {
        DatabaseOutage { limit, since: None }
    }

    /// The database answered as it should: the next outage starts its own clock.
    pub fn ended(&mut self) {
        self.since = None;
    }

    /// `Ok(Some(what))` to wait and retry (saying what for), `Ok(None)` when `error` is not about the
    /// database being reachable and ready, and an error naming what it waited for once the limit passed.
    pub fn judge(&mut self, error: &Error) -> Result<Option<String>> {
        let Some(waiting_for) = error.awaited_database() else {
            return Ok(None);
        };
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() >= self.limit {
            return Err(Error::setup(
                format!(
                    "gave up after --reconnect-timeout {:?} waiting for {waiting_for}: {error}",
                    self.limit
                ),
                "bring the database back behind --database-url (promote the standby, finish the restore), or raise --reconnect-timeout",
            ));
        }
        Ok(Some(waiting_for.to_string()))
    }
}

/// True when every table has the polling columns (so the sweeper and the polling fallback can run).
fn has_polling_columns(settings: &RunSettings) -> bool {
    settings.database.tables.iter().all(|t| t.polling)
}

/// `run`'s start-up: the checks that must pass ([`doctor::startup::must_pass`]), the fleet's poll order, the
/// advisories logged, retention started. Returns the settings the pipeline runs with, the poll-order
/// announcement (held while it runs) and the retention task.
async fn start_up(
    configured: RunSettings<TableSpec>,
    sinks: &impl Sinks,
) -> Result<(
    RunSettings,
    Option<fleet::PollOrderAnnouncement>,
    Option<tokio::task::JoinHandle<()>>,
)> {
    let deadline = Instant::now() + configured.startup_timeout;
    let settings = doctor::startup::must_pass(configured, sinks, deadline).await?;
    // Every instance that may claim rows says in which order; a peer of another order is refused.
    let announcement = doctor::startup::retry_until(settings.startup_timeout, deadline, || {
        fleet::announce_poll_order(&settings)
    })
    .await?;
    // What the start-up checks do not stop on, said once (see `outboxd doctor` for every check).
    tokio::spawn({
        let settings = settings.clone();
        async move { doctor::log_advisories(&settings).await }
    });
    let retention = settings.retention.as_ref().map(|retention| {
        tokio::spawn(crate::retention::run(crate::retention::Sweeper {
            database_url: settings.database.database_url.clone(),
            tables: settings.database.tables.clone(),
            retention: Arc::new(retention.clone()),
            publication: settings.database.publication.clone(),
            slot: settings.database.slot.clone(),
        }))
    });
    Ok((settings, announcement, retention))
}

/// A task that ends with its owner (the retention sweeper of one pipeline run).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `outboxd run`: retries transient start-up failures for `--startup-timeout`, then moves events into Kafka
/// until shutdown in the configured mode.
pub async fn run(settings: RunSettings<TableSpec>, shutdown: watch::Receiver<bool>) -> Result<()> {
    run_with(settings, KafkaSinks::default(), shutdown).await
}

/// [`run`] into the sinks `sinks` makes (an in-memory broker in tests). A table that gains columns while it
/// runs (see [`Error::TablesChanged`]) starts it over from the start-up checks.
pub async fn run_with(
    configured: RunSettings<TableSpec>,
    sinks: impl Sinks,
    shutdown: watch::Receiver<bool>,
) -> Result<()> {
    loop {
        match run_once(configured.clone(), sinks.clone(), shutdown.clone()).await {
            Err(Error::TablesChanged(why)) => {
                // No pipeline delivers until the start-up checks passed again.
                crate::http::READINESS.set_mode("starting");
                tracing::warn!(%why, "an outbox table changed: inspecting the tables again")
            }
            ended => return ended,
        }
    }
}

async fn run_once(
    configured: RunSettings<TableSpec>,
    sinks: impl Sinks,
    shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let (settings, announcement, retention) = start_up(configured, &sinks).await?;
    let _retention = retention.map(AbortOnDrop);
    let database = &settings.database;
    let warnings = [
        database
            .database_url
            .unverified_tls_warning("--database-url"),
        database
            .replication_url
            .unverified_tls_warning("--replication-url"),
    ];
    // Without --replication-url both are the same URL: said once.
    let same_url = database.replication_url.config.get_hosts()
        == database.database_url.config.get_hosts()
        && database.replication_url.tls == database.database_url.tls;
    for warning in warnings.iter().take(if same_url { 1 } else { 2 }).flatten() {
        tracing::warn!("{warning}");
    }
    tracing::info!(
        tables = %crate::table::names(&settings.database.tables),
        mode = ?settings.mode,
        slot = %settings.database.slot,
        publication = %settings.database.publication,
        "start-up checks passed"
    );
    let settings = Arc::new(settings);
    let pipeline = async {
        match settings.mode {
            Mode::Poll => {
                tracing::info!(mode = "poll", "polling the outbox table");
                if settings.kafka.exactly_once.is_some() {
                    tracing::warn!("--delivery exactly-once covers the CDC path, and the server does not allow logical replication: polling delivers at least once");
                }
                crate::http::READINESS.set_mode("poll");
                poll::poll_all_tables(settings.clone(), ClaimScope::All, sinks, shutdown).await
            }
            Mode::Cdc => {
                cdc::CdcPipeline::new(settings.clone(), sinks)
                    .run(shutdown)
                    .await
            }
            Mode::Auto => run_auto(settings.clone(), sinks, shutdown).await,
        }
    };
    match announcement {
        Some(mut announcement) => tokio::select! {
            result = pipeline => result,
            conflict = announcement.conflict() => Err(conflict),
        },
        None => pipeline.await,
    }
}

/// Resolves once `shutdown` turns true (or its sender is gone). Unlike `watch::Receiver::wait_for` it
/// returns no guard, which in a `select!` whose other arms await would make the pipeline a future that
/// cannot move between threads.
pub(crate) async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// How often `auto` checks whether replication has become available while it polls.
const REPLICATION_RECHECK: Duration = Duration::from_secs(10);

/// `--mode auto`: the slot when the server allows it, otherwise polling; switches both ways, logging each
/// switch once with its reason.
async fn run_auto(
    settings: Arc<RunSettings>,
    sinks: impl Sinks,
    mut shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let mut cdc = cdc::CdcPipeline::new(settings.clone(), sinks.clone());
    loop {
        let reason = match doctor::startup::replication_availability(&settings, true, true).await {
            Ok(doctor::startup::Availability::Available) => {
                tracing::info!(
                    mode = "cdc",
                    "mode switch: streaming from the replication slot"
                );
                // Not ready until the session streams (leadership, the slot, an exactly-once start).
                crate::http::READINESS.set_mode("starting");
                match cdc.run(shutdown.clone()).await {
                    Ok(()) => return Ok(()),
                    Err(error) if is_replication_setup_error(&error) => error,
                    Err(error) => return Err(error),
                }
            }
            Err(error) if error.is_transient() => {
                tracing::warn!(%error, "cannot tell whether replication is available; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(REPLICATION_RECHECK) => continue,
                    _ = crate::pipeline::stopped(&mut shutdown) => return Ok(()),
                }
            }
            // Replication not ready (a switchover moving one URL before the other): poll meanwhile; the
            // periodic check below returns to the slot once it is. Start-up refused it when it was not ready.
            Err(error) if error.awaited_database().is_some() => error,
            Err(error) => return Err(error),
            Ok(doctor::startup::Availability::Unavailable(error)) => error,
        };
        tracing::warn!(mode = "poll", reason = %reason, "mode switch: replication unavailable, polling the outbox table");
        crate::http::READINESS.set_mode("poll");
        let (stop_poll, poll_shutdown) = watch::channel(false);
        let mut polling = tokio::spawn(poll::poll_all_tables(
            settings.clone(),
            ClaimScope::All,
            sinks.clone(),
            poll_shutdown,
        ));
        let mut unconsumed_slot = UnconsumedSlot::new(settings.auto_drop_slot_after);
        let stop_for_good = loop {
            tokio::select! {
                result = &mut polling => {
                    return result.map_err(|e| Error::bug(format!("polling task failed: {e}")))?;
                }
                _ = stopped(&mut shutdown) => break true,
                _ = tokio::time::sleep(REPLICATION_RECHECK) => {
                    if matches!(doctor::startup::replication_availability(&settings, true, true).await, Ok(doctor::startup::Availability::Available)) {
                        break false;
                    }
                    unconsumed_slot.drop_when_due(&settings).await;
                }
            }
        };
        let _ = stop_poll.send(true);
        polling
            .await
            .map_err(|e| Error::bug(format!("polling task failed: {e}")))??;
        if stop_for_good {
            return Ok(());
        }
    }
}

/// The slot `auto` leaves behind while it polls: nothing consumes it, and it keeps WAL on the server for as
/// long as it exists (bounded only by `max_slot_wal_keep_size`, if set). After `--auto-drop-slot-after` it
/// is dropped, unless a client streams from it or a live CDC leader (another instance) holds it; when
/// replication works again, a new slot is created, whose
/// snapshot hands what it will not send (rows committed meanwhile, which the polling path publishes anyway)
/// to the polling path. A drop that fails (the role may no longer replicate) is said once, with the fix.
struct UnconsumedSlot {
    drop_after: Option<Duration>,
    polling_since: Instant,
    dropped: bool,
    told: bool,
    /// Said once that a live leader holds the slot.
    kept_for_leader: bool,
}

impl UnconsumedSlot {
    fn new(drop_after: Option<Duration>) -> Self {
        UnconsumedSlot {
            drop_after,
            polling_since: Instant::now(),
            dropped: false,
            told: false,
            kept_for_leader: false,
        }
    }

    async fn drop_when_due(&mut self, settings: &RunSettings) {
        let Some(after) = self.drop_after else {
            return;
        };
        if self.dropped || self.polling_since.elapsed() < after {
            return;
        }
        let slot = &settings.database.slot;
        let dropped = async {
            let sql = pg::connect(&settings.database.database_url).await?;
            match slot::slot_state(&sql, slot).await? {
                None => Ok(true),
                Some(state) if state.active => Ok(false),
                // A live leader's, between two of its sessions.
                Some(_) if fleet::led_by_another(&sql, settings).await? => {
                    if !self.kept_for_leader {
                        self.kept_for_leader = true;
                        tracing::info!(%slot, "not dropping the replication slot nothing consumes: another instance leads CDC and streams from it between its sessions");
                    }
                    Ok(false)
                }
                Some(_) => {
                    sql.execute("SELECT pg_drop_replication_slot($1)", &[slot])
                        .await?;
                    tracing::warn!(%slot, polling_for = ?after, "dropped the replication slot nothing consumed while polling (it kept WAL on the server); a new one is created when replication is available again");
                    Ok::<_, Error>(true)
                }
            }
        };
        match dropped.await {
            Ok(dropped) => self.dropped = dropped,
            Err(error) if !self.told => {
                self.told = true;
                tracing::warn!(%slot, %error, "cannot drop the replication slot nothing consumes while polling: it keeps WAL on the server until replication works again; drop it yourself (SELECT pg_drop_replication_slot('{slot}')) or set max_slot_wal_keep_size");
            }
            Err(_) => {}
        }
    }
}

/// Errors after which `auto` polls instead of streaming: replication itself became unusable.
fn is_replication_setup_error(error: &Error) -> bool {
    matches!(error, Error::ReplicationUnavailable { .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_waited_out_then_given_up_naming_what_it_waited_for() {
        let mut outage = DatabaseOutage::new(Duration::from_secs(3600));
        assert_eq!(
            outage.judge(&Error::in_recovery()).unwrap().as_deref(),
            Some("the standby to be promoted")
        );
        assert_eq!(
            outage
                .judge(&Error::database_missing("database \"shop\" does not exist"))
                .unwrap()
                .as_deref(),
            Some("the database to exist")
        );
        let broker_down = Error::Kafka {
            message: "all brokers down".into(),
            transient: true,
        };
        assert_eq!(
            outage.judge(&broker_down).unwrap(),
            None,
            "not the database's"
        );

        let mut impatient = DatabaseOutage::new(Duration::ZERO);
        let error = impatient.judge(&Error::in_recovery()).unwrap_err();
        assert!(!error.is_transient());
        let text = error.to_string();
        assert!(
            text.contains("gave up after --reconnect-timeout")
                && text.contains("the standby to be promoted")
                && text.contains("raise --reconnect-timeout"),
            "{text}"
        );
    }
}
