//! One fleet, one behaviour: instances of mixed modes, settings and versions on one database agree on who
//! publishes a table and in which order. Each instance announces the `--poll-order` it claims rows in with a
//! shared advisory lock per table (held for its lifetime), and one whose order differs from a live peer's
//! stops with a setup error. A CDC leader holds a shared advisory lock per table it streams (on its
//! leadership connection), and a poller that would claim every row of such a table claims nothing while
//! that leader is live: the slot publishes the rows, and the leader's sweeper the ones handed off.

use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::backoff::Backoff;
use crate::config::{PollOrder, RunSettings};
use crate::error::{Error, Result};
use crate::pipeline::liveness::{self, LOCK_ROWS};
use crate::table::TableName;

/// How often a poller asks whether a CDC leader streams its table.
pub const LEADER_CHECK: Duration = Duration::from_secs(1);

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

/// Whether another live session of this database holds the lock for key text `key`. A holder whose
/// session has run no statement for [`liveness::SILENT_LEADER`] does not count: the connections holding
/// these locks run a health query every [`liveness::HEALTH_INTERVAL`], so a silent one is a dead node or a
/// partition. (Where the role may not see other sessions' state, every holder counts.)
async fn held_by_another(client: &tokio_postgres::Client, key: &str) -> Result<bool> {
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {LOCK_ROWS} AND l.pid <> pg_backend_pid()
             AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = l.pid
                 AND a.state = 'idle' AND a.state_change < now() - make_interval(secs => $2)))"
    );
    let row = client
        .query_one(&sql, &[&key, &liveness::SILENT_LEADER.as_secs_f64()])
        .await?;
    Ok(row.get(0))
}

/// True when another live session holds the CDC marker `key` and its slot is in use. A leader that holds
/// the lock but does not stream (its replication URL down, its slot held by another client) is no reason to
/// wait: the leader's session names its slot (`outboxd active <slot>`), which must be active. A slot name cut
/// by the 63-byte application_name matches nothing: then the poller claims (duplicates, never a stall).
async fn streamed_by_another(client: &tokio_postgres::Client, key: &str) -> Result<bool> {
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {LOCK_ROWS} AND l.pid <> pg_backend_pid()
             AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = l.pid
                 AND a.state = 'idle' AND a.state_change < now() - make_interval(secs => $2))
             AND EXISTS (SELECT 1 FROM pg_stat_activity a JOIN pg_replication_slots s
                         ON s.slot_name = substr(a.application_name, length('outboxd active ') + 1)
                         WHERE a.pid = l.pid AND a.application_name LIKE 'outboxd active %' AND s.active))"
    );
    let row = client
        .query_one(&sql, &[&key, &liveness::SILENT_LEADER.as_secs_f64()])
        .await?;
    Ok(row.get(0))
}

/// Takes, on a leader's lock connection, the marker of every table it streams.
pub async fn mark_cdc_tables(
    client: &tokio_postgres::Client,
    settings: &RunSettings,
) -> Result<()> {
    for table in &settings.database.tables {
        client
            .execute(
                "SELECT pg_advisory_lock_shared(hashtext($1))",
                &[&cdc_marker_key(&table.name)],
            )
            .await?;
    }
    Ok(())
}

/// A poller's view of whether a live CDC leader streams its table: asked at most every [`LEADER_CHECK`],
/// each change logged once.
pub struct LeaderWatch {
    table: TableName,
    key: String,
    deferring: bool,
    next_check: Instant,
}

impl LeaderWatch {
    /// A watch on `table`, checked at the first call to [`LeaderWatch::defer`].
    pub fn new(table: &TableName) -> Self {
        LeaderWatch {
            table: table.clone(),
            key: cdc_marker_key(table),
            deferring: false,
            next_check: Instant::now(),
        }
    }

    /// True while a live CDC leader streams the table: the poller then claims nothing.
    pub async fn defer(&mut self, client: &tokio_postgres::Client) -> Result<bool> {
        if Instant::now() < self.next_check {
            return Ok(self.deferring);
        }
        self.next_check = Instant::now() + LEADER_CHECK;
        let leads = streamed_by_another(client, &self.key).await?;
        if leads != self.deferring {
            if leads {
                tracing::info!(table = %self.table, "a CDC leader streams this table: this poller claims none of its rows while that leader lives");
            } else {
                tracing::info!(table = %self.table, "no CDC leader streams this table any longer: polling it");
            }
            self.deferring = leads;
        }
        Ok(leads)
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
    for table in tables {
        client
            .execute(
                "SELECT pg_advisory_lock_shared(hashtext($1))",
                &[&poll_order_key(table, order)],
            )
            .await?;
    }
    for table in tables {
        for other in [PollOrder::PerAggregate, PollOrder::None] {
            if other != order && held_by_another(&client, &poll_order_key(table, other)).await? {
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
