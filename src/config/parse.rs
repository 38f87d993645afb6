//! Parsers of single values (durations, URLs, identifiers, table names, `--kafka-option`s), each naming
//! the setting it parses on error and never repeating a secret.

use std::time::Duration;

use super::{invalid, ConfigError};
use crate::table::TableName;

/// Parses a duration written like `500ms`, `5s`, `7d`, naming the setting on error.
pub fn parse_duration(setting: &str, text: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(text.trim()).map_err(|e| {
        invalid(format!(
            "{setting} {text:?} is not a duration ({e}); write it like 500ms, 5s, 10m or 7d"
        ))
    })
}

/// Parses a libpq-style URL or key=value string. The error never repeats the URL (it may hold a password).
pub fn parse_postgres_url(setting: &str, url: &str) -> Result<crate::pg::url::PgUrl, ConfigError> {
    crate::pg::url::PgUrl::parse(setting, url).map_err(invalid)
}

/// Identifiers outboxd splices into SQL: letters, digits, `_`, `$`, not starting with a digit or `$`, ≤ 63 bytes.
pub fn parse_identifier(setting: &str, name: &str) -> Result<String, ConfigError> {
    let mut chars = name.chars();
    let valid_start = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if valid_start
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
    {
        Ok(name.to_string())
    } else {
        Err(invalid(format!(
            "{setting} {name:?} is not a valid identifier: use up to 63 letters, digits and underscores, starting with a letter or underscore"
        )))
    }
}

/// Replication slot names: lower-case letters, digits and underscores only (PostgreSQL's rule).
pub fn parse_slot_name(name: &str) -> Result<String, ConfigError> {
    if !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        Ok(name.to_string())
    } else {
        Err(invalid(format!(
            "--slot {name:?} is not a valid replication slot name: use up to 63 lower-case letters, digits and underscores"
        )))
    }
}

/// Parses `--table` text, `schema.name` or `name` (in `public`), checking both parts as identifiers.
pub fn parse_table(text: &str) -> Result<TableName, ConfigError> {
    let (schema, name) = text.split_once('.').unwrap_or(("public", text));
    Ok(TableName {
        schema: parse_identifier("--table", schema)?,
        name: parse_identifier("--table", name)?,
    })
}

/// Whether a librdkafka property holds a secret (a password, a client secret, a JAAS or OAUTHBEARER
/// configuration, a private key or its passphrase, a token): its value is never shown. Errs on the side of
/// hiding: any property naming a key (`ssl.key.pem`, `ssl.key.location`, ...) counts.
pub fn holds_secret(property: &str) -> bool {
    const WORDS: [&str; 8] = [
        "password",
        "secret",
        "jaas",
        "passphrase",
        "key",
        "private",
        "token",
        "oauthbearer.config",
    ];
    let property = property.to_ascii_lowercase();
    WORDS.iter().any(|word| property.contains(word))
}

/// Whether librdkafka has a configuration property of this name (whatever a value of it may be).
fn librdkafka_knows(property: &str) -> bool {
    use rdkafka::error::KafkaError;
    use rdkafka::types::RDKafkaConfRes;
    !matches!(
        rdkafka::ClientConfig::new()
            .set(property, "")
            .create_native_config(),
        Err(KafkaError::ClientConfig(
            RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN,
            ..
        ))
    )
}

/// A URL with its password replaced, for logs and status output.
pub fn redact_url(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((userinfo, host)) => {
                let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                format!("{scheme}://{user}:***@{host}")
            }
            None => url.to_string(),
        },
        None => "(key=value connection string)".to_string(),
    }
}

/// `--kafka-option` values as (property, value). One value may hold several options separated by commas
/// (`OUTBOXD_KAFKA_OPTION=acks=all,linger.ms=5`); a comma starts a new option only where a property name and
/// `=` follow, so values with commas (JAAS configurations) stay whole; within a secret option's value, only
/// where a property librdkafka knows follows (a password's `,z9=Q` stays the password's, never an option
/// librdkafka would name in an error). Errors never repeat what was given: it may be a secret.
pub(super) fn split_kafka_options<'a>(
    values: impl Iterator<Item = &'a String>,
) -> Result<Vec<(String, String)>, ConfigError> {
    let is_property = |s: &str| {
        s.split_once('=').is_some_and(|(key, _)| {
            !key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        })
    };
    let property = |part: &str| {
        part.split_once('=')
            .filter(|_| is_property(part.trim_start()))
            .map(|(key, v)| (key.trim().to_string(), v.to_string()))
    };
    let mut options: Vec<(String, String)> = Vec::new();
    for (n, value) in values.enumerate() {
        let mut parts = value.split(',');
        let first = parts.next().unwrap_or_default();
        let Some(option) = property(first) else {
            return Err(ConfigError::Invalid(format!(
                "--kafka-option number {} is not property=value (e.g. compression.type=lz4); its text is not shown, as it may hold a secret",
                n + 1
            )));
        };
        options.push(option);
        for part in parts {
            let last = options.last_mut().expect("an option was pushed above");
            let new_option =
                property(part).filter(|(key, _)| !holds_secret(&last.0) || librdkafka_knows(key));
            match new_option {
                Some(option) => options.push(option),
                None => {
                    // A comma inside the previous option's value.
                    last.1.push(',');
                    last.1.push_str(part);
                }
            }
        }
    }
    Ok(options)
}
