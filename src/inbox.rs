//! The consumer's side of the pattern: the inbox. A consumer records each event it handles in
//! `consumed_event` (created by `outboxd migrate`) in the same PostgreSQL transaction as the event's effect,
//! so an event delivered twice (at least once, or a consumer restarted before it committed its offsets) is
//! applied once:
//!
//! ```no_run
//! # async fn handle(client: &mut tokio_postgres::Client, event_id: uuid::Uuid) -> Result<(), tokio_postgres::Error> {
//! let inbox = outboxd::inbox::Inbox::new("inventory");
//! let tx = client.transaction().await?;
//! if inbox.record(&tx, event_id).await? == outboxd::inbox::Consumed::Applied {
//!     tx.execute("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'a'", &[]).await?;
//! }
//! tx.commit().await?; // then commit the Kafka offset
//! # Ok(()) }
//! ```
//!
//! Owns only the inbox statement; reading Kafka and committing offsets are the consumer's (see
//! `examples/inbox_consumer.rs`).

use std::time::{Duration, SystemTime};

use tokio_postgres::{GenericClient, Transaction};
use uuid::Uuid;

/// What [`Inbox::record`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumed {
    /// First time: apply the effect in the same transaction.
    Applied,
    /// Recorded before (a duplicate delivery): skip the effect.
    Duplicate,
    /// With a retention ([`Inbox::record_created_at`]): an event created before the inbox's horizon that it
    /// does not hold. Its row may have been pruned after it was applied, so nothing says whether this is a
    /// duplicate: nothing was recorded; report it (and apply it only where applying twice is harmless).
    BeyondRetention,
}

/// One consumer's inbox: its name in `consumed_event.consumer_name`, and the table.
#[derive(Debug, Clone)]
pub struct Inbox {
    consumer_name: String,
    table: String,
    statement: String,
    retention: Option<Duration>,
}

impl Inbox {
    /// The inbox of `consumer_name` in `public.consumed_event`.
    pub fn new(consumer_name: impl Into<String>) -> Self {
        Self::in_table(consumer_name, "public.consumed_event")
    }

    /// The inbox of `consumer_name` in `table` (schema-qualified, as `outboxd migrate` created it).
    pub fn in_table(consumer_name: impl Into<String>, table: &str) -> Self {
        Inbox {
            consumer_name: consumer_name.into(),
            table: table.to_string(),
            statement: format!(
                "INSERT INTO {table} (consumer_name, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            ),
            retention: None,
        }
    }

    /// Keeps rows for `retention` after they were consumed ([`Inbox::prune`] deletes older ones). It must
    /// outlive every copy of an event a consumer could still read: the topic's `retention.ms`, plus the time
    /// a heal or replay may republish it, plus the clock difference between the producing and consuming
    /// databases. Events older than that are told apart ([`Consumed::BeyondRetention`]).
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Records `event_id` in `tx`: [`Consumed::Applied`] when it is new (apply the effect in `tx` before
    /// committing it), [`Consumed::Duplicate`] when it was recorded before. A concurrent consumer recording
    /// the same event waits for the other's transaction, then sees it as a duplicate.
    pub async fn record(
        &self,
        tx: &Transaction<'_>,
        event_id: Uuid,
    ) -> Result<Consumed, tokio_postgres::Error> {
        let inserted = tx
            .execute(&self.statement, &[&self.consumer_name, &event_id])
            .await?;
        Ok(if inserted == 1 {
            Consumed::Applied
        } else {
            Consumed::Duplicate
        })
    }

    /// [`Inbox::record`] for an event created at `created_at` (its record's `created_at` header). With a
    /// retention, an event created before the horizon (now, on the inbox's database clock, minus the
    /// retention) that the inbox does not hold is [`Consumed::BeyondRetention`]: any event whose row
    /// [`Inbox::prune`] deleted was created before it was consumed, so before the horizon.
    pub async fn record_created_at(
        &self,
        tx: &Transaction<'_>,
        event_id: Uuid,
        created_at: SystemTime,
    ) -> Result<Consumed, tokio_postgres::Error> {
        let Some(retention) = self.retention else {
            return self.record(tx, event_id).await;
        };
        let row = tx
            .query_one(
                &format!(
                    "WITH within AS (SELECT $3::timestamptz >= now() - make_interval(secs => $4) AS yes),
                          inserted AS (INSERT INTO {table} (consumer_name, event_id)
                                       SELECT $1, $2 FROM within WHERE yes
                                       ON CONFLICT DO NOTHING RETURNING 1)
                     SELECT (SELECT count(*) FROM inserted), (SELECT yes FROM within),
                            EXISTS (SELECT FROM {table} WHERE consumer_name = $1 AND event_id = $2)",
                    table = self.table
                ),
                &[
                    &self.consumer_name,
                    &event_id,
                    &created_at,
                    &retention.as_secs_f64(),
                ],
            )
            .await?;
        let (inserted, within, held): (i64, bool, bool) = (row.get(0), row.get(1), row.get(2));
        Ok(match (inserted, within, held) {
            (1, _, _) => Consumed::Applied,
            (_, true, _) | (_, false, true) => Consumed::Duplicate,
            (_, false, false) => Consumed::BeyondRetention,
        })
    }

    /// Deletes this consumer's rows consumed longer ago than the retention (none without one). Returns how
    /// many. Run it now and then (a few thousand rows a statement keep locks short: call it until it returns
    /// less than `batch`).
    pub async fn prune(
        &self,
        client: &impl GenericClient,
        batch: i64,
    ) -> Result<u64, tokio_postgres::Error> {
        let Some(retention) = self.retention else {
            return Ok(0);
        };
        client
            .execute(
                &format!(
                    "DELETE FROM {table} WHERE (consumer_name, event_id) IN (
                         SELECT consumer_name, event_id FROM {table}
                          WHERE consumer_name = $1 AND consumed_at < now() - make_interval(secs => $2)
                          LIMIT $3)",
                    table = self.table
                ),
                &[&self.consumer_name, &retention.as_secs_f64(), &batch],
            )
            .await
    }
}
