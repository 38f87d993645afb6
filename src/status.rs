//! `outboxd status`: the slot's state, its lag and retained WAL, the outbox backlog, and how retention
//! fares (as the running sweepers record it, see `retention`), as a table or JSON. Reads only; needs no
//! broker.

use serde::Serialize;

use crate::config::DatabaseSettings;
use crate::error::Result;
use crate::pg::slot::{leadership_application_name, LeadershipRole};
use crate::pg::{self, outbox, slot};
use crate::table::TableSpec;

/// What `outboxd status` reports: the slot, the backlog, the instances and retention (also as JSON).
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The outbox tables, `schema.name`, comma-separated.
    pub table: String,
    /// The replication slot's name (`--slot`).
    pub slot_name: String,
    /// Whether the slot exists in pg_replication_slots.
    pub slot_exists: bool,
    /// Whether a walsender streams from the slot; `None` without a slot.
    pub active: Option<bool>,
    /// PID of the walsender streaming from the slot; `None` when none does, or without a slot.
    pub active_pid: Option<i32>,
    /// The slot's confirmed_flush_lsn, as PostgreSQL prints it (e.g. 0/15132E8); `None` without a slot.
    pub confirmed_flush_lsn: Option<String>,
    /// The slot's wal_status (reserved, extended, unreserved, lost); `None` without a slot.
    pub wal_status: Option<String>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`, in bytes; `None` without a slot.
    pub lag_bytes: Option<i64>,
    /// `pg_current_wal_lsn() - restart_lsn`: WAL the slot keeps, in bytes; `None` without a slot.
    pub retained_wal_bytes: Option<i64>,
    /// Unpublished rows that are not dead, over every table with `published_at`.
    pub unpublished_events: i64,
    /// Age of the oldest of them, in seconds; `None` when there are none, or no table has `created_at`.
    pub oldest_unpublished_age_seconds: Option<f64>,
    /// Dead-lettered events (0 without the polling columns).
    pub dead_events: i64,
    /// outboxd instances (auto/cdc mode) leading this slot: 1 when one runs.
    pub active_instances: i64,
    /// outboxd instances standing by to take over this slot.
    pub standby_instances: i64,
    /// False under `--mode poll`: no slot is used, so a missing one is no finding.
    pub uses_slot: bool,
    /// Retention as the running sweepers of this slot record it (the worst of them); `None`: no
    /// `outboxd run --retention` is running.
    pub retention: Option<RetentionStatus>,
    /// Whether the slot would survive a promotion (PostgreSQL 17+ failover slots); `None` before 17 or
    /// under `--mode poll`.
    pub failover: Option<crate::failover::FailoverReadiness>,
    /// Replays of published events not yet done (`outboxd replay --published`).
    pub replays: Vec<crate::replay::Progress>,
}

/// How retention fares, as the running sweepers record it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RetentionStatus {
    /// Passes in a row that failed (0: the last one succeeded).
    pub consecutive_failures: u64,
    /// Seconds since the last successful pass; `None`: none yet.
    pub last_success_age_seconds: Option<u64>,
}

/// The one-line judgement of `outboxd status`, with its exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Level {
    /// Nothing to report (exit code 0).
    Ok = 0,
    /// At least one finding to look into (exit code 1).
    Warning = 1,
    /// The slot is lost, or its lag is above `--crit-lag` (exit code 2).
    Critical = 2,
    /// The status could not be read (exit code 3).
    Unknown = 3,
}

impl Level {
    /// The level as printed: OK, WARNING, CRITICAL or UNKNOWN.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "OK",
            Level::Warning => "WARNING",
            Level::Critical => "CRITICAL",
            Level::Unknown => "UNKNOWN",
        }
    }
}

/// The verdict of `outboxd status`: its level and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// The worst level found.
    pub level: Level,
    /// The findings of that level joined with `; `, or a fixed sentence when all is well.
    pub reason: String,
}

/// Judges a status: the worst finding wins. Pure.
// Long: one check per finding, in the order `status` reports them.
pub fn verdict(status: &Status, thresholds: &crate::config::Thresholds) -> Verdict {
    let mut findings: Vec<(Level, String)> = Vec::new();
    match status.wal_status.as_deref() {
        Some("lost") => findings.push((Level::Critical, "slot is lost (wal_status = lost)".into())),
        Some("unreserved") => findings.push((
            Level::Warning,
            "slot WAL is unreserved: it will be lost at the next checkpoint unless it catches up"
                .into(),
        )),
        _ => {}
    }
    if let Some(lag) = status.lag_bytes {
        if lag > thresholds.crit_lag {
            findings.push((
                Level::Critical,
                format!("slot lag {lag} bytes > --crit-lag {}", thresholds.crit_lag),
            ));
        } else if lag > thresholds.warn_lag {
            findings.push((
                Level::Warning,
                format!("slot lag {lag} bytes > --warn-lag {}", thresholds.warn_lag),
            ));
        }
    }
    if !status.slot_exists && !status.uses_slot {
        // Polling only: nothing to say about a slot that is not meant to exist.
    } else if !status.slot_exists {
        findings.push((
            Level::Warning,
            format!(
                "slot {} does not exist (outboxd never ran, or polls)",
                status.slot_name
            ),
        ));
    } else if status.active == Some(false) {
        findings.push((
            Level::Warning,
            format!(
                "slot {} is not in use: is outboxd running?",
                status.slot_name
            ),
        ));
    } else if status.active == Some(true) && status.active_instances == 0 {
        // Another client (pg_recvlogical, another connector) consumes the slot: its lag looks healthy while
        // outboxd delivers nothing of what it confirms.
        findings.push((
            Level::Warning,
            format!(
                "slot {} is streamed to by pid {} but no outboxd leads it: another client consumes it (`outboxd doctor` names it)",
                status.slot_name,
                status.active_pid.map_or("?".to_string(), |pid| pid.to_string())
            ),
        ));
    }
    if let Some(age) = status.oldest_unpublished_age_seconds {
        if age > thresholds.warn_age {
            findings.push((
                Level::Warning,
                format!(
                    "oldest unpublished event is {age:.0}s old > --warn-age {}",
                    thresholds.warn_age
                ),
            ));
        }
    }
    if let Some(retention) = status
        .retention
        .as_ref()
        .filter(|r| r.consecutive_failures > 0)
    {
        findings.push((
            Level::Warning,
            format!(
                "retention failed {} pass(es) in a row ({}): see outboxd's log",
                retention.consecutive_failures,
                retention
                    .last_success_age_seconds
                    .map_or("no pass succeeded yet".to_string(), |age| format!(
                        "last success {age}s ago"
                    ))
            ),
        ));
    }
    for (concern, text) in status.failover.iter().flat_map(|f| f.findings()) {
        if concern == crate::failover::Concern::Warning {
            findings.push((Level::Warning, text));
        }
    }
    if status.dead_events > 0 {
        findings.push((
            Level::Warning,
            format!(
                "{} dead-lettered event(s): see README, `outboxd replay`",
                status.dead_events
            ),
        ));
    }
    let worst = findings
        .iter()
        .map(|(level, _)| *level as u8)
        .max()
        .unwrap_or(0);
    let reasons: Vec<&str> = findings
        .iter()
        .filter(|(level, _)| *level as u8 == worst)
        .map(|(_, r)| r.as_str())
        .collect();
    match worst {
        0 => Verdict {
            level: Level::Ok,
            reason: "slot streaming and backlog within limits".into(),
        },
        1 => Verdict {
            level: Level::Warning,
            reason: reasons.join("; "),
        },
        _ => Verdict {
            level: Level::Critical,
            reason: reasons.join("; "),
        },
    }
}

/// How long one of `status`'s queries may run (each reads an index, not the table).
const STATEMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `mode`: the `--mode` outboxd runs with (the same options or file as `run`).
pub async fn read(
    settings: &DatabaseSettings<TableSpec>,
    mode: crate::config::Mode,
) -> Result<Status> {
    let client = pg::connect_for_figures(&settings.database_url, STATEMENT_TIMEOUT).await?;
    let tables = slot::inspect_all(&client, &settings.tables).await?;
    let state = slot::slot_state(&client, &settings.slot).await?;
    // Only what an index serves: a table no index serves is not read whole at every monitoring run.
    let mut counted = Vec::new();
    let mut dead_events = 0;
    for table in tables.iter().filter(|t| t.marks_published) {
        let countable = outbox::countable(&client, table).await?;
        if countable.backlog {
            counted.push(table.clone());
        }
        if countable.dead {
            dead_events += outbox::dead_count(&client, table).await?;
        }
    }
    let backlog = outbox::backlog(&client, &counted, crate::config::PollOrder::default()).await?;
    let quoted: Vec<String> = tables.iter().map(|t| t.name.quoted()).collect();
    let (active_instances, standby_instances) = instances(&client, &settings.slot, &quoted).await?;
    let retention = worst(crate::retention::read_states(&client, &settings.slot).await?);
    let uses_slot = mode != crate::config::Mode::Poll;
    let replays = crate::replay::under_way(&client, &tables).await?;
    let failover = if uses_slot {
        let version = pg::server_version(&client).await?;
        pg::failover::read(&client, version, &settings.slot, &settings.standby_urls).await?
    } else {
        None
    };
    Ok(Status {
        table: crate::table::names(&tables),
        slot_name: settings.slot.clone(),
        slot_exists: state.is_some(),
        active: state.as_ref().map(|s| s.active),
        active_pid: state.as_ref().and_then(|s| s.active_pid),
        confirmed_flush_lsn: state.as_ref().and_then(|s| s.confirmed_flush_lsn.clone()),
        wal_status: state.as_ref().and_then(|s| s.wal_status.clone()),
        lag_bytes: state.as_ref().and_then(|s| s.lag_bytes),
        retained_wal_bytes: state.as_ref().and_then(|s| s.retained_wal_bytes),
        unpublished_events: backlog.unpublished_events,
        oldest_unpublished_age_seconds: backlog.oldest_unpublished_age_seconds,
        dead_events,
        active_instances,
        standby_instances,
        retention,
        uses_slot,
        failover,
        replays,
    })
}

/// The sweeper that fails most (several instances may run retention).
fn worst(states: Vec<crate::retention::Health>) -> Option<RetentionStatus> {
    let worst = states.into_iter().max_by_key(|h| h.consecutive_failures)?;
    Some(RetentionStatus {
        consecutive_failures: worst.consecutive_failures,
        last_success_age_seconds: worst
            .last_success
            .map(|at| crate::retention::age(at).as_secs()),
    })
}

/// Counts instances by the `application_name` of their leadership connections, of roles that may update the
/// tables (`tables`, quoted): a session that only names itself as outboxd's is not counted.
async fn instances(
    client: &tokio_postgres::Client,
    slot: &str,
    tables: &[String],
) -> Result<(i64, i64)> {
    let sql = format!(
        "SELECT count(*) FILTER (WHERE a.application_name = $1),
                count(*) FILTER (WHERE a.application_name = $2)
         FROM pg_stat_activity a WHERE a.application_name IN ($1, $2) AND {}",
        crate::pipeline::liveness::may_publish("$3")
    );
    let row = client
        .query_one(
            &sql,
            &[
                &leadership_application_name(LeadershipRole::Active, slot),
                &leadership_application_name(LeadershipRole::Standby, slot),
                &tables,
            ],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

impl Status {
    /// The status as an aligned two-column text table, one line per figure.
    pub fn to_table(&self) -> String {
        fn show<T: std::fmt::Display>(value: &Option<T>) -> String {
            value
                .as_ref()
                .map_or_else(|| "-".to_string(), |v| v.to_string())
        }
        let rows = [
            ("table", self.table.clone()),
            ("slot", self.slot_name.clone()),
            ("slot exists", self.slot_exists.to_string()),
            ("active", show(&self.active)),
            ("active pid", show(&self.active_pid)),
            ("confirmed_flush_lsn", show(&self.confirmed_flush_lsn)),
            ("wal_status", show(&self.wal_status)),
            ("lag bytes", show(&self.lag_bytes)),
            ("retained WAL bytes", show(&self.retained_wal_bytes)),
            ("unpublished events", self.unpublished_events.to_string()),
            ("dead events", self.dead_events.to_string()),
            (
                "instances",
                format!(
                    "{} active, {} standby",
                    self.active_instances, self.standby_instances
                ),
            ),
            (
                "retention",
                match &self.retention {
                    None => "- (no outboxd run --retention running)".to_string(),
                    Some(r) if r.consecutive_failures == 0 => {
                        format!("ok, last pass {}s ago", show(&r.last_success_age_seconds))
                    }
                    Some(r) => format!(
                        "failing: {} pass(es) in a row, last success {}",
                        r.consecutive_failures,
                        r.last_success_age_seconds
                            .map_or("never".to_string(), |age| format!("{age}s ago"))
                    ),
                },
            ),
            (
                "oldest unpublished age (s)",
                show(
                    &self
                        .oldest_unpublished_age_seconds
                        .map(|s| format!("{s:.1}")),
                ),
            ),
        ];
        let mut rows = rows.to_vec();
        if let Some(failover) = &self.failover {
            rows.extend(failover_rows(failover));
        }
        for replay in &self.replays {
            rows.push((
                "replay",
                format!(
                    "{} of {}: {}, {} of {} republished{}",
                    replay.replay_id,
                    replay.table,
                    replay.state,
                    replay.done,
                    replay.total,
                    replay
                        .to_topic
                        .as_ref()
                        .map(|t| format!(" to {t}"))
                        .unwrap_or_default()
                ),
            ));
        }
        rows.iter().map(|(k, v)| format!("{k:<28}{v}\n")).collect()
    }
}

/// The failover lines of `status`'s table.
fn failover_rows(failover: &crate::failover::FailoverReadiness) -> Vec<(&'static str, String)> {
    let mut rows = vec![
        (
            "failover slot",
            match failover.slot_failover {
                None => "-".to_string(),
                Some(on) => format!("{on}{}", if failover.ready() { " (ready)" } else { "" }),
            },
        ),
        (
            "synchronized_standby_slots",
            if failover.synchronized_standby_slots.is_empty() {
                "- (none: not protected)".to_string()
            } else {
                failover.synchronized_standby_slots.join(",")
            },
        ),
    ];
    for copy in &failover.standbys {
        let state = match &copy.problem {
            Some(problem) => problem.clone(),
            None if !copy.exists => "no copy of the slot".into(),
            None => format!(
                "synced {}, temporary {}, invalidated {}, behind {} bytes",
                copy.synced,
                copy.temporary,
                copy.invalidation_reason.as_deref().unwrap_or("no"),
                copy.behind_bytes.map_or("-".to_string(), |b| b.to_string())
            ),
        };
        rows.push(("standby", format!("{}: {state}", copy.standby)));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Thresholds;

    fn healthy() -> Status {
        Status {
            table: "public.outbox_event".into(),
            slot_name: "outboxd".into(),
            slot_exists: true,
            active: Some(true),
            active_pid: Some(7),
            confirmed_flush_lsn: Some("0/1".into()),
            wal_status: Some("reserved".into()),
            lag_bytes: Some(1000),
            retained_wal_bytes: Some(2000),
            unpublished_events: 0,
            oldest_unpublished_age_seconds: None,
            dead_events: 0,
            active_instances: 1,
            standby_instances: 0,
            uses_slot: true,
            retention: Some(RetentionStatus {
                consecutive_failures: 0,
                last_success_age_seconds: Some(5),
            }),
            failover: None,
            replays: Vec::new(),
        }
    }

    const LIMITS: Thresholds = Thresholds {
        warn_lag: 1_000_000,
        crit_lag: 10_000_000,
        warn_age: 60.0,
    };

    #[test]
    fn an_unprotected_failover_slot_is_a_warning() {
        let unprotected = Status {
            failover: Some(crate::failover::FailoverReadiness {
                slot_failover: Some(true),
                has_standbys: true,
                ..Default::default()
            }),
            ..healthy()
        };
        let verdict = verdict(&unprotected, &LIMITS);
        assert_eq!(verdict.level, Level::Warning);
        assert!(
            verdict.reason.contains("synchronized_standby_slots"),
            "{verdict:?}"
        );
        assert!(unprotected.to_table().contains("(none: not protected)"));
    }

    #[test]
    fn healthy_is_ok() {
        assert_eq!(verdict(&healthy(), &LIMITS).level, Level::Ok);
    }

    #[test]
    fn polling_needs_no_slot() {
        let polling = Status {
            slot_exists: false,
            active: None,
            active_pid: None,
            confirmed_flush_lsn: None,
            wal_status: None,
            lag_bytes: None,
            retained_wal_bytes: None,
            uses_slot: false,
            ..healthy()
        };
        assert_eq!(verdict(&polling, &LIMITS).level, Level::Ok);
        // Under cdc/auto a missing slot is a finding; a slot left behind by a poller still holds WAL.
        let expecting = Status {
            uses_slot: true,
            ..polling.clone()
        };
        assert_eq!(verdict(&expecting, &LIMITS).level, Level::Warning);
        let left_behind = Status {
            uses_slot: false,
            active: Some(false),
            ..healthy()
        };
        assert_eq!(verdict(&left_behind, &LIMITS).level, Level::Warning);
    }

    #[test]
    fn a_slot_another_client_streams_from_is_a_warning() {
        let foreign = Status {
            active_instances: 0,
            ..healthy()
        };
        let judged = verdict(&foreign, &LIMITS);
        assert_eq!(judged.level, Level::Warning);
        assert!(judged.reason.contains("no outboxd leads it"), "{judged:?}");
    }

    #[test]
    fn warnings_and_criticals_name_their_reason() {
        let cases = [
            (
                Status {
                    lag_bytes: Some(2_000_000),
                    ..healthy()
                },
                Level::Warning,
                "--warn-lag",
            ),
            (
                Status {
                    lag_bytes: Some(20_000_000),
                    ..healthy()
                },
                Level::Critical,
                "--crit-lag",
            ),
            (
                Status {
                    wal_status: Some("unreserved".into()),
                    ..healthy()
                },
                Level::Warning,
                "unreserved",
            ),
            (
                Status {
                    wal_status: Some("lost".into()),
                    ..healthy()
                },
                Level::Critical,
                "lost",
            ),
            (
                Status {
                    active: Some(false),
                    ..healthy()
                },
                Level::Warning,
                "not in use",
            ),
            (
                Status {
                    oldest_unpublished_age_seconds: Some(600.0),
                    ..healthy()
                },
                Level::Warning,
                "--warn-age",
            ),
            (
                Status {
                    dead_events: 2,
                    ..healthy()
                },
                Level::Warning,
                "dead",
            ),
            (
                Status {
                    retention: Some(RetentionStatus {
                        consecutive_failures: 3,
                        last_success_age_seconds: None,
                    }),
                    ..healthy()
                },
                Level::Warning,
                "retention failed 3 pass(es) in a row (no pass succeeded yet): see outboxd's log",
            ),
        ];
        for (status, level, needle) in cases {
            let v = verdict(&status, &LIMITS);
            assert_eq!(v.level, level, "{v:?}");
            assert!(v.reason.contains(needle), "{v:?}");
        }
    }

    #[test]
    fn the_worst_finding_wins() {
        let status = Status {
            lag_bytes: Some(20_000_000),
            active: Some(false),
            ..healthy()
        };
        let v = verdict(&status, &LIMITS);
        assert_eq!(v.level, Level::Critical);
        assert!(!v.reason.contains("not in use"));
    }
}
