//! The lease-based polling path: claim a batch in a short transaction (lease token, `attempts + 1`), publish
//! outside any transaction, then mark `published_at` guarded by `event_id` AND the lease token. Failures go
//! back with capped exponential backoff; events refused for a reason retrying cannot fix are dead-lettered
//! after `--max-attempts`. Leases are renewed while a slow send is in flight.
//!
//! Used as the whole pipeline in `--mode poll` (and `auto` without replication), and as the sweeper for
//! handed-off rows next to the CDC path.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use uuid::Uuid;

use crate::backoff::{retry_delay, Backoff};
use crate::config::{PollOrder, RunSettings};
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::http::WorkerReadiness;
use crate::pg;
use crate::pg::outbox::{self, BlockedAggregate, ClaimScope, ClaimedRow, PollSql};
use crate::sink::{Delivery, PublishError, Rejection, Sink, Sinks};

type Deliveries = mpsc::UnboundedReceiver<Delivery<Option<usize>>>;

/// What happened to one claimed row.
#[derive(Debug)]
enum Outcome {
    InFlight,
    Delivered,
    /// Not sent because an earlier event of its aggregate failed in this batch.
    HeldBack,
    /// Failed only because the producer stopped at another aggregate's refusal (the gap-less guarantee):
    /// not its fault; sent again at once on a new producer (see `publish_batch`), else given back.
    Stopped,
    Failed(Rejection),
    /// Can never be published (NULL required column): dead-lettered at once.
    Invalid(String),
}

/// How long a producer stopped by a refusal is given for the answers to requests already on their way
/// before what it still holds is purged (see `PollWorker::await_reports`).
const STOPPED_PRODUCER_GRACE: Duration = Duration::from_secs(2);

/// At most this many events that failed before go alone ahead of their batch (see
/// `Worker::send_retries_alone`).
const ALONE_FIRST: usize = 8;

/// A claimed row's aggregate, as the batch groups them.
fn aggregate_of(row: &ClaimedRow) -> (&str, &str) {
    (
        row.event.aggregate_type.as_deref().unwrap_or_default(),
        row.event.aggregate_id.as_str(),
    )
}

/// Whether a failed event is dead-lettered now: when the broker refused the event's own bytes with the event
/// sent alone (too large for the topic, an invalid record: retrying the same bytes cannot change the answer,
/// and each retry would cost a producer), or when it was refused for good `max_attempts` times (a topic
/// refused outright may be allowed again: an ACL restored). Failures that are not refusals are retried
/// forever.
fn dead_letters(rejection: &Rejection, alone: bool, attempts: i32, max_attempts: i32) -> bool {
    rejection.permanent && ((alone && rejection.of_the_event) || attempts >= max_attempts)
}

/// Counts of one batch, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows delivered and marked published.
    pub published: usize,
    /// Rows given back to retry later (after a backoff, or at once when the broker is down).
    pub retried: usize,
    /// Rows dead-lettered.
    pub dead: usize,
    /// Rows given back unsent because an earlier event of their aggregate failed in this batch.
    pub held_back: usize,
    /// Nothing was delivered and every failure was transient: the broker (or the way to it) is down, so the
    /// rows went back without a per-row backoff and the worker waits instead.
    pub broker_down: bool,
    /// The producer was purged (acknowledgements took longer than the delivery timeout) or failed fatally
    /// (a refusal under the gap-less guarantee): the worker replaces it before the next batch.
    pub producer_spent: bool,
}

/// The longest a worker waits between batches while the broker fails every send: once it is back,
/// publishing resumes within this (plus librdkafka's reconnect backoff).
const BROKER_DOWN_MAX_WAIT: Duration = Duration::from_secs(5);

/// The most aggregates one worker leaves out of its claims at once. The claim hashes their keys; this many
/// fit PostgreSQL's default `work_mem` with room to spare (about 1 MiB as the planner counts it).
const MAX_SKIPPED_AGGREGATES: usize = 20_000;

/// The longest an aggregate waiting for a retry is left out before a claim looks at it again: its wait can
/// end early without this worker seeing it (an operator made the retry due, another path published it).
const LONGEST_SKIP: Duration = Duration::from_secs(10);

/// The longest an aggregate another worker's lease holds is left out. That worker usually publishes it
/// within its batch, and any worker may take the aggregate's next events then: left out longer, aggregates
/// would stay with whichever worker claimed them first (four workers took 703, 797, 700 and 2,800 of 5,000
/// events with 10 s). Long enough that a claim gets past rows leased for long (a killed worker's, a batch
/// waiting on a partition without a leader).
const LEASED_SKIP: Duration = Duration::from_secs(1);

/// The aggregates this worker's claims found blocked (their first unpublished event waiting for a retry, or
/// leased by another worker), left out of its next claims until they may be claimable again. Their rows then
/// take no room in the claim's prefix, so the other aggregates keep moving however many rows the blocked
/// ones hold at the head of the order. Leaving an aggregate out never reorders it: none of its events is
/// claimed meanwhile.
#[derive(Debug, Default)]
pub struct BlockedAggregates {
    /// Key (as the claim SQL names the aggregate) → when to look at it again.
    until: HashMap<String, Instant>,
}

/// What [`BlockedAggregates::record`] did with a claim's findings.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// Aggregates not left out before: the next claim's prefix reaches rows this claim's did not.
    pub added: usize,
    /// Aggregates not left out because [`MAX_SKIPPED_AGGREGATES`] are already.
    pub dropped: usize,
}

impl BlockedAggregates {
    /// The aggregates a claim made at `now` leaves out; forgets those whose wait is over by then.
    pub fn skip(&mut self, now: Instant) -> Vec<String> {
        self.until.retain(|_, until| *until > now);
        self.until.keys().cloned().collect()
    }

    /// Records the aggregates a claim made at `now` found blocked, each until its wait ends (at most
    /// [`LONGEST_SKIP`], or [`LEASED_SKIP`] for one held by another worker's lease).
    pub fn record(&mut self, found: Vec<BlockedAggregate>, now: Instant) -> Recorded {
        let mut recorded = Recorded::default();
        for aggregate in found {
            let longest = if aggregate.leased {
                LEASED_SKIP
            } else {
                LONGEST_SKIP
            };
            let until = now + aggregate.ready_in.min(longest);
            if let Some(known) = self.until.get_mut(&aggregate.key) {
                *known = until;
            } else if self.until.len() < MAX_SKIPPED_AGGREGATES {
                self.until.insert(aggregate.key, until);
                recorded.added += 1;
            } else {
                recorded.dropped += 1;
            }
        }
        recorded
    }
}

/// LISTENs on the table's NOTIFY channel on a dedicated connection; the returned `Notify` fires on every
/// notification (and when the connection ends, so the poller never sleeps on a dead listener).
async fn listen(
    settings: &RunSettings,
    table: &crate::table::TableName,
) -> Result<(tokio_postgres::Client, Arc<tokio::sync::Notify>)> {
    let (client, mut connection) = settings.database.database_url.connect_raw().await?;
    let notify = Arc::new(tokio::sync::Notify::new());
    let wake = notify.clone();
    tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(tokio_postgres::AsyncMessage::Notification(_))) => wake.notify_one(),
                Some(Ok(_)) => {}
                _ => {
                    wake.notify_one();
                    return;
                }
            }
        }
    });
    let channel = pg::migrate::notify_channel(table);
    client
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await?;
    match pg::migrate::notify_trigger(&client, table).await? {
        pg::migrate::NotifyTrigger::Current => {}
        pg::migrate::NotifyTrigger::Missing => {
            tracing::warn!(%table, "--poll-notify is set but the trigger is missing: run `outboxd migrate --poll-notify`; polling on the interval meanwhile")
        }
        pg::migrate::NotifyTrigger::Outdated => {
            tracing::warn!(%table, %channel, "--poll-notify is set but the trigger was installed by an older outboxd and notifies on another channel: run `outboxd migrate --poll-notify` to update it; polling on the interval meanwhile")
        }
    }
    Ok((client, notify))
}

/// Polls every outbox table that has the polling columns, one worker each, until `shutdown` turns true or
/// a worker fails for good.
pub async fn poll_all_tables(
    settings: Arc<RunSettings>,
    scope: ClaimScope,
    sinks: impl Sinks,
    shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let mut workers = tokio::task::JoinSet::new();
    for (table, _) in settings
        .database
        .tables
        .iter()
        .enumerate()
        .filter(|(_, t)| t.polling)
    {
        let worker = PollWorker::new(settings.clone(), table, scope, sinks.clone());
        let shutdown = shutdown.clone();
        workers.spawn(async move { worker.run(shutdown).await });
    }
    while let Some(result) = workers.join_next().await {
        result.map_err(|e| Error::bug(format!("polling task failed: {e}")))??;
    }
    Ok(())
}

/// Waits `delay` (after a claim found nothing, while a CDC leader streams, or after the broker failed a whole
/// batch), or until `wake` (the table's NOTIFY) fires; true when shutdown came first.
async fn idle(
    wake: Option<&tokio::sync::Notify>,
    delay: Duration,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let notified = async {
        match wake {
            Some(notify) => notify.notified().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::time::sleep(delay) => false,
        _ = notified => false,
        _ = crate::pipeline::stopped(shutdown) => true,
    }
}

/// Renews the lease of the claimed rows every half lease, counted from the claim, for as long as their batch
/// is being handled (topic creation, sends, delivery reports, the final marks): a batch may take longer
/// than a lease, and a lapsed lease lets another worker publish the same rows, or later events of their
/// aggregates, meanwhile. Returns only on error.
async fn renew_leases(
    client: &tokio_postgres::Client,
    sql: &PollSql,
    ids: &[Uuid],
    token: Uuid,
    lease: Duration,
    claimed_at: tokio::time::Instant,
) -> Error {
    let every = lease / 2;
    let mut renew_at = claimed_at + every;
    loop {
        tokio::time::sleep_until(renew_at).await;
        if let Err(error) = sql.renew(client, ids, token, lease).await {
            return error;
        }
        renew_at += every;
    }
}

/// Polls one outbox table, publishing into the sinks `K` makes.
pub struct PollWorker<K> {
    settings: Arc<RunSettings>,
    /// Index into `settings.database.tables`.
    table: usize,
    scope: ClaimScope,
    sinks: K,
}

/// A worker's producer.
type PollSink<K> = <K as Sinks>::Sink<Option<usize>>;

impl<K: Sinks> PollWorker<K> {
    /// A worker for `settings.database.tables[table]`, claiming rows of `scope`.
    pub fn new(settings: Arc<RunSettings>, table: usize, scope: ClaimScope, sinks: K) -> Self {
        PollWorker {
            settings,
            table,
            scope,
            sinks,
        }
    }

    fn table(&self) -> &crate::table::OutboxTable {
        &self.settings.database.tables[self.table]
    }

    /// Polls until `shutdown` turns true; transient failures reconnect with capped backoff, forever.
    pub async fn run(&self, mut shutdown: watch::Receiver<bool>) -> Result<()> {
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        let mut outage = super::DatabaseOutage::new(self.settings.reconnect_timeout);
        let mut readiness = WorkerReadiness::default();
        loop {
            let result = self
                .session(&mut shutdown, &mut backoff, &mut outage, &mut readiness)
                .await;
            match result {
                Ok(()) => return Ok(()),
                Err(error) if error.is_transient() || error.awaited_database().is_some() => {
                    if self.scope == ClaimScope::All {
                        readiness.reconnecting();
                    }
                    let delay = backoff.next_delay();
                    match outage.judge(&error)? {
                        Some(waiting_for) => {
                            tracing::warn!(%error, retry_in = ?delay, %waiting_for, "cannot poll: waiting for the database (up to --reconnect-timeout)")
                        }
                        None => {
                            tracing::warn!(%error, retry_in = ?delay, "polling interrupted; reconnecting")
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

    /// The session's SQL connection (to a primary; `pg::connect` reads times as ISO UTC) with its statements prepared,
    /// once every row of the table has a position.
    async fn open(&self) -> Result<(tokio_postgres::Client, PollSql)> {
        // A silent server must end the session (it may hold the claim lock every claimer waits for).
        let mut client = pg::connect(&super::liveness::with_dead_peer_detection(
            &self.settings.database.database_url,
        ))
        .await?;
        if pg::in_recovery(&client).await? {
            return Err(Error::in_recovery());
        }
        // Rows older than the polling columns have no position; the sweeper may meet them too (handed off by
        // `migrate --existing-rows unpublished`).
        let numbering = client.transaction().await?;
        numbering
            .batch_execute(outbox::WITHOUT_STATEMENT_TIMEOUT)
            .await?;
        let numbered = outbox::number_rows_without_position(&numbering, self.table()).await?;
        numbering.commit().await?;
        if numbered > 0 {
            tracing::info!(table = %self.table().name, rows = numbered, "gave rows without a position one, in insert order");
        }
        let poll = &self.settings.poll;
        let sql = PollSql::prepare(&client, self.table(), poll.order, self.scope).await?;
        Ok((client, sql))
    }

    /// One connection's claim loop: defer to a streaming CDC leader, claim, idle when nothing came, publish
    /// the batch under renewed leases, then do what its report asks (a new producer, a broker-down wait).
    // Long: the loop's steps in their order; each is one call, the waits share `idle`.
    async fn session(
        &self,
        shutdown: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
        outage: &mut super::DatabaseOutage,
        readiness: &mut WorkerReadiness,
    ) -> Result<()> {
        let poll = &self.settings.poll;
        let (mut client, sql) = self.open().await?;
        let (mut publisher, mut deliveries) = self.new_publisher()?;
        let wake = match (poll.notify, self.scope) {
            (true, ClaimScope::All) => Some(listen(&self.settings, &self.table().name).await?),
            _ => None,
        };
        let mut idle_delay = poll.interval;
        let mut broker_down = Backoff::new(
            poll.retry_base.min(BROKER_DOWN_MAX_WAIT),
            BROKER_DOWN_MAX_WAIT,
        );
        // Claiming every row next to a live CDC leader would race the slot for them: leave them to it.
        let mut leader = (self.scope == ClaimScope::All)
            .then(|| super::fleet::LeaderWatch::new(&self.table().name));
        let mut blocked = BlockedAggregates::default();
        let mut warned_full = false;
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            if let Some(leader) = &mut leader {
                let defer = leader.defer(&client).await?;
                // The session is up (deferring to a live leader is this worker's work while it lives).
                readiness.working("poll");
                if defer {
                    if idle(None, super::fleet::LEADER_CHECK, shutdown).await {
                        return Ok(());
                    }
                    continue;
                }
            }
            let token = Uuid::new_v4();
            // Before the claim: the lease runs from the moment the claim took the rows, at the latest.
            let claimed_at = tokio::time::Instant::now();
            let skip = blocked.skip(claimed_at.into_std());
            let claim = sql
                .claim_skipping(&mut client, token, poll.lease, poll.batch_size, &skip)
                .await?;
            let recorded = blocked.record(claim.blocked, claimed_at.into_std());
            for row in &claim.dead_without_id {
                tracing::error!(
                    table = %self.table().name,
                    aggregate_type = row.aggregate_type.as_deref().unwrap_or("NULL"),
                    aggregate_id = row.aggregate_id.as_deref().unwrap_or("NULL"),
                    position = ?row.position,
                    "a row with no event_id (NULL) dead-lettered in place: it can never be published, and `outboxd replay` cannot re-queue it; later events of its aggregate proceed; make the event_id column NOT NULL"
                );
            }
            crate::metrics::dead(claim.dead_without_id.len() as u64);
            if recorded.dropped > 0 && !warned_full {
                warned_full = true;
                tracing::warn!(table = %self.table().name, max = MAX_SKIPPED_AGGREGATES, "more aggregates are blocked (waiting for a retry, or leased by another worker) than a claim leaves out: while their rows fill a claim's first max(4 × --poll-batch-size, 2000) rows, other aggregates wait too");
            }
            let rows = claim.rows;
            backoff.reset();
            outage.ended();
            if self.scope == ClaimScope::All {
                readiness.working("poll");
            }
            // Nothing claimable, but aggregates newly found blocked (left out) or rows without an event id
            // dead-lettered: that frees the next claim's prefix for rows behind them.
            if rows.is_empty() && (recorded.added > 0 || !claim.dead_without_id.is_empty()) {
                continue;
            }
            if rows.is_empty() {
                tracing::trace!(next_poll_in = ?idle_delay, "nothing to claim: idle");
                if idle(
                    wake.as_ref().map(|(_, notify)| &**notify),
                    idle_delay,
                    shutdown,
                )
                .await
                {
                    return Ok(());
                }
                idle_delay = (idle_delay * 2).min(poll.interval * 16);
                continue;
            }
            idle_delay = poll.interval;
            let ids: Vec<Uuid> = rows.iter().map(|row| row.event_id).collect();
            let publishing =
                self.publish_batch(&client, &sql, &publisher, &mut deliveries, token, rows);
            let report = tokio::select! {
                report = publishing => report?,
                error = renew_leases(&client, &sql, &ids, token, poll.lease, claimed_at) => return Err(error),
            };
            tracing::debug!(?report, "polling batch done");
            if report.producer_spent {
                (publisher, deliveries) = self.new_publisher()?;
            }
            crate::metrics::published("poll", report.published as u64);
            crate::metrics::dead(report.dead as u64);
            if report.broker_down {
                let delay = broker_down.next_delay();
                tracing::warn!(rows = report.retried, retry_in = ?delay, "the broker failed every send of the batch; retrying the rows once it answers");
                if idle(None, delay, shutdown).await {
                    return Ok(());
                }
            } else {
                broker_down.reset();
            }
        }
    }

    fn new_publisher(&self) -> Result<(PollSink<K>, Deliveries)> {
        let (delivery_tx, deliveries) = mpsc::unbounded_channel();
        let publisher = self.sinks.sink(&self.settings, delivery_tx)?;
        Ok((publisher, deliveries))
    }

    /// How long a batch waits for its acknowledgements before the producer is purged and the rest of the
    /// batch goes back: `message.timeout.ms` if given, else half the lease, so a broker outage shows up as
    /// retries well within the lease.
    fn delivery_timeout(&self) -> Duration {
        crate::kafka::delivery_timeout(
            &self.settings,
            (self.settings.poll.lease / 2).max(Duration::from_secs(1)),
        )
    }

    /// Sends `row` alone on a producer of its own and waits for its acknowledgement: whether the broker
    /// refuses the event itself, or only refused the batch it shared with another (a batch larger than the
    /// topic's `max.message.bytes` fails whole). Only a refusal of the event alone counts toward
    /// dead-lettering it.
    async fn publish_alone(&self, row: &ClaimedRow) -> Outcome {
        let topic = self
            .settings
            .topic
            .render_event(&self.table().name, &row.event);
        self.send_alone(&topic, &row.event, row.event_id, None)
            .await
    }

    /// One event on a producer of its own, waited for (at most the delivery timeout).
    async fn send_alone(
        &self,
        topic: &str,
        event: &OutboxEvent,
        event_id: Uuid,
        error: Option<&str>,
    ) -> Outcome {
        let Ok((publisher, mut deliveries)) = self.new_publisher() else {
            return Outcome::Failed(Rejection::transient("cannot create a producer".into()));
        };
        match publisher
            .publish(self.table(), topic, event, event_id, Some(0), error)
            .await
        {
            Ok(()) => {}
            Err(PublishError::Rejected(rejection)) => return Outcome::Failed(rejection),
            Err(PublishError::Failed(error)) => {
                return Outcome::Failed(Rejection::transient(error.to_string()))
            }
        }
        match tokio::time::timeout(self.delivery_timeout(), deliveries.recv()).await {
            Ok(Some(delivery)) => match delivery.result {
                Ok(()) => Outcome::Delivered,
                Err(rejection) => Outcome::Failed(rejection),
            },
            _ => Outcome::Failed(Rejection::transient(
                "no acknowledgement within the delivery timeout".into(),
            )),
        }
    }

    /// Best effort: the event with an `error` header; when the event itself is refused (usually for its
    /// size), the same record without its payload, so the dead-letter topic still lists every dead event.
    async fn produce_dead_letter(&self, topic: &str, row: &ClaimedRow, reason: &str) {
        let mut outcome = self
            .send_alone(topic, &row.event, row.event_id, Some(reason))
            .await;
        if matches!(&outcome, Outcome::Failed(r) if r.permanent) {
            let mut without_payload = row.event.clone();
            without_payload.payload = None;
            let reason =
                format!("{reason} (payload omitted: refused for the dead-letter topic too)");
            outcome = self
                .send_alone(topic, &without_payload, row.event_id, Some(&reason))
                .await;
        }
        if let Outcome::Failed(error) = outcome {
            tracing::warn!(event_id = %row.event_id, error = %error.reason, "could not produce to the dead-letter topic");
        }
    }

    async fn publish_batch(
        &self,
        client: &tokio_postgres::Client,
        sql: &PollSql,
        publisher: &PollSink<K>,
        deliveries: &mut Deliveries,
        token: Uuid,
        rows: Vec<ClaimedRow>,
    ) -> Result<BatchReport> {
        let mut report = BatchReport::default();
        let (mut decided, mut alone) = self.send_retries_alone(&rows).await;
        let rest: Vec<usize> = (0..rows.len()).filter(|i| decided[*i].is_none()).collect();
        let subset: Vec<ClaimedRow> = rest.iter().map(|&i| rows[i].clone()).collect();
        let (sub_outcomes, in_flight) = self.hand_over(publisher, &subset).await?;
        let mut sub_outcomes = sub_outcomes;
        self.await_reports(
            publisher,
            deliveries,
            &mut sub_outcomes,
            in_flight,
            &mut report,
        )
        .await;
        for (index, outcome) in rest.into_iter().zip(sub_outcomes) {
            decided[index] = Some(outcome);
        }
        let mut outcomes: Vec<Outcome> = decided
            .into_iter()
            .map(|o| o.unwrap_or(Outcome::HeldBack))
            .collect();
        self.settle_refusals(&rows, &mut outcomes, &mut alone).await;
        self.send_stopped_again(&rows, &mut outcomes, &mut alone)
            .await;
        self.record_outcomes(
            client,
            sql,
            publisher,
            token,
            &rows,
            &outcomes,
            &alone,
            &mut report,
        )
        .await?;
        let broken = outcomes.iter().find_map(|o| match o {
            Outcome::Failed(r) if r.producer_broken => Some(r.reason.clone()),
            _ => None,
        });
        if let Some(reason) = publisher.fatal_error().or(broken) {
            tracing::info!(%reason, "the producer stopped; starting a new one");
            report.producer_spent = true;
        }
        Ok(report)
    }

    /// Hands the batch to the producer in claim order; an aggregate that failed stops there (its later
    /// events are held back). Returns each row's outcome so far and how many are in flight.
    async fn hand_over(
        &self,
        publisher: &PollSink<K>,
        rows: &[ClaimedRow],
    ) -> Result<(Vec<Outcome>, usize)> {
        let order = self.settings.poll.order;
        let mut outcomes: Vec<Outcome> = Vec::with_capacity(rows.len());
        let mut failed_aggregates: HashSet<(&str, &str)> = HashSet::new();
        let mut in_flight = 0usize;
        for (index, row) in rows.iter().enumerate() {
            let aggregate = aggregate_of(row);
            if order == PollOrder::PerAggregate && failed_aggregates.contains(&aggregate) {
                outcomes.push(Outcome::HeldBack);
                continue;
            }
            if let Some(reason) = &row.invalid {
                outcomes.push(Outcome::Invalid(reason.clone()));
                continue;
            }
            let topic = self
                .settings
                .topic
                .render_event(&self.table().name, &row.event);
            let outcome = match publisher
                .publish(
                    self.table(),
                    &topic,
                    &row.event,
                    row.event_id,
                    Some(index),
                    None,
                )
                .await
            {
                Ok(()) => {
                    in_flight += 1;
                    Outcome::InFlight
                }
                Err(PublishError::Rejected(rejection)) => Outcome::Failed(rejection),
                // A configuration problem (e.g. a missing topic with --no-create-topics) stops the worker.
                Err(PublishError::Failed(error)) if !error.is_transient() => return Err(error),
                Err(PublishError::Failed(error)) => {
                    Outcome::Failed(Rejection::transient(error.to_string()))
                }
            };
            if matches!(outcome, Outcome::Failed(_)) {
                failed_aggregates.insert(aggregate);
            }
            outcomes.push(outcome);
        }
        Ok((outcomes, in_flight))
    }

    /// Waits for every delivery report (the caller renews the lease meanwhile). Past the delivery timeout
    /// the producer is purged: every event it still holds reports a failure at once. A producer stopped by a
    /// refusal (the gap-less guarantee) neither sends nor reports what it still holds (librdkafka has no
    /// message timeout here): what it never sent is failed at once, and what is left is purged
    /// [`STOPPED_PRODUCER_GRACE`] later, once the requests really on their way got their answers (purging
    /// those at once re-sent events the broker had written).
    async fn await_reports(
        &self,
        publisher: &PollSink<K>,
        deliveries: &mut Deliveries,
        outcomes: &mut [Outcome],
        mut in_flight: usize,
        report: &mut BatchReport,
    ) {
        let mut deadline = tokio::time::Instant::now() + self.delivery_timeout();
        let (mut stopped, mut purged) = (false, false);
        while in_flight > 0 {
            let delivery = tokio::select! {
                delivery = deliveries.recv() => delivery,
                _ = tokio::time::sleep_until(deadline), if !purged => {
                    if stopped {
                        tracing::debug!(in_flight, "the stopped producer's requests got no answer: purging it");
                    } else {
                        tracing::warn!(in_flight, timeout = ?self.delivery_timeout(), "the broker acknowledged no more of the batch within the delivery timeout; purging the producer and retrying the rest");
                    }
                    publisher.purge();
                    purged = true;
                    report.producer_spent = true;
                    continue;
                }
            };
            let Some(delivery) = delivery else {
                break;
            };
            let Some(index) = delivery.tag else { continue };
            let failed = delivery.result.is_err();
            if let Some(outcome @ Outcome::InFlight) = outcomes.get_mut(index) {
                *outcome = match delivery.result {
                    Ok(()) => Outcome::Delivered,
                    Err(rejection) => Outcome::Failed(rejection),
                };
                in_flight -= 1;
            }
            if failed && in_flight > 0 && !stopped {
                if let Some(reason) = publisher.fatal_error() {
                    tracing::debug!(%reason, in_flight, "the producer stopped: failing what it never sent");
                    publisher.purge_unsent();
                    stopped = true;
                    report.producer_spent = true;
                    deadline = deadline.min(tokio::time::Instant::now() + STOPPED_PRODUCER_GRACE);
                }
            }
        }
    }

    /// Events that failed before (their claim counted more than one attempt) go alone first, each on a
    /// producer of its own and waited for, at most [`ALONE_FIRST`] per batch, and only the first of its
    /// aggregate in the batch (the later ones follow it in the batch, or are held back when it failed): one
    /// the broker refuses would otherwise stop the batch's producer at every retry. Returns the outcomes
    /// decided so far and which rows went alone.
    async fn send_retries_alone(
        &self,
        rows: &[ClaimedRow],
    ) -> (Vec<Option<Outcome>>, HashSet<usize>) {
        let per_aggregate = self.settings.poll.order == PollOrder::PerAggregate;
        let mut decided: Vec<Option<Outcome>> = (0..rows.len()).map(|_| None).collect();
        let mut alone = HashSet::new();
        let mut seen: HashSet<(&str, &str)> = HashSet::new();
        let mut failed: HashSet<(&str, &str)> = HashSet::new();
        for (index, row) in rows.iter().enumerate() {
            let aggregate = aggregate_of(row);
            let first_of_aggregate = seen.insert(aggregate);
            if per_aggregate && failed.contains(&aggregate) {
                decided[index] = Some(Outcome::HeldBack);
                continue;
            }
            if first_of_aggregate
                && row.attempts > 1
                && row.invalid.is_none()
                && alone.len() < ALONE_FIRST
            {
                let outcome = self.publish_alone(row).await;
                if !matches!(outcome, Outcome::Delivered) {
                    failed.insert(aggregate);
                }
                alone.insert(index);
                decided[index] = Some(outcome);
            }
        }
        (decided, alone)
    }

    /// The events a refusal stopped the producer for (and the later events of their aggregates) go again on
    /// a new producer, a few rounds (each round's refusals leave with their aggregates): otherwise one event
    /// the broker refuses would hold every batch it is claimed with back, claim after claim, until it is
    /// dead-lettered. What is still stopped after the rounds is given back without an attempt.
    async fn send_stopped_again(
        &self,
        rows: &[ClaimedRow],
        outcomes: &mut [Outcome],
        sent_alone: &mut HashSet<usize>,
    ) {
        const ROUNDS: usize = 3;
        for _ in 0..ROUNDS {
            // Per aggregate, from its first event that was stopped: every event not delivered.
            let mut again_from: HashSet<(&str, &str)> = HashSet::new();
            let mut settled: HashSet<(&str, &str)> = HashSet::new();
            let mut again: Vec<usize> = Vec::new();
            for (index, (row, outcome)) in rows.iter().zip(outcomes.iter()).enumerate() {
                let aggregate = aggregate_of(row);
                if matches!(outcome, Outcome::Delivered) {
                    continue;
                }
                if again_from.contains(&aggregate) {
                    again.push(index);
                } else if !settled.contains(&aggregate) {
                    if matches!(outcome, Outcome::Stopped) {
                        again_from.insert(aggregate);
                        again.push(index);
                    } else {
                        settled.insert(aggregate);
                    }
                }
            }
            if again.is_empty() {
                return;
            }
            let subset: Vec<ClaimedRow> = again.iter().map(|&i| rows[i].clone()).collect();
            let Ok((publisher, mut deliveries)) = self.new_publisher() else {
                break;
            };
            let mut report = BatchReport::default();
            let Ok((mut sub_outcomes, in_flight)) = self.hand_over(&publisher, &subset).await
            else {
                break;
            };
            self.await_reports(
                &publisher,
                &mut deliveries,
                &mut sub_outcomes,
                in_flight,
                &mut report,
            )
            .await;
            let mut alone_in_subset = HashSet::new();
            self.settle_refusals(&subset, &mut sub_outcomes, &mut alone_in_subset)
                .await;
            for (in_subset, (index, outcome)) in again.into_iter().zip(sub_outcomes).enumerate() {
                outcomes[index] = outcome;
                if alone_in_subset.contains(&in_subset) {
                    sent_alone.insert(index);
                } else {
                    sent_alone.remove(&index);
                }
            }
        }
        for outcome in outcomes.iter_mut() {
            if matches!(outcome, Outcome::Stopped) {
                *outcome = Outcome::HeldBack;
            }
        }
    }

    /// A refusal may be of the batch the event shared with others (too large together): each first
    /// refusal of its aggregate in this batch is tried again alone before it counts (the gap-less
    /// guarantee stopped the producer at the refusal, so nothing after it in its partition was written).
    /// Later events of an aggregate whose earlier event was not delivered did not fail on their own, nor
    /// did events the stopped producer failed after another aggregate's refusal: they are held back,
    /// without an attempt. Adds the rows it sent alone to `sent_alone`.
    async fn settle_refusals(
        &self,
        rows: &[ClaimedRow],
        outcomes: &mut [Outcome],
        sent_alone: &mut HashSet<usize>,
    ) {
        let order = self.settings.poll.order;
        let refused = outcomes
            .iter()
            .any(|o| matches!(o, Outcome::Failed(r) if r.permanent));
        let mut undelivered: HashSet<(&str, &str)> = HashSet::new();
        for (index, (row, outcome)) in rows.iter().zip(outcomes.iter_mut()).enumerate() {
            let aggregate = aggregate_of(row);
            if undelivered.contains(&aggregate) {
                if order == PollOrder::PerAggregate && matches!(outcome, Outcome::Failed(_)) {
                    *outcome = Outcome::HeldBack;
                }
            } else if refused
                && rows.len() > 1
                && !sent_alone.contains(&index)
                && matches!(outcome, Outcome::Failed(r) if r.permanent)
            {
                *outcome = self.publish_alone(row).await;
                sent_alone.insert(index);
            } else if rows.len() == 1 {
                // A batch of one: whatever the broker said, it said of this event.
                sent_alone.insert(index);
            } else if refused && matches!(outcome, Outcome::Failed(r) if !r.permanent) {
                // Failed because the producer stopped at another aggregate's refusal: not its fault.
                *outcome = Outcome::Stopped;
            }
            if !matches!(outcome, Outcome::Delivered) {
                undelivered.insert(aggregate);
            }
        }
    }

    /// Writes what became of each row: published, given back (held back, or at once when the broker is
    /// down), retried later with backoff, or dead-lettered. `sent_alone`: the rows whose outcome is of a send
    /// of their event alone.
    #[allow(clippy::too_many_arguments)] // the batch's connection, statements, lease, producer and outcomes
    async fn record_outcomes(
        &self,
        client: &tokio_postgres::Client,
        sql: &PollSql,
        publisher: &PollSink<K>,
        token: Uuid,
        rows: &[ClaimedRow],
        outcomes: &[Outcome],
        sent_alone: &HashSet<usize>,
        report: &mut BatchReport,
    ) -> Result<()> {
        let ids_where = |wanted: fn(&Outcome) -> bool| -> Vec<Uuid> {
            rows.iter()
                .zip(outcomes)
                .filter(|(_, o)| wanted(o))
                .map(|(row, _)| row.event_id)
                .collect()
        };
        let delivered = ids_where(|o| matches!(o, Outcome::Delivered));
        if !delivered.is_empty() {
            sql.mark_published(client, &delivered, token).await?;
            report.published = delivered.len();
        }
        let held_back = ids_where(|o| matches!(o, Outcome::HeldBack));
        if !held_back.is_empty() {
            sql.release(client, &held_back, token, None).await?;
            report.held_back = held_back.len();
        }
        // A broker-wide failure is not a property of the rows: a per-row backoff (growing with every attempt
        // an outage costs, up to --retry-cap) would keep them back for minutes after the broker returned.
        let failures = || {
            outcomes.iter().filter_map(|o| match o {
                Outcome::Failed(rejection) => Some(rejection),
                _ => None,
            })
        };
        // Confirmed by asking a broker: a fault of one partition or topic (its leader gone, NotEnoughReplicas)
        // in a batch of one hot aggregate looks the same, and must keep its per-row backoff, or that batch
        // would come back first at every claim and hold every other aggregate up.
        report.broker_down = delivered.is_empty()
            && failures().next().is_some()
            && failures().all(|rejection| !rejection.permanent)
            && publisher
                .check_brokers(Duration::from_secs(2))
                .await
                .is_err();
        if report.broker_down {
            let failed = ids_where(|o| matches!(o, Outcome::Failed(_)));
            let reason = failures().next().map(|r| r.reason.as_str());
            sql.release(client, &failed, token, reason).await?;
            report.retried = failed.len();
            failed
                .iter()
                .for_each(|_| crate::metrics::publish_error("refused"));
        }
        for (index, (row, outcome)) in rows.iter().zip(outcomes).enumerate() {
            match outcome {
                Outcome::Invalid(reason) => {
                    sql.dead_letter(client, row.event_id, token, reason).await?;
                    report.dead += 1;
                    tracing::error!(event_id = %row.event_id, error = %reason, "event dead-lettered: it can never be published");
                }
                Outcome::Failed(rejection) if !report.broker_down => {
                    let alone = sent_alone.contains(&index);
                    self.record_failure(client, sql, token, row, (rejection, alone), report)
                        .await?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A row whose publish failed (`refusal`: why, and whether its event was sent alone): dead-lettered
    /// when [`dead_letters`] says so, else retried later with backoff.
    async fn record_failure(
        &self,
        client: &tokio_postgres::Client,
        sql: &PollSql,
        token: Uuid,
        row: &ClaimedRow,
        (rejection, alone): (&Rejection, bool),
        report: &mut BatchReport,
    ) -> Result<()> {
        let poll = &self.settings.poll;
        if dead_letters(rejection, alone, row.attempts, poll.max_attempts) {
            // The dead-letter record first, then the row: a process killed in between dead-letters the
            // event again (a second record), never leaves a dead row without its record.
            if let Some(topic) = &poll.dead_letter_topic {
                self.produce_dead_letter(topic, row, &rejection.reason)
                    .await;
            }
            sql.dead_letter(client, row.event_id, token, &rejection.reason)
                .await?;
            report.dead += 1;
            tracing::error!(
                event_id = %row.event_id,
                aggregate_id = %row.event.aggregate_id,
                attempts = row.attempts,
                refused_alone = alone,
                error = %rejection.reason,
                "event dead-lettered; later events of its aggregate proceed; re-queue with `outboxd replay`"
            );
        } else {
            let delay = retry_delay(poll.retry_base, poll.retry_cap, row.attempts);
            sql.retry_later(client, row.event_id, token, &rejection.reason, delay)
                .await?;
            report.retried += 1;
            crate::metrics::publish_error("refused");
            tracing::warn!(
                event_id = %row.event_id,
                attempts = row.attempts,
                retry_in = ?delay,
                error = %rejection.reason,
                "publish failed; will retry"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocked(key: &str, ready_in: Duration) -> BlockedAggregate {
        BlockedAggregate {
            key: key.into(),
            ready_in,
            leased: false,
        }
    }

    #[test]
    fn an_event_the_broker_refuses_alone_is_dead_lettered_at_once() {
        let too_large = Rejection {
            permanent: true,
            of_the_event: true,
            ..Rejection::transient("Broker: Message size too large".into())
        };
        let not_authorised = Rejection {
            permanent: true,
            topic_wide: true,
            ..Rejection::transient("Broker: Topic authorization failed".into())
        };
        let timeout = Rejection::transient("no acknowledgement".into());
        // Alone: the event's own refusal is conclusive; in a batch it may be its batch-mate's.
        assert!(dead_letters(&too_large, true, 1, 10));
        assert!(!dead_letters(&too_large, false, 1, 10));
        assert!(dead_letters(&too_large, false, 10, 10));
        // The topic's refusal may be lifted: retried up to --max-attempts.
        assert!(!dead_letters(&not_authorised, true, 9, 10));
        assert!(dead_letters(&not_authorised, true, 10, 10));
        // Not a refusal: retried forever.
        assert!(!dead_letters(&timeout, true, 1_000, 10));
    }

    fn sorted(mut keys: Vec<String>) -> Vec<String> {
        keys.sort();
        keys
    }

    #[test]
    fn a_blocked_aggregate_is_left_out_until_its_wait_ends() {
        let mut aggregates = BlockedAggregates::default();
        let start = Instant::now();
        let recorded = aggregates.record(
            vec![
                blocked("(Order,a)", Duration::from_secs(2)),
                blocked("(Order,b)", Duration::from_millis(500)),
            ],
            start,
        );
        assert_eq!(
            recorded,
            Recorded {
                added: 2,
                dropped: 0
            }
        );
        assert_eq!(
            sorted(aggregates.skip(start + Duration::from_millis(100))),
            ["(Order,a)", "(Order,b)"]
        );
        assert_eq!(
            aggregates.skip(start + Duration::from_secs(1)),
            ["(Order,a)"],
            "b's retry is due: claims consider it again"
        );
        assert!(aggregates.skip(start + Duration::from_secs(2)).is_empty());
    }

    #[test]
    fn a_long_wait_is_looked_at_again_after_the_longest_skip() {
        let mut aggregates = BlockedAggregates::default();
        let start = Instant::now();
        aggregates.record(
            vec![blocked("(Order,a)", Duration::from_secs(3_600))],
            start,
        );
        assert_eq!(
            aggregates.skip(start + LONGEST_SKIP - Duration::from_millis(1)),
            ["(Order,a)"]
        );
        assert!(
            aggregates.skip(start + LONGEST_SKIP).is_empty(),
            "a wait may end unseen (published by another worker, made due by an operator)"
        );
    }

    #[test]
    fn an_aggregate_another_worker_leased_is_looked_at_again_soon() {
        let mut aggregates = BlockedAggregates::default();
        let start = Instant::now();
        let leased = BlockedAggregate {
            leased: true,
            ..blocked("(Order,a)", Duration::from_secs(30))
        };
        aggregates.record(vec![leased], start);
        assert_eq!(
            aggregates.skip(start + LEASED_SKIP - Duration::from_millis(1)),
            ["(Order,a)"]
        );
        assert!(
            aggregates.skip(start + LEASED_SKIP).is_empty(),
            "the holder usually publishes it within its batch: any worker may take its next events"
        );
    }

    #[test]
    fn an_aggregate_found_again_is_not_new_and_gets_its_new_wait() {
        let mut aggregates = BlockedAggregates::default();
        let start = Instant::now();
        aggregates.record(vec![blocked("(Order,a)", Duration::from_secs(1))], start);
        let later = start + Duration::from_millis(900);
        let recorded = aggregates.record(vec![blocked("(Order,a)", Duration::from_secs(5))], later);
        assert_eq!(
            recorded.added, 0,
            "a claim that finds only known aggregates found nothing new"
        );
        assert_eq!(
            aggregates.skip(start + Duration::from_secs(2)),
            ["(Order,a)"]
        );
    }

    #[test]
    fn no_more_than_the_most_skipped_aggregates_are_left_out() {
        let mut aggregates = BlockedAggregates::default();
        let start = Instant::now();
        let found = (0..MAX_SKIPPED_AGGREGATES + 5)
            .map(|n| blocked(&format!("(Order,{n})"), Duration::from_secs(5)))
            .collect();
        assert_eq!(
            aggregates.record(found, start),
            Recorded {
                added: MAX_SKIPPED_AGGREGATES,
                dropped: 5
            }
        );
        assert_eq!(aggregates.skip(start).len(), MAX_SKIPPED_AGGREGATES);
        // Once some waits end there is room again.
        assert_eq!(aggregates.skip(start + Duration::from_secs(5)).len(), 0);
        assert_eq!(
            aggregates
                .record(vec![blocked("(Order,new)", Duration::from_secs(1))], start)
                .added,
            1
        );
    }
}
