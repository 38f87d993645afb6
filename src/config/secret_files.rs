//! Secrets from files, the container convention: `OUTBOXD_DATABASE_URL_FILE=/run/secrets/db-url` stands for
//! `OUTBOXD_DATABASE_URL` set to that file's contents, so that no password sits on a command line (seen by
//! `ps`) or in a ConfigMap. Owns the resolution of `*_FILE` variables into the values they name (pure, over a
//! reader given by the caller); not the environment itself, which `main` sets before parsing flags.

use std::path::Path;

use super::{invalid, ConfigError};

/// The variables that may hold a secret, each of which may instead be given as `<name>_FILE`.
pub const SECRET_VARIABLES: [&str; 3] = [
    "OUTBOXD_DATABASE_URL",
    "OUTBOXD_REPLICATION_URL",
    "OUTBOXD_KAFKA_OPTION",
];

/// The value each `<name>_FILE` of [`SECRET_VARIABLES`] stands for, as `(name, value)`: the file's contents
/// without the trailing line break. A Kafka option file may hold one `key=value` per line (blank lines and
/// lines starting with `#` skipped). `var` reads the environment, `read` a file. Errors name the variable and
/// the path, never the contents.
pub fn resolve(
    var: impl Fn(&str) -> Option<String>,
    read: impl Fn(&Path) -> std::io::Result<String>,
) -> Result<Vec<(&'static str, String)>, ConfigError> {
    let mut resolved = Vec::new();
    for name in SECRET_VARIABLES {
        let file_variable = format!("{name}_FILE");
        let Some(path) = var(&file_variable) else {
            continue;
        };
        if var(name).is_some() {
            return Err(invalid(format!(
                "both {name} and {file_variable} are set: set one of them (a secret belongs in the file {file_variable} names)"
            )));
        }
        let contents = read(Path::new(&path)).map_err(|error| {
            invalid(format!(
                "{file_variable} names {path}, which cannot be read ({error}): mount the secret there, or fix the path"
            ))
        })?;
        let value = if name == "OUTBOXD_KAFKA_OPTION" {
            kafka_options(&contents)
        } else {
            contents.trim_end_matches(['\n', '\r']).to_string()
        };
        if value.is_empty() {
            return Err(invalid(format!(
                "{file_variable} names {path}, which is empty: put the secret in it"
            )));
        }
        resolved.push((name, value));
    }
    Ok(resolved)
}

/// A Kafka option file's lines as one `OUTBOXD_KAFKA_OPTION` value: options separated by commas (a comma
/// starts a new option only where `name=` follows, and within a secret's value only where a property
/// librdkafka knows follows, so a value keeps its own commas).
fn kafka_options(contents: &str) -> String {
    contents
        .lines()
        .map(|line| line.trim_end_matches('\r'))
        .filter(|line| !line.trim().is_empty() && !line.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn resolve_with(
        vars: &[(&str, &str)],
        files: &[(&str, &str)],
    ) -> Result<Vec<(&'static str, String)>, ConfigError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let files: HashMap<String, String> = files
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        resolve(
            |name| vars.get(name).cloned(),
            |path| {
                files
                    .get(path.to_str().unwrap_or_default())
                    .cloned()
                    .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
            },
        )
    }

    #[test]
    fn a_file_variable_stands_for_the_file_contents_without_the_line_break() {
        let resolved = resolve_with(
            &[("OUTBOXD_DATABASE_URL_FILE", "/run/secrets/db")],
            &[("/run/secrets/db", "postgres://u:s3cret@db/app\r\n")],
        )
        .unwrap();
        assert_eq!(
            resolved,
            [("OUTBOXD_DATABASE_URL", "postgres://u:s3cret@db/app".into())]
        );
    }

    #[test]
    fn a_kafka_option_file_holds_one_option_per_line() {
        let resolved = resolve_with(
            &[("OUTBOXD_KAFKA_OPTION_FILE", "/k")],
            &[(
                "/k",
                "# credentials\nsasl.username=outboxd\n\nsasl.password=a,b=c\n",
            )],
        )
        .unwrap();
        assert_eq!(
            resolved,
            [(
                "OUTBOXD_KAFKA_OPTION",
                "sasl.username=outboxd,sasl.password=a,b=c".into()
            )]
        );
    }

    #[test]
    fn both_the_variable_and_its_file_are_refused() {
        let error = resolve_with(
            &[
                ("OUTBOXD_REPLICATION_URL", "postgres://u:s3cret@db/app"),
                ("OUTBOXD_REPLICATION_URL_FILE", "/r"),
            ],
            &[("/r", "postgres://u:other@db/app")],
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("OUTBOXD_REPLICATION_URL_FILE"), "{error}");
        assert!(
            !error.contains("s3cret") && !error.contains("other"),
            "{error}"
        );
    }

    #[test]
    fn a_missing_or_empty_file_is_named_never_its_contents() {
        let missing = resolve_with(&[("OUTBOXD_DATABASE_URL_FILE", "/nope")], &[])
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("/nope") && missing.contains("mount the secret"),
            "{missing}"
        );
        let empty = resolve_with(&[("OUTBOXD_DATABASE_URL_FILE", "/e")], &[("/e", "\n")])
            .unwrap_err()
            .to_string();
        assert!(empty.contains("empty"), "{empty}");
    }

    #[test]
    fn nothing_is_resolved_without_file_variables() {
        let resolved = resolve_with(&[("OUTBOXD_DATABASE_URL", "postgres://db/app")], &[]).unwrap();
        assert!(resolved.is_empty());
    }
}
