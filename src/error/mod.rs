//! The library's error type and the one decision every caller needs from it: retry, or stop and tell the
//! user what to fix. `classify` makes that decision, in one place: it turns PostgreSQL's and the
//! replication protocol's failures into the variants below, by SQLSTATE (tokio-postgres' `SqlState`).

mod classify;

pub use classify::{connect_error, replication_error, tls_problem};

use crate::config::ConfigError;
use crate::event::MappingError;
use crate::pg::pgoutput::DecodeError;
use crate::pg::replication::ReplicationError;

/// Every failure of the library; `is_transient` and `awaited_database` say whether to retry or wait.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An invalid option.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A problem with the database or broker set-up that retrying cannot fix.
    #[error("{problem}; fix: {fix}")]
    Setup {
        /// What is wrong with the set-up.
        problem: String,
        /// What to change so that it works.
        fix: String,
    },
    /// The server does not let us use logical replication (wal_level, permission, pg_hba): `auto` polls.
    #[error("{problem}; fix: {fix}")]
    ReplicationUnavailable {
        /// Why logical replication cannot be used.
        problem: String,
        /// What to change to allow it (outboxd polls meanwhile under `--mode auto`).
        fix: String,
    },
    /// The database is there but not ready for outboxd: missing, or a standby still in recovery. Definite at
    /// first start (a wrong URL); after a failover, restore or switchover a running outboxd waits for it
    /// (`--reconnect-timeout`), saying what it waits for.
    #[error("{problem}; fix: {fix}")]
    NotReady {
        /// What is not ready (the database missing, a standby in recovery).
        problem: String,
        /// What to change, should it not resolve itself.
        fix: String,
        /// What a running pipeline waits for, for its log lines (e.g. "the standby to be promoted").
        waiting_for: String,
    },
    /// An error of an ordinary SQL connection (tokio-postgres).
    #[error("PostgreSQL: {}", postgres_error_text(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// Opening an ordinary SQL connection (TCP, TLS, authentication) took longer than its bound (the URL's
    /// `connect_timeout` per host plus `pg::HANDSHAKE_TIMEOUT`): a server, or something in between, that
    /// accepts and then says nothing.
    #[error("PostgreSQL: no connection within {0:?}: the server (or something in between) accepted the connection but did not finish the handshake")]
    ConnectTimeout(std::time::Duration),
    /// `--database-password-command` gave no password (the message names the program and why, never its
    /// output): retried like an unreachable server, since token services fail for a moment too.
    #[error("{0}")]
    PasswordCommand(String),
    /// An error of the replication connection.
    #[error("PostgreSQL replication: {0}")]
    Replication(#[from] ReplicationError),
    /// The replication session must start over (its state would be unsafe to change in place).
    #[error("restarting the replication session: {0}")]
    SessionRestart(String),
    /// An outbox table gained columns that change what outboxd does with it (the polling columns, or
    /// `published_at`): the pipeline starts over from its start-up checks, in this process.
    #[error("{0}")]
    TablesChanged(String),
    /// Reaching the brokers, creating or checking topics, or delivering to Kafka failed.
    #[error("Kafka: {message}")]
    Kafka {
        /// What librdkafka or the broker reported, or what stopped the delivery.
        message: String,
        /// True when retrying can succeed; false when a person must fix something first.
        transient: bool,
    },
    /// An outbox relation or row that cannot be mapped to an event.
    #[error(transparent)]
    Mapping(#[from] MappingError),
    /// A pgoutput message that cannot be decoded.
    #[error("cannot decode the replication stream: {0}")]
    Decode(#[from] DecodeError),
    /// An internal invariant broke (or a server answered against its protocol): nothing the user can fix.
    #[error("internal error: {0} (please report this as an outboxd bug, with the server versions and the log)")]
    Bug(String),
}

/// The library's result type ([`Error`] unless given).
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a running pipeline waits for (`waiting_for` of [`Error::NotReady`], see [`Error::awaited_database`]).
const ACCEPTING_CONNECTIONS: &str = "PostgreSQL to accept connections";
const PROMOTION: &str = "the standby to be promoted";

impl Error {
    /// An [`Error::Bug`]: a broken internal invariant.
    pub fn bug(what: impl Into<String>) -> Self {
        Error::Bug(what.into())
    }

    /// An [`Error::Setup`]: a set-up problem and its fix.
    pub fn setup(problem: impl Into<String>, fix: impl Into<String>) -> Self {
        Error::Setup {
            problem: problem.into(),
            fix: fix.into(),
        }
    }

    /// An [`Error::ReplicationUnavailable`]: why logical replication cannot be used, and the fix.
    pub fn replication_unavailable(problem: impl Into<String>, fix: impl Into<String>) -> Self {
        Error::ReplicationUnavailable {
            problem: problem.into(),
            fix: fix.into(),
        }
    }

    /// The database does not exist (SQLSTATE 3D000).
    pub fn database_missing(message: &str) -> Self {
        Error::NotReady {
            problem: format!("the database does not exist ({message})"),
            fix: "create it or fix the database name in --database-url / --replication-url".into(),
            waiting_for: "the database to exist".into(),
        }
    }

    /// `--replication-url` reaches a standby in recovery while `--database-url` reaches the primary
    /// (decoding on a standby): refused, see README "Decoding on a standby". At start-up a definite error;
    /// in a running pipeline (a switchover moving one URL before the other) something to wait for.
    pub fn replication_on_standby(running: bool) -> Self {
        let problem = "--replication-url reaches a standby in recovery while --database-url reaches the primary (decoding on a standby): outboxd does not stream from a standby, because a new slot's hand-off imports the slot's exported snapshot on the server it writes to (a standby's snapshot cannot be imported on the primary), and the slot's position, lag and invalidation are read on the primary".to_string();
        let fix = "point --replication-url at the primary (or leave it out); README 'Decoding on a standby' says why and what keeps decoding load low".to_string();
        if running {
            Error::NotReady {
                problem,
                fix,
                waiting_for: "the replication connection to reach the primary".into(),
            }
        } else {
            Error::Setup { problem, fix }
        }
    }

    /// The server is a standby still in recovery: logical decoding needs a primary.
    pub fn in_recovery() -> Self {
        Error::NotReady {
            problem: "the server is a standby in recovery, and logical decoding needs a primary".into(),
            fix: "promote the standby (pg_ctl promote, or SELECT pg_promote()), or point --database-url at the primary".into(),
            waiting_for: PROMOTION.into(),
        }
    }
}

/// tokio-postgres displays server errors as just "db error"; show the server's message and SQLSTATE.
pub fn postgres_error_text(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{} {}: {}", db.severity(), db.code().code(), db.message()),
        None => match std::error::Error::source(error) {
            Some(source) => format!("{error}: {source}"),
            None => error.to_string(),
        },
    }
}
