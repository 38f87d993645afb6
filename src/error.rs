//! The library's error type and the one decision every caller needs from it: retry, or stop and tell the
//! user what to fix.

use crate::config::ConfigError;
use crate::event::MappingError;
use crate::pg::pgoutput::DecodeError;
use crate::pg::replication::ReplicationError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A problem with the database or broker set-up that retrying cannot fix.
    #[error("{problem}; fix: {fix}")]
    Setup { problem: String, fix: String },
    /// The server does not let us use logical replication (wal_level, permission, pg_hba): `auto` polls.
    #[error("{problem}; fix: {fix}")]
    ReplicationUnavailable { problem: String, fix: String },
    /// The database is there but not ready for outboxd: missing, or a standby still in recovery. Definite at
    /// first start (a wrong URL); after a failover, restore or switchover a running outboxd waits for it
    /// (`--reconnect-timeout`), saying what it waits for.
    #[error("{problem}; fix: {fix}")]
    NotReady {
        problem: String,
        fix: String,
        waiting_for: String,
    },
    #[error("PostgreSQL: {}", postgres_error_text(.0))]
    Postgres(#[from] tokio_postgres::Error),
    #[error("PostgreSQL replication: {0}")]
    Replication(#[from] ReplicationError),
    /// The replication session must start over (its state would be unsafe to change in place).
    #[error("restarting the replication session: {0}")]
    SessionRestart(String),
    #[error("Kafka: {message}")]
    Kafka { message: String, transient: bool },
    #[error(transparent)]
    Mapping(#[from] MappingError),
    #[error("cannot decode the replication stream: {0}")]
    Decode(#[from] DecodeError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// SQLSTATEs that mean "try again later": connection failures, server shutting down or starting up,
/// too many connections, a replication slot still held by a dying walsender.
fn is_transient_sqlstate(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("57P")
        // Too many connections, object in use, serialization failure, deadlock; a statement cancelled
        // (statement_timeout, pg_cancel_backend) and a lock wait given up (lock_timeout): the database is
        // busy, not wrong.
        || matches!(code, "53300" | "55006" | "40001" | "40P01" | "57014" | "55P03")
}

/// Connection failures and a server shutting down, restarting or starting up.
fn is_unreachable_sqlstate(code: &str) -> bool {
    code.starts_with("08") || code.starts_with("57P")
}

const ACCEPTING_CONNECTIONS: &str = "PostgreSQL to accept connections";
const PROMOTION: &str = "the standby to be promoted";

impl Error {
    pub fn setup(problem: impl Into<String>, fix: impl Into<String>) -> Self {
        Error::Setup {
            problem: problem.into(),
            fix: fix.into(),
        }
    }

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

    /// The server is a standby still in recovery: logical decoding needs a primary.
    pub fn in_recovery() -> Self {
        Error::NotReady {
            problem: "the server is a standby in recovery, and logical decoding needs a primary".into(),
            fix: "promote the standby (pg_ctl promote, or SELECT pg_promote()), or point --database-url at the primary".into(),
            waiting_for: PROMOTION.into(),
        }
    }

    /// What a running pipeline waits for when the database went away or is not ready yet (a failover, a
    /// restore, a switchover): `None` for errors that are not about the database being reachable and ready.
    pub fn awaited_database(&self) -> Option<&str> {
        match self {
            Error::NotReady { waiting_for, .. } => Some(waiting_for),
            // A write on a standby (the address reached one before its promotion).
            Error::Postgres(e) if e.code().map(|c| c.code()) == Some("25006") => Some(PROMOTION),
            Error::Postgres(e) => match e.code() {
                None => self.is_transient(),
                Some(code) => is_unreachable_sqlstate(code.code()),
            }
            .then_some(ACCEPTING_CONNECTIONS),
            Error::Replication(
                ReplicationError::Io(_)
                | ReplicationError::Closed
                | ReplicationError::Connect { .. },
            ) => Some(ACCEPTING_CONNECTIONS),
            Error::Replication(ReplicationError::Server { code, .. }) => {
                is_unreachable_sqlstate(code).then_some(ACCEPTING_CONNECTIONS)
            }
            _ => None,
        }
    }

    /// True when waiting and retrying can succeed; false when a person must change something first.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Config(_)
            | Error::Setup { .. }
            | Error::ReplicationUnavailable { .. }
            | Error::NotReady { .. }
            | Error::Mapping(_)
            | Error::Decode(_) => false,
            Error::Postgres(e) => match e.code() {
                Some(code) => is_transient_sqlstate(code.code()),
                // No SQLSTATE: the connection itself failed or closed.
                None => !is_config_like(&e.to_string()),
            },
            Error::Replication(e) => match e {
                ReplicationError::Server { code, .. } => is_transient_sqlstate(code),
                ReplicationError::Io(_)
                | ReplicationError::Closed
                | ReplicationError::Connect { .. }
                | ReplicationError::Tls { .. } => true,
                ReplicationError::Protocol(_)
                | ReplicationError::Unsupported(_)
                | ReplicationError::PasswordRequired
                | ReplicationError::ChannelBindingRequired(_) => false,
            },
            Error::Kafka { transient, .. } => *transient,
            Error::SessionRestart(_) => true,
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

fn is_config_like(message: &str) -> bool {
    message.contains("invalid configuration") || message.contains("password missing")
}
