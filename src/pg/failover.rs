//! Reads what decides whether the slot survives a promotion (PostgreSQL 17+): the slot's `failover` flag and
//! `synchronized_standby_slots` on the primary, and the slot's copy on each standby given with
//! `--standby-url`. Judging it is `crate::failover`'s; nothing here changes a server.

use tokio_postgres::Client;

use super::version::ServerVersion;
use super::PgUrl;
use crate::error::Result;
use crate::failover::{FailoverReadiness, StandbyCopy};
use crate::lsn::Lsn;

/// How long reading one standby may take, connecting included.
const STANDBY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The failover state of `slot` seen from the primary behind `primary` and from `standbys`; `None` before
/// PostgreSQL 17 (no failover slots). A standby that cannot be read is a finding, not an error.
pub async fn read(
    primary: &Client,
    version: ServerVersion,
    slot: &str,
    standbys: &[PgUrl],
) -> Result<Option<FailoverReadiness>> {
    if !version.has_failover_slots() {
        return Ok(None);
    }
    let row = primary
        .query_opt(
            "SELECT (to_jsonb(s) ->> 'failover')::bool, confirmed_flush_lsn::text
             FROM pg_replication_slots s WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let (slot_failover, confirmed): (Option<bool>, Option<String>) = match &row {
        Some(row) => (row.get(0), row.get(1)),
        None => (None, None),
    };
    let confirmed = confirmed.and_then(|lsn| lsn.parse::<Lsn>().ok());
    let setting: String = primary
        .query_one("SELECT current_setting('synchronized_standby_slots')", &[])
        .await?
        .get(0);
    let synchronized_standby_slots = setting_list(&setting);
    let unknown_standby_slots = if synchronized_standby_slots.is_empty() {
        Vec::new()
    } else {
        let physical: Vec<String> = primary
            .query(
                "SELECT slot_name::text FROM pg_replication_slots WHERE slot_type = 'physical'",
                &[],
            )
            .await?
            .iter()
            .map(|row| row.get(0))
            .collect();
        synchronized_standby_slots
            .iter()
            .filter(|name| !physical.contains(name))
            .cloned()
            .collect()
    };
    let has_standbys: bool = primary
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_type = 'physical')
                 OR EXISTS (SELECT FROM pg_stat_replication r
                            WHERE NOT EXISTS (SELECT FROM pg_replication_slots s
                                              WHERE s.active_pid = r.pid AND s.slot_type = 'logical'))",
            &[],
        )
        .await?
        .get(0);
    let mut copies = Vec::with_capacity(standbys.len());
    for standby in standbys {
        let label = label(standby);
        let copy = match tokio::time::timeout(STANDBY_TIMEOUT, read_copy(standby, slot, confirmed))
            .await
        {
            Ok(Ok(copy)) => copy,
            Ok(Err(error)) => StandbyCopy {
                problem: Some(format!("cannot be read: {error}")),
                ..StandbyCopy::default()
            },
            Err(_) => StandbyCopy {
                problem: Some(format!(
                    "did not answer within {}s",
                    STANDBY_TIMEOUT.as_secs()
                )),
                ..StandbyCopy::default()
            },
        };
        copies.push(StandbyCopy {
            standby: label,
            ..copy
        });
    }
    Ok(Some(FailoverReadiness {
        slot_failover,
        synchronized_standby_slots,
        unknown_standby_slots,
        has_standbys,
        standbys: copies,
    }))
}

/// The slot's copy on one standby; `primary_confirmed`: the primary's position, to say how far behind it is.
async fn read_copy(
    standby: &PgUrl,
    slot: &str,
    primary_confirmed: Option<Lsn>,
) -> Result<StandbyCopy> {
    let client = super::connect_for_figures(standby, STANDBY_TIMEOUT).await?;
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery(), current_setting('sync_replication_slots')::bool",
            &[],
        )
        .await?;
    let (in_recovery, sync_replication_slots): (bool, bool) = (row.get(0), row.get(1));
    if !in_recovery {
        return Ok(StandbyCopy {
            problem: Some(
                "is no standby (not in recovery): give --standby-url only for standbys of the primary"
                    .into(),
            ),
            ..StandbyCopy::default()
        });
    }
    let row = client
        .query_opt(
            "SELECT synced, temporary, invalidation_reason, confirmed_flush_lsn::text
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(row) = row else {
        return Ok(StandbyCopy {
            sync_replication_slots,
            ..StandbyCopy::default()
        });
    };
    let copy_confirmed = row
        .get::<_, Option<String>>(3)
        .and_then(|lsn| lsn.parse::<Lsn>().ok());
    if let (Some(primary), Some(copy)) = (primary_confirmed, copy_confirmed) {
        if copy > primary {
            return Ok(StandbyCopy {
                problem: Some(format!("its copy of the slot is at {copy}, ahead of the primary's slot at {primary}: a copy from another history (the slot was re-created, or the standby follows another primary); drop it on the standby so that it syncs again")),
                ..StandbyCopy::default()
            });
        }
    }
    let behind_bytes = match (primary_confirmed, copy_confirmed) {
        (Some(primary), Some(copy)) => i64::try_from(primary.bytes_since(copy)).ok(),
        _ => None,
    };
    Ok(StandbyCopy {
        standby: String::new(),
        problem: None,
        sync_replication_slots,
        exists: true,
        synced: row.get(0),
        temporary: row.get(1),
        invalidation_reason: row.get(2),
        behind_bytes,
    })
}

/// Pure: the names in a list setting (`synchronized_standby_slots`: comma-separated, maybe quoted).
fn setting_list(setting: &str) -> Vec<String> {
    setting
        .split(',')
        .map(|name| name.trim().trim_matches('"').to_string())
        .filter(|name| !name.is_empty())
        .collect()
}

/// host:port of a URL's first host: what a message may say about it (the URL may hold a password).
pub fn label(url: &PgUrl) -> String {
    use tokio_postgres::config::Host;
    let host = match url.config.get_hosts().first() {
        Some(Host::Tcp(name)) => name.clone(),
        #[cfg(unix)]
        Some(Host::Unix(path)) => path.display().to_string(),
        None => "localhost".into(),
    };
    let port = url.config.get_ports().first().copied().unwrap_or(5432);
    format!("{host}:{port}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_settings_are_split_and_unquoted() {
        assert_eq!(setting_list(""), Vec::<String>::new());
        assert_eq!(setting_list("a"), vec!["a"]);
        assert_eq!(setting_list("a, \"B c\",,d"), vec!["a", "B c", "d"]);
    }

    #[test]
    fn a_label_shows_host_and_port_but_never_the_password() {
        let url = PgUrl::parse("--standby-url", "postgres://u:secret@10.0.0.2:6543/db").unwrap();
        assert_eq!(label(&url), "10.0.0.2:6543");
    }
}
