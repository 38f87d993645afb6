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

use tokio_postgres::Transaction;
use uuid::Uuid;

/// What [`Inbox::record`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumed {
    /// First time: apply the effect in the same transaction.
    Applied,
    /// Recorded before (a duplicate delivery): skip the effect.
    Duplicate,
}

/// One consumer's inbox: its name in `consumed_event.consumer_name`, and the table.
#[derive(Debug, Clone)]
pub struct Inbox {
    consumer_name: String,
    statement: String,
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
            statement: format!(
                "INSERT INTO {table} (consumer_name, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            ),
        }
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
}
