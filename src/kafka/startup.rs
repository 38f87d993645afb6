//! The start-up broker check: a broker answers, and it accepts outboxd. A broker that cannot be reached may
//! come back, so that is retried (for `--startup-timeout`); one that refused outboxd's credentials (SASL) or
//! whose certificate outboxd does not trust (TLS) will not change its mind, so that stops outboxd at once with
//! what to fix. librdkafka reports those refusals only to the client's error callback, where this module's
//! context keeps the first one.

use std::sync::Mutex;
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;

use super::{ask_a_broker, client_config, config_error};
use crate::config::RunSettings;
use crate::error::{Error, Result};

/// A broker's refusal that retrying cannot fix. Other TLS failures (a connection reset or timed out during
/// the handshake) may be the network's, and are retried like an unreachable broker.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refusal {
    /// SASL: wrong user name or password, or a mechanism the broker does not offer.
    Authentication(String),
    /// TLS: the broker's certificate is not trusted (its CA, or the name it was issued for).
    UntrustedCertificate(String),
    /// TLS: the broker wants a client certificate.
    ClientCertificateRequired(String),
}

impl Refusal {
    fn of(error: &KafkaError, reason: &str) -> Option<Self> {
        let code = error.rdkafka_error_code()?;
        // librdkafka appends its own hint (and how long the connection took); the setup error has the fix.
        let reason = reason
            .split(": broker certificate could not be verified")
            .next()
            .unwrap_or(reason);
        let reason = reason
            .split(" (after ")
            .next()
            .unwrap_or(reason)
            .to_string();
        match code {
            // Fetching an OAUTHBEARER token fails too while its identity provider is unreachable.
            RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed
                if !reason.contains("OAUTHBEARER token") =>
            {
                Some(Refusal::Authentication(reason))
            }
            // A failed verification is also reported as a transport failure.
            RDKafkaErrorCode::SSL | RDKafkaErrorCode::BrokerTransportFailure
                if reason.contains("certificate verify failed")
                    || reason.contains("Failed to verify broker certificate")
                    || reason.contains("Broker did not provide a certificate") =>
            {
                Some(Refusal::UntrustedCertificate(reason))
            }
            RDKafkaErrorCode::SSL
                if reason.contains("client SSL authentication might be required") =>
            {
                Some(Refusal::ClientCertificateRequired(reason))
            }
            _ => None,
        }
    }

    /// The setup error, with librdkafka's reason stripped of every secret `kafka_options` hold.
    fn into_error(self, kafka_options: &[(String, String)]) -> Error {
        let (problem, reason, fix) = match self {
            Refusal::Authentication(reason) => (
                "the Kafka broker refused outboxd's credentials: SASL authentication failed",
                reason,
                "check sasl.username / sasl.password (and sasl.mechanism, e.g. SCRAM-SHA-512) in --kafka-option, and that the user exists on the brokers",
            ),
            Refusal::UntrustedCertificate(reason) => (
                "the Kafka broker's TLS certificate is not trusted: certificate verify failed",
                reason,
                "set --kafka-option ssl.ca.location to the CA certificate (PEM) that signed the brokers' certificates; they must also name the addresses outboxd connects to (--brokers, and the brokers' advertised listeners)",
            ),
            Refusal::ClientCertificateRequired(reason) => (
                "the Kafka broker requires a TLS client certificate",
                reason,
                "give one with --kafka-option ssl.certificate.location and ssl.key.location (and ssl.key.password)",
            ),
        };
        Error::setup(
            format!(
                "{problem} ({})",
                super::secrets::SecretValues::of(kafka_options).redact(&reason)
            ),
            fix,
        )
    }
}

/// Keeps the first refusal librdkafka reports; logs every other global error as rdkafka's default context
/// does (same target, so `RUST_LOG` filters it alike), but for `AllBrokersDown`, which only sums up the errors
/// before it (many times a second while TLS fails).
struct RefusalContext {
    refusal: Mutex<Option<Refusal>>,
    secrets: super::secrets::SecretValues,
}

impl ClientContext for RefusalContext {
    fn error(&self, error: KafkaError, reason: &str) {
        match Refusal::of(&error, reason) {
            Some(refusal) => {
                tracing::debug!(%error, reason = %self.secrets.redact(reason), "the Kafka broker refused outboxd");
                if let Ok(mut first) = self.refusal.lock() {
                    first.get_or_insert(refusal);
                }
            }
            None if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown) => {
                tracing::debug!(target: "rdkafka::client", "librdkafka: {}", self.secrets.redact(&format!("{error}: {reason}")))
            }
            None => super::secrets::error(&self.secrets, &error, reason),
        }
    }
}

impl ProducerContext for RefusalContext {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

/// Fails unless a broker answers a metadata request within `timeout` (see [`super::Publisher::check_brokers`]),
/// with the producer's own settings (so invalid `--kafka-option`s fail here too). No answer is transient; a
/// broker that refused outboxd's credentials or TLS is a setup error naming the fix.
pub async fn check_brokers<Tables>(
    settings: &RunSettings<Tables>,
    timeout: Duration,
) -> Result<()> {
    let config = client_config(settings);
    let context = RefusalContext {
        refusal: Mutex::default(),
        secrets: super::secrets::SecretValues::of_config(&config),
    };
    let producer: ThreadedProducer<RefusalContext> =
        config.create_with_context(context).map_err(config_error)?;
    let answered = ask_a_broker(producer.clone(), timeout).await;
    let refusal = producer
        .context()
        .refusal
        .lock()
        .ok()
        .and_then(|mut r| r.take());
    match (answered, refusal) {
        (Err(_), Some(refusal)) => Err(refusal.into_error(&settings.kafka.options)),
        (Ok(()), Some(refusal)) => {
            // Another broker answered: the one that refused is named in the warning.
            tracing::warn!(error = %refusal.into_error(&settings.kafka.options), "a Kafka broker refused outboxd");
            Ok(())
        }
        (answered, None) => answered,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(options: &[(&str, &str)]) -> Vec<(String, String)> {
        options
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn refusals_are_told_apart_by_code_and_reason() {
        let global = |code| KafkaError::Global(code);
        assert!(matches!(
            Refusal::of(
                &global(RDKafkaErrorCode::Authentication),
                "SASL authentication error: Authentication failed"
            ),
            Some(Refusal::Authentication(_))
        ));
        // librdkafka's hint and timing are dropped (the setup error has the fix).
        assert_eq!(
            Refusal::of(&global(RDKafkaErrorCode::SSL), "sasl_ssl://b:9093/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified, verify that ssl.ca.location is correctly configured or root CA certificates are installed (install ca-certificates package) (after 28ms in state SSL_HANDSHAKE)"),
            Some(Refusal::UntrustedCertificate("sasl_ssl://b:9093/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed".into()))
        );
        assert!(matches!(
            Refusal::of(&global(RDKafkaErrorCode::BrokerTransportFailure), "sasl_ssl://b:9093/bootstrap: error:0A000086:SSL routines::certificate verify failed (after 4ms in state SSL_HANDSHAKE)"),
            Some(Refusal::UntrustedCertificate(_))
        ));
        assert!(matches!(
            Refusal::of(&global(RDKafkaErrorCode::SSL), "SSL handshake failed: error:0A0000F4:SSL routines::unexpected message: client SSL authentication might be required (see ssl.key.location and ssl.certificate.location and consult the broker logs for more information)"),
            Some(Refusal::ClientCertificateRequired(_))
        ));
        // The network's failures during a handshake, and an identity provider that does not answer, may pass.
        assert_eq!(
            Refusal::of(
                &global(RDKafkaErrorCode::SSL),
                "SSL transport error: Connection timed out"
            ),
            None
        );
        assert_eq!(
            Refusal::of(
                &global(RDKafkaErrorCode::Authentication),
                "Failed to acquire SASL OAUTHBEARER token: connection refused"
            ),
            None
        );
        // An unreachable broker may come back: not a refusal.
        for code in [
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::Resolve,
        ] {
            assert_eq!(
                Refusal::of(&global(code), "Connection refused"),
                None,
                "{code:?}"
            );
        }
    }

    #[test]
    fn setup_errors_name_the_fix_and_never_a_secret() {
        let options = options(&[
            ("sasl.username", "outboxd"),
            ("sasl.password", "hunter2-secret"),
        ]);
        let error = Refusal::Authentication(
            "sasl_ssl://127.0.0.1:9093/bootstrap: SASL authentication error: echoing hunter2-secret".into(),
        )
        .into_error(&options);
        assert!(!error.is_transient());
        let text = error.to_string();
        assert!(text.contains("SASL authentication failed"), "{text}");
        assert!(text.contains("sasl.username / sasl.password"), "{text}");
        assert!(text.contains("127.0.0.1:9093"), "{text}");
        assert!(!text.contains("hunter2-secret"), "{text}");

        let text = Refusal::UntrustedCertificate("certificate verify failed".into())
            .into_error(&options)
            .to_string();
        assert!(text.contains("not trusted"), "{text}");
        assert!(text.contains("ssl.ca.location"), "{text}");
    }
}
