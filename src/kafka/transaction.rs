//! Exactly-once delivery on the Kafka side: a transactional producer whose `transactional.id` is derived
//! from the slot and the progress topic (a new leader fences a paused old one), Kafka transactions that
//! each carry a progress record (see `progress`) to a compacted progress topic, and the read of the last
//! committed record at start-up (`read_committed`).
//!
//! Acknowledgements are held back until their Kafka transaction commits: only then does the pipeline write
//! `published_at` and confirm the slot. A failed delivery is reported at once (it will abort the
//! transaction); when the transaction aborts, what it had delivered is reported failed too, and the events
//! are sent again from the slot. Owns no rule about when to commit (the CDC session's).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::sync::mpsc::UnboundedSender;

use super::{config_error, producer_config, Carried, DeliveryContext, KnownTopics, Publisher};
use crate::config::RunSettings;
use crate::error::{Error, Result};
use crate::progress::{Progress, ProgressKey};
use crate::sink::{Delivery, PublishError, Rejection};

/// How long `init_transactions` and the read of the progress topic may take at the start of a session.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a commit (each of its [`COMMIT_TRIES`]) or an abort may take before the session gives the
/// transaction up. The session sends no status update meanwhile: the wait for the deliveries, the commits,
/// an abort and the wait for its reports (15 + 2 x 10 + 10 + 5 s) stay under `wal_sender_timeout` (60 s
/// by default).
const COMMIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long, before a commit, the delivery reports of the transaction's events may take to come in (through
/// a broker failover: a new leader, retried requests); a transaction still missing some then aborts.
const DELIVERIES_TIMEOUT: Duration = Duration::from_secs(15);
/// How long, after a commit or an abort, the delivery reports of its events may take to be served.
const REPORTS_TIMEOUT: Duration = Duration::from_secs(5);

/// The transactional producer's own settings.
pub(super) struct Transactions {
    progress_topic: String,
    /// The producer's `transactional.id` (see `ProgressKey::transactional_id`).
    transactional_id: String,
    replication_factor: i32,
    /// The progress reader's configuration: the brokers and `--kafka-option` (credentials, TLS).
    reader: ClientConfig,
}

/// Acknowledgements of the open Kafka transaction, held until it commits or aborts.
pub(super) struct Held<T> {
    /// Events handed to the producer in the open transaction.
    produced: usize,
    /// Of those, reports served so far (acknowledged ones wait in `acknowledged`).
    reported: usize,
    /// Of those, failures (passed on at once): the transaction must not commit.
    failed: usize,
    acknowledged: Vec<Delivery<T>>,
    /// The transaction was given up (released as aborted) before every report came: a success reported
    /// later is passed on as a failure, so nothing waits for it.
    given_up: Option<String>,
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Held {
            produced: 0,
            reported: 0,
            failed: 0,
            acknowledged: Vec::new(),
            given_up: None,
        }
    }
}

impl<T> DeliveryContext<T> {
    /// Exactly-once: an acknowledgement waits for its transaction's commit (`None`: held); a failure is
    /// passed on at once. At least once: passed on.
    pub(super) fn hold_until_committed(&self, delivery: Delivery<T>) -> Option<Delivery<T>> {
        let Some(held) = &self.held else {
            return Some(delivery);
        };
        let Ok(mut held) = held.lock() else {
            // Never believed before its commit: a failure (the events are sent again).
            return Some(Delivery {
                result: Err(Rejection::transient(
                    "the Kafka transaction's bookkeeping failed".into(),
                )),
                ..delivery
            });
        };
        held.reported += 1;
        if let (Ok(()), Some(why)) = (&delivery.result, &held.given_up) {
            return Some(Delivery {
                result: Err(Rejection::transient(format!(
                    "the Kafka transaction was aborted: {why}"
                ))),
                ..delivery
            });
        }
        if delivery.result.is_ok() {
            held.acknowledged.push(delivery);
            return None;
        }
        held.failed += 1;
        Some(delivery)
    }

    /// Why the open transaction must not commit, once its events were reported: one failed (librdkafka
    /// commits a transaction whose every message it took as delivered, yet outboxd may have refused one, e.g.
    /// an implicitly acked one, see `IMPLICIT_ACK`), or a report is missing. Its progress record would
    /// cover events Kafka may not hold, and the next session would mark them published.
    fn commit_refusal(&self) -> Option<String> {
        let held = self.held.as_ref()?;
        let Ok(held) = held.lock() else {
            return Some("the Kafka transaction's bookkeeping failed".into());
        };
        if held.failed > 0 {
            return Some(format!(
                "{} of its {} events were not delivered",
                held.failed, held.produced
            ));
        }
        (held.reported < held.produced).then(|| {
            format!(
                "{} of its {} events were not reported delivered in {DELIVERIES_TIMEOUT:?}",
                held.produced - held.reported,
                held.produced
            )
        })
    }

    /// One more event handed to the producer (exactly-once only).
    pub(super) fn produced(&self) {
        if let Some(Ok(mut held)) = self.held.as_ref().map(Mutex::lock) {
            held.produced += 1;
        }
    }

    /// Once every report of the transaction is in (or [`REPORTS_TIMEOUT`] passed), passes its held
    /// acknowledgements on: as they are when it committed, as failures when it aborted (`aborted`: why).
    /// Blocks: call it off the runtime.
    fn release_held(&self, aborted: Option<&str>) {
        let Some(held) = &self.held else {
            return;
        };
        let deadline = Instant::now() + REPORTS_TIMEOUT;
        let acknowledged = loop {
            let Ok(mut held) = held.lock() else {
                return;
            };
            if held.reported >= held.produced || Instant::now() > deadline {
                if held.reported < held.produced {
                    tracing::warn!(
                        missing = held.produced - held.reported,
                        "delivery reports of a finished Kafka transaction did not arrive; their events are given up with the session"
                    );
                }
                let acknowledged = std::mem::take(&mut held.acknowledged);
                let late = held.reported < held.produced;
                *held = Held::default();
                if late {
                    // Reports still to come belong to this transaction, never to the next one.
                    held.given_up = Some(
                        aborted
                            .unwrap_or("its delivery reports came too late")
                            .to_string(),
                    );
                }
                break acknowledged;
            }
            drop(held);
            std::thread::sleep(Duration::from_millis(1));
        };
        for mut delivery in acknowledged {
            if let Some(why) = aborted {
                delivery.result = Err(Rejection::transient(format!(
                    "the Kafka transaction was aborted: {why}"
                )));
            }
            let _ = self.deliveries.send(delivery);
        }
    }
}

/// The producer configuration of exactly-once: outboxd's guarantees plus the transactional id. librdkafka
/// derives the message timeout from `transaction.timeout.ms` (a message that times out aborts the whole
/// transaction, so nothing after it becomes visible).
fn transactional_config<Tables>(
    settings: &RunSettings<Tables>,
    transactional_id: &str,
) -> ClientConfig {
    let mut config = producer_config(settings);
    config
        .set("transactional.id", transactional_id)
        .remove("message.timeout.ms");
    config
}

/// Whether the brokers let outboxd's principal use Kafka transactions (`--delivery exactly-once`), tried
/// with a transactional id of its own (`outboxd-doctor-<slot>`), so that a running outboxd is never fenced.
pub async fn check_transactions(settings: &RunSettings, timeout: Duration) -> Result<()> {
    let transactional_id = format!("outboxd-doctor-{}", settings.database.slot);
    let config = transactional_config(settings, &transactional_id);
    let producer: rdkafka::producer::BaseProducer<super::secrets::RedactingContext> = config
        .create_with_context(super::secrets::RedactingContext::for_config(&config))
        .map_err(config_error)?;
    tokio::task::spawn_blocking(move || producer.init_transactions(timeout))
        .await
        .map_err(|e| Error::bug(format!("the transactions check failed: {e}")))?
        .map_err(|error| start_error("initialising Kafka transactions", error, &transactional_id))
}

/// The progress reader's configuration: the brokers and the user's options (credentials, TLS); producer
/// properties among them are ignored by librdkafka (with a warning).
fn reader_config(settings: &RunSettings) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &settings.kafka.brokers);
    for (key, value) in &settings.kafka.options {
        config.set(key, value);
    }
    config
}

/// What a failed transactional call means for the session.
fn transaction_rejection(error: &KafkaError) -> Rejection {
    if matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::TransactionalIdAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
        )
    ) {
        return Rejection {
            permanent: true,
            ..Rejection::transient(format!(
                "the broker refuses outboxd's Kafka transaction ({error}): grant the principal WRITE on the progress topic (--progress-topic) and on the outbox topics, and WRITE and DESCRIBE on its TransactionalId (outboxd-<system id>-<slot>, with -<progress topic> when --progress-topic is not the default)"
            ))
        };
    }
    let fenced = matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::Fenced
                | RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
        )
    );
    let reason = if fenced {
        format!("{error}: another outboxd instance took over this slot's Kafka transactions (this one was fenced); stepping down")
    } else {
        error.to_string()
    };
    Rejection {
        producer_broken: true,
        ..Rejection::transient(reason)
    }
}

/// The start-up error of a transactional call, naming the fix where a person must act.
fn start_error(what: &str, error: KafkaError, transactional_id: &str) -> Error {
    match error.rdkafka_error_code() {
        Some(RDKafkaErrorCode::TransactionalIdAuthorizationFailed) => Error::setup(
            format!("the broker does not let outboxd use transactional id {transactional_id} ({error})"),
            format!("grant the principal WRITE and DESCRIBE on TransactionalId {transactional_id} (or a prefixed ACL on outboxd-), or drop --delivery exactly-once"),
        ),
        Some(RDKafkaErrorCode::InvalidTransactionTimeout) => Error::setup(
            format!("the broker refuses the transaction timeout ({error})"),
            "set --kafka-option transaction.timeout.ms to at most the broker's transaction.max.timeout.ms (15 minutes by default)",
        ),
        _ => Error::Kafka {
            message: format!("{what}: {error}"),
            transient: true,
        },
    }
}

impl<T: Send + Sync + 'static> Publisher<T> {
    /// A transactional publisher for the slot `key` names (see the module doc).
    pub(super) fn transactional(
        settings: &RunSettings,
        known_topics: KnownTopics,
        deliveries: UnboundedSender<Delivery<T>>,
        key: &ProgressKey,
    ) -> Result<Self> {
        let Some(exactly_once) = &settings.kafka.exactly_once else {
            return Err(Error::bug(
                "a transactional producer was asked for without --delivery exactly-once",
            ));
        };
        let transactional_id = key.transactional_id(&exactly_once.progress_topic);
        Self::with_config(
            settings,
            transactional_config(settings, &transactional_id),
            known_topics,
            deliveries,
            Some(Transactions {
                progress_topic: exactly_once.progress_topic.clone(),
                transactional_id,
                replication_factor: settings.kafka.topic_replication_factor.unwrap_or(-1),
                reader: reader_config(settings),
            }),
        )
    }

    /// Fences every earlier producer of the slot (their open transaction is aborted, or completed when
    /// its commit had begun), reads what the last committed transaction covered, and begins one.
    pub(super) async fn start_transactions(&self, key: &ProgressKey) -> Result<Option<Progress>> {
        let Some(transactions) = &self.transactions else {
            return Ok(None);
        };
        let producer = self.producer.clone();
        blocking(move || producer.init_transactions(START_TIMEOUT))
            .await?
            .map_err(|e| {
                start_error(
                    "cannot initialise Kafka transactions",
                    e,
                    &transactions.transactional_id,
                )
            })?;
        self.ensure_progress_topic(transactions).await?;
        let config = transactions.reader.clone();
        let (topic, record_key) = (transactions.progress_topic.clone(), key.record_key());
        let value = blocking(move || read_last(config, &topic, &record_key)).await??;
        let progress = match value {
            None => None,
            Some(value) => match Progress::decode(&value, key) {
                Ok(progress) => Some(progress),
                Err(why) => {
                    tracing::warn!(%why, topic = %transactions.progress_topic, "ignoring the last progress record: events it covered may be published again");
                    None
                }
            },
        };
        let producer = self.producer.clone();
        blocking(move || producer.begin_transaction())
            .await?
            .map_err(|e| {
                start_error(
                    "cannot begin a Kafka transaction",
                    e,
                    &transactions.transactional_id,
                )
            })?;
        Ok(progress)
    }

    /// Commits the open transaction with `progress` as its progress record, then begins the next one;
    /// the transaction's acknowledgements are passed on once it committed. On failure it is aborted and
    /// they are passed on as failures.
    pub(super) async fn commit_transaction(&self, progress: &Progress) -> Result<(), Rejection> {
        let Some(transactions) = &self.transactions else {
            return Ok(());
        };
        let (key, value) = (progress.key.record_key(), progress.encode());
        let record = BaseRecord::with_opaque_to(
            transactions.progress_topic.as_str(),
            Box::new(Carried::Progress),
        )
        .partition(0)
        .key(key.as_bytes())
        .payload(&value[..]);
        if let Err(error) = self.send(record).await {
            let rejection = match error {
                PublishError::Rejected(rejection) => rejection,
                PublishError::Failed(error) => Rejection::transient(error.to_string()),
            };
            self.abort(&rejection.reason).await;
            return Err(rejection);
        }
        let producer = self.producer.clone();
        let started = Instant::now();
        let committed = blocking(move || {
            // commit_transaction flushes first, polling the report queue alongside the producer's own
            // polling thread: when that thread takes the last report, the flush sleeps out its poll
            // timeout (~100 ms a commit). Waiting here, 1 ms at a time, leaves it nothing to flush, and
            // every report is in before deciding whether to commit at all.
            let deadline = Instant::now() + DELIVERIES_TIMEOUT;
            while producer.in_flight_count() > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if let Some(why) = producer.context().commit_refusal() {
                return Err(CommitFailed::Refused(why));
            }
            commit_until_definite(&producer).map_err(CommitFailed::Kafka)
        })
        .await
        .map_err(|e| Rejection::transient(e.to_string()))?;
        match committed {
            Ok(()) => {
                let commit_took = started.elapsed();
                let producer = self.producer.clone();
                let begun = blocking(move || {
                    producer.context().release_held(None);
                    producer.begin_transaction()
                })
                .await
                .map_err(|e| Rejection::transient(e.to_string()))?
                .map_err(|e| transaction_rejection(&e));
                tracing::debug!(?commit_took, reports_and_begin_took = ?(started.elapsed() - commit_took), "committed a Kafka transaction");
                begun
            }
            Err(failed) => {
                let rejection = match failed {
                    CommitFailed::Kafka(error) => transaction_rejection(&error),
                    CommitFailed::Refused(why) => Rejection {
                        producer_broken: true,
                        ..Rejection::transient(why)
                    },
                };
                tracing::warn!(error = %rejection.reason, "a Kafka transaction did not commit; aborting it (its events are sent again from the slot)");
                self.abort(&rejection.reason).await;
                Err(rejection)
            }
        }
    }

    /// Aborts the open transaction and reports what it had delivered as failed.
    async fn abort(&self, why: &str) {
        let producer = self.producer.clone();
        let why = why.to_string();
        let _ = blocking(move || abort_and_release(&producer, &why)).await;
    }

    /// [`Publisher::abort`] from a synchronous caller (a purge): on a thread of its own.
    pub(super) fn abort_in_background(&self) {
        if self.transactions.is_none() {
            return;
        }
        let producer = self.producer.clone();
        std::thread::spawn(move || {
            abort_and_release(&producer, "the session gave its deliveries up")
        });
    }

    async fn ensure_progress_topic(&self, transactions: &Transactions) -> Result<()> {
        let topic = NewTopic::new(
            &transactions.progress_topic,
            1,
            TopicReplication::Fixed(transactions.replication_factor),
        )
        .set("cleanup.policy", "compact")
        .set("segment.ms", "3600000")
        .set("min.cleanable.dirty.ratio", "0.1");
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let results = self
            .admin
            .create_topics([&topic], &options)
            .await
            .map_err(|e| Error::Kafka {
                message: format!(
                    "cannot create progress topic {}: {e}",
                    transactions.progress_topic
                ),
                transient: true,
            })?;
        for result in results {
            match result {
                Ok(_) => {
                    tracing::info!(topic = %transactions.progress_topic, "created progress topic")
                }
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                // A principal that may not create topics: fine if it exists (the read below says so).
                Err((_, RDKafkaErrorCode::TopicAuthorizationFailed))
                | Err((_, RDKafkaErrorCode::ClusterAuthorizationFailed)) => {}
                Err((_, code)) => {
                    return Err(Error::Kafka {
                        message: format!(
                            "cannot create progress topic {}: {code}",
                            transactions.progress_topic
                        ),
                        transient: true,
                    })
                }
            }
        }
        Ok(())
    }
}

/// Why a transaction did not commit: outboxd would not ask (see `DeliveryContext::commit_refusal`), or
/// Kafka said no.
enum CommitFailed {
    Refused(String),
    Kafka(KafkaError),
}

/// How many times a commit that timed out is asked again: librdkafka's answer to a retriable error is the
/// same call again (the commit may be under way, and an abort meanwhile is refused as a conflicting call,
/// leaving the transaction open until the broker times it out).
const COMMIT_TRIES: u32 = 2;

/// `commit_transaction`, asked again while its error is retriable (up to [`COMMIT_TRIES`] times), so
/// that the answer is a definite commit or a failure an abort resolves.
fn commit_until_definite<T: Send + Sync + 'static>(
    producer: &rdkafka::producer::ThreadedProducer<DeliveryContext<T>>,
) -> Result<(), KafkaError> {
    let mut tries = 1;
    loop {
        match producer.commit_transaction(COMMIT_TIMEOUT) {
            Err(KafkaError::Transaction(error)) if error.is_retriable() && tries < COMMIT_TRIES => {
                tracing::debug!(%error, "the Kafka commit did not finish yet; asking again");
                tries += 1;
            }
            other => return other,
        }
    }
}

fn abort_and_release<T: Send + Sync + 'static>(
    producer: &rdkafka::producer::ThreadedProducer<DeliveryContext<T>>,
    why: &str,
) {
    if let Err(error) = producer.abort_transaction(COMMIT_TIMEOUT) {
        tracing::debug!(%error, "aborting the Kafka transaction failed (the next producer's init aborts it)");
    }
    producer.context().release_held(Some(why));
}

/// Runs `work` on the blocking pool.
async fn blocking<R: Send + 'static>(work: impl FnOnce() -> R + Send + 'static) -> Result<R> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Kafka {
            message: e.to_string(),
            transient: true,
        })
}

/// The value of the last committed record with `key` in partition 0 of `topic`, read `read_committed`:
/// from the end backwards in growing spans (compaction keeps the topic short, but not at once). `None`
/// when there is none, or the last is a tombstone (the record deleted by hand: start over at least once).
///
/// Where the read ends: a `read_committed` reader sees records only up to the last stable offset, the
/// first record of the oldest transaction still open on the topic (any writer's: the progress topic is
/// shared by every slot). Records of `key` past it (read `read_uncommitted`, up to the high watermark) were
/// written by this slot's own, now fenced, producers and may have been committed: then the read waits for
/// the open transactions to end (up to [`START_TIMEOUT`]) rather than take an older record for the last.
/// Without any, the last stable offset is the end.
fn read_last(mut config: ClientConfig, topic: &str, key: &str) -> Result<Option<Vec<u8>>> {
    let unreadable = |error| unreadable(topic, error);
    config
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .set("group.id", "outboxd-progress-reader");
    let deadline = Instant::now() + START_TIMEOUT;
    let context = super::secrets::RedactingContext::for_config(&config);
    let uncommitted: BaseConsumer<_> = config
        .clone()
        .set("isolation.level", "read_uncommitted")
        .create_with_context(context.clone())
        .map_err(config_error)?;
    let (low, high) = watermarks(&uncommitted, topic).map_err(unreadable)?;
    let consumer: BaseConsumer<_> = config
        .set("isolation.level", "read_committed")
        .create_with_context(context)
        .map_err(config_error)?;
    let (_, stable) = watermarks(&consumer, topic).map_err(unreadable)?;
    let mut pending_own = false;
    if stable < high {
        scan(&uncommitted, topic, key, (stable, high), deadline, |_| {
            pending_own = true
        })?;
    }
    drop(uncommitted);
    let end = if pending_own { high } else { stable };
    let mut span = 1_000;
    loop {
        let start = (end - span).max(low);
        // The last record of the key in the span: `Some(None)` for a tombstone (the record deleted).
        let mut last = None;
        scan(&consumer, topic, key, (start, end), deadline, |value| {
            last = Some(value.map(<[u8]>::to_vec))
        })
        .map_err(|error| match error {
            Error::Kafka { message, transient } if end > stable => Error::Kafka {
                message: format!("{message}; a transaction left open on the topic holds this slot's newest progress record back (last stable offset {stable}, high watermark {high}): it ends with its writer's transaction.timeout.ms; a hanging one is found and aborted with kafka-transactions.sh find-hanging / abort"),
                transient,
            },
            other => other,
        })?;
        if let Some(value) = last {
            return Ok(value);
        }
        if start == low {
            return Ok(None);
        }
        span *= 8;
    }
}

/// Reads partition 0 of `topic` from `start` to `end` (exclusive) with `consumer`, passing the value of
/// every record of `key` to `each` (`None`: a tombstone); fails at `deadline` short of `end` (a record
/// short of the end could be an older one: no answer rather than a wrong one).
fn scan(
    consumer: &BaseConsumer<super::secrets::RedactingContext>,
    topic: &str,
    key: &str,
    (start, end): (i64, i64),
    deadline: Instant,
    mut each: impl FnMut(Option<&[u8]>),
) -> Result<()> {
    let unreadable = |error| unreadable(topic, error);
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(topic, 0, Offset::Offset(start))
        .map_err(unreadable)?;
    consumer.assign(&assignment).map_err(unreadable)?;
    loop {
        let position = consumer
            .position()
            .ok()
            .and_then(|list| match list.find_partition(topic, 0)?.offset() {
                Offset::Offset(offset) => Some(offset),
                _ => None,
            })
            .unwrap_or(start);
        if position >= end {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Kafka {
                message: format!("progress topic {topic} could not be read to its end within {START_TIMEOUT:?} (at offset {position} of {end})"),
                transient: true,
            });
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(message)) if message.key() == Some(key.as_bytes()) => each(message.payload()),
            Some(Ok(_)) => {}
            Some(Err(error)) => return Err(unreadable(error)),
            None => {}
        }
    }
}

/// A failed read of the progress topic: transient (the session retries).
fn unreadable(topic: &str, error: KafkaError) -> Error {
    Error::Kafka {
        message: format!("cannot read progress topic {topic}: {error}"),
        transient: true,
    }
}

/// Partition 0's low and high watermarks, as `consumer`'s isolation level counts them. A topic created a
/// moment ago may have no leader yet: asked again until it answers.
fn watermarks(
    consumer: &BaseConsumer<super::secrets::RedactingContext>,
    topic: &str,
) -> Result<(i64, i64), KafkaError> {
    let asked_until = Instant::now() + START_TIMEOUT;
    loop {
        match consumer.fetch_watermarks(topic, 0, Duration::from_secs(2)) {
            Ok(watermarks) => return Ok(watermarks),
            Err(error) if Instant::now() > asked_until => return Err(error),
            Err(error) => {
                tracing::debug!(%error, topic, "progress topic not readable yet");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use rdkafka::client::ClientContext;
    use rdkafka::config::RDKafkaLogLevel;

    use super::super::{secrets, DeliveryContext, KnownTopics, IMPLICIT_ACK};
    use crate::sink::{Delivery, Rejection};

    fn held_context() -> (
        DeliveryContext<u32>,
        tokio::sync::mpsc::UnboundedReceiver<Delivery<u32>>,
    ) {
        let (deliveries, receiver) = tokio::sync::mpsc::unbounded_channel();
        let context = DeliveryContext {
            deliveries,
            held: Some(Mutex::default()),
            known_topics: KnownTopics::default(),
            implicit_ack_seen: Arc::default(),
            secrets: secrets::SecretValues::default(),
        };
        (context, receiver)
    }

    fn delivered(tag: u32, result: Result<(), Rejection>) -> Delivery<u32> {
        Delivery {
            tag,
            event_id: uuid::Uuid::nil(),
            bytes: 1,
            result,
        }
    }

    /// librdkafka commits a transaction whose every message it took as delivered; outboxd refuses an
    /// implicitly acked one (and any failed one): that transaction must not commit, or its progress record
    /// covers an event Kafka may not hold and the next session marks it published.
    #[test]
    fn a_transaction_with_a_refused_or_unreported_delivery_is_not_committed() {
        let (context, _receiver) = held_context();
        context.produced();
        context.produced();
        assert!(context.hold_until_committed(delivered(1, Ok(()))).is_none());
        let refusal = context.commit_refusal();
        assert!(
            refusal
                .as_deref()
                .is_some_and(|why| why.contains("not reported")),
            "{refusal:?}"
        );
        context.log(
            RDKafkaLogLevel::Debug,
            IMPLICIT_ACK,
            "outbox.Order [2] 1 message(s) implicitly acked by subsequent batch success",
        );
        let passed_on = context.hold_until_committed(delivered(2, context.trusted(Ok(()))));
        assert!(passed_on.is_some_and(|d| d.result.is_err()));
        let refusal = context.commit_refusal();
        assert!(
            refusal
                .as_deref()
                .is_some_and(|why| why.contains("1 of its 2 events were not delivered")),
            "{refusal:?}"
        );

        let (context, _receiver) = held_context();
        context.produced();
        assert!(context.hold_until_committed(delivered(1, Ok(()))).is_none());
        assert_eq!(context.commit_refusal(), None);
    }

    /// A report that comes after its transaction was given up is a failure, passed on at once: never an
    /// acknowledgement held for the next transaction, which would wait for it forever.
    #[test]
    fn a_report_after_its_transaction_was_given_up_is_passed_on_as_a_failure() {
        let (context, mut receiver) = held_context();
        context.produced();
        context.produced();
        assert!(context.hold_until_committed(delivered(1, Ok(()))).is_none());
        // Waits out REPORTS_TIMEOUT for the second report.
        context.release_held(Some("the commit timed out"));
        let first = receiver.try_recv().expect("the held acknowledgement");
        assert!(first.result.is_err(), "{:?}", first.result);
        let late = context
            .hold_until_committed(delivered(2, Ok(())))
            .expect("passed on at once");
        assert!(
            late.result
                .as_ref()
                .is_err_and(|e| e.reason.contains("the commit timed out")),
            "{:?}",
            late.result
        );
    }
}
