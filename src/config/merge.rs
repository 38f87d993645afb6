//! The `--config` file under flags and environment: read, then merged option by option, by name.

use std::path::Path;

use super::{invalid, ConfigError, Options};

impl Options {
    /// Fills every option not given by flag or environment from the `--config` file.
    pub fn with_file(self) -> Result<Options, ConfigError> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let file = Options::from_file(&path)?;
        self.or(file)
    }

    fn from_file(path: &Path) -> Result<Options, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::ParseFile {
            path: path.into(),
            message: describe_toml_error(&text, &e),
        })
    }

    /// `self` (flags and environment) over `file`, option by option: a flag left unset (`None`, or a switch
    /// left off) takes the file's value.
    pub(super) fn or(self, file: Options) -> Result<Options, ConfigError> {
        let table = |options: &Options| {
            toml::Table::try_from(options)
                .map_err(|e| invalid(format!("cannot merge the options: {e}")))
        };
        let mut merged = table(&file)?;
        let mut given = table(&self)?;
        // Kafka options add up: the file's first, then those of flags and environment, so that a secret
        // kept in the environment (from a Kubernetes Secret) joins the file's options, and the later wins
        // per property (librdkafka applies them in order).
        if let (Some(toml::Value::Array(from_file)), Some(toml::Value::Array(from_flags))) =
            (merged.get(KAFKA_OPTION), given.get_mut(KAFKA_OPTION))
        {
            let mut all = from_file.clone();
            all.append(from_flags);
            *from_flags = all;
        }
        merged.extend(given);
        // What a struct serialised reads back as itself; the error would quote a value (maybe a URL with its
        // password), so it is not repeated.
        let mut options: Options = merged.try_into().map_err(|_| {
            invalid("cannot merge the options given by flag or environment with the file")
        })?;
        options.config = self.config;
        Ok(options)
    }
}

/// The `--config` name of `--kafka-option`.
const KAFKA_OPTION: &str = "kafka-option";

/// Where a `--config` file is wrong and why, without its text: the parser's own message quotes the line at
/// fault and the value (review M5: `kafka-option = "sasl.password=..."` printed the password). Keeps the
/// line, the column, the key of that line when it is a bare key (names are not secret) and the message
/// without the value.
fn describe_toml_error(text: &str, error: &toml::de::Error) -> String {
    let message = without_value(error.message());
    let Some(span) = error.span() else {
        return message;
    };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |at| at + 1) + 1;
    let is_bare_key = |key: &&str| {
        !key.is_empty()
            && key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    };
    let key = text
        .lines()
        .nth(line - 1)
        .and_then(|l| l.split_once('='))
        .map(|(key, _)| key.trim())
        .filter(is_bare_key);
    match key {
        Some(key) => format!("line {line}, column {column} (key {key}): {message}"),
        None => format!("line {line}, column {column}: {message}"),
    }
}

/// serde's messages about a value quote it ("invalid type: string \"...\", expected a sequence", "unknown
/// variant `...`, expected one of ..."): only what was expected is kept. The parser's own messages (syntax)
/// hold no source text and stay as they are.
fn without_value(message: &str) -> String {
    let about_a_value = [
        "invalid type",
        "invalid value",
        "invalid length",
        "unknown variant",
    ]
    .into_iter()
    .find(|kind| message.starts_with(kind));
    match about_a_value {
        Some(kind) => match message.rfind(", expected ") {
            Some(at) => format!("{kind} (the value is not shown){}", &message[at..]),
            None => format!("{kind} (the value is not shown)"),
        },
        None => message.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_error(text: &str) -> String {
        let Err(error) = toml::from_str::<Options>(text) else {
            panic!("{text:?} parsed")
        };
        describe_toml_error(text, &error)
    }

    #[test]
    fn a_config_error_names_the_place_and_never_a_value() {
        for (text, secret) in [
            (
                "database_url = \"postgres://outboxd:S3cret@db/app\"\n",
                "S3cret",
            ),
            (
                "brokers = \"b:9092\"\nkafka-option = 7\nsasl = \"hunter2\"\n",
                "hunter2",
            ),
            ("mode = \"hunter2\"\n", "hunter2"),
            (
                "database-url = [\"postgres://u:S3cret@db/app\"]\n",
                "S3cret",
            ),
            // The adversarial review: a YAML habit, an escaped quote, a backtick in a value.
            (
                "database_url: postgres://u:S3cret@db/app?sslmode=require\n",
                "S3cret",
            ),
            ("topic-partitions = \"hunt\\\"er2\"\n", "er2"),
            ("format = \"x`S3cret\"\n", "S3cret"),
        ] {
            let message = parse_error(text);
            assert!(!message.contains(secret), "{message}");
            assert!(message.starts_with("line "), "{message}");
        }
        assert!(parse_error("mode = \"hunter2\"\n").contains("key mode"));
    }

    #[test]
    fn a_kafka_option_may_be_one_string() {
        let options: Options =
            toml::from_str("kafka-option = \"sasl.password=hunter2\"\n").unwrap();
        assert_eq!(
            options.kafka_option,
            Some(vec!["sasl.password=hunter2".to_string()])
        );
    }
}
