//! `outboxd status`: the slot's state, its lag and retained WAL, and the outbox backlog, as a table or
//! JSON. Reads only; needs no broker.

use serde::Serialize;

use crate::config::DatabaseSettings;
use crate::error::Result;
use crate::pg::{self, outbox, slot};

#[derive(Debug, Serialize)]
pub struct Status {
    pub table: String,
    pub slot_name: String,
    pub slot_exists: bool,
    pub active: Option<bool>,
    pub active_pid: Option<i32>,
    pub confirmed_flush_lsn: Option<String>,
    pub wal_status: Option<String>,
    pub lag_bytes: Option<i64>,
    pub retained_wal_bytes: Option<i64>,
    pub unpublished_events: i64,
    pub oldest_unpublished_age_seconds: Option<f64>,
}

pub async fn read(settings: &DatabaseSettings) -> Result<Status> {
    let client = pg::connect(&settings.database_url).await?;
    slot::check_table(&client, &settings.table).await?;
    let state = slot::slot_state(&client, &settings.slot).await?;
    let backlog = outbox::backlog(&client, &settings.table).await?;
    Ok(Status {
        table: settings.table.to_string(),
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
    })
}

impl Status {
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
            (
                "oldest unpublished age (s)",
                show(
                    &self
                        .oldest_unpublished_age_seconds
                        .map(|s| format!("{s:.1}")),
                ),
            ),
        ];
        rows.iter().map(|(k, v)| format!("{k:<28}{v}\n")).collect()
    }
}
