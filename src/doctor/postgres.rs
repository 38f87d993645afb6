//! The PostgreSQL half of `outboxd doctor`, over one SQL connection (and one replication connection for
//! the replication permission): each check is a function returning its finding, with the SQL or setting
//! that fixes it. The checks `run` must pass are the same functions `run`'s start-up calls (`pg::slot`,
//! `retention::check`), so the two never disagree; the others are what operators otherwise learn the hard
//! way. Reads only: nothing here changes the database.

use tokio_postgres::Client;

use super::report::{Finding, Outcome};
use crate::config::{Mode, RunSettings};
use crate::error::{replication_error, Result};
use crate::failover::Concern;
use crate::pg::outbox;
use crate::pg::replication::ReplicationConnection;
use crate::pg::slot;
use crate::pg::version::{ServerVersion, NEWEST_TESTED, OLDEST_SUPPORTED};
use crate::table::OutboxTable;

/// PostgreSQL 18 adds `idle_replication_slot_timeout`; 17 adds `invalidation_reason`.
const PG_18: i32 = 180_000;
const PG_17: i32 = 170_000;

/// Every PostgreSQL check, in the order they are read: the server, the tables, replication, the slot, the
/// sessions, the figures' indexes, retention.
pub async fn examine(client: &Client, settings: &RunSettings) -> Vec<Finding> {
    let mut findings = Vec::new();
    let version = match server_version(client).await {
        Ok((version, finding)) => {
            findings.push(finding);
            version
        }
        Err(error) => {
            findings.push(Finding::of_error("postgres.server", &error));
            return findings;
        }
    };
    for table in &settings.database.tables {
        findings.push(polling_columns(table, settings.mode));
        findings.push(Finding::from_result(
            "postgres.privileges",
            privileges(client, table, settings).await,
        ));
        findings.push(Finding::from_result(
            "postgres.row_level_security",
            row_level_security(client, table).await,
        ));
        findings.push(Finding::from_result(
            "postgres.indexes",
            figures_indexes(client, table).await,
        ));
        if table.polling {
            findings.push(Finding::from_result(
                "postgres.positions",
                rows_without_position(client, table).await,
            ));
            findings.push(Finding::from_result(
                "postgres.inserting_roles",
                inserting_roles(client, table).await,
            ));
        }
    }
    if settings.mode == Mode::Poll {
        findings.push(Finding::from_result(
            "postgres.slot",
            slot_left_behind(client, &settings.database.slot).await,
        ));
    } else {
        let replication = [
            Finding::from_result("postgres.wal_level", wal_level(client).await),
            replication_permission(settings).await,
        ];
        let available = replication.iter().all(|f| f.outcome == Outcome::Ok);
        for finding in replication {
            findings.push(polled_instead(finding, settings.mode));
        }
        if available || settings.mode == Mode::Cdc {
            findings.push(Finding::from_result(
                "postgres.publication",
                publication(client, settings).await,
            ));
        }
        let can_sweep = settings.database.tables.iter().all(|t| t.polling);
        findings.push(Finding::from_result(
            "postgres.slot",
            replication_slot(client, &settings.database.slot, version, can_sweep).await,
        ));
        findings.push(Finding::from_result(
            "postgres.wal_headroom",
            wal_headroom(client, &settings.database.slot).await,
        ));
        if version >= PG_18 {
            findings.push(Finding::from_result(
                "postgres.idle_slot_timeout",
                idle_slot_timeout(client, settings).await,
            ));
        }
        if version >= PG_17 {
            findings.push(Finding::from_result(
                "postgres.failover_slot",
                failover_slot(client, ServerVersion(version), settings).await,
            ));
        }
    }
    findings.push(Finding::from_result(
        "postgres.session",
        one_session(client).await,
    ));
    findings.push(Finding::from_result(
        "postgres.synchronous_commit",
        synchronous_commit(client).await,
    ));
    if let Some(retention) = &settings.retention {
        let checked = crate::retention::check(
            client,
            &settings.database.tables,
            retention,
            &settings.database.publication,
        )
        .await;
        findings.push(Finding::from_result(
            "postgres.retention",
            checked.map(|()| {
                Finding::ok(
                    "postgres.retention",
                    "retention can drop, delete or archive as configured",
                )
            }),
        ));
    }
    findings
}

/// Under `--mode auto` (every table has the polling columns), replication that is not available is no
/// failure: `run` polls the table instead, and switches to the slot once it is.
fn polled_instead(finding: Finding, mode: Mode) -> Finding {
    if mode != Mode::Auto || finding.outcome != Outcome::Failed {
        return finding;
    }
    Finding {
        outcome: Outcome::Warning,
        detail: format!(
            "{}; --mode auto polls the table instead (later events wait up to --poll-interval) and streams once it is fixed",
            finding.detail
        ),
        ..finding
    }
}

/// The checks `run`'s start-up does not make itself (it stops on the others), for it to log: what hides rows
/// from outboxd, privileges it may lack, roles whose inserts the `position` sequence refuses, a pooler between
/// it and PostgreSQL, how close the slot is to being invalidated.
pub async fn advisories(client: &Client, settings: &RunSettings) -> Vec<Finding> {
    let mut findings = Vec::new();
    for table in &settings.database.tables {
        findings.push(Finding::from_result(
            "postgres.privileges",
            privileges(client, table, settings).await,
        ));
        findings.push(Finding::from_result(
            "postgres.row_level_security",
            row_level_security(client, table).await,
        ));
        if table.polling {
            findings.push(Finding::from_result(
                "postgres.inserting_roles",
                inserting_roles(client, table).await,
            ));
        }
    }
    findings.push(Finding::from_result(
        "postgres.session",
        one_session(client).await,
    ));
    if settings.mode != Mode::Poll {
        let slot_name = &settings.database.slot;
        findings.push(Finding::from_result(
            "postgres.wal_headroom",
            wal_headroom(client, slot_name).await,
        ));
        let version = server_version(client).await.map(|(version, _)| version);
        if version.as_ref().is_ok_and(|version| *version >= PG_18) {
            findings.push(Finding::from_result(
                "postgres.idle_slot_timeout",
                idle_slot_timeout(client, settings).await,
            ));
        }
        if let Some(version) = version.ok().filter(|version| *version >= PG_17) {
            findings.push(Finding::from_result(
                "postgres.failover_slot",
                failover_slot(client, ServerVersion(version), settings).await,
            ));
        }
    }
    findings
}

/// Whether the slot would survive a promotion (PostgreSQL 17+): judged by `crate::failover`.
async fn failover_slot(
    client: &Client,
    version: ServerVersion,
    settings: &RunSettings,
) -> Result<Finding> {
    let db = &settings.database;
    let check = "postgres.failover_slot";
    let Some(readiness) =
        crate::pg::failover::read(client, version, &db.slot, &db.standby_urls).await?
    else {
        return Ok(Finding::ok(check, "no failover slots before PostgreSQL 17"));
    };
    let findings = readiness.findings();
    let warnings: Vec<&str> = findings
        .iter()
        .filter(|(concern, _)| *concern == Concern::Warning)
        .map(|(_, text)| text.as_str())
        .collect();
    Ok(if !warnings.is_empty() {
        Finding::with_fix(
            check,
            Outcome::Warning,
            warnings.join("; "),
            "README 'Failover slots (PostgreSQL 17+)' gives the settings on primary and standby",
        )
    } else if let Some((_, note)) = findings.first() {
        Finding::with_fix(
            check,
            Outcome::Note,
            note.clone(),
            "leave out --no-failover-slot to have outboxd make it a failover slot",
        )
    } else if readiness.slot_failover.is_none() {
        Finding::ok(
            check,
            if db.failover_slot {
                "outboxd creates its slot as a failover slot"
            } else {
                "--no-failover-slot: outboxd creates its slot without failover"
            },
        )
    } else {
        Finding::ok(
            check,
            format!(
                "a failover slot, protected by synchronized_standby_slots = {}{}",
                readiness.synchronized_standby_slots.join(","),
                if readiness.standbys.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; {} standby(s) hold a synchronised copy",
                        readiness.standbys.len()
                    )
                }
            ),
        )
    })
}

/// The server answers, as a primary; its version decides which later checks apply.
async fn server_version(client: &Client) -> Result<(i32, Finding)> {
    let row = client
        .query_one(
            "SELECT current_setting('server_version_num')::int, current_setting('server_version'), pg_is_in_recovery()",
            &[],
        )
        .await?;
    let (number, version, standby): (i32, String, bool) = (row.get(0), row.get(1), row.get(2));
    let finding = if standby {
        Finding::with_fix(
            "postgres.server",
            Outcome::Failed,
            format!("PostgreSQL {version} is a standby in recovery: outboxd needs the primary (a standby cannot take its writes)"),
            "point --database-url at the primary (or promote this server)",
        )
    } else {
        match ServerVersion(number).check_supported() {
            Err(error) => Finding::of_error("postgres.server", &error),
            Ok(true) => Finding::ok("postgres.server", format!("PostgreSQL {version}, primary")),
            Ok(false) => Finding::with_fix(
                "postgres.server",
                Outcome::Warning,
                format!("PostgreSQL {version}, primary: a major outboxd is not tested on (it is tested on {OLDEST_SUPPORTED} to {NEWEST_TESTED})"),
                "run outboxd's test suite against this major before relying on it (README 'PostgreSQL versions and managed services')",
            ),
        }
    };
    Ok((number, finding))
}

/// The polling columns are there where the mode needs them (the column types themselves were checked when
/// the table was inspected).
fn polling_columns(table: &OutboxTable, mode: Mode) -> Finding {
    let check = format!("postgres.table {}", table.name);
    match (table.polling, mode) {
        (true, _) => Finding::ok(check, "every column outboxd maps, and the polling columns"),
        (false, Mode::Poll) => match slot::check_polling_columns(table) {
            Err(error) => Finding::of_error(check, &error),
            Ok(()) => Finding::ok(check, "every column outboxd maps, and the polling columns"),
        },
        (false, _) => Finding::with_fix(
            check,
            Outcome::Warning,
            "no polling columns: CDC only (no backfill of rows older than the slot, no polling fallback, no retries or dead letters)",
            format!("outboxd migrate --table {} --add-polling-columns", table.name),
        ),
    }
}

/// A table that enforces row level security on outboxd's role hides rows from the polling path and the
/// backlog figures (logical decoding does not apply it): events would wait unseen.
async fn row_level_security(client: &Client, table: &OutboxTable) -> Result<Finding> {
    let check = "postgres.row_level_security";
    let Some(role) = slot::role_row_security_hides_rows_from(client, table).await? else {
        return Ok(Finding::ok(
            check,
            format!("{} shows every row to the role outboxd runs as", table.name),
        ));
    };
    let (problem, fix) = slot::hidden_rows_problem(table, &role);
    Ok(Finding::with_fix(
        check,
        if table.polling {
            Outcome::Failed
        } else {
            Outcome::Warning
        },
        problem,
        fix,
    ))
}

/// Each periodic figure of the table reads an index, not the whole table.
async fn figures_indexes(client: &Client, table: &OutboxTable) -> Result<Finding> {
    let check = "postgres.indexes";
    if !table.marks_published {
        return Ok(Finding::ok(
            check,
            format!(
                "{} has no published_at: no backlog to count (slot lag is the measure)",
                table.name
            ),
        ));
    }
    let statements = outbox::backlog_statements(table, crate::config::PollOrder::PerAggregate);
    let mut scanned = Vec::new();
    for (what, sql) in [
        ("backlog", Some(&statements.count)),
        ("oldest age", statements.oldest.as_ref()),
        ("dead letters", statements.dead.as_ref()),
    ] {
        if let Some(sql) = sql {
            if outbox::needs_a_table_scan(client, sql).await? {
                scanned.push(what);
            }
        }
    }
    if scanned.is_empty() {
        return Ok(Finding::ok(
            check,
            format!("an index serves every figure of {}", table.name),
        ));
    }
    // With the polling columns the figures read the claim index: without it, every claim reads the table.
    let (outcome, claims) = if table.polling {
        (Outcome::Failed, "; the claim index is missing or invalid, so every claim of the polling path and the sweeper reads the whole table too")
    } else {
        (Outcome::Warning, "")
    };
    Ok(Finding::with_fix(
        check,
        outcome,
        format!("no index serves the {} of {}: those figures are not counted (reading the whole table every 5 s would load the database){claims}", scanned.join(", "), table.name),
        outbox::backlog_index_fix(table),
    ))
}

/// Unpublished rows without a `position` (from before the polling columns) are numbered in insert order
/// when the polling path starts: one transaction over all of them, worth knowing on a large history.
async fn rows_without_position(client: &Client, table: &OutboxTable) -> Result<Finding> {
    let check = "postgres.positions";
    let unnumbered: bool = client
        .query_one(
            &format!(
                "SELECT EXISTS (SELECT FROM {} WHERE position IS NULL AND published_at IS NULL AND dead_at IS NULL)",
                table.name.quoted()
            ),
            &[],
        )
        .await?
        .get(0);
    if !unnumbered {
        return Ok(Finding::ok(
            check,
            format!("every unpublished row of {} has its position", table.name),
        ));
    }
    Ok(Finding {
        check: check.into(),
        outcome: Outcome::Note,
        detail:
        format!("{} has unpublished rows without a position (from before the polling columns): the polling path numbers them in insert order when it starts, in one transaction (a statement_timeout does not apply to it)", table.name),
        fix: None,
    })
}

/// Every role that may insert into the table may also draw its `position` from the sequence (the column's
/// default runs with the inserting role's rights). `outboxd migrate` grants it to the roles that may insert
/// when it runs; a role granted INSERT since fails every insert until the next migrate or the GRANT.
/// Outboxd's own role is not judged: the rows it writes back carry their position.
async fn inserting_roles(client: &Client, table: &OutboxTable) -> Result<Finding> {
    let check = "postgres.inserting_roles";
    let roles: Vec<String> = client
        .query(
            &format!(
                "SELECT role FROM ({}) AS inserters(role) WHERE role <> quote_ident(current_user::text)",
                crate::pg::migrate::inserters_without_position_sequence("$1::text")
            ),
            &[&table.name.quoted()],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if roles.is_empty() {
        return Ok(Finding::ok(
            check,
            format!(
                "every role that may insert into {} may draw its position",
                table.name
            ),
        ));
    }
    let sequence: String = client
        .query_one(
            "SELECT pg_get_serial_sequence($1, 'position')",
            &[&table.name.quoted()],
        )
        .await?
        .get(0);
    Ok(Finding::with_fix(
        check,
        Outcome::Warning,
        format!(
            "{} may insert into {} but not use the sequence of its position column: every insert of theirs that leaves position to its default fails with \"permission denied for sequence\" (an application's does; outboxd's own write-back does not, it carries the position)",
            roles.join(", "),
            table.name
        ),
        format!(
            "run `outboxd migrate` again (it grants it to every role that may insert), or GRANT USAGE ON SEQUENCE {sequence} TO {}",
            roles.join(", ")
        ),
    ))
}

/// `wal_level = logical`, through the check `run` makes.
async fn wal_level(client: &Client) -> Result<Finding> {
    slot::check_wal_level(client).await?;
    Ok(Finding::ok("postgres.wal_level", "logical"))
}

/// The role may open a replication connection (tried, as managed services grant it through roles), on
/// `--replication-url`.
async fn replication_permission(settings: &RunSettings) -> Finding {
    let check = "postgres.replication";
    let identified = async {
        let mut connection =
            ReplicationConnection::connect(&settings.database.replication_url).await?;
        connection.identify_system().await?;
        connection.in_recovery().await
    };
    match identified.await.map_err(replication_error) {
        // The SQL connection's server is judged by `postgres.server`: only a standby behind a primary's
        // --database-url is this check's finding.
        Ok(true)
            if settings.database.replication_url.config
                != settings.database.database_url.config =>
        {
            Finding::of_error(check, &crate::error::Error::replication_on_standby(false))
        }
        Ok(_) => Finding::ok(
            check,
            "the replication connection is allowed (IDENTIFY_SYSTEM answered)",
        ),
        Err(error) => Finding::of_error(check, &error),
    }
}

/// The publication exists, is trusted, publishes inserts and covers every table: the check `run` makes.
async fn publication(client: &Client, settings: &RunSettings) -> Result<Finding> {
    slot::check_publication(client, &settings.database).await?;
    Ok(Finding::ok(
        "postgres.publication",
        format!(
            "{} publishes the inserts of {}",
            settings.database.publication,
            crate::table::names(&settings.database.tables)
        ),
    ))
}

/// The slot, when it exists: pgoutput, this database's, not lost (the check `run` makes), and how much of
/// its WAL is still reserved.
async fn replication_slot(
    client: &Client,
    slot_name: &str,
    version: i32,
    can_sweep: bool,
) -> Result<Finding> {
    let check = "postgres.slot";
    let lost = slot::slot_state(client, slot_name)
        .await?
        .is_some_and(|state| state.wal_status.as_deref() == Some("lost"));
    if lost && can_sweep {
        return Ok(Finding::with_fix(
            check,
            Outcome::Warning,
            format!("{slot_name} is lost (wal_status = lost): outboxd drops and replaces it at start, and the polling path publishes what it missed (some events again)"),
            "nothing to do before starting outboxd; to keep slots from being lost, keep outboxd running or raise max_slot_wal_keep_size",
        ));
    }
    let Some(state) = slot::check_existing_slot(client, slot_name).await? else {
        return free_slots(client, slot_name).await;
    };
    let invalidated = if version >= PG_17 {
        client
            .query_one(
                "SELECT invalidation_reason::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot_name],
            )
            .await?
            .get::<_, Option<String>>(0)
    } else {
        None
    };
    if let Some(reason) = invalidated {
        return Ok(Finding::with_fix(
            check,
            Outcome::Failed,
            format!("{slot_name} is invalidated ({reason}): it can never stream again"),
            format!("drop it (SELECT pg_drop_replication_slot('{slot_name}')) and restart outboxd; see README 'When the slot is lost'"),
        ));
    }
    if state.active {
        if let Some(finding) = foreign_client(client, slot_name).await? {
            return Ok(finding);
        }
    }
    let used = if state.active { "in use" } else { "not in use" };
    let lag = state.lag_bytes.unwrap_or(0);
    Ok(match state.wal_status.as_deref() {
        Some("unreserved") => Finding::with_fix(
            check,
            Outcome::Warning,
            format!("{slot_name} ({used}, {lag} bytes behind) has wal_status = unreserved: it is lost at the next checkpoint unless it catches up"),
            "start outboxd now (or raise max_slot_wal_keep_size); if it is lost anyway, see README 'When the slot is lost'",
        ),
        status => Finding::ok(
            check,
            format!("{slot_name}: pgoutput, {used}, {lag} bytes behind, wal_status = {}", status.unwrap_or("unknown")),
        ),
    })
}

/// A slot streamed to while no outboxd leads it (no leadership session names the slot, see
/// `LeadershipRole`): another client (`pg_recvlogical`, another connector given the same slot name) holds it, and
/// outboxd cannot stream until it lets go; events it takes from the slot are not outboxd's to publish.
async fn foreign_client(client: &Client, slot_name: &str) -> Result<Option<Finding>> {
    let row = client
        .query_opt(
            "SELECT s.active_pid, coalesce(a.application_name, ''), coalesce(a.client_addr::text, 'local')
               FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
              WHERE s.slot_name = $1 AND s.active
                AND NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = $2)",
            &[
                &slot_name,
                &slot::leadership_application_name(slot::LeadershipRole::Active, slot_name),
            ],
        )
        .await?;
    Ok(row.map(|row| {
        let (pid, application, address): (Option<i32>, String, String) =
            (row.get(0), row.get(1), row.get(2));
        let pid = pid.map_or("?".into(), |pid| pid.to_string());
        Finding::with_fix(
            "postgres.slot",
            Outcome::Failed,
            format!("{slot_name} is streamed to by a client that is not an outboxd leading it (pid {pid}, application_name '{application}', from {address}): outboxd cannot stream from it while that client holds it"),
            format!("stop that client (SELECT pg_terminate_backend({pid}) ends it), or give outboxd a slot of its own with --slot"),
        )
    }))
}

/// Under `--mode poll` nothing reads the slot: one left from an earlier CDC run keeps WAL without end.
async fn slot_left_behind(client: &Client, slot_name: &str) -> Result<Finding> {
    let check = "postgres.slot";
    let slot: Option<(Option<i64>, bool, Option<String>)> = client
        .query_opt(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8, active, wal_status
             FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()",
            &[&slot_name],
        )
        .await?
        .map(|row| (row.get(0), row.get(1), row.get(2)));
    Ok(match slot {
        None => Finding::ok(check, format!("no slot {slot_name}: --mode poll needs none")),
        // A CDC instance of the fleet streams from it (pollers leave its rows to it).
        Some((_, true, _)) => Finding::ok(
            check,
            format!("{slot_name} is streamed by another client (a CDC instance of the fleet?); --mode poll leaves it alone"),
        ),
        Some((_, false, Some(status))) if status == "lost" => Finding::with_fix(
            check,
            Outcome::Note,
            format!("{slot_name} exists, lost (wal_status = lost): it keeps no WAL, and --mode poll never reads it"),
            format!("SELECT pg_drop_replication_slot('{slot_name}')"),
        ),
        Some((retained, false, _)) => Finding::with_fix(
            check,
            Outcome::Warning,
            format!(
                "{slot_name} exists, but --mode poll never reads it: it keeps WAL ({} bytes so far) until the disk is full",
                retained.unwrap_or(0)
            ),
            format!("if nothing is to stream from it again: SELECT pg_drop_replication_slot('{slot_name}')"),
        ),
    })
}

/// A slot to create needs a free one of `max_replication_slots`.
async fn free_slots(client: &Client, slot_name: &str) -> Result<Finding> {
    let check = "postgres.slot";
    let row = client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int8, (SELECT count(*) FROM pg_replication_slots)",
            &[],
        )
        .await?;
    let (max, used): (i64, i64) = (row.get(0), row.get(1));
    if used < max {
        return Ok(Finding::ok(
            check,
            format!("{slot_name} does not exist yet: outboxd creates it ({used} of max_replication_slots = {max} in use)"),
        ));
    }
    Ok(Finding::with_fix(
        check,
        Outcome::Failed,
        format!("{slot_name} does not exist yet, and every one of max_replication_slots = {max} is in use: outboxd cannot create it"),
        "drop a slot nothing reads (see pg_replication_slots WHERE NOT active), or raise max_replication_slots (ALTER SYSTEM SET max_replication_slots = ...; needs a restart)",
    ))
}

/// Outboxd's role reads the table's columns and writes `published_at` (and the polling columns) back:
/// table-wide or column by column (`GRANT SELECT (...)`, `GRANT UPDATE (published_at, ...)` are enough);
/// with `--retention` it deletes rows (unless it drops partitions, which needs ownership: `retention::check`)
/// and inserts them into an existing archive. The stream writes a row the application deleted back into the
/// table when its event must go to polling (README, rows deleted in their own transaction): without INSERT
/// that stops outboxd, so its lack is a warning.
async fn privileges(
    client: &Client,
    table: &OutboxTable,
    settings: &RunSettings,
) -> Result<Finding> {
    let check = "postgres.privileges";
    let (quoted, name) = (table.name.quoted(), &table.name);
    let retention = settings.retention.as_ref();
    let deletes = retention.is_some_and(|r| r.archive_table.is_some() || !table.partitioned);
    let archive = retention
        .and_then(|r| r.archive_table.as_ref())
        .map(|a| a.quoted());
    let row = client
        .query_one(
            "SELECT coalesce((SELECT array_agg(c) FROM unnest($4::text[]) AS c
                              WHERE NOT has_column_privilege($1::text::regclass, c, 'SELECT')), '{}'),
                    coalesce((SELECT array_agg(c) FROM unnest($2::text[]) AS c
                              WHERE NOT has_column_privilege($1::text::regclass, c, 'UPDATE')), '{}'),
                    has_table_privilege($1::text::regclass, 'DELETE'),
                    $3::text IS NULL OR to_regclass($3) IS NULL OR has_table_privilege(to_regclass($3), 'INSERT'),
                    NOT EXISTS (SELECT 1 FROM pg_attribute
                                 WHERE attrelid = $1::text::regclass AND attnum > 0 AND NOT attisdropped
                                   AND attgenerated = '' AND NOT has_column_privilege($1::text::regclass, attnum, 'INSERT')),
                    current_user::text",
            &[&quoted, &table.written_columns(), &archive, &table.read_columns()],
        )
        .await?;
    let (not_readable, not_updatable, delete, archive_insert, insert, role): (
        Vec<String>,
        Vec<String>,
        bool,
        bool,
        bool,
        String,
    ) = (
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
    );
    let mut missing = Vec::new();
    if !not_readable.is_empty() {
        missing.push(format!(
            "GRANT SELECT ({}) ON {name} TO {role}",
            not_readable.join(", ")
        ));
    }
    if !not_updatable.is_empty() {
        missing.push(format!(
            "GRANT UPDATE ({}) ON {name} TO {role}",
            not_updatable.join(", ")
        ));
    }
    if deletes && !delete {
        missing.push(format!(
            "GRANT DELETE ON {name} TO {role} (for --retention)"
        ));
    }
    if !archive_insert {
        if let Some(archive) = retention.and_then(|r| r.archive_table.as_ref()) {
            missing.push(format!(
                "GRANT INSERT ON {archive} TO {role} (for --archive-table)"
            ));
        }
    }
    let writes_rows_back = table.polling && settings.mode != Mode::Poll;
    if writes_rows_back && !insert {
        let grant = format!("GRANT INSERT ON {name} TO {role}");
        if missing.is_empty() {
            return Ok(Finding::with_fix(
                check,
                Outcome::Warning,
                format!("{role} may not insert into {name}: if your application deletes outbox rows in the transaction after inserting them, an event that must go to the polling path (the broker refused it) cannot be written back, and outboxd stops with it unconfirmed in the slot"),
                format!("{grant} (needed only for tables whose rows the application deletes)"),
            ));
        }
        missing.push(format!("{grant} (for rows the application deletes)"));
    }
    if missing.is_empty() {
        return Ok(Finding::ok(
            check,
            format!("{role} may read {name} and write back what it published"),
        ));
    }
    Ok(Finding::with_fix(
        check,
        Outcome::Failed,
        format!("{role} lacks privileges outboxd needs on {name} (reading events, writing published_at and the polling columns back, retention)"),
        missing.join("; "),
    ))
}

/// How much WAL the slot may keep before PostgreSQL invalidates it (`max_slot_wal_keep_size`), and how
/// much of that is left.
async fn wal_headroom(client: &Client, slot_name: &str) -> Result<Finding> {
    let check = "postgres.wal_headroom";
    let limit: String = client
        .query_one("SHOW max_slot_wal_keep_size", &[])
        .await?
        .get(0);
    if limit == "-1" {
        return Ok(Finding::with_fix(
            check,
            Outcome::Note,
            "max_slot_wal_keep_size = -1: a slot nothing consumes keeps WAL until the disk is full",
            "ALTER SYSTEM SET max_slot_wal_keep_size = '<a size your disk holds>'; SELECT pg_reload_conf(); (a slot then lost is recovered by the polling path: README 'When the slot is lost')",
        ));
    }
    let state = slot::slot_state(client, slot_name).await?;
    let limit_bytes: i64 = client
        .query_one(
            "SELECT pg_size_bytes(setting || unit) FROM pg_settings WHERE name = 'max_slot_wal_keep_size'",
            &[],
        )
        .await?
        .get(0);
    match state.and_then(|s| s.safe_wal_bytes) {
        Some(safe) if safe < limit_bytes / 4 => Ok(Finding::with_fix(
            check,
            Outcome::Warning,
            format!("slot {slot_name} may fall {safe} more bytes behind before PostgreSQL invalidates it (max_slot_wal_keep_size = {limit})"),
            "make sure outboxd runs and keeps up (outboxd status), or raise max_slot_wal_keep_size",
        )),
        Some(safe) => Ok(Finding::ok(check, format!("max_slot_wal_keep_size = {limit}; slot {slot_name} has {safe} bytes of headroom"))),
        None => Ok(Finding::ok(check, format!("max_slot_wal_keep_size = {limit}"))),
    }
}

/// PostgreSQL 18 invalidates a slot nobody streamed from for `idle_replication_slot_timeout`.
async fn idle_slot_timeout(client: &Client, settings: &RunSettings) -> Result<Finding> {
    let check = "postgres.idle_slot_timeout";
    let timeout: String = client
        .query_one("SHOW idle_replication_slot_timeout", &[])
        .await?
        .get(0);
    if timeout == "0" {
        return Ok(Finding::ok(
            check,
            "idle_replication_slot_timeout = 0: an idle slot is kept",
        ));
    }
    let covered = settings.database.tables.iter().all(|t| t.polling);
    Ok(Finding::with_fix(
        check,
        if covered { Outcome::Note } else { Outcome::Warning },
        format!(
            "idle_replication_slot_timeout = {timeout}: while outboxd is stopped longer than that, PostgreSQL invalidates slot {}{}",
            settings.database.slot,
            if covered { " (the polling path then publishes what it missed)" } else { ", and tables without the polling columns have no way to publish what it missed" }
        ),
        "ALTER SYSTEM SET idle_replication_slot_timeout = 0; SELECT pg_reload_conf(); or keep outboxd's downtime shorter",
    ))
}

/// Statements on one connection reach one server session: the leadership lock and the lease renewals are
/// session state, which a transaction-mode pooler (pgbouncer `pool_mode = transaction`) hands to others.
async fn one_session(client: &Client) -> Result<Finding> {
    let check = "postgres.session";
    let first: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    for _ in 0..3 {
        let next: i32 = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await?
            .get(0);
        if next != first {
            return Ok(Finding::with_fix(
                check,
                Outcome::Failed,
                "statements of one connection reached different server sessions: a transaction-mode pooler is between outboxd and PostgreSQL, and outboxd's session locks (leadership, claims) would be held by, and released with, other clients' sessions",
                "point --database-url at PostgreSQL itself or at a session-mode pool (pgbouncer pool_mode = session)",
            ));
        }
    }
    Ok(Finding::ok(
        check,
        "one server session per connection (no transaction-mode pooler)",
    ))
}

/// outboxd's own commits are durable whatever the server's default (see `pg::connect`): said, so that a
/// server-wide `synchronous_commit = off` does not look like a risk to outboxd.
async fn synchronous_commit(client: &Client) -> Result<Finding> {
    let row = client
        .query_one(
            "SELECT current_setting('synchronous_commit'), (SELECT reset_val FROM pg_settings WHERE name = 'synchronous_commit')",
            &[],
        )
        .await?;
    let (session, server): (String, String) = (row.get(0), row.get(1));
    Ok(Finding::ok(
        "postgres.synchronous_commit",
        format!("outboxd's sessions commit with synchronous_commit = {session} (the server's default for its role: {server})"),
    ))
}
