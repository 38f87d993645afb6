//! The publisher: builds Kafka records from outbox events (topic, key, value, headers), creates missing
//! topics, and reports every broker acknowledgement (or failure) through a channel, tagged with the
//! transaction it belongs to. Owns the producer settings; what an ack means for the slot is the pipeline's.

pub mod secrets;
pub mod startup;
mod transaction;

pub use transaction::check_transactions;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;
use tokio::sync::mpsc::UnboundedSender;
use uuid::Uuid;

use crate::config::RunSettings;
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::progress::{Progress, ProgressKey};
use crate::record::RecordFormat;
use crate::sink::{Delivery, PublishError, Rejection, Sink, Sinks};
use crate::table::OutboxTable;

/// What a librdkafka error means for the event it refused.
fn rejection_from(error: &KafkaError) -> Rejection {
    let topic_wide = matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
        )
    );
    let permanent = matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::MessageBatchTooLarge
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
        )
    );
    // Not InvalidMessage: a CRC mismatch may be the network's.
    let of_the_event = matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::MessageBatchTooLarge
        )
    );
    let producer_broken = matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
                | RDKafkaErrorCode::OutOfOrderSequenceNumber
                | RDKafkaErrorCode::UnknownProducerId
                | RDKafkaErrorCode::InvalidProducerIdMapping
        )
    );
    Rejection {
        reason: error.to_string(),
        permanent,
        producer_broken,
        topic_wide,
        of_the_event,
        topic: None,
    }
}

/// What a CreateTopics refusal of `topic` means. A refusal of this topic alone (InvalidTopic: a name Kafka
/// does not allow, or one that collides with an existing topic's once '.' and '_' are taken for one;
/// PolicyViolation: the broker's topic policy) is refused alike for every event bound there and for no
/// other: a topic-wide, permanent [`Rejection`], which the pipelines retry and dead-letter like a topic the
/// producer refuses. What every new topic would meet (partitions, replication factor, missing rights) stops
/// outboxd for a person to fix; anything else (timeouts, a controller moving) is retried.
fn creation_refused(topic: &str, code: RDKafkaErrorCode) -> PublishError {
    match code {
        RDKafkaErrorCode::InvalidTopic | RDKafkaErrorCode::PolicyViolation => {
            PublishError::Rejected(Rejection {
                reason: format!(
                    "Kafka refuses to create topic {topic}: {code}; a name Kafka does not allow, or one that collides with an existing topic's ('.' and '_' count as one), or one the broker's topic policy refuses: fix the topic template (--topic), the aggregate type, or the topic it collides with"
                ),
                permanent: true,
                producer_broken: false,
                topic_wide: true,
                of_the_event: false,
                topic: Some(topic.to_string()),
            })
        }
        _ => PublishError::Failed(Error::Kafka {
            message: format!("cannot create topic {topic}: {code}"),
            transient: !matches!(
                code,
                RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::ClusterAuthorizationFailed
                    | RDKafkaErrorCode::InvalidReplicationFactor
                    | RDKafkaErrorCode::InvalidPartitions
            ),
        }),
    }
}

/// The topic no longer exists (deleted while outboxd runs): it is forgotten, so that the next event bound for
/// it creates it again (or, with --no-create-topics, stops outboxd naming it).
fn topic_gone(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::UnknownPartition
                | RDKafkaErrorCode::UnknownTopic
                | RDKafkaErrorCode::UnknownTopicOrPartition
        )
    )
}

/// The producer's context: reports each delivery on the channel and watches librdkafka's log.
pub struct DeliveryContext<T> {
    deliveries: UnboundedSender<Delivery<T>>,
    /// Exactly-once: acknowledgements wait here until their Kafka transaction commits (see
    /// `transaction`); failures are reported at once.
    held: Option<Mutex<transaction::Held<T>>>,
    known_topics: KnownTopics,
    /// librdkafka took messages as delivered because a later batch of their partition was (see
    /// [`IMPLICIT_ACK`]): from then on this producer's acknowledgements are not trusted.
    implicit_ack_seen: Arc<AtomicBool>,
    /// Taken out of librdkafka's messages.
    secrets: secrets::SecretValues,
}

/// librdkafka's log facility for messages it reports delivered without an answer for their own batch,
/// because a later batch of the partition succeeded ("implicitly acked by subsequent batch success"). A
/// broker that holds no state for the producer id accepts a later batch after an earlier one failed, so
/// such messages may never have been written. With one request in flight per broker this should not happen
/// (see [`enforce_delivery_guarantees`]); should it still, every acknowledgement the producer reports from
/// then on is turned into a failure, so the events are sent again by a new producer: duplicates, not loss.
const IMPLICIT_ACK: &str = "IMPLICITACK";
/// How long, after creating a topic, outboxd asks for its partitions' leaders (see
/// `Publisher::learn_leaders_soon`).
const NEW_TOPIC_LEADERS_WAIT: Duration = Duration::from_secs(2);

const IMPLICIT_ACK_REASON: &str = "librdkafka took events as delivered because a later batch of their partition was (\"implicitly acked\"): this producer's acknowledgements are no longer trusted; sending again with a new producer";

impl<T> DeliveryContext<T> {
    /// What a delivery report means once [`IMPLICIT_ACK`] was seen: no success is believed any more.
    fn trusted(&self, result: Result<(), Rejection>) -> Result<(), Rejection> {
        match result {
            Ok(()) if self.implicit_ack_seen.load(Ordering::SeqCst) => Err(Rejection {
                producer_broken: true,
                ..Rejection::transient(IMPLICIT_ACK_REASON.into())
            }),
            other => other,
        }
    }
}

impl<T: Send + Sync + 'static> ClientContext for DeliveryContext<T> {
    /// librdkafka's log, as rdkafka's default context writes it (secrets taken out), without the warning
    /// that `enable.gapless.guarantee` is experimental (outboxd depends on it, see [`client_config`]).
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        if fac == "CONFWARN" && log_message.contains("enable.gapless.guarantee") {
            return;
        }
        // librdkafka queues this line ahead of the reports concerned, on the queue the producer's polling
        // thread serves (rdkafka routes logs there), so `delivery` sees the flag for them.
        if fac == IMPLICIT_ACK && !self.implicit_ack_seen.swap(true, Ordering::SeqCst) {
            tracing::warn!(target: "librdkafka", detail = %self.secrets.redact(log_message), "{IMPLICIT_ACK_REASON}");
        }
        secrets::log(&self.secrets, level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        secrets::error(&self.secrets, &error, reason);
    }
}

impl<T: Send + Sync + 'static> ProducerContext for DeliveryContext<T> {
    type DeliveryOpaque = Box<Carried<T>>;

    fn delivery(&self, result: &DeliveryResult<'_>, opaque: Self::DeliveryOpaque) {
        let Carried::Event(mut delivery) = *opaque else {
            return;
        };
        if let Err((error, message)) = result {
            if topic_gone(error) {
                if let Ok(mut known) = self.known_topics.lock() {
                    known.remove(message.topic());
                }
            }
            delivery.result = Err(Rejection {
                topic: Some(message.topic().to_string()),
                ..rejection_from(error)
            });
        }
        delivery.result = self.trusted(delivery.result);
        let Some(delivery) = self.hold_until_committed(delivery) else {
            return;
        };
        // The receiver is gone only when the session ended; its events will be re-sent.
        let _ = self.deliveries.send(delivery);
    }
}

/// What travels with a record to its delivery report.
pub enum Carried<T> {
    /// An outbox event.
    Event(Delivery<T>),
    /// A progress record (its failure fails the commit, see `transaction`).
    Progress,
}

/// The topic whose metadata [`Publisher::check_brokers`] asks for; never created.
pub const PROBE_TOPIC: &str = "__outboxd_readiness_probe";

/// Topics known to exist, shared by every session of the process.
pub type KnownTopics = Arc<Mutex<HashSet<String>>>;

/// Pure: the topics an event may not go to, whatever its row says (security review L1). Topic names come from
/// rows (`{aggregate_type}`, `{event_type}`): a bug or user input writing many distinct values must not make
/// outboxd create topics without end (each with its partitions, on the brokers' controller), nor address
/// the topics of outboxd itself or of Kafka's own tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicLimits {
    /// `--max-topics`: the most distinct topics one process publishes events to.
    pub max_topics: usize,
    /// outboxd's own topics (`--dead-letter-topic`, `--progress-topic`): never an event's.
    pub reserved: Vec<String>,
}

impl TopicLimits {
    fn of<Tables>(settings: &RunSettings<Tables>) -> Self {
        let progress = settings
            .kafka
            .exactly_once
            .as_ref()
            .map(|e| &e.progress_topic);
        TopicLimits {
            max_topics: settings.kafka.max_topics,
            reserved: progress
                .into_iter()
                .chain(settings.poll.dead_letter_topic.as_ref())
                .cloned()
                .collect(),
        }
    }

    /// How many of the topics `known` to this process are events' (not outboxd's own).
    fn events_topics(&self, known: &HashSet<String>) -> usize {
        known.iter().filter(|t| !self.reserved.contains(t)).count()
    }

    /// Why an event may not go to `topic`, new to this process, which publishes events to `known` topics
    /// already; `None` when it may. Refused: outboxd's own topics, names starting with `_` (Kafka's
    /// internal topics and those of its tools: `__consumer_offsets`, `_schemas`, ...), and a new topic past
    /// `--max-topics`.
    pub fn refusal(&self, topic: &str, known: usize) -> Option<String> {
        if self.reserved.iter().any(|reserved| reserved == topic) {
            return Some(format!(
                "topic {topic} is outboxd's own (--dead-letter-topic or --progress-topic), never an event's: fix the topic template (--topic) or the row's aggregate or event type"
            ));
        }
        if topic.starts_with('_') {
            return Some(format!(
                "topic {topic} starts with '_', as Kafka's internal topics and those of its tools do (__consumer_offsets, _schemas): outboxd sends no event there; fix the topic template (--topic) or the row's aggregate or event type"
            ));
        }
        if known >= self.max_topics {
            return Some(format!(
                "topic {topic} is new, and this process publishes to {known} topics already (--max-topics {}): the rows name more distinct topics than expected (an aggregate or event type from user input?); fix the rows, or raise --max-topics",
                self.max_topics
            ));
        }
        None
    }
}

/// The Kafka producer (and admin client) that publishes outbox events and creates their topics.
pub struct Publisher<T: Send + Sync + 'static> {
    producer: ThreadedProducer<DeliveryContext<T>>,
    admin: AdminClient<secrets::RedactingContext>,
    known_topics: KnownTopics,
    create_topics: bool,
    /// Which topics events may go to, beyond what Kafka allows (`--max-topics`, reserved names).
    topic_limits: TopicLimits,
    partitions: i32,
    replication_factor: i32,
    /// Header carrying the event id: `event_id`, or `id` for Debezium-style tables.
    event_id_header: &'static str,
    /// What a record's headers and value hold (`--format`).
    format: RecordFormat,
    /// Exactly-once: the transactional producer's own settings.
    transactions: Option<transaction::Transactions>,
}

/// Makes the pipelines' Kafka producers ([`Publisher`]); its clones share the topics known to exist.
#[derive(Clone, Default)]
pub struct KafkaSinks {
    known_topics: KnownTopics,
}

impl Sinks for KafkaSinks {
    type Sink<T: Send + Sync + 'static> = Publisher<T>;

    fn sink<T: Send + Sync + 'static>(
        &self,
        settings: &RunSettings,
        deliveries: UnboundedSender<Delivery<T>>,
    ) -> Result<Publisher<T>> {
        Publisher::new(settings, self.known_topics.clone(), deliveries)
    }

    fn exactly_once_sink<T: Send + Sync + 'static>(
        &self,
        settings: &RunSettings,
        deliveries: UnboundedSender<Delivery<T>>,
        key: &ProgressKey,
    ) -> Result<Publisher<T>> {
        Publisher::transactional(settings, self.known_topics.clone(), deliveries, key)
    }

    async fn check_ready(&self, settings: &RunSettings) -> Result<()> {
        startup::check_brokers(settings, Duration::from_secs(5)).await
    }
}

/// librdkafka's default `message.timeout.ms`: how long the CDC path lets any one event wait for its
/// acknowledgement by default before it gives the whole attempt up.
pub const DEFAULT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(300);

/// How long outboxd waits for acknowledgements before it gives an attempt up: `message.timeout.ms` (or
/// `delivery.timeout.ms`) from `--kafka-option`, else `default`. librdkafka itself is never given a timeout
/// (see [`Publisher::new`]).
pub fn delivery_timeout<Tables>(settings: &RunSettings<Tables>, default: Duration) -> Duration {
    settings
        .kafka
        .options
        .iter()
        .rev()
        .find(|(key, _)| key == "message.timeout.ms" || key == "delivery.timeout.ms")
        .and_then(|(_, value)| value.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
        .unwrap_or(default)
}

/// [`Publisher::check_brokers`] through any producer (the start-up check's has a context of its own).
async fn ask_a_broker<C: ProducerContext + 'static>(
    producer: ThreadedProducer<C>,
    timeout: Duration,
) -> Result<()> {
    let result = tokio::task::spawn_blocking(move || {
        producer.client().fetch_metadata(Some(PROBE_TOPIC), timeout)
    })
    .await
    .map_err(|e| Error::Kafka {
        message: e.to_string(),
        transient: true,
    })?;
    result.map(|_| ()).map_err(|e| Error::Kafka {
        message: format!(
            "no broker answered ({e}); check --brokers and that the brokers are reachable"
        ),
        transient: true,
    })
}

/// The producer settings outboxd relies on; `--kafka-option` values are applied after them.
pub fn client_config<Tables>(settings: &RunSettings<Tables>) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &settings.kafka.brokers)
        .set("client.id", "outboxd")
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "5")
        // Topics are created through the admin API (or checked, with --no-create-topics), never as a side
        // effect of a metadata request: the broker check asks for a topic that must not come to exist.
        .set("allow.auto.create.topics", "false");
    for (key, value) in &settings.kafka.options {
        config.set(key, value);
    }
    config
}

/// The producer's configuration: [`client_config`] with the settings outboxd's delivery guarantees rest on,
/// applied after `--kafka-option` so that no option can undo them (see [`Publisher::new`]).
pub fn producer_config<Tables>(settings: &RunSettings<Tables>) -> ClientConfig {
    let mut config = client_config(settings);
    enforce_delivery_guarantees(&mut config);
    config
}

/// - `enable.gapless.guarantee` and no librdkafka `message.timeout.ms`: see [`Publisher::new`].
/// - `max.in.flight.requests.per.connection=1`: with more, a partition's next request can be sent while the
///   one before it is still unanswered. A broker that holds no state for the producer on that partition yet
///   (a new producer id, a new topic) accepts the later batch even when the earlier one failed (for example
///   with NOT_LEADER_OR_FOLLOWER right after a topic was created or a leader moved), and librdkafka then
///   reports the earlier batch delivered too ("implicitly acked by subsequent batch success"): events
///   reported delivered that Kafka never wrote. One request at a time lets the failed batch be retried
///   before anything after it is sent.
/// - librdkafka's `eos` debug messages, at debug level, reach outboxd's log callback: among them the one
///   that says acknowledgements can no longer be trusted ([`IMPLICIT_ACK`]). They are few (idempotence
///   state changes and errors, not one per message) and logged at debug.
fn enforce_delivery_guarantees(config: &mut ClientConfig) {
    let debug = match config.get("debug").map(str::trim) {
        Some(contexts)
            if contexts
                .split(',')
                .any(|c| matches!(c.trim(), "eos" | "all")) =>
        {
            contexts.to_string()
        }
        Some(contexts) if !contexts.is_empty() => format!("{contexts},eos"),
        _ => "eos".to_string(),
    };
    config
        .set("enable.gapless.guarantee", "true")
        .set("message.timeout.ms", "0")
        .set("max.in.flight.requests.per.connection", "1")
        .set("debug", debug)
        .remove("delivery.timeout.ms")
        .remove("max.in.flight")
        .set_log_level(RDKafkaLogLevel::Debug);
}

/// librdkafka's configuration errors name the property and, for some, repeat its value: the value (perhaps a
/// password, perhaps under a mistyped name) never reaches the message.
pub(crate) fn config_error(error: KafkaError) -> Error {
    let problem = match &error {
        KafkaError::ClientConfig(_, description, key, value) => {
            let description = if value.is_empty() {
                description.clone()
            } else {
                description.replace(value.as_str(), "<value not shown>")
            };
            format!("invalid Kafka client configuration, property {key:?}: {description}")
        }
        other => format!("invalid Kafka client configuration: {other}"),
    };
    Error::setup(
        problem,
        "fix or remove the --kafka-option in question (see librdkafka's CONFIGURATION.md for valid properties)",
    )
}

impl<T: Send + Sync + 'static> Publisher<T> {
    /// The producer never lets one event fail and a later one of its partition through, which would let a
    /// later event of an aggregate reach Kafka before an earlier one:
    /// - `enable.gapless.guarantee`: a batch the broker refuses (too large, not authorised) stops the
    ///   producer (a fatal error) instead of letting librdkafka reset its sequence and send what follows;
    /// - no `message.timeout.ms` (0, infinite) for librdkafka: a message timed out in its queue is skipped
    ///   and the next ones are sent, which the gap-less guarantee does not cover. outboxd keeps the timeout
    ///   itself ([`delivery_timeout`]): when it passes, it purges the whole producer and re-sends;
    /// - one request in flight per broker, so that a failed batch is never taken as delivered because a later
    ///   one was (see [`producer_config`]).
    ///
    /// Either way the caller replaces the producer and re-sends every event it did not see acknowledged,
    /// in order, so what reached Kafka is an in-order prefix followed by the re-sent events.
    /// `Tables`: the settings' tables, inspected or not (only the Kafka settings and the table style count).
    pub fn new<Tables>(
        settings: &RunSettings<Tables>,
        known_topics: KnownTopics,
        deliveries: UnboundedSender<Delivery<T>>,
    ) -> Result<Self> {
        Self::with_config(
            settings,
            producer_config(settings),
            known_topics,
            deliveries,
            None,
        )
    }

    /// A publisher whose producer is made from `config`; `transactions`: exactly-once.
    fn with_config<Tables>(
        settings: &RunSettings<Tables>,
        config: ClientConfig,
        known_topics: KnownTopics,
        deliveries: UnboundedSender<Delivery<T>>,
        transactions: Option<transaction::Transactions>,
    ) -> Result<Self> {
        let admin_config = client_config(settings);
        let admin = admin_config
            .create_with_context(secrets::RedactingContext::for_config(&admin_config))
            .map_err(config_error)?;
        let secrets = secrets::SecretValues::of_config(&config);
        let producer = config
            .create_with_context(DeliveryContext {
                deliveries,
                held: transactions.as_ref().map(|_| Mutex::default()),
                known_topics: known_topics.clone(),
                implicit_ack_seen: Arc::default(),
                secrets,
            })
            .map_err(config_error)?;
        Ok(Publisher {
            transactions,
            producer,
            admin,
            known_topics,
            create_topics: settings.kafka.create_topics,
            topic_limits: TopicLimits::of(settings),
            partitions: settings.kafka.topic_partitions,
            replication_factor: settings.kafka.topic_replication_factor.unwrap_or(-1),
            event_id_header: settings.database.style.event_id_header(),
            format: settings.kafka.format.clone(),
        })
    }

    /// Makes sure `topic` exists: created on first use, or checked when topic creation is off. A creation
    /// refused for this topic alone is a [`PublishError::Rejected`] (see [`creation_refused`]), and so is a
    /// topic an event may not go to ([`TopicLimits`]; `dead_letter`: a dead-letter record, whose topic is
    /// outboxd's own and never refused so).
    async fn ensure_topic(&self, topic: &str, dead_letter: bool) -> Result<(), PublishError> {
        let known = match self.known_topics.lock() {
            Ok(known) if known.contains(topic) => return Ok(()),
            Ok(known) => self.topic_limits.events_topics(&known),
            Err(_) => 0,
        };
        if !dead_letter {
            if let Some(reason) = self.topic_limits.refusal(topic, known) {
                return Err(PublishError::Rejected(Rejection {
                    reason,
                    permanent: true,
                    producer_broken: false,
                    topic_wide: true,
                    of_the_event: false,
                    topic: Some(topic.to_string()),
                }));
            }
        }
        if self.create_topics {
            let new_topic = NewTopic::new(
                topic,
                self.partitions,
                TopicReplication::Fixed(self.replication_factor),
            );
            let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
            let results = self
                .admin
                .create_topics([&new_topic], &options)
                .await
                .map_err(|e| {
                    PublishError::Failed(Error::Kafka {
                        message: format!("cannot create topic {topic}: {e}"),
                        transient: true,
                    })
                })?;
            for result in results {
                match result {
                    Ok(_) => {
                        tracing::info!(topic, partitions = self.partitions, "created topic");
                        self.learn_leaders_soon(topic);
                    }
                    Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                    // A principal that may write the topic but not create topics: fine if it exists.
                    Err((_, code))
                        if matches!(
                            code,
                            RDKafkaErrorCode::TopicAuthorizationFailed
                                | RDKafkaErrorCode::ClusterAuthorizationFailed
                        ) && self
                            .topic_exists(topic)
                            .await
                            .map_err(PublishError::Failed)? => {}
                    Err((_, code)) => return Err(creation_refused(topic, code)),
                }
            }
        } else if !self
            .topic_exists(topic)
            .await
            .map_err(PublishError::Failed)?
        {
            return Err(PublishError::Failed(Error::setup(
                format!("Kafka topic {topic} does not exist and --no-create-topics is set"),
                format!("create topic {topic}, or drop --no-create-topics so outboxd creates it"),
            )));
        }
        if let Ok(mut known) = self.known_topics.lock() {
            known.insert(topic.to_string());
        }
        Ok(())
    }

    /// Hands one record to librdkafka, waiting while its queue is full.
    async fn send<'a>(
        &self,
        mut record: BaseRecord<'a, [u8], [u8], Box<Carried<T>>>,
    ) -> Result<(), PublishError> {
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), returned)) => {
                    record = returned;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((error, _)) => return Err(PublishError::Rejected(rejection_from(&error))),
            }
        }
    }

    /// Asks, on a thread of its own, every 10 ms (for up to [`NEW_TOPIC_LEADERS_WAIT`]) for the metadata of a
    /// topic just created until every partition has a leader. Asked through the producer's own client, the
    /// answer also updates the producer: without it, the first records wait for librdkafka's next metadata
    /// refresh (up to a second) after the answer that showed no leader yet. Nothing waits for it: records
    /// are produced meanwhile, and past the wait the producer finds the leaders itself.
    fn learn_leaders_soon(&self, topic: &str) {
        let producer = self.producer.clone();
        let name = topic.to_string();
        tokio::task::spawn_blocking(move || {
            let deadline = std::time::Instant::now() + NEW_TOPIC_LEADERS_WAIT;
            while std::time::Instant::now() < deadline {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let led = producer
                    .client()
                    .fetch_metadata(Some(&name), left.min(Duration::from_millis(500)))
                    .is_ok_and(|metadata| {
                        metadata.topics().iter().any(|t| {
                            t.name() == name
                                && t.error().is_none()
                                && !t.partitions().is_empty()
                                && t.partitions()
                                    .iter()
                                    .all(|p| p.error().is_none() && p.leader() >= 0)
                        })
                    });
                if led {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            tracing::debug!(topic = %name, "a new topic's partitions have no leader yet; librdkafka will find them");
        });
    }

    /// Whether the brokers' metadata lists `topic` with partitions.
    async fn topic_exists(&self, topic: &str) -> Result<bool> {
        let producer = self.producer.clone();
        let name = topic.to_string();
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&name), Duration::from_secs(10))
        })
        .await
        .map_err(|e| Error::Kafka {
            message: e.to_string(),
            transient: true,
        })?
        .map_err(|e| Error::Kafka {
            message: format!("cannot read metadata of topic {topic}: {e}"),
            transient: true,
        })?;
        Ok(metadata
            .topics()
            .iter()
            .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    }
}

impl<T: Send + Sync + 'static> Sink<T> for Publisher<T> {
    /// Fails unless a broker answers a metadata request within `timeout`.
    /// Asks for the metadata of one topic that is never created (`allow.auto.create.topics=false`), which any
    /// broker answers with its broker list: proof that a broker answers, without fetching every topic of the
    /// cluster every few seconds.
    async fn check_brokers(&self, timeout: Duration) -> Result<()> {
        ask_a_broker(self.producer.clone(), timeout).await
    }

    /// Hands one event to the producer; its acknowledgement arrives later on the delivery channel, tagged
    /// with `tag`. `error` adds an `error` header (dead letters).
    async fn publish(
        &self,
        table: &OutboxTable,
        topic: &str,
        event: &OutboxEvent,
        event_id: Uuid,
        tag: T,
        error: Option<&str>,
    ) -> Result<(), PublishError> {
        self.ensure_topic(topic, error.is_some())
            .await
            .map_err(|error| match error {
                // Named for the log line and the error that stops outboxd on a table without polling columns.
                PublishError::Rejected(rejection) => PublishError::Rejected(Rejection {
                    reason: format!("event {event_id}: {}", rejection.reason),
                    ..rejection
                }),
                failed => failed,
            })?;
        let parts = self.format.parts(table, event, self.event_id_header, error);
        let mut headers = OwnedHeaders::new_with_capacity(parts.headers.len());
        for (key, value) in &parts.headers {
            headers = headers.insert(Header {
                key,
                value: Some(&value[..]),
            });
        }
        let opaque = Box::new(Carried::Event(Delivery {
            tag,
            event_id,
            bytes: event.size_bytes(),
            result: Ok(()),
        }));
        let mut record = BaseRecord::with_opaque_to(topic, opaque)
            .key(event.aggregate_id.as_bytes())
            .headers(headers);
        // No value: a tombstone (null value) for compacted topics.
        if let Some(value) = &parts.value {
            record = record.payload(&value[..]);
        }
        self.send(record).await?;
        self.producer.context().produced();
        Ok(())
    }

    /// Exactly-once: see [`Sink::begin_transactions`].
    async fn begin_transactions(&self, key: &ProgressKey) -> Result<Option<Progress>> {
        self.start_transactions(key).await
    }

    /// Exactly-once: see [`Sink::commit`].
    async fn commit(&self, progress: &Progress) -> Result<(), Rejection> {
        self.commit_transaction(progress).await
    }

    /// A fatal producer error (e.g. the idempotent producer was fenced after an outage): the producer must be
    /// replaced; every later send would fail.
    fn fatal_error(&self) -> Option<String> {
        let implicit_ack = self
            .producer
            .context()
            .implicit_ack_seen
            .load(Ordering::SeqCst);
        self.producer
            .client()
            .fatal_error()
            .map(|(code, reason)| format!("{code:?}: {reason}"))
            .or_else(|| implicit_ack.then(|| IMPLICIT_ACK_REASON.to_string()))
    }

    /// Fails every event the producer still holds (their delivery reports arrive at once, as failures):
    /// the attempt is given up and the producer must not be used again (see [`Publisher::new`]). With
    /// exactly-once the open Kafka transaction is aborted, and what it had delivered is reported failed.
    fn purge(&self) {
        self.producer
            .purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
        self.abort_in_background();
    }

    fn purge_unsent(&self) {
        // As librdkafka's own fatal-error handling: queues only, in-flight requests get their real status.
        self.producer
            .purge(rdkafka::producer::PurgeConfig::default().queue());
    }

    /// Drops whatever the producer still holds; those events are re-sent from the slot.
    fn abandon(self) {
        self.producer
            .purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_never_go_to_outboxds_own_or_underscore_topics_nor_past_the_topic_limit() {
        let limits = TopicLimits {
            max_topics: 2,
            reserved: vec!["outbox.dead".into(), "outboxd.progress".into()],
        };
        assert_eq!(limits.refusal("outbox.Order", 0), None);
        assert_eq!(limits.refusal("outbox.Order", 1), None);
        let past = limits.refusal("outbox.Order", 2).unwrap();
        assert!(past.contains("--max-topics 2"), "{past}");
        for own in ["outbox.dead", "outboxd.progress"] {
            let refused = limits.refusal(own, 0).unwrap();
            assert!(refused.contains("outboxd's own"), "{refused}");
        }
        for internal in ["__consumer_offsets", "_schemas"] {
            let refused = limits.refusal(internal, 0).unwrap();
            assert!(refused.contains("starts with '_'"), "{refused}");
        }
        let known: HashSet<String> = ["outbox.dead", "outbox.A"].map(String::from).into();
        assert_eq!(
            limits.events_topics(&known),
            1,
            "the dead-letter topic is not an event's"
        );
    }

    #[test]
    fn options_cannot_undo_the_delivery_guarantees() {
        let mut config = ClientConfig::new();
        config
            .set("enable.gapless.guarantee", "false")
            .set("message.timeout.ms", "1000")
            .set("delivery.timeout.ms", "1000")
            .set("max.in.flight", "5")
            .set("max.in.flight.requests.per.connection", "5")
            .set("linger.ms", "20");
        enforce_delivery_guarantees(&mut config);
        assert_eq!(config.get("enable.gapless.guarantee"), Some("true"));
        assert_eq!(config.get("message.timeout.ms"), Some("0"));
        assert_eq!(config.get("delivery.timeout.ms"), None);
        assert_eq!(config.get("max.in.flight"), None);
        assert_eq!(
            config.get("max.in.flight.requests.per.connection"),
            Some("1")
        );
        assert_eq!(
            config.get("linger.ms"),
            Some("20"),
            "other options are the user's"
        );
        assert_eq!(config.get("debug"), Some("eos"));
        assert!(matches!(config.log_level, RDKafkaLogLevel::Debug));
    }

    #[test]
    fn debug_contexts_of_the_user_are_kept() {
        for (user, expected) in [
            ("broker,topic", "broker,topic,eos"),
            ("eos", "eos"),
            ("all", "all"),
            ("", "eos"),
        ] {
            let mut config = ClientConfig::new();
            config.set("debug", user);
            enforce_delivery_guarantees(&mut config);
            assert_eq!(config.get("debug"), Some(expected), "debug={user}");
        }
    }

    #[test]
    fn a_creation_refused_for_the_topic_alone_is_a_topic_wide_refusal() {
        for code in [
            RDKafkaErrorCode::InvalidTopic,
            RDKafkaErrorCode::PolicyViolation,
        ] {
            let PublishError::Rejected(rejection) = creation_refused("outbox.Order.Line", code)
            else {
                panic!("{code:?} stops outboxd instead of refusing the topic's events");
            };
            assert!(
                rejection.permanent && rejection.topic_wide && !rejection.producer_broken,
                "{rejection:?}"
            );
            assert_eq!(rejection.topic.as_deref(), Some("outbox.Order.Line"));
            assert!(
                rejection.reason.contains("outbox.Order.Line"),
                "{rejection:?}"
            );
        }
        for (code, transient) in [
            (RDKafkaErrorCode::TopicAuthorizationFailed, false),
            (RDKafkaErrorCode::ClusterAuthorizationFailed, false),
            (RDKafkaErrorCode::InvalidReplicationFactor, false),
            (RDKafkaErrorCode::InvalidPartitions, false),
            (RDKafkaErrorCode::RequestTimedOut, true),
            (RDKafkaErrorCode::NotController, true),
        ] {
            match creation_refused("outbox.Order", code) {
                PublishError::Failed(error) => {
                    assert_eq!(error.is_transient(), transient, "{code:?}: {error}")
                }
                PublishError::Rejected(rejection) => {
                    panic!("{code:?} is not the topic's alone: {rejection:?}")
                }
            }
        }
    }

    #[test]
    fn no_acknowledgement_is_believed_after_an_implicit_ack() {
        let (deliveries, _receiver) = tokio::sync::mpsc::unbounded_channel::<Delivery<()>>();
        let context = DeliveryContext {
            deliveries,
            held: None,
            known_topics: KnownTopics::default(),
            implicit_ack_seen: Arc::default(),
            secrets: secrets::SecretValues::default(),
        };
        context.log(
            RDKafkaLogLevel::Debug,
            "MSGSET",
            "outbox.Order [2]: delivered",
        );
        assert_eq!(context.trusted(Ok(())), Ok(()));
        context.log(
            RDKafkaLogLevel::Debug,
            IMPLICIT_ACK,
            "outbox.Order [2] 3 message(s) implicitly acked by subsequent batch success",
        );
        let rejection = context.trusted(Ok(())).unwrap_err();
        assert!(
            rejection.producer_broken && !rejection.permanent,
            "{rejection:?}"
        );
        let refused = Rejection::transient("broker refused".into());
        assert_eq!(
            context.trusted(Err(refused.clone())),
            Err(refused),
            "failures stay as they were"
        );
    }
}
