//! The one place that decides what a failure means: retry (transient), wait for the database (not ready),
//! fall back to polling (replication unavailable), or stop with a setup error that names the fix. Server
//! failures are judged by SQLSTATE, compared with tokio-postgres' [`SqlState`] constants (by class where a
//! whole class means the same); failures without one (a connection or TLS handshake that failed) by their
//! kind, and by text only where the driver gives nothing else.

use tokio_postgres::error::SqlState;

use super::{Error, ACCEPTING_CONNECTIONS, PROMOTION};
use crate::pg::replication::auth::AuthError;
use crate::pg::replication::ReplicationError;
use crate::pg::require_auth::Refused;
use crate::pg::tls::SslMode;

/// SQLSTATE classes 08 (connection exception) and 57P (operator intervention: shutdown, crash, starting
/// up): the server cannot be reached or is going away.
fn is_unreachable(code: &SqlState) -> bool {
    code.code().starts_with("08") || code.code().starts_with("57P")
}

/// "Try again later": the server is unreachable, or busy rather than wrong: too many connections, an
/// object in use (a replication slot still held by a dying walsender), a serialization failure or
/// deadlock, a statement cancelled (statement_timeout, pg_cancel_backend) or a lock wait given up
/// (lock_timeout).
fn is_transient_sqlstate(code: &SqlState) -> bool {
    is_unreachable(code)
        || [
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::OBJECT_IN_USE,
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::QUERY_CANCELED,
            SqlState::LOCK_NOT_AVAILABLE,
        ]
        .contains(code)
}

impl Error {
    /// True when waiting and retrying can succeed; false when a person must change something first.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Config(_)
            | Error::Setup { .. }
            | Error::ReplicationUnavailable { .. }
            | Error::NotReady { .. }
            | Error::Mapping(_)
            | Error::Decode(_)
            | Error::Bug(_) => false,
            Error::Postgres(e) => match e.code() {
                Some(code) => is_transient_sqlstate(code),
                // No SQLSTATE: the connection itself failed or closed, unless the driver refused its
                // configuration (it says so only in text).
                None => !is_driver_configuration(e),
            },
            Error::Replication(e) => match e {
                ReplicationError::Server { .. } => {
                    e.sqlstate().is_some_and(|c| is_transient_sqlstate(&c))
                }
                ReplicationError::Io(_)
                | ReplicationError::Closed
                | ReplicationError::Connect { .. }
                | ReplicationError::PasswordCommand(_)
                | ReplicationError::Tls { .. } => true,
                ReplicationError::Protocol(_)
                | ReplicationError::Unsupported(_)
                | ReplicationError::Auth(_) => false,
            },
            Error::Kafka { transient, .. } => *transient,
            Error::SessionRestart(_) => true,
            // Not retried by a session: the whole pipeline starts over (see `pipeline::run_with`).
            Error::TablesChanged(_) => false,
            Error::ConnectTimeout(_) | Error::PasswordCommand(_) => true,
        }
    }

    /// The replication slot is held by another walsender (a live client, or one still dying).
    pub fn is_slot_in_use(&self) -> bool {
        matches!(self, Error::Replication(e) if e.sqlstate() == Some(SqlState::OBJECT_IN_USE))
    }

    /// What a running pipeline waits for when the database went away or is not ready yet (a failover, a
    /// restore, a switchover): `None` for errors that are not about the database being reachable and ready.
    pub fn awaited_database(&self) -> Option<&str> {
        match self {
            Error::NotReady { waiting_for, .. } => Some(waiting_for),
            Error::Postgres(e) => match e.code() {
                // A write on a standby (the address reached one before its promotion).
                Some(code) if *code == SqlState::READ_ONLY_SQL_TRANSACTION => Some(PROMOTION),
                Some(code) => is_unreachable(code).then_some(ACCEPTING_CONNECTIONS),
                None => self.is_transient().then_some(ACCEPTING_CONNECTIONS),
            },
            Error::Replication(
                ReplicationError::Io(_)
                | ReplicationError::Closed
                | ReplicationError::Connect { .. },
            ) => Some(ACCEPTING_CONNECTIONS),
            Error::Replication(e @ ReplicationError::Server { .. }) => e
                .sqlstate()
                .is_some_and(|c| is_unreachable(&c))
                .then_some(ACCEPTING_CONNECTIONS),
            _ => None,
        }
    }
}

fn is_driver_configuration(error: &tokio_postgres::Error) -> bool {
    let message = error.to_string();
    message.contains("invalid configuration") || message.contains("password missing")
}

/// Turns connection failures that retrying cannot fix into setup errors naming the fix.
pub fn connect_error(error: tokio_postgres::Error, ssl_mode: SslMode) -> Error {
    if let Some(refused) = refused_method(&error) {
        return Error::setup(refused.to_string(), Refused::FIX);
    }
    let Some(code) = error.code().cloned() else {
        return match tls_problem(&error_chain(&error), ssl_mode) {
            Some(setup) => setup,
            None => Error::Postgres(error),
        };
    };
    let message = error
        .as_db_error()
        .map(|e| e.message().to_string())
        .unwrap_or_else(|| error.to_string());
    if code == SqlState::INVALID_PASSWORD {
        Error::setup(
            format!("PostgreSQL rejected the password ({message})"),
            "check the user and password in --database-url / --replication-url",
        )
    } else if code == SqlState::INVALID_AUTHORIZATION_SPECIFICATION {
        Error::setup(
            format!("PostgreSQL refused the connection ({message})"),
            "allow this user/host in pg_hba.conf (a replication connection matches the database column)",
        )
    } else if code == SqlState::INVALID_CATALOG_NAME {
        Error::database_missing(&message)
    } else {
        Error::Postgres(error)
    }
}

/// Maps replication-connection failures a person must fix to setup errors that say how (or, for what
/// stops logical replication itself, to `ReplicationUnavailable`, on which `auto` polls).
pub fn replication_error(error: ReplicationError) -> Error {
    let message = error.to_string();
    if let ReplicationError::Tls { mode, .. } = &error {
        return tls_problem(&message, *mode).unwrap_or(Error::Replication(error));
    }
    if let ReplicationError::Auth(AuthError::ChannelBindingRequired(_)) = &error {
        return Error::setup(
            message,
            "where the server is set up for SCRAM over TLS this may be a man in the middle: have outboxd check the server's certificate (sslmode=verify-full with sslrootcert); otherwise authenticate replication connections with scram-sha-256 over TLS (a `hostssl ... scram-sha-256` line in pg_hba.conf, sslmode=require or stricter, a password stored as SCRAM), or drop channel_binding=require from the URL",
        );
    }
    if let ReplicationError::Auth(AuthError::MethodRefused(_)) = &error {
        return Error::setup(message, Refused::FIX);
    }
    if let ReplicationError::Auth(AuthError::Scram(_)) = &error {
        return Error::setup(
            message,
            "make sure --replication-url reaches the PostgreSQL server itself, and have outboxd check the server's certificate (sslmode=verify-full with sslrootcert): a proxy that does not speak SCRAM, or a man in the middle, ends SCRAM this way",
        );
    }
    let Some(code) = error.sqlstate() else {
        return Error::Replication(error);
    };
    // PG 15 says "logical decoding cannot be used while in recovery" with 0A000 (55000 on some paths), and
    // "logical decoding requires wal_level >= logical" with 55000: the message tells them apart.
    let prerequisite = code == SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE;
    if code == SqlState::INSUFFICIENT_PRIVILEGE {
        Error::replication_unavailable(
            format!("the user may not open a replication connection ({message})"),
            "ALTER ROLE <user> WITH REPLICATION (managed services: GRANT rds_replication TO <user> or the provider's equivalent)",
        )
    } else if code == SqlState::INVALID_AUTHORIZATION_SPECIFICATION {
        Error::replication_unavailable(
            format!("PostgreSQL refused the replication connection ({message})"),
            "add a pg_hba.conf line for this user and database (a logical replication connection matches the database column)",
        )
    } else if code == SqlState::INVALID_PASSWORD {
        Error::setup(
            format!("PostgreSQL rejected the password of the replication connection ({message})"),
            "check the password in --replication-url / --database-url",
        )
    } else if code == SqlState::INVALID_CATALOG_NAME {
        Error::database_missing(&message)
    } else if (prerequisite || code == SqlState::FEATURE_NOT_SUPPORTED)
        && message.contains("recovery")
    {
        Error::in_recovery()
    } else if prerequisite && message.contains("wal_level") {
        Error::replication_unavailable(
            format!("logical decoding is not enabled ({message})"),
            "set wal_level = logical and restart PostgreSQL",
        )
    } else if code == SqlState::UNDEFINED_OBJECT {
        Error::setup(
            format!("a replication object is missing ({message})"),
            "run `outboxd migrate` to create the publication, or check --publication and --slot",
        )
    } else {
        Error::Replication(error)
    }
}

/// An error and all its sources on one line.
/// The `require_auth` refusal behind a failed SQL connection (see `pg::guarded_tls`), if that is what it is.
fn refused_method(error: &tokio_postgres::Error) -> Option<&Refused> {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(refused) = cause
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<Refused>())
        {
            return Some(refused);
        }
        source = cause.source();
    }
    None
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// TLS failures retrying cannot fix: the server has no TLS, or its certificate does not pass the checks
/// `sslmode` asks for. `None` for anything else.
pub fn tls_problem(message: &str, ssl_mode: SslMode) -> Option<Error> {
    let mode = ssl_mode.as_str();
    if message.contains("server does not support TLS") {
        return Some(Error::setup(
            format!("the PostgreSQL server does not accept TLS connections, but sslmode={mode} requires TLS"),
            "turn on ssl in postgresql.conf (ssl = on, ssl_cert_file, ssl_key_file), or use sslmode=prefer / sslmode=disable on a trusted network",
        ));
    }
    if message.contains("certificate verify failed") {
        // OpenSSL's text repeats its error stack; the verification result follows the first "::".
        let reason = message
            .split(":: ")
            .nth(1)
            .and_then(|rest| rest.split([':', ')']).next())
            .unwrap_or("certificate verify failed");
        let fix = if message.contains("hostname mismatch")
            || message.contains("IP address mismatch")
        {
            "connect with a host name the certificate names (its subjectAltName or CN; an IP address must be an IP subjectAltName), or have the server's certificate reissued for the name outboxd connects with"
        } else {
            "point sslrootcert= in the URL at the CA certificate that signed the server's certificate"
        };
        return Some(Error::setup(
            format!("the PostgreSQL server's TLS certificate failed verification under sslmode={mode}: {reason}"),
            fix,
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(code: &str, message: &str) -> ReplicationError {
        ReplicationError::Server {
            severity: "ERROR".into(),
            code: code.into(),
            message: message.into(),
            detail: None,
        }
    }

    #[test]
    fn recovery_errors_of_the_replication_connection_are_waited_for() {
        let error = replication_error(server(
            "0A000",
            "logical decoding cannot be used while in recovery",
        ));
        assert_eq!(error.awaited_database(), Some("the standby to be promoted"));
        assert!(
            !error.is_transient(),
            "waited for, with --reconnect-timeout"
        );
    }

    #[test]
    fn what_stops_logical_replication_is_unavailable_and_auto_polls() {
        for (code, message) in [
            ("42501", "must be superuser or replication role"),
            ("28000", "no pg_hba.conf entry for replication connection"),
            ("55000", "logical decoding requires wal_level >= logical"),
        ] {
            let error = replication_error(server(code, message));
            assert!(
                matches!(error, Error::ReplicationUnavailable { .. }),
                "{code}: {error}"
            );
        }
    }

    #[test]
    fn a_busy_server_is_retried_and_a_missing_object_names_the_fix() {
        let busy = replication_error(server("55006", "replication slot is active for PID 42"));
        assert!(busy.is_transient() && busy.is_slot_in_use());
        assert_eq!(busy.awaited_database(), None, "the server is up");
        let going_away = replication_error(server("57P01", "terminating connection"));
        assert!(going_away.is_transient());
        assert_eq!(
            going_away.awaited_database(),
            Some("PostgreSQL to accept connections")
        );
        let missing = replication_error(server("42704", "publication \"outboxd\" does not exist"));
        assert!(!missing.is_transient());
        assert!(missing.to_string().contains("outboxd migrate"), "{missing}");
        let password = replication_error(server("28P01", "password authentication failed"));
        assert!(matches!(password, Error::Setup { .. }), "{password}");
    }

    #[test]
    fn a_broken_invariant_is_no_setup_error_and_never_retried() {
        let bug = Error::bug("a row outside a transaction");
        assert!(!bug.is_transient());
        assert!(
            bug.to_string().contains("report this as an outboxd bug"),
            "{bug}"
        );
    }
}
