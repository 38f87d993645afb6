//! Leadership among outboxd instances sharing one slot: a session-level advisory lock held on a dedicated
//! connection. Exactly one instance streams; the others stand by and take over when the leader's session
//! ends (a dead leader's connection closes, and PostgreSQL releases its lock).

use std::time::Duration;

use tokio::sync::watch;

use crate::backoff::Backoff;
use crate::config::RunSettings;
use crate::error::Result;
use crate::http::READINESS;

/// How often a standby asks for the lock.
const STANDBY_POLL: Duration = Duration::from_secs(1);

/// The role an instance plays for a slot, shown as the `application_name` of its leadership connection so
/// that `outboxd status` (any process with SQL access) can count active and standby instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Active,
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

/// Held while this instance leads; dropping it releases the lock.
pub struct Leadership {
    _client: tokio_postgres::Client,
    lost: watch::Receiver<bool>,
}

impl Leadership {
    /// Resolves when the leader's connection ends (its lock is gone: another instance may take over).
    pub async fn lost(&mut self) {
        let _ = self.lost.wait_for(|lost| *lost).await;
    }
}

/// Waits until this instance holds the lock for `settings`' slot. `None` when `shutdown` came first.
pub async fn acquire(
    settings: &RunSettings,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<Option<Leadership>> {
    let key = format!(
        "outboxd.leader.{}.{}",
        crate::table::names(&settings.database.tables),
        settings.database.slot
    );
    let mut standing_by = false;
    let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));
    // After a failover or switchover the database may be missing or in recovery for a while.
    let mut outage = super::DatabaseOutage::new(settings.reconnect_timeout);
    loop {
        let (client, connection) = match settings.database.database_url.connect_raw().await {
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
                    _ = shutdown.wait_for(|stop| *stop) => return Ok(None),
                }
            }
        };
        let (lost_tx, mut lost) = watch::channel(false);
        tokio::spawn(async move {
            let _ = connection.await;
            let _ = lost_tx.send(true);
        });
        loop {
            let held: bool = match client
                .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&key])
                .await
            {
                Ok(row) => row.get(0),
                Err(_) => break, // connection trouble: reconnect
            };
            if held {
                if announce(&client, Role::Active, &settings.database.slot)
                    .await
                    .is_err()
                {
                    break; // connection trouble: reconnect (the lock goes with the session)
                }
                if standing_by {
                    tracing::info!("took over as the active instance for this slot");
                }
                return Ok(Some(Leadership {
                    _client: client,
                    lost,
                }));
            }
            if !standing_by {
                if announce(&client, Role::Standby, &settings.database.slot)
                    .await
                    .is_err()
                {
                    break;
                }
                tracing::info!(
                    mode = "standby",
                    "another outboxd instance is active for this slot; standing by"
                );
                READINESS.set_mode("standby");
                standing_by = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(STANDBY_POLL) => {}
                _ = lost.wait_for(|lost| *lost) => break,
                _ = shutdown.wait_for(|stop| *stop) => return Ok(None),
            }
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
}
