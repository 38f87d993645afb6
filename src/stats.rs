//! Periodic figures that need SQL or a broker round trip: slot lag, retained and safe WAL, wal_status,
//! backlog, its oldest age and the dead letters; and the readiness flags. Runs on its own interval, never
//! per event. Whether PostgreSQL answers (readiness) is checked apart from the backlog figures: slow figures
//! are a warning in the log, not an unreachable database; and a backlog no index can count is not counted
//! (a whole-table read every 5 s would load the application's database). A failure of this task itself is
//! reported by readiness, never left as a frozen last answer.

use std::collections::{BTreeMap, BTreeSet};
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

/// Events may wait this long with none delivered (by this process or, as the backlog shows, another)
/// before `/readyz` says the pipeline stalled.
pub const STALL_AFTER: Duration = Duration::from_secs(60);

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

/// How often the failover readiness (`--standby-url`s included) is read for `/metrics`.
const FAILOVER_INTERVAL: Duration = Duration::from_secs(30);

/// Refreshes the failover gauges every [`FAILOVER_INTERVAL`] until the process ends (PostgreSQL 17+; a
/// reading that fails leaves the gauges at "not ready").
pub async fn watch_failover(settings: std::sync::Arc<RunSettings<TableSpec>>) {
    let db = &settings.database;
    let mut client: Option<tokio_postgres::Client> = None;
    loop {
        let reading = async {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = Some(pg::connect_for_figures(&db.database_url, REFRESH_TIMEOUT).await?);
            }
            let Some(client) = client.as_ref() else {
                return Ok(None);
            };
            let version = pg::server_version(client).await?;
            pg::failover::read(client, version, &db.slot, &db.standby_urls).await
        };
        match reading.await {
            Ok(readiness) => m::set_failover(readiness.as_ref()),
            Err(error) => {
                tracing::debug!(%error, "cannot read the failover readiness");
                m::set_failover(None);
            }
        }
        tokio::time::sleep(FAILOVER_INTERVAL).await;
    }
}

async fn check_forever(settings: std::sync::Arc<RunSettings<TableSpec>>) {
    let (deliveries, _) = mpsc::unbounded_channel::<Delivery<()>>();
    let publisher = Publisher::new(&settings, KnownTopics::default(), deliveries).ok();
    let mut client: Option<tokio_postgres::Client> = None;
    let mut figures = Figures::default();
    let mut watchdog = Watchdog::default();
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
                let backlog = figures
                    .report(refreshed.unwrap_or_else(|_| Err("took longer than 4 s".into())));
                // Figures that could not be read (slow, or a lock on the table) are taken as unchanged:
                // only this instance's own publishing then counts as progress.
                let sample = READINESS.should_deliver().then(|| Sample {
                    published: m::published_so_far(),
                    tables: match backlog {
                        Some(backlog) => backlog.activity,
                        None => watchdog.last_tables(),
                    },
                });
                judge_stall(&mut watchdog, sample);
            }
            _ if READINESS.is_standby() => {
                judge_stall(&mut watchdog, None);
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
    ) -> Result<outbox::Backlog, String> {
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
        let backlog = outbox::backlog(client, &counted, settings.poll.order)
            .await
            .map_err(failed)?;
        gauge!(m::UNPUBLISHED_EVENTS).set(backlog.unpublished_events as f64);
        gauge!(m::OLDEST_UNPUBLISHED_AGE)
            .set(backlog.oldest_unpublished_age_seconds.unwrap_or(0.0));
        gauge!(m::DEAD_EVENTS).set(dead as f64);
        Ok(backlog)
    }

    /// Logs a failure when it starts and when it ends; the gauges keep their last values meanwhile.
    fn report(&mut self, refreshed: Result<outbox::Backlog, String>) -> Option<outbox::Backlog> {
        match (refreshed, self.failing.is_some()) {
            (Ok(backlog), failing) => {
                if failing {
                    self.failing = None;
                    tracing::info!("the backlog figures are refreshed again");
                }
                Some(backlog)
            }
            (Err(error), false) => {
                tracing::warn!(%error, "the backlog figures could not be refreshed; their gauges keep their last values (readiness is not affected: PostgreSQL answers)");
                self.failing = Some(error);
                None
            }
            (Err(_), true) => None,
        }
    }
}

/// Feeds the watchdog and tells readiness and the log when a stall begins, changes and ends.
fn judge_stall(watchdog: &mut Watchdog, sample: Option<Sample>) {
    let was = watchdog.stalled.clone();
    let stalled = watchdog.observe(std::time::Instant::now(), sample).to_vec();
    READINESS.set_stalled(!stalled.is_empty());
    if stalled == was {
        return;
    }
    if stalled.is_empty() {
        tracing::info!("events are published again: the stall is over");
    } else {
        tracing::warn!(stalled_for = ?STALL_AFTER, tables = %stalled.join(", "), "the pipeline stalled: events of these tables could be claimed and none has been published, by this instance or another; /readyz reports it until one is (look for a lock on the table in pg_locks, a broker refusing events in the log, or a slow server)")
    }
}

/// What the watchdog looks at, every [`INTERVAL`].
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    /// Events this process published so far ([`m::published_so_far`]).
    published: u64,
    /// Each table with the polling columns (only their rows can be judged due).
    tables: Vec<outbox::TableActivity>,
}

/// Judges, table by table, whether the pipeline stalls: one of the table's events is owed (it could be
/// claimed now, or it waits for its retry after a failed attempt; not one behind such a row of its aggregate
/// that never failed, nor one the application scheduled for later), and for [`STALL_AFTER`] none of its events was published, by any instance, as its newest `published_at`
/// shows. Where no index shows that, any event this process published counts as progress. Pure.
#[derive(Debug, Default)]
struct Watchdog {
    last: Option<Sample>,
    /// When each table's progress was last seen (or the watch began).
    progress_at: BTreeMap<String, std::time::Instant>,
    /// The tables that stall, as last judged.
    stalled: Vec<String>,
}

impl Watchdog {
    /// `sample` is `None` while the pipeline is not meant to deliver (starting, standing by, reconnecting):
    /// the watch starts over. Returns the tables that stall.
    fn observe(&mut self, now: std::time::Instant, sample: Option<Sample>) -> &[String] {
        let Some(sample) = sample else {
            *self = Watchdog::default();
            return &self.stalled;
        };
        let last = self.last.take();
        let published_here = last
            .as_ref()
            .is_none_or(|l| l.published != sample.published);
        let mut progress_at = BTreeMap::new();
        for table in &sample.tables {
            let before = last
                .as_ref()
                .and_then(|l| l.tables.iter().find(|t| t.table == table.table));
            let progressed = match before {
                None => true,
                Some(_) if !table.newest_published_known => published_here,
                Some(before) => match (before.newest_published, table.newest_published) {
                    (Some(then), Some(newest)) => newest > then,
                    (then, newest) => then.is_none() && newest.is_some(),
                },
            };
            let since = match self.progress_at.get(&table.table) {
                Some(&at) if !progressed && table.due => at,
                _ => now,
            };
            progress_at.insert(table.table.clone(), since);
        }
        self.progress_at = progress_at;
        self.stalled = self
            .progress_at
            .iter()
            .filter(|(_, &at)| now.duration_since(at) >= STALL_AFTER)
            .map(|(table, _)| table.clone())
            .collect();
        self.last = Some(sample);
        &self.stalled
    }

    /// The tables as last seen, for a round whose figures could not be read: taken as unchanged.
    fn last_tables(&self) -> Vec<outbox::TableActivity> {
        self.last
            .as_ref()
            .map(|l| l.tables.clone())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{Sample, Watchdog, STALL_AFTER};
    use crate::pg::outbox::TableActivity;

    /// `newest_published`: `None` where no index shows it.
    fn activity(table: &str, due: bool, newest_published: Option<f64>) -> TableActivity {
        TableActivity {
            table: table.into(),
            due,
            newest_published,
            newest_published_known: newest_published.is_some(),
        }
    }

    /// One table, `t`.
    fn sample(published: u64, waiting: bool, newest_published: f64) -> Option<Sample> {
        Some(Sample {
            published,
            tables: vec![activity("t", waiting, Some(newest_published))],
        })
    }

    fn stalls(watchdog: &mut Watchdog, at: Instant, sample: Option<Sample>) -> bool {
        !watchdog.observe(at, sample).is_empty()
    }

    #[test]
    fn claimable_events_with_nothing_published_stall_after_the_limit() {
        let start = Instant::now();
        let mut watchdog = Watchdog::default();
        assert!(!stalls(&mut watchdog, start, sample(5, true, 100.0)));
        assert!(!stalls(
            &mut watchdog,
            start + STALL_AFTER / 2,
            sample(5, true, 100.0)
        ));
        assert!(stalls(
            &mut watchdog,
            start + STALL_AFTER,
            sample(5, true, 100.0)
        ));
        // One event of the table published: the watch starts over.
        assert!(!stalls(
            &mut watchdog,
            start + STALL_AFTER * 2,
            sample(6, true, 101.0)
        ));
        assert!(stalls(
            &mut watchdog,
            start + STALL_AFTER * 3,
            sample(6, true, 101.0)
        ));
    }

    #[test]
    fn nothing_claimable_or_another_instance_publishing_never_stalls() {
        let start = Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);
        let mut watchdog = Watchdog::default();
        for step in 0..10 {
            // Rows waiting for their retry (or behind those of their aggregate) only.
            assert!(!stalls(
                &mut watchdog,
                at(step * 60),
                sample(0, false, 100.0)
            ));
        }
        // Another instance publishes: the newest published_at moves.
        let mut watchdog = Watchdog::default();
        for step in 0..10 {
            assert!(!stalls(
                &mut watchdog,
                at(step * 60),
                sample(0, true, 100.0 + step as f64)
            ));
        }
        assert!(stalls(&mut watchdog, at(600), sample(0, true, 109.0)));
    }

    /// One table stuck while another flows is a stall of that table: events published elsewhere (counted
    /// by this process) do not hide it. A table whose progress no index shows falls back on them.
    #[test]
    fn a_stuck_table_stalls_while_another_flows() {
        let start = Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);
        let mut watchdog = Watchdog::default();
        let round = |step: u64| {
            Some(Sample {
                published: step * 100,
                tables: vec![
                    activity("flowing", true, Some(step as f64)),
                    activity("stuck", true, Some(0.0)),
                    // Nothing published yet.
                    TableActivity {
                        newest_published: None,
                        ..activity("never_published", true, Some(0.0))
                    },
                    activity("unindexed", true, None),
                ],
            })
        };
        for step in 0..6 {
            assert!(watchdog.observe(at(step * 10), round(step)).is_empty());
        }
        assert_eq!(
            watchdog.observe(at(60), round(6)),
            ["never_published", "stuck"]
        );
    }

    #[test]
    fn a_pipeline_that_is_not_meant_to_deliver_starts_the_watch_over() {
        let start = Instant::now();
        let mut watchdog = Watchdog::default();
        assert!(!stalls(&mut watchdog, start, sample(0, true, 1.0)));
        assert!(stalls(
            &mut watchdog,
            start + STALL_AFTER,
            sample(0, true, 1.0)
        ));
        assert!(!stalls(&mut watchdog, start + STALL_AFTER, None));
        assert!(!stalls(
            &mut watchdog,
            start + STALL_AFTER * 2,
            sample(0, true, 1.0)
        ));
        assert!(stalls(
            &mut watchdog,
            start + STALL_AFTER * 3,
            sample(0, true, 1.0)
        ));
    }
}
