//! Everything that talks to PostgreSQL: ordinary SQL (`connect`, `outbox`, `slot`, `migrate`) on
//! tokio-postgres, and the replication protocol (`replication`, `pgoutput`) on postgres-protocol.

pub mod migrate;
pub mod outbox;
pub mod pgoutput;
pub mod replication;
pub mod slot;
pub mod tls;
pub mod url;

pub use url::{Connection, PgUrl};

use crate::error::{Error, Result};

impl PgUrl {
    /// Opens a SQL connection; the caller drives `Connection`.
    pub async fn connect_raw(&self) -> Result<(tokio_postgres::Client, Connection)> {
        self.config
            .connect(self.connector())
            .await
            .map_err(|error| classify_connect_error(error, self.tls.mode))
    }
}

/// Opens an ordinary SQL connection and drives it on a background task.
pub async fn connect(url: &PgUrl) -> Result<tokio_postgres::Client> {
    let (client, connection) = url.connect_raw().await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "SQL connection closed");
        }
    });
    Ok(client)
}

/// A connection for periodic figures and `outboxd status`: each statement is bounded by `statement_timeout`,
/// and `timestamp without time zone` columns are read as UTC (as the polling and replication sessions read
/// them), not in the server's time zone.
pub async fn connect_for_figures(
    url: &PgUrl,
    statement_timeout: std::time::Duration,
) -> Result<tokio_postgres::Client> {
    let client = connect(url).await?;
    client
        .batch_execute(&format!(
            "SET statement_timeout = {}; SET TIME ZONE 'UTC'",
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

/// Turns connection failures that retrying cannot fix into setup errors naming the fix.
pub fn classify_connect_error(error: tokio_postgres::Error, ssl_mode: tls::SslMode) -> Error {
    let Some(code) = error.code().map(|c| c.code().to_string()) else {
        return match tls_problem(&error_chain(&error), ssl_mode) {
            Some(setup) => setup,
            None => Error::Postgres(error),
        };
    };
    let message = error
        .as_db_error()
        .map(|e| e.message().to_string())
        .unwrap_or_else(|| error.to_string());
    match code.as_str() {
        "28P01" => Error::setup(
            format!("PostgreSQL rejected the password ({message})"),
            "check the user and password in --database-url / --replication-url",
        ),
        "28000" => Error::setup(
            format!("PostgreSQL refused the connection ({message})"),
            "allow this user/host in pg_hba.conf (a replication connection matches the database column)",
        ),
        "3D000" => Error::database_missing(&message),
        _ => Error::Postgres(error),
    }
}

/// An error and all its sources on one line.
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
pub fn tls_problem(message: &str, ssl_mode: tls::SslMode) -> Option<Error> {
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
            "connect with the host name the certificate was issued for, or use sslmode=verify-ca to check the chain only"
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
