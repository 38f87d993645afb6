//! The lease-based polling path: claim a batch in a short transaction (lease token, `attempts + 1`), publish
//! outside any transaction, then mark `published_at` guarded by `event_id` AND the lease token. Failures go
//! back with capped exponential backoff; events refused for a reason retrying cannot fix are dead-lettered
//! after `--max-attempts`. Leases are renewed while a slow send is in flight.
//!
//! Used as the whole pipeline in `--mode poll` (and `auto` without replication), and as the sweeper for
//! handed-off rows next to the CDC path.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use uuid::Uuid;

use crate::backoff::{retry_delay, Backoff};
use crate::config::{PollOrder, RunSettings};
use crate::error::{Error, Result};
use crate::kafka::{KnownTopics, PublishError, Publisher, Rejection};
use crate::pg;
use crate::pg::outbox::{self, ClaimScope, ClaimedRow, PollSql};

/// What happened to one claimed row.
#[derive(Debug)]
enum Outcome {
    InFlight,
    Delivered,
    /// Not sent because an earlier event of its aggregate failed in this batch.
    HeldBack,
    Failed(Rejection),
    /// Can never be published (NULL required column): dead-lettered at once.
    Invalid(String),
}

/// Counts of one batch, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    pub published: usize,
    pub retried: usize,
    pub dead: usize,
    pub held_back: usize,
    /// Nothing was delivered and every failure was transient: the broker (or the way to it) is down, so the
    /// rows went back without a per-row backoff and the worker waits instead.
    pub broker_down: bool,
}

/// The longest a worker waits between batches while the broker fails every send: once it is back,
/// publishing resumes within this (plus librdkafka's reconnect backoff).
const BROKER_DOWN_MAX_WAIT: Duration = Duration::from_secs(5);

/// LISTENs on the table's NOTIFY channel on a dedicated connection; the returned `Notify` fires on every
/// notification (and when the connection ends, so the poller never sleeps on a dead listener).
async fn listen(
    settings: &RunSettings,
    table: &crate::config::TableName,
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
    known_topics: KnownTopics,
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
        let worker = PollWorker::new(settings.clone(), table, scope, known_topics.clone());
        let shutdown = shutdown.clone();
        workers.spawn(async move { worker.run(shutdown).await });
    }
    while let Some(result) = workers.join_next().await {
        result.map_err(|e| {
            Error::setup(
                format!("polling task failed: {e}"),
                "report this as an outboxd bug",
            )
        })??;
    }
    Ok(())
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

/// Polls one outbox table.
pub struct PollWorker {
    settings: Arc<RunSettings>,
    /// Index into `settings.database.tables`.
    table: usize,
    scope: ClaimScope,
    known_topics: KnownTopics,
}

impl PollWorker {
    pub fn new(
        settings: Arc<RunSettings>,
        table: usize,
        scope: ClaimScope,
        known_topics: KnownTopics,
    ) -> Self {
        PollWorker {
            settings,
            table,
            scope,
            known_topics,
        }
    }

    fn table(&self) -> &crate::table::OutboxTable {
        &self.settings.database.tables[self.table]
    }

    /// Polls until `shutdown` turns true; transient failures reconnect with capped backoff, forever.
    pub async fn run(&self, mut shutdown: watch::Receiver<bool>) -> Result<()> {
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        let mut outage = super::DatabaseOutage::new(self.settings.reconnect_timeout);
        loop {
            let result = self.session(&mut shutdown, &mut backoff, &mut outage).await;
            match result {
                Ok(()) => return Ok(()),
                Err(error) if error.is_transient() || error.awaited_database().is_some() => {
                    if self.scope == ClaimScope::All {
                        crate::http::READINESS.set_mode("reconnecting");
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
                        _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
                    }
                }
                Err(error) => return Err(error),
            }
        }
    }

    async fn session(
        &self,
        shutdown: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
        outage: &mut super::DatabaseOutage,
    ) -> Result<()> {
        let poll = &self.settings.poll;
        // A silent server must end the session (it may hold the claim lock every claimer waits for).
        let mut client = pg::connect(&super::leader::with_dead_peer_detection(
            &self.settings.database.database_url,
        ))
        .await?;
        if pg::in_recovery(&client).await? {
            return Err(Error::in_recovery());
        }
        // created_at is read as text: make it ISO and UTC, as on the replication connection.
        client
            .batch_execute("SET datestyle = 'ISO'; SET TIME ZONE 'UTC'")
            .await?;
        // Rows older than the polling columns have no position; the sweeper may meet them too (handed off by
        // `migrate --existing-rows unpublished`).
        let numbered = outbox::number_rows_without_position(&client, self.table()).await?;
        if numbered > 0 {
            tracing::info!(table = %self.table().name, rows = numbered, "gave rows without a position one, in insert order");
        }
        let sql = PollSql::prepare(&client, self.table(), poll.order, self.scope).await?;
        let (delivery_tx, mut deliveries) = mpsc::unbounded_channel();
        // Let a send fail well within the lease, so a broker outage shows up as retries with backoff.
        let send_timeout = (poll.lease / 2).as_millis().max(1000).to_string();
        let publisher = Publisher::new(
            &self.settings,
            self.known_topics.clone(),
            delivery_tx,
            &[("message.timeout.ms", send_timeout)],
        )?;
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
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            if let Some(leader) = &mut leader {
                if leader.defer(&client).await? {
                    tokio::select! {
                        _ = tokio::time::sleep(super::fleet::LEADER_CHECK) => continue,
                        _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
                    }
                }
            }
            let token = Uuid::new_v4();
            // Before the claim: the lease runs from the moment the claim took the rows, at the latest.
            let claimed_at = tokio::time::Instant::now();
            let rows = sql
                .claim(&mut client, token, poll.lease, poll.batch_size)
                .await?;
            backoff.reset();
            outage.ended();
            if self.scope == ClaimScope::All {
                crate::http::READINESS.set_mode("poll");
            }
            if rows.is_empty() {
                let notified = async {
                    match &wake {
                        Some((_, notify)) => notify.notified().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = tokio::time::sleep(idle_delay) => {}
                    _ = notified => {}
                    _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
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
            crate::metrics::published("poll", report.published as u64);
            crate::metrics::dead(report.dead as u64);
            if report.broker_down {
                let delay = broker_down.next_delay();
                tracing::warn!(rows = report.retried, retry_in = ?delay, "the broker failed every send of the batch; retrying the rows once it answers");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
                }
            } else {
                broker_down.reset();
            }
        }
    }

    /// Best effort: the event with an `error` header; when the event itself is refused (usually for its
    /// size), the same record without its payload, so the dead-letter topic still lists every dead event.
    async fn produce_dead_letter(
        &self,
        publisher: &Publisher<Option<usize>>,
        topic: &str,
        row: &ClaimedRow,
        reason: &str,
    ) {
        let sent = publisher
            .publish(topic, &row.event, row.event_id, None, Some(reason))
            .await;
        let sent = match sent {
            Err(PublishError::Rejected(_)) => {
                let mut without_payload = row.event.clone();
                without_payload.payload = None;
                let reason =
                    format!("{reason} (payload omitted: refused for the dead-letter topic too)");
                publisher
                    .publish(topic, &without_payload, row.event_id, None, Some(&reason))
                    .await
            }
            other => other,
        };
        if let Err(error) = sent {
            tracing::warn!(event_id = %row.event_id, ?error, "could not produce to the dead-letter topic");
        }
    }

    async fn publish_batch(
        &self,
        client: &tokio_postgres::Client,
        sql: &PollSql,
        publisher: &Publisher<Option<usize>>,
        deliveries: &mut mpsc::UnboundedReceiver<crate::kafka::Delivery<Option<usize>>>,
        token: Uuid,
        rows: Vec<ClaimedRow>,
    ) -> Result<BatchReport> {
        let poll = &self.settings.poll;
        let mut outcomes: Vec<Outcome> = Vec::with_capacity(rows.len());
        let mut failed_aggregates: HashSet<(&str, &str)> = HashSet::new();
        let mut in_flight = 0usize;
        for (index, row) in rows.iter().enumerate() {
            let aggregate = (
                row.event.aggregate_type.as_deref().unwrap_or_default(),
                row.event.aggregate_id.as_str(),
            );
            if poll.order == PollOrder::PerAggregate && failed_aggregates.contains(&aggregate) {
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
                .publish(&topic, &row.event, row.event_id, Some(index), None)
                .await
            {
                Ok(()) => {
                    in_flight += 1;
                    Outcome::InFlight
                }
                Err(PublishError::Rejected(rejection)) => Outcome::Failed(rejection),
                // A configuration problem (e.g. a missing topic with --no-create-topics) stops the worker.
                Err(PublishError::Failed(error)) if !error.is_transient() => return Err(error),
                Err(PublishError::Failed(error)) => Outcome::Failed(Rejection {
                    reason: error.to_string(),
                    permanent: false,
                    producer_broken: false,
                }),
            };
            if matches!(outcome, Outcome::Failed(_)) {
                failed_aggregates.insert(aggregate);
            }
            outcomes.push(outcome);
        }

        // Wait for every delivery report (the caller renews the lease meanwhile).
        while in_flight > 0 {
            let Some(delivery) = deliveries.recv().await else {
                break;
            };
            let Some(index) = delivery.tag else { continue };
            if let Some(outcome @ Outcome::InFlight) = outcomes.get_mut(index) {
                *outcome = match delivery.result {
                    Ok(()) => Outcome::Delivered,
                    Err(rejection) => Outcome::Failed(rejection),
                };
                in_flight -= 1;
            }
        }

        let mut report = BatchReport::default();
        let ids_where = |wanted: fn(&Outcome) -> bool| -> Vec<Uuid> {
            rows.iter()
                .zip(&outcomes)
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
        for (row, outcome) in rows.iter().zip(&outcomes) {
            if let Outcome::Invalid(reason) = outcome {
                sql.dead_letter(client, row.event_id, token, reason).await?;
                report.dead += 1;
                tracing::error!(event_id = %row.event_id, error = %reason, "event dead-lettered: it can never be published");
                continue;
            }
            let Outcome::Failed(rejection) = outcome else {
                continue;
            };
            if report.broker_down {
                continue;
            }
            if rejection.permanent && row.attempts >= poll.max_attempts {
                sql.dead_letter(client, row.event_id, token, &rejection.reason)
                    .await?;
                report.dead += 1;
                tracing::error!(
                    event_id = %row.event_id,
                    aggregate_id = %row.event.aggregate_id,
                    attempts = row.attempts,
                    error = %rejection.reason,
                    "event dead-lettered; later events of its aggregate proceed; re-queue with `outboxd replay`"
                );
                if let Some(topic) = &poll.dead_letter_topic {
                    self.produce_dead_letter(publisher, topic, row, &rejection.reason)
                        .await;
                }
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
        }
        let broken = outcomes.iter().find_map(|o| match o {
            Outcome::Failed(r) if r.producer_broken => Some(r.reason.clone()),
            _ => None,
        });
        if let Some(reason) = publisher.fatal_error().or(broken) {
            return Err(Error::Kafka {
                message: format!("the producer failed fatally ({reason}); starting a new one"),
                transient: true,
            });
        }
        Ok(report)
    }
}
