//! One fleet, one behaviour: instances of mixed modes, settings and versions on one database agree on who
//! publishes a table and in which order. Each instance announces the `--poll-order` it claims rows in with a
//! shared advisory lock per table (held for its lifetime), and one whose order differs from a live peer's
//! stops with a setup error. A CDC leader holds a shared advisory lock per table it streams (on its
//! leadership connection), and a poller that would claim every row of such a table claims nothing while
//! that leader is live: the slot publishes the rows, and the leader's sweeper the ones handed off. A leader
//! whose slot is briefly inactive (its replication session restarting) is still deferred to; only one whose
//! slot has been inactive for [`STREAM_GAP_GRACE`] is not.
//!
//! These locks live in outboxd's keyspace (`liveness::OUTBOXD_LOCK_CLASS`). Earlier versions took them in
//! the bigint keyspace applications use: this version also takes them there, best-effort (never waiting on
//! an application's lock), and counts an earlier version's markers too, so that a fleet of mixed versions
//! still behaves as one.

use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::backoff::Backoff;
use crate::config::{PollOrder, RunSettings};
use crate::error::{Error, Result};
use crate::pipeline::liveness::{self, former_lock_call, lock_call, LockSpace};
use crate::table::TableName;

/// How often a poller asks whether a CDC leader streams its table.
pub const LEADER_CHECK: Duration = Duration::from_secs(1);
/// A live, marked CDC leader whose slot has been inactive this long does not stream: pollers claim the
/// table's rows again. Longer than the leader's longest wait between two replication sessions
/// (`cdc::SESSION_RETRY_CAP`) plus the start of a session, so that a leader reconnecting is waited for.
pub const STREAM_GAP_GRACE: Duration = Duration::from_secs(40);

/// Key text of the lock a CDC leader holds (shared) for each table it streams.
pub fn cdc_marker_key(table: &TableName) -> String {
    format!("outboxd.cdc.{table}")
}

fn order_name(order: PollOrder) -> &'static str {
    match order {
        PollOrder::PerAggregate => "per-aggregate",
        PollOrder::None => "none",
    }
}

/// Key text of the lock every instance that may claim rows of `table` in `order` holds (shared).
fn poll_order_key(table: &TableName, order: PollOrder) -> String {
    format!("outboxd.poll-order.{table}.{}", order_name(order))
}

/// Whether another live session of this database holds the `--poll-order` marker for key text `key`: in
/// outboxd's keyspace, or (an instance of an earlier version) in shared mode in the former one, where an
/// application's exclusive lock on the same bigint does not count. A holder whose session has run no
/// statement for [`liveness::SILENT_LEADER`] does not count: the connections holding these locks run a
/// health query every [`liveness::HEALTH_INTERVAL`], so a silent one is a dead node or a partition. (Where
/// the role may not see other sessions' state, every holder counts.) Only a session whose role may update
/// `table` counts: any login can take an advisory lock (security review M4).
async fn held_by_another(
    client: &tokio_postgres::Client,
    key: &str,
    table: &TableName,
) -> Result<bool> {
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE (({}) OR ({} AND l.mode = 'ShareLock')) AND l.pid <> pg_backend_pid() AND {}
               AND coalesce(NOT (a.state = 'idle' AND a.state_change < now() - make_interval(secs => $2)), true))",
        LockSpace::Outboxd.lock_filter("$1"),
        LockSpace::Former.lock_filter("$1"),
        liveness::may_publish("$3"),
    );
    let tables = [table.quoted()];
    let row = client
        .query_one(
            &sql,
            &[&key, &liveness::SILENT_LEADER.as_secs_f64(), &&tables[..]],
        )
        .await?;
    Ok(row.get(0))
}

/// What a poller sees of the CDC leaders of its table at one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CdcLeader {
    /// No live session named `outboxd active <slot>` holds the table's CDC marker.
    None,
    /// A live leader holds it and its slot is active: it streams.
    Streaming,
    /// A live leader holds it, and its slot is not active: between two replication sessions, or unable to
    /// stream (its replication URL down, its slot held by another client). A slot name cut by the 63-byte
    /// `application_name` matches no slot, so counts here too.
    NotStreaming,
}

/// The CDC leader of the table whose marker has key text `key`, as [`CdcLeader`] describes. The marker
/// counts in either keyspace (a leader of an earlier version holds it in the former one) when its session
/// names itself `outboxd active <slot>` and its role may update `table`, and is live as in [`held_by_another`].
async fn cdc_leader(client: &tokio_postgres::Client, table: &TableName) -> Result<CdcLeader> {
    let sql = format!(
        "SELECT count(*) > 0, coalesce(bool_or(s.active), false)
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         LEFT JOIN pg_replication_slots s ON s.slot_name = substr(a.application_name, length('outboxd active ') + 1)
         WHERE {} AND l.pid <> pg_backend_pid() AND a.application_name LIKE 'outboxd active %' AND {}
           AND coalesce(NOT (a.state = 'idle' AND a.state_change < now() - make_interval(secs => $2)), true)",
        LockSpace::Either.lock_filter("$1"),
        liveness::may_publish("$3"),
    );
    let tables = [table.quoted()];
    let row = client
        .query_one(
            &sql,
            &[
                &cdc_marker_key(table),
                &liveness::SILENT_LEADER.as_secs_f64(),
                &&tables[..],
            ],
        )
        .await?;
    Ok(match (row.get::<_, bool>(0), row.get::<_, bool>(1)) {
        (false, _) => CdcLeader::None,
        (true, true) => CdcLeader::Streaming,
        (true, false) => CdcLeader::NotStreaming,
    })
}

/// Whether a live CDC leader (streaming or between sessions) holds the marker of any of `settings`' tables.
pub async fn led_by_another(
    client: &tokio_postgres::Client,
    settings: &RunSettings,
) -> Result<bool> {
    for table in &settings.database.tables {
        if cdc_leader(client, &table.name).await? != CdcLeader::None {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Takes, on a leader's lock connection, the marker of every table it streams. Returns the key texts of the
/// markers it could not take in the former keyspace too (an application holds that bigint): the caller asks
/// for them again with [`take_former_marker`].
pub async fn mark_cdc_tables(
    client: &tokio_postgres::Client,
    settings: &RunSettings,
) -> Result<Vec<String>> {
    let mut missing = Vec::new();
    for table in &settings.database.tables {
        let key = cdc_marker_key(&table.name);
        client
            .execute(
                &format!("SELECT {}", lock_call("pg_advisory_lock_shared", "$1")),
                &[&key],
            )
            .await?;
        if !take_former_marker(client, &key).await? {
            missing.push(key);
        }
    }
    Ok(missing)
}

/// Takes the shared marker for key text `key` in the former keyspace, where pollers of earlier versions
/// look, if no one holds it exclusively (an application, for a lock of its own). Never waits.
pub async fn take_former_marker(client: &tokio_postgres::Client, key: &str) -> Result<bool> {
    let sql = format!(
        "SELECT {}",
        former_lock_call("pg_try_advisory_lock_shared", "$1")
    );
    Ok(client.query_one(&sql, &[&key]).await?.get(0))
}

/// Pure: whether a poller defers to the CDC leader it sees, given how long the leader's slot has been
/// seen inactive: a live leader between two replication sessions is deferred to for [`STREAM_GAP_GRACE`].
#[derive(Debug, Default)]
struct Deference {
    /// Since when a live leader has been seen without an active slot (at every check since).
    not_streaming_since: Option<Instant>,
}

impl Deference {
    fn defer(&mut self, seen: CdcLeader, now: Instant) -> bool {
        match seen {
            CdcLeader::None => {
                self.not_streaming_since = None;
                false
            }
            CdcLeader::Streaming => {
                self.not_streaming_since = None;
                true
            }
            CdcLeader::NotStreaming => {
                let since = *self.not_streaming_since.get_or_insert(now);
                now.saturating_duration_since(since) < STREAM_GAP_GRACE
            }
        }
    }
}

/// A poller's view of whether a live CDC leader streams its table: asked at most every [`LEADER_CHECK`],
/// each change logged once.
pub struct LeaderWatch {
    table: TableName,
    deference: Deference,
    deferring: bool,
    next_check: Instant,
}

impl LeaderWatch {
    /// A watch on `table`, checked at the first call to [`LeaderWatch::defer`].
    pub fn new(table: &TableName) -> Self {
        LeaderWatch {
            table: table.clone(),
            deference: Deference::default(),
            deferring: false,
            next_check: Instant::now(),
        }
    }

    /// True while a live CDC leader streams the table (or its slot has been inactive for less than
    /// [`STREAM_GAP_GRACE`]): the poller then claims nothing.
    pub async fn defer(&mut self, client: &tokio_postgres::Client) -> Result<bool> {
        if Instant::now() < self.next_check {
            return Ok(self.deferring);
        }
        self.next_check = Instant::now() + LEADER_CHECK;
        let seen = cdc_leader(client, &self.table).await?;
        let defer = self.deference.defer(seen, Instant::now());
        if defer != self.deferring {
            if defer {
                tracing::info!(table = %self.table, "a CDC leader streams this table: this poller claims none of its rows while that leader lives");
            } else if seen == CdcLeader::NotStreaming {
                tracing::info!(table = %self.table, "the CDC leader of this table has not streamed for {STREAM_GAP_GRACE:?} (its slot is inactive): polling it until the leader streams again");
            } else {
                tracing::info!(table = %self.table, "no CDC leader streams this table any longer: polling it");
            }
            self.deferring = defer;
        }
        Ok(defer)
    }
}

/// Holds this instance's `--poll-order` announcement for its lifetime. `conflict` resolves with the
/// setup error should a re-announcement (after the connection was lost) meet a peer of another order.
pub struct PollOrderAnnouncement {
    conflict: watch::Receiver<Option<String>>,
    task: tokio::task::AbortHandle,
}

impl PollOrderAnnouncement {
    /// Resolves only when a peer of another order was found (never otherwise).
    pub async fn conflict(&mut self) -> Error {
        let found = match self.conflict.wait_for(Option::is_some).await {
            Ok(found) => found.clone(),
            Err(_) => None,
        };
        match found {
            Some(problem) => mixed_orders(problem),
            None => std::future::pending().await,
        }
    }
}

impl Drop for PollOrderAnnouncement {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn mixed_orders(problem: String) -> Error {
    Error::setup(
        problem,
        "run every instance on a table with the same --poll-order (to change it, stop them all, then start them with the new one)",
    )
}

/// Announces `settings`' poll order for each table this instance may claim rows of, and refuses (a setup
/// error) when a live peer claims them in another order. `None` when no table has the polling columns.
pub async fn announce_poll_order(settings: &RunSettings) -> Result<Option<PollOrderAnnouncement>> {
    let tables: Vec<TableName> = settings
        .database
        .tables
        .iter()
        .filter(|t| t.polling)
        .map(|t| t.name.clone())
        .collect();
    if tables.is_empty() {
        return Ok(None);
    }
    let order = settings.poll.order;
    let url = liveness::with_dead_peer_detection(&settings.database.database_url);
    let client = announce(&url, &tables, order)
        .await?
        .map_err(mixed_orders)?;
    let (found, conflict) = watch::channel(None);
    let task = tokio::spawn(async move {
        let mut client = client;
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        loop {
            // Keep the session busy (and notice a dead one), as the leadership connection does.
            loop {
                tokio::time::sleep(liveness::HEALTH_INTERVAL).await;
                let alive =
                    tokio::time::timeout(liveness::HEALTH_TIMEOUT, client.simple_query("SELECT 1"));
                if !matches!(alive.await, Ok(Ok(_))) {
                    break;
                }
            }
            tracing::debug!("the --poll-order announcement's connection ended; announcing again");
            loop {
                tokio::time::sleep(backoff.next_delay()).await;
                match announce(&url, &tables, order).await {
                    Ok(Ok(again)) => {
                        client = again;
                        backoff.reset();
                        break;
                    }
                    Ok(Err(problem)) => {
                        let _ = found.send(Some(problem));
                        return;
                    }
                    Err(error) => {
                        tracing::debug!(%error, "cannot announce --poll-order yet; retrying")
                    }
                }
            }
        }
    })
    .abort_handle();
    Ok(Some(PollOrderAnnouncement { conflict, task }))
}

/// One announcement on a new connection: the client holding it, or (inner `Err`) the conflict found.
async fn announce(
    url: &crate::pg::PgUrl,
    tables: &[TableName],
    order: PollOrder,
) -> Result<std::result::Result<tokio_postgres::Client, String>> {
    let client = crate::pg::connect(url).await?;
    client.batch_execute(&liveness::session_settings()).await?;
    // Own order first, then the others: of two instances starting at once, at least one sees the other.
    // In the former keyspace too, where instances of earlier versions look (unless an application holds
    // that bigint exclusively: never waited for).
    for table in tables {
        let key = poll_order_key(table, order);
        client
            .execute(
                &format!("SELECT {}", lock_call("pg_advisory_lock_shared", "$1")),
                &[&key],
            )
            .await?;
        take_former_marker(&client, &key).await?;
    }
    for table in tables {
        for other in [PollOrder::PerAggregate, PollOrder::None] {
            if other != order
                && held_by_another(&client, &poll_order_key(table, other), table).await?
            {
                return Ok(Err(format!(
                    "another outboxd instance claims rows of {table} with --poll-order {}, and this one has --poll-order {}: with mixed orders the unordered claims break the per-aggregate order for every instance",
                    order_name(other),
                    order_name(order)
                )));
            }
        }
    }
    Ok(Ok(client))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poller_defers_to_a_live_leader_between_its_sessions_for_the_grace_only() {
        let start = Instant::now();
        let mut deference = Deference::default();
        assert!(!deference.defer(CdcLeader::None, start));
        assert!(deference.defer(CdcLeader::Streaming, start));
        // The leader's replication session restarts: its slot is inactive for a while.
        assert!(deference.defer(CdcLeader::NotStreaming, start + LEADER_CHECK));
        let gap_end = start + LEADER_CHECK + STREAM_GAP_GRACE;
        assert!(deference.defer(CdcLeader::NotStreaming, gap_end - LEADER_CHECK));
        assert!(!deference.defer(CdcLeader::NotStreaming, gap_end));
        // Streaming again: deferred to, with a whole grace for the next gap.
        assert!(deference.defer(CdcLeader::Streaming, gap_end));
        assert!(deference.defer(CdcLeader::NotStreaming, gap_end + LEADER_CHECK));
        // Gone: polled at once.
        assert!(!deference.defer(CdcLeader::None, gap_end + LEADER_CHECK * 2));
        assert!(deference.defer(CdcLeader::NotStreaming, gap_end + LEADER_CHECK * 3));
    }

    #[test]
    fn the_grace_outlasts_the_leaders_longest_wait_between_sessions() {
        assert!(STREAM_GAP_GRACE >= crate::pipeline::cdc::SESSION_RETRY_CAP + 2 * LEADER_CHECK);
    }

    #[test]
    fn fleet_keys_name_the_table_and_the_order() {
        let table = TableName {
            schema: "public".into(),
            name: "outbox_event".into(),
        };
        assert_eq!(cdc_marker_key(&table), "outboxd.cdc.public.outbox_event");
        assert_eq!(
            poll_order_key(&table, PollOrder::PerAggregate),
            "outboxd.poll-order.public.outbox_event.per-aggregate"
        );
        assert_eq!(
            poll_order_key(&table, PollOrder::None),
            "outboxd.poll-order.public.outbox_event.none"
        );
    }
}
