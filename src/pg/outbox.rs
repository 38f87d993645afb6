//! Outbox SQL on an ordinary connection: mark events published in batches, find rows already published,
//! and read backlog figures. Owns the statements; batching decisions belong to the pipeline.

use tokio_postgres::Client;
use uuid::Uuid;

use crate::config::TableName;
use crate::error::Result;

/// Prepared statements for one outbox table.
pub struct OutboxSql {
    mark_published: tokio_postgres::Statement,
    find_published: tokio_postgres::Statement,
}

impl OutboxSql {
    pub async fn prepare(client: &Client, table: &TableName) -> Result<Self> {
        let table = table.quoted();
        let mark_published = client
            .prepare(&format!(
                "UPDATE {table} SET published_at = now() WHERE event_id = ANY($1::uuid[]) AND published_at IS NULL"
            ))
            .await?;
        let find_published = client
            .prepare(&format!(
                "SELECT event_id FROM {table} WHERE event_id = ANY($1::uuid[]) AND published_at IS NOT NULL"
            ))
            .await?;
        Ok(OutboxSql {
            mark_published,
            find_published,
        })
    }

    /// Sets `published_at` for the given events (one statement); rows already published are left alone.
    pub async fn mark_published(&self, client: &Client, event_ids: &[Uuid]) -> Result<u64> {
        Ok(client.execute(&self.mark_published, &[&event_ids]).await?)
    }

    /// The subset of `event_ids` whose rows already have `published_at`.
    pub async fn find_published(&self, client: &Client, event_ids: &[Uuid]) -> Result<Vec<Uuid>> {
        let rows = client.query(&self.find_published, &[&event_ids]).await?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }
}

/// Backlog figures of the outbox table.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Backlog {
    pub unpublished_events: i64,
    pub oldest_unpublished_age_seconds: Option<f64>,
}

pub async fn backlog(client: &Client, table: &TableName) -> Result<Backlog> {
    let row = client
        .query_one(
            &format!(
                "SELECT count(*), EXTRACT(EPOCH FROM now() - min(created_at))::float8 FROM {} WHERE published_at IS NULL",
                table.quoted()
            ),
            &[],
        )
        .await?;
    Ok(Backlog {
        unpublished_events: row.get(0),
        oldest_unpublished_age_seconds: row.get(1),
    })
}
