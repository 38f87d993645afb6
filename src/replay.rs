//! `outboxd replay --published`: republishes events that were already published (time travel), in their
//! aggregates' order, each record marked with an `outboxd-replay: <replay id>` header.
//!
//! - To the live topic (the default) it goes through the same per-aggregate gate as everything else: the
//!   selected rows are handed back to the polling path *held* (not claimable), the replay waits until nothing
//!   of theirs is still on its way (the slot confirmed past the hand-back, so the CDC path published or handed
//!   off every event committed before it; no lease on an event of their aggregates), then releases them, all at
//!   once or `--rate` per second. A live event of an aggregate is then published after its replayed ones:
//!   one committed before the hand-back has already been delivered, one committed after waits behind them in
//!   the polling path (the hand-off notice blocks the aggregate on the CDC path).
//! - To another topic (`--to-topic`) it reads the rows in their order (from the outbox table, or retention's
//!   archive) and produces them itself, batch by batch, recording after each acknowledged batch how far it got,
//!   so that `--resume` sends at most one batch again; under `--delivery exactly-once` each batch is a Kafka
//!   transaction carrying that cursor, and nothing is sent twice.
//! - `--cancel` lets the events a replay still holds go, as published again.
//!
//! The selection is read in a read-only transaction, so a `--where` predicate can read but never write; the
//! statements that write name rows by their event ids. Each replay's plan and progress live in the table
//! migration 0006 made next to the outbox table (`<table>_replay`), read by `--resume` and `outboxd status`.
//! It owns the selection, the progress rows and the pacing; the hand-back SQL is `pg::outbox`'s, producing is
//! `kafka`'s.

use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::config::{DatabaseSettings, Mode, PollOrder, RunSettings};
use crate::error::{Error, Result};
use crate::pg::outbox::{self, EventColumns};
use crate::progress::ProgressKey;
use crate::sink::{Delivery, Sink, Sinks};
use crate::table::replay_tables;
use crate::table::{OutboxTable, Role, TableSpec};

/// What a replay republishes, where, and how fast; kept with its progress, so `--resume` goes on with it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Created at or after (the table's `created_at`, or `published_at` where it has none).
    pub since: Option<SystemTime>,
    /// Created before; a new replay sets it to its start when not given, so later events never join it.
    pub until: Option<SystemTime>,
    /// Of this aggregate type only.
    pub aggregate_type: Option<String>,
    /// Of this aggregate only.
    pub aggregate_id: Option<String>,
    /// Of this event type only.
    pub event_type: Option<String>,
    /// `--where`: an SQL predicate over the outbox table's columns, evaluated read-only.
    pub predicate: Option<String>,
    /// `--to-topic`: produce to this topic instead of handing the events back to the live pipeline.
    pub to_topic: Option<String>,
    /// `--rate`: at most this many events per second.
    pub rate: Option<f64>,
    /// `--from-archive`: read the events from this table (retention's `--archive-table`, `schema.name`)
    /// instead of the outbox table; only with `to_topic`.
    #[serde(default)]
    pub from_archive: Option<String>,
    /// The pipeline it waits for (to the live topics), as the replay was started: a `--resume` keeps it.
    #[serde(default)]
    pub pipeline: Option<Pipeline>,
}

/// Where a replay of one table stands (the `state` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Live: handing the selected rows back, held.
    HandingBack,
    /// Live: every selected row handed back, held until the stream passed the hand-back.
    Held,
    /// Live: released to the polling path, which publishes them.
    Released,
    /// To another topic: producing, batch by batch.
    Sending,
    /// Every selected event republished.
    Done,
}

impl Stage {
    fn as_str(self) -> &'static str {
        match self {
            Stage::HandingBack => "handing_back",
            Stage::Held => "held",
            Stage::Released => "released",
            Stage::Sending => "sending",
            Stage::Done => "done",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        [
            Stage::HandingBack,
            Stage::Held,
            Stage::Released,
            Stage::Sending,
            Stage::Done,
        ]
        .into_iter()
        .find(|stage| stage.as_str() == text)
    }
}

/// The progress of one replay of one table, as `outboxd status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    /// The replay's id (the `outboxd-replay` header's value).
    pub replay_id: String,
    /// The outbox table.
    pub table: String,
    /// `handing_back`, `held`, `released`, `sending` or `done`.
    pub state: String,
    /// Events selected.
    pub total: i64,
    /// Events republished so far (to another topic: acknowledged; live: published by the polling path).
    pub done: i64,
    /// The topic it goes to (`None`: the live topics).
    pub to_topic: Option<String>,
}

/// Events read and produced per batch (`--to-topic`); a `--resume` sends at most one batch again.
const BATCH: i64 = 1_000;
/// How often a replay checks the stream, the leases and the polling path while it waits.
const CHECK_EVERY: Duration = Duration::from_millis(200);
/// How often a long replay says how far it got.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// How long `--to-topic` waits for one batch's acknowledgements.
const BATCH_ACK_TIMEOUT: Duration = Duration::from_secs(120);

/// A new replay's id: `replay-` and the start time, with a few random digits so two never share it.
pub fn new_replay_id(now: SystemTime) -> String {
    let time = humantime::format_rfc3339_seconds(now)
        .to_string()
        .replace([':', '-'], "");
    let random = Uuid::new_v4().simple().to_string();
    format!("replay-{time}-{}", &random[..6])
}

/// Spaces events `rate` per second: how long to wait before sending the next one after `sent` of them went
/// since `started` (`elapsed` ago).
pub fn pace(rate: Option<f64>, sent: u64, elapsed: Duration) -> Duration {
    match rate {
        Some(rate) if rate > 0.0 => {
            Duration::from_secs_f64(sent as f64 / rate).saturating_sub(elapsed)
        }
        _ => Duration::ZERO,
    }
}

/// The selection's conditions on `table` (as `e`), with its parameters from `$first` on: published rows (not
/// those marked published before outboxd, nor dead ones) of the plan's range, and the `--where` predicate in
/// parentheses. `handed_back`: the table of replayed events, whose rows count as published while another
/// replay or a heal has handed them back (a replay to another topic must not skip them). Pure.
pub fn selection_sql(
    table: &OutboxTable,
    plan: &Plan,
    first: usize,
    handed_back: Option<&str>,
) -> String {
    let created = match table.column(Role::CreatedAt) {
        Some(column) => format!("e.\"{column}\""),
        None => "e.published_at".into(),
    };
    let p = |n: usize| format!("${}", first + n);
    let published = match handed_back {
        Some(replayed) => format!(
            "(e.published_at > '-infinity' OR e.published_at IS NULL AND e.{} IN (SELECT event_id FROM {replayed}))",
            table.col(Role::EventId)
        ),
        None => "e.published_at > '-infinity'".into(),
    };
    let mut sql = format!(
        "{published} AND e.dead_at IS NULL
         AND ({p0}::timestamptz IS NULL OR {created} >= {p0})
         AND ({p1}::timestamptz IS NULL OR {created} < {p1})
         AND ({p2}::text IS NULL OR {aggregate_type} = {p2})
         AND ({p3}::text IS NULL OR e.{aggregate_id}::text = {p3})
         AND ({p4}::text IS NULL OR {event_type} = {p4})",
        p0 = p(0),
        p1 = p(1),
        p2 = p(2),
        p3 = p(3),
        p4 = p(4),
        aggregate_type = table.text_expr(Role::AggregateType, "NULL::text"),
        aggregate_id = table.col(Role::AggregateId),
        event_type = table.text_expr(Role::EventType, "NULL::text"),
    );
    if let Some(predicate) = &plan.predicate {
        sql.push_str(&format!("\n         AND ({predicate})"));
    }
    sql
}

fn selection_params(plan: &Plan) -> [&(dyn ToSql + Sync); 5] {
    [
        &plan.since,
        &plan.until,
        &plan.aggregate_type,
        &plan.aggregate_id,
        &plan.event_type,
    ]
}

/// A `--where` the server refused, named with its fix.
fn predicate_error(plan: &Plan, error: tokio_postgres::Error) -> Error {
    match &plan.predicate {
        Some(predicate) => Error::setup(
            format!("--where {predicate:?} cannot select events: {}", crate::error::postgres_error_text(&error)),
            "give a boolean SQL expression over the outbox table's columns that only reads, e.g. --where \"payload->>'currency' = 'EUR'\"",
        ),
        None => error.into(),
    }
}

/// How the pipeline that publishes the live topics runs (`--mode`, `--poll-order`, `--slot`, as `run` is
/// given them): a replay to the live topics waits for what it has on its way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pipeline {
    /// `--mode`: under `poll` no slot is waited for.
    pub mode: Mode,
    /// `--poll-order`: `none` keeps no order, so a replay to the live topics is refused.
    pub poll_order: PollOrder,
    /// `--slot`.
    pub slot: String,
}

/// What a replay did.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The replay's id (for `--resume` and the header).
    pub replay_id: String,
    /// Events selected, over every table.
    pub selected: u64,
    /// Events republished.
    pub republished: u64,
    /// Events handed back to the live topics that were dead-lettered instead of republished (`outboxd dead
    /// list`).
    pub dead: u64,
}

/// Starts the replay `plan` describes under the id `replay_id` (see [`new_replay_id`]), or, without a plan,
/// goes on with the replay of that id, over every table with polling columns; returns once every selected
/// event is republished. `kafka`: the settings a replay to another topic produces with (`None` where the
/// Kafka options were not given).
pub async fn replay(
    database: DatabaseSettings<TableSpec>,
    kafka: Option<RunSettings<TableSpec>>,
    pipeline: Pipeline,
    plan: Option<Plan>,
    replay_id: String,
) -> Result<Outcome> {
    let resume = plan.is_none();
    let mut sql = crate::pg::connect(&database.database_url).await?;
    let tables = crate::pg::slot::inspect_all(&sql, &database.tables).await?;
    for table in &tables {
        crate::pg::slot::check_polling_columns(table)?;
        check_replay_tables(&sql, table).await?;
    }
    let mut outcome = Outcome {
        replay_id: replay_id.clone(),
        ..Outcome::default()
    };
    // An archive holds the rows of every table: read once, with the first table's columns.
    let from_archive = plan.as_ref().is_some_and(|p| p.from_archive.is_some());
    let tables: Vec<OutboxTable> = if from_archive {
        tables.into_iter().take(1).collect()
    } else {
        tables
    };
    for table in &tables {
        let (plan, stage) = match &plan {
            Some(plan) => {
                let plan = Plan {
                    until: plan.until.or(Some(SystemTime::now())),
                    pipeline: Some(pipeline.clone()),
                    ..plan.clone()
                };
                let first = if plan.to_topic.is_some() {
                    Stage::Sending
                } else {
                    Stage::HandingBack
                };
                // Refusals before anything is recorded: a replay refused leaves no trace.
                if plan.to_topic.is_none() {
                    check_pipeline(&sql, &pipeline).await?;
                    check_no_live_replay_under_way(&sql, table).await?;
                }
                if let Some(archive) = &plan.from_archive {
                    archive_source(&sql, table, archive).await?;
                }
                check_selection(&mut sql, table, &plan).await?;
                start(&sql, table, &replay_id, &plan, first).await?;
                (plan, first)
            }
            None => match load(&sql, table, &replay_id).await? {
                Some(found) => found,
                None => continue,
            },
        };
        tracing::info!(replay = %replay_id, table = %table.name, state = stage.as_str(), "replaying published events");
        let (selected, republished) = match (&plan.to_topic, &kafka) {
            (Some(_), Some(kafka)) => {
                send_to_topic(&mut sql, kafka, table, &replay_id, &plan).await?
            }
            (Some(topic), None) => {
                return Err(Error::setup(
                    format!(
                        "replay {replay_id} produces to topic {topic}, and no broker was given"
                    ),
                    "give --brokers (and the other Kafka options outboxd run takes)",
                ))
            }
            (None, _) => {
                // As it was started (a --resume given other --mode or --slot does not change what it waits
                // for).
                let waits_for = plan.pipeline.clone().unwrap_or_else(|| pipeline.clone());
                let live =
                    replay_live(&mut sql, &waits_for, table, &replay_id, &plan, stage).await?;
                outcome.dead += live.2;
                (live.0, live.1)
            }
        };
        outcome.selected += selected;
        outcome.republished += republished;
    }
    if resume && outcome.selected == 0 && outcome.republished == 0 {
        let known = any_replay(&sql, &tables, &replay_id).await?;
        if !known {
            return Err(Error::setup(
                format!("no replay has the id {replay_id}"),
                "give --resume the id a replay printed (outboxd status lists the replays under way)",
            ));
        }
    }
    Ok(outcome)
}

async fn check_replay_tables(sql: &Client, table: &OutboxTable) -> Result<()> {
    let names = replay_tables(&table.name);
    let present: bool = sql
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL",
            &[&names.progress, &names.replayed],
        )
        .await?
        .get(0);
    if !present {
        return Err(Error::setup(
            format!(
                "{} lacks the replay tables ({} and {}) that replay keeps its progress in",
                table.name, names.progress, names.replayed
            ),
            "run `outboxd migrate` (this version's migration 0006 creates them)",
        ));
    }
    Ok(())
}

async fn start(
    sql: &Client,
    table: &OutboxTable,
    replay_id: &str,
    plan: &Plan,
    stage: Stage,
) -> Result<()> {
    let plan_text = serde_json::to_string(plan).map_err(|e| Error::bug(e.to_string()))?;
    sql.execute(
        &format!(
            "INSERT INTO {} (replay_id, plan, state) VALUES ($1, $2, $3)",
            replay_tables(&table.name).progress
        ),
        &[&replay_id, &plan_text, &stage.as_str()],
    )
    .await?;
    Ok(())
}

async fn load(sql: &Client, table: &OutboxTable, replay_id: &str) -> Result<Option<(Plan, Stage)>> {
    let Some(row) = sql
        .query_opt(
            &format!(
                "SELECT plan, state FROM {} WHERE replay_id = $1",
                replay_tables(&table.name).progress
            ),
            &[&replay_id],
        )
        .await?
    else {
        return Ok(None);
    };
    let plan: Plan = serde_json::from_str(row.get(0))
        .map_err(|e| Error::bug(format!("replay {replay_id}'s plan cannot be read: {e}")))?;
    let state: &str = row.get(1);
    if state == "cancelled" {
        return Err(Error::setup(
            format!("replay {replay_id} was cancelled"),
            "start a new replay (outboxd replay --published ...)",
        ));
    }
    let stage = Stage::parse(state)
        .ok_or_else(|| Error::bug(format!("replay {replay_id} is in an unknown state")))?;
    Ok(Some((plan, stage)))
}

async fn any_replay(sql: &Client, tables: &[OutboxTable], replay_id: &str) -> Result<bool> {
    for table in tables {
        if load(sql, table, replay_id).await?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

async fn set_stage(
    sql: &Client,
    table: &OutboxTable,
    replay_id: &str,
    stage: Stage,
    counts: Option<(i64, i64)>,
) -> Result<()> {
    sql.execute(
        &format!(
            "UPDATE {} SET state = $2, total = coalesce($3, total), done = coalesce($4, done), updated_at = now()
             WHERE replay_id = $1 AND state <> 'cancelled'",
            replay_tables(&table.name).progress
        ),
        &[
            &replay_id,
            &stage.as_str(),
            &counts.map(|c| c.0),
            &counts.map(|c| c.1),
        ],
    )
    .await?;
    // A `--cancel` in between wins: the replay stops (see `check_not_cancelled`).
    check_not_cancelled(sql, table, replay_id).await
}

/// Live: hand back held, wait until nothing of theirs is on its way, release, wait until published. Returns
/// (selected, republished, dead-lettered instead).
async fn replay_live(
    sql: &mut Client,
    pipeline: &Pipeline,
    table: &OutboxTable,
    replay_id: &str,
    plan: &Plan,
    mut stage: Stage,
) -> Result<(u64, u64, u64)> {
    let progress = replay_tables(&table.name).progress;
    if stage == Stage::HandingBack {
        // One transaction: an interrupted run handed back nothing, or everything it selected.
        let ids = select_ids(sql, table, plan).await?;
        outbox::hand_back_published(sql, table, &ids, replay_id, true).await?;
        // Counted from what is recorded, so that a run interrupted after the hand-back counts it too.
        let handed: i64 = sql
            .query_one(
                &format!(
                    "SELECT count(*) FROM {} WHERE replay_id = $1",
                    replay_tables(&table.name).replayed
                ),
                &[&replay_id],
            )
            .await?
            .get(0);
        let updated = sql
            .execute(
                &format!(
                    "UPDATE {progress} SET state = $2, total = $3, stream_past = pg_current_wal_insert_lsn(),
                                           updated_at = now()
                     WHERE replay_id = $1 AND state <> 'cancelled'"
                ),
                &[&replay_id, &Stage::Held.as_str(), &handed],
            )
            .await?;
        if updated == 0 {
            check_not_cancelled(sql, table, replay_id).await?;
        }
        tracing::info!(replay = %replay_id, table = %table.name, events = handed, "handed back, held until nothing of their aggregates is on its way");
        stage = Stage::Held;
    }
    if stage == Stage::Held {
        wait_until_nothing_on_its_way(sql, pipeline, table, replay_id).await?;
        let released = outbox::release_replay(sql, table, replay_id, plan.rate).await?;
        set_stage(sql, table, replay_id, Stage::Released, None).await?;
        tracing::info!(replay = %replay_id, table = %table.name, events = released, "released to the polling path");
        stage = Stage::Released;
    }
    let total: i64 = sql
        .query_one(
            &format!("SELECT total FROM {progress} WHERE replay_id = $1"),
            &[&replay_id],
        )
        .await?
        .get(0);
    if stage == Stage::Released {
        let mut last_progress = Instant::now();
        loop {
            check_not_cancelled(sql, table, replay_id).await?;
            let waiting = replay_rows(sql, table, replay_id, "o.dead_at IS NULL").await?;
            if waiting == 0 {
                break;
            }
            if last_progress.elapsed() >= PROGRESS_EVERY {
                let done = (total - waiting).max(0);
                set_stage(sql, table, replay_id, Stage::Released, Some((total, done))).await?;
                tracing::info!(replay = %replay_id, table = %table.name, done, total, "republishing through the polling path");
                last_progress = Instant::now();
            }
            tokio::time::sleep(CHECK_EVERY).await;
        }
    }
    // Dead-lettered on the way (refused for good): not republished, and named.
    let dead = replay_rows(sql, table, replay_id, "o.dead_at IS NOT NULL").await?;
    set_stage(
        sql,
        table,
        replay_id,
        Stage::Done,
        Some((total, total - dead)),
    )
    .await?;
    if dead > 0 {
        tracing::error!(replay = %replay_id, table = %table.name, dead, "events of the replay were dead-lettered instead of republished: see `outboxd dead list`");
    }
    Ok((
        total.max(0) as u64,
        (total - dead).max(0) as u64,
        dead.max(0) as u64,
    ))
}

/// A replay to the live topics keeps each aggregate's order only where the pipeline does, and waits for the
/// slot `run` streams: refuses `--poll-order none`, and a `--slot` this database lacks while it has other
/// logical slots (a replay given another `--slot` than `run` would not wait for the stream at all).
async fn check_pipeline(sql: &Client, pipeline: &Pipeline) -> Result<()> {
    if pipeline.poll_order == PollOrder::None {
        return Err(Error::setup(
            "--poll-order none keeps no order in the polling path, so a replay to the live topics could put live events between an aggregate's replayed ones",
            "replay to another topic (--to-topic), or run with --poll-order per-aggregate",
        ));
    }
    if pipeline.mode == Mode::Poll {
        return Ok(());
    }
    let others: Vec<String> = sql
        .query(
            "SELECT slot_name::text FROM pg_replication_slots
             WHERE database = current_database() AND slot_type = 'logical'
               AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.slot_name = $1
                               AND s.database = current_database() AND s.slot_type = 'logical')",
            &[&pipeline.slot],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if !others.is_empty() {
        return Err(Error::setup(
            format!(
                "no logical slot named {} in this database, but {} exist: a replay to the live topics waits for the slot outboxd streams",
                pipeline.slot,
                others.join(", ")
            ),
            "give replay the --slot `outboxd run` has (or --mode poll where outboxd only polls)",
        ));
    }
    Ok(())
}

/// One replay to the live topics at a time per table: two over the same events would each take some of an
/// aggregate's events as its own and wait for the other's release.
async fn check_no_live_replay_under_way(sql: &Client, table: &OutboxTable) -> Result<()> {
    let under_way = under_way(sql, std::slice::from_ref(table)).await?;
    if let Some(other) = under_way.iter().find(|r| r.to_topic.is_none()) {
        return Err(Error::setup(
            format!(
                "replay {} to the live topics is under way ({}, {} of {})",
                other.replay_id, other.state, other.done, other.total
            ),
            format!(
                "wait for it (outboxd status), resume it (outboxd replay --resume {id}), or give it up (outboxd replay --cancel {id})",
                id = other.replay_id
            ),
        ));
    }
    Ok(())
}

/// Fails with the server's reason when the selection (its `--where`, above all) cannot be read.
async fn check_selection(sql: &mut Client, table: &OutboxTable, plan: &Plan) -> Result<()> {
    let statement = format!(
        "SELECT 1 FROM {t} e WHERE {selection} LIMIT 1",
        t = table.name.quoted(),
        selection = selection_sql(table, plan, 1, None),
    );
    let tx = sql.build_transaction().read_only(true).start().await?;
    tx.query(&statement, &selection_params(plan))
        .await
        .map_err(|e| predicate_error(plan, e))?;
    tx.commit().await?;
    Ok(())
}

/// The event ids of the selection, in their order, read in a read-only transaction.
async fn select_ids(sql: &mut Client, table: &OutboxTable, plan: &Plan) -> Result<Vec<Uuid>> {
    let statement = format!(
        "SELECT e.{id} FROM {t} e WHERE {selection}
         ORDER BY e.position NULLS FIRST, e.{id}",
        id = table.col(Role::EventId),
        t = table.name.quoted(),
        selection = selection_sql(table, plan, 1, None),
    );
    let tx = sql.build_transaction().read_only(true).start().await?;
    let rows = tx
        .query(&statement, &selection_params(plan))
        .await
        .map_err(|e| predicate_error(plan, e))?;
    tx.commit().await?;
    Ok(rows.iter().map(|row| row.get(0)).collect())
}

/// Fails once `outboxd replay --cancel` gave the replay up (a replay still waiting stops then).
async fn check_not_cancelled(sql: &Client, table: &OutboxTable, replay_id: &str) -> Result<()> {
    load(sql, table, replay_id).await.map(|_| ())
}

/// Rows of the replay still unpublished (with `condition` on the outbox row `o`).
async fn replay_rows(
    sql: &Client,
    table: &OutboxTable,
    replay_id: &str,
    condition: &str,
) -> Result<i64> {
    Ok(sql
        .query_one(
            &format!(
                "SELECT count(*) FROM {replayed} r JOIN {t} o ON o.{id} = r.event_id
                 WHERE r.replay_id = $1 AND o.handoff_at = r.handed_back_at AND o.published_at IS NULL
                   AND {condition}",
                replayed = replay_tables(&table.name).replayed,
                t = table.name.quoted(),
                id = table.col(Role::EventId),
            ),
            &[&replay_id],
        )
        .await?
        .get(0))
}

/// Runs `leases` (counting the leases on events of the held aggregates) once every claim under way on
/// `table` has committed: under the claim lock, which claims hold for their whole transaction. A claim
/// whose snapshot predates the hand-back may be leasing a live event of a held aggregate; uncommitted, its
/// lease would not be counted, the held events would be released, and one of them could be claimed while
/// that live event is still on its way.
async fn leases_once_claims_committed(
    sql: &Client,
    table: &OutboxTable,
    leases: &str,
    replay_id: &str,
) -> Result<i64> {
    use crate::pipeline::liveness::lock_call;
    let key = crate::pg::outbox::claim_lock_key(table);
    sql.execute(
        &format!("SELECT {}", lock_call("pg_advisory_lock", "$1")),
        &[&key],
    )
    .await?;
    let counted = sql.query_one(leases, &[&replay_id]).await;
    sql.execute(
        &format!("SELECT {}", lock_call("pg_advisory_unlock", "$1")),
        &[&key],
    )
    .await?;
    Ok(counted?.get(0))
}

/// Waits until the slot (where there is one) confirmed past the hand-back, and no event of a held aggregate
/// is leased by a polling worker: then nothing of those aggregates is on its way to Kafka, and every later
/// event of theirs waits behind the held ones.
async fn wait_until_nothing_on_its_way(
    sql: &Client,
    pipeline: &Pipeline,
    table: &OutboxTable,
    replay_id: &str,
) -> Result<()> {
    let slot = pipeline.slot.as_str();
    let progress = replay_tables(&table.name).progress;
    let replayed = replay_tables(&table.name).replayed;
    let t = table.name.quoted();
    let id = table.col(Role::EventId);
    let aggregate = table.aggregate_key();
    let stream = format!(
        "SELECT coalesce(s.confirmed_flush_lsn >= p.stream_past, false), s.active, s.confirmed_flush_lsn::text,
                p.stream_past::text
         FROM {progress} p, pg_replication_slots s
         WHERE p.replay_id = $1 AND s.slot_name = $2 AND s.database = current_database()
           AND s.slot_type = 'logical'"
    );
    let leases = format!(
        "WITH held AS (
             SELECT DISTINCT ROW({aggregate})::text AS k FROM {t}
             WHERE {id} IN (SELECT event_id FROM {replayed} WHERE replay_id = $1) AND available_at = 'infinity'
               AND published_at IS NULL)
         SELECT count(*) FROM {t}
         WHERE published_at IS NULL AND lease_until >= now() AND ROW({aggregate})::text IN (SELECT k FROM held)"
    );
    let logical: bool = sql
        .query_one("SELECT current_setting('wal_level') = 'logical'", &[])
        .await?
        .get(0);
    let mut last_said = Instant::now();
    loop {
        check_not_cancelled(sql, table, replay_id).await?;
        let stream_state = if pipeline.mode == Mode::Poll {
            None
        } else {
            sql.query_opt(&stream, &[&replay_id, &slot]).await?
        };
        // No such slot: passed only where the server cannot decode logically (no stream to wait for);
        // otherwise the slot `run` will create or stream is waited for.
        let stream_passed = match &stream_state {
            Some(row) => row.get(0),
            None => pipeline.mode == Mode::Poll || !logical,
        };
        // Counted without the claim lock first, so that claims are not held up while leases remain; a count
        // of none is confirmed under it.
        let leased: i64 = if stream_passed {
            match sql.query_one(&leases, &[&replay_id]).await?.get(0) {
                0 => leases_once_claims_committed(sql, table, &leases, replay_id).await?,
                leased => leased,
            }
        } else {
            0
        };
        if stream_passed && leased == 0 {
            return Ok(());
        }
        if last_said.elapsed() >= PROGRESS_EVERY {
            match &stream_state {
                Some(row) if !stream_passed => {
                    let (active, at, past): (bool, Option<String>, Option<String>) =
                        (row.get(1), row.get(2), row.get(3));
                    if active {
                        tracing::info!(replay = %replay_id, slot, confirmed = ?at, needed = ?past, "waiting for the stream to pass the hand-back");
                    } else {
                        tracing::warn!(replay = %replay_id, slot, confirmed = ?at, needed = ?past, "waiting for the stream to pass the hand-back, but no outboxd streams the slot: start outboxd run (the held events wait until it has)");
                    }
                }
                None if !stream_passed => {
                    tracing::warn!(replay = %replay_id, slot, "waiting for the stream to pass the hand-back, but this database has no slot of that name yet: start outboxd run (or --cancel the replay)");
                }
                _ => {
                    tracing::info!(replay = %replay_id, leased, "waiting for the events of the held aggregates polling workers hold")
                }
            }
            last_said = Instant::now();
        }
        tokio::time::sleep(CHECK_EVERY).await;
    }
}

/// To another topic: batches in order from the cursor, each produced and acknowledged before the cursor moves
/// past it. Returns (selected, republished).
async fn send_to_topic(
    sql: &mut Client,
    settings: &RunSettings<TableSpec>,
    table: &OutboxTable,
    replay_id: &str,
    plan: &Plan,
) -> Result<(u64, u64)> {
    let Some(topic) = plan.to_topic.as_deref() else {
        return Ok((0, 0));
    };
    let progress = replay_tables(&table.name).progress;
    let row = sql
        .query_one(
            &format!("SELECT state, cursor, done FROM {progress} WHERE replay_id = $1"),
            &[&replay_id],
        )
        .await?;
    let (state, cursor, mut done): (String, Option<String>, i64) =
        (row.get(0), row.get(1), row.get(2));
    if Stage::parse(&state) == Some(Stage::Done) {
        return Ok((done as u64, 0));
    }
    let mut cursor: Cursor = match cursor {
        Some(text) => serde_json::from_str(&text)
            .map_err(|e| Error::bug(format!("replay {replay_id}'s cursor cannot be read: {e}")))?,
        None => Cursor::default(),
    };
    let id = table.col(Role::EventId);
    let key = format!("coalesce(e.position, {}), e.{id}", i64::MIN);
    // From the archive: its rows are published ones (retention moved them), read by the outbox table's
    // column names.
    let (source, handed_back) = match &plan.from_archive {
        Some(archive) => (archive_source(sql, table, archive).await?, None),
        None => (
            table.name.quoted(),
            Some(replay_tables(&table.name).replayed),
        ),
    };
    let statement = format!(
        "SELECT 'replayed', {columns} FROM {source} e
         WHERE {selection} AND ({key}) > ($1, $2)
         ORDER BY {key} LIMIT $3",
        columns = EventColumns::select_list(table, "$4::text"),
        selection = selection_sql(table, plan, 5, handed_back.as_deref()),
    );
    let columns = EventColumns::of(table);
    let (deliveries_tx, mut deliveries) = tokio::sync::mpsc::unbounded_channel::<Delivery<u64>>();
    let producing = settings
        .clone()
        .inspected(vec![table.clone()], settings.mode);
    let sinks = crate::kafka::KafkaSinks::default();
    // Exactly-once: each batch is one Kafka transaction with a progress record of its own key, and what the
    // last committed one says is where the replay goes on (the table's cursor may be a batch behind it).
    let transactions = match settings.kafka.exactly_once {
        Some(_) => {
            let system_id = crate::pg::system_identifier(sql).await?.ok_or_else(|| {
                Error::setup(
                    "--delivery exactly-once: the role may not read the server's system identifier, which names a replay's Kafka transactions",
                    "run replay as a role that may call pg_control_system() (GRANT pg_monitor, or EXECUTE on it)",
                )
            })?;
            Some(ProgressKey {
                system_id,
                slot: format!("replay.{replay_id}.{}", table.name),
            })
        }
        None => None,
    };
    let publisher = match &transactions {
        Some(key) => sinks.exactly_once_sink(&producing, deliveries_tx, key)?,
        None => sinks.sink(&producing, deliveries_tx)?,
    };
    if let Some(key) = &transactions {
        let committed = publisher.begin_transactions(key).await?;
        if let Some(text) = committed.and_then(|progress| progress.replay_cursor) {
            let found: Cursor = serde_json::from_str(&text).map_err(|e| {
                Error::bug(format!(
                    "replay {replay_id}'s committed cursor cannot be read: {e}"
                ))
            })?;
            cursor = found;
            done = found.done;
        }
    }
    let started = Instant::now();
    let mut sent_this_run = 0u64;
    let mut last_progress = Instant::now();
    loop {
        let mut params: Vec<&(dyn ToSql + Sync)> =
            vec![&cursor.position, &cursor.event_id, &BATCH, &replay_id];
        params.extend(selection_params(plan));
        let rows = {
            let tx = sql.build_transaction().read_only(true).start().await?;
            let rows = tx
                .query(&statement, &params)
                .await
                .map_err(|e| predicate_error(plan, e))?;
            tx.commit().await?;
            rows
        };
        if rows.is_empty() {
            break;
        }
        let mut batch = Vec::with_capacity(rows.len());
        for row in &rows {
            let (position, _, claimed) = columns.claimed_row(row)?;
            batch.push((position.unwrap_or(i64::MIN), claimed));
        }
        for (_, claimed) in &batch {
            let event = &claimed.event;
            let live = settings.topic.render(
                &table.name,
                event.aggregate_type.as_deref().unwrap_or_default(),
                event.event_type.as_deref().unwrap_or_default(),
            );
            if live == topic {
                // Refused before anything was sent: the replay is given up, not left under way.
                sql.execute(
                    &format!("UPDATE {progress} SET state = 'cancelled' WHERE replay_id = $1 AND done = 0"),
                    &[&replay_id],
                )
                .await?;
                return Err(Error::setup(
                    format!("--to-topic {topic} is where event {} is published live: a replay to it would go around the per-aggregate gate", claimed.event_id),
                    "leave out --to-topic to replay to the live topics (through the gate), or give another topic",
                ));
            }
        }
        for (n, (_, claimed)) in batch.iter().enumerate() {
            let wait = pace(plan.rate, sent_this_run, started.elapsed());
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            publisher
                .publish(
                    table,
                    topic,
                    &claimed.event,
                    claimed.event_id,
                    n as u64,
                    None,
                )
                .await
                .map_err(|e| replay_stopped(replay_id, Error::from(e)))?;
            sent_this_run += 1;
        }
        let (position, last) = batch
            .last()
            .map(|(p, c)| (*p, c.event_id))
            .unwrap_or_default();
        let reached = Cursor {
            position,
            event_id: last,
            done: done + batch.len() as i64,
        };
        let cursor_text = serde_json::to_string(&reached).map_err(|e| Error::bug(e.to_string()))?;
        if let Some(key) = &transactions {
            let progress = crate::progress::Progress {
                replay_cursor: Some(cursor_text.clone()),
                ..crate::progress::Progress::new(
                    key.clone(),
                    0,
                    crate::lsn::Lsn(0),
                    0,
                    None,
                    Vec::new(),
                )
            };
            publisher.commit(&progress).await.map_err(|rejection| {
                replay_stopped(
                    replay_id,
                    Error::Kafka {
                        message: format!(
                            "the batch's Kafka transaction did not commit: {}",
                            rejection.reason
                        ),
                        transient: true,
                    },
                )
            })?;
        }
        let mut acknowledged = 0;
        while acknowledged < batch.len() {
            let delivery = tokio::time::timeout(BATCH_ACK_TIMEOUT, deliveries.recv())
                .await
                .map_err(|_| {
                    replay_stopped(
                        replay_id,
                        Error::Kafka {
                            message: format!(
                                "no acknowledgement from the broker in {BATCH_ACK_TIMEOUT:?}"
                            ),
                            transient: true,
                        },
                    )
                })?
                .ok_or_else(|| Error::bug("the producer's delivery channel closed"))?;
            if let Err(rejection) = delivery.result {
                return Err(replay_stopped(
                    replay_id,
                    Error::Kafka {
                        message: format!("event {}: {}", delivery.event_id, rejection.reason),
                        transient: true,
                    },
                ));
            }
            acknowledged += 1;
        }
        cursor = reached;
        done = reached.done;
        sql.execute(
            &format!(
                "UPDATE {progress} SET cursor = $2, done = $3, total = greatest(total, $3), updated_at = now()
                 WHERE replay_id = $1"
            ),
            &[&replay_id, &cursor_text, &done],
        )
        .await?;
        if last_progress.elapsed() >= PROGRESS_EVERY {
            let rate = sent_this_run as f64 / started.elapsed().as_secs_f64().max(0.001);
            tracing::info!(replay = %replay_id, table = %table.name, topic, done, per_second = rate.round(), "replaying to the topic");
            last_progress = Instant::now();
        }
    }
    set_stage(sql, table, replay_id, Stage::Done, Some((done, done))).await?;
    Ok((done as u64, sent_this_run))
}

/// Where a replay to another topic got: every selected event up to this (position, event id) is acknowledged.
/// With `--delivery exactly-once` it is also written in each Kafka transaction's progress record, with `done`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Cursor {
    position: i64,
    event_id: Uuid,
    /// Events sent up to here.
    #[serde(default)]
    done: i64,
}

impl Default for Cursor {
    fn default() -> Self {
        Cursor {
            position: i64::MIN,
            event_id: Uuid::nil(),
            done: 0,
        }
    }
}

/// The archive `archive` names, quoted, once it is known to hold every column a replay reads (by the outbox
/// table's names).
async fn archive_source(sql: &Client, table: &OutboxTable, archive: &str) -> Result<String> {
    let name = crate::config::parse_table(archive).map_err(|_| {
        Error::setup(
            format!("--from-archive {archive:?} is not a table name"),
            "give it as retention's --archive-table is given (schema.name)",
        )
    })?;
    let mut needed: Vec<String> = [
        Role::EventId,
        Role::AggregateType,
        Role::AggregateId,
        Role::EventType,
        Role::Payload,
        Role::CreatedAt,
    ]
    .into_iter()
    .filter_map(|role| table.column(role).map(str::to_string))
    .collect();
    needed.extend(table.header_columns.iter().cloned());
    needed.extend(
        ["published_at", "dead_at", "position", "attempts"]
            .into_iter()
            .map(String::from),
    );
    let present: Vec<String> = sql
        .query(
            "SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
            &[&name.quoted()],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if present.is_empty() {
        return Err(Error::setup(
            format!("--from-archive: there is no table {name}"),
            "give the table retention archives into (--archive-table)",
        ));
    }
    let missing: Vec<&String> = needed.iter().filter(|c| !present.contains(c)).collect();
    if !missing.is_empty() {
        return Err(Error::setup(
            format!("--from-archive: {name} lacks the columns {missing:?} a replay reads"),
            format!("add them (ALTER TABLE {name} ADD COLUMN ..., as the outbox table has them)"),
        ));
    }
    Ok(name.quoted())
}

fn replay_stopped(replay_id: &str, error: Error) -> Error {
    Error::setup(
        format!("replay {replay_id} stopped: {error}"),
        format!("fix the cause and run `outboxd replay --resume {replay_id}` (it goes on from the last acknowledged batch)"),
    )
}

/// `outboxd replay --cancel`: a replay to the live topics that has not released its events yet lets them go
/// (they count as published again, as before it); one to another topic stops where it got. Returns the
/// events let go; fails when no table has a replay of that id.
pub async fn cancel(database: DatabaseSettings<TableSpec>, replay_id: &str) -> Result<u64> {
    let sql = crate::pg::connect(&database.database_url).await?;
    let tables = crate::pg::slot::inspect_all(&sql, &database.tables).await?;
    let mut found = false;
    let mut let_go = 0;
    for table in tables.iter().filter(|t| t.polling) {
        check_replay_tables(&sql, table).await?;
        let Some((_, stage)) = load(&sql, table, replay_id).await? else {
            continue;
        };
        found = true;
        if stage == Stage::Done {
            continue;
        }
        let_go += outbox::cancel_replay(&sql, table, replay_id).await?;
        sql.execute(
            &format!(
                "UPDATE {} SET state = 'cancelled', updated_at = now() WHERE replay_id = $1",
                replay_tables(&table.name).progress
            ),
            &[&replay_id],
        )
        .await?;
    }
    if !found {
        return Err(Error::setup(
            format!("no replay has the id {replay_id}"),
            "give --cancel the id a replay printed (outboxd status lists the replays under way)",
        ));
    }
    Ok(let_go)
}

/// Every replay of `tables` not yet done, for `outboxd status`.
pub async fn under_way(sql: &Client, tables: &[OutboxTable]) -> Result<Vec<Progress>> {
    let mut found = Vec::new();
    for table in tables {
        let names = replay_tables(&table.name);
        // Missing (an earlier migrate), or not readable by the role `status` runs as (README's role): no
        // replay to show.
        let readable = crate::pg::may_read(sql, &names.progress).await?;
        if !readable {
            continue;
        }
        for row in sql
            .query(
                &format!(
                    "SELECT replay_id, state, total, done, plan FROM {} WHERE state NOT IN ('done', 'cancelled')
                     ORDER BY started_at",
                    names.progress
                ),
                &[],
            )
            .await?
        {
            let plan: Option<Plan> = serde_json::from_str(row.get(4)).ok();
            found.push(Progress {
                replay_id: row.get(0),
                table: table.name.to_string(),
                state: row.get(1),
                total: row.get(2),
                done: row.get(3),
                to_topic: plan.and_then(|p| p.to_topic),
            });
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacing_spaces_events_at_the_rate_and_never_waits_when_behind() {
        assert_eq!(pace(None, 1_000, Duration::ZERO), Duration::ZERO);
        assert_eq!(
            pace(Some(100.0), 50, Duration::from_millis(200)),
            Duration::from_millis(300)
        );
        assert_eq!(
            pace(Some(100.0), 50, Duration::from_secs(1)),
            Duration::ZERO
        );
    }

    #[test]
    fn replay_ids_are_named_for_their_start_and_never_shared() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_000_000);
        let (a, b) = (new_replay_id(now), new_replay_id(now));
        assert!(a.starts_with("replay-20261130T005320Z-"), "{a}");
        assert_ne!(a, b);
        assert!(!a.contains(':'), "{a}");
    }

    #[test]
    fn the_predicate_is_one_parenthesised_condition_after_the_parameterised_filters() {
        let table = OutboxTable::standard_for_tests();
        let plan = Plan {
            predicate: Some("payload->>'currency' = 'EUR'".into()),
            ..Plan::default()
        };
        let sql = selection_sql(&table, &plan, 4, None);
        assert!(sql.contains("$4::timestamptz IS NULL"), "{sql}");
        assert!(sql.contains("$8::text IS NULL"), "{sql}");
        assert!(
            sql.trim_end()
                .ends_with("AND (payload->>'currency' = 'EUR')"),
            "{sql}"
        );
        assert!(!selection_sql(&table, &Plan::default(), 1, None).contains("AND ()"));
        let with = selection_sql(&table, &Plan::default(), 1, Some("r"));
        assert!(with.contains("IN (SELECT event_id FROM r)"), "{with}");
    }

    #[test]
    fn stages_read_back_as_written() {
        for stage in [
            Stage::HandingBack,
            Stage::Held,
            Stage::Released,
            Stage::Sending,
            Stage::Done,
        ] {
            assert_eq!(Stage::parse(stage.as_str()), Some(stage));
        }
        assert_eq!(Stage::parse("lost"), None);
    }
}
