//! Retention: removes published rows older than `--retention`, on `--retention-interval`. A plain table
//! loses them 1,000 rows per short transaction (or moves them to `--archive-table`, column by column name);
//! a partitioned table loses whole range partitions whose upper bound is older than the window and that
//! hold no unpublished row (DETACH, then DROP), which leaves no dead tuples behind. Never touches
//! unpublished rows, nor rows the slot may still send (see [`SlotHorizon`]): a row the stream meets again
//! without its row would be taken for one deleted by its own transaction and published again. With
//! `publish = 'insert'` none of this is streamed by the slot.
//!
//! Every pass's outcome is counted in `/metrics` and written where `outboxd status` (another process) can
//! read it from SQL: the `application_name` of one idle connection the sweeper keeps open,
//! `outboxd retention STATE FAILURES LAST_SUCCESS SLOT` (see [`state_name`], [`read_states`]). That needs
//! no table and no grant, and disappears with the process.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

use crate::config::Retention;
use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::pg::{self, slot};
use crate::table::TableName;
use crate::table::{OutboxTable, Role, TableSpec};

/// Rows per statement: small enough to hold locks only briefly.
const BATCH: i64 = 1_000;

/// How long a retention statement (the partition detach, a batch of deletes) waits for a lock before it gives
/// way (the pass fails, saying so, and the next one tries again). An
/// application's statement that queues behind the wait waits at most this long, so this stays below
/// `deadlock_timeout` (1 s by default) and below any `lock_timeout` an application is likely to use.
const LOCK_TIMEOUT: &str = "500ms";

/// Where the sweeper runs: the settings `run` needs beside the tables.
#[derive(Debug, Clone)]
pub struct Sweeper {
    /// The connection for the sweeper's SQL.
    pub database_url: crate::pg::PgUrl,
    /// The outbox tables to sweep.
    pub tables: Vec<OutboxTable>,
    /// `--retention`, `--archive-table` and `--retention-interval`.
    pub retention: Arc<Retention>,
    /// The replication publication (an archive in it would be republished).
    pub publication: String,
    /// The slot, to tell this deployment's state from another's in `outboxd status`.
    pub slot: String,
}

/// The sweeper: a pass over every table each `--retention-interval`, forever, recording each pass's outcome.
pub async fn run(sweeper: Sweeper) {
    let mut health = Health::default();
    let mut marker: Option<Client> = None;
    let mut slot_horizon = SlotHorizon::default();
    let retention = &sweeper.retention;
    loop {
        let mut failed = false;
        let checked = match check_on_its_own(&sweeper).await {
            Ok(()) => slot_horizon.judge(&sweeper).await,
            Err(error) => Err(error),
        };
        if let Err(error) = &checked {
            tracing::error!(%error, "retention refused; nothing removed");
            crate::metrics::retention_failed();
            failed = true;
        }
        if let Ok(horizon) = checked {
            for table in &sweeper.tables {
                match sweep_once(&sweeper.database_url, table.spec(), retention, &horizon).await {
                    Ok(Removed {
                        rows: 0,
                        partitions,
                        gave_way,
                        ..
                    }) if partitions.is_empty() && gave_way.is_empty() => {}
                    Ok(Removed {
                        rows,
                        partitions,
                        not_archived,
                        gave_way,
                    }) => {
                        for (partition, why) in &gave_way {
                            tracing::warn!(table = %table.name, %partition, reason = %why, "a partition past --retention could not be dropped this pass; trying again next pass (counted as a failed pass)");
                        }
                        if !gave_way.is_empty() {
                            crate::metrics::retention_failed();
                            failed = true;
                        }
                        if rows > 0 || !partitions.is_empty() {
                            tracing::info!(table = %table.name, rows, partitions = ?partitions, archive = ?retention.archive_table.as_ref().map(|t| t.to_string()), "retention removed published rows");
                        }
                        if !not_archived.is_empty() {
                            tracing::warn!(table = %table.name, columns = ?not_archived, "the archive table lacks these columns of the outbox table: their values were not archived (add them to the archive with ALTER TABLE ... ADD COLUMN)");
                        }
                    }
                    Err(error) => {
                        tracing::warn!(table = %table.name, %error, "retention failed; will try again");
                        crate::metrics::retention_failed();
                        failed = true;
                    }
                }
            }
        }
        health.record(!failed, unix_now());
        crate::metrics::retention_health(health.consecutive_failures, health.last_success);
        mark(&mut marker, &sweeper, &health).await;
        tokio::time::sleep(retention.interval).await;
    }
}

/// [`check`] on a connection of its own.
async fn check_on_its_own(sweeper: &Sweeper) -> Result<()> {
    let client = pg::connect(&sweeper.database_url).await?;
    let tables = slot::inspect_all(&client, sweeper.tables.iter().map(OutboxTable::spec)).await?;
    check(&client, &tables, &sweeper.retention, &sweeper.publication).await
}

/// What the slot may still send, which retention keeps. Every pass samples the server's clock and WAL end;
/// once the slot has confirmed past a sample's position, every row published before that sample's time was
/// committed before it, and the slot never sends it again. Rows published since the newest such sample are
/// kept (however old, should the slot lag: a polling fallback with the slot left behind, a stopped leader).
/// Without a slot (or with a lost one, which is replaced by a slot that only hands off unpublished rows)
/// nothing is kept back.
#[derive(Debug, Default)]
pub struct SlotHorizon {
    /// (server time in seconds since the epoch, WAL end then), oldest first.
    samples: std::collections::VecDeque<(f64, Lsn)>,
    /// The time of the newest sample the slot passed.
    passed: Option<f64>,
}

/// Most samples kept (a pass a minute: over a day); a slot lagging longer keeps the oldest bound.
const MOST_SAMPLES: usize = 2_000;

impl SlotHorizon {
    /// Samples and reads the slot (see [`SlotHorizon`]).
    async fn judge(&mut self, sweeper: &Sweeper) -> Result<Horizon> {
        let client = pg::connect(&sweeper.database_url).await?;
        // Recording the history as streamed comments on a column (SHARE UPDATE EXCLUSIVE): behind a
        // concurrent index build or a VACUUM it gives way and is tried again next pass, rather than hanging
        // the pass (or cancelling an autovacuum, which a wait past `deadlock_timeout` would).
        client
            .batch_execute(&format!("SET lock_timeout = '{LOCK_TIMEOUT}'"))
            .await?;
        let row = client
            .query_one(
                // The insert position: every commit record written before the sample lies below it (the
                // write position can lag behind asynchronous commits).
                "SELECT EXTRACT(EPOCH FROM now())::float8, pg_current_wal_insert_lsn()::text",
                &[],
            )
            .await?;
        let (now, wal_end): (f64, String) = (row.get(0), row.get(1));
        let wal_end: Lsn = wal_end.parse().map_err(|_| {
            Error::bug(format!(
                "PostgreSQL answered an unexpected WAL position {wal_end:?}"
            ))
        })?;
        let slot = slot::slot_state(&client, &sweeper.slot).await?;
        let confirmed = match &slot {
            Some(state) if state.wal_status.as_deref() != Some("lost") => {
                Some(state.confirmed_flush().unwrap_or(Lsn::ZERO))
            }
            _ => None,
        };
        let mut horizon = self.horizon(now, wal_end, confirmed);
        // Not while a slot is being created: its hand-off reads the history mark (and republishes a pending
        // one); a slot created since the mark has confirmed past it without ever streaming those rows. Read
        // after the slot: a new slot seen above was marked as being created before it existed, and stays so
        // until its hand-off committed.
        if let Some(confirmed) = confirmed {
            horizon.slot_being_created = slot::creation_in_progress(&client, &sweeper.slot).await?;
            if !horizon.slot_being_created {
                for table in sweeper.tables.iter().filter(|t| t.polling) {
                    crate::pg::outbox::record_history_streamed(&client, table, confirmed).await?;
                }
            }
        }
        Ok(horizon)
    }

    /// The pure rule: `now` and `wal_end` sampled, `confirmed` the slot's position (`None`: no slot).
    fn horizon(&mut self, now: f64, wal_end: Lsn, confirmed: Option<Lsn>) -> Horizon {
        let Some(confirmed) = confirmed else {
            self.samples.clear();
            self.passed = None;
            return Horizon::NO_SLOT;
        };
        self.samples.push_back((now, wal_end));
        if self.samples.len() > MOST_SAMPLES {
            self.samples.pop_back();
        }
        while let Some(&(at, position)) = self.samples.front() {
            if position > confirmed {
                break;
            }
            self.passed = Some(at);
            self.samples.pop_front();
        }
        Horizon {
            published_before: self.passed.unwrap_or(f64::NEG_INFINITY),
            slot_confirmed: Some(confirmed),
            slot_being_created: false,
        }
    }
}

/// What one retention pass may remove, by what the slot may still send.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Horizon {
    /// Rows published before this (seconds since the epoch, on the server's clock) will not be sent again:
    /// infinite without a slot, minus infinity while the slot has passed no sample yet.
    pub published_before: f64,
    /// The slot's confirmed position; `None` without a slot.
    pub slot_confirmed: Option<Lsn>,
    /// A slot is being created: its hand-off may still republish rows marked published before outboxd.
    pub slot_being_created: bool,
}

impl Horizon {
    /// No slot: nothing is sent again.
    pub const NO_SLOT: Horizon = Horizon {
        published_before: f64::INFINITY,
        slot_confirmed: None,
        slot_being_created: false,
    };

    /// Whether rows marked published before outboxd ('-infinity') may go: no slot owes them (see
    /// [`crate::pg::outbox::HistoryMark`]). Without a slot, a pending mark keeps them: the next slot hands
    /// them to the polling path; so does a slot being created, whose hand-off may republish them (its
    /// position says nothing of rows it never streamed).
    pub fn history_may_go(&self, mark: Option<crate::pg::outbox::HistoryMark>) -> bool {
        mark.is_none_or(|mark| {
            mark.streamed || (!self.slot_being_created && mark.owed_by_none(self.slot_confirmed))
        })
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Consecutive failed passes and the time of the last successful one.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    /// Passes in a row that failed (0 after a successful one).
    pub consecutive_failures: u64,
    /// Unix seconds; `None` until a pass succeeded.
    pub last_success: Option<u64>,
}

impl Health {
    /// Records one pass's outcome at `now` (Unix seconds).
    pub fn record(&mut self, ok: bool, now: u64) {
        if ok {
            self.consecutive_failures = 0;
            self.last_success = Some(now);
        } else {
            self.consecutive_failures += 1;
        }
    }
}

const MARKER: &str = "outboxd retention";

/// The marker connection's `application_name`: `outboxd retention ok|failing FAILURES LAST_SUCCESS SLOT`
/// (LAST_SUCCESS in Unix seconds, 0 for never), cut to PostgreSQL's 63 bytes (slot names are ASCII).
pub fn state_name(health: &Health, slot: &str) -> String {
    let state = if health.consecutive_failures == 0 {
        "ok"
    } else {
        "failing"
    };
    let mut name = format!(
        "{MARKER} {state} {} {} {slot}",
        health.consecutive_failures,
        health.last_success.unwrap_or(0)
    );
    name.truncate(63);
    name
}

/// Parses [`state_name`]; `None` for another deployment's slot or another application.
pub fn parse_state_name(name: &str, slot: &str) -> Option<Health> {
    let rest = name.strip_prefix(MARKER)?.strip_prefix(' ')?;
    let mut fields = rest.splitn(4, ' ');
    let (_state, failures, last, theirs) = (
        fields.next()?,
        fields.next()?.parse().ok()?,
        fields.next()?.parse::<u64>().ok()?,
        fields.next()?,
    );
    let same_slot = theirs == slot || (name.len() == 63 && slot.starts_with(theirs));
    same_slot.then_some(Health {
        consecutive_failures: failures,
        last_success: (last > 0).then_some(last),
    })
}

/// Publishes the state on the marker connection, (re)connecting as needed. Best effort: a database that
/// cannot be reached shows in the pass's own failure.
async fn mark(marker: &mut Option<Client>, sweeper: &Sweeper, health: &Health) {
    if marker.as_ref().is_none_or(|c| c.is_closed()) {
        *marker = pg::connect(&sweeper.database_url).await.ok();
    }
    let Some(client) = marker.as_ref() else {
        return;
    };
    let name = state_name(health, &sweeper.slot);
    if let Err(error) = client
        .execute("SELECT set_config('application_name', $1, false)", &[&name])
        .await
    {
        tracing::debug!(%error, "cannot record the retention state; reconnecting next pass");
        *marker = None;
    }
}

/// The retention state of every running sweeper of `slot`, as `outboxd status` sees it.
pub async fn read_states(client: &Client, slot: &str) -> Result<Vec<Health>> {
    let rows = client
        .query(
            "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE $1",
            &[&format!("{MARKER} %")],
        )
        .await?;
    Ok(rows
        .iter()
        .filter_map(|row| parse_state_name(row.get(0), slot))
        .collect())
}

/// Start-up (and every pass) checks that retention can work as configured: the archive table is none of
/// the outbox tables and not in the publication (its rows would be published again), and the role owns
/// the partitioned tables whose partitions it drops.
pub async fn check(
    client: &Client,
    tables: &[OutboxTable],
    retention: &Retention,
    publication: &str,
) -> Result<()> {
    match &retention.archive_table {
        Some(archive) => check_archive(client, tables, archive, publication).await,
        None => {
            for table in tables.iter().filter(|t| t.partitioned) {
                check_partitioned_by_time(client, &table.name).await?;
                check_owner(client, &table.name, &table.name).await?;
            }
            Ok(())
        }
    }
}

/// A partitioned table's retention drops whole partitions by their upper bound, a point in time: that needs
/// range partitioning on one timestamp (or date) column. On any other key (hash or list on `aggregate_id`, a
/// range of numbers or of two columns) no partition could ever be judged, and every pass would remove
/// nothing while reporting success.
async fn check_partitioned_by_time(client: &Client, table: &TableName) -> Result<()> {
    let row = client
        .query_one(
            "SELECT pg_get_partkeydef(p.partrelid),
                    p.partstrat = 'r' AND p.partnatts = 1
                    AND coalesce((SELECT a.atttypid IN ('timestamptz'::regtype, 'timestamp'::regtype, 'date'::regtype)
                                  FROM pg_attribute a WHERE a.attrelid = p.partrelid AND a.attnum = p.partattrs[0]), false)
             FROM pg_partitioned_table p WHERE p.partrelid = $1::text::regclass",
            &[&table.quoted()],
        )
        .await?;
    let (key, by_time): (String, bool) = (row.get(0), row.get(1));
    if by_time {
        return Ok(());
    }
    Err(Error::setup(
        format!("--retention drops whole partitions of a partitioned table once their upper bound is past the window, but {table} is partitioned by {key}, not by a range of one timestamp column: no partition could ever be dropped"),
        format!("add --archive-table (published rows are then moved out one by one), or partition {table} by RANGE on a timestamp column such as created_at"),
    ))
}

async fn check_archive(
    client: &Client,
    tables: &[OutboxTable],
    archive: &TableName,
    publication: &str,
) -> Result<()> {
    check_archive_owner(client, tables, archive).await?;
    let archive_oid: Option<u32> = client
        .query_one("SELECT to_regclass($1)::oid", &[&archive.quoted()])
        .await?
        .get(0);
    for table in tables {
        let oid: Option<u32> = client
            .query_one("SELECT to_regclass($1)::oid", &[&table.name.quoted()])
            .await?
            .get(0);
        if (archive_oid.is_some() && oid == archive_oid) || *archive == table.name {
            return Err(Error::setup(
                format!("--archive-table {archive} is an outbox table (--table {}): archived rows would be published again", table.name),
                format!("name a table of its own, e.g. --archive-table {}_archive", table.name),
            ));
        }
    }
    let all_tables: Option<bool> = client
        .query_opt(
            "SELECT puballtables FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?
        .map(|row| row.get(0));
    if all_tables == Some(true) {
        return Err(Error::setup(
            format!("--archive-table {archive} is in the publication {publication} (FOR ALL TABLES): every archived row would be published again"),
            format!("recreate the publication for the outbox tables only (CREATE PUBLICATION {publication} FOR TABLE ... WITH (publish = 'insert'), see README)"),
        ));
    }
    let published = client
        .query_opt(
            "SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
            &[&publication, &archive.schema, &archive.name],
        )
        .await?
        .is_some();
    if published {
        return Err(Error::setup(
            format!("--archive-table {archive} is in the publication {publication}: every archived row would be published again"),
            format!("ALTER PUBLICATION {publication} DROP TABLE {archive}"),
        ));
    }
    Ok(())
}

/// Refuses an archive table, or the schema it is (to be) created in, that a role outboxd does not trust owns:
/// its triggers, rules or row security would run as outboxd's role (which holds REPLICATION and writes to
/// the outbox) with every archived row, and a schema's owner may drop outboxd's archive and plant another.
/// Trusted: outboxd's role and who holds its rights already (migrate's rule), the outbox tables' owners and
/// their members (their triggers run as outboxd already, and README tells them to create the archive), the
/// database's owner for the schema.
async fn check_archive_owner(
    client: &Client,
    tables: &[OutboxTable],
    archive: &TableName,
) -> Result<()> {
    let outbox_tables: Vec<String> = tables.iter().map(|t| t.name.quoted()).collect();
    let trusted = |owner: &str| {
        format!(
            "({} OR EXISTS (SELECT 1 FROM pg_class outbox
                            WHERE outbox.oid = ANY (SELECT to_regclass(t) FROM unnest($2::text[]) AS t)
                              AND pg_has_role({owner}, outbox.relowner, 'MEMBER')))",
            pg::ownership::trusted_owner(owner)
        )
    };
    let schema = client
        .query_opt(
            &format!(
                "SELECT pg_get_userbyid(o.owner)::text,
                        {} OR o.owner = (SELECT datdba FROM pg_database WHERE datname = current_database())
                 FROM ({}) AS o(owner)",
                trusted("o.owner"),
                pg::ownership::SCHEMA_OWNER
            ),
            &[&archive.schema, &outbox_tables],
        )
        .await?;
    let table = client
        .query_opt(
            &format!(
                "SELECT pg_get_userbyid(c.relowner)::text, {} AND c.relkind IN ('r', 'p')
                 FROM pg_class c WHERE c.oid = to_regclass($1)",
                trusted("c.relowner")
            ),
            &[&archive.quoted(), &outbox_tables],
        )
        .await?;
    for (what, row) in [("schema", schema), ("table", table)] {
        let Some(row) = row else { continue };
        let (owner, trusted): (String, bool) = (row.get(0), row.get(1));
        if !trusted {
            return Err(Error::setup(
                format!("--archive-table {archive}: its {what} is owned by role {owner}, which outboxd does not trust (neither its own role, one holding its rights, nor the outbox table's owner): code of {owner}'s (a trigger, a rule) would run as outboxd with every archived row, or replace the archive"),
                format!("find out who created it; if {owner} is not yours, drop it (outboxd creates the archive itself with CREATE on the schema) or give it to the outbox table's owner (ALTER {} ... OWNER TO ...); or name an archive in a schema you control", what.to_uppercase()),
            ));
        }
    }
    Ok(())
}

/// The role may DETACH and DROP `partition` of `parent` only as (a member of) its owner: grants are not
/// enough.
async fn check_owner(client: &Client, parent: &TableName, relation: &TableName) -> Result<()> {
    let row = client
        .query_opt(
            "SELECT pg_has_role(current_user, c.relowner, 'USAGE'), pg_get_userbyid(c.relowner)::text,
                    current_user::text
             FROM pg_class c WHERE c.oid = to_regclass($1)",
            &[&relation.quoted()],
        )
        .await?;
    let Some(row) = row else { return Ok(()) };
    let (owns, owner, role): (bool, String, String) = (row.get(0), row.get(1), row.get(2));
    if owns {
        return Ok(());
    }
    Err(not_owner(parent, &relation.to_string(), &owner, &role))
}

fn not_owner(parent: &TableName, relation: &str, owner: &str, role: &str) -> Error {
    Error::setup(
        format!("--retention drops old partitions of {parent} (DETACH, DROP), which needs ownership: the role {role} does not own {relation} (owner: {owner})"),
        format!("make {role} a member of the owning role (GRANT {owner} TO {role}), or give it the tables (ALTER TABLE {relation} OWNER TO {role}), or add --archive-table, which deletes rows instead and needs no ownership"),
    )
}

/// What one retention pass removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// Rows deleted (or moved to the archive table).
    pub rows: u64,
    /// Dropped partitions, schema-qualified.
    pub partitions: Vec<String>,
    /// Columns of the outbox table the archive table lacks (their values are not archived).
    pub not_archived: Vec<String>,
    /// Partitions due to be dropped that this pass could not drop (in use, or their check too slow), with
    /// why: the pass did not do its work.
    pub gave_way: Vec<(String, String)>,
}

/// One pass over one table: batches until no published row older than the window is left, or, for a
/// partitioned table (without an archive table), drops the partitions that are wholly old and published.
pub async fn sweep_once(
    database_url: &crate::pg::PgUrl,
    table: &TableSpec,
    retention: &Retention,
    horizon: &Horizon,
) -> Result<Removed> {
    let client = pg::connect(database_url).await?;
    // Rows it cannot lock now are skipped; a table (or archive) another session locked is given way to, the
    // pass failing with the reason, rather than waited for without end.
    client
        .batch_execute(&format!("SET lock_timeout = '{LOCK_TIMEOUT}'"))
        .await?;
    let table = &slot::inspect(&client, table).await?;
    if !table.marks_published {
        tracing::warn!(table = %table.name, "--retention needs the published_at column to know what was published; nothing removed (run `outboxd migrate --add-polling-columns`)");
        return Ok(Removed::default());
    }
    let history = horizon.history_may_go(crate::pg::outbox::history_mark(&client, table).await?);
    if table.partitioned && retention.archive_table.is_none() {
        let (partitions, gave_way) =
            drop_old_partitions(&client, table, retention, horizon, history).await?;
        return Ok(Removed {
            partitions,
            gave_way,
            ..Removed::default()
        });
    }
    let t = table.name.quoted();
    let id = table.col(crate::table::Role::EventId);
    let pick = format!(
        "SELECT {id} FROM {t} WHERE published_at IS NOT NULL
           AND published_at < now() - make_interval(secs => $1::float8)
           AND {}
         LIMIT $2 FOR UPDATE SKIP LOCKED",
        may_go("$3", "$4")
    );
    let mut not_archived = Vec::new();
    let statement = match &retention.archive_table {
        Some(archive) => {
            let copy = archive_plan(&client, table, archive).await?;
            not_archived = copy.not_archived;
            let columns = copy.columns.join(", ");
            let a = archive.quoted();
            format!(
                "WITH moved AS (DELETE FROM {t} WHERE {id} IN ({pick}) RETURNING {columns})
                 INSERT INTO {a} ({columns}) SELECT {columns} FROM moved"
            )
        }
        None => format!("DELETE FROM {t} WHERE {id} IN ({pick})"),
    };
    let statement = client
        .prepare(&statement)
        .await
        .map_err(|e| gave_way_to_a_lock(e, table, retention))?;
    let keep = retention.keep.as_secs_f64();
    let mut total = 0;
    loop {
        let removed = client
            .execute(
                &statement,
                &[&keep, &BATCH, &horizon.published_before, &history],
            )
            .await
            .map_err(|e| gave_way_to_a_lock(e, table, retention))?;
        total += removed;
        if removed < BATCH as u64 {
            return Ok(Removed {
                rows: total,
                partitions: Vec::new(),
                not_archived: if total > 0 { not_archived } else { Vec::new() },
                gave_way: Vec::new(),
            });
        }
    }
}

/// A lock retention's statement waited for longer than [`LOCK_TIMEOUT`] is this pass's failure, named;
/// other errors as they are.
fn gave_way_to_a_lock(
    error: tokio_postgres::Error,
    table: &OutboxTable,
    retention: &Retention,
) -> Error {
    if error.code() != Some(&SqlState::LOCK_NOT_AVAILABLE) {
        return error.into();
    }
    let archive = match &retention.archive_table {
        Some(archive) => format!(" or {archive}"),
        None => String::new(),
    };
    Error::setup(
        format!(
            "another session holds a lock on {}{archive} that retention needs (nothing within {LOCK_TIMEOUT}): retention gave way and tries again next pass",
            table.name
        ),
        "nothing, if it passes; if it lasts, find the session in pg_locks joined with pg_stat_activity",
    )
}

/// SQL true for a published row the slot will not send again (see [`Horizon`]): published before
/// `published_before` (a float8 parameter), or marked published before outboxd when `history` (a bool
/// parameter) says those may go.
fn may_go(published_before: &str, history: &str) -> String {
    format!(
        "CASE WHEN published_at = '-infinity' THEN {history}::bool
              ELSE published_at < to_timestamp({published_before}::float8) END"
    )
}

/// How rows are copied into the archive: by name, the archive's columns that the outbox table has too.
#[derive(Debug, PartialEq, Eq)]
pub struct ArchivePlan {
    /// Quoted column names, listed in INSERT and SELECT alike.
    pub columns: Vec<String>,
    /// Outbox columns the archive lacks (unquoted).
    pub not_archived: Vec<String>,
}

/// A column as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Column name.
    pub name: String,
    /// Type, as `format_type` prints it.
    pub type_name: String,
    /// NOT NULL without a default (nor generated, nor identity): an INSERT must give it a value.
    pub needs_value: bool,
    /// Generated or identity ALWAYS: an INSERT may not give it a value.
    pub no_value: bool,
}

/// Creates the archive when it does not exist (only then: creating needs CREATE on the schema), then
/// matches its columns to the outbox table's by name.
async fn archive_plan(
    client: &Client,
    table: &OutboxTable,
    archive: &TableName,
) -> Result<ArchivePlan> {
    let mut archive_columns = columns_of(client, archive).await?;
    if archive_columns.is_empty() {
        create_archive(client, table, archive).await?;
        archive_columns = columns_of(client, archive).await?;
        // Checked at the start of every pass; again after creating it, as CREATE TABLE IF NOT EXISTS keeps
        // one another role created meanwhile.
        check_archive_owner(client, std::slice::from_ref(table), archive).await?;
    }
    let outbox_columns = columns_of(client, &table.name).await?;
    plan_copy(table, archive, &outbox_columns, &archive_columns)
}

async fn create_archive(client: &Client, table: &OutboxTable, archive: &TableName) -> Result<()> {
    let (a, t) = (archive.quoted(), table.name.quoted());
    // IF NOT EXISTS: another instance may create it at the same moment.
    let created = client
        .batch_execute(&format!("CREATE TABLE IF NOT EXISTS {a} (LIKE {t})"))
        .await;
    match created {
        Ok(()) => {
            tracing::info!(archive = %archive, table = %table.name, "created the archive table");
            Ok(())
        }
        Err(error) if error.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            let role: String = client
                .query_one("SELECT current_user::text", &[])
                .await?
                .get(0);
            Err(Error::setup(
                format!("--archive-table {archive} does not exist and the role {role} may not create it (no CREATE on schema {})", archive.schema),
                format!("create it once as the table's owner (CREATE TABLE {archive} (LIKE {}); GRANT INSERT ON {archive} TO {role}), or GRANT CREATE ON SCHEMA {} TO {role}", table.name, archive.schema),
            ))
        }
        Err(error) => Err(error.into()),
    }
}

async fn columns_of(client: &Client, table: &TableName) -> Result<Vec<Column>> {
    let rows = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod),
                    a.attnotnull AND NOT a.atthasdef AND a.attidentity = '' AND a.attgenerated = '',
                    a.attgenerated <> '' OR a.attidentity = 'a'
             FROM pg_attribute a
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
             ORDER BY a.attnum",
            &[&table.quoted()],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| Column {
            name: row.get(0),
            type_name: row.get(1),
            needs_value: row.get(2),
            no_value: row.get(3),
        })
        .collect())
}

/// Pure: the columns to copy. The archive must have each column that plays a role in the outbox table
/// (the event itself) and may not require a value the outbox table cannot give; other outbox columns it
/// lacks are reported, not copied.
pub fn plan_copy(
    table: &OutboxTable,
    archive: &TableName,
    outbox: &[Column],
    archived: &[Column],
) -> Result<ArchivePlan> {
    let has = |columns: &[Column], name: &str| columns.iter().any(|c| c.name == name);
    let missing: Vec<&Column> = Role::ALL
        .into_iter()
        .filter_map(|role| table.column(role))
        .chain(["published_at"])
        .filter(|name| !has(archived, name))
        .filter_map(|name| outbox.iter().find(|c| c.name == name))
        .collect();
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().map(|c| c.name.as_str()).collect();
        let adds: Vec<String> = missing
            .iter()
            .map(|c| format!("ADD COLUMN {} {}", quote(&c.name), c.type_name))
            .collect();
        return Err(Error::setup(
            format!(
                "--archive-table {archive} has no column {} of the outbox table {}: archived events would lose it",
                names.join(", "),
                table.name
            ),
            format!("ALTER TABLE {archive} {}", adds.join(", ")),
        ));
    }
    if let Some(column) = archived
        .iter()
        .find(|c| c.needs_value && !has(outbox, &c.name))
    {
        return Err(Error::setup(
            format!(
                "--archive-table {archive} has the NOT NULL column {} without a default, and the outbox table {} has no such column",
                column.name, table.name
            ),
            format!(
                "ALTER TABLE {archive} ALTER COLUMN {} DROP NOT NULL (or SET DEFAULT ...)",
                quote(&column.name)
            ),
        ));
    }
    let columns = archived
        .iter()
        .filter(|c| !c.no_value && has(outbox, &c.name))
        .map(|c| quote(&c.name))
        .collect();
    let not_archived = outbox
        .iter()
        .filter(|c| !has(archived, &c.name))
        .map(|c| c.name.clone())
        .collect();
    Ok(ArchivePlan {
        columns,
        not_archived,
    })
}

fn quote(identifier: &str) -> String {
    format!("\"{}\"", identifier.replace('"', "\"\""))
}

/// Detaches and drops each range partition whose upper bound (a timestamp) is older than the window and
/// that holds no unpublished row. Partitions of other kinds (list, hash, default) are left alone. DETACH
/// and DROP need the owner's rights on the parent and the partition: checked first, named in the error.
async fn drop_old_partitions(
    client: &Client,
    outbox: &OutboxTable,
    retention: &Retention,
    horizon: &Horizon,
    history: bool,
) -> Result<(Vec<String>, Vec<(String, String)>)> {
    let table = &outbox.name;
    check_owner(client, table, table).await?;
    let rows = client
        .query(
            "SELECT format('%I.%I', n.nspname, c.relname),
                    substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \\(''([^'']+)''\\)'),
                    pg_has_role(current_user, c.relowner, 'USAGE'), pg_get_userbyid(c.relowner)::text,
                    current_user::text
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE i.inhparent = $1::text::regclass
             ORDER BY 2",
            &[&table.quoted()],
        )
        .await?;
    let keep = retention.keep.as_secs_f64();
    let mut dropped = Vec::new();
    let mut gave_way = Vec::new();
    for row in rows {
        let (partition, upper): (String, Option<String>) = (row.get(0), row.get(1));
        let Some(upper) = upper else { continue };
        // A bound that is no timestamp (e.g. an integer range) fails the cast: not ours to judge.
        let old = client
            .query_one(
                "SELECT $1::text::timestamptz <= now() - make_interval(secs => $2::float8)",
                &[&upper, &keep],
            )
            .await;
        if !matches!(old.map(|r| r.get::<_, bool>(0)), Ok(true)) {
            continue;
        }
        let (owns, owner, role): (bool, String, String) = (row.get(2), row.get(3), row.get(4));
        if !owns {
            return Err(not_owner(table, &partition, &owner, &role));
        }
        let unpublished: bool = client
            .query_one(
                &kept_rows_statement(outbox, &partition),
                &[&horizon.published_before, &history],
            )
            .await?
            .get(0);
        if unpublished {
            tracing::warn!(%partition, "partition is past --retention but still holds unpublished rows (or rows the slot may still send); kept");
            continue;
        }
        // After one give-way the pass only takes locks that are free at once (NOWAIT): each wait may have
        // made an application statement wait behind it, and one pass makes it wait at most once.
        let wait = gave_way.is_empty();
        match detach_and_drop_if_published(client, outbox, &partition, horizon, history, wait).await
        {
            Ok(Detached::Dropped) => dropped.push(partition),
            Ok(Detached::Kept) => {}
            Ok(Detached::GaveWay(why)) => gave_way.push((partition, why)),
            // Checked above, so only when ownership changed in between.
            Err(Error::Postgres(error))
                if error.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) =>
            {
                return Err(Error::setup(
                    format!("--retention cannot detach and drop {partition} of {table} as the role {role}: {}", crate::error::postgres_error_text(&error)),
                    format!("DETACH and DROP need ownership: make {role} a member of the role owning {table} and its partitions (GRANT <owner> TO {role}), or add --archive-table"),
                ));
            }
            Err(error) => return Err(error),
        }
    }
    Ok((dropped, gave_way))
}

/// What [`detach_and_drop_if_published`] did with a partition.
enum Detached {
    Dropped,
    /// It holds a row retention keeps (arrived since the unlocked check).
    Kept,
    /// It could not be dropped now, for this reason.
    GaveWay(String),
}

/// Detaches and drops `partition` unless, under its lock, it holds an unpublished row: a row committed (or
/// re-queued) after the unlocked check above is never dropped. The partition is locked first and checked
/// through its indexes (polling columns; the check may take at most [`LOCK_TIMEOUT`] too, so a statement
/// that reaches the partition waits no longer behind it); the parent's lock, which DETACH needs, is taken
/// only for the detach itself. Either lock not granted within [`LOCK_TIMEOUT`] (shorter than
/// `deadlock_timeout`, so outboxd, never the application, gives way), or a check that takes longer, leaves
/// the partition for the next pass, which counts as a failed pass; an application statement queued behind
/// the wait waits at most that long.
///
/// Not `DETACH PARTITION ... CONCURRENTLY` (PG 14+), which takes only SHARE UPDATE EXCLUSIVE on the parent:
/// it cannot run in a transaction block, so the partition could not be locked and checked for unpublished
/// rows in the detach's own transaction (a row written in between would be dropped unpublished); it is
/// refused when the table has a default partition; and one interrupted leaves the partition "detach
/// pending" until someone runs `DETACH ... FINALIZE`.
/// (The connection is this pass's own: an error leaves nothing open behind.)
async fn detach_and_drop_if_published(
    client: &Client,
    table: &OutboxTable,
    partition: &str,
    horizon: &Horizon,
    history: bool,
    wait: bool,
) -> Result<Detached> {
    let parent = table.name.quoted();
    let (nowait, waited) = if wait {
        ("", LOCK_TIMEOUT)
    } else {
        (" NOWAIT", "0 s: an earlier partition of this pass gave way")
    };
    client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'; SET LOCAL statement_timeout = '{LOCK_TIMEOUT}'"
        ))
        .await?;
    let partition_locked = client
        .batch_execute(&format!(
            "LOCK TABLE {partition} IN ACCESS EXCLUSIVE MODE{nowait}"
        ))
        .await;
    if let Some(gave_way) =
        gave_way(client, partition_locked, "the partition is in use", waited).await?
    {
        return Ok(gave_way);
    }
    let written_since = client
        .query_one(
            &kept_rows_statement(table, partition),
            &[&horizon.published_before, &history],
        )
        .await
        .map(|row| row.get::<_, bool>(0));
    let written_since = match written_since {
        Ok(written_since) => written_since,
        Err(error) => {
            let why = "checking it for unpublished rows took too long (without the polling columns' indexes the check reads the partition)";
            return gave_way(client, Err(error), why, LOCK_TIMEOUT)
                .await
                .map(|gave_way| gave_way.unwrap_or(Detached::Kept));
        }
    };
    if written_since {
        client.batch_execute("ROLLBACK").await?;
        tracing::warn!(%partition, "an unpublished row arrived in the partition past --retention while it was checked; kept");
        return Ok(Detached::Kept);
    }
    let parent_locked = client
        .batch_execute(&format!(
            "LOCK TABLE {parent} IN ACCESS EXCLUSIVE MODE{nowait}"
        ))
        .await;
    if let Some(gave_way) =
        gave_way(client, parent_locked, "the parent table is in use", waited).await?
    {
        return Ok(gave_way);
    }
    client
        .batch_execute(&format!(
            "ALTER TABLE {parent} DETACH PARTITION {partition}; DROP TABLE {partition}; COMMIT"
        ))
        .await?;
    Ok(Detached::Dropped)
}

/// SQL: whether `partition` of `table` holds a row retention keeps: unpublished, or one the slot may still
/// send (`$1`, `$2` as [`may_go`] takes them). With the polling columns each part reads an index of the
/// polling migrations (claim, dead letters, published_at), never the partition itself.
pub fn kept_rows_statement(table: &OutboxTable, partition: &str) -> String {
    if !table.polling {
        return format!(
            "SELECT EXISTS (SELECT 1 FROM {partition} WHERE published_at IS NULL OR NOT ({}))",
            may_go("$1", "$2")
        );
    }
    format!(
        "SELECT EXISTS (SELECT 1 FROM {partition} WHERE published_at IS NULL AND dead_at IS NULL)
             OR EXISTS (SELECT 1 FROM {partition} WHERE dead_at IS NOT NULL AND published_at IS NULL)
             OR EXISTS (SELECT 1 FROM {partition} WHERE published_at >= to_timestamp($1::float8))
             OR EXISTS (SELECT 1 FROM {partition} WHERE published_at = '-infinity' AND NOT $2::bool)"
    )
}

/// `None` when the statement succeeded; after a lock or statement timeout, the transaction rolled back and
/// why the partition gave way. Other errors propagate.
async fn gave_way(
    client: &Client,
    outcome: std::result::Result<(), tokio_postgres::Error>,
    why: &str,
    waited: &str,
) -> Result<Option<Detached>> {
    let Err(error) = outcome else {
        return Ok(None);
    };
    client.batch_execute("ROLLBACK").await?;
    if matches!(
        error.code(),
        Some(&SqlState::LOCK_NOT_AVAILABLE | &SqlState::QUERY_CANCELED)
    ) {
        return Ok(Some(Detached::GaveWay(format!(
            "{why} (nothing within {waited})"
        ))));
    }
    Err(error.into())
}

/// How long ago a Unix time was, for `status`.
pub fn age(last_success: u64) -> Duration {
    Duration::from_secs(unix_now().saturating_sub(last_success))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str, needs_value: bool) -> Column {
        Column {
            name: name.into(),
            type_name: "text".into(),
            needs_value,
            no_value: false,
        }
    }

    fn outbox() -> (OutboxTable, Vec<Column>) {
        let names = [
            "event_id",
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
            "created_at",
            "published_at",
            "attempts",
        ];
        let pairs: Vec<(String, String)> = names
            .iter()
            .map(|n| {
                let t = match *n {
                    "event_id" => "uuid",
                    "payload" => "jsonb",
                    "created_at" | "published_at" => "timestamp with time zone",
                    "attempts" => "integer",
                    _ => "text",
                };
                (n.to_string(), t.to_string())
            })
            .collect();
        let table = OutboxTable::standard_for_tests()
            .spec()
            .resolve(&pairs, false)
            .unwrap();
        let columns = pairs
            .iter()
            .map(|(name, type_name)| Column {
                type_name: type_name.clone(),
                ..col(name, false)
            })
            .collect();
        (table, columns)
    }

    fn archive() -> TableName {
        TableName {
            schema: "public".into(),
            name: "outbox_archive".into(),
        }
    }

    #[test]
    fn copies_by_name_in_the_archive_order_and_reports_what_it_lacks() {
        let (table, outbox) = outbox();
        let archived: Vec<Column> = [
            "aggregate_id",
            "aggregate_type",
            "event_id",
            "event_type",
            "payload",
            "created_at",
            "published_at",
        ]
        .iter()
        .map(|n| col(n, false))
        .chain([col("archived_at", false)])
        .collect();
        let plan = plan_copy(&table, &archive(), &outbox, &archived).unwrap();
        assert_eq!(
            plan.columns,
            [
                "\"aggregate_id\"",
                "\"aggregate_type\"",
                "\"event_id\"",
                "\"event_type\"",
                "\"payload\"",
                "\"created_at\"",
                "\"published_at\""
            ]
        );
        assert_eq!(plan.not_archived, ["attempts"]);
    }

    #[test]
    fn a_missing_event_column_or_an_unfillable_one_is_a_setup_error() {
        let (table, outbox) = outbox();
        let without_id: Vec<Column> = outbox
            .iter()
            .filter(|c| c.name != "event_id")
            .cloned()
            .collect();
        let error = plan_copy(&table, &archive(), &outbox, &without_id)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("has no column event_id")
                && error.contains("ALTER TABLE public.outbox_archive ADD COLUMN \"event_id\" uuid"),
            "{error}"
        );
        let mut strict = outbox.clone();
        strict.push(col("tenant", true));
        let error = plan_copy(&table, &archive(), &outbox, &strict)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("NOT NULL column tenant") && error.contains("DROP NOT NULL"),
            "{error}"
        );
    }

    #[test]
    fn generated_archive_columns_are_left_to_the_archive() {
        let (table, outbox) = outbox();
        let mut archived = outbox.clone();
        archived[7].no_value = true; // attempts GENERATED ALWAYS AS (...) in the archive
        let plan = plan_copy(&table, &archive(), &outbox, &archived).unwrap();
        assert!(!plan.columns.contains(&"\"attempts\"".to_string()));
    }

    #[test]
    fn state_names_round_trip_and_fit_postgres() {
        let health = Health {
            consecutive_failures: 3,
            last_success: Some(1_767_225_600),
        };
        let name = state_name(&health, "outboxd");
        assert_eq!(name, "outboxd retention failing 3 1767225600 outboxd");
        assert_eq!(parse_state_name(&name, "outboxd"), Some(health));
        assert_eq!(parse_state_name(&name, "other"), None);
        assert_eq!(parse_state_name("outboxd active outboxd", "outboxd"), None);
        let long = "s".repeat(63);
        let name = state_name(&Health::default(), &long);
        assert_eq!(name.len(), 63);
        assert_eq!(
            parse_state_name(&name, &long),
            Some(Health {
                consecutive_failures: 0,
                last_success: None
            })
        );
    }

    #[test]
    fn health_counts_failures_in_a_row() {
        let mut health = Health::default();
        health.record(false, 10);
        health.record(false, 20);
        assert_eq!(health.consecutive_failures, 2);
        assert_eq!(health.last_success, None);
        health.record(true, 30);
        assert_eq!(
            health,
            Health {
                consecutive_failures: 0,
                last_success: Some(30)
            }
        );
    }

    #[test]
    fn rows_published_after_the_newest_sample_the_slot_passed_are_kept() {
        let mut horizon = SlotHorizon::default();
        // No slot: nothing is sent again.
        assert_eq!(horizon.horizon(100.0, Lsn(1_000), None), Horizon::NO_SLOT);
        // The slot has passed no sample yet: nothing published may go.
        let first = horizon.horizon(200.0, Lsn(2_000), Some(Lsn(1_500)));
        assert_eq!(first.published_before, f64::NEG_INFINITY);
        // It passed the sample taken at 200 (WAL end 2,000) but not the one at 300.
        let second = horizon.horizon(300.0, Lsn(3_000), Some(Lsn(2_500)));
        assert_eq!(second.published_before, 200.0);
        // A slot that stops confirming keeps the bound where it was.
        assert_eq!(
            horizon
                .horizon(400.0, Lsn(4_000), Some(Lsn(2_500)))
                .published_before,
            200.0
        );
        assert_eq!(
            horizon
                .horizon(500.0, Lsn(5_000), Some(Lsn(9_000)))
                .published_before,
            500.0
        );
    }

    #[test]
    fn history_goes_once_no_slot_owes_it() {
        use crate::pg::outbox::HistoryMark;
        let pending = HistoryMark {
            position: Lsn(1_000),
            streamed: false,
        };
        let behind = Horizon {
            published_before: 0.0,
            slot_confirmed: Some(Lsn(900)),
            slot_being_created: false,
        };
        let past = Horizon {
            slot_confirmed: Some(Lsn(1_000)),
            ..behind
        };
        assert!(Horizon::NO_SLOT.history_may_go(None));
        assert!(!behind.history_may_go(Some(pending)));
        assert!(past.history_may_go(Some(pending)));
        // A slot whose hand-off has not committed yet: past the mark, but it may still republish them.
        let creating = Horizon {
            slot_being_created: true,
            ..past
        };
        assert!(!creating.history_may_go(Some(pending)));
        // Without a slot a pending mark keeps them: the next slot hands them to the polling path.
        assert!(!Horizon::NO_SLOT.history_may_go(Some(pending)));
        let streamed = HistoryMark {
            streamed: true,
            ..pending
        };
        assert!(behind.history_may_go(Some(streamed)));
        assert_eq!(HistoryMark::parse(&streamed.comment()), Some(streamed));
        assert_eq!(HistoryMark::parse(&pending.comment()), Some(pending));
    }
}
