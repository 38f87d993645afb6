//! Outbox SQL on an ordinary connection: mark events published in batches, find rows already published,
//! the polling path's claim and lease statements, and backlog figures. Every statement names the table's
//! columns through its mapping (`table::OutboxTable`). Owns the statements; batching decisions belong to
//! the pipeline.

use tokio_postgres::{Client, GenericClient};
use uuid::Uuid;

use crate::config::PollOrder;
use crate::error::Result;
use crate::pipeline::liveness::{former_lock_call, lock_call};
use crate::table::{OutboxTable, PayloadType, Role};

/// Prepared statements for one outbox table. A table without `published_at` (CDC only) gets none: nothing
/// is recorded, and every row the slot re-sends is published again.
pub struct OutboxSql {
    mark_published: Option<tokio_postgres::Statement>,
    row_states: Option<tokio_postgres::Statement>,
    hand_off: Option<tokio_postgres::Statement>,
}

impl OutboxSql {
    /// Prepares the statements the table's columns allow (none without `published_at`).
    pub async fn prepare(client: &Client, outbox: &OutboxTable) -> Result<Self> {
        let table = outbox.name.quoted();
        let id = outbox.col(Role::EventId);
        // Stamps `column` on the given unpublished rows and returns the ids it changed.
        let stamp = |column: &str| {
            format!(
                "UPDATE {table} SET {column} = now() WHERE {id} = ANY($1::uuid[]) AND published_at IS NULL
                 RETURNING {id}"
            )
        };
        let mut sql = OutboxSql {
            mark_published: None,
            row_states: None,
            hand_off: None,
        };
        if outbox.marks_published {
            sql.mark_published = Some(client.prepare(&stamp("published_at")).await?);
            // What became of each row, as far as the stream is concerned (see [`RowState`]). A row marked
            // '-infinity' ("published before outboxd", by `migrate --add-polling-columns`) may still be in the
            // slot's stream: it is sent again.
            let published = "(published_at IS NOT NULL AND published_at <> '-infinity')";
            let (waiting, dead) = if outbox.polling {
                ("handoff_at IS NOT NULL", "dead_at IS NOT NULL")
            } else {
                ("false", "false")
            };
            sql.row_states = Some(
                client
                    .prepare(&format!(
                        "SELECT {id}, CASE WHEN {published} THEN 1 WHEN {dead} THEN 2 WHEN {waiting} THEN 3 ELSE 0 END
                         FROM {table} WHERE {id} = ANY($1::uuid[])"
                    ))
                    .await?,
            );
        }
        if outbox.polling {
            // A row marked '-infinity' (published before outboxd) that the stream could not publish is handed
            // off like any other: it becomes unpublished, or it would be dropped.
            sql.hand_off = Some(
                client
                    .prepare(&format!(
                        "UPDATE {table} SET handoff_at = now(), published_at = NULL
                         WHERE {id} = ANY($1::uuid[])
                           AND (published_at IS NULL OR published_at = '-infinity')
                         RETURNING {id}"
                    ))
                    .await?,
            );
        }
        Ok(sql)
    }

    /// Sets `published_at` for the given events (one statement); rows already published are left alone.
    /// Returns the rows it changed (all of them, without `published_at`: nothing to write).
    pub async fn mark_published(&self, client: &Client, event_ids: &[Uuid]) -> Result<Vec<Uuid>> {
        let Some(statement) = &self.mark_published else {
            return Ok(event_ids.to_vec());
        };
        let rows = client.query(statement, &[&event_ids]).await?;
        Ok(rows.iter().map(|row| row.get(0)).collect())
    }

    /// True when the table has the polling columns, so events can be handed to the polling path.
    pub fn can_hand_off(&self) -> bool {
        self.hand_off.is_some()
    }

    /// Hands events to the polling path (sets `handoff_at`); an error without the polling columns.
    /// Returns the rows it changed.
    pub async fn hand_off(
        &self,
        client: &impl GenericClient,
        event_ids: &[Uuid],
    ) -> Result<Vec<Uuid>> {
        match &self.hand_off {
            Some(statement) => {
                let rows = client.query(statement, &[&event_ids]).await?;
                Ok(rows.iter().map(|row| row.get(0)).collect())
            }
            None => Err(crate::error::Error::setup(
                "cannot hand events to the polling path: the table has no polling columns",
                "run `outboxd migrate --add-polling-columns`",
            )),
        }
    }

    /// The rows of the given events as they stand. An id missing from the answer has no row (deleted), or
    /// the table does not record `published_at` (then nothing is known).
    pub async fn row_states(
        &self,
        client: &Client,
        event_ids: &[Uuid],
    ) -> Result<std::collections::HashMap<Uuid, RowState>> {
        let Some(statement) = &self.row_states else {
            return Ok(Default::default());
        };
        let rows = client.query(statement, &[&event_ids]).await?;
        Ok(rows
            .iter()
            .map(|row| {
                let state = match row.get::<_, i32>(1) {
                    1 => RowState::Published,
                    2 => RowState::Dead,
                    3 => RowState::WaitingInPollingPath,
                    _ => RowState::Unfinished,
                };
                (row.get(0), state)
            })
            .collect())
    }
}

/// What became of an event's row, as the stream sees it when the slot sends the event again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowState {
    /// Nothing yet: the stream publishes it.
    Unfinished,
    /// Published (by the stream before, or by the polling path).
    Published,
    /// Dead-lettered by the polling path.
    Dead,
    /// Handed to the polling path and not published yet: its aggregate's later events wait behind it.
    WaitingInPollingPath,
}

impl RowState {
    /// Never produced from the stream again.
    pub fn is_finished(self) -> bool {
        self != RowState::Unfinished
    }
}

/// Columns a written-back row never takes from the row as inserted: it starts unpublished, handed to the
/// polling path, with no lease and not dead.
const WRITE_BACK_RESETS: [&str; 5] = [
    "published_at",
    "handoff_at",
    "dead_at",
    "lease_token",
    "lease_until",
];

/// Writes back, as rows handed to the polling path, events whose rows are gone (deleted by their own
/// transaction) but which must go to the polling path (refused by the broker, or behind earlier events of
/// their aggregate waiting there): each row as it was inserted (`RowImage`, every column the stream carried,
/// its `position` included, so the polling path orders it among its aggregate's rows), with `handoff_at`
/// set. The stream recognises such inserts by that column and leaves them to the polling path. A row that
/// exists again is handed off in place. Runs in the caller's transaction (the backfill's hand-off of the
/// whole batch, so that no later event of an aggregate is handed off visibly before an earlier one is
/// written back). What retrying cannot fix is a setup error naming the fix: INSERT permission, a constraint,
/// a trigger that deletes the row again.
pub async fn write_back_handed_off(
    tx: &tokio_postgres::Transaction<'_>,
    table: &OutboxTable,
    sql: &OutboxSql,
    rows: &[(Uuid, &crate::event::RowImage)],
) -> Result<()> {
    let name = table.name.quoted();
    let id = table.col(Role::EventId);
    let types: std::collections::HashMap<String, String> = tx
        .query(
            "SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped AND attgenerated = ''",
            &[&name],
        )
        .await?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let refused = |problem: String, fix: String| {
        crate::error::Error::setup(
            format!("cannot write back to {name} an event handed to the polling path whose row its own transaction deleted: {problem}"),
            fix,
        )
    };
    let classify = |error: tokio_postgres::Error| {
        use tokio_postgres::error::SqlState;
        match error.code() {
            Some(&SqlState::INSUFFICIENT_PRIVILEGE) => refused(
                crate::error::postgres_error_text(&error),
                format!("GRANT INSERT ON {name} TO the role outboxd runs as (needed where the application deletes its outbox rows in the inserting transaction)"),
            ),
            // Class 23: integrity constraints (NOT NULL, CHECK, foreign keys, exclusion).
            Some(code) if code.code().starts_with("23") => refused(
                crate::error::postgres_error_text(&error),
                format!("make {name} accept the row again as the application inserted it (the error names the constraint), then restart outboxd"),
            ),
            _ => error.into(),
        }
    };
    let mut conflicted = Vec::new();
    for (event_id, row) in rows {
        let mut columns = Vec::new();
        let mut values = Vec::new();
        let mut params: Vec<Option<&str>> = Vec::new();
        for (column, value) in row.columns.iter().zip(&row.values) {
            let Some(column_type) = types.get(&**column) else {
                continue;
            };
            if WRITE_BACK_RESETS.contains(&&**column) {
                continue;
            }
            let text = match value.as_text() {
                Some(bytes) => Some(std::str::from_utf8(bytes).map_err(|_| {
                    crate::error::Error::bug(format!(
                        "column {column} of event {event_id} is not UTF-8 text"
                    ))
                })?),
                None => None,
            };
            params.push(text);
            columns.push(format!("\"{}\"", column.replace('"', "\"\"")));
            values.push(format!("${}::text::{column_type}", params.len()));
        }
        let statement = format!(
            "INSERT INTO {name} ({}, handoff_at) OVERRIDING SYSTEM VALUE VALUES ({}, now())
             ON CONFLICT DO NOTHING RETURNING {id}",
            columns.join(", "),
            values.join(", ")
        );
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
            .iter()
            .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        if tx
            .query_opt(&statement, &params)
            .await
            .map_err(classify)?
            .is_none()
        {
            conflicted.push(*event_id);
        }
    }
    if !conflicted.is_empty() {
        // The row exists again: hand it off where it is (nothing changes if it is published already). A
        // conflict on another unique constraint leaves no row of this event: said below.
        if let Some(statement) = &sql.hand_off {
            tx.query(statement, &[&conflicted])
                .await
                .map_err(classify)?;
        }
    }
    let ids: Vec<Uuid> = rows.iter().map(|(id, _)| *id).collect();
    let present: Vec<Uuid> = tx
        .query(
            &format!("SELECT {id} FROM {name} WHERE {id} = ANY($1::uuid[])"),
            &[&ids],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if let Some(missing) = ids.iter().find(|id| !present.contains(id)) {
        return Err(if conflicted.contains(missing) {
            refused(
                format!("event {missing} conflicts with a row of another event on a unique constraint other than the event id"),
                format!("remove the conflicting row of {name} (or the constraint), then restart outboxd"),
            )
        } else {
            refused(
                format!("event {missing} was deleted again by the statement that inserted it: a trigger on the table deletes inserted rows"),
                "let the trigger keep rows whose handoff_at is set (outboxd's written-back rows), then restart outboxd".into(),
            )
        });
    }
    Ok(())
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
/// Tables without polling columns are skipped (their older rows are not published).
pub async fn hand_off_rows_older_than_slot(
    client: &mut Client,
    tables: &[OutboxTable],
    snapshot_name: &str,
) -> Result<u64> {
    if !snapshot_name
        .chars()
        .all(|c| c.is_ascii_hexdigit() || c == '-')
    {
        return Err(crate::error::Error::bug(format!(
            "PostgreSQL exported an unexpected snapshot name {snapshot_name:?}"
        )));
    }
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await?;
    tx.batch_execute(&format!("SET TRANSACTION SNAPSHOT '{snapshot_name}'"))
        .await?;
    tx.batch_execute(WITHOUT_STATEMENT_TIMEOUT).await?;
    let mut marked = 0;
    for table in tables.iter().filter(|t| t.polling) {
        // A slot created while an earlier one still owed the rows marked published before outboxd (replaced
        // after a failover, or dropped) will never send them: they go to the polling path with the rest.
        if history_mark(&tx, table)
            .await?
            .is_some_and(|mark| !mark.streamed)
        {
            let rows = republish_history(&tx, table).await?;
            tracing::warn!(table = %table.name, rows, "a new slot: the rows marked published before outboxd may not all have been streamed by the slot it replaces; handed them all to the polling path (some are published again)");
        }
        marked += hand_off_unpublished_rows_of(&tx, table).await?;
    }
    tx.commit().await?;
    Ok(marked)
}

/// Marks every unpublished row visible now as handed to the polling path, in one transaction (a slot that
/// may skip some of them: see `pipeline::cdc::bootstrap`). Rows the slot sends again are found handed off.
/// Tables without polling columns are skipped. Returns how many.
pub async fn hand_off_unpublished_rows(client: &mut Client, tables: &[OutboxTable]) -> Result<u64> {
    let tx = client.transaction().await?;
    tx.batch_execute(WITHOUT_STATEMENT_TIMEOUT).await?;
    let mut marked = 0;
    for table in tables.iter().filter(|t| t.polling) {
        marked += hand_off_unpublished_rows_of(&tx, table).await?;
    }
    tx.commit().await?;
    Ok(marked)
}

async fn hand_off_unpublished_rows_of(
    tx: &tokio_postgres::Transaction<'_>,
    table: &OutboxTable,
) -> Result<u64> {
    number_rows_without_position(tx, table).await?;
    Ok(tx
        .execute(
            &format!(
                "UPDATE {} SET handoff_at = now()
                 WHERE published_at IS NULL AND dead_at IS NULL AND handoff_at IS NULL",
                table.name.quoted()
            ),
            &[],
        )
        .await?)
}

/// The start of `published_at`'s comment that records up to which WAL position rows were marked published
/// before outboxd (`migrate --existing-rows published`), followed by that position.
pub const HISTORY_MARK: &str = "outboxd: rows with published_at -infinity were marked published before outboxd, all committed before WAL ";
/// Follows the position once no slot owes those rows any longer (the slot streamed past it, or there was
/// none when they were marked).
pub const HISTORY_STREAMED: &str = "; no slot owes them";

/// The history mark of a table (see [`HISTORY_MARK`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryMark {
    /// Every row marked '-infinity' committed before this WAL position.
    pub position: crate::lsn::Lsn,
    /// No slot owes them any longer: they are history for good.
    pub streamed: bool,
}

impl HistoryMark {
    /// Reads a `published_at` comment; `None` for any other comment.
    pub fn parse(comment: &str) -> Option<Self> {
        let rest = comment.strip_prefix(HISTORY_MARK)?;
        let (position, streamed) = match rest.strip_suffix(HISTORY_STREAMED) {
            Some(position) => (position, true),
            None => (rest, false),
        };
        Some(HistoryMark {
            position: position.parse().ok()?,
            streamed,
        })
    }

    /// The comment that records this mark.
    pub fn comment(&self) -> String {
        let streamed = if self.streamed { HISTORY_STREAMED } else { "" };
        format!("{HISTORY_MARK}{}{streamed}", self.position)
    }

    /// Rows marked '-infinity' are owed to no slot whose confirmed position is `confirmed` (or none at all).
    pub fn owed_by_none(&self, confirmed: Option<crate::lsn::Lsn>) -> bool {
        self.streamed || confirmed.is_some_and(|confirmed| confirmed >= self.position)
    }
}

/// The history mark of `table`, if it has one.
pub async fn history_mark(
    client: &impl GenericClient,
    table: &OutboxTable,
) -> Result<Option<HistoryMark>> {
    let comment: Option<String> = client
        .query_opt(
            "SELECT col_description(to_regclass($1), a.attnum) FROM pg_attribute a
             WHERE a.attrelid = to_regclass($1) AND a.attname = 'published_at'",
            &[&table.name.quoted()],
        )
        .await?
        .and_then(|row| row.get(0));
    Ok(comment.as_deref().and_then(HistoryMark::parse))
}

/// Records that no slot owes `table`'s history any longer, once the slot's `confirmed` position passed it. A
/// comment needs the table's owner: a role that is not is told once at debug level, and the mark stays
/// pending (a slot created later then hands the history to the polling path again: duplicates, never a
/// loss; `outboxd migrate` records it too). The comment's lock (SHARE UPDATE EXCLUSIVE) is held by every
/// VACUUM, autovacuum and index build on the table, for as long as they run: behind one, the statement
/// gives way at the client's `lock_timeout` and the mark stays pending until a later call, which is no
/// failure (while this slot has confirmed past the mark, the history may go whether recorded or not).
pub async fn record_history_streamed(
    client: &Client,
    table: &OutboxTable,
    confirmed: crate::lsn::Lsn,
) -> Result<()> {
    let Some(mark) = history_mark(client, table).await? else {
        return Ok(());
    };
    if mark.streamed || confirmed < mark.position {
        return Ok(());
    }
    let streamed = HistoryMark {
        streamed: true,
        ..mark
    };
    let comment = format!(
        "COMMENT ON COLUMN {}.published_at IS '{}'",
        table.name.quoted(),
        streamed.comment()
    );
    match client.batch_execute(&comment).await {
        Ok(()) => {
            tracing::info!(table = %table.name, position = %mark.position, "the slot streamed past the rows marked published before outboxd: recorded");
            Ok(())
        }
        Err(error)
            if error.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) =>
        {
            tracing::debug!(table = %table.name, "cannot record that the slot streamed past the history (not the table's owner); `outboxd migrate` records it");
            Ok(())
        }
        Err(error)
            if error.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
        {
            tracing::info!(table = %table.name, "the slot streamed past the rows marked published before outboxd; recording it gave way to another session's lock on the table (a VACUUM or an index build): trying again next pass");
            Ok(())
        }
        Err(error) => Err(error.into()),
    }
}

/// Hands every '-infinity' row of `table` to the polling path (`published_at` NULL, `handoff_at` set).
async fn republish_history(client: &impl GenericClient, table: &OutboxTable) -> Result<u64> {
    Ok(client
        .execute(
            &format!(
                "UPDATE {} SET published_at = NULL, handoff_at = now() WHERE published_at = '-infinity'",
                table.name.quoted()
            ),
            &[],
        )
        .await?)
}

/// Called before a lost slot (`confirmed`: its last confirmed position) is replaced. Rows marked published
/// before outboxd after that position may never have been streamed: every '-infinity' row of such a table is
/// handed to the polling path (those the slot did stream are published again: duplicates, never a loss).
/// Returns the rows handed off.
pub async fn republish_history_a_lost_slot_owed(
    client: &Client,
    tables: &[OutboxTable],
    confirmed: crate::lsn::Lsn,
) -> Result<u64> {
    let mut handed_off = 0;
    for table in tables.iter().filter(|t| t.polling) {
        let Some(mark) = history_mark(client, table).await? else {
            continue;
        };
        if mark.owed_by_none(Some(confirmed)) {
            continue;
        }
        let rows = republish_history(client, table).await?;
        tracing::warn!(table = %table.name, rows, "the lost slot had not streamed every row marked published before outboxd: handed them all to the polling path (some are published again)");
        handed_off += rows;
    }
    Ok(handed_off)
}

/// Lifts a `statement_timeout` (set for the role, or by the server) for the rest of the transaction:
/// outboxd's one-off maintenance statements over the whole backlog (numbering, the slot's hand-off) must
/// finish, however large the backlog; outboxd bounds its other statements itself.
pub const WITHOUT_STATEMENT_TIMEOUT: &str = "SET LOCAL statement_timeout = 0";

/// Gives the unpublished rows that have no `position` (older than the polling migration, or in a table given
/// `migrate --add-polling-columns`) one in insert order, before every sequence-filled row: by `created_at`
/// (the transaction's start), then the inserting transaction's id and the command id within it (one per
/// INSERT statement), then physical order (rows of one multi-row INSERT). xmin and cmin are the insert's only
/// while the row was never updated, so this runs before outboxd first touches them: when the polling path
/// starts and inside the slot's hand-off. Reads the claim index (`position NULLS FIRST`), not the table.
/// Returns the rows numbered (none once done). Callers run it in a transaction after
/// [`WITHOUT_STATEMENT_TIMEOUT`]: on a large history it takes longer than a role's `statement_timeout` may
/// allow, and cut short it would fail again at every try.
pub async fn number_rows_without_position(
    client: &impl GenericClient,
    table: &OutboxTable,
) -> Result<u64> {
    let created_at = table
        .column(Role::CreatedAt)
        .map(|column| format!("\"{column}\", "))
        .unwrap_or_default();
    let name = table.name.quoted();
    Ok(client
        .execute(
            &format!(
                "WITH ordered AS (
                     SELECT tableoid AS rel, ctid AS tid, count(*) OVER () AS total,
                            row_number() OVER (ORDER BY {created_at}xmin::text::int8, cmin::text::int8, tableoid, ctid) AS n
                     FROM {name} WHERE position IS NULL AND published_at IS NULL AND dead_at IS NULL)
                 UPDATE {name} t SET position = ordered.n - ordered.total - 1
                 FROM ordered
                 WHERE t.tableoid = ordered.rel AND t.ctid = ordered.tid AND t.position IS NULL"
            ),
            &[],
        )
        .await?)
}

/// An aggregate: (aggregate_type, aggregate_id).
pub type AggregateKey = (String, String);

/// Aggregates with handed-off rows still waiting for the polling path, each with whether some of them are
/// held by a replay (see [`HandOffNotice::held`]). The CDC path must not publish their later events ahead of
/// them. At most `limit + 1` (more than `limit` means "too many to track").
pub async fn aggregates_pending_hand_off(
    client: &Client,
    table: &OutboxTable,
    limit: usize,
) -> Result<std::collections::HashMap<AggregateKey, bool>> {
    let rows = client
        .query(
            &format!(
                // NULLs (nullable columns of a fitted table) read as '', as the CDC path keys such rows;
                // the polling path dead-letters them.
                "SELECT coalesce({0}, ''), coalesce({1}::text, ''), bool_or(available_at = 'infinity') FROM {2}
                 WHERE handoff_at IS NOT NULL AND published_at IS NULL AND dead_at IS NULL
                 GROUP BY 1, 2 LIMIT $1",
                table.text_expr(Role::AggregateType, "''::text"),
                table.col(Role::AggregateId),
                table.name.quoted()
            ),
            &[&(limit as i64 + 1)],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| ((r.get(0), r.get(1)), r.get(2)))
        .collect())
}

/// Whether transaction `xid` is still running on the server. A commit is on disk (and decoded) before it
/// is visible to other sessions while it waits for a synchronous standby; every transaction holds the lock
/// on its own id until after it became visible, and `pg_locks` shows it to every role.
pub async fn transaction_running(client: &Client, xid: u32) -> Result<bool> {
    Ok(client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks
             WHERE locktype = 'transactionid' AND transactionid = $1::text::xid)",
            &[&xid.to_string()],
        )
        .await?
        .get(0))
}

/// Whether `aggregate` has rows waiting in the polling path of `table` (as [`aggregates_pending_hand_off`]
/// counts them).
pub async fn aggregate_pending_hand_off(
    client: &Client,
    table: &OutboxTable,
    aggregate: &AggregateKey,
) -> Result<bool> {
    let row = client
        .query_one(
            &format!(
                "SELECT EXISTS (SELECT 1 FROM {} WHERE handoff_at IS NOT NULL AND published_at IS NULL
                 AND dead_at IS NULL AND coalesce({}, '') = $1 AND coalesce({}::text, '') = $2)",
                table.name.quoted(),
                table.text_expr(Role::AggregateType, "''::text"),
                table.col(Role::AggregateId),
            ),
            &[&aggregate.0, &aggregate.1],
        )
        .await?;
    Ok(row.get(0))
}

/// The statements behind the periodic figures of one table (every 5 s on the instance that reports them, and in
/// `outboxd status`), each matching a partial index of the polling migrations so that it reads the backlog, not
/// the table: `(count, oldest created_at)` and, with the polling columns, the dead count. Dead events are not
/// backlog: they wait for a person (`outboxd replay`), and counting them kept "oldest age" climbing forever.
/// A table without the polling columns has no such index: its count reads the whole table.
pub fn backlog_statements(table: &OutboxTable, order: PollOrder) -> BacklogStatements {
    let t = table.name.quoted();
    let unpublished = if table.polling {
        "published_at IS NULL AND dead_at IS NULL"
    } else {
        "published_at IS NULL"
    };
    // Bounded: a backlog of millions (a catch-up) costs the same as one of BACKLOG_COUNT_CAP.
    let count = format!(
        "SELECT count(*) FROM (SELECT FROM {t} WHERE {unpublished} LIMIT {BACKLOG_COUNT_CAP}) AS unpublished"
    );
    // The oldest events are the first in claim order (the claim index's order), a few index entries away.
    // The oldest age among the first HEAD_ROWS: a first row without created_at (its age unknown) does not
    // hide how long the rows behind it wait. With the polling columns, whether any of them is due (not
    // waiting for a retry).
    let oldest = table.column(Role::CreatedAt).map(|created_at| {
        let first = if table.polling {
            format!(
                "ORDER BY position NULLS FIRST, {} LIMIT {HEAD_ROWS}",
                table.order_key()
            )
        } else {
            // NULLs sort last: the first row has an age whenever any row has one.
            format!("ORDER BY \"{created_at}\" LIMIT 1")
        };
        format!(
            "SELECT max(EXTRACT(EPOCH FROM now() - \"{created_at}\"))::float8
             FROM (SELECT \"{created_at}\" FROM {t} WHERE {unpublished} {first}) AS head"
        )
    });
    // Whether one of the first rows in claim order is owed now: due (not waiting for a retry, nor, in
    // per-aggregate order, behind such a row of its aggregate among them), or waiting for its retry after a
    // failed attempt (a broker refusing every event keeps every row waiting: that is no idle table). A leased
    // row counts as due: a lease that ends without a publication (a broker that does not answer) is no
    // progress. A row waiting for its first try (`available_at` set ahead by the application) is not owed.
    let claimable_now = "available_at <= now()";
    let failed = "attempts > 0";
    let due = table.polling.then(|| match order {
        PollOrder::None => format!(
            "SELECT coalesce(bool_or({claimable_now} OR {failed}), false)
             FROM (SELECT available_at, attempts FROM {t} WHERE {unpublished} ORDER BY position NULLS FIRST, {order} LIMIT {HEAD_ROWS}) AS head",
            order = table.order_key(),
        ),
        PollOrder::PerAggregate => format!(
            "SELECT coalesce(bool_or(claimable OR failed), false) FROM (
                 SELECT bool_and({claimable_now}) OVER (PARTITION BY {aggregate} ORDER BY position NULLS FIRST, {order}) AS claimable,
                        {failed} AS failed
                 FROM (SELECT * FROM {t} WHERE {unpublished} ORDER BY position NULLS FIRST, {order} LIMIT {HEAD_ROWS}) AS head
             ) AS head",
            aggregate = table.aggregate_key(),
            order = table.order_key(),
        ),
    });
    // The newest publication by any instance (the published index, one entry): the fleet's progress.
    let newest_published = table.polling.then(|| {
        format!("SELECT EXTRACT(EPOCH FROM max(published_at))::float8 FROM {t} WHERE published_at IS NOT NULL")
    });
    let dead = table.polling.then(|| {
        format!("SELECT count(*) FROM (SELECT FROM {t} WHERE dead_at IS NOT NULL AND published_at IS NULL LIMIT {BACKLOG_COUNT_CAP}) AS dead")
    });
    BacklogStatements {
        count,
        oldest,
        due,
        newest_published,
        dead,
    }
}

/// What makes `table`'s backlog countable through an index.
pub fn backlog_index_fix(table: &OutboxTable) -> String {
    if table.polling {
        return format!("run `outboxd migrate --add-polling-columns --table {}`: it builds the claim index the count reads", table.name);
    }
    let key = table.column(Role::CreatedAt).unwrap_or("published_at");
    format!(
        "CREATE INDEX CONCURRENTLY ON {} (\"{key}\") WHERE published_at IS NULL",
        table.name.quoted()
    )
}

/// How many of the first unpublished rows the oldest age is read from.
const HEAD_ROWS: i64 = 100;

/// The backlog is counted up to this many rows; beyond, the count reads this.
pub const BACKLOG_COUNT_CAP: i64 = 1_000_000;

/// Whether `sql` can only be answered by reading the whole table (no index serves it): the plan it gets
/// with sequential scans ruled out as far as the planner can.
pub async fn needs_a_table_scan(client: &Client, sql: &str) -> Result<bool> {
    let explained = client
        .simple_query(&format!(
            // One implicit transaction (a failure leaves no transaction open), where SET LOCAL holds.
            "SET LOCAL enable_seqscan = off; EXPLAIN (FORMAT JSON) {sql}"
        ))
        .await?;
    Ok(explained.iter().any(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => row
            .get(0)
            .is_some_and(|plan| plan.contains("\"Node Type\": \"Seq Scan\"")),
        _ => false,
    }))
}

/// Which of a table's figures an index serves (see [`needs_a_table_scan`]): only those are read, by the
/// periodic figures, `outboxd status` and `outboxd doctor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Countable {
    /// The backlog's count and oldest age.
    pub backlog: bool,
    /// The dead letters (false without the polling columns).
    pub dead: bool,
}

/// [`Countable`] for `table`, by the plans of its [`backlog_statements`].
pub async fn countable(client: &Client, table: &OutboxTable) -> Result<Countable> {
    // The per-aggregate statements: an index that serves them serves the others.
    let statements = backlog_statements(table, PollOrder::PerAggregate);
    let mut backlog = true;
    for sql in std::iter::once(&statements.count)
        .chain(&statements.oldest)
        .chain(&statements.due)
    {
        backlog &= !needs_a_table_scan(client, sql).await?;
    }
    let dead = match &statements.dead {
        Some(sql) => !needs_a_table_scan(client, sql).await?,
        None => false,
    };
    Ok(Countable { backlog, dead })
}

/// See [`backlog_statements`].
#[derive(Debug, Clone)]
pub struct BacklogStatements {
    /// Counts the unpublished rows (with the polling columns: those not dead).
    pub count: String,
    /// Without a `created_at` column there is no age.
    pub oldest: Option<String>,
    /// Whether a row is due (only with the polling columns).
    pub due: Option<String>,
    /// When the newest row was published (only with the polling columns, whose migrations index it).
    pub newest_published: Option<String>,
    /// Only with the polling columns.
    pub dead: Option<String>,
}

/// Dead-lettered events (needs the polling columns).
pub async fn dead_count(client: &Client, table: &OutboxTable) -> Result<i64> {
    match backlog_statements(table, PollOrder::PerAggregate).dead {
        Some(sql) => Ok(client.query_one(&sql, &[]).await?.try_get(0)?),
        None => Ok(0),
    }
}

/// Backlog figures of the outbox table.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Backlog {
    /// Unpublished rows that are not dead, summed over the tables.
    pub unpublished_events: i64,
    /// Age of the oldest unpublished row in seconds; `None` without rows, or without `created_at` columns.
    pub oldest_unpublished_age_seconds: Option<f64>,
    /// Each table with the polling columns: whether its events move (for the stall watchdog).
    #[serde(skip)]
    pub activity: Vec<TableActivity>,
}

/// Whether a table's events move, as its rows show.
#[derive(Debug, Clone, PartialEq)]
pub struct TableActivity {
    /// The table, schema-qualified.
    pub table: String,
    /// A row is owed now, as far as the first rows in claim order show: due (not waiting for its retry, nor
    /// behind such a row of its aggregate), or waiting for its retry after a failed attempt.
    pub due: bool,
    /// When its newest row was published (seconds since the epoch), by any instance; `None` before the first.
    pub newest_published: Option<f64>,
    /// An index serves `newest_published` (without one it is not asked, and is `None`).
    pub newest_published_known: bool,
}

/// The backlog of every table that records what was published (tables without `published_at` have no
/// backlog to count: their slot lag is the measure). Dead events are not counted. `order`: the claim's
/// (`--poll-order`), which decides which rows are due.
pub async fn backlog(client: &Client, tables: &[OutboxTable], order: PollOrder) -> Result<Backlog> {
    let mut total = Backlog::default();
    for table in tables.iter().filter(|t| t.marks_published) {
        let statements = backlog_statements(table, order);
        let unpublished = client
            .query_one(&statements.count, &[])
            .await?
            .try_get::<_, i64>(0)?;
        total.unpublished_events += unpublished;
        let oldest: Option<f64> = match &statements.oldest {
            // NULL when none of those rows has a created_at (a nullable column): their age is unknown.
            Some(sql) => client.query_one(sql, &[]).await?.try_get(0)?,
            None => None,
        };
        total.oldest_unpublished_age_seconds = match (total.oldest_unpublished_age_seconds, oldest)
        {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let Some(due) = &statements.due else {
            continue;
        };
        let due = client.query_one(due, &[]).await?.try_get::<_, bool>(0)?;
        // Only through the published index (a table may lack it; the figures above do not need it).
        let (newest_published, newest_published_known) = match &statements.newest_published {
            Some(sql) if !needs_a_table_scan(client, sql).await? => {
                (client.query_one(sql, &[]).await?.try_get(0)?, true)
            }
            _ => (None, false),
        };
        total.activity.push(TableActivity {
            table: table.name.to_string(),
            due,
            newest_published,
            newest_published_known,
        });
    }
    Ok(total)
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
    /// The event's id (the row's event_id column).
    pub event_id: Uuid,
    /// The event, as it will be published.
    pub event: crate::event::OutboxEvent,
    /// Publish attempts so far, this claim included.
    pub attempts: i32,
    /// Why this row can never be published (a required column is NULL in a user's table): dead-letter it.
    pub invalid: Option<String>,
}

/// What one claim took, and which aggregates it found blocked.
#[derive(Debug, Default)]
pub struct Claim {
    /// The claimed rows, in publishing order.
    pub rows: Vec<ClaimedRow>,
    /// Aggregates of the claim's prefix whose first unpublished event is not claimable (waiting for a retry,
    /// or leased by another worker): none of their events can be claimed before `ready_in` has passed.
    pub blocked: Vec<BlockedAggregate>,
    /// Rows without an event id the claim came upon and dead-lettered (never leased, never returned in
    /// `rows`).
    pub dead_without_id: Vec<RowWithoutId>,
}

/// A row without an event id (NULL in a fitted table's nullable column) that a claim dead-lettered in place:
/// it can never be published, and nothing can name it by its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowWithoutId {
    /// Its aggregate_type (`None`: NULL, or the table has no such column).
    pub aggregate_type: Option<String>,
    /// Its aggregate_id (`None`: NULL).
    pub aggregate_id: Option<String>,
    /// Its place in the claim order (`None`: NULL).
    pub position: Option<i64>,
}

/// The columns of a claim's answer, in order; the header columns follow [`ClaimColumn::Headers`], then a
/// blocked aggregate's key, wait and lease.
#[derive(Debug, Clone, Copy)]
enum ClaimColumn {
    /// What the row is: 'claimed', 'dead_without_id' or 'blocked'.
    Kind,
    EventId,
    AggregateType,
    AggregateId,
    EventType,
    Payload,
    CreatedAt,
    Attempts,
    Position,
    /// The replay (or heal) that handed the row back (see [`replayed_column`]).
    ReplayId,
    Headers,
}

/// An aggregate a claim found blocked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockedAggregate {
    /// The aggregate as the claim SQL names it (`ROW(aggregate key)::text`); give it back in
    /// [`PollSql::claim_skipping`]'s `skip`.
    pub key: String,
    /// How long until its first event may be claimable (its retry is due, or the lease on it ends), at most
    /// an hour.
    pub ready_in: std::time::Duration,
    /// Another worker's lease holds it (usually only for that worker's batch).
    pub leased: bool,
}
/// How long a claim waits for the claim lock in the form earlier versions take it: an earlier version's
/// claim under way holds it for milliseconds, or at most its claim transaction's
/// `idle_in_transaction_session_timeout` (10 s) when its instance went silent. Held longer, it is an
/// application's lock on that bigint, and claims go on without it.
const FORMER_CLAIM_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The key of `outbox`'s claim lock, which every per-aggregate claim holds for its transaction (through
/// `liveness::lock_call`).
pub fn claim_lock_key(outbox: &OutboxTable) -> String {
    format!("outboxd.claim.{}", outbox.name)
}

/// Statements of the lease-based polling path for one outbox table.
pub struct PollSql {
    claim: String,
    /// The last_error of a row a claim dead-lettered because its event id is NULL.
    without_id_error: String,
    columns: EventColumns,
    serialize_claims: bool,
    table_key: String,
    /// Set when a claim gave up waiting for the former claim lock; cleared when one gets it again.
    former_claim_lock_busy: std::sync::atomic::AtomicBool,
    mark_published: tokio_postgres::Statement,
    retry_later: tokio_postgres::Statement,
    dead_letter: tokio_postgres::Statement,
    release: tokio_postgres::Statement,
    renew: tokio_postgres::Statement,
}

/// An event's columns as a claim (or a replay's read) returns them, after a first column telling what the row
/// is (see [`ClaimColumn`]), and how to read them back.
pub struct EventColumns {
    payload_type: PayloadType,
    has_aggregate_type: bool,
    header_columns: Vec<std::sync::Arc<str>>,
}

impl EventColumns {
    /// The columns of `outbox`'s events.
    pub fn of(outbox: &OutboxTable) -> Self {
        EventColumns {
            payload_type: outbox.payload_type,
            has_aggregate_type: outbox.column(Role::AggregateType).is_some(),
            header_columns: outbox
                .header_columns
                .iter()
                .map(|c| std::sync::Arc::from(c.as_str()))
                .collect(),
        }
    }

    /// The select list of an event's columns, from `outbox` as `e`, from [`ClaimColumn::EventId`] on; `replay`:
    /// the expression of [`ClaimColumn::ReplayId`].
    pub fn select_list(outbox: &OutboxTable, replay: &str) -> String {
        let payload = match outbox.payload_type {
            PayloadType::Text | PayloadType::Json => {
                format!("e.{}::text", outbox.col(Role::Payload))
            }
            PayloadType::Bytes => format!("e.{}", outbox.col(Role::Payload)),
        };
        let created_at_text = outbox
            .column(Role::CreatedAt)
            .map_or("NULL::text".to_string(), |c| format!("e.\"{c}\"::text"));
        let headers: String = outbox
            .header_columns
            .iter()
            .map(|c| format!(", e.\"{c}\"::text"))
            .collect();
        format!(
            "e.{id}, {aggregate_type}, e.{aggregate_id}::text, {event_type}, {payload}, {created_at_text},
             e.attempts, e.position, {replay}{headers}",
            id = outbox.col(Role::EventId),
            aggregate_type = outbox.text_expr(Role::AggregateType, "NULL::text"),
            aggregate_id = outbox.col(Role::AggregateId),
            event_type = outbox.text_expr(Role::EventType, "NULL::text"),
        )
    }

    /// A claimed (or replayed) row, with its position and created_at (its place in the claim order).
    pub fn claimed_row(
        &self,
        row: &tokio_postgres::Row,
    ) -> Result<(Option<i64>, String, ClaimedRow)> {
        use ClaimColumn as C;
        // The claim leased it by its id: never NULL.
        let event_id: Uuid = row
            .get::<_, Option<Uuid>>(C::EventId as usize)
            .ok_or_else(|| {
                crate::error::Error::bug("the claim returned a claimed row without event id")
            })?;
        let text = |column: C| row.get::<_, Option<String>>(column as usize);
        let created_at = text(C::CreatedAt);
        // As on the CDC path: a NULL event_type only leaves its header out.
        let null_columns: Vec<&str> = [
            (C::AggregateType, "aggregate_type", self.has_aggregate_type),
            (C::AggregateId, "aggregate_id", true),
        ]
        .into_iter()
        .filter(|(column, _, present)| *present && text(*column).is_none())
        .map(|(_, name, _)| name)
        .collect();
        let invalid = (!null_columns.is_empty()).then(|| {
            format!(
                "{} is NULL: an event cannot be published without it",
                null_columns.join(", ")
            )
        });
        // A NULL payload is a tombstone.
        let payload = match self.payload_type {
            PayloadType::Text | PayloadType::Json => text(C::Payload).map(bytes::Bytes::from),
            PayloadType::Bytes => row
                .get::<_, Option<Vec<u8>>>(C::Payload as usize)
                .map(bytes::Bytes::from),
        };
        let headers = self
            .header_columns
            .iter()
            .enumerate()
            .filter_map(|(at, name)| {
                let value = row.get::<_, Option<String>>(C::Headers as usize + at)?;
                Some((name.clone(), value.into()))
            })
            .collect();
        let event = crate::event::OutboxEvent {
            event_id: event_id.to_string().into(),
            aggregate_type: text(C::AggregateType).map(Into::into),
            aggregate_id: text(C::AggregateId).unwrap_or_default().into(),
            event_type: text(C::EventType).map(Into::into),
            payload,
            created_at: created_at
                .as_deref()
                .map(|c| crate::event::to_rfc3339(c).into()),
            headers,
            replay: row
                .get::<_, Option<String>>(C::ReplayId as usize)
                .map(Into::into),
        };
        Ok((
            row.get(C::Position as usize),
            created_at.unwrap_or_default(),
            ClaimedRow {
                event_id,
                event,
                attempts: row
                    .get::<_, Option<i32>>(C::Attempts as usize)
                    .unwrap_or_default(),
                invalid,
            },
        ))
    }
}

impl PollSql {
    /// Prepares the polling statements of `outbox` for the given ordering rule and claim scope.
    // Long: the SQL of each polling statement, written out once per ordering rule and claim scope.
    pub async fn prepare(
        client: &Client,
        outbox: &OutboxTable,
        order: PollOrder,
        scope: ClaimScope,
    ) -> Result<Self> {
        let table = &outbox.name;
        let t = table.quoted();
        let id = outbox.col(Role::EventId);
        let aggregate_key = outbox.aggregate_key();
        let created_at = outbox.column(Role::CreatedAt).map(|c| format!("\"{c}\""));
        let scope_filter = match scope {
            ClaimScope::All => "",
            ClaimScope::HandedOff => "AND handoff_at IS NOT NULL",
        };
        let order_by = format!("position NULLS FIRST, {}", outbox.order_key());
        let picked = match order {
            // An event is claimable only when it and every earlier unpublished, non-dead event of its aggregate
            // are claimable (not leased, not waiting for a retry). Earlier events always precede later ones in
            // the global order, so a prefix of that order is enough to decide, and LIMIT never takes an event
            // without its predecessors. Claims are serialised (advisory lock) so two workers never split one
            // aggregate between them.
            //
            // The prefix leaves out whole aggregates (`$5`, their `ROW(aggregate key)::text`): those earlier
            // claims found blocked. Every event of such an aggregate is left out, so for any other aggregate
            // the prefix still holds every earlier event of each event in it, and the decision stays exact;
            // the aggregates left out are simply not claimed by this claim. Without it, blocked aggregates
            // with enough rows at the head of the order fill the prefix and no claim gets past them. Each claim
            // reports the aggregates of its prefix whose first event is not claimable, with how long until it
            // may be (`blocked`); the worker leaves them out until then (`pipeline::poll::BlockedAggregates`).
            //
            // Row locks are taken last, and an aggregate is claimed only up to its first event that could not
            // be locked: SKIP LOCKED passes over a row another session holds (a worker's retry UPDATE after its
            // lease lapsed, an operator's UPDATE, a `FOR UPDATE`), and claiming that aggregate's later events
            // would publish them first. The lock re-checks that the row is still claimable, so a row leased
            // or published since the statement's snapshot holds its aggregate back too.
            //
            // A row of the prefix without an event id takes no part in this: it is dead-lettered (`without_id`,
            // below), never claimed, and holds back no later event of its aggregate.
            PollOrder::PerAggregate => format!(
                "prefix AS (
                     SELECT {id}, {aggregate_key}, position{created_at_column}, tableoid AS row_table, ctid AS row_tid,
                            (available_at <= now() AND (lease_until IS NULL OR lease_until < clock_timestamp())) AS ready,
                            coalesce(lease_until >= now(), false) AS leased, greatest(available_at, lease_until) AS ready_at
                     FROM {t} WHERE published_at IS NULL AND dead_at IS NULL {scope_filter}
                       AND ROW({aggregate_key})::text NOT IN (SELECT unnest($5::text[]))
                     ORDER BY {order_by} LIMIT $4),
                 ranked AS (
                     SELECT {id}, {aggregate_key}, position{created_at_column}, ready, leased, ready_at,
                            bool_and(ready) OVER in_aggregate AS ready_prefix,
                            first_value(ready) OVER in_aggregate AS first_ready
                     FROM prefix WHERE {id} IS NOT NULL
                     WINDOW in_aggregate AS (PARTITION BY {aggregate_key} ORDER BY {order_by}
                                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)),
                 candidates AS (
                     SELECT {id}, {aggregate_key}, position{created_at_column} FROM ranked WHERE ready_prefix
                     ORDER BY {order_by} LIMIT $3),
                 locked AS (
                     SELECT {id} AS locked_id FROM {t}
                     WHERE {id} = ANY (ARRAY(SELECT {id} FROM candidates))
                       AND published_at IS NULL AND dead_at IS NULL {scope_filter} AND available_at <= now()
                       AND (lease_until IS NULL OR lease_until < clock_timestamp())
                     FOR UPDATE SKIP LOCKED),
                 picked AS (
                     SELECT {id} AS picked_id FROM (
                         SELECT {id}, bool_and(locked_id IS NOT NULL) OVER (
                                    PARTITION BY {aggregate_key} ORDER BY {order_by}
                                    ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS locked_prefix
                         FROM candidates LEFT JOIN locked ON locked_id = {id}) AS claimable
                     WHERE locked_prefix),
                 blocked AS (
                     SELECT ROW({aggregate_key})::text AS blocked_key,
                            extract(epoch FROM least(min(ready_at), now() + interval '1 hour') - now())::float8
                                AS blocked_for,
                            bool_or(leased) AS blocked_by_lease
                     FROM ranked WHERE NOT first_ready AND NOT ready
                     GROUP BY {aggregate_key}),
                 without_id AS (SELECT row_table, row_tid FROM prefix WHERE {id} IS NULL)",
                created_at_column = created_at.as_ref().map(|c| format!(", {c}")).unwrap_or_default()
            ),
            // No exclusions: `$5` is only there so both rules take the same parameters.
            PollOrder::None => format!(
                "head AS (
                     SELECT {id} AS head_id, tableoid AS row_table, ctid AS row_tid FROM {t}
                     WHERE published_at IS NULL AND dead_at IS NULL {scope_filter} AND available_at <= now()
                       AND (lease_until IS NULL OR lease_until < clock_timestamp()) AND $4::int8 > 0
                       AND cardinality($5::text[]) >= 0
                     ORDER BY {order_by} LIMIT $3 FOR UPDATE SKIP LOCKED),
                 picked AS (SELECT head_id AS picked_id FROM head WHERE head_id IS NOT NULL),
                 blocked AS (SELECT NULL::text AS blocked_key, NULL::float8 AS blocked_for,
                                    NULL::bool AS blocked_by_lease WHERE false),
                 without_id AS (SELECT row_table, row_tid FROM head WHERE head_id IS NULL)"
            ),
        };
        let replay = replayed_column(client, outbox).await?;
        let event_columns = EventColumns::select_list(outbox, &replay);
        // A row whose event id is NULL (a fitted table's nullable column) can never be published, and no
        // statement that names rows by their id reaches it (mark, retry, dead-letter, renew): it is never
        // leased, but dead-lettered here, in place, by its physical address (`tableoid`, `ctid`), with `$6`
        // as its last_error. Locked first with SKIP LOCKED, like every row a claim changes, so that a claim
        // never waits for another session's lock on it.
        //
        // The claim returns, told apart by their first column: the claimed rows ('claimed'), the rows without
        // an event id it dead-lettered ('dead_without_id', the same columns), and one row per blocked
        // aggregate ('blocked'): its key, seconds until it may be claimable and whether a lease holds it, the
        // event's columns NULL.
        let event_nulls =
            "NULL, ".repeat(ClaimColumn::Headers as usize - 1 + outbox.header_columns.len());
        let claim = format!(
            "WITH {picked},
             claimed AS (
                 UPDATE {t} e SET lease_token = $1, lease_until = clock_timestamp() + make_interval(secs => $2::float8),
                                  attempts = coalesce(e.attempts, 0) + 1
                 FROM picked WHERE e.{id} = picked.picked_id
                 RETURNING {event_columns}),
             locked_without_id AS (
                 SELECT tableoid AS locked_table, ctid AS locked_tid FROM {t}
                 WHERE ctid = ANY (ARRAY(SELECT row_tid FROM without_id))
                   AND (tableoid, ctid) IN (SELECT row_table, row_tid FROM without_id)
                   AND {id} IS NULL AND published_at IS NULL AND dead_at IS NULL {scope_filter}
                 FOR UPDATE SKIP LOCKED),
             dead_without_id AS (
                 UPDATE {t} e SET dead_at = now(), last_error = $6::text, lease_token = NULL, lease_until = NULL
                 WHERE e.ctid = ANY (ARRAY(SELECT locked_tid FROM locked_without_id))
                   AND (e.tableoid, e.ctid) IN (SELECT locked_table, locked_tid FROM locked_without_id)
                 RETURNING {event_columns})
             SELECT 'claimed', *, NULL::text, NULL::float8, NULL::bool FROM claimed
             UNION ALL
             SELECT 'dead_without_id', *, NULL::text, NULL::float8, NULL::bool FROM dead_without_id
             UNION ALL
             SELECT 'blocked', {event_nulls}blocked_key, blocked_for, blocked_by_lease FROM blocked"
        );
        let event_id_column = outbox.column(Role::EventId).unwrap_or("event_id");
        let prepare = |sql: String| async move { client.prepare(&sql).await };
        Ok(PollSql {
            claim,
            without_id_error: format!(
                "{event_id_column} is NULL: the row can be neither published nor named by its id (dead-lettered in place); make {event_id_column} NOT NULL"
            ),
            columns: EventColumns::of(outbox),
            serialize_claims: order == PollOrder::PerAggregate,
            table_key: claim_lock_key(outbox),
            former_claim_lock_busy: std::sync::atomic::AtomicBool::new(false),
            mark_published: prepare(format!(
                "UPDATE {t} SET published_at = now(), lease_token = NULL, lease_until = NULL, last_error = NULL
                 WHERE {id} = ANY($1::uuid[]) AND lease_token = $2"
            ))
            .await?,
            retry_later: prepare(format!(
                "UPDATE {t} SET lease_token = NULL, lease_until = NULL, last_error = $3,
                                available_at = now() + make_interval(secs => $4::float8){history}
                 WHERE {id} = $1 AND lease_token = $2",
                history = append_attempt_error(outbox, Counted::Yes),
            ))
            .await?,
            dead_letter: prepare(format!(
                "UPDATE {t} SET lease_token = NULL, lease_until = NULL, last_error = $3, dead_at = now(){history}
                 WHERE {id} = $1 AND lease_token = $2",
                history = append_attempt_error(outbox, Counted::Yes),
            ))
            .await?,
            release: prepare(format!(
                "UPDATE {t} SET lease_token = NULL, lease_until = NULL, attempts = greatest(attempts - 1, 0),
                                last_error = coalesce($3, last_error){history}
                 WHERE {id} = ANY($1::uuid[]) AND lease_token = $2",
                history = append_attempt_error(outbox, Counted::No),
            ))
            .await?,
            renew: prepare(renew_statement(outbox)).await?,
        })
    }

    /// Inside a claim transaction that holds the claim lock: the claim lock in the form earlier versions take
    /// it (`pg_advisory_xact_lock(hashtext(key))`, the bigint keyspace), so that their claims and this
    /// version's never interleave during a rolling upgrade. Best-effort: waited for at most
    /// [`FORMER_CLAIM_LOCK_WAIT`] (never forever behind an application's lock on that bigint); after a wait
    /// given up, claims only ask for it without waiting, until one gets it again.
    async fn take_former_claim_lock(&self, tx: &mut tokio_postgres::Transaction<'_>) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let ask = format!(
            "SELECT {}",
            former_lock_call("pg_try_advisory_xact_lock", "$1")
        );
        if tx
            .query_one(&ask, &[&self.table_key])
            .await?
            .get::<_, bool>(0)
        {
            self.former_claim_lock_busy.store(false, Relaxed);
            return Ok(());
        }
        if self.former_claim_lock_busy.load(Relaxed) {
            return Ok(());
        }
        // A lock wait given up aborts the statement: in a savepoint, so that the claim goes on.
        let waiting = tx.savepoint("former_claim_lock").await?;
        waiting
            .batch_execute(&format!(
                "SET LOCAL lock_timeout = {}",
                FORMER_CLAIM_LOCK_WAIT.as_millis()
            ))
            .await?;
        let wait = format!("SELECT {}", former_lock_call("pg_advisory_xact_lock", "$1"));
        match waiting.execute(&wait, &[&self.table_key]).await {
            Ok(_) => {
                waiting.commit().await?;
                // The SET LOCAL outlives the savepoint: the claim itself keeps the connection's setting.
                tx.batch_execute("SET LOCAL lock_timeout TO DEFAULT")
                    .await?;
            }
            Err(error)
                if error.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
            {
                waiting.rollback().await?;
                self.former_claim_lock_busy.store(true, Relaxed);
                tracing::warn!(
                    key = self.table_key,
                    "the claim lock in the form earlier versions take it (pg_advisory_xact_lock(hashtext(key)), the bigint keyspace applications use too) has been held for {FORMER_CLAIM_LOCK_WAIT:?}, longer than a claim of an earlier version holds it: taken for an application's lock on that bigint, claiming without it (until a claim gets it again, claims of an earlier version's instances are not kept from interleaving with this version's)"
                );
            }
            Err(error) => return Err(error.into()),
        }
        Ok(())
    }

    /// Claims up to `batch` rows under `token` in one short transaction, committed before any Kafka call.
    /// Rows come back in publishing order. Leaves out no aggregate: see [`PollSql::claim_skipping`].
    pub async fn claim(
        &self,
        client: &mut Client,
        token: Uuid,
        lease: std::time::Duration,
        batch: i64,
    ) -> Result<Vec<ClaimedRow>> {
        Ok(self
            .claim_skipping(client, token, lease, batch, &[])
            .await?
            .rows)
    }

    /// [`PollSql::claim`], leaving out every event of the aggregates in `skip` (keys an earlier claim reported
    /// in [`Claim::blocked`]): none of them is claimed, and their rows take no room in the claim's prefix.
    /// Also reports the aggregates this claim found blocked (per-aggregate order only).
    // Long: one claim transaction, and the kinds of row its answer holds told apart in one place.
    pub async fn claim_skipping(
        &self,
        client: &mut Client,
        token: Uuid,
        lease: std::time::Duration,
        batch: i64,
        skip: &[String],
    ) -> Result<Claim> {
        // Leases are measured on the clock (`clock_timestamp()`), not from the transaction's start, so that
        // waiting for the claim lock never shortens them. A claimer that goes silent inside the transaction
        // (holding the claim lock every per-aggregate claimer waits for) is ended by the server.
        let mut tx = client.transaction().await?;
        tx.batch_execute("SET LOCAL idle_in_transaction_session_timeout = '10s'")
            .await?;
        if self.serialize_claims {
            tx.execute(
                &format!("SELECT {}", lock_call("pg_advisory_xact_lock", "$1")),
                &[&self.table_key],
            )
            .await?;
            self.take_former_claim_lock(&mut tx).await?;
        }
        // Wide enough that blocked aggregates not yet in `skip` rarely starve the batch; each row of it costs
        // every claim.
        let prefix = (batch * 4).max(2_000);
        let rows = tx
            .query(
                &self.claim,
                &[
                    &token,
                    &lease.as_secs_f64(),
                    &batch,
                    &prefix,
                    &skip,
                    &self.without_id_error,
                ],
            )
            .await?;
        tx.commit().await?;
        use ClaimColumn as C;
        // After the event's columns and the header columns: a blocked aggregate's key, wait and lease.
        let blocked_key = C::Headers as usize + self.columns.header_columns.len();
        let text = |row: &tokio_postgres::Row, column: usize| row.get::<_, Option<String>>(column);
        let mut blocked = Vec::new();
        let mut dead_without_id = Vec::new();
        let mut claimed: Vec<(Option<i64>, String, ClaimedRow)> = Vec::with_capacity(rows.len());
        for row in &rows {
            match row.get::<_, Option<&str>>(C::Kind as usize) {
                Some("claimed") => claimed.push(self.columns.claimed_row(row)?),
                Some("dead_without_id") => dead_without_id.push(RowWithoutId {
                    aggregate_type: text(row, C::AggregateType as usize),
                    aggregate_id: text(row, C::AggregateId as usize),
                    position: row.get(C::Position as usize),
                }),
                Some("blocked") => {
                    let Some(key) = text(row, blocked_key) else {
                        continue;
                    };
                    let seconds: f64 = row
                        .get::<_, Option<f64>>(blocked_key + 1)
                        .unwrap_or_default();
                    let ready_in =
                        std::time::Duration::try_from_secs_f64(seconds).unwrap_or_default();
                    let leased = row
                        .get::<_, Option<bool>>(blocked_key + 2)
                        .unwrap_or_default();
                    blocked.push(BlockedAggregate {
                        key,
                        ready_in,
                        leased,
                    });
                }
                other => {
                    return Err(crate::error::Error::bug(format!(
                        "the claim returned a row of unknown kind {other:?}"
                    )))
                }
            }
        }
        // Same order as the claim: position (NULLs first), created_at, event_id.
        claimed.sort_by(|a, b| {
            (a.0.is_some(), a.0, &a.1, a.2.event_id).cmp(&(b.0.is_some(), b.0, &b.1, b.2.event_id))
        });
        Ok(Claim {
            rows: claimed.into_iter().map(|(_, _, row)| row).collect(),
            blocked,
            dead_without_id,
        })
    }

    /// Marks the given rows published and ends their lease (only rows still under `token`); returns how many.
    pub async fn mark_published(&self, client: &Client, ids: &[Uuid], token: Uuid) -> Result<u64> {
        Ok(client
            .execute(&self.mark_published, &[&ids, &token])
            .await?)
    }

    /// Ends the lease of a failed row, keeps `error` as `last_error` and makes it claimable after `delay`.
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

    /// Dead-letters a row still under `token` (sets `dead_at`), keeping `error` as `last_error`.
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

    /// Gives rows back at once without counting the attempt: they were never sent, or the broker as a whole
    /// failed them (`error`, kept as `last_error`), which says nothing about the rows.
    pub async fn release(
        &self,
        client: &Client,
        ids: &[Uuid],
        token: Uuid,
        error: Option<&str>,
    ) -> Result<u64> {
        Ok(client
            .execute(&self.release, &[&ids, &token, &error])
            .await?)
    }

    /// Extends the lease of the given claimed rows (those still under `token`).
    pub async fn renew(
        &self,
        client: &Client,
        ids: &[Uuid],
        token: Uuid,
        lease: std::time::Duration,
    ) -> Result<u64> {
        Ok(client
            .execute(&self.renew, &[&token, &lease.as_secs_f64(), &ids])
            .await?)
    }
}

/// The lease renewal: `$1` token, `$2` lease in seconds, `$3` the claimed ids. By primary key: the claimed rows
/// are known, and a lease token alone matches no index.
pub fn renew_statement(outbox: &OutboxTable) -> String {
    format!(
        "UPDATE {} SET lease_until = clock_timestamp() + make_interval(secs => $2::float8)
         WHERE {id} = ANY($3::uuid[]) AND lease_token = $1",
        outbox.name.quoted(),
        id = outbox.col(Role::EventId)
    )
}

/// Prefix of the logical decoding message `outboxd replay` writes in its transaction for every aggregate it
/// re-queues (content: a [`HandOffNotice`] as JSON), so that a CDC leader learns, at that place in WAL order,
/// that the aggregate waits in the polling path (the publication sends inserts only, not the UPDATE).
pub const HANDOFF_MESSAGE: &str = "outboxd.handoff";

/// The content of a [`HANDOFF_MESSAGE`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HandOffNotice {
    /// The outbox table, `schema.name`.
    pub table: String,
    /// As the polling path names it ('' for NULL or without the column).
    pub aggregate_type: String,
    /// As the polling path names it ('' for NULL).
    pub aggregate_id: String,
    /// The aggregate's rows are held (`outboxd replay --published`: not claimable until the stream passed
    /// the hand-back): its later events must go to the polling path, never wait in memory for a release that
    /// waits for the stream. Absent in notices of earlier versions.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
}

/// Prefix of the logical decoding message outboxd writes in the transaction of each hand-off from the CDC
/// path (content: a [`HandedOffNotice`] as JSON), so that a later process meeting one of these events again
/// learns where its hand-off ended: the message's transaction's commit in the stream
/// (`pipeline::cdc::earlier_hand_offs`).
pub const HANDED_OFF_MESSAGE: &str = "outboxd.handed_off";

/// Most event ids in one [`HANDED_OFF_MESSAGE`]: about 39 bytes each as JSON, under the 64 KiB a stream
/// reads of a logical decoding message.
pub const HANDED_OFF_IDS_PER_MESSAGE: usize = 1_000;

/// The content of a [`HANDED_OFF_MESSAGE`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HandedOffNotice {
    /// The outbox table, `schema.name`.
    pub table: String,
    /// The events handed off in this transaction.
    pub event_ids: Vec<Uuid>,
}

/// Names `event_ids`, handed off in `tx`, in [`HANDED_OFF_MESSAGE`]s of the same transaction.
pub async fn name_handed_off_events(
    tx: &tokio_postgres::Transaction<'_>,
    table: &OutboxTable,
    event_ids: &[Uuid],
) -> Result<()> {
    for chunk in event_ids.chunks(HANDED_OFF_IDS_PER_MESSAGE) {
        let notice = HandedOffNotice {
            table: table.name.to_string(),
            event_ids: chunk.to_vec(),
        };
        let content = serde_json::to_string(&notice).map_err(|error| {
            crate::error::Error::bug(format!("cannot write a hand-off's event ids: {error}"))
        })?;
        tx.execute(
            "SELECT pg_logical_emit_message(true, $1, $2)",
            &[&HANDED_OFF_MESSAGE, &content],
        )
        .await?;
    }
    Ok(())
}

/// Re-queues dead events (not rows without an event id, which can never be published): clears `dead_at`,
/// `attempts` and `last_error`, and hands them to the polling path.
/// In the same transaction, a [`HANDOFF_MESSAGE`] per re-queued aggregate tells a CDC leader (when the server
/// decodes logically: `wal_level = logical`) that its later events must wait behind them. Returns how many.
pub async fn replay_dead(
    client: &mut Client,
    table: &OutboxTable,
    filter: &ReplayFilter,
) -> Result<u64> {
    let t = table.name.quoted();
    let id = table.col(Role::EventId);
    let aggregate = aggregate_of_row(table);
    // Handed to the polling path: the slot streamed the row long ago, and next to the CDC path only handed-off
    // rows are swept (a row dead-lettered in poll mode never was). `--mode poll` claims every row regardless.
    // A row without an event id (a fitted table's nullable column) stays dead: it can never be published.
    let base = format!(
        "UPDATE {t} SET dead_at = NULL, attempts = 0, last_error = NULL, available_at = now(),
                        lease_token = NULL, lease_until = NULL, handoff_at = coalesce(handoff_at, now())
         WHERE dead_at IS NOT NULL AND published_at IS NULL AND {id} IS NOT NULL"
    );
    let tx = client.transaction().await?;
    let returning = format!("RETURNING {aggregate}");
    let rows = match filter {
        ReplayFilter::EventId(event_id) => {
            tx.query(&format!("{base} AND {id} = $1 {returning}"), &[event_id])
                .await?
        }
        ReplayFilter::Dead(range) => {
            let at = |time: Option<std::time::SystemTime>| {
                time.map(|t| humantime::format_rfc3339_micros(t).to_string())
            };
            tx.query(
                &format!(
                    "{base} AND ($1::text IS NULL OR {aggregate_id}::text = $1)
                       AND ($2::text IS NULL OR {aggregate_type} = $2)
                       AND ($3::text IS NULL OR dead_at >= $3::timestamptz)
                       AND ($4::text IS NULL OR dead_at < $4::timestamptz) {returning}",
                    aggregate_id = table.col(Role::AggregateId),
                    aggregate_type = table.text_expr(Role::AggregateType, "''::text"),
                ),
                &[
                    &range.aggregate_id,
                    &range.aggregate_type,
                    &at(range.since),
                    &at(range.until),
                ],
            )
            .await?
        }
    };
    notify_hand_offs(&tx, table, &rows, false).await?;
    tx.commit().await?;
    Ok(rows.len() as u64)
}

/// The claim's [`ClaimColumn::ReplayId`]: the id of the replay (or heal) that handed a row back, read from the
/// table migration 0006 made for it while the row's `handoff_at` is still the one it was handed back with (a
/// later hand-off by the CDC path is not a replay). `NULL` where that table is missing (an earlier migrate) or
/// the role may not read it: records then go without the header, as before.
async fn replayed_column(client: &Client, outbox: &OutboxTable) -> Result<String> {
    let replayed = crate::table::replay_tables(&outbox.name).replayed;
    let readable = crate::pg::may_read(client, &replayed).await?;
    Ok(if readable {
        format!(
            "CASE WHEN e.handoff_at IS NOT NULL THEN (SELECT r.replay_id FROM {replayed} r
                  WHERE r.event_id = e.{id} AND r.handed_back_at = e.handoff_at) END",
            id = outbox.col(Role::EventId)
        )
    } else {
        "NULL::text".into()
    })
}

/// Hands published events back to the polling path: `published_at` cleared and `handoff_at` set, so that
/// the polling path publishes them again, each after its aggregate's earlier unpublished events, with a
/// [`HANDOFF_MESSAGE`] per aggregate for a CDC leader (as [`replay_dead`]). Event ids are kept, so inboxes
/// dedupe. Each event is recorded under `replay_id` in the table of replayed events (where migration 0006 made
/// it), so that its record carries the `outboxd-replay` header. `held`: made claimable only by
/// [`release_replay`] (`available_at` infinity), for a replay that first waits for what is already on its way.
/// Returns how many.
pub async fn hand_back_published(
    client: &mut Client,
    table: &OutboxTable,
    event_ids: &[Uuid],
    replay_id: &str,
    held: bool,
) -> Result<u64> {
    let t = table.name.quoted();
    let id = table.col(Role::EventId);
    let aggregate = aggregate_of_row(table);
    let replayed = crate::table::replay_tables(&table.name).replayed;
    let tx = client.transaction().await?;
    let tagged: bool = tx
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&replayed])
        .await?
        .get(0);
    let mut rows = Vec::new();
    // One transaction, however many: a replay's aggregates are handed back whole, and its notices all come
    // before any later event of theirs.
    for chunk in event_ids.chunks(HAND_BACK_CHUNK) {
        let handed = tx
            .query(
                &format!(
                    "WITH before AS (
                         SELECT {id} AS event_id, published_at FROM {t}
                         WHERE {id} = ANY($1) AND published_at IS NOT NULL AND dead_at IS NULL FOR UPDATE)
                     UPDATE {t} e SET published_at = NULL, attempts = 0, last_error = NULL,
                                    available_at = CASE WHEN $2 THEN 'infinity' ELSE now() END,
                                    lease_token = NULL, lease_until = NULL, handoff_at = now()
                     FROM before WHERE e.{id} = before.event_id
                     RETURNING {aggregate}, e.{id}, before.published_at"
                ),
                &[&chunk, &held],
            )
            .await?;
        if tagged {
            let ids: Vec<Uuid> = handed.iter().map(|row| row.get(2)).collect();
            let first_published: Vec<Option<std::time::SystemTime>> =
                handed.iter().map(|row| row.get(3)).collect();
            tx.execute(
                &format!(
                    "INSERT INTO {replayed} (event_id, replay_id, handed_back_at, published_at)
                     SELECT id, $2, now(), at FROM unnest($1::uuid[], $3::timestamptz[]) AS u(id, at)
                     ON CONFLICT (event_id) DO UPDATE SET replay_id = excluded.replay_id,
                                                          handed_back_at = excluded.handed_back_at,
                                                          published_at = excluded.published_at"
                ),
                &[&ids, &replay_id, &first_published],
            )
            .await?;
        }
        rows.extend(handed);
    }
    notify_hand_offs(&tx, table, &rows, held).await?;
    tx.commit().await?;
    Ok(rows.len() as u64)
}

/// Event ids a hand-back names per statement (all in one transaction).
const HAND_BACK_CHUNK: usize = 10_000;

/// `outboxd replay --cancel`: the events `replay_id` still holds (handed back, not yet released) count as
/// published again, as they were before it. Returns how many.
pub async fn cancel_replay(client: &Client, table: &OutboxTable, replay_id: &str) -> Result<u64> {
    let t = table.name.quoted();
    let id = table.col(Role::EventId);
    let replayed = crate::table::replay_tables(&table.name).replayed;
    Ok(client
        .execute(
            &format!(
                "UPDATE {t} e SET published_at = coalesce(r.published_at, now()), available_at = now(),
                                handoff_at = NULL
                 FROM {replayed} r
                 WHERE r.replay_id = $1 AND e.{id} = r.event_id AND e.handoff_at = r.handed_back_at
                   AND e.available_at = 'infinity' AND e.published_at IS NULL AND e.dead_at IS NULL"
            ),
            &[&replay_id],
        )
        .await?)
}

/// Makes the events `replay_id` handed back held ([`hand_back_published`]) claimable: at once, or `rate` per
/// second in their order (`available_at` spread from now). Returns how many.
pub async fn release_replay(
    client: &Client,
    table: &OutboxTable,
    replay_id: &str,
    rate: Option<f64>,
) -> Result<u64> {
    let t = table.name.quoted();
    let id = table.col(Role::EventId);
    let replayed = crate::table::replay_tables(&table.name).replayed;
    let per_second = rate.unwrap_or(f64::INFINITY);
    Ok(client
        .execute(
            &format!(
                "UPDATE {t} e SET available_at = now() + make_interval(secs => (held.n - 1) / $2::float8)
                 FROM (SELECT r.event_id, row_number() OVER (ORDER BY o.position NULLS FIRST, r.event_id) AS n
                       FROM {replayed} r JOIN {t} o ON o.{id} = r.event_id
                       WHERE r.replay_id = $1 AND o.handoff_at = r.handed_back_at
                         AND o.available_at = 'infinity' AND o.published_at IS NULL) AS held
                 WHERE e.{id} = held.event_id"
            ),
            &[&replay_id, &per_second],
        )
        .await?)
}

/// The row's (aggregate type, aggregate id) as two text columns for `RETURNING` (what [`notify_hand_offs`]
/// reads).
fn aggregate_of_row(table: &OutboxTable) -> String {
    format!(
        "coalesce({}, ''), coalesce({}::text, '')",
        table.text_expr(Role::AggregateType, "''::text"),
        table.col(Role::AggregateId)
    )
}

/// In the transaction that hands events to the polling path: a [`HANDOFF_MESSAGE`] per aggregate of `rows`
/// (aggregate type, aggregate id) tells a CDC leader that its later events must wait behind them, when the
/// server decodes logically (`wal_level = logical`).
async fn notify_hand_offs(
    tx: &tokio_postgres::Transaction<'_>,
    table: &OutboxTable,
    rows: &[tokio_postgres::Row],
    held: bool,
) -> Result<()> {
    let logical: bool = tx
        .query_one("SELECT current_setting('wal_level') = 'logical'", &[])
        .await?
        .get(0);
    if !logical {
        return Ok(());
    }
    let aggregates: std::collections::BTreeSet<(String, String)> =
        rows.iter().map(|row| (row.get(0), row.get(1))).collect();
    for (aggregate_type, aggregate_id) in aggregates {
        let notice = HandOffNotice {
            table: table.name.to_string(),
            aggregate_type,
            aggregate_id,
            held,
        };
        let content = serde_json::to_string(&notice).map_err(|error| {
            crate::error::Error::bug(format!("cannot write a hand-off notice: {error}"))
        })?;
        tx.execute(
            "SELECT pg_logical_emit_message(true, $1, $2)",
            &[&HANDOFF_MESSAGE, &content],
        )
        .await?;
    }
    Ok(())
}

/// Which dead events `outboxd replay` re-queues.
#[derive(Debug, Clone)]
pub enum ReplayFilter {
    /// The dead event with this event id.
    EventId(Uuid),
    /// Every dead event `DeadRange` selects.
    Dead(DeadRange),
}

/// Dead events by aggregate and by when they were dead-lettered; every field unset selects them all.
#[derive(Debug, Clone, Default)]
pub struct DeadRange {
    /// Of this aggregate id (of any aggregate type unless `aggregate_type` says).
    pub aggregate_id: Option<String>,
    /// Of this aggregate type.
    pub aggregate_type: Option<String>,
    /// Dead-lettered at or after this time.
    pub since: Option<std::time::SystemTime>,
    /// Dead-lettered before this time.
    pub until: Option<std::time::SystemTime>,
}

/// Whether a failed attempt counts against `--max-attempts`.
#[derive(Clone, Copy)]
enum Counted {
    Yes,
    /// The broker as a whole failed it (the attempt is given back).
    No,
}

/// `, attempt_errors = ...`: appends the failed attempt (its number, when, the error `$3` and whether it
/// counted) to the row's history, keeping the last [`crate::table::ATTEMPT_HISTORY`]; nothing when `$3` is
/// NULL or the table keeps no history (not migrated to 0007). `attempts` is the row's count before the
/// statement: the claim counted this attempt.
fn append_attempt_error(outbox: &OutboxTable, counted: Counted) -> String {
    if !outbox.keeps_attempt_history {
        return String::new();
    }
    let column = crate::table::ATTEMPT_HISTORY_COLUMN;
    let counted = matches!(counted, Counted::Yes);
    let keep = crate::table::ATTEMPT_HISTORY;
    format!(
        ",
         {column} = CASE WHEN $3::text IS NULL THEN {column} ELSE (
             SELECT CASE WHEN jsonb_array_length(h) > {keep} THEN h - 0 ELSE h END
             FROM (SELECT coalesce({column}, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                 'attempt', attempts, 'at', now(), 'error', $3::text, 'counted', {counted}))) AS appended (h)) END"
    )
}
