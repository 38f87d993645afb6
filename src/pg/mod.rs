//! Everything that talks to PostgreSQL: ordinary SQL (`connect`, `outbox`, `slot`, `migrate`) on
//! tokio-postgres, and the replication protocol (`replication`, `pgoutput`) on postgres-protocol.

pub mod failover;
pub mod guarded_tls;
pub mod migrate;
pub mod outbox;
pub mod ownership;
pub mod password_command;
pub mod pgoutput;
pub mod replication;
pub mod require_auth;
pub mod slot;
pub mod tls;
pub mod url;
pub mod version;

pub use url::{Connection, PgUrl};

use crate::error::Result;

/// How long an ordinary SQL connection may take to finish TLS and authentication once a host answered: a
/// server, or a man in the middle, that accepts and then sends nothing, or announces a message it never sends,
/// cannot hold outboxd forever (tokio-postgres bounds only the TCP connect, by the URL's `connect_timeout`).
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Pure: the bound on opening a SQL connection to `hosts` hosts tried in turn, each TCP connect bounded by
/// `connect_timeout` (none: only the handshake bound applies).
fn connect_limit(
    connect_timeout: Option<std::time::Duration>,
    hosts: usize,
) -> std::time::Duration {
    let tries = u32::try_from(hosts.max(1)).unwrap_or(u32::MAX);
    connect_timeout.unwrap_or_default().saturating_mul(tries) + HANDSHAKE_TIMEOUT
}

impl PgUrl {
    /// Opens a SQL connection; the caller drives `Connection`.
    pub async fn connect_raw(&self) -> Result<(tokio_postgres::Client, Connection)> {
        let limit = connect_limit(
            self.config.get_connect_timeout().copied(),
            self.config.get_hosts().len(),
        );
        let config = self
            .fresh_config()
            .await
            .map_err(crate::error::Error::PasswordCommand)?;
        match tokio::time::timeout(limit, config.connect(self.connector())).await {
            Ok(connected) => {
                connected.map_err(|error| crate::error::connect_error(error, self.tls.mode))
            }
            Err(_) => Err(crate::error::Error::ConnectTimeout(limit)),
        }
    }
}

/// How every SQL connection of outboxd reads and writes times, whatever the server's or the database's
/// `TimeZone` and `DateStyle`: a `timestamp without time zone` column holds UTC wall-clock time, on every
/// path (as the replication connection decodes it), and times read as text are ISO.
const SESSION_TIME: &str = "SET datestyle = 'ISO'; SET TIME ZONE 'UTC'";

/// outboxd's own statements are bounded by outboxd (claims and lookups by their `LIMIT`s, figures by
/// [`connect_for_figures`]): a `statement_timeout` set for the role, the database or the server (as DBAs
/// set for application roles) would cancel a claim or a hand-off lookup over a large backlog at every try,
/// and each cancel ends a replication session or a poll round that then only begins again. One set in
/// outboxd's own URL (`options=-c statement_timeout=...`, source `client`) was asked for, and is kept.
const NO_STATEMENT_TIMEOUT: &str = "SELECT set_config('statement_timeout', '0', false)
     FROM pg_catalog.pg_settings WHERE name = 'statement_timeout' AND source <> 'client'";

/// Opens an ordinary SQL connection and drives it on a background task. Its commits are durable when
/// they return (see [`DURABLE_COMMITS`]); its times are UTC (see [`SESSION_TIME`]); its statements are not
/// cut short by a role's `statement_timeout` unless its URL asks for one (see [`NO_STATEMENT_TIMEOUT`]).
pub async fn connect(url: &PgUrl) -> Result<tokio_postgres::Client> {
    let (client, connection) = url.connect_raw().await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "SQL connection closed");
        }
    });
    client
        .batch_execute(&format!(
            "{DURABLE_COMMITS}; {SESSION_TIME}; {NO_STATEMENT_TIMEOUT}"
        ))
        .await?;
    Ok(client)
}

/// Makes the session's commits wait for the local WAL flush where the server does not
/// (`synchronous_commit = off`). outboxd confirms positions and commits Kafka transactions on the strength
/// of its writes (`handoff_at`, `published_at`, the slot's hand-off): one lost in a crash after that would
/// be a row nobody publishes. A stronger setting (`remote_write`, `on`, `remote_apply`) is kept. Always set
/// for the session, even to the value it has: a value from the server's configuration would follow a
/// reload (`ALTER SYSTEM SET synchronous_commit = off` while outboxd runs), a session's own does not.
const DURABLE_COMMITS: &str = "SELECT set_config('synchronous_commit',
     CASE current_setting('synchronous_commit') WHEN 'off' THEN 'local' ELSE current_setting('synchronous_commit') END,
     false)";

/// The server's current WAL insert position (`pg_current_wal_insert_lsn()`): past the end of every
/// transaction committed (visible) by then, in this session or another, even one committed with
/// `synchronous_commit = off` whose commit record was not written yet. A primary's only.
pub async fn current_wal_position(client: &tokio_postgres::Client) -> Result<crate::lsn::Lsn> {
    let position: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get(0);
    position.parse().map_err(|_| {
        crate::error::Error::bug(format!(
            "PostgreSQL answered an unexpected WAL position {position:?}"
        ))
    })
}

/// How far every standby that could keep a copy of a logical slot has flushed WAL, as the primary knows
/// it: the lowest of the `restart_lsn` of its physical slots (a standby's flush position, as it reports it
/// through `primary_slot_name`; outboxd's own marks are not standbys) and the `flush_lsn` of walsenders
/// streaming without a slot. [`Lsn::ZERO`] while any of them is unknown (a slot not reserved yet or lost, a
/// base backup under way, a walsender this role may not see the figures of); `None` without any (no
/// standby is known). A standby the primary does not know of is not counted: one that keeps a copy must
/// stream through its own physical slot, created before its base backup (README: *Failover slots*).
///
/// [`Lsn::ZERO`]: crate::lsn::Lsn::ZERO
pub async fn standbys_flushed(client: &tokio_postgres::Client) -> Result<Option<crate::lsn::Lsn>> {
    let row = client
        .query_one(
            &format!(
                "WITH standby (flushed) AS (
                     SELECT restart_lsn FROM pg_replication_slots WHERE {}
                     UNION ALL
                     SELECT r.flush_lsn FROM pg_stat_replication r
                      WHERE NOT EXISTS (SELECT FROM pg_replication_slots s WHERE s.active_pid = r.pid))
                 SELECT count(*), coalesce(bool_or(flushed IS NULL), false), min(flushed)::text FROM standby",
                slot::STANDBY_PHYSICAL_SLOT
            ),
            &[],
        )
        .await?;
    let (standbys, unknown, lowest): (i64, bool, Option<String>) =
        (row.get(0), row.get(1), row.get(2));
    if standbys == 0 {
        return Ok(None);
    }
    if unknown {
        return Ok(Some(crate::lsn::Lsn::ZERO));
    }
    let lowest = lowest.unwrap_or_default();
    lowest.parse().map(Some).map_err(|_| {
        crate::error::Error::bug(format!(
            "PostgreSQL answered an unexpected WAL position {lowest:?}"
        ))
    })
}

/// A connection for periodic figures and `outboxd status`: each statement is bounded by `statement_timeout`.
pub async fn connect_for_figures(
    url: &PgUrl,
    statement_timeout: std::time::Duration,
) -> Result<tokio_postgres::Client> {
    let client = connect(url).await?;
    client
        .batch_execute(&format!(
            "SET statement_timeout = {}",
            statement_timeout.as_millis()
        ))
        .await?;
    Ok(client)
}

/// True while the server is a standby in recovery (logical decoding and writes need a primary).
pub async fn in_recovery(client: &tokio_postgres::Client) -> Result<bool> {
    Ok(client
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await?
        .get(0))
}

/// The server's version (`server_version_num`).
pub async fn server_version(client: &tokio_postgres::Client) -> Result<version::ServerVersion> {
    let number: String = client
        .query_one("SELECT current_setting('server_version_num')", &[])
        .await?
        .get(0);
    number.parse().map(version::ServerVersion).map_err(|_| {
        crate::error::Error::setup(
            format!("PostgreSQL reported server_version_num {number:?}, which is no number"),
            "connect outboxd to a PostgreSQL server (14 or newer)",
        )
    })
}

/// When the server's postmaster started, as epoch seconds (the same text whatever the session's time zone):
/// two connections that read the same value reached the same server, which a system identifier cannot
/// tell apart from a promoted standby of it.
pub const SERVER_STARTED_AT: &str = "SELECT extract(epoch FROM pg_postmaster_start_time())::text";

/// [`SERVER_STARTED_AT`] over a SQL connection.
pub async fn server_started_at(client: &tokio_postgres::Client) -> Result<String> {
    Ok(client.query_one(SERVER_STARTED_AT, &[]).await?.get(0))
}

/// Whether `relation` (a quoted, qualified name) exists and this role may read it.
pub async fn may_read(client: &tokio_postgres::Client, relation: &str) -> Result<bool> {
    Ok(client
        .query_one(
            "SELECT CASE WHEN to_regclass($1) IS NULL THEN false
                         ELSE has_table_privilege(to_regclass($1), 'SELECT') END",
            &[&relation],
        )
        .await?
        .get(0))
}

/// The server's system identifier, or `None` where the role may not read it (`pg_control_system()` needs
/// superuser or pg_monitor-like rights on some services).
pub async fn system_identifier(client: &tokio_postgres::Client) -> Result<Option<String>> {
    match client
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await
    {
        Ok(row) => Ok(Some(row.get(0))),
        Err(error)
            if error.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) =>
        {
            Ok(None)
        }
        Err(error) => Err(error.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn every_host_gets_its_connect_timeout_and_the_handshake_its_own() {
        assert_eq!(connect_limit(None, 1), HANDSHAKE_TIMEOUT);
        assert_eq!(
            connect_limit(Some(Duration::from_secs(15)), 2),
            Duration::from_secs(30) + HANDSHAKE_TIMEOUT,
            "a second host is still tried after the first one's connect timed out"
        );
        assert_eq!(
            connect_limit(Some(Duration::from_secs(5)), 0),
            Duration::from_secs(5) + HANDSHAKE_TIMEOUT
        );
    }
}
