//! The outbox event as outboxd publishes it, and the pure mapping from a decoded pgoutput row to it.
//! Columns are found by name (the table's `--column` mapping) in the Relation message, so extra columns
//! and any column order work. Owns no I/O; the SQL-side view of the table lives in `pg::outbox`.

use std::sync::Arc;

use bytes::Bytes;

use crate::pg::pgoutput::{ColumnValue, Insert, Relation};
use crate::table::{OutboxTable, Role};

/// Type OID of bytea: its pgoutput text form is `\x` and hex digits.
const BYTEA_OID: u32 = 17;

/// UTF-8 text sharing the buffer it was read from (a replication message), so mapping a row copies no
/// column; reads as `&str`.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Text(Bytes);

impl Text {
    /// Wraps `bytes` without copying, after checking that they are UTF-8.
    pub fn from_utf8(bytes: Bytes) -> Result<Self, std::str::Utf8Error> {
        std::str::from_utf8(&bytes)?;
        Ok(Text(bytes))
    }

    /// The text, borrowed from the shared buffer.
    pub fn as_str(&self) -> &str {
        // SAFETY: every constructor checks or guarantees UTF-8, and `Bytes` is immutable.
        unsafe { std::str::from_utf8_unchecked(&self.0) }
    }
}

impl std::ops::Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl From<String> for Text {
    fn from(text: String) -> Self {
        Text(Bytes::from(text))
    }
}

impl From<&str> for Text {
    fn from(text: &str) -> Self {
        Text(Bytes::copy_from_slice(text.as_bytes()))
    }
}

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// One outbox row, ready to become a Kafka record. Text fields are UTF-8 as sent by the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// Lowercase canonical UUID text.
    pub event_id: Text,
    /// `None` when the table has no aggregate_type column.
    pub aggregate_type: Option<Text>,
    /// The record key.
    pub aggregate_id: Text,
    /// `None` when the table has no event_type column, or it is NULL.
    pub event_type: Option<Text>,
    /// The payload as stored (JSON or text as is, bytea as raw bytes); `None` (a NULL payload) publishes a
    /// tombstone.
    pub payload: Option<Bytes>,
    /// RFC 3339; `None` when the table has no created_at column.
    pub created_at: Option<Text>,
    /// `--header-column` values that are not NULL, as (header name, text).
    pub headers: Vec<(Arc<str>, Text)>,
    /// The replay (or heal) that republishes this event, if one does: its records carry it in the
    /// `outboxd-replay` header. Set only by the polling path.
    pub replay: Option<Text>,
}

impl OutboxEvent {
    /// Approximate size in memory, for the in-flight byte budget.
    pub fn size_bytes(&self) -> usize {
        self.event_id.len()
            + self.aggregate_type.as_ref().map_or(0, |t| t.len())
            + self.aggregate_id.len()
            + self.event_type.as_ref().map_or(0, |t| t.len())
            + self.payload.as_ref().map_or(0, Bytes::len)
            + self.created_at.as_ref().map_or(0, |t| t.len())
            + self.replay.as_ref().map_or(0, |t| t.len())
            + self
                .headers
                .iter()
                .map(|(_, v)| v.len() + 16)
                .sum::<usize>()
            + 64
    }
}

/// Why an outbox table's relation or row cannot become an [`OutboxEvent`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MappingError {
    /// The relation lacks a column the table's mapping names.
    #[error(
        "table {table} has no column {column:?} (its {role} column); map your column with --column {role}=<column>, or run `outboxd migrate` to create the standard table"
    )]
    MissingColumn {
        /// The outbox table, `schema.name`.
        table: String,
        /// The column name the mapping expects.
        column: String,
        /// The role that column plays (e.g. `aggregate_id`), or `header`.
        role: &'static str,
    },
    /// A row's value count differs from its relation's column count.
    #[error("row of {table} has {got} values but its relation has {expected} columns")]
    ColumnCountMismatch {
        /// The outbox table, `schema.name`.
        table: String,
        /// Columns of the relation.
        expected: usize,
        /// Values in the row.
        got: usize,
    },
    /// A NULL where outboxd needs a value (event_id, aggregate_type or aggregate_id).
    #[error("row {event_id} of {table}: the {column} column is NULL; outboxd cannot publish an event without it")]
    NullValue {
        /// The outbox table, `schema.name`.
        table: String,
        /// The row's event id as text; empty when the event id itself is NULL.
        event_id: String,
        /// The role of the NULL column.
        column: &'static str,
    },
    /// A text column or header column holds bytes that are not UTF-8.
    #[error("row of {table}: the {column} column is not valid UTF-8 text")]
    NotUtf8 {
        /// The outbox table, `schema.name`.
        table: String,
        /// The role of the column (e.g. `aggregate_id`), or `header`.
        column: &'static str,
    },
    /// A bytea payload that is not in hex output form (`\x...`).
    #[error("row of {table}: the bytea payload is not in hex form")]
    BadBytea {
        /// The outbox table, `schema.name`.
        table: String,
    },
}

/// A row as the stream carried its insert: every published column's name and text value. An event keeps it
/// on its way to the polling path, so that one whose row is gone (deleted by its own transaction) can be
/// written back as a handed-off row. Shares the replication message's buffer (no column is copied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowImage {
    /// Column names, in the relation's order.
    pub columns: Arc<[Arc<str>]>,
    /// The values, one per column.
    pub values: Vec<ColumnValue>,
}

/// Where each role's column and each header column sit in a relation's tuples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowMapping {
    /// The outbox table, `schema.name` as the relation names it, for errors.
    pub table: String,
    column_count: usize,
    /// The relation's column names, shared by the [`RowImage`]s of its rows.
    column_names: Arc<[Arc<str>]>,
    /// The `handoff_at` column of a table with the polling columns: a row inserted with it set was handed
    /// to the polling path by outboxd (written back, or re-queued by `outboxd replay`).
    handoff_at: Option<usize>,
    /// Index per role (`Role::ALL` order); `None` for an optional role the table lacks.
    columns: [Option<usize>; 6],
    payload_is_bytea: bool,
    headers: Vec<(Arc<str>, usize)>,
}

impl RowMapping {
    /// Finds each mapped role's column and each header column by name in a Relation message.
    pub fn from_relation(outbox: &OutboxTable, relation: &Relation) -> Result<Self, MappingError> {
        let table = format!("{}.{}", relation.namespace, relation.name);
        let position = |column: &str, role: &'static str| {
            relation
                .columns
                .iter()
                .position(|c| c.name == column)
                .ok_or_else(|| MappingError::MissingColumn {
                    table: table.clone(),
                    column: column.to_string(),
                    role,
                })
        };
        let mut columns = [None; 6];
        for (slot, role) in columns.iter_mut().zip(Role::ALL) {
            *slot = match outbox.column(role) {
                Some(column) => Some(position(column, role.name())?),
                None => None,
            };
        }
        let headers = outbox
            .header_columns
            .iter()
            .map(|column| Ok((Arc::from(column.as_str()), position(column, "header")?)))
            .collect::<Result<_, _>>()?;
        let payload = columns[Role::Payload as usize].unwrap_or_default();
        let handoff_at = outbox
            .polling
            .then(|| relation.columns.iter().position(|c| c.name == "handoff_at"))
            .flatten();
        Ok(RowMapping {
            payload_is_bytea: relation.columns.get(payload).map(|c| c.type_oid) == Some(BYTEA_OID),
            table,
            column_count: relation.columns.len(),
            column_names: relation
                .columns
                .iter()
                .map(|c| Arc::from(c.name.as_str()))
                .collect(),
            handoff_at,
            columns,
            headers,
        })
    }

    /// The inserted row as it was written (see [`RowImage`]).
    pub fn image(&self, insert: Insert) -> RowImage {
        RowImage {
            columns: self.column_names.clone(),
            values: insert.values,
        }
    }

    /// True when the row was inserted already handed to the polling path (`handoff_at` set): outboxd wrote
    /// it back, or `outboxd replay` re-queued it. The polling path publishes it, never the stream.
    pub fn inserted_handed_off(&self, insert: &Insert) -> bool {
        self.handoff_at
            .and_then(|at| insert.values.get(at))
            .is_some_and(|value| value.as_text().is_some())
    }

    /// The row's aggregate as the polling path names it (a NULL reads as ''), without mapping the row.
    pub fn aggregate_key(&self, insert: &Insert) -> (String, String) {
        let text = |role: Role| {
            self.columns[role as usize]
                .and_then(|at| insert.values.get(at))
                .and_then(ColumnValue::as_text)
                .map(|bytes| String::from_utf8_lossy(bytes).into_owned())
                .unwrap_or_default()
        };
        (text(Role::AggregateType), text(Role::AggregateId))
    }

    /// Maps one inserted row of this relation to an event.
    pub fn event(&self, insert: &Insert) -> Result<OutboxEvent, MappingError> {
        if insert.values.len() != self.column_count {
            return Err(MappingError::ColumnCountMismatch {
                table: self.table.clone(),
                expected: self.column_count,
                got: insert.values.len(),
            });
        }
        let raw = |at: usize| -> Option<&Bytes> { insert.values[at].as_text() };
        let utf8 = |bytes: &Bytes, column: &'static str| {
            Text::from_utf8(bytes.clone()).map_err(|_| MappingError::NotUtf8 {
                table: self.table.clone(),
                column,
            })
        };
        // The role's text; `None` when the table lacks the role, or the value is NULL where that is allowed.
        let text = |role: Role| -> Result<Option<Text>, MappingError> {
            let Some(at) = self.columns[role as usize] else {
                return Ok(None);
            };
            match raw(at) {
                Some(bytes) => utf8(bytes, role.name()).map(Some),
                // A nullable event_type or created_at column: no header.
                None if matches!(role, Role::EventType | Role::CreatedAt) => Ok(None),
                None => Err(MappingError::NullValue {
                    table: self.table.clone(),
                    event_id: self.columns[Role::EventId as usize]
                        .and_then(raw)
                        .map(|b| String::from_utf8_lossy(b).into_owned())
                        .unwrap_or_default(),
                    column: role.name(),
                }),
            }
        };
        let required = |role: Role| text(role).map(Option::unwrap_or_default);
        let payload = match self.columns[Role::Payload as usize].and_then(raw) {
            Some(bytes) if self.payload_is_bytea => Some(decode_bytea_hex(bytes).ok_or_else(
                || MappingError::BadBytea {
                    table: self.table.clone(),
                },
            )?),
            Some(bytes) => Some(bytes.clone()),
            None => None,
        };
        let mut headers = Vec::new();
        for (name, at) in &self.headers {
            if let Some(bytes) = raw(*at) {
                headers.push((name.clone(), utf8(bytes, "header")?));
            }
        }
        Ok(OutboxEvent {
            event_id: required(Role::EventId)?,
            aggregate_type: text(Role::AggregateType)?,
            aggregate_id: required(Role::AggregateId)?,
            event_type: text(Role::EventType)?,
            payload,
            created_at: text(Role::CreatedAt)?.map(|t| Text::from(to_rfc3339(&t))),
            headers,
            replay: None,
        })
    }
}

/// Decodes bytea's hex output (`\x0a1b...`) to the raw bytes.
pub fn decode_bytea_hex(text: &[u8]) -> Option<Bytes> {
    let hex = text.strip_prefix(b"\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect::<Option<Vec<u8>>>()
        .map(Bytes::from)
}

/// Converts PostgreSQL's ISO `timestamptz` text (`2026-11-30 05:02:15.123456+00`, `...+05:30`) to RFC 3339
/// (`2026-11-30T05:02:15.123456Z`, `...+05:30`). A `timestamp` without time zone is taken as UTC. Text it
/// does not recognise is returned unchanged.
pub fn to_rfc3339(pg_text: &str) -> String {
    let Some((date, time)) = pg_text.split_once(' ') else {
        return pg_text.to_string();
    };
    let (clock, offset) = match time.rfind(['+', '-']) {
        Some(sign_at) => time.split_at(sign_at),
        None if time.starts_with(|c: char| c.is_ascii_digit()) => (time, "+00"),
        None => return pg_text.to_string(),
    };
    let mut rfc3339 = String::with_capacity(pg_text.len() + 3);
    rfc3339.push_str(date);
    rfc3339.push('T');
    rfc3339.push_str(clock);
    match offset {
        "+00" | "-00" | "+00:00" => rfc3339.push('Z'),
        o if o.len() == 3 => {
            rfc3339.push_str(o);
            rfc3339.push_str(":00");
        }
        // Offsets with seconds (+05:53:28) have no RFC 3339 form; drop the seconds.
        o if o.len() == 9 => rfc3339.push_str(&o[..6]),
        o => rfc3339.push_str(o),
    }
    rfc3339
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pg::pgoutput::tests::text;
    use crate::pg::pgoutput::ColumnValue;
    use crate::table::TableStyle;

    fn standard() -> OutboxTable {
        OutboxTable::standard_for_tests()
    }

    const STANDARD_COLUMNS: [&str; 6] = [
        "event_id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "payload",
        "created_at",
    ];

    fn relation(names: &[&str]) -> Relation {
        crate::pg::pgoutput::tests::relation(1, "outbox_event", names)
    }

    #[test]
    fn maps_columns_by_name_in_any_order_with_extras() {
        let rel = relation(&[
            "tenant",
            "payload",
            "created_at",
            "event_type",
            "aggregate_id",
            "attempts",
            "aggregate_type",
            "event_id",
        ]);
        let mut table = standard();
        table.header_columns = vec!["tenant".into()];
        let mapping = RowMapping::from_relation(&table, &rel).unwrap();
        let insert = Insert {
            relation_id: 1,
            values: vec![
                text("acme"),
                text(r#"{"a":1}"#),
                text("2026-11-30 05:02:15.5+00"),
                text("OrderCreated"),
                text("order-7"),
                text("0"),
                text("Order"),
                text("0b7d6f0e-8f3c-4c1b-9d6e-1f2a3b4c5d6e"),
            ],
        };
        let event = mapping.event(&insert).unwrap();
        assert_eq!(event.event_id, "0b7d6f0e-8f3c-4c1b-9d6e-1f2a3b4c5d6e");
        assert_eq!(event.aggregate_type.unwrap(), "Order");
        assert_eq!(event.aggregate_id, "order-7");
        assert_eq!(event.event_type.unwrap(), "OrderCreated");
        assert_eq!(event.payload.as_deref(), Some(&br#"{"a":1}"#[..]));
        assert_eq!(event.created_at.unwrap(), "2026-11-30T05:02:15.5Z");
        assert_eq!(
            event.headers,
            vec![(Arc::from("tenant"), Text::from("acme"))]
        );
    }

    #[test]
    fn maps_a_captured_pg15_row() {
        use crate::pg::pgoutput::{decode, tests::unhex, tests::CAPTURED_PG15, PgOutputMessage};
        let PgOutputMessage::Relation(rel) = decode(unhex(CAPTURED_PG15[1])).unwrap() else {
            panic!()
        };
        let PgOutputMessage::Insert(insert) = decode(unhex(CAPTURED_PG15[2])).unwrap() else {
            panic!()
        };
        let event = RowMapping::from_relation(&standard(), &rel)
            .unwrap()
            .event(&insert)
            .unwrap();
        assert_eq!(event.event_id, "0b7d6f0e-8f3c-4c1b-9d6e-1f2a3b4c5d6e");
        assert_eq!(event.aggregate_id, "order-1");
        assert_eq!(event.payload.as_deref(), Some(&br#"{"total": 12.5}"#[..]));
        assert_eq!(event.created_at.unwrap(), "2026-11-30T05:11:33.435734Z");
    }

    #[test]
    fn missing_column_is_named() {
        let err = RowMapping::from_relation(
            &standard(),
            &relation(&["event_id", "aggregate_type", "payload"]),
        )
        .unwrap_err();
        assert_eq!(
            err,
            MappingError::MissingColumn {
                table: "public.outbox_event".into(),
                column: "aggregate_id".into(),
                role: "aggregate_id",
            }
        );
        assert!(err.to_string().contains("outboxd migrate"));
    }

    #[test]
    fn null_required_value_is_an_error() {
        let mapping = RowMapping::from_relation(&standard(), &relation(&STANDARD_COLUMNS)).unwrap();
        let insert = Insert {
            relation_id: 1,
            values: vec![
                text("id"),
                text("A"),
                ColumnValue::Null,
                text("E"),
                text("{}"),
                text("2026-01-01 00:00:00+00"),
            ],
        };
        assert!(matches!(
            mapping.event(&insert),
            Err(MappingError::NullValue {
                column: "aggregate_id",
                ..
            })
        ));
        let short = Insert {
            relation_id: 1,
            values: vec![text("id")],
        };
        assert!(matches!(
            mapping.event(&short),
            Err(MappingError::ColumnCountMismatch { .. })
        ));
    }

    #[test]
    fn debezium_table_without_created_at_bytea_payload_and_null_payload() {
        let spec = crate::table::TableSpec::new(
            crate::table::TableName {
                schema: "public".into(),
                name: "outboxevent".into(),
            },
            TableStyle::Debezium,
            &[],
            vec!["traceparent".into()],
        );
        let mut rel = relation(&[
            "id",
            "aggregatetype",
            "aggregateid",
            "type",
            "payload",
            "traceparent",
        ]);
        rel.columns[4].type_oid = BYTEA_OID;
        let types = [
            ("id", "uuid"),
            ("aggregatetype", "text"),
            ("aggregateid", "text"),
            ("type", "text"),
            ("payload", "bytea"),
            ("traceparent", "text"),
        ];
        let columns: Vec<(String, String)> = types
            .iter()
            .map(|(n, t)| (n.to_string(), t.to_string()))
            .collect();
        let table = spec.resolve(&columns, false).unwrap();
        let mapping = RowMapping::from_relation(&table, &rel).unwrap();
        let row = |payload: ColumnValue| Insert {
            relation_id: 1,
            values: vec![
                text("0b7d6f0e-8f3c-4c1b-9d6e-1f2a3b4c5d6e"),
                text("Order"),
                text("o-1"),
                text("Created"),
                payload,
                ColumnValue::Null,
            ],
        };
        let event = mapping.event(&row(text("\\x00ff41"))).unwrap();
        assert_eq!(event.payload.as_deref(), Some(&[0u8, 0xff, 0x41][..]));
        assert_eq!(event.created_at, None);
        assert!(event.headers.is_empty(), "NULL header column: no header");
        let tombstone = mapping.event(&row(ColumnValue::Null)).unwrap();
        assert_eq!(tombstone.payload, None);
        assert!(matches!(
            mapping.event(&row(text("00ff"))),
            Err(MappingError::BadBytea { .. })
        ));
    }

    #[test]
    fn converts_timestamps_to_rfc3339() {
        assert_eq!(
            to_rfc3339("2026-11-30 05:02:15.123456+00"),
            "2026-11-30T05:02:15.123456Z"
        );
        assert_eq!(
            to_rfc3339("2026-11-30 05:02:15+05:30"),
            "2026-11-30T05:02:15+05:30"
        );
        assert_eq!(
            to_rfc3339("2026-11-30 05:02:15-08"),
            "2026-11-30T05:02:15-08:00"
        );
        assert_eq!(
            to_rfc3339("1850-01-01 00:00:00+00:53:28"),
            "1850-01-01T00:00:00+00:53"
        );
        assert_eq!(to_rfc3339("infinity"), "infinity");
        assert_eq!(
            to_rfc3339("2026-11-30 05:02:15.5"),
            "2026-11-30T05:02:15.5Z",
            "timestamp without time zone: UTC"
        );
    }

    #[test]
    fn text_shares_the_buffer_and_checks_utf8() {
        let message = Bytes::from_static(b"order-7 and more");
        let text = Text::from_utf8(message.slice(0..7)).unwrap();
        assert_eq!(text, "order-7");
        assert_eq!(text.as_ptr(), message.as_ptr(), "no copy");
        assert!(Text::from_utf8(Bytes::from_static(b"\xff\xfe")).is_err());
    }
}
