//! The CDC fast path: slot stream -> decode -> publish -> (ack + backfill) -> watermark -> confirm.
//!
//! One *session* is one replication connection. Transient failures end the session; the next one resumes
//! from the slot's own position, and recognises what it confirmed before by the highest confirmed position
//! kept in memory (PG 15 can move `confirmed_flush_lsn` back). A position is kept only for its own server
//! history (see `history`).
//! Reading stops while the in-flight window is full, but standby status updates keep flowing on a timer.
//!
//! This module owns leadership and reconnecting: sessions run while this instance leads, with the sweeper
//! alongside. Its rooms: `bootstrap` (a session's connections, slot and start position), `session` (the
//! stream loop), and the pure cores it drives: `decoder` (pgoutput to tagged events), `gate` (publish,
//! park or hand off, per aggregate), `window` (how much may be in flight) and `earlier_hand_offs` (when events
//! found handed off before may be confirmed).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use crate::backoff::Backoff;
use crate::config::{ExactlyOnceSettings, RunSettings};
use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::pg;
use crate::pg::outbox::ClaimScope;
use crate::pipeline::backfill;
use crate::pipeline::history::ServerHistory;
use crate::pipeline::leader;
use crate::pipeline::topic_holds::TopicHolds;
use crate::pipeline::watermark::Watermark;
use crate::progress::ProgressKey;
use crate::sink::{Sink, Sinks};

mod bootstrap;
mod decoder;
mod earlier_hand_offs;
mod gate;
mod owed;
mod session;
mod window;
use owed::OwedHandOffs;
use session::{ExactlyOnce, Session};

/// Most blocked aggregates tracked one by one. A table with more (a huge hand-off after a slot was
/// recreated) is held whole: all its events go to the polling path, in order, until few enough remain.
const MAX_TRACKED_BLOCKED: usize = 50_000;
/// Longest wait before asking again for a slot another walsender holds, while this instance leads.
const SLOT_BUSY_RETRY: Duration = Duration::from_secs(1);
/// Longest wait between two replication sessions (the backoff's cap): pollers next to this leader wait
/// longer than this for its slot to be active again (`fleet::STREAM_GAP_GRACE`).
pub const SESSION_RETRY_CAP: Duration = Duration::from_secs(30);

/// The CDC path: replication sessions on the slot, one after another, reconnecting as needed, publishing
/// into the sinks `K` makes (one per session).
pub struct CdcPipeline<K> {
    settings: Arc<RunSettings>,
    watermark: Watermark,
    sinks: K,
    /// Whether a session of this process ever reached streaming (a slot held since start-up is an error).
    ever_streamed: bool,
    /// Whether the latest session reached streaming (ends a database outage).
    reached_streaming: bool,
    /// The server history `watermark`'s confirmed position belongs to (`None` before the first session).
    history: Option<ServerHistory>,
    /// When a session last stopped streaming: where a history change may have left a gap.
    last_streamed_at: Option<std::time::SystemTime>,
    /// What a session leaves the next one (refused topics, refused events).
    memory: SessionMemory,
}

/// What sessions remember of the ones before them.
#[derive(Default)]
struct SessionMemory {
    /// Topics the broker refused outright: their events go to the polling path for a while.
    topic_holds: TopicHolds,
    /// Events refused for good that the next session hands to the polling path.
    owed: OwedHandOffs,
    /// The slot becomes a failover slot (17+) only once confirmed at or past this position, past every
    /// hand-off written before it: a standby's copy made earlier could rest between an event and its hand-off
    /// (see `bootstrap::set_failover`). The session that confirms it ends, and the next one turns it on.
    failover_after: Option<Lsn>,
}

impl<K: Sinks> CdcPipeline<K> {
    /// A pipeline that has not streamed yet.
    pub fn new(settings: Arc<RunSettings>, sinks: K) -> Self {
        CdcPipeline {
            settings,
            watermark: Watermark::new(Lsn::ZERO),
            sinks,
            ever_streamed: false,
            reached_streaming: false,
            history: None,
            last_streamed_at: None,
            memory: SessionMemory::default(),
        }
    }

    /// Runs sessions until `shutdown` turns true, with the sweeper (the polling path restricted to rows
    /// handed off to it) alongside. Transient failures reconnect with capped backoff, forever.
    pub async fn run(&mut self, mut shutdown: watch::Receiver<bool>) -> Result<()> {
        loop {
            let Some(mut leadership) = leader::acquire(&self.settings, &mut shutdown).await? else {
                return Ok(());
            };
            // Stop streaming when the process stops or when leadership is lost (another instance may lead).
            let (stop, stop_rx) = watch::channel(false);
            let mut parent = shutdown.clone();
            let watcher = tokio::spawn(async move {
                let lost = tokio::select! {
                    _ = crate::pipeline::stopped(&mut parent) => None,
                    lost = leadership.lost() => Some(lost),
                };
                if let Some(Ok(why)) = &lost {
                    tracing::warn!(reason = %why, "lost the leadership lock: stopping streaming (another instance may lead now)");
                }
                let _ = stop.send(true);
                lost
            });
            let result = self.run_as_leader(stop_rx).await;
            // Ok means a stop was signalled, so the watcher has finished or is about to.
            let lost = match &result {
                Ok(()) => watcher.await.unwrap_or(None),
                Err(_) => {
                    watcher.abort();
                    None
                }
            };
            match lost {
                Some(Ok(_)) => {
                    crate::http::READINESS.set_mode("reconnecting");
                    tracing::info!(
                        "stopped streaming after losing the leadership lock; asking for it again"
                    );
                    continue;
                }
                Some(Err(error)) => return Err(error),
                None => return result,
            }
        }
    }

    async fn run_as_leader(&mut self, shutdown: watch::Receiver<bool>) -> Result<()> {
        // Another leader may have replaced the slot meanwhile: a position owed to the old one means nothing.
        self.memory.failover_after = None;
        let (stop_sweeper, mut sweeper_shutdown) = watch::channel(false);
        let (settings, sinks) = (self.settings.clone(), self.sinks.clone());
        // One sweeper per table with polling columns. It outlives its errors: it logs them and starts
        // again, so handed-off rows are never stranded.
        let sweeper = tokio::spawn(async move {
            loop {
                let sweep = crate::pipeline::poll::poll_all_tables(
                    settings.clone(),
                    ClaimScope::HandedOff,
                    sinks.clone(),
                    sweeper_shutdown.clone(),
                );
                match sweep.await {
                    Ok(()) => return,
                    Err(error) => tracing::error!(%error, "sweeper failed; restarting it in 5s"),
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                    _ = crate::pipeline::stopped(&mut sweeper_shutdown) => return,
                }
            }
        });
        let result = self.sessions(shutdown).await;
        let _ = stop_sweeper.send(true);
        // A sweeper waiting on a connection that went silent (leadership lost to a partition) is abandoned:
        // its leases expire and the next leader's sweeper claims the rows.
        let mut sweeper = sweeper;
        match tokio::time::timeout(self.settings.shutdown_timeout, &mut sweeper).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "sweeper task failed"),
            Err(_) => {
                sweeper.abort();
                tracing::warn!(
                    "the sweeper did not stop within --shutdown-timeout; abandoned it (its leases expire)"
                );
            }
        }
        result
    }

    async fn sessions(&mut self, mut shutdown: watch::Receiver<bool>) -> Result<()> {
        let mut backoff = Backoff::new(Duration::from_millis(500), SESSION_RETRY_CAP);
        let mut outage = super::DatabaseOutage::new(self.settings.reconnect_timeout);
        let first_attempt = Instant::now();
        loop {
            let started = Instant::now();
            let result = self.session(&mut shutdown).await;
            if std::mem::take(&mut self.reached_streaming) {
                outage.ended();
            }
            match result {
                Ok(()) => return Ok(()),
                // Held by another client since start-up (not a walsender that is still dying): say so.
                Err(error)
                    if error.is_slot_in_use()
                        && !self.ever_streamed
                        && first_attempt.elapsed() > self.settings.startup_timeout =>
                {
                    return Err(Error::setup(
                        format!("replication slot {} is in use by another client ({error})", self.settings.database.slot),
                        "stop that client (see pg_stat_replication / pg_replication_slots.active_pid), or give outboxd its own --slot",
                    ));
                }
                Err(error) if error.is_transient() || error.awaited_database().is_some() => {
                    crate::http::READINESS.set_mode("reconnecting");
                    // A long session, or one that ended on purpose (to hand refused events over, see
                    // `session`), starts the backoff over.
                    if started.elapsed() > Duration::from_secs(60)
                        || matches!(error, Error::SessionRestart(_))
                    {
                        backoff.reset();
                    }
                    let mut delay = backoff.next_delay();
                    if error.is_slot_in_use() {
                        // We hold the leadership lock: a walsender whose client went silent is the
                        // previous leader's, and is ended; a live one is asked again soon.
                        self.end_silent_walsender().await;
                        delay = delay.min(SLOT_BUSY_RETRY);
                    }
                    match outage.judge(&error)? {
                        Some(waiting_for) => {
                            tracing::warn!(%error, retry_in = ?delay, %waiting_for, "cannot stream: waiting for the database (up to --reconnect-timeout)")
                        }
                        None => {
                            tracing::warn!(%error, retry_in = ?delay, confirmed = %self.watermark.confirmed(), "replication session ended; reconnecting")
                        }
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = crate::pipeline::stopped(&mut shutdown) => return Ok(()),
                    }
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// See [`leader::end_silent_walsender`]; failures only delay the takeover (logged at debug).
    async fn end_silent_walsender(&self) {
        let ended = async {
            let sql = pg::connect(&self.settings.database.database_url).await?;
            leader::end_silent_walsender(&sql, &self.settings.database.slot).await
        };
        match tokio::time::timeout(crate::pipeline::liveness::HEALTH_TIMEOUT, ended).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::debug!(%error, "cannot check the slot for a silent walsender")
            }
            Err(_) => tracing::debug!("no answer when checking the slot for a silent walsender"),
        }
    }

    async fn session(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<()> {
        let settings = self.settings.clone();
        let (mut stream, boot) = self.bootstrap().await?;
        self.ever_streamed = true;
        self.reached_streaming = true;

        let (delivery_tx, delivery_rx) = mpsc::unbounded_channel();
        let (finished_tx, mut finished_rx) = mpsc::unbounded_channel();
        let (publisher, exactly_once) = match &settings.kafka.exactly_once {
            None => (self.sinks.sink(&settings, delivery_tx.clone())?, None),
            Some(eos) => {
                let (publisher, eos) = self
                    .start_exactly_once(eos, &boot, delivery_tx.clone())
                    .await?;
                (publisher, Some(eos))
            }
        };
        // Ready only now: an exactly-once start (fencing earlier producers, reading the progress record) can
        // take a while, and delivers nothing meanwhile.
        crate::http::READINESS.set_mode("cdc");
        let hand_off_rows = backfill::HandOffRows::default();
        let backfill = tokio::spawn(backfill::run(
            settings.database.database_url.clone(),
            settings.database.tables.clone(),
            delivery_rx,
            finished_tx,
            hand_off_rows.clone(),
        ));
        let mut session = Session::new(
            &settings,
            &mut self.watermark,
            &mut self.memory,
            boot,
            publisher,
            backfill::ToBackfill {
                deliveries: delivery_tx,
                rows: hand_off_rows,
            },
            exactly_once,
        );
        let result = session
            .stream(&mut stream, &mut finished_rx, shutdown)
            .await;
        backfill.abort();
        self.last_streamed_at = Some(std::time::SystemTime::now());
        session.end();
        if result.is_ok() {
            stream.close().await;
        }
        result
    }

    /// `--delivery exactly-once`: the session's transactional producer, earlier ones fenced, and what the
    /// last committed Kafka transaction covered (when it belongs to this server history and these tables).
    async fn start_exactly_once(
        &self,
        eos: &ExactlyOnceSettings,
        boot: &bootstrap::Bootstrapped,
        delivery_tx: mpsc::UnboundedSender<crate::sink::Delivery<backfill::CdcTag>>,
    ) -> Result<(K::Sink<backfill::CdcTag>, ExactlyOnce)> {
        let settings = &self.settings;
        let key = ProgressKey {
            system_id: boot.history.system_id.clone(),
            slot: settings.database.slot.clone(),
        };
        let publisher = self.sinks.exactly_once_sink(settings, delivery_tx, &key)?;
        let asked = Instant::now();
        let committed = publisher.begin_transactions(&key).await?;
        let tables: Vec<String> = settings
            .database
            .tables
            .iter()
            .map(|table| table.name.to_string())
            .collect();
        let committed = committed.map(|progress| progress.for_tables(&tables));
        let committed = committed.filter(|progress| {
            match progress.usable_on(boot.history.timeline, boot.replay_end, boot.slot_created_at) {
                Ok(()) => true,
                Err(why) => {
                    tracing::warn!(%why, "the last progress record does not belong to this server history: events it covered are published again where their rows are unpublished");
                    false
                }
            }
        });
        let took = asked.elapsed();
        let transactional_id = key.transactional_id(&eos.progress_topic);
        match &committed {
            Some(progress) => {
                tracing::info!(%transactional_id, commit_lsn = %progress.commit_lsn, events_included = ?progress.events_included, ?took, "exactly-once: Kafka transactions ready; events up to the last committed one are not produced again")
            }
            None => {
                tracing::info!(%transactional_id, ?took, "exactly-once: Kafka transactions ready; no progress recorded for this slot yet")
            }
        }
        let eos = ExactlyOnce::new(
            key,
            boot.history.timeline,
            tables,
            committed,
            eos,
            settings.kafka.transaction_timeout(),
            settings.cdc.max_in_flight_events,
        );
        Ok((publisher, eos))
    }
}
