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
    hand_off: Option<tokio_postgres::Statement>,
}

impl OutboxSql {
    pub async fn prepare(client: &Client, table_name: &TableName) -> Result<Self> {
        let table = table_name.quoted();
        let mark_published = client
            .prepare(&format!(
                "UPDATE {table} SET published_at = now() WHERE event_id = ANY($1::uuid[]) AND published_at IS NULL
                 RETURNING event_id"
            ))
            .await?;
        let find_published = client
            .prepare(&format!(
                "SELECT event_id FROM {table} WHERE event_id = ANY($1::uuid[]) AND published_at IS NOT NULL"
            ))
            .await?;
        let hand_off = match crate::pg::slot::check_polling_columns(client, table_name).await {
            Ok(()) => Some(
                client
                    .prepare(&format!(
                        "UPDATE {table} SET handoff_at = now() WHERE event_id = ANY($1::uuid[]) AND published_at IS NULL
                         RETURNING event_id"
                    ))
                    .await?,
            ),
            Err(crate::error::Error::Setup { .. }) => None,
            Err(error) => return Err(error),
        };
        Ok(OutboxSql {
            mark_published,
            find_published,
            hand_off,
        })
    }

    /// Sets `published_at` for the given events (one statement); rows already published are left alone.
    /// Returns the rows it changed.
    pub async fn mark_published(&self, client: &Client, event_ids: &[Uuid]) -> Result<Vec<Uuid>> {
        let rows = client.query(&self.mark_published, &[&event_ids]).await?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    /// True when the table has the polling columns, so events can be handed to the polling path.
    pub fn can_hand_off(&self) -> bool {
        self.hand_off.is_some()
    }

    /// Hands events to the polling path (sets `handoff_at`); an error without the polling columns.
    /// Returns the rows it changed.
    pub async fn hand_off(&self, client: &Client, event_ids: &[Uuid]) -> Result<Vec<Uuid>> {
        match &self.hand_off {
            Some(statement) => {
                let rows = client.query(statement, &[&event_ids]).await?;
                Ok(rows.iter().map(|row| row.get(0)).collect())
            }
            None => Err(crate::error::Error::setup(
                "cannot hand events to the polling path: the table has no polling columns",
                "run `outboxd migrate`",
            )),
        }
    }

    /// The subset of `event_ids` whose rows already have `published_at`.
    pub async fn find_published(&self, client: &Client, event_ids: &[Uuid]) -> Result<Vec<Uuid>> {
        let rows = client.query(&self.find_published, &[&event_ids]).await?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }
}

/// True when transaction `xid` (32-bit, as pgoutput's Begin reports it) is visible to a snapshot taken now.
///
/// A logical walsender sends a transaction as soon as its commit record is flushed, which can be before the
/// committing backend makes it visible to other sessions (and, with synchronous replication, long before):
/// an UPDATE of its rows issued right away may find nothing. Waiting for visibility tells "not visible yet"
/// apart from "gone" (already published, or deleted by its own transaction).
pub async fn transaction_visible(client: &Client, xid: u32) -> Result<bool> {
    let row = client
        .query_one(
            "WITH s AS (SELECT pg_current_snapshot() AS snap),
                  x AS (SELECT snap, pg_snapshot_xmax(snap)::text::int8 AS xmax FROM s),
                  c AS (SELECT snap, CASE WHEN ((xmax >> 32) << 32) | $1::int8 > xmax
                                          THEN (((xmax >> 32) - 1) << 32) | $1::int8
                                          ELSE ((xmax >> 32) << 32) | $1::int8 END AS full_xid FROM x)
             SELECT pg_visible_in_snapshot(full_xid::text::xid8, snap) FROM c",
            &[&i64::from(xid)],
        )
        .await?;
    Ok(row.get(0))
}

/// Marks, as handed to the polling path, every unpublished row visible in the snapshot exported when the
/// slot was created: exactly the rows the slot will never send. Rows committed later are not visible there.
pub async fn hand_off_rows_older_than_slot(
    client: &mut Client,
    table: &TableName,
    snapshot_name: &str,
) -> Result<u64> {
    if !snapshot_name
        .chars()
        .all(|c| c.is_ascii_hexdigit() || c == '-')
    {
        return Err(crate::error::Error::setup(
            format!("unexpected exported snapshot name {snapshot_name:?}"),
            "report this as an outboxd bug, with the server version",
        ));
    }
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await?;
    tx.batch_execute(&format!("SET TRANSACTION SNAPSHOT '{snapshot_name}'"))
        .await?;
    let marked = tx
        .execute(
            &format!(
                "UPDATE {} SET handoff_at = now()
                 WHERE published_at IS NULL AND dead_at IS NULL AND handoff_at IS NULL",
                table.quoted()
            ),
            &[],
        )
        .await?;
    tx.commit().await?;
    Ok(marked)
}

/// An aggregate: (aggregate_type, aggregate_id).
pub type AggregateKey = (String, String);

/// Aggregates with handed-off rows still waiting for the polling path. The CDC path must not publish their
/// later events ahead of them.
pub async fn aggregates_pending_hand_off(
    client: &Client,
    table: &TableName,
) -> Result<std::collections::HashSet<AggregateKey>> {
    let rows = client
        .query(
            &format!(
                "SELECT DISTINCT aggregate_type, aggregate_id FROM {}
                 WHERE handoff_at IS NOT NULL AND published_at IS NULL AND dead_at IS NULL",
                table.quoted()
            ),
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Dead-lettered events (needs the polling columns).
pub async fn dead_count(client: &Client, table: &TableName) -> Result<i64> {
    let row = client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE dead_at IS NOT NULL AND published_at IS NULL",
                table.quoted()
            ),
            &[],
        )
        .await?;
    Ok(row.get(0))
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

/// Which unpublished rows the polling path may claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimScope {
    /// Every unpublished, non-dead row (`--mode poll`, or `auto` without replication).
    All,
    /// Only rows handed to the polling path: older than the slot, or handed over by the CDC path.
    HandedOff,
}

/// A row claimed by one polling worker under its lease token.
#[derive(Debug, Clone)]
pub struct ClaimedRow {
    pub event_id: Uuid,
    pub event: crate::event::OutboxEvent,
    pub attempts: i32,
    /// Why this row can never be published (a required column is NULL in a user's table): dead-letter it.
    pub invalid: Option<String>,
}

/// Statements of the lease-based polling path for one outbox table.
pub struct PollSql {
    claim: String,
    serialize_claims: bool,
    table_key: String,
    mark_published: tokio_postgres::Statement,
    retry_later: tokio_postgres::Statement,
    dead_letter: tokio_postgres::Statement,
    release: tokio_postgres::Statement,
    renew: tokio_postgres::Statement,
}

impl PollSql {
    pub async fn prepare(
        client: &Client,
        table: &TableName,
        order: crate::config::PollOrder,
        scope: ClaimScope,
    ) -> Result<Self> {
        let t = table.quoted();
        let scope_filter = match scope {
            ClaimScope::All => "",
            ClaimScope::HandedOff => "AND handoff_at IS NOT NULL",
        };
        let order_by = "position NULLS FIRST, created_at, event_id";
        let picked = match order {
            // An event is claimable only when it and every earlier unpublished, non-dead event of its aggregate
            // are claimable (not leased, not waiting for a retry). Earlier events always precede later ones in
            // the global order, so a prefix of that order is enough to decide, and LIMIT never takes an event
            // without its predecessors. Claims are serialised (advisory lock) so two workers never split one
            // aggregate between them.
            crate::config::PollOrder::PerAggregate => format!(
                "prefix AS (
                     SELECT event_id, aggregate_type, aggregate_id, position, created_at,
                            (available_at <= now() AND (lease_until IS NULL OR lease_until < now())) AS ready
                     FROM {t} WHERE published_at IS NULL AND dead_at IS NULL {scope_filter}
                     ORDER BY {order_by} LIMIT $4),
                 ranked AS (
                     SELECT event_id, position, created_at,
                            bool_and(ready) OVER (PARTITION BY aggregate_type, aggregate_id ORDER BY {order_by}
                                                  ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS ready_prefix
                     FROM prefix),
                 picked AS (
                     SELECT event_id FROM {t}
                     WHERE event_id = ANY (ARRAY(SELECT event_id FROM ranked WHERE ready_prefix
                                                 ORDER BY {order_by} LIMIT $3))
                     FOR UPDATE SKIP LOCKED)"
            ),
            crate::config::PollOrder::None => format!(
                "picked AS (
                     SELECT event_id FROM {t}
                     WHERE published_at IS NULL AND dead_at IS NULL {scope_filter} AND available_at <= now()
                       AND (lease_until IS NULL OR lease_until < now()) AND $4::int8 > 0
                     ORDER BY {order_by} LIMIT $3 FOR UPDATE SKIP LOCKED)"
            ),
        };
        let claim = format!(
            "WITH {picked}
             UPDATE {t} e SET lease_token = $1, lease_until = now() + make_interval(secs => $2::float8),
                              attempts = e.attempts + 1
             FROM picked WHERE e.event_id = picked.event_id
             RETURNING e.event_id, e.aggregate_type, e.aggregate_id, e.event_type, e.payload::text,
                       e.created_at::text, e.attempts, e.position"
        );
        let prepare = |sql: String| async move { client.prepare(&sql).await };
        Ok(PollSql {
            claim,
            serialize_claims: order == crate::config::PollOrder::PerAggregate,
            table_key: format!("outboxd.claim.{table}"),
            mark_published: prepare(format!(
                "UPDATE {t} SET published_at = now(), lease_token = NULL, lease_until = NULL, last_error = NULL
                 WHERE event_id = ANY($1::uuid[]) AND lease_token = $2"
            ))
            .await?,
            retry_later: prepare(format!(
                "UPDATE {t} SET lease_token = NULL, lease_until = NULL, last_error = $3,
                                available_at = now() + make_interval(secs => $4::float8)
                 WHERE event_id = $1 AND lease_token = $2"
            ))
            .await?,
            dead_letter: prepare(format!(
                "UPDATE {t} SET lease_token = NULL, lease_until = NULL, last_error = $3, dead_at = now()
                 WHERE event_id = $1 AND lease_token = $2"
            ))
            .await?,
            release: prepare(format!(
                "UPDATE {t} SET lease_token = NULL, lease_until = NULL, attempts = greatest(attempts - 1, 0)
                 WHERE event_id = ANY($1::uuid[]) AND lease_token = $2"
            ))
            .await?,
            renew: prepare(format!(
                "UPDATE {t} SET lease_until = now() + make_interval(secs => $2::float8)
                 WHERE lease_token = $1 AND published_at IS NULL"
            ))
            .await?,
        })
    }

    /// Claims up to `batch` rows under `token` in one short transaction, committed before any Kafka call.
    /// Rows come back in publishing order.
    pub async fn claim(
        &self,
        client: &mut Client,
        token: Uuid,
        lease: std::time::Duration,
        batch: i64,
    ) -> Result<Vec<ClaimedRow>> {
        let tx = client.transaction().await?;
        if self.serialize_claims {
            tx.execute(
                "SELECT pg_advisory_xact_lock(hashtext($1))",
                &[&self.table_key],
            )
            .await?;
        }
        // Wide enough that blocked aggregates rarely starve the batch; each row of it costs every claim.
        let prefix = (batch * 4).max(2_000);
        let rows = tx
            .query(
                &self.claim,
                &[&token, &lease.as_secs_f64(), &batch, &prefix],
            )
            .await?;
        tx.commit().await?;
        let mut claimed: Vec<(Option<i64>, String, ClaimedRow)> = rows
            .iter()
            .map(|row| {
                let event_id: Uuid = row.get(0);
                let created_at: Option<String> = row.get(5);
                let text = |index: usize| row.get::<_, Option<String>>(index);
                let null_columns: Vec<&str> = [
                    (1, "aggregate_type"),
                    (2, "aggregate_id"),
                    (3, "event_type"),
                    (4, "payload"),
                    (5, "created_at"),
                ]
                .into_iter()
                .filter(|(index, _)| text(*index).is_none())
                .map(|(_, name)| name)
                .collect();
                let invalid = (!null_columns.is_empty()).then(|| {
                    format!(
                        "{} is NULL: an event cannot be published without it",
                        null_columns.join(", ")
                    )
                });
                let event = crate::event::OutboxEvent {
                    event_id: event_id.to_string().into(),
                    aggregate_type: text(1).unwrap_or_default().into(),
                    aggregate_id: text(2).unwrap_or_default().into(),
                    event_type: text(3).unwrap_or_default().into(),
                    payload: bytes::Bytes::from(text(4).unwrap_or_default()),
                    created_at: crate::event::to_rfc3339(created_at.as_deref().unwrap_or_default())
                        .into(),
                };
                (
                    row.get(7),
                    created_at.unwrap_or_default(),
                    ClaimedRow {
                        event_id,
                        event,
                        attempts: row.get(6),
                        invalid,
                    },
                )
            })
            .collect();
        // Same order as the claim: position (NULLs first), created_at, event_id.
        claimed.sort_by(|a, b| {
            (a.0.is_some(), a.0, &a.1, a.2.event_id).cmp(&(b.0.is_some(), b.0, &b.1, b.2.event_id))
        });
        Ok(claimed.into_iter().map(|(_, _, row)| row).collect())
    }

    pub async fn mark_published(&self, client: &Client, ids: &[Uuid], token: Uuid) -> Result<u64> {
        Ok(client
            .execute(&self.mark_published, &[&ids, &token])
            .await?)
    }

    pub async fn retry_later(
        &self,
        client: &Client,
        id: Uuid,
        token: Uuid,
        error: &str,
        delay: std::time::Duration,
    ) -> Result<u64> {
        Ok(client
            .execute(
                &self.retry_later,
                &[&id, &token, &error, &delay.as_secs_f64()],
            )
            .await?)
    }

    pub async fn dead_letter(
        &self,
        client: &Client,
        id: Uuid,
        token: Uuid,
        error: &str,
    ) -> Result<u64> {
        Ok(client
            .execute(&self.dead_letter, &[&id, &token, &error])
            .await?)
    }

    /// Gives rows back without counting the attempt (they were never sent).
    pub async fn release(&self, client: &Client, ids: &[Uuid], token: Uuid) -> Result<u64> {
        Ok(client.execute(&self.release, &[&ids, &token]).await?)
    }

    pub async fn renew(
        &self,
        client: &Client,
        token: Uuid,
        lease: std::time::Duration,
    ) -> Result<u64> {
        Ok(client
            .execute(&self.renew, &[&token, &lease.as_secs_f64()])
            .await?)
    }
}

/// Re-queues dead events: clears `dead_at`, `attempts` and `last_error`. Returns how many.
pub async fn replay_dead(client: &Client, table: &TableName, filter: &ReplayFilter) -> Result<u64> {
    let t = table.quoted();
    let base = format!(
        "UPDATE {t} SET dead_at = NULL, attempts = 0, last_error = NULL, available_at = now(),
                        lease_token = NULL, lease_until = NULL
         WHERE dead_at IS NOT NULL AND published_at IS NULL"
    );
    Ok(match filter {
        ReplayFilter::EventId(id) => {
            client
                .execute(&format!("{base} AND event_id = $1"), &[id])
                .await?
        }
        ReplayFilter::AggregateId(aggregate) => {
            client
                .execute(&format!("{base} AND aggregate_id = $1"), &[aggregate])
                .await?
        }
        ReplayFilter::AllDead => client.execute(&base, &[]).await?,
    })
}

/// Which dead events `outboxd replay` re-queues.
#[derive(Debug, Clone)]
pub enum ReplayFilter {
    EventId(Uuid),
    AggregateId(String),
    AllDead,
}
