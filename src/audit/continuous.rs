//! `outboxd run --audit-interval`: every interval, the events created in the interval before it (ending a
//! settling time ago, so that they had time to be published) are audited against their topics, read only
//! from shortly before that range; what the audit found becomes the `outboxd_audit_*` metrics. It owns the
//! schedule and the ranges; the audit is [`super::audit`]'s, the metrics `metrics`'s.

use std::time::{Duration, SystemTime};

use crate::config::RunSettings;
use crate::table::TableSpec;

/// How long after its creation an event is audited: time to be published (and its row marked) first.
pub const SETTLE: Duration = Duration::from_secs(60);
/// How much earlier than the range the topics are read: producers' clocks and record timestamps may be a
/// little behind the database's.
pub const READ_MARGIN: Duration = Duration::from_secs(300);

/// The range the audit at `now` checks: events created in `[now - SETTLE - every, now - SETTLE)`, their
/// records read from `READ_MARGIN` before. Pure.
pub fn range_at(now: SystemTime, every: Duration) -> super::Range {
    let until = now - SETTLE;
    let since = until - every;
    super::Range {
        since: Some(since),
        until: Some(until),
        aggregate_type: None,
        heal: false,
        read_since: Some(since - READ_MARGIN),
    }
}

/// Audits every `every` until the task is dropped; never ends on a failed audit (it is counted, logged,
/// and the next one is made).
pub async fn run(settings: RunSettings<TableSpec>, every: Duration) {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let range = range_at(SystemTime::now(), every);
        let until = range.until.unwrap_or_else(SystemTime::now);
        match super::audit(settings.clone(), &range, None).await {
            Ok(summary) => {
                let failing = summary.failing();
                crate::metrics::audited(
                    Some((
                        summary.checked,
                        summary.missing,
                        summary.duplicated,
                        failing,
                    )),
                    until,
                );
                if failing > 0 {
                    tracing::error!(checked = summary.checked, missing = summary.missing, misplaced = summary.misplaced, reordered = summary.reordered, unexplained = summary.unexplained_without_id + summary.unexplained_foreign, "the audit of the last interval has findings: run `outboxd audit --since ... --details FILE` over it to name the events (README, Audit and replay)");
                } else {
                    tracing::info!(
                        checked = summary.checked,
                        duplicated = summary.duplicated,
                        "the audit of the last interval is clean"
                    );
                }
            }
            Err(error) => {
                crate::metrics::audited(None, until);
                tracing::warn!(%error, "could not audit the last interval (the next audit tries again)");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_audit_checks_the_interval_before_the_settling_time_reading_from_a_margin_earlier() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(100_000);
        let range = range_at(now, Duration::from_secs(600));
        assert_eq!(range.until, Some(now - SETTLE));
        assert_eq!(range.since, Some(now - SETTLE - Duration::from_secs(600)));
        assert_eq!(
            range.read_since,
            Some(now - SETTLE - Duration::from_secs(900))
        );
        assert!(!range.heal);
    }
}
