//! Keeps the secret Kafka options (passwords, keys, `sasl.oauthbearer.config`) out of what librdkafka says
//! at run time: its log lines and global errors may quote an option's value, or the rest of it ("Unrecognized
//! sasl.oauthbearer.config beginning at: ..."). `SecretValues` (pure) finds those values and their parts in
//! a text; `RedactingContext` is the client context of the clients without one of their own. Which options
//! hold secrets is `config::holds_secret`'s.

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::KafkaError;

/// What replaces a secret in a message.
pub const NOT_SHOWN: &str = "<value not shown>";

/// The pieces of secret option values to take out of librdkafka's messages, longest first.
#[derive(Debug, Clone, Default)]
pub struct SecretValues {
    pieces: Vec<String>,
}

/// Parts shorter than this are not taken out on their own (too common to mean the secret; the whole value
/// still is, however short).
const SHORTEST_PART: usize = 4;

/// A piece cut short at the end of a message is taken out from this many bytes on (fewer could be a word of
/// the message itself).
const SHORTEST_CUT: usize = 8;

impl SecretValues {
    /// The secret values among `options` (`key`, `value`): each whole, and, for a value of several
    /// `key=value` words (`sasl.oauthbearer.config`, a JAAS line), each word's value and every rest of the
    /// value from a word on, which is how librdkafka quotes what it cannot parse.
    pub fn of(options: &[(String, String)]) -> Self {
        let mut pieces: Vec<String> = Vec::new();
        for (_, value) in options
            .iter()
            .filter(|(key, value)| !value.is_empty() && crate::config::holds_secret(key))
        {
            let mut parts: Vec<String> = value
                .char_indices()
                .filter(|(_, c)| c.is_whitespace() || *c == ',')
                .map(|(at, c)| value[at + c.len_utf8()..].trim().to_string())
                .collect();
            for word in value.split(|c: char| c.is_whitespace() || c == ',') {
                let part = word.split_once('=').map_or(word, |(_, v)| v);
                parts.push(part.trim_matches(['"', '\'', ';']).to_string());
            }
            parts.retain(|part| part.len() >= SHORTEST_PART);
            pieces.push(value.clone());
            pieces.extend(parts);
        }
        pieces.sort_by_key(|piece| std::cmp::Reverse(piece.len()));
        pieces.dedup();
        SecretValues { pieces }
    }

    /// The secret values among a client configuration's options.
    pub fn of_config(config: &rdkafka::ClientConfig) -> Self {
        let options: Vec<(String, String)> = config
            .config_map()
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect();
        Self::of(&options)
    }

    /// `text` with every secret piece replaced by [`NOT_SHOWN`], also one that ends the text cut short
    /// (librdkafka cuts its messages at 512 bytes) after at least [`SHORTEST_CUT`] bytes.
    pub fn redact(&self, text: &str) -> String {
        let mut text = self.pieces.iter().fold(text.to_string(), |text, piece| {
            text.replace(piece.as_str(), NOT_SHOWN)
        });
        for piece in &self.pieces {
            // A cut inside a multi-byte character leaves a replacement character behind.
            let kept = text.trim_end_matches(['\u{FFFD}', ' ', '\n', '\t']).len();
            let cut = (SHORTEST_CUT..piece.len())
                .rev()
                .filter(|&n| piece.is_char_boundary(n))
                .find(|&n| text[..kept].ends_with(&piece[..n]));
            if let Some(n) = cut {
                text = format!("{}{NOT_SHOWN}", &text[..kept - n]);
            }
        }
        text
    }
}

/// librdkafka's log line, redacted, at its level (as rdkafka's default context writes it).
pub fn log(secrets: &SecretValues, level: RDKafkaLogLevel, fac: &str, message: &str) {
    use RDKafkaLogLevel::*;
    let message = secrets.redact(message);
    match level {
        Emerg | Alert | Critical | Error => {
            tracing::error!(target: "librdkafka", "librdkafka: {fac} {message}")
        }
        Warning => tracing::warn!(target: "librdkafka", "librdkafka: {fac} {message}"),
        Notice | Info => tracing::info!(target: "librdkafka", "librdkafka: {fac} {message}"),
        Debug => tracing::debug!(target: "librdkafka", "librdkafka: {fac} {message}"),
    }
}

/// librdkafka's global error, redacted (as rdkafka's default context writes it).
pub fn error(secrets: &SecretValues, error: &KafkaError, reason: &str) {
    let text = secrets.redact(&format!("{error}: {reason}"));
    tracing::error!(target: "rdkafka::client", "librdkafka: {text}");
}

/// rdkafka's default client context, with librdkafka's messages redacted.
#[derive(Debug, Clone, Default)]
pub struct RedactingContext {
    /// What to take out.
    pub secrets: SecretValues,
}

impl RedactingContext {
    /// The context for a client made from `config`.
    pub fn for_config(config: &rdkafka::ClientConfig) -> Self {
        RedactingContext {
            secrets: SecretValues::of_config(config),
        }
    }
}

impl ClientContext for RedactingContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log(&self.secrets, level, fac, message);
    }

    fn error(&self, kafka_error: KafkaError, reason: &str) {
        error(&self.secrets, &kafka_error, reason);
    }
}

impl ConsumerContext for RedactingContext {}

impl rdkafka::producer::ProducerContext for RedactingContext {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::producer::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_secret_never_shows_whole_or_in_the_parts_librdkafka_quotes() {
        let secrets = SecretValues::of(&options(&[
            ("sasl.password", "pw"),
            (
                "sasl.oauthbearer.config",
                "principal=admin extension_traceId=Tr4ce-S3cret lifeSeconds=x9Secret",
            ),
            ("bootstrap.servers", "broker:9092"),
        ]));
        for quoted in [
            "Unrecognized sasl.oauthbearer.config beginning at: extension_traceId=Tr4ce-S3cret lifeSeconds=x9Secret",
            "Invalid sasl.oauthbearer.config: non-integral 'lifeSeconds': x9Secret",
            "authentication failed for pw",
            // Cut short where librdkafka's 512-byte message ends.
            "Unrecognized sasl.oauthbearer.config beginning at: extension_traceId=Tr4ce-S3c",
        ] {
            let said = secrets.redact(quoted);
            for secret in ["Tr4ce-S3c", "x9Secret", " pw"] {
                assert!(!said.contains(secret), "{secret} in {said}");
            }
            assert!(said.contains(NOT_SHOWN), "{said}");
        }
        assert_eq!(
            secrets.redact("connecting to broker:9092"),
            "connecting to broker:9092",
            "only secret options' values are taken out"
        );
    }
}
