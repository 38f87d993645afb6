//! Leadership among outboxd instances sharing one slot: a session-level advisory lock held on a dedicated
//! connection, in outboxd's own keyspace (`liveness::OUTBOXD_LOCK_CLASS`). Exactly one instance streams; the
//! others stand by and take over when the leader's session ends. Earlier versions took the lock in the
//! bigint keyspace applications use; while an instance of an earlier version may run beside this one (a
//! rolling upgrade), the leader also holds that former key, and stands by while an earlier version's leader
//! holds it. A holder of the former key that does not name itself as outboxd's is an application's lock:
//! it neither keeps this instance from leading nor is ever ended.
//!
//! A leader that vanishes without closing its connection (a node lost, a network partition) must not
//! hold the lock for the operating system's TCP timeout (about two hours), so:
//!
//! - the lock connection has TCP keepalives and `tcp_user_timeout` on both ends (the client's socket, and
//!   the server's through its session settings), and idle-session kills switched off for that session;
//! - the leader runs a health query every [`HEALTH_INTERVAL`] that also proves its own server session holds
//!   the lock (a transaction-mode pooler would run it elsewhere: refused with a setup error), and gives up
//!   leadership when it gets no answer within [`HEALTH_TIMEOUT`];
//! - a standby ends the session of a leader (a session named `outboxd active|standby <slot>` holding the
//!   key) that has been silent for [`SILENT_LEADER`], and, once it holds the lock, a walsender of the slot
//!   that has sent no reply for [`SILENT_WALSENDER`] (a proxy or load balancer in between keeps answering
//!   TCP for a dead client, so keepalives alone are not enough).
//!
//! Together these bound a takeover by [`TAKEOVER_BOUND`], the figure README states (the shared parts of
//! dead-peer detection are in `liveness`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::backoff::Backoff;
use crate::config::RunSettings;
use crate::error::{Error, Result};
use crate::http::READINESS;
use crate::pg::slot::{leadership_application_name, LeadershipRole};
use crate::pipeline::liveness::{
    former_lock_call, lock_call, may_publish, session_settings, with_dead_peer_detection,
    LockSpace, HEALTH_INTERVAL, HEALTH_TIMEOUT, SILENT_LEADER,
};

/// How often a standby asks for the lock.
const STANDBY_POLL: Duration = Duration::from_secs(1);
/// A session holding the former leadership key without naming itself as outboxd's counts as an
/// application's once it has held the key this long: an instance of an earlier version names its session
/// (`outboxd active <slot>`) within a few statements, each given [`HEALTH_TIMEOUT`], after taking the key.
const FORMER_KEY_PATIENCE: Duration = HEALTH_TIMEOUT;
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

async fn announce(client: &tokio_postgres::Client, role: LeadershipRole, slot: &str) -> Result<()> {
    client
        .execute(
            "SELECT set_config('application_name', $1, false)",
            &[&leadership_application_name(role, slot)],
        )
        .await?;
    Ok(())
}

/// Whether this connection's own server session holds the lock: false through a pooler in transaction or
/// statement mode, where the lock stays on whichever server connection ran `pg_try_advisory_lock`.
async fn holds_lock(client: &tokio_postgres::Client, key: &str) -> Result<bool> {
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE {} AND l.pid = pg_backend_pid())",
        LockSpace::Outboxd.lock_filter("$1")
    );
    Ok(client.query_one(&sql, &[&key]).await?.get(0))
}

/// Takes the leadership lock for key text `key` when it is free.
async fn try_lock(client: &tokio_postgres::Client, key: &str) -> Result<bool> {
    let sql = format!("SELECT {}", lock_call("pg_try_advisory_lock", "$1"));
    Ok(client.query_one(&sql, &[&key]).await?.get(0))
}

/// Gives back the leadership lock taken by [`try_lock`].
async fn unlock(client: &tokio_postgres::Client, key: &str) -> Result<()> {
    let sql = format!("SELECT {}", lock_call("pg_advisory_unlock", "$1"));
    client.query_one(&sql, &[&key]).await?;
    Ok(())
}

/// The leadership key in the form earlier versions took it (`pg_advisory_lock(hashtext(key))`), asked for by
/// an instance that holds the key in outboxd's keyspace.
#[derive(Debug, Clone, PartialEq, Eq)]
enum FormerKey {
    /// This session holds it now as well.
    Taken,
    /// A leadership session (`outboxd active|standby <slot>`) holds it: an instance of an earlier version.
    EarlierVersion,
    /// Held by these sessions, none of which names itself as outboxd's: an application's lock on an id of
    /// its own, or (for a moment) an earlier version's leader that has not named its session yet.
    Foreign(Vec<i32>),
}

async fn take_former_key(
    client: &tokio_postgres::Client,
    lock: &LeadershipLock,
) -> Result<FormerKey> {
    let take = format!("SELECT {}", former_lock_call("pg_try_advisory_lock", "$1"));
    if client
        .query_one(&take, &[&lock.key])
        .await?
        .get::<_, bool>(0)
    {
        return Ok(FormerKey::Taken);
    }
    let holders = format!(
        "SELECT l.pid, coalesce(a.application_name IN ($2, $3), false) AND {}
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE {} AND l.pid <> pg_backend_pid() ORDER BY l.pid",
        may_publish("$4"),
        LockSpace::Former.lock_filter("$1")
    );
    let names = lock.names();
    let rows = client
        .query(&holders, &[&lock.key, &names[0], &names[1], &lock.tables])
        .await?;
    if rows.iter().any(|row| row.get::<_, bool>(1)) {
        return Ok(FormerKey::EarlierVersion);
    }
    Ok(FormerKey::Foreign(
        rows.iter().map(|row| row.get(0)).collect(),
    ))
}

/// The leadership lock of one slot, and what proves a session holding it is an outboxd instance's: its
/// `application_name` names it a leadership session of this slot, and its role may update the tables
/// ([`liveness::may_publish`]).
#[derive(Debug, Clone)]
struct LeadershipLock {
    /// The key text ([`key_text`]).
    key: String,
    slot: String,
    /// The tables, quoted (`"schema"."name"`).
    tables: Vec<String>,
}

impl LeadershipLock {
    fn of(settings: &RunSettings) -> Self {
        let tables = settings.database.tables.iter().map(|t| &t.name);
        LeadershipLock {
            key: key_text(tables.clone(), &settings.database.slot),
            slot: settings.database.slot.clone(),
            tables: tables.map(|t| t.quoted()).collect(),
        }
    }

    /// The `application_name`s of the leadership sessions of the slot, active and standby.
    fn names(&self) -> [String; 2] {
        leadership_names(&self.slot)
    }
}

/// The `application_name`s of the leadership sessions of `slot`, active and standby.
fn leadership_names(slot: &str) -> [String; 2] {
    [
        leadership_application_name(LeadershipRole::Active, slot),
        leadership_application_name(LeadershipRole::Standby, slot),
    ]
}

/// Pure: the sessions seen holding the former leadership key without naming themselves as outboxd's, and
/// since when, so that they count as an application's only after [`FORMER_KEY_PATIENCE`].
#[derive(Debug, Default)]
struct ForeignHolders {
    seen: Option<(Vec<i32>, Instant)>,
}

impl ForeignHolders {
    /// Whether `pids`, seen holding the key `now`, have held it for [`FORMER_KEY_PATIENCE`] (the same
    /// sessions all along).
    fn patience_over(&mut self, pids: &[i32], now: Instant) -> bool {
        match &self.seen {
            Some((seen, since)) if seen == pids => {
                now.saturating_duration_since(*since) >= FORMER_KEY_PATIENCE
            }
            _ => {
                self.seen = Some((pids.to_vec(), now));
                false
            }
        }
    }

    fn forget(&mut self) {
        self.seen = None;
    }
}

/// The locks that instances of earlier versions look for, which this leader could not take yet (an
/// application held them): it asks for them again with every health query.
#[derive(Debug, Default)]
struct FormerLocksMissing {
    /// The former leadership key: until this leader holds it, an instance of an earlier version that
    /// starts could take it and lead too.
    leadership: bool,
    /// Key texts of the former CDC markers (earlier versions' pollers defer only to these).
    markers: Vec<String>,
}

impl FormerLocksMissing {
    fn is_empty(&self) -> bool {
        !self.leadership && self.markers.is_empty()
    }

    /// Asks for each missing lock once. `Some(why)` when an instance of an earlier version took the former
    /// leadership key: it leads, so this instance must not.
    async fn take(
        &mut self,
        client: &tokio_postgres::Client,
        lock: &LeadershipLock,
    ) -> Result<Option<String>> {
        if self.leadership {
            match take_former_key(client, lock).await? {
                FormerKey::Taken => {
                    self.leadership = false;
                    tracing::info!("now also holding the leadership key of earlier versions (the application holding it let go)");
                }
                FormerKey::EarlierVersion => {
                    return Ok(Some(
                        "an outboxd instance of an earlier version took the leadership key earlier versions use, and leads".into(),
                    ))
                }
                FormerKey::Foreign(_) => {}
            }
        }
        let mut still_missing = Vec::new();
        for marker in std::mem::take(&mut self.markers) {
            if !super::fleet::take_former_marker(client, &marker).await? {
                still_missing.push(marker);
            }
        }
        self.markers = still_missing;
        Ok(None)
    }
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
    lock: LeadershipLock,
    mut missing: FormerLocksMissing,
    lost: watch::Sender<Option<Lost>>,
) {
    let mut ended = lost.subscribe();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(HEALTH_INTERVAL) => {}
            _ = ended.wait_for(Option::is_some) => return,
        }
        match within(holds_lock(&client, &lock.key)).await {
            Ok(true) => {}
            Ok(false) => return report(&lost, Lost::Pooler),
            Err(error) => {
                return report(
                    &lost,
                    Lost::Ended(format!("the health query failed: {error}")),
                )
            }
        }
        if missing.is_empty() {
            continue;
        }
        match within(missing.take(&client, &lock)).await {
            Ok(None) => {}
            Ok(Some(why)) => return report(&lost, Lost::Ended(why)),
            Err(error) => {
                return report(
                    &lost,
                    Lost::Ended(format!("the health query failed: {error}")),
                )
            }
        }
    }
}

/// A session holding the leadership lock in outboxd's keyspace that does not name itself as an outboxd
/// leadership session: any login can take an advisory lock (security review M4).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Impostor {
    pid: i32,
    user: String,
    application: String,
}

/// The sessions holding the leadership lock (outboxd's keyspace) that are not proven to be this slot's
/// leadership sessions ([`LeadershipLock`]): named otherwise, or named so by a role that may not update the
/// tables.
async fn impostors(
    client: &tokio_postgres::Client,
    lock: &LeadershipLock,
) -> Result<Vec<Impostor>> {
    let sql = format!(
        "SELECT l.pid, coalesce(a.usename::text, '?'), coalesce(a.application_name, '?')
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE {} AND l.pid <> pg_backend_pid()
           AND NOT (coalesce(a.application_name IN ($2, $3), false) AND {})
         ORDER BY l.pid",
        LockSpace::Outboxd.lock_filter("$1"),
        may_publish("$4")
    );
    let names = lock.names();
    let rows = client
        .query(&sql, &[&lock.key, &names[0], &names[1], &lock.tables])
        .await?;
    Ok(rows
        .iter()
        .map(|row| Impostor {
            pid: row.get(0),
            user: row.get(1),
            application: row.get(2),
        })
        .collect())
}

/// Says (at error, once per set of sessions) that sessions which are not outboxd instances have held the
/// leadership lock for [`FORMER_KEY_PATIENCE`] (an outboxd leader names its session as soon as it takes
/// the lock): no instance can lead while they do, and outboxd never ends them.
fn report_impostors(found: &[Impostor], watch: &mut ForeignHolders, reported: &mut Vec<i32>) {
    let pids: Vec<i32> = found.iter().map(|i| i.pid).collect();
    if pids.is_empty() {
        watch.forget();
        reported.clear();
    } else if watch.patience_over(&pids, Instant::now()) && *reported != pids {
        let sessions: Vec<String> = found
            .iter()
            .map(|i| {
                format!(
                    "pid {} (user {}, application_name {:?})",
                    i.pid, i.user, i.application
                )
            })
            .collect();
        tracing::error!(
            sessions = %sessions.join("; "),
            "sessions that are not outboxd instances (not named as this slot's leadership sessions, or named so by a role that may not update the outbox tables) hold outboxd's leadership lock: no instance can lead (nothing is published by the CDC path, and the slot keeps WAL) while they do; find who took it, and end them with SELECT pg_terminate_backend(<pid>) (outboxd never ends a session that is not its own)"
        );
        *reported = pids;
    }
}

/// What a standby's look at the leader's lock session found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fencing {
    /// A silent leader's session was ended: its lock goes as its backend exits.
    Ended,
    /// The leader's session is alive, or no leadership session holds the key.
    NothingToEnd,
    /// The leader's session state is hidden from this role (another role, no `pg_read_all_stats`).
    Blind,
}

/// Ends the session of a leader whose lock session has run no statement for [`SILENT_LEADER`] (a dead
/// node, a partition). Only a leadership session of this slot (`outboxd active|standby <slot>`, of a role
/// that may update the tables) holding the key, in outboxd's keyspace or the former one, is ever ended:
/// never an application's session that holds the same bigint key for a lock of its own, nor one that only
/// names itself as outboxd's. Needs the same role as that session (or `pg_signal_backend`
/// and `pg_read_all_stats`); without it, the server's keepalives end the session instead.
async fn end_silent_leader(
    client: &tokio_postgres::Client,
    lock: &LeadershipLock,
) -> Result<Fencing> {
    let sql = format!(
        "SELECT a.pid, a.state IS NULL,
                CASE WHEN a.state = 'idle' AND a.state_change < now() - make_interval(secs => $2)
                     THEN pg_terminate_backend(a.pid) ELSE false END,
                extract(epoch FROM now() - a.state_change)::float8
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE {} AND l.pid <> pg_backend_pid() AND a.application_name IN ($3, $4) AND {}",
        LockSpace::Either.lock_filter("$1"),
        may_publish("$5")
    );
    let names = lock.names();
    let rows = client
        .query(
            &sql,
            &[
                &lock.key,
                &SILENT_LEADER.as_secs_f64(),
                &names[0],
                &names[1],
                &lock.tables,
            ],
        )
        .await?;
    let mut fencing = Fencing::NothingToEnd;
    for row in &rows {
        let (pid, hidden, ended): (i32, bool, bool) = (row.get(0), row.get(1), row.get(2));
        if ended {
            let silent = row.get::<_, Option<f64>>(3).unwrap_or_default();
            tracing::warn!(
                pid,
                silent_secs = silent.round(),
                "the active instance's leadership session has run no statement for {silent:.0}s (a dead node or a network partition): ended it so that a standby can take over"
            );
            fencing = Fencing::Ended;
        } else if hidden && fencing == Fencing::NothingToEnd {
            fencing = Fencing::Blind;
        }
    }
    Ok(fencing)
}

/// Ends a walsender of `slot` that has had no reply from its client for [`SILENT_WALSENDER`]: only for an
/// instance that holds the leadership lock, so that a dead leader's walsender does not keep the slot busy
/// until `wal_sender_timeout`. A walsender whose client still replies is left alone.
pub async fn end_silent_walsender(client: &tokio_postgres::Client, slot: &str) -> Result<()> {
    let rows = client
        .query(
            "SELECT r.pid, pg_terminate_backend(r.pid)
             FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1 AND s.database = current_database()
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

/// Logs (once per process) that this instance may not end a silent leader's session, and why (`reason`: the
/// error of `pg_terminate_backend`, or that the leader's session state is hidden from this role).
fn cannot_fence(reason: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(reason, "cannot end a silent leader's session; a takeover after a partition then waits for the server's TCP keepalives (about 15 s) or longer behind a proxy; run every instance as the same role, or grant pg_signal_backend and pg_read_all_stats");
    }
}

/// `outboxd.leader.<tables>.<slot>`, the tables named `schema.table`, sorted and joined with `, `. Stable
/// across versions: for one table it is the key text every earlier version used (whose lock, in the former
/// keyspace, this version holds too: a rolling upgrade never has two leaders), and it does not depend on the
/// order of `--table`s (earlier versions used that order, so a fleet of several tables given in another
/// order than sorted gets a new key once: upgrade it all at once).
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
/// a silent previous leader left behind. Any other error means the connection is in trouble. Returns the
/// former locks it could not take (the leadership key's among them unless `former_key_held`).
async fn take_over(
    client: &tokio_postgres::Client,
    settings: &RunSettings,
    key: &str,
    former_key_held: bool,
) -> Result<FormerLocksMissing> {
    let slot = settings.database.slot.as_str();
    if !within(holds_lock(client, key)).await? {
        return Err(pooler_error());
    }
    let markers = within(super::fleet::mark_cdc_tables(client, settings)).await?;
    within(announce(client, LeadershipRole::Active, slot)).await?;
    if let Err(error) = within(end_silent_walsender(client, slot)).await {
        tracing::debug!(%error, "cannot check the slot for a silent walsender");
    }
    Ok(FormerLocksMissing {
        leadership: !former_key_held,
        markers,
    })
}

/// Waits until this instance holds the lock for `settings`' slot. `None` when `shutdown` came first.
pub async fn acquire(
    settings: &RunSettings,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<Option<Leadership>> {
    let lock = LeadershipLock::of(settings);
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
            lock.clone(),
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
    lock: LeadershipLock,
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
    let mut foreign = ForeignHolders::default();
    let (mut impostor_watch, mut reported) = (ForeignHolders::default(), Vec::new());
    loop {
        let round = within(ask_for_leadership(&client, &lock, &mut foreign));
        let round = match round.await {
            Ok(round) => round,
            Err(error) => return Ok(Contention::Trouble(error)),
        };
        match round {
            Round::Lead { former_key_held } => {
                let missing = match take_over(&client, settings, &lock.key, former_key_held).await {
                    Ok(missing) => missing,
                    Err(error @ Error::Setup { .. }) => return Err(error),
                    Err(error) => return Ok(Contention::Trouble(error)), // the lock goes with the session
                };
                if *standing_by {
                    tracing::info!("took over as the active instance for this slot");
                }
                let health =
                    tokio::spawn(watch_health(client, lock, missing, lost_tx)).abort_handle();
                return Ok(Contention::Leading(Leadership { lost, health }));
            }
            Round::Wait => {}
            Round::StandBy => {
                if !*standing_by {
                    if let Err(error) =
                        within(announce(&client, LeadershipRole::Standby, slot)).await
                    {
                        return Ok(Contention::Trouble(error));
                    }
                    tracing::info!(
                        mode = "standby",
                        "another outboxd instance is active for this slot; standing by"
                    );
                    READINESS.set_mode("standby");
                    *standing_by = true;
                }
                match within(end_silent_leader(&client, &lock)).await {
                    Ok(Fencing::Ended) => continue, // its lock goes as its backend exits: ask again at once
                    Ok(Fencing::NothingToEnd) => {}
                    Ok(Fencing::Blind) => cannot_fence(
                        "this role cannot see whether the active instance's leadership session is alive: pg_stat_activity shows a session's state only to its own role and to pg_read_all_stats",
                    ),
                    Err(Error::Postgres(error)) if error.code().is_some() => {
                        cannot_fence(&error.to_string())
                    }
                    Err(error) => return Ok(Contention::Trouble(error)),
                }
                match within(impostors(&client, &lock)).await {
                    Ok(found) => report_impostors(&found, &mut impostor_watch, &mut reported),
                    Err(error) => return Ok(Contention::Trouble(error)),
                }
            }
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

/// What one request for leadership came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Round {
    /// This session holds the lock: lead (holding the former key too, or not while an application holds it).
    Lead { former_key_held: bool },
    /// A session that does not name itself as outboxd's holds the former key: ask again before leading
    /// without it (it may be an earlier version's leader about to name its session).
    Wait,
    /// Another instance leads (of this version, or of an earlier one holding the former key).
    StandBy,
}

/// Asks for the lock once. Holding it, asks for the former key too; the lock goes back unless this
/// instance leads, so that it only ever marks a leader.
async fn ask_for_leadership(
    client: &tokio_postgres::Client,
    lock: &LeadershipLock,
    foreign: &mut ForeignHolders,
) -> Result<Round> {
    if !try_lock(client, &lock.key).await? {
        foreign.forget();
        return Ok(Round::StandBy);
    }
    let round = match take_former_key(client, lock).await? {
        FormerKey::Taken => {
            return Ok(Round::Lead {
                former_key_held: true,
            })
        }
        FormerKey::Foreign(pids) if foreign.patience_over(&pids, Instant::now()) => {
            tracing::warn!(
                ?pids,
                key = lock.key,
                "the leadership key earlier versions used (pg_advisory_lock(hashtext(key)), the bigint keyspace applications use too) is held by a session that does not name itself as outboxd's, an application's lock: leading without it, and taking it as soon as it is free (until then an instance of an earlier version started now could lead beside this one)"
            );
            return Ok(Round::Lead {
                former_key_held: false,
            });
        }
        FormerKey::Foreign(pids) => {
            tracing::debug!(
                ?pids,
                "the leadership key earlier versions used is held by a session that does not name itself as outboxd's; asking again before leading without it"
            );
            Round::Wait
        }
        FormerKey::EarlierVersion => {
            foreign.forget();
            Round::StandBy
        }
    };
    unlock(client, &lock.key).await?;
    Ok(round)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_names_fit_postgres_limit() {
        assert_eq!(
            leadership_application_name(LeadershipRole::Standby, "outboxd"),
            "outboxd standby outboxd"
        );
        let long = "s".repeat(63);
        assert_eq!(
            leadership_application_name(LeadershipRole::Active, &long).len(),
            63
        );
    }

    #[test]
    fn the_leadership_key_is_stable_across_versions_and_table_order() {
        let table = |schema: &str, name: &str| crate::table::TableName {
            schema: schema.into(),
            name: name.into(),
        };
        // The key text of every earlier version for one table. PostgreSQL 15: hashtext = 19094275, so the
        // lock is (1869968482, 19094275), and earlier versions' (and the former key this one holds too while
        // it leads) is the bigint 19094275 (the fleet tests check both on a server).
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
    fn a_foreign_holder_of_the_former_key_counts_as_an_application_only_after_the_patience() {
        let start = Instant::now();
        let mut foreign = ForeignHolders::default();
        assert!(!foreign.patience_over(&[7], start));
        assert!(!foreign.patience_over(&[7], start + FORMER_KEY_PATIENCE / 2));
        assert!(foreign.patience_over(&[7], start + FORMER_KEY_PATIENCE));
        // Other sessions: the patience starts over.
        assert!(!foreign.patience_over(&[8], start + FORMER_KEY_PATIENCE * 2));
        assert!(foreign.patience_over(&[8], start + FORMER_KEY_PATIENCE * 3));
        foreign.forget();
        assert!(!foreign.patience_over(&[8], start + FORMER_KEY_PATIENCE * 4));
        // An earlier version names its session within a few statements on its lock connection.
        assert!(FORMER_KEY_PATIENCE >= HEALTH_TIMEOUT);
    }

    #[test]
    fn leadership_sessions_are_known_by_their_names() {
        assert_eq!(
            leadership_names("outboxd"),
            ["outboxd active outboxd", "outboxd standby outboxd"]
        );
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
