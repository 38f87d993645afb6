//! Options from flags, environment (`OUTBOXD_*`) and a TOML file (`--config`), merged in that order of
//! precedence, then validated into typed settings with errors that name the setting and the fix.
//! Owns parsing and validation only; nothing here connects anywhere.
//!
//! Rooms, each depending only on those before it: `parse` (single values), `settings` (the validated
//! settings and their choices), `cli` (the command line and [`Options`]: a new option is one field there),
//! `merge` (the `--config` file under flags and environment), `validate` (options to settings: a new
//! option's check goes there). `secret_files` stands apart: `*_FILE` variables, read before flags are parsed.

mod cli;
mod merge;
mod parse;
pub mod secret_files;
mod settings;
#[cfg(test)]
mod tests;
mod validate;

pub use cli::{Cli, Command, DeadCommand, LogFormat, Options, Thresholds};
pub use parse::{
    holds_secret, parse_duration, parse_identifier, parse_postgres_url, parse_slot_name,
    parse_table, redact_url,
};
pub use settings::{
    CdcSettings, DatabaseSettings, DeliveryGuarantee, ExactlyOnceSettings, ExistingRows,
    KafkaSettings, Mode, PollOrder, PollSettings, Retention, RunSettings,
    DEFAULT_MAX_IN_FLIGHT_EVENTS,
};

use std::path::PathBuf;

use crate::topic::TemplateError;

/// An option that cannot be used as given; the message names the setting and, where it helps, the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The `--config` file cannot be read.
    #[error("cannot read --config file {path}: {source}")]
    ReadFile {
        /// The `--config` path as given.
        path: PathBuf,
        /// Why reading it failed.
        source: std::io::Error,
    },
    /// The `--config` file is not valid TOML, or holds an unknown key or a value of the wrong type.
    #[error("invalid --config file {path}: {message}")]
    ParseFile {
        /// The `--config` path as given.
        path: PathBuf,
        /// The TOML parser's message (it names the key at fault).
        message: String,
    },
    /// Any other invalid setting, with the message to show.
    #[error("{0}")]
    Invalid(String),
    /// An invalid `--topic` template.
    #[error(transparent)]
    Topic(#[from] TemplateError),
}

fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(message.into())
}
