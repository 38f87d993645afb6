//! What outboxd knows about one outbox table: its name, which column plays each role (`--column`,
//! `--table-style`), which columns become Kafka headers (`--header-column`), and what the database says
//! about it (payload type, polling columns, partitioning). Pure: parsing, and resolving the mapping
//! against the table's real columns; the SQL that reads the table lives in `pg::outbox`, the row mapping of
//! the CDC path in `event`.

use clap::ValueEnum;
use serde::Deserialize;

/// What a column means to outboxd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The event's unique id (a uuid column): the record's event id header.
    EventId,
    /// The aggregate's type: the `aggregate_type` header and `{aggregate_type}` in topics (optional).
    AggregateType,
    /// The aggregate's id: the record key, which keeps one aggregate's events in one partition.
    AggregateId,
    /// The event's type: the `event_type` header and `{event_type}` in topics (optional).
    EventType,
    /// The record value (jsonb, json, text or bytea); NULL publishes a tombstone.
    Payload,
    /// When the event was created: the `created_at` header, RFC 3339 (optional).
    CreatedAt,
}

impl Role {
    /// Every role, in declaration order (the index order of per-role arrays).
    pub const ALL: [Role; 6] = [
        Role::EventId,
        Role::AggregateType,
        Role::AggregateId,
        Role::EventType,
        Role::Payload,
        Role::CreatedAt,
    ];

    /// The role's name, as `--column ROLE=...` and error messages write it (e.g. `aggregate_id`).
    pub fn name(self) -> &'static str {
        match self {
            Role::EventId => "event_id",
            Role::AggregateType => "aggregate_type",
            Role::AggregateId => "aggregate_id",
            Role::EventType => "event_type",
            Role::Payload => "payload",
            Role::CreatedAt => "created_at",
        }
    }

    fn parse(text: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|role| role.name() == text)
    }

    /// A table without this column still works: the header it feeds is left out (and aggregates are keyed
    /// by aggregate_id alone).
    pub fn optional(self) -> bool {
        matches!(
            self,
            Role::AggregateType | Role::EventType | Role::CreatedAt
        )
    }
}

/// Preset column names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TableStyle {
    /// outboxd's table: event_id, aggregate_type, aggregate_id, event_type, payload, created_at.
    #[default]
    Standard,
    /// Debezium's outbox table: id, aggregatetype, aggregateid, type, payload; records carry an `id` header
    /// and go to outbox.event.{aggregate_type}, as Debezium's outbox event router sends them.
    Debezium,
}

impl TableStyle {
    /// The column name this style gives `role` (unless `--column` maps it).
    pub fn column(self, role: Role) -> &'static str {
        match (self, role) {
            (TableStyle::Debezium, Role::EventId) => "id",
            (TableStyle::Debezium, Role::AggregateType) => "aggregatetype",
            (TableStyle::Debezium, Role::AggregateId) => "aggregateid",
            (TableStyle::Debezium, Role::EventType) => "type",
            (_, role) => role.name(),
        }
    }

    /// The topic template used without `--topic`.
    pub fn default_topic(self) -> &'static str {
        match self {
            TableStyle::Standard => "outbox.{aggregate_type}",
            TableStyle::Debezium => "outbox.event.{aggregate_type}",
        }
    }

    /// Name of the header carrying the event id.
    pub fn event_id_header(self) -> &'static str {
        match self {
            TableStyle::Standard => "event_id",
            TableStyle::Debezium => "id",
        }
    }
}

/// How the payload column is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PayloadType {
    /// text: the text, as is.
    #[default]
    Text,
    /// jsonb or json: the JSON text, as is.
    Json,
    /// bytea: the raw bytes.
    Bytes,
}

/// Column types outboxd accepts per role (as `format_type` prints them).
fn accepted_types(role: Role) -> &'static [&'static str] {
    match role {
        Role::EventId => &["uuid"],
        Role::Payload => &["jsonb", "json", "text", "bytea"],
        Role::CreatedAt => &["timestamp with time zone", "timestamp without time zone"],
        _ => &[],
    }
}

/// A type name without its modifier: `timestamp(3) with time zone` -> `timestamp with time zone`.
fn without_modifier(type_name: &str) -> String {
    match (type_name.find('('), type_name.find(')')) {
        (Some(open), Some(close)) if open < close => {
            format!("{}{}", &type_name[..open], &type_name[close + 1..])
        }
        _ => type_name.to_string(),
    }
}

/// Columns the polling path (backfill, sweeper, retries, dead letters) needs; `outboxd migrate
/// --add-polling-columns` adds them.
pub const POLLING_COLUMNS: [&str; 9] = [
    "published_at",
    "available_at",
    "attempts",
    "lease_token",
    "lease_until",
    "last_error",
    "dead_at",
    "handoff_at",
    "position",
];

/// The column where migration 0007 keeps an event's failed attempts (`outboxd dead show`): a JSON array of
/// `{"attempt", "at", "error", "counted"}`, the oldest first. A table without it (not migrated since) keeps
/// only the last error.
pub const ATTEMPT_HISTORY_COLUMN: &str = "attempt_errors";

/// How many failed attempts the history keeps (the oldest go first).
pub const ATTEMPT_HISTORY: usize = 20;

/// The types the polling path reads and writes its columns as (migrate creates the first of each).
const POLLING_COLUMN_TYPES: [(&str, &[&str]); 9] = {
    const TIME: &[&str] = &["timestamp with time zone", "timestamp without time zone"];
    [
        ("published_at", TIME),
        ("available_at", TIME),
        ("attempts", &["integer"]),
        ("lease_token", &["uuid"]),
        ("lease_until", TIME),
        ("last_error", &["text", "character varying"]),
        ("dead_at", TIME),
        ("handoff_at", TIME),
        ("position", &["bigint"]),
    ]
};

/// A schema-qualified table name whose parts are plain identifiers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    /// Schema name.
    pub schema: String,
    /// Table name.
    pub name: String,
}

impl TableName {
    /// `"schema"."name"`, safe to splice into SQL (parts are validated identifiers).
    pub fn quoted(&self) -> String {
        format!("\"{}\".\"{}\"", self.schema, self.name)
    }
}

impl std::fmt::Display for TableName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// An outbox table as configured: its name and column mapping (`--table`, `--table-style`, `--column`,
/// `--header-column`). What the table supports is known only once the database was asked
/// ([`TableSpec::resolve`], done by `pg::slot::inspect`), which makes an [`OutboxTable`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSpec {
    /// The table's schema-qualified name.
    pub name: TableName,
    /// Column per role, in `Role::ALL` order, as mapped.
    columns: [Option<String>; 6],
    /// Roles the user named with `--column` (a missing column is then an error, even for optional roles).
    explicit: [bool; 6],
    /// Columns copied to headers of the same name.
    pub header_columns: Vec<String>,
}

/// One outbox table as the database has it: its mapping resolved against its columns, and what it supports.
/// Made only by [`TableSpec::resolve`] (or [`TableSpec::as_created`], for the table `migrate` creates).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxTable {
    /// The table's schema-qualified name.
    pub name: TableName,
    /// Its mapping as resolved, to inspect it again: an optional role the table lacked stays dropped, so a
    /// column added while outboxd runs does not change what a running outboxd reads.
    spec: TableSpec,
    /// Column per role, in `Role::ALL` order; `None`: the table lacks that optional role.
    columns: [Option<String>; 6],
    /// Columns copied to headers of the same name.
    pub header_columns: Vec<String>,
    /// How the payload column is read.
    pub payload_type: PayloadType,
    /// The table has `published_at`: outboxd records what it published.
    pub marks_published: bool,
    /// The table has every polling column: backfill, sweeper and the polling path work.
    pub polling: bool,
    /// The table has `attempt_errors` (migration 0007): failed attempts are kept there, the last
    /// [`ATTEMPT_HISTORY`] of them.
    pub keeps_attempt_history: bool,
    /// The table is partitioned: the publication must publish via the partition root.
    pub partitioned: bool,
}

/// A mapping that does not fit the table, with the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{problem}")]
pub struct TableMismatch {
    /// What does not fit.
    pub problem: String,
    /// How to make it fit.
    pub fix: String,
}

impl TableSpec {
    /// `overrides` are `--column ROLE=NAME` values; header columns are `--header-column` values.
    pub fn new(
        name: TableName,
        style: TableStyle,
        overrides: &[(Role, String)],
        header_columns: Vec<String>,
    ) -> Self {
        let mut columns = Role::ALL.map(|role| Some(style.column(role).to_string()));
        let mut explicit = [false; 6];
        for (role, column) in overrides {
            let at = *role as usize;
            columns[at] = Some(column.clone());
            explicit[at] = true;
        }
        TableSpec {
            name,
            columns,
            explicit,
            header_columns,
        }
    }

    /// The table as `outboxd migrate` creates it: every mapped column, the polling columns, a `jsonb`
    /// payload, not partitioned.
    pub fn as_created(&self) -> OutboxTable {
        OutboxTable {
            name: self.name.clone(),
            spec: self.clone(),
            columns: self.columns.clone(),
            header_columns: self.header_columns.clone(),
            payload_type: PayloadType::Json,
            marks_published: true,
            polling: true,
            keeps_attempt_history: true,
            partitioned: false,
        }
    }

    /// Checks the mapping against the table's columns (`(name, type)` pairs as `format_type` prints them)
    /// and reads what the table supports. Optional roles whose default column is missing are dropped.
    pub fn resolve(
        &self,
        columns: &[(String, String)],
        partitioned: bool,
    ) -> Result<OutboxTable, TableMismatch> {
        let mut table = self.as_created();
        table.resolve_against(columns, partitioned, &self.explicit)?;
        table.spec.columns = table.columns.clone();
        Ok(table)
    }
}

impl OutboxTable {
    /// Its mapping as resolved (see the field), to inspect it again.
    pub fn spec(&self) -> &TableSpec {
        &self.spec
    }

    /// The column playing `role`; `None` for an optional role the table lacks.
    pub fn column(&self, role: Role) -> Option<&str> {
        self.columns[role as usize].as_deref()
    }

    /// The column playing a required role (always present once the table is resolved).
    pub fn required(&self, role: Role) -> &str {
        self.column(role).unwrap_or(role.name())
    }

    /// The quoted column of a required role, ready for SQL.
    pub fn col(&self, role: Role) -> String {
        format!("\"{}\"", self.required(role))
    }

    /// The column of `role` as text for SQL: the quoted column cast to text, or `fallback` (an SQL text
    /// literal or NULL) when the table lacks the optional role.
    pub fn text_expr(&self, role: Role, fallback: &str) -> String {
        match self.column(role) {
            Some(column) => format!("\"{column}\"::text"),
            None => fallback.to_string(),
        }
    }

    /// The columns outboxd writes back: the polling columns (which include `published_at`), or
    /// `published_at` alone on a table without them, or none.
    pub fn written_columns(&self) -> &'static [&'static str] {
        if self.polling {
            &POLLING_COLUMNS
        } else if self.marks_published {
            &["published_at"]
        } else {
            &[]
        }
    }

    /// Every column outboxd reads: the mapped ones, the header columns and the ones it writes back (its
    /// updates and claims read them too).
    pub fn read_columns(&self) -> Vec<String> {
        let mapped = self.columns.iter().flatten().cloned();
        let written = self.written_columns().iter().map(|c| c.to_string());
        let mut columns: Vec<String> = mapped
            .chain(self.header_columns.iter().cloned())
            .chain(written)
            .collect();
        columns.sort();
        columns.dedup();
        columns
    }

    /// The quoted columns that identify an aggregate: aggregate_type (when the table has it) and
    /// aggregate_id.
    pub fn aggregate_key(&self) -> String {
        match self.column(Role::AggregateType) {
            Some(aggregate_type) => {
                format!("\"{aggregate_type}\", {}", self.col(Role::AggregateId))
            }
            None => self.col(Role::AggregateId),
        }
    }

    /// The quoted columns after `position` that order events (created_at when the table has it, then
    /// event_id), ready for SQL.
    pub fn order_key(&self) -> String {
        match self.column(Role::CreatedAt) {
            Some(created_at) => format!("\"{created_at}\", {}", self.col(Role::EventId)),
            None => self.col(Role::EventId),
        }
    }

    /// See [`TableSpec::resolve`]; `explicit`: the roles named with `--column`.
    fn resolve_against(
        &mut self,
        columns: &[(String, String)],
        partitioned: bool,
        explicit: &[bool; 6],
    ) -> Result<(), TableMismatch> {
        let table = &self.name;
        if columns.is_empty() {
            return Err(TableMismatch {
                problem: format!("the outbox table {table} does not exist"),
                fix: "run `outboxd migrate` (or create it as README shows), or point --table at your outbox table".into(),
            });
        }
        let type_of = |name: &str| {
            columns
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t.as_str())
        };
        for role in Role::ALL {
            let at = role as usize;
            let Some(column) = self.columns[at].clone() else {
                continue;
            };
            let Some(actual) = type_of(&column) else {
                if role.optional() && !explicit[at] {
                    self.columns[at] = None;
                    continue;
                }
                return Err(TableMismatch {
                    problem: format!(
                        "the outbox table {table} has no column {column} (the {} column)",
                        role.name()
                    ),
                    fix: format!(
                        "map the role to your column with --column {}=<column> (or --table-style debezium for Debezium's table), or run `outboxd migrate` on a new table",
                        role.name()
                    ),
                });
            };
            let accepted = accepted_types(role);
            if !accepted.is_empty() && !accepted.contains(&without_modifier(actual).as_str()) {
                return Err(TableMismatch {
                    problem: format!(
                        "column {column} of {table} ({} column) has type {actual}, expected {}",
                        role.name(),
                        accepted.join(" or ")
                    ),
                    fix: format!(
                        "ALTER TABLE {table} ALTER COLUMN {column} TYPE {}",
                        accepted[0]
                    ),
                });
            }
            if role == Role::Payload {
                self.payload_type = match actual {
                    "bytea" => PayloadType::Bytes,
                    "jsonb" | "json" => PayloadType::Json,
                    _ => PayloadType::Text,
                };
            }
        }
        if let Some(missing) = self.header_columns.iter().find(|c| type_of(c).is_none()) {
            return Err(TableMismatch {
                problem: format!("--header-column {missing}: {table} has no such column"),
                fix: format!("add the column to {table} or remove --header-column {missing}"),
            });
        }
        self.marks_published = type_of("published_at").is_some();
        self.polling = POLLING_COLUMNS.iter().all(|c| type_of(c).is_some());
        self.keeps_attempt_history = type_of(ATTEMPT_HISTORY_COLUMN) == Some("jsonb");
        if self.polling {
            // A column of that name the table had before migrate (which adds only missing ones) may have
            // another type, which the polling path cannot read or count with.
            for (column, accepted) in POLLING_COLUMN_TYPES {
                let actual = type_of(column).unwrap_or_default();
                if !accepted.contains(&without_modifier(actual).as_str()) {
                    return Err(TableMismatch {
                        problem: format!(
                            "column {column} of {table} has type {actual}, but the polling path needs {}",
                            accepted.join(" or ")
                        ),
                        fix: format!(
                            "ALTER TABLE {table} ALTER COLUMN {column} TYPE {} (or rename your column and run `outboxd migrate --add-polling-columns`)",
                            accepted[0]
                        ),
                    });
                }
            }
        }
        self.partitioned = partitioned;
        Ok(())
    }
}

/// A `--column` or `--header-column` value, optionally for one table only (`TABLE:...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForTable<T> {
    /// The table as written (`schema.name` or `name`); `None`: every table.
    pub table: Option<String>,
    /// The value itself.
    pub value: T,
}

fn split_table(value: &str) -> (Option<String>, &str) {
    match value.split_once(':') {
        Some((table, rest)) => (Some(table.trim().to_string()), rest),
        None => (None, value),
    }
}

/// `schema.a, schema.b`: the names of `tables`, for messages.
pub fn names<'a>(tables: impl IntoIterator<Item = &'a OutboxTable>) -> String {
    list(tables.into_iter().map(|t| &t.name))
}

/// `schema.a, schema.b`, for messages.
pub fn list<'a>(names: impl IntoIterator<Item = &'a TableName>) -> String {
    names
        .into_iter()
        .map(|name| name.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses `--column [TABLE:]ROLE=COLUMN` values.
pub fn parse_column_overrides(values: &[String]) -> Result<Vec<ForTable<(Role, String)>>, String> {
    values
        .iter()
        .map(|value| {
            let (table, mapping) = split_table(value);
            let (role, column) = mapping.split_once('=').ok_or_else(|| {
                format!("--column {value:?} must be [TABLE:]ROLE=COLUMN, e.g. --column event_id=id")
            })?;
            let role = Role::parse(role.trim()).ok_or_else(|| {
                format!(
                    "--column {value:?}: unknown role {role:?}; roles are {}",
                    Role::ALL.map(Role::name).join(", ")
                )
            })?;
            Ok(ForTable {
                table,
                value: (role, column.trim().to_string()),
            })
        })
        .collect()
}

/// Parses `--header-column [TABLE:]COLUMN` values.
pub fn parse_header_columns(values: &[String]) -> Vec<ForTable<String>> {
    values
        .iter()
        .map(|value| {
            let (table, column) = split_table(value);
            ForTable {
                table,
                value: column.trim().to_string(),
            }
        })
        .collect()
}

#[cfg(test)]
impl OutboxTable {
    /// `public.outbox_event` in the standard style, as the unit tests of other modules need it.
    pub(crate) fn standard_for_tests() -> Self {
        TableSpec::new(
            TableName {
                schema: "public".into(),
                name: "outbox_event".into(),
            },
            TableStyle::Standard,
            &[],
            Vec::new(),
        )
        .as_created()
    }
}

/// The name of an index or sequence of table `bare`: `<bare>_<suffix>`, or, when that would pass PostgreSQL's
/// 63 bytes (which cuts names, so that a long table's sequence and indexes all got one name), `bare` cut to
/// fit plus a hash of it. Names that fit are the ones earlier versions created.
pub fn derived_name(bare: &str, suffix: &str) -> String {
    let plain = format!("{bare}_{suffix}");
    if plain.len() <= 63 {
        return plain;
    }
    let mut keep = 63 - suffix.len() - "_12345678_".len();
    while !bare.is_char_boundary(keep) {
        keep -= 1;
    }
    format!(
        "{}_{:08x}_{suffix}",
        &bare[..keep],
        fnv1a(bare.as_bytes()) as u32
    )
}

/// 64-bit FNV-1a: a fixed, documented hash (std's hasher may change between Rust releases).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The quoted names of the two tables migration 0006 creates next to an outbox table.
pub struct ReplayTables {
    /// Each replay's selection and progress.
    pub progress: String,
    /// The events a replay or heal handed back, with the replay's id.
    pub replayed: String,
}

/// The replay tables of the outbox table `table`, in its schema.
pub fn replay_tables(table: &TableName) -> ReplayTables {
    let schema = format!("\"{}\"", table.schema);
    ReplayTables {
        progress: format!("{schema}.\"{}\"", derived_name(&table.name, "replay")),
        replayed: format!("{schema}.\"{}\"", derived_name(&table.name, "replayed")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(style: TableStyle, overrides: &[(Role, String)]) -> TableSpec {
        TableSpec::new(
            TableName {
                schema: "public".into(),
                name: "outbox".into(),
            },
            style,
            overrides,
            vec![],
        )
    }

    fn columns(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, t)| (n.to_string(), t.to_string()))
            .collect()
    }

    #[test]
    fn debezium_style_maps_debezium_columns_and_drops_missing_created_at() {
        let t = table(TableStyle::Debezium, &[])
            .resolve(
                &columns(&[
                    ("id", "uuid"),
                    ("aggregatetype", "character varying(255)"),
                    ("aggregateid", "character varying(255)"),
                    ("type", "character varying(255)"),
                    ("payload", "jsonb"),
                ]),
                false,
            )
            .unwrap();
        assert_eq!(t.column(Role::EventId), Some("id"));
        assert_eq!(t.column(Role::EventType), Some("type"));
        assert_eq!(t.column(Role::CreatedAt), None);
        assert!(!t.marks_published && !t.polling);
    }

    #[test]
    fn explicit_columns_must_exist_and_types_are_checked() {
        let t = table(
            TableStyle::Standard,
            &[(Role::CreatedAt, "occurred_at".into())],
        );
        let standard = columns(&[
            ("event_id", "uuid"),
            ("aggregate_type", "text"),
            ("aggregate_id", "text"),
            ("event_type", "text"),
            ("payload", "bytea"),
        ]);
        let err = t.resolve(&standard, false).unwrap_err();
        assert!(err.problem.contains("no column occurred_at"), "{err:?}");
        let t = table(TableStyle::Standard, &[])
            .resolve(&standard, false)
            .unwrap();
        assert_eq!(t.payload_type, PayloadType::Bytes);
        let mut with_precision = standard.clone();
        with_precision.push(("created_at".into(), "timestamp(3) with time zone".into()));
        let t = table(TableStyle::Standard, &[])
            .resolve(&with_precision, false)
            .unwrap();
        assert_eq!(t.column(Role::CreatedAt), Some("created_at"));
        let mut bad = standard.clone();
        bad[0].1 = "bigint".into();
        let err = table(TableStyle::Standard, &[])
            .resolve(&bad, false)
            .unwrap_err();
        assert!(err.problem.contains("expected uuid"), "{err:?}");
    }

    #[test]
    fn read_columns_are_the_mapped_ones_and_those_written_back_once_each() {
        let standard = columns(&[
            ("event_id", "uuid"),
            ("aggregate_type", "text"),
            ("aggregate_id", "text"),
            ("event_type", "text"),
            ("payload", "jsonb"),
            ("occurred_at", "timestamp with time zone"),
            ("published_at", "timestamp with time zone"),
        ]);
        let t = table(
            TableStyle::Standard,
            &[(Role::CreatedAt, "occurred_at".into())],
        )
        .resolve(&standard, false)
        .unwrap();
        assert_eq!(t.written_columns(), ["published_at"]);
        let names: Vec<String> = standard.into_iter().map(|(name, _)| name).collect();
        let mut expected = names.clone();
        expected.sort();
        assert_eq!(t.read_columns(), expected);
    }

    #[test]
    fn polling_columns_of_another_type_are_refused_with_the_fix() {
        let mut polling = columns(&[
            ("event_id", "uuid"),
            ("aggregate_type", "text"),
            ("aggregate_id", "text"),
            ("event_type", "text"),
            ("payload", "jsonb"),
            ("created_at", "timestamp with time zone"),
            ("published_at", "timestamp with time zone"),
            ("available_at", "timestamp with time zone"),
            ("attempts", "integer"),
            ("lease_token", "uuid"),
            ("lease_until", "timestamp with time zone"),
            ("last_error", "text"),
            ("dead_at", "timestamp with time zone"),
            ("handoff_at", "timestamp with time zone"),
            ("position", "bigint"),
        ]);
        let t = table(TableStyle::Standard, &[])
            .resolve(&polling, false)
            .unwrap();
        assert!(t.polling);
        for (column, wrong, needed) in [
            ("attempts", "smallint", "integer"),
            ("position", "integer", "bigint"),
        ] {
            let at = polling.iter().position(|(n, _)| n == column).unwrap();
            let right = std::mem::replace(&mut polling[at].1, wrong.into());
            let err = table(TableStyle::Standard, &[])
                .resolve(&polling, false)
                .unwrap_err();
            assert!(
                err.problem.contains(&format!("column {column}")) && err.problem.contains(wrong),
                "{err:?}"
            );
            assert!(
                err.fix
                    .contains(&format!("ALTER COLUMN {column} TYPE {needed}")),
                "{err:?}"
            );
            polling[at].1 = right;
        }
    }

    #[test]
    fn only_event_id_aggregate_id_and_payload_are_required() {
        let t = table(TableStyle::Standard, &[])
            .resolve(
                &columns(&[
                    ("event_id", "uuid"),
                    ("aggregate_id", "bigint"),
                    ("payload", "jsonb"),
                ]),
                false,
            )
            .unwrap();
        assert_eq!(t.column(Role::AggregateType), None);
        assert_eq!(t.column(Role::EventType), None);
        assert_eq!(t.aggregate_key(), "\"aggregate_id\"");
        assert_eq!(t.text_expr(Role::EventType, "NULL::text"), "NULL::text");
        let err = table(TableStyle::Standard, &[])
            .resolve(
                &columns(&[("event_id", "uuid"), ("payload", "jsonb")]),
                false,
            )
            .unwrap_err();
        assert!(err.problem.contains("no column aggregate_id"), "{err:?}");
    }

    #[test]
    fn an_optional_role_the_table_lacked_stays_dropped_when_inspected_again() {
        let without = columns(&[
            ("event_id", "uuid"),
            ("aggregate_id", "text"),
            ("payload", "jsonb"),
        ]);
        let mut with = without.clone();
        with.push(("created_at".into(), "timestamp with time zone".into()));
        let first = table(TableStyle::Standard, &[])
            .resolve(&without, false)
            .unwrap();
        let again = first.spec().resolve(&with, false).unwrap();
        assert_eq!(again.column(Role::CreatedAt), None);
        let fresh = table(TableStyle::Standard, &[])
            .resolve(&with, false)
            .unwrap();
        assert_eq!(fresh.column(Role::CreatedAt), Some("created_at"));
    }

    #[test]
    fn parses_column_overrides() {
        assert_eq!(
            parse_column_overrides(&["event_id=id".into(), "billing.outbox:payload = body".into()])
                .unwrap(),
            vec![
                ForTable {
                    table: None,
                    value: (Role::EventId, "id".into())
                },
                ForTable {
                    table: Some("billing.outbox".into()),
                    value: (Role::Payload, "body".into())
                }
            ]
        );
        assert!(parse_column_overrides(&["eventid=id".into()])
            .unwrap_err()
            .contains("roles are event_id"));
        assert!(parse_column_overrides(&["id".into()])
            .unwrap_err()
            .contains("ROLE=COLUMN"));
    }
}
