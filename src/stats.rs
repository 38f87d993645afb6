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
                // Unknown figures leave the last judgement standing.
                if let Some(backlog) = backlog {
                    let sample = READINESS.should_deliver().then(|| Sample {
                        settled: m::settled_so_far(),
                        // Events waiting only for their retry are not held back by a stall.
                        waiting: if backlog.due {
                            backlog.unpublished_events
                        } else {
                            0
                        },
                        oldest_age: backlog.oldest_unpublished_age_seconds,
                    });
                    judge_stall(&mut watchdog, sample);
                }
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
        let backlog = outbox::backlog(client, &counted).await.map_err(failed)?;
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

/// Feeds the watchdog and tells readiness and the log when a stall begins and ends.
fn judge_stall(watchdog: &mut Watchdog, sample: Option<Sample>) {
    let was = watchdog.stalled;
    let stalled = watchdog.observe(std::time::Instant::now(), sample);
    READINESS.set_stalled(stalled);
    match (was, stalled, sample) {
        (false, true, Some(sample)) => {
            tracing::warn!(waiting = sample.waiting, oldest_unpublished_age_seconds = ?sample.oldest_age, stalled_for = ?STALL_AFTER, "the pipeline stalled: events wait and none has been delivered; /readyz reports it until one is (look for a lock on the outbox table in pg_locks, a broker refusing events in the log, or a slow server)")
        }
        (true, false, _) => tracing::info!("events are delivered again: the stall is over"),
        _ => {}
    }
}

/// What the watchdog looks at, every [`INTERVAL`].
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    /// Events this process settled so far ([`m::settled_so_far`]).
    settled: u64,
    /// Unpublished events (the fleet's backlog, counted tables only).
    waiting: i64,
    /// The oldest unpublished event's age.
    oldest_age: Option<f64>,
}

/// Judges whether the pipeline stalls: events wait, and for [`STALL_AFTER`] this process settled none and
/// the backlog neither shrank nor moved its head (another instance delivering them). Pure.
#[derive(Debug, Default)]
struct Watchdog {
    last: Option<Sample>,
    /// When progress was last seen (or the watch began).
    progress_at: Option<std::time::Instant>,
    stalled: bool,
}

impl Watchdog {
    /// `sample` is `None` while the pipeline is not meant to deliver (starting, standing by, reconnecting):
    /// the watch starts over. Returns whether the pipeline stalls.
    fn observe(&mut self, now: std::time::Instant, sample: Option<Sample>) -> bool {
        let Some(sample) = sample else {
            *self = Watchdog::default();
            return false;
        };
        let progressed = match self.last {
            None => true,
            Some(last) => {
                sample.settled != last.settled
                    || sample.waiting < last.waiting
                    || matches!((sample.oldest_age, last.oldest_age), (Some(now), Some(then)) if now < then)
            }
        };
        if progressed || sample.waiting == 0 {
            self.progress_at = Some(now);
        }
        self.last = Some(sample);
        self.stalled = self
            .progress_at
            .is_some_and(|at| now.duration_since(at) >= STALL_AFTER);
        self.stalled
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{Sample, Watchdog, STALL_AFTER};

    fn sample(settled: u64, waiting: i64, oldest_age: f64) -> Option<Sample> {
        Some(Sample {
            settled,
            waiting,
            oldest_age: Some(oldest_age),
        })
    }

    #[test]
    fn waiting_events_with_nothing_settled_stall_after_the_limit() {
        let start = Instant::now();
        let mut watchdog = Watchdog::default();
        assert!(!watchdog.observe(start, sample(5, 10, 1.0)));
        assert!(!watchdog.observe(start + STALL_AFTER / 2, sample(5, 10, 31.0)));
        assert!(watchdog.observe(start + STALL_AFTER, sample(5, 10, 61.0)));
        // One event settled: the watch starts over.
        assert!(!watchdog.observe(start + STALL_AFTER * 2, sample(6, 12, 121.0)));
        assert!(watchdog.observe(start + STALL_AFTER * 3, sample(6, 12, 181.0)));
    }

    #[test]
    fn an_empty_backlog_or_one_another_instance_drains_never_stalls() {
        let start = Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);
        let mut watchdog = Watchdog::default();
        for step in 0..10 {
            assert!(!watchdog.observe(at(step * 60), sample(0, 0, 0.0)));
        }
        // Another instance settles them: the backlog shrinks, or its head moves while new events come.
        let mut watchdog = Watchdog::default();
        assert!(!watchdog.observe(at(0), sample(0, 100, 5.0)));
        assert!(!watchdog.observe(at(60), sample(0, 90, 65.0)));
        assert!(!watchdog.observe(at(120), sample(0, 95, 3.0)));
        assert!(watchdog.observe(at(180), sample(0, 95, 63.0)));
    }

    #[test]
    fn a_pipeline_that_is_not_meant_to_deliver_starts_the_watch_over() {
        let start = Instant::now();
        let mut watchdog = Watchdog::default();
        assert!(!watchdog.observe(start, sample(0, 10, 1.0)));
        assert!(watchdog.observe(start + STALL_AFTER, sample(0, 10, 61.0)));
        assert!(!watchdog.observe(start + STALL_AFTER, None));
        assert!(!watchdog.observe(start + STALL_AFTER * 2, sample(0, 10, 121.0)));
        assert!(watchdog.observe(start + STALL_AFTER * 3, sample(0, 10, 181.0)));
    }
}
