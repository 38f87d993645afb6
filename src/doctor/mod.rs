//! `outboxd doctor`: every check outboxd makes before it runs, and those operators otherwise learn the hard
//! way, in one place that reads top to bottom: the configuration against the tables, then PostgreSQL
//! (`postgres`), then Kafka (`kafka`), each check a small function with its fix, findings collected in a
//! `report` rather than stopping at the first. `run` gives its start-up the same checks (the ones that
//! must pass stop it; the rest are logged as warnings). Owns no state and changes nothing.

pub mod kafka;
pub mod postgres;
pub mod report;
pub mod startup;

use crate::config::{Mode, RunSettings};
use crate::error::{Error, Result};
use crate::pg::{self, outbox, slot};
use crate::table::{OutboxTable, Role, TableSpec};
use report::{Finding, Outcome, Report};

/// Runs every check against the configured servers; never fails (what could not be checked is a finding).
pub async fn examine(configured: RunSettings<TableSpec>) -> Report {
    let mut report = Report::default();
    let database = &configured.database;
    let client = match pg::connect(&database.database_url).await {
        Ok(client) => {
            report.push(Finding::ok(
                "postgres.connection",
                "connected on --database-url",
            ));
            Some(client)
        }
        Err(error) => {
            report.push(Finding::of_error("postgres.connection", &error));
            None
        }
    };
    // The tables as the database has them; a table that cannot be read is checked as migrate creates it.
    let mut tables = Vec::new();
    for spec in &database.tables {
        let inspected = match &client {
            Some(client) => slot::inspect(client, spec).await,
            None => Err(Error::bug("not connected")),
        };
        match inspected {
            Ok(table) => tables.push(table),
            Err(error) => {
                if client.is_some() {
                    report.push(Finding::of_error(
                        format!("postgres.table {}", spec.name),
                        &error,
                    ));
                }
                tables.push(spec.as_created());
            }
        }
    }
    let tables_read = report.count(Outcome::Failed) == 0;
    let mode = effective_mode(configured.mode, &tables);
    let settings = configured.inspected(tables, mode);
    report.push(Finding::from_result(
        "config.topic",
        check_topic_template(&settings)
            .map(|()| Finding::ok("config.topic", "--topic names only columns every table has")),
    ));
    if settings.retention.is_some() {
        report.push(Finding::from_result(
            "config.retention",
            check_retention_columns(&settings)
                .map(|()| Finding::ok("config.retention", "every table has published_at")),
        ));
    }
    let mut waiting = kafka::Waiting::default();
    if let (Some(client), true) = (&client, tables_read) {
        for finding in postgres::examine(client, &settings).await {
            report.push(finding);
        }
        match waiting_events(client, &settings.database.tables).await {
            Ok(facts) => waiting = facts,
            Err(error) => report.push(Finding::of_error("postgres.backlog", &error)),
        }
    }
    for finding in kafka::examine(&settings, waiting).await {
        report.push(finding);
    }
    report
}

/// Logs what [`postgres::advisories`] finds that is not as outboxd needs it (a failure as an error, with
/// its fix): `run` calls it once its start-up checks passed. Never fails: a check it cannot make is skipped.
pub async fn log_advisories(settings: &RunSettings) {
    let Ok(client) = pg::connect(&settings.database.database_url).await else {
        return;
    };
    for finding in postgres::advisories(&client, settings).await {
        let fix = finding.fix.as_deref().unwrap_or("");
        match finding.outcome {
            Outcome::Failed => tracing::error!(check = %finding.check, %fix, "{}", finding.detail),
            Outcome::Warning => tracing::warn!(check = %finding.check, %fix, "{}", finding.detail),
            Outcome::Ok | Outcome::Note | Outcome::Unknown => {}
        }
    }
}

/// The mode `run` would use: `auto` on tables without the polling columns is `cdc`.
pub fn effective_mode(configured: Mode, tables: &[OutboxTable]) -> Mode {
    if configured != Mode::Poll && !tables.iter().all(|t| t.polling) {
        Mode::Cdc
    } else {
        configured
    }
}

/// The topic template names only columns every table has.
pub fn check_topic_template(settings: &RunSettings) -> Result<()> {
    for table in &settings.database.tables {
        for (used, role) in [
            (settings.topic.uses_aggregate_type(), Role::AggregateType),
            (settings.topic.uses_event_type(), Role::EventType),
        ] {
            if used && table.column(role).is_none() {
                return Err(Error::setup(
                    format!("--topic uses {{{}}}, but {} has no {} column", role.name(), table.name, role.name()),
                    format!("map it with --column {}=<column>, or give a --topic without {{{}}} (e.g. --topic outbox.{{table}})", role.name(), role.name()),
                ));
            }
        }
    }
    Ok(())
}

/// `--retention` needs `published_at` on every table, to know what was published.
pub fn check_retention_columns(settings: &RunSettings) -> Result<()> {
    if let (Some(_), Some(table)) = (
        &settings.retention,
        settings.database.tables.iter().find(|t| !t.marks_published),
    ) {
        return Err(Error::setup(
            format!("--retention needs the published_at column to know what was published, and {} has none", table.name),
            "run `outboxd migrate --add-polling-columns`, or drop --retention",
        ));
    }
    Ok(())
}

/// How many rows of the backlog the largest-payload check reads at most.
const PAYLOADS_READ: i64 = 100_000;

/// The largest payload among (at most [`PAYLOADS_READ`] of) the unpublished events, and the oldest one's
/// age, through the statements the periodic figures use (tables whose figures no index serves are skipped).
async fn waiting_events(
    client: &tokio_postgres::Client,
    tables: &[OutboxTable],
) -> Result<kafka::Waiting> {
    let mut waiting = kafka::Waiting::default();
    let mut counted = Vec::new();
    for table in tables.iter().filter(|t| t.marks_published) {
        if !outbox::countable(client, table).await?.backlog {
            continue;
        }
        counted.push(table.clone());
        let unpublished = if table.polling {
            "published_at IS NULL AND dead_at IS NULL"
        } else {
            "published_at IS NULL"
        };
        let largest: Option<i64> = client
            .query_one(
                &format!(
                    "SELECT max(octet_length({}::text))::int8 FROM (SELECT {0} FROM {} WHERE {unpublished} LIMIT {PAYLOADS_READ}) AS waiting",
                    table.col(Role::Payload),
                    table.name.quoted()
                ),
                &[],
            )
            .await?
            .get(0);
        waiting.largest_payload = waiting.largest_payload.max(largest);
    }
    let backlog = outbox::backlog(client, &counted, crate::config::PollOrder::default()).await?;
    waiting.oldest_age_seconds = backlog.oldest_unpublished_age_seconds;
    Ok(waiting)
}
