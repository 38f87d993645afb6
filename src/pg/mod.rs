//! Everything that talks to PostgreSQL: ordinary SQL (`connect`, `outbox`, `slot`, `migrate`) on
//! tokio-postgres, and the replication protocol (`replication`, `pgoutput`) on postgres-protocol.

pub mod migrate;
pub mod outbox;
pub mod pgoutput;
pub mod replication;
pub mod slot;

use crate::error::{Error, Result};

/// Opens an ordinary SQL connection and drives it on a background task.
pub async fn connect(config: &tokio_postgres::Config) -> Result<tokio_postgres::Client> {
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(classify_connect_error)?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "SQL connection closed");
        }
    });
    Ok(client)
}

/// Turns connection failures that retrying cannot fix into setup errors naming the fix.
pub fn classify_connect_error(error: tokio_postgres::Error) -> Error {
    let Some(code) = error.code().map(|c| c.code().to_string()) else {
        return Error::Postgres(error);
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
        "3D000" => Error::setup(
            format!("the database does not exist ({message})"),
            "create it or fix the database name in --database-url",
        ),
        _ => Error::Postgres(error),
    }
}
