//! Dead letters an operator can look at: `outboxd dead list` and `outboxd dead show` (reads only). Owns the
//! queries and their text form; re-queuing dead events is `outboxd replay` (`pg::outbox::replay_dead`), and
//! the `outboxd_dead_events` gauge is the stats task's.

use serde::Serialize;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::error::Result;
use crate::table::{OutboxTable, Role};

/// One dead event, as `dead list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadEvent {
    /// The outbox table, `schema.name`.
    pub table: String,
    /// NULL only on a fitted table whose event id column allows it.
    pub event_id: Option<Uuid>,
    /// '' when the table has no aggregate type, or it is NULL.
    pub aggregate_type: String,
    /// The aggregate's id, as text ('' for NULL).
    pub aggregate_id: String,
    /// `None` without an event type column.
    pub event_type: Option<String>,
    /// When it was dead-lettered, RFC 3339 in UTC.
    pub dead_at: String,
    /// Publish attempts before it was dead-lettered.
    pub attempts: i32,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// Events of its aggregate not published yet (a dead event does not hold them back: replaying it
    /// publishes it after every later event of its aggregate published meanwhile).
    pub unpublished_of_aggregate: i64,
}

/// Which dead events `dead list` shows.
#[derive(Debug, Clone, Default)]
pub struct DeadFilter {
    /// Only events of this aggregate type.
    pub aggregate_type: Option<String>,
    /// Only events of this aggregate id.
    pub aggregate_id: Option<String>,
    /// Dead-lettered at or after this time.
    pub since: Option<std::time::SystemTime>,
    /// At most this many, the most recently dead-lettered first.
    pub limit: i64,
}

/// The columns of a [`DeadEvent`] from the row aliased `d` of `table`, in field order after `table`.
fn dead_event_columns(table: &OutboxTable) -> String {
    let t = table.name.quoted();
    let key = table.aggregate_key();
    let later_key: Vec<String> = key
        .split(", ")
        .map(|column| format!("l.{column} IS NOT DISTINCT FROM d.{column}"))
        .collect();
    format!(
        "d.{id}, coalesce({aggregate_type}, ''), coalesce(d.{aggregate_id}::text, ''), {event_type},
         to_char(d.dead_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), d.attempts, d.last_error,
         (SELECT count(*) FROM {t} l WHERE {later} AND l.published_at IS NULL AND l.dead_at IS NULL)",
        id = table.col(Role::EventId),
        aggregate_type = prefixed(table.text_expr(Role::AggregateType, "NULL::text")),
        aggregate_id = table.col(Role::AggregateId),
        event_type = prefixed(table.text_expr(Role::EventType, "NULL::text")),
        later = later_key.join(" AND "),
    )
}

/// A column expression of [`OutboxTable::text_expr`] read from the row aliased `d`.
fn prefixed(expression: String) -> String {
    if expression.starts_with('"') {
        format!("d.{expression}")
    } else {
        expression
    }
}

fn dead_event(table: &OutboxTable, row: &tokio_postgres::Row) -> DeadEvent {
    DeadEvent {
        table: table.name.to_string(),
        event_id: row.get(0),
        aggregate_type: row.get(1),
        aggregate_id: row.get(2),
        event_type: row.get(3),
        dead_at: row.get(4),
        attempts: row.get(5),
        last_error: row.get(6),
        unpublished_of_aggregate: row.get(7),
    }
}

/// The dead events of `table` that `filter` selects, the most recently dead-lettered first.
pub async fn list(
    client: &Client,
    table: &OutboxTable,
    filter: &DeadFilter,
) -> Result<Vec<DeadEvent>> {
    let since = filter.since.map(rfc3339);
    let statement = format!(
        "SELECT {columns} FROM {t} d
         WHERE d.dead_at IS NOT NULL AND d.published_at IS NULL
           AND ($1::text IS NULL OR {aggregate_type} = $1)
           AND ($2::text IS NULL OR d.{aggregate_id}::text = $2)
           AND ($3::text IS NULL OR d.dead_at >= $3::timestamptz)
         ORDER BY d.dead_at DESC LIMIT $4",
        columns = dead_event_columns(table),
        t = table.name.quoted(),
        aggregate_type = prefixed(table.text_expr(Role::AggregateType, "''::text")),
        aggregate_id = table.col(Role::AggregateId),
    );
    let rows = client
        .query(
            &statement,
            &[
                &filter.aggregate_type,
                &filter.aggregate_id,
                &since,
                &filter.limit,
            ],
        )
        .await?;
    Ok(rows.iter().map(|row| dead_event(table, row)).collect())
}

/// One dead event of `table` and its whole row as JSON; `None` when no dead event has this id there.
pub async fn show(
    client: &Client,
    table: &OutboxTable,
    event_id: Uuid,
) -> Result<Option<(DeadEvent, serde_json::Value)>> {
    let statement = format!(
        "SELECT {columns}, to_jsonb(d)::text FROM {t} d
         WHERE d.{id} = $1 AND d.dead_at IS NOT NULL AND d.published_at IS NULL",
        columns = dead_event_columns(table),
        t = table.name.quoted(),
        id = table.col(Role::EventId),
    );
    let Some(row) = client.query_opt(&statement, &[&event_id]).await? else {
        return Ok(None);
    };
    let whole: String = row.get(8);
    let whole = serde_json::from_str(&whole).unwrap_or(serde_json::Value::String(whole));
    Ok(Some((dead_event(table, &row), whole)))
}

/// RFC 3339 in UTC, for a `timestamptz` parameter given as text.
fn rfc3339(at: std::time::SystemTime) -> String {
    humantime::format_rfc3339_micros(at).to_string()
}

/// Pure: `dead list` as text, one event per line, with what to do.
pub fn to_text(events: &[DeadEvent], limit: i64) -> String {
    if events.is_empty() {
        return "no dead events\n".into();
    }
    let mut text = String::new();
    for event in events {
        let id = event
            .event_id
            .map_or_else(|| "(no event id)".to_string(), |id| id.to_string());
        let aggregate = if event.aggregate_type.is_empty() {
            event.aggregate_id.clone()
        } else {
            format!("{}/{}", event.aggregate_type, event.aggregate_id)
        };
        text.push_str(&format!(
            "{dead_at}  {id}  {aggregate}  {event_type}  attempts={attempts}  unpublished_of_aggregate={waiting}  {table}\n    {error}\n",
            dead_at = event.dead_at,
            event_type = event.event_type.as_deref().unwrap_or("-"),
            attempts = event.attempts,
            waiting = event.unpublished_of_aggregate,
            table = event.table,
            error = one_line(event.last_error.as_deref().unwrap_or("(no error recorded)")),
        ));
    }
    if events.len() as i64 >= limit {
        text.push_str(&format!(
            "(the {limit} most recent; --limit shows more, --aggregate-id or --since fewer)\n"
        ));
    }
    text.push_str(
        "outboxd dead show EVENT_ID: the whole row; outboxd replay --event-id ID (or --aggregate-id, --all-dead): publish again\n",
    );
    text
}

/// Pure: `dead show` as text.
pub fn show_text(event: &DeadEvent, row: &serde_json::Value) -> String {
    let pretty = serde_json::to_string_pretty(row).unwrap_or_default();
    format!(
        "dead event {id} of {table}\n  aggregate: {aggregate_type} {aggregate_id}\n  event type: {event_type}\n  dead since: {dead_at} after {attempts} attempt(s)\n  last error: {error}\n  unpublished events of its aggregate: {waiting}\n{history}row:\n{pretty}\nto publish it again: outboxd replay --event-id {id}\n",
        history = attempt_history_text(row),
        id = event.event_id.map(|id| id.to_string()).unwrap_or_default(),
        table = event.table,
        aggregate_type = event.aggregate_type,
        aggregate_id = event.aggregate_id,
        event_type = event.event_type.as_deref().unwrap_or("-"),
        dead_at = event.dead_at,
        attempts = event.attempts,
        error = one_line(event.last_error.as_deref().unwrap_or("(no error recorded)")),
        waiting = event.unpublished_of_aggregate,
    )
}

/// The failed attempts the row keeps (migration 0007), one per line, the oldest first; '' without any.
fn attempt_history_text(row: &serde_json::Value) -> String {
    let Some(attempts) = row[crate::table::ATTEMPT_HISTORY_COLUMN]
        .as_array()
        .filter(|a| !a.is_empty())
    else {
        return String::new();
    };
    let mut text = format!(
        "  failed attempts (the last {}, oldest first; replays start the count again):\n",
        crate::table::ATTEMPT_HISTORY
    );
    for attempt in attempts {
        let counted = if attempt["counted"] == false {
            "  (not counted: the broker as a whole failed it)"
        } else {
            ""
        };
        text.push_str(&format!(
            "    #{}  {}  {}{counted}\n",
            attempt["attempt"],
            attempt["at"].as_str().unwrap_or("-"),
            one_line(attempt["error"].as_str().unwrap_or("-")),
        ));
    }
    text
}

/// Control characters (a newline in an error) shown escaped, so one event stays on its lines.
fn one_line(text: &str) -> String {
    crate::logging::escape_controls(text).replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> DeadEvent {
        DeadEvent {
            table: "public.outbox_event".into(),
            event_id: Some(Uuid::from_u128(7)),
            aggregate_type: "Order".into(),
            aggregate_id: "o-1".into(),
            event_type: Some("OrderPlaced".into()),
            dead_at: "2026-12-07T08:00:00.000000Z".into(),
            attempts: 1,
            last_error: Some("Message size too large\nsecond line".into()),
            unpublished_of_aggregate: 2,
        }
    }

    #[test]
    fn the_list_names_each_event_its_error_on_one_line_and_what_to_do() {
        let text = to_text(&[event()], 50);
        assert!(text.contains("00000000-0000-0000-0000-000000000007  Order/o-1  OrderPlaced  attempts=1  unpublished_of_aggregate=2"), "{text}");
        assert!(
            text.contains("Message size too large\\nsecond line"),
            "{text}"
        );
        assert!(text.contains("outboxd replay --event-id"), "{text}");
        assert!(!text.contains("--limit shows more"), "{text}");
        assert!(to_text(&[event()], 1).contains("--limit shows more"));
        assert_eq!(to_text(&[], 50), "no dead events\n");
    }

    #[test]
    fn show_prints_the_row_and_the_replay_command() {
        let row =
            serde_json::json!({"event_id": "00000000-0000-0000-0000-000000000007", "attempts": 1});
        let text = show_text(&event(), &row);
        assert!(
            text.contains("dead since: 2026-12-07T08:00:00.000000Z after 1 attempt(s)"),
            "{text}"
        );
        assert!(text.contains("\"attempts\": 1"), "{text}");
        assert!(
            !text.contains("failed attempts"),
            "no history, no section: {text}"
        );
    }

    #[test]
    fn show_lists_the_failed_attempts_oldest_first() {
        let row = serde_json::json!({"event_id": "00000000-0000-0000-0000-000000000007", "attempts": 2,
            "attempt_errors": [
                {"attempt": 1, "at": "2026-12-07T10:00:00+00:00", "error": "Broker: timed out", "counted": false},
                {"attempt": 2, "at": "2026-12-07T10:00:05+00:00", "error": "Message size\ntoo large", "counted": true}]});
        let text = show_text(&event(), &row);
        let first = text
            .find("#1  2026-12-07T10:00:00+00:00  Broker: timed out  (not counted")
            .expect(&text);
        let second = text
            .find("#2  2026-12-07T10:00:05+00:00  Message size\\ntoo large\n")
            .expect(&text);
        assert!(first < second, "{text}");
        assert!(
            text.contains("outboxd replay --event-id 00000000-0000-0000-0000-000000000007"),
            "{text}"
        );
    }
}
