//! `outboxd migrate`: embedded plain-SQL migrations tracked in `outboxd_migrations`, then the publication.
//! Idempotent, safe to run concurrently (one migrate at a time, under a session advisory lock in outboxd's
//! keyspace and the one earlier versions took), and safe on a large table the application keeps writing:
//! statements that lock the table run in short transactions under `lock_timeout`, retried while the lock is
//! busy, so application inserts never queue behind a long wait; indexes are built `CONCURRENTLY` outside any
//! transaction. Needs no broker and works with `wal_level = replica`.

use std::time::Duration;

use tokio_postgres::{Client, GenericClient};

use crate::config::{DatabaseSettings, ExistingRows};
use crate::error::{Error, Result};
use crate::pg::outbox::HistoryMark;
use crate::pg::ownership::{trusted_owner, SCHEMA_OWNER};
use crate::pg::slot;
use crate::pipeline::liveness::lock_call;
use crate::table::TableName;
use crate::table::{derived_name, fnv1a, replay_tables};
use crate::table::{OutboxTable, Role, TableSpec};

/// Embedded migrations, applied in order. Never edit one that has shipped: add a new one.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "outbox_tables",
        include_str!("../../migrations/0001_outbox_tables.sql"),
    ),
    (
        2,
        "polling",
        include_str!("../../migrations/0002_polling.sql"),
    ),
    (
        3,
        "retention",
        include_str!("../../migrations/0003_retention.sql"),
    ),
    (
        4,
        "claim_order",
        include_str!("../../migrations/0004_claim_order.sql"),
    ),
    (
        5,
        "dead_letters",
        include_str!("../../migrations/0005_dead_letters.sql"),
    ),
    (
        6,
        "replay",
        include_str!("../../migrations/0006_replay.sql"),
    ),
    (
        7,
        "attempt_history",
        include_str!("../../migrations/0007_attempt_history.sql"),
    ),
];

/// The migration that puts the claim index in `position NULLS FIRST` order (skipped where it already is).
const CLAIM_ORDER_VERSION: i32 = 4;

/// How long a statement that locks the outbox table may wait for its lock before it gives up and tries again
/// later: an application insert queued behind it waits at most about this long.
const LOCK_TIMEOUT: Duration = Duration::from_millis(300);

/// How long migrate keeps trying to take a table lock before it reports what holds it.
const LOCK_PATIENCE: Duration = Duration::from_secs(600);

/// Key text of outboxd's migration lock, `(OUTBOXD_LOCK_CLASS, hashtext(key))` like its other locks.
const MIGRATION_LOCK_KEY: &str = "outboxd.migrate";

/// The migration lock as earlier versions took it (a bigint, in the keyspace applications use): taken as
/// well, so that a migrate of an earlier version never runs at the same time as this one.
const FORMER_MIGRATION_LOCK_KEY: i64 = 0x6f75_7462_6f78_6d67; // "outboxmg"

/// The first migration creates the table; the later ones add the polling path's columns and indexes.
const CREATE_TABLE_VERSION: i32 = 1;

/// What `migrate` did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Migrations applied by this run, as `schema.table NNNN_name`.
    pub applied: Vec<String>,
    /// Whether this run created the publication.
    pub publication_created: bool,
    /// Existing tables left without polling columns (no `--add-polling-columns`): they run CDC only.
    pub cdc_only: Vec<String>,
    /// Tables whose rows were marked published before outboxd (`--existing-rows published`) while the slot
    /// had not yet streamed all of them: (table, the slot's position, the position it must reach).
    pub history_awaiting_slot: Vec<(String, crate::lsn::Lsn, crate::lsn::Lsn)>,
}

/// How long migrate waits for a streaming slot to pass the rows it marked published before outboxd.
const HISTORY_WAIT: Duration = Duration::from_secs(60);

/// Fills a migration's placeholders with quoted identifiers derived from the (validated) table name and
/// its column mapping.
/// `existing`: the table gains `published_at` here, and its rows count as sent (`Published`: `published_at`
/// '-infinity') or as handed to the polling path at once (`Unpublished`: `handoff_at` '-infinity', so that the
/// sweeper publishes them even next to a slot that streamed past them long ago). Both through the column's
/// default, dropped in the same transaction: no rewrite, and rows inserted afterwards get NULL.
fn render_migration(sql: &str, table: &OutboxTable, existing: Option<ExistingRows>) -> String {
    let name = &table.name;
    let schema = format!("\"{}\"", name.schema);
    let bare = &name.name;
    let position_seq = format!("{schema}.\"{}\"", derived_name(bare, "position_seq"));
    let created_at = format!(
        "\"{}\"",
        table.column(Role::CreatedAt).unwrap_or("created_at")
    );
    let existing_rows_default = |column: &str, wanted: ExistingRows| {
        if existing == Some(wanted) {
            (
                " DEFAULT '-infinity'".to_string(),
                format!(
                    "ALTER TABLE {} ALTER COLUMN {column} DROP DEFAULT;",
                    name.quoted()
                ),
            )
        } else {
            (String::new(), String::new())
        }
    };
    let (published_at_default, published_at_drop_default) =
        existing_rows_default("published_at", ExistingRows::Published);
    let (handoff_at_default, handoff_at_drop_default) =
        existing_rows_default("handoff_at", ExistingRows::Unpublished);
    let placeholders = [
        ("{{published_at_default}}", published_at_default),
        ("{{published_at_drop_default}}", published_at_drop_default),
        ("{{handoff_at_default}}", handoff_at_default),
        ("{{handoff_at_drop_default}}", handoff_at_drop_default),
        ("{{table}}", name.quoted()),
        ("{{schema}}", schema.clone()),
        (
            "{{grant_position_seq}}",
            grant_position_sequence_to_inserters(name),
        ),
        ("{{position_seq_text}}", position_seq.clone()),
        ("{{position_seq}}", position_seq),
        (
            "{{claim_index}}",
            format!("\"{}\"", derived_name(bare, "claim_idx")),
        ),
        (
            "{{claim_index_next}}",
            format!("\"{}\"", derived_name(bare, "claim_idx_next")),
        ),
        (
            "{{dead_index}}",
            format!("\"{}\"", derived_name(bare, "dead_idx")),
        ),
        (
            "{{handoff_index}}",
            format!("\"{}\"", derived_name(bare, "handoff_idx")),
        ),
        (
            "{{published_index}}",
            format!("\"{}\"", derived_name(bare, "published_idx")),
        ),
        ("{{replay_table}}", replay_tables(name).progress),
        ("{{replayed_table}}", replay_tables(name).replayed),
        ("{{event_id}}", table.col(Role::EventId)),
        ("{{aggregate_type}}", table.col(Role::AggregateType)),
        ("{{aggregate_id}}", table.col(Role::AggregateId)),
        ("{{event_type}}", table.col(Role::EventType)),
        ("{{payload}}", table.col(Role::Payload)),
        ("{{created_at}}", created_at),
        ("{{order_key}}", table.order_key()),
        ("{{aggregate_key}}", table.aggregate_key()),
    ];
    placeholders
        .iter()
        .fold(sql.to_string(), |sql, (placeholder, value)| {
            sql.replace(placeholder, value)
        })
}

async fn table_exists(tx: &impl GenericClient, table: &TableName) -> Result<bool> {
    Ok(tx
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table.quoted()])
        .await?
        .get(0))
}

/// One step of a rendered migration.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// Statements run together in one short transaction under [`LOCK_TIMEOUT`], retried while a lock is busy.
    Locked(String),
    /// One `CREATE INDEX CONCURRENTLY` / `DROP INDEX CONCURRENTLY`, outside any transaction. `index`: the
    /// (quoted) name a CREATE builds, whose invalid leftover of an interrupted build is dropped first.
    Concurrent { sql: String, index: Option<String> },
}

/// Splits a rendered migration into steps: consecutive ordinary statements form one locked step, each
/// statement that says `CONCURRENTLY` is a step of its own. Statements end with `;` at the end of a line;
/// `--` comment lines are dropped.
fn plan(sql: &str) -> Vec<Step> {
    let text: String = sql
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .map(|line| format!("{line}\n"))
        .collect();
    let mut steps = Vec::new();
    let mut locked = String::new();
    for statement in text.split(";\n").map(str::trim).filter(|s| !s.is_empty()) {
        let words: Vec<&str> = statement.split_whitespace().collect();
        if words.contains(&"CONCURRENTLY") {
            if !locked.is_empty() {
                steps.push(Step::Locked(std::mem::take(&mut locked)));
            }
            let index = match words.as_slice() {
                ["CREATE", "INDEX", "CONCURRENTLY", "IF", "NOT", "EXISTS", name, ..] => {
                    Some(name.to_string())
                }
                _ => None,
            };
            steps.push(Step::Concurrent {
                sql: statement.to_string(),
                index,
            });
        } else {
            locked.push_str(statement);
            locked.push_str(";\n");
        }
    }
    if !locked.is_empty() {
        steps.push(Step::Locked(locked));
    }
    steps
}

/// Runs `sql` in one transaction whose lock waits end after `LOCK_TIMEOUT`; a wait given up is tried again
/// with backoff (the application's transactions holding the table come and go), for up to `LOCK_PATIENCE`.
pub async fn run_locked(client: &mut Client, table: &TableName, sql: &str) -> Result<()> {
    let started = std::time::Instant::now();
    let mut backoff =
        crate::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        let tx = client.transaction().await?;
        tx.batch_execute(&format!(
            "SET LOCAL lock_timeout = {}",
            LOCK_TIMEOUT.as_millis()
        ))
        .await?;
        match tx.batch_execute(sql).await {
            Ok(()) => return Ok(tx.commit().await?),
            Err(error)
                if error.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
            {
                drop(tx); // rolled back
                if started.elapsed() > LOCK_PATIENCE {
                    return Err(Error::setup(
                        format!(
                            "migrate could not lock {table} for {} minutes: a long transaction holds it",
                            LOCK_PATIENCE.as_secs() / 60
                        ),
                        format!("find it with `SELECT pid, xact_start, query FROM pg_stat_activity WHERE pid IN (SELECT pid FROM pg_locks WHERE relation = to_regclass('{table}'))`, end it, and run migrate again"),
                    ));
                }
                let delay = backoff.next_delay();
                tracing::info!(%table, retry_in = ?delay, "the table is busy: waiting for a moment without a long lock queue");
                tokio::time::sleep(delay).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Runs a `CONCURRENTLY` step outside any transaction. A concurrent build that was interrupted leaves an
/// invalid index behind, which `IF NOT EXISTS` would keep forever: it is dropped and built again.
async fn run_concurrent(
    client: &Client,
    schema: &str,
    sql: &str,
    index: Option<&str>,
) -> Result<()> {
    if let Some(index) = index {
        let qualified = format!("\"{schema}\".{index}");
        let invalid: Option<bool> = client
            .query_opt(
                "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)",
                &[&qualified],
            )
            .await?
            .map(|row| row.get(0));
        if invalid == Some(true) {
            tracing::info!(index = %qualified, "dropping an index an interrupted build left invalid");
            client
                .batch_execute(&format!("DROP INDEX CONCURRENTLY IF EXISTS {qualified}"))
                .await?;
        }
    }
    // A lock_timeout from the URL would cut a long build short; the build blocks no application write.
    client.batch_execute("SET lock_timeout = 0").await?;
    client.batch_execute(sql).await?;
    Ok(())
}

/// Records, in the comment of `published_at`, the WAL position up to which rows were marked published before
/// outboxd ('-infinity'): every such row committed before it. A slot lost or replaced before it had confirmed
/// that position may not have streamed them all; the CDC path then hands them all to the polling path
/// ([`crate::pg::outbox::republish_history_a_lost_slot_owed`]), and retention keeps them. Returns the mark,
/// pending until [`record_history_streamed`] says no slot owes them. A comment needs no grant to read.
async fn mark_history(client: &mut Client, table: &OutboxTable) -> Result<HistoryMark> {
    let position = super::current_wal_position(client).await?;
    let mark = HistoryMark {
        position,
        streamed: false,
    };
    write_history_mark(client, table, &mark).await?;
    Ok(mark)
}

async fn write_history_mark(
    client: &mut Client,
    table: &OutboxTable,
    mark: &HistoryMark,
) -> Result<()> {
    run_locked(
        client,
        &table.name,
        &format!(
            "COMMENT ON COLUMN {}.published_at IS '{}'",
            table.name.quoted(),
            mark.comment()
        ),
    )
    .await
}

/// A pending history mark of `table` whose slot has confirmed past it is recorded as owed by none. Without
/// the slot (lost, dropped, failed over, or migrate given another `--slot`) it stays pending: the slot that
/// owed the rows may never have streamed them, and the next slot hands them to the polling path. Not while
/// a slot is being created (a slot created since the mark has confirmed past it without streaming them).
async fn record_history_streamed(
    client: &mut Client,
    table: &OutboxTable,
    slot: &str,
) -> Result<()> {
    let Some(mark) = crate::pg::outbox::history_mark(&*client, table).await? else {
        return Ok(());
    };
    if mark.streamed {
        return Ok(());
    }
    let owed = match slot::slot_state(client, slot).await? {
        None => true,
        Some(state) => {
            state.wal_status.as_deref() == Some("lost")
                || !mark.owed_by_none(state.confirmed_flush())
                || slot::creation_in_progress(client, slot).await?
        }
    };
    if !owed {
        write_history_mark(
            client,
            table,
            &HistoryMark {
                streamed: true,
                ..mark
            },
        )
        .await?;
    }
    Ok(())
}

/// Right after rows were marked published before outboxd: rows committed before that whose slot has not
/// streamed them yet are safe only while the slot lives (it still sends them; the CDC path publishes marked
/// rows it meets). Waits up to [`HISTORY_WAIT`] for a streaming slot to pass the current WAL position;
/// returns the slot's position and the target when it has not (slot inactive or behind).
async fn history_owed_by_slot(
    client: &Client,
    slot: &str,
) -> Result<Option<(crate::lsn::Lsn, crate::lsn::Lsn)>> {
    let target: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let Ok(target) = target.parse::<crate::lsn::Lsn>() else {
        return Ok(None);
    };
    let started = std::time::Instant::now();
    loop {
        let Some(state) = slot::slot_state(client, slot).await? else {
            return Ok(None); // no slot: nothing streams those rows, nothing can skip them
        };
        let position = state.confirmed_flush().unwrap_or(crate::lsn::Lsn::ZERO);
        if position >= target || state.wal_status.as_deref() == Some("lost") {
            // Lost: the next slot's hand-off covers what it missed (see README).
            return Ok((position < target).then_some((position, target)));
        }
        if !state.active || started.elapsed() > HISTORY_WAIT {
            return Ok(Some((position, target)));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `CREATE INDEX CONCURRENTLY IF NOT EXISTS <index> ON <table> <definition>` for a partitioned table, the way
/// PostgreSQL allows it without locking out writes: the parent's index `ON ONLY` the parent (invalid, and built
/// in no time), then each partition's index built concurrently and attached; the parent's index is valid once
/// every partition's is attached, and partitions created later get theirs with their creation.
async fn build_partitioned_index(
    client: &mut Client,
    table: &OutboxTable,
    index: &str,
    sql: &str,
) -> Result<()> {
    let parent = table.name.quoted();
    let Some((_, definition)) = sql.split_once(&format!(" ON {parent} ")) else {
        return Err(Error::bug(format!(
            "cannot read the index statement of migrate for {parent}: {sql}"
        )));
    };
    let parent_index = format!("\"{}\".{index}", table.name.schema);
    run_locked(
        client,
        &table.name,
        &format!("CREATE INDEX IF NOT EXISTS {index} ON ONLY {parent} {definition}"),
    )
    .await?;
    let partitions = client
        .query(
            "SELECT c.oid::regclass::text, n.nspname::text, c.relname::text, c.relkind = 'p',
                    EXISTS (SELECT 1 FROM pg_inherits attached JOIN pg_index x ON x.indexrelid = attached.inhrelid
                            WHERE attached.inhparent = to_regclass($2) AND x.indrelid = c.oid)
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE i.inhparent = to_regclass($1)",
            &[&parent, &parent_index],
        )
        .await?;
    for partition in partitions {
        let (name, schema, bare, partitioned, attached): (String, String, String, bool, bool) = (
            partition.get(0),
            partition.get(1),
            partition.get(2),
            partition.get(3),
            partition.get(4),
        );
        if attached {
            continue;
        }
        if partitioned {
            return Err(Error::setup(
                format!("partition {name} of {parent} is itself partitioned: migrate builds indexes of one level of partitions only"),
                format!("create the index yourself (`CREATE INDEX {index} ON {parent} {definition}` builds it on every level, locking out writes while it runs), then run migrate again"),
            ));
        }
        let partition_index = format!("\"{}\"", derived_name(&bare, index.trim_matches('"')));
        run_concurrent(
            client,
            &schema,
            &format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS {partition_index} ON {name} {definition}"
            ),
            Some(&partition_index),
        )
        .await?;
        run_locked(
            client,
            &table.name,
            &format!("ALTER INDEX {parent_index} ATTACH PARTITION \"{schema}\".{partition_index}"),
        )
        .await?;
    }
    Ok(())
}

/// True when the table's claim index exists, is valid and reads in `position NULLS FIRST` order already.
async fn claim_index_in_order(client: &Client, table: &OutboxTable) -> Result<bool> {
    let index = format!(
        "\"{}\".\"{}\"",
        table.name.schema,
        derived_name(&table.name.name, "claim_idx")
    );
    let definition: Option<String> = client
        .query_opt(
            "SELECT pg_get_indexdef(indexrelid) FROM pg_index
             WHERE indexrelid = to_regclass($1) AND indisvalid",
            &[&index],
        )
        .await?
        .map(|row| row.get(0));
    Ok(definition.is_some_and(|d| {
        d.contains("(\"position\" NULLS FIRST") || d.contains("(position NULLS FIRST")
    }))
}

/// Creates each outbox table that does not exist yet (with the polling columns), adds the polling columns
/// to an existing table only when `--add-polling-columns` asks, then creates or extends the publication.
pub async fn migrate(
    client: &mut Client,
    settings: &DatabaseSettings<TableSpec>,
) -> Result<MigrationReport> {
    // Waits by polling, never inside a statement: a concurrent index build waits for every open transaction,
    // and one blocked in `pg_advisory_lock` behind the builder's own session would be a deadlock.
    // The former lock is waited for at most LOCK_PATIENCE: held longer, it is an application's lock on that
    // bigint (an earlier version's migrate is done well before), and migrate goes on without it.
    // Every name migrate means is resolved in the system catalog or qualified: no object another role
    // creates in a schema on the user's search_path stands in for one (security review M2).
    client
        .batch_execute("SET search_path = pg_catalog, pg_temp")
        .await?;
    let lock = format!("SELECT {}", lock_call("pg_try_advisory_lock", "$1"));
    let mut held = false;
    let mut said = false;
    let mut waiting_for_former = None;
    let former_held = loop {
        if !held {
            held = client
                .query_one(&lock, &[&MIGRATION_LOCK_KEY])
                .await?
                .get(0);
        }
        if held {
            let former: bool = client
                .query_one(
                    "SELECT pg_try_advisory_lock($1)",
                    &[&FORMER_MIGRATION_LOCK_KEY],
                )
                .await?
                .get(0);
            if former {
                break true;
            }
            let waited = waiting_for_former.get_or_insert_with(std::time::Instant::now);
            if waited.elapsed() > LOCK_PATIENCE {
                tracing::warn!(
                    key = FORMER_MIGRATION_LOCK_KEY,
                    "the migration lock of earlier versions (pg_advisory_lock(bigint), the keyspace applications use too) has been held for {} minutes: taken for an application's lock on that bigint (a migrate of an earlier version rarely runs that long), migrating without it",
                    LOCK_PATIENCE.as_secs() / 60
                );
                break false;
            }
        }
        if !said {
            tracing::info!("another outboxd migrate is running: waiting for it to finish");
            said = true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let result = migrate_under_lock(client, settings).await;
    // The locks also end with the session.
    let unlock = format!("SELECT {}", lock_call("pg_advisory_unlock", "$1"));
    let _ = client.execute(&unlock, &[&MIGRATION_LOCK_KEY]).await;
    if former_held {
        let _ = client
            .execute(
                "SELECT pg_advisory_unlock($1)",
                &[&FORMER_MIGRATION_LOCK_KEY],
            )
            .await;
    }
    result
}

/// `public.outboxd_migrations` is migrate's own: a plain table owned by a role trusted with migrate's rights,
/// without triggers, rules or row-level security. One created beforehand by another role (who may create in `public`) could run its
/// code with migrate's rights through a trigger, or make migrate skip migrations (security review M2).
async fn check_migrations_table(client: &Client) -> Result<()> {
    let row = client
        .query_one(
            // Trusted owners: those who hold this role's rights already, so that code of theirs running with
            // them gains nothing: this role; a superuser; a role that is a member of this one, unless this
            // one is a superuser (membership in a superuser role does not make a superuser). A role this one
            // is a member of is not trusted: its code would run with rights it does not have.
            "SELECT pg_get_userbyid(c.relowner),
                    c.relowner = me.oid OR owner.rolsuper
                        OR (NOT me.rolsuper AND pg_has_role(c.relowner, me.oid, 'MEMBER')),
                    c.relkind = 'r', c.relrowsecurity,
                    EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = c.oid AND NOT t.tgisinternal),
                    EXISTS (SELECT 1 FROM pg_rewrite r WHERE r.ev_class = c.oid)
             FROM pg_class c JOIN pg_roles owner ON owner.oid = c.relowner,
                  (SELECT oid, rolsuper FROM pg_roles WHERE rolname = current_user) me
             WHERE c.oid = 'public.outboxd_migrations'::regclass",
            &[],
        )
        .await?;
    let (owner, own, plain, row_security, triggers, rules): (String, bool, bool, bool, bool, bool) = (
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
    );
    let problem = if !own {
        Some(format!(
            "is owned by role {owner}, whose code must not run with the rights of the role migrate runs as"
        ))
    } else if !plain {
        Some("is not a plain table".to_string())
    } else if triggers || rules || row_security {
        Some(
            "has triggers, rules or row-level security, which would run with migrate's rights"
                .to_string(),
        )
    } else {
        None
    };
    match problem {
        None => Ok(()),
        Some(problem) => Err(Error::setup(
            format!("public.outboxd_migrations {problem}: migrate stops before reading or writing it"),
            "find out who created it (another role that may create tables in schema public could plant it to run its code as migrate); drop it if it is not outboxd's own (DROP TABLE public.outboxd_migrations: migrate recreates it and its migrations are idempotent), and REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        )),
    }
}

/// Who besides [`trusted_owner`]s may own an object migrate uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AlsoTrusted {
    /// Nobody.
    Nobody,
    /// The database's owner, for a schema: it owns `public` on PostgreSQL 15+ (`pg_database_owner`) and
    /// controls the database anyway, so a schema of its holds nothing another role planted.
    DatabaseOwner,
}

/// Refuses an object migrate would use (alter, or have run in every insert) that a role without migrate's
/// rights owns: created before migrate by a role that may create in its schema, it would be that role's (its
/// triggers, its function's body, a schema's objects it may drop and replace) while outboxd publishes from
/// it (security review M2). `owner_sql` selects the owner's oid for `$1` = `key`; no row: the object does
/// not exist (migrate creates it, as its own).
async fn check_owner(
    client: &impl GenericClient,
    kind: &str,
    name: &str,
    (owner_sql, key): (&str, &str),
    also: AlsoTrusted,
) -> Result<()> {
    let database_owner = match also {
        AlsoTrusted::Nobody => "false",
        AlsoTrusted::DatabaseOwner => {
            "o.owner = (SELECT datdba FROM pg_database WHERE datname = current_database())"
        }
    };
    let sql = format!(
        "SELECT pg_get_userbyid(o.owner), {} OR {database_owner} FROM ({owner_sql}) AS o(owner)",
        trusted_owner("o.owner")
    );
    let Some(row) = client.query_opt(&sql, &[&key]).await? else {
        return Ok(());
    };
    let (owner, trusted): (String, bool) = (row.get(0), row.get(1));
    if trusted {
        return Ok(());
    }
    Err(Error::setup(
        format!("{kind} {name} is owned by role {owner}, which does not hold the rights of the role migrate runs as: its code (triggers, a function's body) would run with them, and outboxd would publish from an object another role controls"),
        format!("run outboxd migrate as role {owner} (or a role it is a member of), or, if {owner} is not yours, find out who created {name} and drop it (migrate creates it again) or give it to a role you trust (ALTER {} {name} OWNER TO ...)", kind.to_uppercase()),
    ))
}

/// The owner of relation `$1` (a quoted, qualified name).
const RELATION_OWNER: &str = "SELECT c.relowner FROM pg_class c WHERE c.oid = to_regclass($1)";

/// Checks what migrate creates next to an outbox table only when it is missing (its schema, the inbox table
/// `consumed_event`, the position sequence) the way [`check_owner`] checks the table: a role that may create
/// in the schema could plant any of them first.
async fn check_neighbours(client: &impl GenericClient, table: &TableName) -> Result<()> {
    let schema = format!("\"{}\"", table.schema);
    check_owner(
        client,
        "schema",
        &schema,
        (SCHEMA_OWNER, &table.schema),
        AlsoTrusted::DatabaseOwner,
    )
    .await?;
    let inbox = format!("{schema}.consumed_event");
    check_owner(
        client,
        "table",
        &inbox,
        (RELATION_OWNER, &inbox),
        AlsoTrusted::Nobody,
    )
    .await?;
    let sequence = format!("{schema}.\"{}\"", derived_name(&table.name, "position_seq"));
    check_owner(
        client,
        "sequence",
        &sequence,
        (RELATION_OWNER, &sequence),
        AlsoTrusted::Nobody,
    )
    .await?;
    for relation in [replay_tables(table).progress, replay_tables(table).replayed] {
        check_owner(
            client,
            "table",
            &relation,
            (RELATION_OWNER, &relation),
            AlsoTrusted::Nobody,
        )
        .await?;
    }
    check_index_names(client, table).await
}

/// SQL listing the roles (`PUBLIC` for everyone) that may insert into the table `table` (an SQL expression of
/// its name: a literal or a parameter), table-wide or into some column, but may not draw from the sequence of
/// its `position` column: PostgreSQL evaluates the column's default, `nextval`, with the inserting role's
/// rights, so every insert of such a role fails ("permission denied for sequence"). The table's owner is not
/// listed (it owns the sequence too). Nothing without a sequence behind `position`.
pub fn inserters_without_position_sequence(table: &str) -> String {
    format!(
        "SELECT CASE WHEN i.grantee = 0 THEN 'PUBLIC' ELSE i.grantee::regrole::text END
         FROM pg_class c
         CROSS JOIN LATERAL (SELECT pg_get_serial_sequence({table}, 'position')::regclass AS oid) seq
         CROSS JOIN LATERAL (SELECT a.grantee FROM aclexplode(c.relacl) a WHERE a.privilege_type = 'INSERT'
                             UNION
                             SELECT a.grantee FROM pg_attribute att CROSS JOIN LATERAL aclexplode(att.attacl) a
                             WHERE att.attrelid = c.oid AND a.privilege_type = 'INSERT') i
         WHERE c.oid = ({table})::regclass AND seq.oid IS NOT NULL AND i.grantee <> c.relowner
           AND CASE WHEN i.grantee = 0
                    THEN NOT EXISTS (SELECT 1 FROM pg_class s CROSS JOIN LATERAL aclexplode(s.relacl) a
                                     WHERE s.oid = seq.oid AND a.grantee = 0 AND a.privilege_type IN ('USAGE', 'UPDATE'))
                    ELSE NOT has_sequence_privilege(i.grantee, seq.oid, 'USAGE, UPDATE') END
         ORDER BY 1"
    )
}

/// A statement granting USAGE on `table`'s position sequence to every role
/// [`inserters_without_position_sequence`] lists. Run by the migration that sets the default (in its
/// transaction) and by every migrate after it (a role granted INSERT since).
fn grant_position_sequence_to_inserters(table: &TableName) -> String {
    let literal = format!("'{}'", table.quoted().replace('\'', "''"));
    format!(
        "DO $grant$ DECLARE role_name text; BEGIN
         FOR role_name IN {} LOOP
             EXECUTE format('GRANT USAGE ON SEQUENCE %s TO %s', pg_get_serial_sequence({literal}, 'position'), role_name); END LOOP; END
         $grant$",
        inserters_without_position_sequence(&literal)
    )
}

/// The names of the indexes migrate builds on an outbox table.
const INDEX_SUFFIXES: [&str; 5] = [
    "claim_idx",
    "claim_idx_next",
    "dead_idx",
    "handoff_idx",
    "published_idx",
];

/// `CREATE INDEX IF NOT EXISTS` goes by name: a relation of that name that is not an index of `table` (another
/// table's index, one another role planted) would be taken for it, leaving the table without the index its
/// queries need (a claim reading the whole table), and 0004 would drop the real claim index for it.
async fn check_index_names(client: &impl GenericClient, table: &TableName) -> Result<()> {
    let names: Vec<String> = INDEX_SUFFIXES
        .iter()
        .map(|suffix| derived_name(&table.name, suffix))
        .collect();
    let squatted = client
        .query(
            "SELECT c.relname::text, pg_get_userbyid(c.relowner)::text FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = ANY ($2)
               AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indexrelid = c.oid
                               AND i.indrelid = to_regclass($3))",
            &[&table.schema, &names, &table.quoted()],
        )
        .await?;
    match squatted.first() {
        None => Ok(()),
        Some(row) => {
            let (name, owner): (String, String) = (row.get(0), row.get(1));
            Err(Error::setup(
                format!("\"{}\".\"{name}\" (owner {owner}) is not an index of {table}, but has the name migrate gives one of its indexes: migrate would take it for its own and the table would lack the index its queries need", table.schema),
                format!("find out who created it; drop or rename it (ALTER INDEX \"{}\".\"{name}\" RENAME TO ...), then run migrate again", table.schema),
            ))
        }
    }
}

async fn migrate_under_lock(
    client: &mut Client,
    settings: &DatabaseSettings<TableSpec>,
) -> Result<MigrationReport> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS public.outboxd_migrations (
                 target text NOT NULL, version integer NOT NULL, name text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (target, version))",
        )
        .await?;
    check_migrations_table(client).await?;
    // Before anything is created, and again right before the publication is used (created meanwhile).
    let as_created: Vec<OutboxTable> = settings.tables.iter().map(TableSpec::as_created).collect();
    slot::check_publication_owner(&*client, &settings.publication, &as_created).await?;
    let mut report = MigrationReport::default();
    let mut tables = Vec::with_capacity(settings.tables.len());
    for spec in &settings.tables {
        // Until it is inspected: the table as migrate creates it (its first migration, when it is missing).
        let mut table = spec.as_created();
        let target = table.name.to_string();
        let created_here = !table_exists(&*client, &table.name).await?;
        if !created_here {
            check_owner(
                &*client,
                "table",
                &table.name.to_string(),
                (RELATION_OWNER, &table.name.quoted()),
                AlsoTrusted::Nobody,
            )
            .await?;
        }
        check_neighbours(&*client, &table.name).await?;
        // An earlier migrate added the polling columns: keep upgrading them.
        let has_polling_migrations: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM public.outboxd_migrations WHERE target = $1 AND version > $2)",
                &[&target, &CREATE_TABLE_VERSION],
            )
            .await?
            .get(0);
        for (version, name, sql) in MIGRATIONS {
            let done = client
                .query_opt(
                    "SELECT 1 FROM public.outboxd_migrations WHERE target = $1 AND version = $2",
                    &[&target, version],
                )
                .await?;
            if done.is_some() {
                // A claim index dropped (or left invalid) since is built again, by the migration that
                // builds it in order (the claim and the backlog figures read it).
                if *version == CLAIM_ORDER_VERSION && !claim_index_in_order(client, &table).await? {
                    table = slot::inspect(&*client, table.spec()).await?;
                    tracing::info!(table = %table.name, "the claim index is missing or invalid: building it again");
                    apply(client, &table, &render_migration(sql, &table, None)).await?;
                }
                continue;
            }
            let mut existing_rows = None;
            if *version > CREATE_TABLE_VERSION {
                table = slot::inspect(&*client, table.spec()).await?;
                if !created_here && !has_polling_migrations && !settings.add_polling_columns {
                    report.cdc_only.push(target.clone());
                    break;
                }
                existing_rows =
                    (!created_here && !table.marks_published).then_some(settings.existing_rows);
            }
            let skip =
                *version == CLAIM_ORDER_VERSION && claim_index_in_order(client, &table).await?;
            if !skip {
                let rendered = render_migration(sql, &table, existing_rows);
                apply(client, &table, &rendered).await?;
            }
            if existing_rows == Some(ExistingRows::Published) {
                let mark = mark_history(client, &table).await?;
                match history_owed_by_slot(client, &settings.slot).await? {
                    Some(owed) => {
                        report
                            .history_awaiting_slot
                            .push((target.clone(), owed.0, owed.1))
                    }
                    None => {
                        let streamed = HistoryMark {
                            streamed: true,
                            ..mark
                        };
                        write_history_mark(client, &table, &streamed).await?;
                    }
                }
            }
            client
                .execute(
                    "INSERT INTO public.outboxd_migrations (target, version, name) VALUES ($1, $2, $3)
                     ON CONFLICT DO NOTHING",
                    &[&target, version, name],
                )
                .await?;
            report.applied.push(format!("{target} {version:04}_{name}"));
        }
        // Again: CREATE ... IF NOT EXISTS keeps what another role may have created since the first check.
        check_neighbours(&*client, &table.name).await?;
        let table = slot::inspect(&*client, table.spec()).await?;
        if table.polling {
            record_history_streamed(client, &table, &settings.slot).await?;
            run_locked(
                client,
                &table.name,
                &grant_position_sequence_to_inserters(&table.name),
            )
            .await?;
        }
        tables.push(table);
    }
    slot::check_publication_owner(&*client, &settings.publication, &tables).await?;
    report.publication_created = ensure_publication(client, &settings.publication, &tables).await?;
    Ok(report)
}

/// Runs one rendered migration step by step: statements that lock the table briefly under `run_locked`,
/// index builds concurrently (or, on a partitioned table, per partition).
async fn apply(client: &mut Client, table: &OutboxTable, rendered: &str) -> Result<()> {
    for step in plan(rendered) {
        match step {
            Step::Locked(sql) => run_locked(client, &table.name, &sql).await?,
            // PostgreSQL builds no index of a partitioned table concurrently, and drops none.
            Step::Concurrent {
                sql,
                index: Some(index),
            } if table.partitioned => build_partitioned_index(client, table, &index, &sql).await?,
            Step::Concurrent { sql, index: None } if table.partitioned => {
                run_locked(client, &table.name, &sql.replace(" CONCURRENTLY", "")).await?
            }
            Step::Concurrent { sql, index } => {
                run_concurrent(client, &table.name.schema, &sql, index.as_deref()).await?
            }
        }
    }
    Ok(())
}

/// The publication covers every table (inserts only, partitions as their root); true when it was created.
async fn ensure_publication(
    client: &mut Client,
    publication: &str,
    tables: &[OutboxTable],
) -> Result<bool> {
    let partitioned = tables.iter().any(|t| t.partitioned);
    let mut created = false;
    for table in tables {
        let name = &table.name;
        let statement = match slot::publication_state(&*client, publication, name).await? {
            None => {
                created = true;
                Some(format!(
                    "CREATE PUBLICATION \"{publication}\" FOR TABLE {}
                     WITH (publish = 'insert', publish_via_partition_root = true)",
                    name.quoted()
                ))
            }
            Some(state) => {
                let mut sql = String::new();
                if partitioned && !state.via_root {
                    sql.push_str(&format!(
                        "ALTER PUBLICATION \"{publication}\" SET (publish_via_partition_root = true);"
                    ));
                }
                if !state.covers_table {
                    sql.push_str(&format!(
                        "ALTER PUBLICATION \"{publication}\" ADD TABLE {};",
                        name.quoted()
                    ));
                }
                (!sql.is_empty()).then_some(sql)
            }
        };
        if let Some(sql) = statement {
            run_locked(client, name, &sql).await?;
        }
    }
    Ok(created)
}

/// The NOTIFY channel of an outbox table's insert trigger, also the name of the trigger's function:
/// `outboxd_<schema>_<table>` cut to fit, then a hash of the full name, so it stays within PostgreSQL's
/// 63 bytes (a longer channel makes `pg_notify` fail, and with it every insert into the table) and two
/// tables never share it. Stable across versions: pollers and the trigger must agree on it.
pub fn notify_channel(table: &TableName) -> String {
    const READABLE: usize = 63 - "outboxd_".len() - "_".len() - 16;
    let readable: String = format!("{}_{}", table.schema, table.name)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(READABLE)
        .collect();
    format!(
        "outboxd_{readable}_{:016x}",
        fnv1a(format!("{}.{}", table.schema, table.name).as_bytes())
    )
}

/// The channel name earlier builds used (`outboxd_<schema>_<table>`, too long for long names); its function is
/// dropped on upgrade.
fn legacy_notify_channel(table: &TableName) -> String {
    format!("outboxd_{}_{}", table.schema, table.name)
}

/// Installs the statement-level trigger that wakes `--poll-notify` pollers (only when asked: NOTIFY takes a
/// database-wide lock at commit and serialises every committing transaction that notifies). Its function runs
/// in every inserting transaction, with the inserter's rights: its `search_path` is pinned, so that no object
/// another role creates can stand in for the one it calls (security review M2).
/// The trigger's creation locks the table against writes: it waits under `lock_timeout`, like a migration.
pub async fn install_notify_trigger(client: &mut Client, table: &TableName) -> Result<()> {
    let channel = notify_channel(table);
    let function = format!("\"{}\".\"{channel}\"", table.schema);
    client
        .batch_execute(&format!(
            "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql
                 SET search_path = pg_catalog, pg_temp AS
                 $$ BEGIN PERFORM pg_catalog.pg_notify('{channel}', ''); RETURN NULL; END $$"
        ))
        .await?;
    check_owner(
        &*client,
        "function",
        &function,
        (
            "SELECT p.proowner FROM pg_proc p WHERE p.oid = to_regprocedure($1)",
            &format!("{function}()"),
        ),
        AlsoTrusted::Nobody,
    )
    .await?;
    run_locked(
        client,
        table,
        &format!(
            "CREATE OR REPLACE TRIGGER outboxd_notify AFTER INSERT ON {} FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
            table.quoted()
        ),
    )
    .await?;
    // The trigger no longer calls an older version's function (which, for a long table name, notified on
    // a channel PostgreSQL refuses).
    let legacy = legacy_notify_channel(table);
    if legacy != channel {
        client
            .batch_execute(&format!(
                "DROP FUNCTION IF EXISTS \"{}\".\"{legacy}\"()",
                table.schema
            ))
            .await?;
    }
    Ok(())
}

/// Whether `table` has outboxd's insert trigger, and whether it notifies on this version's channel.
pub async fn notify_trigger(client: &Client, table: &TableName) -> Result<NotifyTrigger> {
    let function: Option<String> = client
        .query_opt(
            "SELECT p.proname::text FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
             WHERE t.tgname = 'outboxd_notify' AND t.tgrelid = to_regclass($1)",
            &[&table.quoted()],
        )
        .await?
        .map(|row| row.get(0));
    Ok(match function {
        None => NotifyTrigger::Missing,
        Some(function) if function == notify_channel(table) => NotifyTrigger::Current,
        Some(_) => NotifyTrigger::Outdated,
    })
}

/// Whether an outbox table has outboxd's LISTEN/NOTIFY insert trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifyTrigger {
    /// No trigger.
    Missing,
    /// Notifies on this version's channel.
    Current,
    /// Installed by an older version, on another channel.
    Outdated,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::TableStyle;

    #[test]
    fn migrations_lock_briefly_and_build_indexes_concurrently() {
        let table = TableSpec::new(
            TableName {
                schema: "public".into(),
                name: "outbox_event".into(),
            },
            TableStyle::Standard,
            &[],
            vec![],
        )
        .as_created();
        for (version, name, sql) in MIGRATIONS {
            for step in plan(&render_migration(
                sql,
                &table,
                Some(ExistingRows::Published),
            )) {
                match step {
                    Step::Locked(sql) => assert!(
                        !sql.contains("INDEX") || sql.contains("ALTER INDEX"),
                        "migration {version} {name} builds an index under a table lock:\n{sql}"
                    ),
                    Step::Concurrent { sql, index } => {
                        assert!(sql.contains("CONCURRENTLY"));
                        assert_eq!(index.is_some(), sql.starts_with("CREATE"), "{sql}");
                    }
                }
            }
        }
        let steps = plan(&render_migration(
            MIGRATIONS[1].2,
            &table,
            Some(ExistingRows::Published),
        ));
        assert!(
            matches!(&steps[0], Step::Locked(sql) if sql.contains("DEFAULT '-infinity'") && sql.contains("DROP DEFAULT")),
            "{steps:?}"
        );
        assert_eq!(
            steps[1],
            Step::Concurrent {
                sql: "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"outbox_event_claim_idx\" ON \"public\".\"outbox_event\" (position NULLS FIRST, \"created_at\", \"event_id\")\n    WHERE published_at IS NULL AND dead_at IS NULL".into(),
                index: Some("\"outbox_event_claim_idx\"".into()),
            }
        );
        let unmarked = plan(&render_migration(MIGRATIONS[1].2, &table, None));
        assert!(
            matches!(&unmarked[0], Step::Locked(sql) if !sql.contains("infinity") && !sql.contains("DROP DEFAULT")),
            "{unmarked:?}"
        );
    }

    #[test]
    fn every_placeholder_of_every_migration_is_filled() {
        let table = TableSpec::new(
            TableName {
                schema: "app".into(),
                name: "outbox".into(),
            },
            TableStyle::Debezium,
            &[],
            vec![],
        )
        .as_created();
        for (version, name, sql) in MIGRATIONS {
            let rendered = render_migration(sql, &table, Some(ExistingRows::Published));
            assert!(
                !rendered.contains("{{"),
                "migration {version} {name} keeps a placeholder:\n{rendered}"
            );
        }
        assert_eq!(
            MIGRATIONS.iter().map(|m| m.0).collect::<Vec<_>>(),
            (1..=MIGRATIONS.len() as i32).collect::<Vec<_>>()
        );
    }

    #[test]
    fn notify_channels_fit_postgres_and_never_collide() {
        let table = |schema: &str, name: &str| TableName {
            schema: schema.into(),
            name: name.into(),
        };
        // Pinned: a poller and a trigger installed by another version must agree on it.
        assert_eq!(
            notify_channel(&table("public", "outbox_event")),
            "outboxd_public_outbox_event_2843650bfe0a9fc4"
        );
        let long = "order_service_transactional_outbox_events_partitioned_by_month";
        let a = notify_channel(&table("fulfilment_and_inventory_reservations", long));
        let b = notify_channel(&table(
            "fulfilment_and_inventory_reservations",
            &format!("{long}_archive"),
        ));
        for channel in [&a, &b] {
            assert!(channel.len() <= 63, "{channel} is {} bytes", channel.len());
            assert!(channel
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
        }
        assert_ne!(a, b, "tables sharing a long prefix get their own channel");
        assert_ne!(
            notify_channel(&table("a_b", "c")),
            notify_channel(&table("a", "b_c"))
        );
    }

    #[test]
    fn derived_names_fit_postgres_and_keep_short_names() {
        assert_eq!(
            derived_name("outbox_event", "claim_idx"),
            "outbox_event_claim_idx"
        );
        let long = "order_service_transactional_outbox_events_partitioned_by_month";
        let names: Vec<String> = ["position_seq", "claim_idx", "handoff_idx", "published_idx"]
            .iter()
            .map(|suffix| derived_name(long, suffix))
            .collect();
        for name in &names {
            assert!(name.len() <= 63, "{name} is {} bytes", name.len());
        }
        let distinct: std::collections::HashSet<&String> = names.iter().collect();
        assert_eq!(distinct.len(), names.len(), "{names:?}");
        assert_ne!(
            derived_name(&format!("{long}_a"), "claim_idx"),
            derived_name(&format!("{long}_b"), "claim_idx")
        );
        // Cut at a character boundary.
        assert!(derived_name(&"é".repeat(40), "claim_idx").len() <= 63);
    }

    #[test]
    fn every_migration_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let files = std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "sql")
            })
            .count();
        assert_eq!(
            files,
            MIGRATIONS.len(),
            "a file in migrations/ is not listed in MIGRATIONS"
        );
    }
}
