//! Pre-flight checks and slot bookkeeping over ordinary SQL: server settings, the outbox table's columns,
//! the publication, and the replication slot's state, with the physical slots outboxd uses as marks
//! (a creation under way, streaming on a timeline). Each failed check names the problem and the fix.
//! Creating the slot itself needs the replication connection (see `pipeline::cdc`).

use tokio_postgres::{Client, GenericClient};

use crate::config::DatabaseSettings;
use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::table::TableName;
use crate::table::{OutboxTable, TableSpec};

/// `wal_level` must be `logical` for a logical slot.
pub async fn check_wal_level(client: &Client) -> Result<()> {
    let level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if level != "logical" {
        return Err(Error::replication_unavailable(
            format!("PostgreSQL has wal_level = {level}, but logical replication needs wal_level = logical"),
            "run ALTER SYSTEM SET wal_level = logical; and restart PostgreSQL (managed services: enable logical replication in the parameter group)",
        ));
    }
    Ok(())
}

/// Reads the outbox table's columns and kind, and resolves its column mapping against them (see
/// [`TableSpec::resolve`]): the table exists, every role has a column of an accepted type.
pub async fn inspect(client: &impl GenericClient, table: &TableSpec) -> Result<OutboxTable> {
    // The history of failed attempts counts as absent where this role may not read and write it (granted
    // column by column, before migration 0007 added it): the statements that keep it would fail.
    let rows = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), c.relkind = 'p'
             FROM pg_attribute a
             JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped
               AND (a.attname <> $3 OR (has_column_privilege(c.oid, a.attnum, 'SELECT')
                                        AND has_column_privilege(c.oid, a.attnum, 'UPDATE')))",
            &[
                &table.name.schema,
                &table.name.name,
                &crate::table::ATTEMPT_HISTORY_COLUMN,
            ],
        )
        .await?;
    let columns: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let partitioned = rows.first().is_some_and(|r| r.get(2));
    table
        .resolve(&columns, partitioned)
        .map_err(|mismatch| Error::setup(mismatch.problem, mismatch.fix))
}

/// [`inspect`] for every table, in order (a table inspected before is inspected again by its
/// `OutboxTable::spec`).
pub async fn inspect_all<'a>(
    client: &impl GenericClient,
    tables: impl IntoIterator<Item = &'a TableSpec>,
) -> Result<Vec<OutboxTable>> {
    let mut inspected = Vec::new();
    for table in tables {
        inspected.push(inspect(client, table).await?);
    }
    Ok(inspected)
}

/// The table has every polling column (`--mode poll` needs them).
pub fn check_polling_columns(table: &OutboxTable) -> Result<()> {
    if table.polling {
        return Ok(());
    }
    let name = &table.name;
    Err(Error::setup(
        format!("the outbox table {name} lacks the polling columns (published_at, leases, position, dead letters)"),
        format!("run `outboxd migrate --table {name} --add-polling-columns` (adds them without rewriting the table), or use --mode cdc"),
    ))
}

/// What the catalog says about a publication, relative to the outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicationState {
    /// The publication publishes inserts (`pubinsert`).
    pub publishes_inserts: bool,
    /// The publication includes the table (as pg_publication_tables lists it).
    pub covers_table: bool,
    /// `publish_via_partition_root`: rows of partitions decode as the partitioned table.
    pub via_root: bool,
    /// The table's row filter (`ADD TABLE ... WHERE`, PostgreSQL 15+): inserts outside it are never
    /// decoded, and the slot confirms past them.
    pub row_filter: Option<String>,
    /// The columns the publication sends of the table (all of them without a column list); `None` before
    /// PostgreSQL 15 (no column lists) or where the table is not covered.
    pub columns: Option<Vec<String>>,
}

/// Refuses a publication owned by a role outboxd does not trust: its owner may change what it publishes (`SET
/// (publish = 'update')`, `DROP TABLE`) without owning the outbox table, and the slot would then confirm past
/// inserts it never streamed. Trusted: this role and who holds its rights already (migrate's rule), and the
/// outbox tables' owners and their members (migrate runs as one; they may alter the table anyway). No
/// publication: nothing to check.
pub async fn check_publication_owner(
    client: &impl GenericClient,
    publication: &str,
    tables: &[OutboxTable],
) -> Result<()> {
    let outbox_tables: Vec<String> = tables.iter().map(|t| t.name.quoted()).collect();
    let row = client
        .query_opt(
            &format!(
                "SELECT pg_get_userbyid(p.pubowner)::text,
                        {} OR EXISTS (SELECT 1 FROM pg_class outbox
                                      WHERE outbox.oid = ANY (SELECT to_regclass(t) FROM unnest($2::text[]) AS t)
                                        AND pg_has_role(p.pubowner, outbox.relowner, 'MEMBER'))
                 FROM pg_publication p WHERE p.pubname = $1",
                super::ownership::trusted_owner("p.pubowner")
            ),
            &[&publication, &outbox_tables],
        )
        .await?;
    let Some(row) = row else { return Ok(()) };
    let (owner, trusted): (String, bool) = (row.get(0), row.get(1));
    if trusted {
        return Ok(());
    }
    Err(Error::setup(
        format!("publication {publication} is owned by role {owner}, which neither holds this role's rights nor owns the outbox table: it could change what the publication streams (publish, its tables) and the slot would confirm past events it never sent"),
        format!("find out who created it; if {owner} is not yours, DROP PUBLICATION {publication} and run `outboxd migrate` (it creates it again), or ALTER PUBLICATION {publication} OWNER TO the outbox table's owner"),
    ))
}

/// The publication's state relative to `table`; `None` when the publication does not exist.
pub async fn publication_state(
    client: &impl GenericClient,
    publication: &str,
    table: &TableName,
) -> Result<Option<PublicationState>> {
    let row = client
        .query_opt(
            // `rowfilter` and `attnames` exist from PostgreSQL 15 on: read through to_jsonb, which is
            // missing the keys before.
            "SELECT p.pubinsert, t.row IS NOT NULL, p.pubviaroot, t.row ->> 'rowfilter',
                    CASE WHEN t.row ? 'attnames'
                         THEN ARRAY(SELECT jsonb_array_elements_text(t.row -> 'attnames')) END
             FROM pg_publication p
             LEFT JOIN LATERAL (SELECT to_jsonb(pt) AS row FROM pg_publication_tables pt
                                WHERE pt.pubname = p.pubname AND pt.schemaname = $2 AND pt.tablename = $3
                                LIMIT 1) t ON true
             WHERE p.pubname = $1",
            &[&publication, &table.schema, &table.name],
        )
        .await?;
    Ok(row.map(|r| PublicationState {
        publishes_inserts: r.get(0),
        covers_table: r.get(1),
        via_root: r.get(2),
        row_filter: r.get(3),
        columns: r.get(4),
    }))
}

/// The publication exists, publishes inserts and covers the outbox table.
pub async fn check_publication(client: &Client, settings: &DatabaseSettings) -> Result<()> {
    let publication = &settings.publication;
    let names = crate::table::names(&settings.tables);
    check_publication_owner(client, publication, &settings.tables).await?;
    for table in &settings.tables {
        let name = &table.name;
        let Some(state) = publication_state(client, publication, name).await? else {
            let via_root = if settings.tables.iter().any(|t| t.partitioned) {
                ", publish_via_partition_root = true"
            } else {
                ""
            };
            return Err(Error::setup(
                format!("publication {publication} does not exist"),
                format!(
                    "run `outboxd migrate --publication {publication}`, or CREATE PUBLICATION {publication} FOR TABLE {names} WITH (publish = 'insert'{via_root})"
                ),
            ));
        };
        if !state.publishes_inserts {
            return Err(Error::setup(
                format!("publication {publication} does not publish inserts"),
                format!("ALTER PUBLICATION {publication} SET (publish = 'insert')"),
            ));
        }
        if table.partitioned && !state.via_root {
            return Err(Error::setup(
                format!("{name} is partitioned but publication {publication} publishes its rows as the partitions'"),
                format!("ALTER PUBLICATION {publication} SET (publish_via_partition_root = true)"),
            ));
        }
        if !state.covers_table {
            return Err(Error::setup(
                format!("publication {publication} does not include {name}"),
                format!("ALTER PUBLICATION {publication} ADD TABLE {name}"),
            ));
        }
        let republish = format!("in one transaction, ALTER PUBLICATION {publication} DROP TABLE {name}; ALTER PUBLICATION {publication} ADD TABLE {name}; (then run `outboxd migrate --add-polling-columns` if it lacks them: rows the publication left out stay unpublished, and only the polling path can send them)");
        if let Some(filter) = &state.row_filter {
            return Err(Error::setup(
                format!("publication {publication} publishes only the rows of {name} WHERE {filter}: an event outside it is never streamed, and the slot confirms past it"),
                republish,
            ));
        }
        if let Some(published) = &state.columns {
            let left_out: Vec<String> = table
                .read_columns()
                .into_iter()
                .filter(|column| !published.contains(column))
                .collect();
            if !left_out.is_empty() {
                return Err(Error::setup(
                    format!("publication {publication} leaves the columns {} of {name} out (a column list): outboxd needs them in every streamed event", left_out.join(", ")),
                    republish,
                ));
            }
        }
    }
    Ok(())
}

/// A replication slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SlotState {
    /// The slot's name.
    pub slot_name: String,
    /// The output plugin (`pgoutput` for outboxd's); `None` for a physical slot.
    pub plugin: Option<String>,
    /// `logical` or `physical`.
    pub slot_type: String,
    /// The database of a logical slot; `None` for a physical slot.
    pub database: Option<String>,
    /// Whether a walsender streams from the slot now.
    pub active: bool,
    /// PID of that walsender; `None` when none does.
    pub active_pid: Option<i32>,
    /// The slot's confirmed_flush_lsn as text; `None` for a physical slot.
    pub confirmed_flush_lsn: Option<String>,
    /// The slot's restart_lsn as text: the oldest WAL it keeps; `None` when it keeps none.
    pub restart_lsn: Option<String>,
    /// reserved, extended, unreserved or lost; `None` when PostgreSQL shows none.
    pub wal_status: Option<String>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`.
    pub lag_bytes: Option<i64>,
    /// `pg_current_wal_lsn() - restart_lsn`: WAL the slot keeps on disk.
    pub retained_wal_bytes: Option<i64>,
    /// `safe_wal_size`: WAL that can still be written before the slot is lost (NULL without a limit).
    pub safe_wal_bytes: Option<i64>,
    /// `failover` (PostgreSQL 17+): standbys with `sync_replication_slots` keep a copy; `None` before 17.
    pub failover: Option<bool>,
    /// `synced` (PostgreSQL 17+): the slot was synchronised from a primary (on a promoted standby it stays
    /// true); `None` before 17.
    pub synced: Option<bool>,
    /// `invalidation_reason` (PostgreSQL 17+): why PostgreSQL invalidated the slot (`wal_removed`,
    /// `idle_timeout`, ...); `None` when it is valid, or before 17.
    pub invalidation_reason: Option<String>,
}

impl SlotState {
    /// The confirmed_flush_lsn as an [`Lsn`]; `None` when there is none.
    pub fn confirmed_flush(&self) -> Option<Lsn> {
        self.confirmed_flush_lsn
            .as_deref()
            .and_then(|l| l.parse().ok())
    }
}

/// The role outboxd runs as, when row level security hides rows of `table` from it (logical decoding does
/// not apply row security, the polling path, the `published_at` writes, retention and the figures do);
/// `None` when the role sees every row.
pub async fn role_row_security_hides_rows_from(
    client: &impl GenericClient,
    table: &OutboxTable,
) -> Result<Option<String>> {
    let row = client
        .query_one(
            // Hidden: row security applies to this role, and its policies do not plainly let it read and
            // update every row (a permissive `USING (true)` for SELECT and UPDATE, no restrictive policy).
            "WITH applying AS (
                 SELECT p.permissive, p.cmd, p.qual FROM pg_policies p
                 WHERE p.schemaname = $2 AND p.tablename = $3
                   AND EXISTS (SELECT FROM unnest(p.roles) AS r
                               WHERE r = 'public' OR pg_has_role(current_user, r, 'MEMBER')))
             SELECT row_security_active($1::text::regclass)
                    AND NOT (EXISTS (SELECT FROM applying WHERE permissive = 'PERMISSIVE' AND cmd IN ('ALL', 'SELECT') AND qual = 'true')
                             AND EXISTS (SELECT FROM applying WHERE permissive = 'PERMISSIVE' AND cmd IN ('ALL', 'UPDATE') AND qual = 'true')
                             AND NOT EXISTS (SELECT FROM applying WHERE permissive = 'RESTRICTIVE')),
                    current_user::text",
            &[&table.name.quoted(), &table.name.schema, &table.name.name],
        )
        .await?;
    let (hidden, role): (bool, String) = (row.get(0), row.get(1));
    Ok(hidden.then_some(role))
}

/// Pure: what row security hiding rows of `table` from `role` breaks, and the fix.
pub fn hidden_rows_problem(table: &OutboxTable, role: &str) -> (String, String) {
    (
        format!("{} has row level security that applies to {role}: the polling path, retention and the backlog figures see only the rows its policies let {role} see, and would leave the others unpublished", table.name),
        format!("ALTER ROLE {role} BYPASSRLS (as a superuser), or a policy letting {role} see every row: CREATE POLICY outboxd ON {} TO {role} USING (true)", table.name),
    )
}

/// Refuses a table with the polling columns whose rows row level security hides from outboxd's role (`run`'s
/// start-up; doctor reports the same).
pub async fn check_row_level_security(
    client: &impl GenericClient,
    table: &OutboxTable,
) -> Result<()> {
    if !table.polling {
        return Ok(());
    }
    match role_row_security_hides_rows_from(client, table).await? {
        None => Ok(()),
        Some(role) => {
            let (problem, fix) = hidden_rows_problem(table, &role);
            Err(Error::setup(problem, fix))
        }
    }
}

/// The slot named `slot` as pg_replication_slots shows it; `None` when it does not exist.
pub async fn slot_state(client: &Client, slot: &str) -> Result<Option<SlotState>> {
    let row = client
        .query_opt(
            "SELECT slot_name::text, plugin::text, slot_type, database::text, active, active_pid,
                    confirmed_flush_lsn::text, restart_lsn::text, wal_status,
                    (pg_current_wal_lsn() - confirmed_flush_lsn)::int8,
                    (pg_current_wal_lsn() - restart_lsn)::int8, safe_wal_size,
                    (to_jsonb(s) ->> 'failover')::bool, (to_jsonb(s) ->> 'synced')::bool,
                    to_jsonb(s) ->> 'invalidation_reason'
             FROM pg_replication_slots s WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotState {
        slot_name: r.get(0),
        plugin: r.get(1),
        slot_type: r.get(2),
        database: r.get(3),
        active: r.get(4),
        active_pid: r.get(5),
        confirmed_flush_lsn: r.get(6),
        restart_lsn: r.get(7),
        wal_status: r.get(8),
        lag_bytes: r.get(9),
        retained_wal_bytes: r.get(10),
        safe_wal_bytes: r.get(11),
        failover: r.get(12),
        synced: r.get(13),
        invalidation_reason: r.get(14),
    }))
}

/// Drops the slot if PostgreSQL invalidated it (`wal_status = lost`): it can never stream again. Only safe
/// when the polling path will publish what the slot missed (the next slot's snapshot hands those rows off).
/// Rows marked published before outboxd that it may not have streamed are handed off first.
pub async fn drop_if_lost(client: &Client, slot: &str, tables: &[OutboxTable]) -> Result<bool> {
    let Some(state) = own_slot_state(client, slot).await? else {
        return Ok(false);
    };
    if state.wal_status.as_deref() != Some("lost") {
        return Ok(false);
    }
    let reason = state
        .invalidation_reason
        .as_deref()
        .map(|reason| format!(", invalidation_reason = {reason}"))
        .unwrap_or_default();
    tracing::warn!(slot, "replication slot was invalidated (wal_status = lost{reason}); dropping it so a new one can be created; rows committed meanwhile go through the polling path");
    let confirmed = state.confirmed_flush().unwrap_or(Lsn::ZERO);
    crate::pg::outbox::republish_history_a_lost_slot_owed(client, tables, confirmed).await?;
    terminate_and_drop(client, slot, state.active_pid).await?;
    Ok(true)
}

/// Drops outboxd's own slot before this session streams from it; a slot of that name that is not outboxd's
/// is left alone (`check_existing_slot` refuses it). A slot some client streams from is not taken from it
/// (another leader during a split brain): NotReady, to try again. Only safe when the polling path will
/// publish what the slot did not (the next slot's snapshot hands those rows off).
pub async fn drop_own_slot(client: &Client, slot: &str) -> Result<()> {
    let Some(state) = own_slot_state(client, slot).await? else {
        return Ok(());
    };
    if let Some(pid) = state.active_pid {
        return Err(Error::NotReady {
            problem: format!("replication slot {slot} has to be replaced, but a walsender (pid {pid}) streams from it"),
            fix: "stop the other client of the slot (another outboxd, during a switchover)".into(),
            waiting_for: "the slot to be free".into(),
        });
    }
    terminate_and_drop(client, slot, None).await
}

/// The physical slot that marks "outboxd streamed slot `slot` on timeline `timeline` of this server"; it
/// reserves no WAL. A standby never holds one (physical slots are neither synchronised nor in a base
/// backup), and a file-level copy holds its old timeline's: a server on a timeline without the mark has never
/// had the slot moved by outboxd there, so the slot is trusted only up to where that timeline began. Only
/// timelines after the first are marked (timeline 1 began with the cluster).
pub fn timeline_marker(slot: &str, timeline: u32) -> String {
    format!("{}{timeline}", timeline_marker_prefix(slot))
}

/// What every timeline mark of `slot` starts with.
fn timeline_marker_prefix(slot: &str) -> String {
    format!("{}_tl", marker_base(slot))
}

/// The part of a marker's name that stands for `slot`: the name itself up to 50 characters, so that a suffix
/// (`_creating`, `_tl` and a timeline) fits PostgreSQL's 63; a longer name keeps its first 41 and a hash of
/// the whole, so that two slots sharing their first 50 characters never share marks. Slot names are ASCII
/// (PostgreSQL allows `[a-z0-9_]`), so cutting bytes is safe.
fn marker_base(slot: &str) -> String {
    const FITS: usize = 50;
    if slot.len() <= FITS {
        return slot.to_string();
    }
    // FNV-1a: stable across releases and platforms (a mark is read back by later versions of outboxd).
    let hash = slot.bytes().fold(0x811c_9dc5_u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    });
    format!("{}_{hash:08x}", &slot[..FITS - 9])
}

/// Whether a session of outboxd streamed `slot` on `timeline` of this server (its mark exists: a physical
/// slot of that name that reserves no WAL).
pub async fn marked_on_timeline(client: &Client, slot: &str, timeline: u32) -> Result<bool> {
    Ok(client
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_replication_slots
                             WHERE slot_name = $1 AND slot_type = 'physical' AND restart_lsn IS NULL)",
            &[&timeline_marker(slot, timeline)],
        )
        .await?
        .get(0))
}

/// Replacing `slot` takes two slots once it is dropped (the creation marker and the new slot): refuses, with
/// the fix, when the server could not give them, before the slot is dropped.
pub async fn check_free_slot_to_replace(client: &Client, slot: &str) -> Result<()> {
    let free: i64 = client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int8 - count(*) FROM pg_replication_slots",
            &[],
        )
        .await?
        .get(0);
    if free < 1 {
        return Err(Error::setup(
            format!("replication slot {slot} has to be replaced, which takes one free replication slot besides it, and max_replication_slots leaves none"),
            "raise max_replication_slots by one (a restart of PostgreSQL), or drop a slot nothing uses",
        ));
    }
    Ok(())
}

/// Marks that this session streams `slot` on `timeline` (after the first), and drops the marks of other
/// timelines.
pub async fn mark_on_timeline(client: &Client, slot: &str, timeline: u32) -> Result<()> {
    if timeline <= 1 {
        return Ok(());
    }
    let mark = timeline_marker(slot, timeline);
    if !marked_on_timeline(client, slot, timeline).await? {
        client
            .execute("SELECT pg_create_physical_replication_slot($1)", &[&mark])
            .await?;
    }
    let prefix = timeline_marker_prefix(slot);
    client
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
              WHERE slot_type = 'physical' AND NOT active AND restart_lsn IS NULL AND slot_name <> $2
                AND starts_with(slot_name, $1) AND substr(slot_name, length($1) + 1) ~ '^[0-9]+$'",
            &[&prefix, &mark],
        )
        .await?;
    Ok(())
}

/// SQL condition on a row of `pg_replication_slots`: a physical slot that stands for a standby, not one of
/// outboxd's marks (creation, timeline), which reserve no WAL and nobody streams from.
pub const STANDBY_PHYSICAL_SLOT: &str = "slot_type = 'physical'
    AND NOT (slot_name ~ '_(tl[0-9]+|creating)$' AND restart_lsn IS NULL AND NOT active)";

/// The slot named `slot` when it is outboxd's to manage: a logical pgoutput slot of this database. Slot names
/// are cluster-wide: a slot of the same name in another database (another application's, or another outboxd's)
/// is never dropped, nor its walsender ended (`check_existing_slot` then refuses it, naming it).
async fn own_slot_state(client: &Client, slot: &str) -> Result<Option<SlotState>> {
    let Some(state) = slot_state(client, slot).await? else {
        return Ok(None);
    };
    let database = current_database(client).await?;
    let own = state.slot_type == "logical"
        && state.plugin.as_deref() == Some("pgoutput")
        && state.database.as_deref() == Some(database.as_str());
    Ok(own.then_some(state))
}

async fn current_database(client: &Client) -> Result<String> {
    Ok(client
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0))
}

/// Ends the walsender holding `slot` (if any) and drops the slot.
async fn terminate_and_drop(client: &Client, slot: &str, active_pid: Option<i32>) -> Result<()> {
    if let Some(pid) = active_pid {
        client
            .execute("SELECT pg_terminate_backend($1)", &[&pid])
            .await?;
    }
    client
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await?;
    Ok(())
}

/// The role an instance plays for a slot, shown as the `application_name` of its leadership connection (see
/// `pipeline::leader`) so that `outboxd status` and `outboxd doctor` (any process with SQL access) can count
/// active and standby instances, and tell an outboxd from another client of the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeadershipRole {
    /// Holds the slot's leadership lock: this instance streams.
    Active,
    /// Waits for the lock, to take over when the active instance goes.
    Standby,
}

/// `application_name` of the leadership connection: `outboxd active <slot>` / `outboxd standby <slot>`,
/// cut to PostgreSQL's 63 bytes as the server would.
pub fn leadership_application_name(role: LeadershipRole, slot: &str) -> String {
    let role = match role {
        LeadershipRole::Active => "active",
        LeadershipRole::Standby => "standby",
    };
    let mut name = format!("outboxd {role} {slot}");
    name.truncate(63); // slot names are ASCII
    name
}

/// The physical slot that marks "slot `slot` is being created and the hand-off of the rows older than it is
/// not committed yet". It reserves no WAL.
pub fn creation_marker(slot: &str) -> String {
    format!("{}_creating", marker_base(slot))
}

/// Whether `slot` is being created (its creation marker exists): its hand-off may not be committed yet.
pub async fn creation_in_progress(client: &Client, slot: &str) -> Result<bool> {
    Ok(client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            &[&creation_marker(slot)],
        )
        .await?
        .get(0))
}

/// Sets the creation marker before CREATE_REPLICATION_SLOT; `finish_creation` removes it once the hand-off
/// is committed.
pub async fn begin_creation(client: &Client, slot: &str) -> Result<()> {
    client
        .execute(
            "SELECT pg_create_physical_replication_slot($1)",
            &[&creation_marker(slot)],
        )
        .await?;
    Ok(())
}

/// Removes the creation marker once the hand-off of the rows older than the slot is committed.
pub async fn finish_creation(client: &Client, slot: &str) -> Result<()> {
    client
        .execute(
            "SELECT pg_drop_replication_slot($1)",
            &[&creation_marker(slot)],
        )
        .await?;
    Ok(())
}

/// A process that died between creating the slot and committing the hand-off leaves the marker behind: that
/// slot would never deliver the rows older than it, so it is dropped (it has streamed nothing) and created
/// again, hand-off included. Returns true when it undid one.
pub async fn undo_interrupted_creation(client: &Client, slot: &str) -> Result<bool> {
    if slot_state(client, &creation_marker(slot)).await?.is_none() {
        return Ok(false);
    }
    let own = own_slot_state(client, slot).await?;
    if own.is_none() && slot_state(client, slot).await?.is_some() {
        // Another database's slot of this name: the marker may be its creation's; neither is touched.
        return Ok(false);
    }
    tracing::warn!(
        slot,
        "a previous run died while creating the replication slot; creating it again"
    );
    if let Some(state) = own {
        terminate_and_drop(client, slot, state.active_pid).await?;
    }
    finish_creation(client, slot).await?;
    Ok(true)
}

/// An existing slot must be a logical pgoutput slot of this database and not lost.
pub async fn check_existing_slot(client: &Client, slot: &str) -> Result<Option<SlotState>> {
    let Some(state) = slot_state(client, slot).await? else {
        return Ok(None);
    };
    let database = current_database(client).await?;
    let drop_it =
        format!("pick another --slot, or drop it with SELECT pg_drop_replication_slot('{slot}')");
    if state.slot_type != "logical" || state.plugin.as_deref() != Some("pgoutput") {
        return Err(Error::setup(
            format!(
                "replication slot {slot} uses output plugin {} ({}), but outboxd needs a logical pgoutput slot",
                state.plugin.as_deref().unwrap_or("none"),
                state.slot_type
            ),
            drop_it,
        ));
    }
    if state.database.as_deref() != Some(database.as_str()) {
        return Err(Error::setup(
            format!(
                "replication slot {slot} belongs to database {}, not {database}",
                state.database.as_deref().unwrap_or("?")
            ),
            drop_it,
        ));
    }
    if state.wal_status.as_deref() == Some("lost") {
        return Err(Error::setup(
            format!("replication slot {slot} is invalidated (wal_status = lost): the WAL it needed was removed"),
            format!("drop it (SELECT pg_drop_replication_slot('{slot}')) and restart outboxd; see README 'When the slot is lost'"),
        ));
    }
    Ok(Some(state))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_of_short_names_are_the_name_and_a_suffix() {
        assert_eq!(timeline_marker("outboxd", 3), "outboxd_tl3");
        assert_eq!(creation_marker("outboxd"), "outboxd_creating");
        let fifty = "s".repeat(50);
        assert_eq!(creation_marker(&fifty), format!("{fifty}_creating"));
    }

    #[test]
    fn long_names_sharing_their_first_fifty_characters_never_share_marks() {
        let common = "orders_service_outbox_relay_to_kafka_cluster_eu_we";
        let (a, b) = (format!("{common}st_1"), format!("{common}st_2"));
        assert_ne!(timeline_marker(&a, 2), timeline_marker(&b, 2));
        assert_ne!(creation_marker(&a), creation_marker(&b));
        let longest = "x".repeat(63);
        for name in [a.as_str(), b.as_str(), longest.as_str()] {
            assert!(timeline_marker(name, u32::MAX).len() <= 63, "{name}");
            assert!(creation_marker(name).len() <= 63, "{name}");
            assert!(timeline_marker(name, 7).starts_with(&timeline_marker_prefix(name)));
        }
    }
}
