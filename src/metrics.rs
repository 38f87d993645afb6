//! Prometheus metrics: names, descriptions and the recorder. Every metric has a sample line from start-up
//! on (counters at 0, gauges at their initial value). Owns no I/O; `http` serves the rendered text and
//! `stats` fills the gauges that need SQL.

use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Gauge: `pg_current_wal_lsn()` minus the slot's confirmed_flush_lsn, in bytes.
pub const SLOT_LAG_BYTES: &str = "outboxd_slot_lag_bytes";
/// Gauge: `pg_current_wal_lsn()` minus the slot's restart_lsn (WAL the slot keeps), in bytes.
pub const SLOT_RETAINED_WAL_BYTES: &str = "outboxd_slot_retained_wal_bytes";
/// Gauge: the slot's safe_wal_size (WAL that may still be written before the slot is lost), in bytes.
pub const SLOT_SAFE_WAL_BYTES: &str = "outboxd_slot_safe_wal_bytes";
/// Gauge per `status` label: 1 for the slot's current wal_status, 0 for the others.
pub const SLOT_WAL_STATUS: &str = "outboxd_slot_wal_status";
/// Counter per `path` label (cdc, poll): events acknowledged by the broker, once each.
pub const EVENTS_PUBLISHED: &str = "outboxd_events_published_total";
/// Counter per `kind` label ([`ERROR_KINDS`]): failed publish attempts.
pub const PUBLISH_ERRORS: &str = "outboxd_publish_errors_total";
/// Counter: events dead-lettered.
pub const EVENTS_DEAD: &str = "outboxd_events_dead_total";
/// Gauge: rows with `published_at IS NULL` that are not dead (0 on a standby instance).
pub const UNPUBLISHED_EVENTS: &str = "outboxd_unpublished_events";
/// Gauge: age of the oldest unpublished row, in seconds (0 on a standby instance).
pub const OLDEST_UNPUBLISHED_AGE: &str = "outboxd_oldest_unpublished_age_seconds";
/// Gauge: dead-lettered rows waiting in the table (read from it, so it holds across restarts; 0 on a standby).
pub const DEAD_EVENTS: &str = "outboxd_dead_events";
/// Gauge: events handed to the broker and not yet finished.
pub const INFLIGHT_EVENTS: &str = "outboxd_inflight_events";
/// Histogram: seconds from the transaction's commit to the broker's acknowledgement.
pub const COMMIT_TO_ACK: &str = "outboxd_commit_to_ack_seconds";
/// Gauge per `mode` label (cdc, poll, standby, starting, reconnecting): 1 for the current mode.
pub const MODE: &str = "outboxd_mode";
/// Counter: times the server behind the URL had another history (failover, restore, switchover, slot gone).
pub const HISTORY_CHANGES: &str = "outboxd_database_history_changes_total";
/// Gauge: 1 while outboxd runs.
pub const UP: &str = "outboxd_up";
/// Counter: retention passes that failed (the log names the table and says why).
pub const RETENTION_FAILURES: &str = "outboxd_retention_failures_total";
/// Gauge: retention passes in a row that failed (0 after a successful one).
pub const RETENTION_CONSECUTIVE_FAILURES: &str = "outboxd_retention_consecutive_failures";
/// Gauge: Unix time of the last successful retention pass (0: none yet, or no `--retention`).
pub const RETENTION_LAST_SUCCESS: &str = "outboxd_retention_last_success_timestamp_seconds";
/// Counter: promotions outboxd carried on through the failover slot synchronised to the promoted standby.
pub const FAILOVER_SLOT_CONTINUATIONS: &str = "outboxd_failover_slot_continuations_total";
/// Gauge: 1 when a promotion would carry the slot over (a failover slot, `synchronized_standby_slots` set,
/// every `--standby-url` holding a valid synchronised copy); 0 otherwise, and before PostgreSQL 17.
pub const FAILOVER_READY: &str = "outboxd_failover_ready";
/// Gauge per `standby` label (host:port of a `--standby-url`): how far the standby's copy of the slot is
/// behind the primary's confirmed position, in bytes (-1: no usable copy). Sampled only once a standby was
/// read (one line per `--standby-url`, none without), so it is not in [`ALL`], whose metrics have a sample
/// from start-up on.
pub const STANDBY_SLOT_BEHIND_BYTES: &str = "outboxd_standby_slot_behind_bytes";

/// Counter per `result` label (clean, findings, failed): audits `run --audit-interval` made.
pub const AUDIT_RUNS: &str = "outboxd_audit_runs_total";
/// Gauge: published events the last audit checked (`run --audit-interval`).
pub const AUDIT_CHECKED: &str = "outboxd_audit_checked_events";
/// Gauge: events the last audit found missing from their topic.
pub const AUDIT_MISSING: &str = "outboxd_audit_missing_events";
/// Gauge: events the last audit found more than once in their topic.
pub const AUDIT_DUPLICATED: &str = "outboxd_audit_duplicated_events";
/// Gauge: findings that fail an audit (missing, misplaced, reordered, unexplained) in the last one.
pub const AUDIT_FINDINGS: &str = "outboxd_audit_findings";
/// Gauge: Unix time of the end of the last range an audit found clean (0: none yet).
pub const AUDIT_LAST_CLEAN: &str = "outboxd_audit_last_clean_timestamp_seconds";

/// Every metric name `/metrics` exports (the Grafana dashboard may only use these).
pub const ALL: [&str; 26] = [
    SLOT_LAG_BYTES,
    SLOT_RETAINED_WAL_BYTES,
    SLOT_SAFE_WAL_BYTES,
    SLOT_WAL_STATUS,
    EVENTS_PUBLISHED,
    PUBLISH_ERRORS,
    EVENTS_DEAD,
    UNPUBLISHED_EVENTS,
    OLDEST_UNPUBLISHED_AGE,
    DEAD_EVENTS,
    INFLIGHT_EVENTS,
    COMMIT_TO_ACK,
    MODE,
    HISTORY_CHANGES,
    UP,
    RETENTION_FAILURES,
    RETENTION_CONSECUTIVE_FAILURES,
    RETENTION_LAST_SUCCESS,
    FAILOVER_SLOT_CONTINUATIONS,
    FAILOVER_READY,
    AUDIT_RUNS,
    AUDIT_CHECKED,
    AUDIT_MISSING,
    AUDIT_DUPLICATED,
    AUDIT_FINDINGS,
    AUDIT_LAST_CLEAN,
];

/// `outboxd_audit_runs_total{result}` values.
const AUDIT_RESULTS: [&str; 3] = ["clean", "findings", "failed"];

/// Kinds of publish errors counted in `outboxd_publish_errors_total{kind}`.
pub const ERROR_KINDS: [&str; 3] = ["refused", "delivery", "database"];
const MODES: [&str; 5] = ["cdc", "poll", "standby", "starting", "reconnecting"];
/// `outboxd_slot_wal_status` values, as in pg_replication_slots.wal_status.
const WAL_STATUSES: [&str; 5] = ["reserved", "extended", "unreserved", "lost", "none"];

/// How often recorded histogram samples are folded into their buckets. Until then the exporter keeps every
/// sample (8 bytes and more per event); folding only at scrape time let memory grow without bound when
/// nobody scraped.
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Installs the global recorder, gives every metric its first sample and starts the upkeep task that keeps
/// the recorder's memory flat whether or not anyone scrapes (needs a Tokio runtime).
// Long: one description per metric, the list README's metrics table follows.
pub fn install() -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(COMMIT_TO_ACK.to_string()),
            // Fine below 50 ms, where a healthy pipeline lives, so percentiles read from the buckets are
            // close to the truth there.
            &[
                0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.010, 0.0125,
                0.015, 0.0175, 0.020, 0.0225, 0.025, 0.030, 0.035, 0.040, 0.050, 0.075, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ],
        )
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())?;
    describe_gauge!(
        SLOT_LAG_BYTES,
        "pg_current_wal_lsn() - confirmed_flush_lsn of the slot"
    );
    describe_gauge!(
        SLOT_RETAINED_WAL_BYTES,
        "pg_current_wal_lsn() - restart_lsn: WAL the slot keeps"
    );
    describe_gauge!(
        SLOT_SAFE_WAL_BYTES,
        "safe_wal_size: WAL that may still be written before the slot is lost"
    );
    describe_gauge!(SLOT_WAL_STATUS, "1 for the slot's current wal_status");
    describe_counter!(
        EVENTS_PUBLISHED,
        "events acknowledged by the broker, once each"
    );
    describe_counter!(PUBLISH_ERRORS, "failed publish attempts by kind");
    describe_counter!(EVENTS_DEAD, "events dead-lettered");
    describe_gauge!(
        UNPUBLISHED_EVENTS,
        "rows with published_at IS NULL (not dead)"
    );
    describe_gauge!(OLDEST_UNPUBLISHED_AGE, "age of the oldest unpublished row");
    describe_gauge!(
        DEAD_EVENTS,
        "dead-lettered rows in the table (until replayed or removed)"
    );
    describe_gauge!(
        INFLIGHT_EVENTS,
        "events handed to the broker and not yet finished"
    );
    describe_histogram!(
        COMMIT_TO_ACK,
        "from the transaction's commit to the broker's acknowledgement"
    );
    describe_gauge!(MODE, "1 for the current mode");
    describe_counter!(
        HISTORY_CHANGES,
        "times the server behind the URL had another history (failover, restore, switchover, slot gone)"
    );
    describe_gauge!(UP, "1 while outboxd runs");
    describe_counter!(
        RETENTION_FAILURES,
        "retention passes that failed (the log names the table and says why)"
    );
    describe_gauge!(
        RETENTION_CONSECUTIVE_FAILURES,
        "retention passes in a row that failed (0 after a successful one)"
    );
    describe_gauge!(
        RETENTION_LAST_SUCCESS,
        "Unix time of the last successful retention pass (0: none yet, or no --retention)"
    );
    describe_counter!(
        FAILOVER_SLOT_CONTINUATIONS,
        "promotions carried on through the failover slot synchronised to the promoted standby"
    );
    describe_gauge!(
        FAILOVER_READY,
        "1 when a promotion would carry the slot over (PostgreSQL 17+ failover slot, protected, synced)"
    );
    describe_gauge!(
        STANDBY_SLOT_BEHIND_BYTES,
        "bytes the standby's copy of the slot is behind the primary's (-1: no usable copy)"
    );
    describe_counter!(
        AUDIT_RUNS,
        "audits of run --audit-interval, by result (clean, findings, failed)"
    );
    describe_gauge!(AUDIT_CHECKED, "published events the last audit checked");
    describe_gauge!(
        AUDIT_MISSING,
        "events the last audit found missing from their topic"
    );
    describe_gauge!(
        AUDIT_DUPLICATED,
        "events the last audit found more than once"
    );
    describe_gauge!(
        AUDIT_FINDINGS,
        "findings that fail an audit (missing, misplaced, reordered, unexplained) in the last one"
    );
    describe_gauge!(
        AUDIT_LAST_CLEAN,
        "Unix time of the end of the last range an audit found clean"
    );
    for path in ["cdc", "poll"] {
        counter!(EVENTS_PUBLISHED, "path" => path).increment(0);
    }
    for kind in ERROR_KINDS {
        counter!(PUBLISH_ERRORS, "kind" => kind).increment(0);
    }
    counter!(EVENTS_DEAD).increment(0);
    counter!(HISTORY_CHANGES).increment(0);
    counter!(FAILOVER_SLOT_CONTINUATIONS).increment(0);
    counter!(RETENTION_FAILURES).increment(0);
    for result in AUDIT_RESULTS {
        counter!(AUDIT_RUNS, "result" => result).increment(0);
    }
    for name in [
        SLOT_LAG_BYTES,
        SLOT_RETAINED_WAL_BYTES,
        SLOT_SAFE_WAL_BYTES,
        UNPUBLISHED_EVENTS,
        OLDEST_UNPUBLISHED_AGE,
        DEAD_EVENTS,
        INFLIGHT_EVENTS,
        RETENTION_CONSECUTIVE_FAILURES,
        RETENTION_LAST_SUCCESS,
        FAILOVER_READY,
        AUDIT_CHECKED,
        AUDIT_MISSING,
        AUDIT_DUPLICATED,
        AUDIT_FINDINGS,
        AUDIT_LAST_CLEAN,
    ] {
        gauge!(name).set(0.0);
    }
    set_wal_status(None);
    set_mode("starting");
    gauge!(UP).set(1.0);
    // Registering the histogram renders its (empty) buckets from start-up on.
    let _ = histogram!(COMMIT_TO_ACK);
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| "metrics need a Tokio runtime for their upkeep".to_string())?;
    let upkeep = handle.clone();
    runtime.spawn(async move {
        let mut every = tokio::time::interval(UPKEEP_EVERY);
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// Sets `outboxd_mode` to 1 for `mode` (cdc, poll, standby, starting or reconnecting) and 0 for the others.
pub fn set_mode(mode: &str) {
    for m in MODES {
        gauge!(MODE, "mode" => m).set(if m == mode { 1.0 } else { 0.0 });
    }
}

/// Sets `outboxd_slot_wal_status` to 1 for `status` and 0 for the others; `None` (no slot) counts as `none`.
pub fn set_wal_status(status: Option<&str>) {
    let status = status.unwrap_or("none");
    for s in WAL_STATUSES {
        gauge!(SLOT_WAL_STATUS, "status" => s).set(if s == status { 1.0 } else { 0.0 });
    }
}

/// Events this process has published (acknowledged by the broker; dead letters are not): the stall
/// watchdog's sign of progress (see `stats`), which cannot read the counters back from the recorder.
static PUBLISHED: AtomicU64 = AtomicU64::new(0);

/// Events published since the process started.
pub fn published_so_far() -> u64 {
    PUBLISHED.load(Ordering::Relaxed)
}

/// Counts `events` acknowledged by the broker on `path` (cdc or poll).
pub fn published(path: &'static str, events: u64) {
    counter!(EVENTS_PUBLISHED, "path" => path).increment(events);
    PUBLISHED.fetch_add(events, Ordering::Relaxed);
}

/// Counts one failed publish attempt of `kind` (one of [`ERROR_KINDS`]).
pub fn publish_error(kind: &'static str) {
    counter!(PUBLISH_ERRORS, "kind" => kind).increment(1);
}

/// Counts `events` dead-lettered.
pub fn dead(events: u64) {
    counter!(EVENTS_DEAD).increment(events);
}

/// What one audit of `run --audit-interval` found: (checked, missing, duplicated, failing findings), and the
/// end of its range when it was clean; `None`: the audit could not be made.
pub fn audited(found: Option<(u64, u64, u64, u64)>, range_end: std::time::SystemTime) {
    let Some((checked, missing, duplicated, failing)) = found else {
        counter!(AUDIT_RUNS, "result" => "failed").increment(1);
        return;
    };
    gauge!(AUDIT_CHECKED).set(checked as f64);
    gauge!(AUDIT_MISSING).set(missing as f64);
    gauge!(AUDIT_DUPLICATED).set(duplicated as f64);
    gauge!(AUDIT_FINDINGS).set(failing as f64);
    if failing == 0 {
        counter!(AUDIT_RUNS, "result" => "clean").increment(1);
        let end = range_end
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        gauge!(AUDIT_LAST_CLEAN).set(end.as_secs_f64());
    } else {
        counter!(AUDIT_RUNS, "result" => "findings").increment(1);
    }
}

/// Counts one change of the server history behind the URL.
pub fn history_changed() {
    counter!(HISTORY_CHANGES).increment(1);
}

/// Counts one promotion carried on through the synchronised failover slot.
pub fn failover_slot_used() {
    counter!(FAILOVER_SLOT_CONTINUATIONS).increment(1);
}

/// Sets the failover gauges from the latest reading (`None`: before PostgreSQL 17, or no reading).
pub fn set_failover(readiness: Option<&crate::failover::FailoverReadiness>) {
    gauge!(FAILOVER_READY).set(if readiness.is_some_and(|r| r.ready()) {
        1.0
    } else {
        0.0
    });
    for copy in readiness.map(|r| r.standbys.as_slice()).unwrap_or_default() {
        let usable = copy.problem.is_none()
            && copy.synced
            && !copy.temporary
            && copy.invalidation_reason.is_none();
        let behind = copy.behind_bytes.filter(|_| usable).unwrap_or(-1);
        gauge!(STANDBY_SLOT_BEHIND_BYTES, "standby" => copy.standby.clone()).set(behind as f64);
    }
}

/// Sets the number of events handed to the broker and not yet finished.
pub fn in_flight(events: usize) {
    gauge!(INFLIGHT_EVENTS).set(events as f64);
}

/// Records one event's time from commit to the broker's acknowledgement, in seconds.
pub fn commit_to_ack(seconds: f64) {
    histogram!(COMMIT_TO_ACK).record(seconds);
}

/// Counts one failed retention pass.
pub fn retention_failed() {
    counter!(RETENTION_FAILURES).increment(1);
}

/// After each retention pass: failed passes in a row, and when the last one succeeded (Unix seconds).
pub fn retention_health(consecutive_failures: u64, last_success: Option<u64>) {
    gauge!(RETENTION_CONSECUTIVE_FAILURES).set(consecutive_failures as f64);
    gauge!(RETENTION_LAST_SUCCESS).set(last_success.unwrap_or(0) as f64);
}
