//! Leadership among outboxd instances sharing one slot: a session-level advisory lock held on a dedicated
//! connection. Exactly one instance streams; the others stand by and take over when the leader's session
//! ends. A leader that vanishes without closing its connection (a node lost, a network partition) must not
//! hold the lock for the operating system's TCP timeout (about two hours), so:
//!
//! - the lock connection has TCP keepalives and `tcp_user_timeout` on both ends (the client's socket, and
//!   the server's through its session settings), and idle-session kills switched off for that session;
//! - the leader runs a health query every [`HEALTH_INTERVAL`] that also proves its own server session holds
//!   the lock (a transaction-mode pooler would run it elsewhere: refused with a setup error), and gives up
//!   leadership when it gets no answer within [`HEALTH_TIMEOUT`];
//! - a standby ends the session of a leader that has been silent for [`SILENT_LEADER`], and, once it holds
//!   the lock, a walsender of the slot that has sent no reply for [`SILENT_WALSENDER`] (a proxy or load
//!   balancer in between keeps answering TCP for a dead client, so keepalives alone are not enough).
//!
//! Together these bound a takeover by [`TAKEOVER_BOUND`], the figure README states (the shared parts of
//! dead-peer detection are in `liveness`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;

use crate::backoff::Backoff;
use crate::config::RunSettings;
use crate::error::{Error, Result};
use crate::http::READINESS;
use crate::pipeline::liveness::{
    session_settings, with_dead_peer_detection, HEALTH_INTERVAL, HEALTH_TIMEOUT, LOCK_ROWS,
    SILENT_LEADER,
};

/// How often a standby asks for the lock.
const STANDBY_POLL: Duration = Duration::from_secs(1);
/// A walsender of our slot that has had no reply from its client for this long serves a dead client (a
/// live outboxd replies every `--status-interval`): the instance holding the lock ends it.
pub const SILENT_WALSENDER: Duration = Duration::from_secs(10);
/// Time a new leader needs from taking the lock to streaming (connect, inspect the slot, end a silent
/// walsender, START_REPLICATION), with room for a loaded machine.
const STREAM_START: Duration = Duration::from_secs(9);
/// After the leader's network goes silent, a standby streams within this (README, *Several instances*).
pub const TAKEOVER_BOUND: Duration = Duration::from_secs(
    SILENT_LEADER.as_secs()
        + STANDBY_POLL.as_secs()
        + HEALTH_TIMEOUT.as_secs()
        + STREAM_START.as_secs(),
);

/// The role an instance plays for a slot, shown as the `application_name` of its leadership connection so
/// that `outboxd status` (any process with SQL access) can count active and standby instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Holds the slot's leadership lock: this instance streams.
    Active,
    /// Waits for the lock, to take over when the active instance goes.
    Standby,
}

/// `application_name` of the leadership connection: `outboxd active <slot>` / `outboxd standby <slot>`,
/// cut to PostgreSQL's 63 bytes as the server would.
pub fn application_name(role: Role, slot: &str) -> String {
    let role = match role {
        Role::Active => "active",
        Role::Standby => "standby",
    };
    let mut name = format!("outboxd {role} {slot}");
    name.truncate(63); // slot names are ASCII
    name
}

async fn announce(client: &tokio_postgres::Client, role: Role, slot: &str) -> Result<()> {
    client
        .execute(
            "SELECT set_config('application_name', $1, false)",
            &[&application_name(role, slot)],
        )
        .await?;
    Ok(())
}

/// Whether this connection's own server session holds the lock: false through a pooler in transaction or
/// statement mode, where the lock stays on whichever server connection ran `pg_try_advisory_lock`.
async fn holds_lock(client: &tokio_postgres::Client, key: &str) -> Result<bool> {
    let sql = format!("SELECT EXISTS (SELECT 1 FROM {LOCK_ROWS} AND l.pid = pg_backend_pid())");
    Ok(client.query_one(&sql, &[&key]).await?.get(0))
}

fn pooler_error() -> Error {
    Error::setup(
        "the leadership lock is not held by this connection's server session (pg_try_advisory_lock took it, but pg_locks shows no such lock for pg_backend_pid()): --database-url goes through a pooler in transaction or statement mode, where a session advisory lock stays on whichever server connection ran it",
        "point --database-url at PostgreSQL directly or at a pooler in session mode (PgBouncer pool_mode = session); the application may keep its transaction-mode pooler",
    )
}

/// A statement on the lock connection, given up after [`HEALTH_TIMEOUT`] (the connection counts as dead).
async fn within<T>(statement: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(HEALTH_TIMEOUT, statement)
        .await
        .unwrap_or_else(|_| {
            Err(Error::SessionRestart(format!(
                "no answer on the leadership connection within {HEALTH_TIMEOUT:?}"
            )))
        })
}

/// Why leadership ended.
#[derive(Debug, Clone)]
enum Lost {
    /// The lock connection died or stopped answering: the lock is (or will be) gone.
    Ended(String),
    /// The lock is not on our server session: a transaction-mode pooler.
    Pooler,
}

/// Held while this instance leads; dropping it closes the lock connection, which releases the lock.
pub struct Leadership {
    lost: watch::Receiver<Option<Lost>>,
    health: tokio::task::AbortHandle,
}

impl Leadership {
    /// Resolves when leadership ends: `Ok(why)` when the lock connection died or stopped answering (another
    /// instance may take over; stand by again), an error when the lock turned out not to be ours (a pooler).
    pub async fn lost(&mut self) -> Result<String> {
        let lost = match self.lost.wait_for(Option::is_some).await {
            Ok(lost) => lost.clone(),
            Err(_) => None,
        };
        match lost {
            Some(Lost::Pooler) => Err(pooler_error()),
            Some(Lost::Ended(why)) => Ok(why),
            None => Ok("the leadership connection ended".into()),
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.health.abort();
    }
}

fn report(lost: &watch::Sender<Option<Lost>>, why: Lost) {
    lost.send_if_modified(|current| {
        if current.is_some() {
            return false;
        }
        *current = Some(why);
        true
    });
}

/// The leader's health query, every [`HEALTH_INTERVAL`], until it fails. Owns the client: when this task
/// ends (or is aborted with its `Leadership`) the connection closes.
async fn watch_health(
    client: tokio_postgres::Client,
    key: String,
    lost: watch::Sender<Option<Lost>>,
) {
    let mut ended = lost.subscribe();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(HEALTH_INTERVAL) => {}
            _ = ended.wait_for(Option::is_some) => return,
        }
        match within(holds_lock(&client, &key)).await {
            Ok(true) => {}
            Ok(false) => return report(&lost, Lost::Pooler),
            Err(error) => {
                return report(
                    &lost,
                    Lost::Ended(format!("the health query failed: {error}")),
                )
            }
        }
    }
}

/// Ends the session of a leader whose lock session has run no statement for [`SILENT_LEADER`] (a dead
/// node, a partition). Needs the same role as that session (or `pg_signal_backend` and `pg_read_all_stats`);
/// without it, the server's keepalives end the session instead. Returns whether one was ended.
async fn end_silent_leader(client: &tokio_postgres::Client, key: &str) -> Result<bool> {
    let sql = format!(
        "SELECT a.pid, pg_terminate_backend(a.pid), extract(epoch FROM now() - a.state_change)::float8
         FROM (SELECT l.pid FROM {LOCK_ROWS} AND l.pid <> pg_backend_pid()) holder
         JOIN pg_stat_activity a ON a.pid = holder.pid
         WHERE a.state = 'idle' AND a.state_change < now() - make_interval(secs => $2)"
    );
    let rows = client
        .query(&sql, &[&key, &SILENT_LEADER.as_secs_f64()])
        .await?;
    for row in &rows {
        let (pid, silent): (i32, f64) = (row.get(0), row.get(2));
        tracing::warn!(
            pid,
            silent_secs = silent.round(),
            "the active instance's leadership session has run no statement for {silent:.0}s (a dead node or a network partition): ended it so that a standby can take over"
        );
    }
    Ok(!rows.is_empty())
}

/// Ends a walsender of `slot` that has had no reply from its client for [`SILENT_WALSENDER`]: only for an
/// instance that holds the leadership lock, so that a dead leader's walsender does not keep the slot busy
/// until `wal_sender_timeout`. A walsender whose client still replies is left alone.
pub async fn end_silent_walsender(client: &tokio_postgres::Client, slot: &str) -> Result<()> {
    let rows = client
        .query(
            "SELECT r.pid, pg_terminate_backend(r.pid)
             FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1
               AND coalesce(r.reply_time, r.backend_start) < now() - make_interval(secs => $2)",
            &[&slot, &SILENT_WALSENDER.as_secs_f64()],
        )
        .await?;
    for row in &rows {
        let pid: i32 = row.get(0);
        tracing::warn!(
            pid,
            slot,
            "ended the walsender of the slot: its client has not replied for {SILENT_WALSENDER:?} (the previous leader, gone)"
        );
    }
    Ok(())
}

/// Logs (once per process) that this instance may not end a silent leader's session.
fn cannot_fence(error: &Error) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(%error, "cannot end a silent leader's session; a takeover after a partition then waits for the server's TCP keepalives (about 15 s) or longer behind a proxy; run every instance as the same role, or grant pg_signal_backend and pg_read_all_stats");
    }
}

/// The leadership lock's key text (the lock is `hashtext` of it) for `settings`' tables and slot.
fn lock_key(settings: &RunSettings) -> String {
    key_text(
        settings.database.tables.iter().map(|t| &t.name),
        &settings.database.slot,
    )
}

/// `outboxd.leader.<tables>.<slot>`, the tables named `schema.table`, sorted and joined with `, `. Stable
/// across versions: for one table it is the key every earlier version used (a rolling upgrade never has two
/// leaders), and it does not depend on the order of `--table`s (earlier versions used that order, so a fleet
/// of several tables given in another order than sorted gets a new key once: upgrade it all at once).
pub fn key_text<'a>(
    tables: impl IntoIterator<Item = &'a crate::table::TableName>,
    slot: &str,
) -> String {
    let mut names: Vec<String> = tables.into_iter().map(|t| t.to_string()).collect();
    names.sort();
    names.dedup();
    format!("outboxd.leader.{}.{slot}", names.join(", "))
}

/// With the lock just taken: proves that this connection's server session holds it (a setup error through
/// a pooler in transaction mode), marks the tables this leader streams, announces it, and ends a walsender
/// a silent previous leader left behind. Any other error means the connection is in trouble.
async fn take_over(
    client: &tokio_postgres::Client,
    settings: &RunSettings,
    key: &str,
) -> Result<()> {
    let slot = settings.database.slot.as_str();
    if !within(holds_lock(client, key)).await? {
        return Err(pooler_error());
    }
    within(super::fleet::mark_cdc_tables(client, settings)).await?;
    within(announce(client, Role::Active, slot)).await?;
    if let Err(error) = within(end_silent_walsender(client, slot)).await {
        tracing::debug!(%error, "cannot check the slot for a silent walsender");
    }
    Ok(())
}

/// Waits until this instance holds the lock for `settings`' slot. `None` when `shutdown` came first.
pub async fn acquire(
    settings: &RunSettings,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<Option<Leadership>> {
    let key = lock_key(settings);
    let url = with_dead_peer_detection(&settings.database.database_url);
    let mut standing_by = false;
    let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));
    // After a failover or switchover the database may be missing or in recovery for a while.
    let mut outage = super::DatabaseOutage::new(settings.reconnect_timeout);
    loop {
        let (client, connection) = match url.connect_raw().await {
            Ok(pair) => {
                outage.ended();
                pair
            }
            Err(error) => {
                let waiting_for = outage.judge(&error)?;
                if waiting_for.is_none() && !error.is_transient() {
                    return Err(error);
                }
                tracing::warn!(%error, waiting_for = waiting_for.as_deref(), "cannot reach PostgreSQL for the leadership lock; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next_delay()) => continue,
                    _ = crate::pipeline::stopped(shutdown) => return Ok(None),
                }
            }
        };
        let (lost_tx, lost) = watch::channel(None);
        let closed = lost_tx.clone();
        tokio::spawn(async move {
            let why = match connection.await {
                Ok(()) => "the leadership connection closed".to_string(),
                Err(error) => format!("the leadership connection ended: {error}"),
            };
            report(&closed, Lost::Ended(why));
        });
        let contention = contend(
            client,
            settings,
            key.clone(),
            (lost_tx, lost),
            &mut standing_by,
            shutdown,
        );
        let trouble = match contention.await? {
            Contention::Leading(leadership) => return Ok(Some(leadership)),
            Contention::Stopped => return Ok(None),
            Contention::Trouble(error) => error,
        };
        tracing::debug!(error = %trouble, "leadership connection trouble; reconnecting");
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay()) => {}
            _ = crate::pipeline::stopped(shutdown) => return Ok(None),
        }
    }
}

/// What one leadership connection came to.
enum Contention {
    Leading(Leadership),
    /// Shutdown came first.
    Stopped,
    /// The connection failed (the lock, if held, went with it): reconnect.
    Trouble(Error),
}

/// On one connection: asks for the lock until it is granted (then takes over), standing by meanwhile and
/// ending a silent leader; or until the connection fails or shutdown. `lost`: the connection's end, as
/// the task driving it reports it.
async fn contend(
    client: tokio_postgres::Client,
    settings: &RunSettings,
    key: String,
    (lost_tx, mut lost): (watch::Sender<Option<Lost>>, watch::Receiver<Option<Lost>>),
    standing_by: &mut bool,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<Contention> {
    let slot = settings.database.slot.as_str();
    let settled = within(async {
        client.batch_execute(&session_settings()).await?;
        Ok(())
    });
    if let Err(error) = settled.await {
        return Ok(Contention::Trouble(error));
    }
    loop {
        let held = within(async {
            let row = client
                .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&key])
                .await?;
            Ok(row.get::<_, bool>(0))
        });
        let held = match held.await {
            Ok(held) => held,
            Err(error) => return Ok(Contention::Trouble(error)),
        };
        if held {
            match take_over(&client, settings, &key).await {
                Ok(()) => {}
                Err(error @ Error::Setup { .. }) => return Err(error),
                Err(error) => return Ok(Contention::Trouble(error)), // the lock goes with the session
            }
            if *standing_by {
                tracing::info!("took over as the active instance for this slot");
            }
            let health = tokio::spawn(watch_health(client, key, lost_tx)).abort_handle();
            return Ok(Contention::Leading(Leadership { lost, health }));
        }
        if !*standing_by {
            if let Err(error) = within(announce(&client, Role::Standby, slot)).await {
                return Ok(Contention::Trouble(error));
            }
            tracing::info!(
                mode = "standby",
                "another outboxd instance is active for this slot; standing by"
            );
            READINESS.set_mode("standby");
            *standing_by = true;
        }
        match within(end_silent_leader(&client, &key)).await {
            Ok(true) => continue, // its lock goes as its backend exits: ask again at once
            Ok(false) => {}
            Err(Error::Postgres(error)) if error.code().is_some() => {
                cannot_fence(&Error::Postgres(error))
            }
            Err(error) => return Ok(Contention::Trouble(error)),
        }
        tokio::select! {
            _ = tokio::time::sleep(STANDBY_POLL) => {}
            _ = lost.wait_for(Option::is_some) => {
                return Ok(Contention::Trouble(Error::SessionRestart("the leadership connection ended".into())));
            }
            _ = crate::pipeline::stopped(shutdown) => return Ok(Contention::Stopped),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_names_fit_postgres_limit() {
        assert_eq!(
            application_name(Role::Standby, "outboxd"),
            "outboxd standby outboxd"
        );
        let long = "s".repeat(63);
        assert_eq!(application_name(Role::Active, &long).len(), 63);
    }

    #[test]
    fn the_leadership_key_is_stable_across_versions_and_table_order() {
        let table = |schema: &str, name: &str| crate::table::TableName {
            schema: schema.into(),
            name: name.into(),
        };
        // The key of every earlier version for one table (PostgreSQL 15: hashtext = 19094275).
        assert_eq!(
            key_text([&table("public", "outbox_event")], "outboxd"),
            "outboxd.leader.public.outbox_event.outboxd"
        );
        let (orders, billing) = (
            table("orders", "outbox_event"),
            table("billing", "outbox_event"),
        );
        let sorted = "outboxd.leader.billing.outbox_event, orders.outbox_event.outboxd";
        assert_eq!(key_text([&orders, &billing], "outboxd"), sorted);
        assert_eq!(key_text([&billing, &orders], "outboxd"), sorted);
        assert_eq!(key_text([&billing, &orders, &billing], "outboxd"), sorted);
    }

    #[test]
    fn a_lock_not_on_our_session_is_a_setup_error_naming_the_fix() {
        let error = pooler_error();
        assert!(!error.is_transient());
        let text = error.to_string();
        assert!(
            text.contains("transaction or statement mode")
                && text.contains("fix: point --database-url at PostgreSQL directly or at a pooler in session mode"),
            "{text}"
        );
    }

    #[test]
    fn the_takeover_bound_covers_its_parts_and_is_the_one_readme_states() {
        // A live leader is never taken for a silent one: its health query runs far more often.
        assert!(SILENT_LEADER >= 3 * (HEALTH_INTERVAL + HEALTH_TIMEOUT) / 2);
        // The leader gives up before a standby may end its session.
        assert!(HEALTH_INTERVAL + HEALTH_TIMEOUT < SILENT_LEADER);
        // By the time a standby takes the lock, the old walsender counts as silent too.
        assert!(SILENT_WALSENDER + HEALTH_INTERVAL <= SILENT_LEADER);
        assert_eq!(TAKEOVER_BOUND, Duration::from_secs(30));
        let readme = include_str!("../../README.md");
        assert!(
            readme.contains(&format!(
                "a standby streams within {} s",
                TAKEOVER_BOUND.as_secs()
            )),
            "README states the takeover bound"
        );
    }

    #[test]
    fn the_lock_session_settings_are_the_server_side_keepalives() {
        assert_eq!(
            session_settings(),
            "SET tcp_keepalives_idle = 5; SET tcp_keepalives_interval = 2; SET tcp_keepalives_count = 3; \
             SET tcp_user_timeout = 15000; SET idle_session_timeout = 0; SET idle_in_transaction_session_timeout = 0"
        );
    }
}
