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
            &format!(
                "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE {})
                     OR EXISTS (SELECT FROM pg_stat_replication r
                                WHERE NOT EXISTS (SELECT FROM pg_replication_slots s
                                                  WHERE s.active_pid = r.pid AND s.slot_type = 'logical'))",
                crate::pg::slot::STANDBY_PHYSICAL_SLOT
            ),
            &[],
        )
        .await?
        .get(0);
    let mut copies = Vec::with_capacity(standbys.len());
    for standby in standbys {
        let label = label(standby);
        let (copy, position) =
            match tokio::time::timeout(STANDBY_TIMEOUT, read_copy(standby, slot)).await {
                Ok(Ok(read)) => read,
                Ok(Err(error)) => (
                    StandbyCopy {
                        problem: Some(format!("cannot be read: {error}")),
                        ..StandbyCopy::default()
                    },
                    None,
                ),
                Err(_) => (
                    StandbyCopy {
                        problem: Some(format!(
                            "did not answer within {}s",
                            STANDBY_TIMEOUT.as_secs()
                        )),
                        ..StandbyCopy::default()
                    },
                    None,
                ),
            };
        copies.push((
            StandbyCopy {
                standby: label,
                ..copy
            },
            position,
        ));
    }
    // Read after every copy: a copy is synchronised from the primary's slot, so it can never be ahead of
    // what the primary's slot holds later (read before, a copy synced meanwhile would look ahead).
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
    let copies = copies
        .into_iter()
        .map(|(copy, position)| compared_with_primary(copy, position, confirmed))
        .collect();
    Ok(Some(FailoverReadiness {
        slot_failover,
        synchronized_standby_slots,
        unknown_standby_slots,
        has_standbys,
        standbys: copies,
    }))
}

/// Pure: a copy at `copy_position` next to the primary's slot at `primary` (read after it): how far behind it
/// is, or, ahead of it, a copy from another history.
fn compared_with_primary(
    copy: StandbyCopy,
    copy_position: Option<Lsn>,
    primary: Option<Lsn>,
) -> StandbyCopy {
    let (Some(primary), Some(position)) = (primary, copy_position) else {
        return copy;
    };
    if position > primary {
        return StandbyCopy {
            standby: copy.standby,
            problem: Some(format!("its copy of the slot is at {position}, ahead of the primary's slot at {primary}: a copy from another history (the slot was re-created, or the standby follows another primary); drop it on the standby so that it syncs again")),
            ..StandbyCopy::default()
        };
    }
    StandbyCopy {
        behind_bytes: i64::try_from(primary.bytes_since(position)).ok(),
        ..copy
    }
}

/// The slot's copy on one standby, and the copy's confirmed position.
async fn read_copy(standby: &PgUrl, slot: &str) -> Result<(StandbyCopy, Option<Lsn>)> {
    let client = super::connect_for_figures(standby, STANDBY_TIMEOUT).await?;
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery(), current_setting('sync_replication_slots')::bool",
            &[],
        )
        .await?;
    let (in_recovery, sync_replication_slots): (bool, bool) = (row.get(0), row.get(1));
    if !in_recovery {
        let copy = StandbyCopy {
            problem: Some(
                "is no standby (not in recovery): give --standby-url only for standbys of the primary"
                    .into(),
            ),
            ..StandbyCopy::default()
        };
        return Ok((copy, None));
    }
    let row = client
        .query_opt(
            "SELECT synced, temporary, invalidation_reason, confirmed_flush_lsn::text
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(row) = row else {
        let copy = StandbyCopy {
            sync_replication_slots,
            ..StandbyCopy::default()
        };
        return Ok((copy, None));
    };
    let position = row
        .get::<_, Option<String>>(3)
        .and_then(|lsn| lsn.parse::<Lsn>().ok());
    let copy = StandbyCopy {
        standby: String::new(),
        problem: None,
        sync_replication_slots,
        exists: true,
        synced: row.get(0),
        temporary: row.get(1),
        invalidation_reason: row.get(2),
        behind_bytes: None,
    };
    Ok((copy, position))
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
    fn a_copy_is_behind_the_primary_read_after_it_or_from_another_history() {
        let copy = || StandbyCopy {
            standby: "standby:5432".into(),
            exists: true,
            ..StandbyCopy::default()
        };
        let behind = compared_with_primary(copy(), Some(Lsn(100)), Some(Lsn(250)));
        assert_eq!((behind.behind_bytes, behind.problem), (Some(150), None));
        let ahead = compared_with_primary(copy(), Some(Lsn(300)), Some(Lsn(250)));
        assert!(ahead
            .problem
            .unwrap_or_default()
            .contains("ahead of the primary"));
        assert_eq!(ahead.standby, "standby:5432");
        let unknown = compared_with_primary(copy(), None, Some(Lsn(250)));
        assert_eq!(unknown.behind_bytes, None);
    }

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
