//! The seam between the pipelines and the broker: what a pipeline hands an event to ([`Sink`]), what it
//! hears back ([`Delivery`], [`Rejection`]), and how it gets a new sink after the old one was spent
//! ([`Sinks`]). `kafka` implements it for Kafka; [`memory`] is an in-memory broker for tests, which can
//! refuse, hold, fail after acceptance and reorder delivery reports, and keep transactions.
//!
//! Owns no rule about what a delivery means for the slot or a row (that is the pipelines'), and no Kafka
//! detail (that is `kafka`'s).

pub mod memory;

use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;
use uuid::Uuid;

use crate::config::RunSettings;
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::progress::{Progress, ProgressKey};
use crate::table::OutboxTable;

/// Why the broker (or the producer) refused an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The producer's or the broker's message.
    pub reason: String,
    /// Retrying cannot fix it (too large, invalid topic, not authorized): counts toward dead-lettering.
    pub permanent: bool,
    /// The producer's idempotence state is broken (fenced, epoch or sequence lost, e.g. after an outage):
    /// only a new producer recovers.
    pub producer_broken: bool,
    /// The refusal is the topic's, not the event's (the principal may not write it): every event bound
    /// for it would be refused alike.
    pub topic_wide: bool,
    /// The broker judged the event's own bytes (too large for the topic, an invalid record): sent alone,
    /// it is refused again every time, so the polling path dead-letters it at once.
    pub of_the_event: bool,
    /// The topic of a refused delivery (set by the delivery report).
    pub topic: Option<String>,
}

impl Rejection {
    /// A failure that is neither the event's nor the topic's (a timeout, the broker unreachable).
    pub fn transient(reason: String) -> Self {
        Rejection {
            reason,
            permanent: false,
            producer_broken: false,
            topic_wide: false,
            of_the_event: false,
            topic: None,
        }
    }
}

/// Why an event could not be handed to the producer.
#[derive(Debug)]
pub enum PublishError {
    /// The producer refused this event (e.g. larger than message.max.bytes).
    Rejected(Rejection),
    /// The topic could not be created or checked.
    Failed(Error),
}

impl From<PublishError> for Error {
    fn from(error: PublishError) -> Self {
        match error {
            PublishError::Rejected(r) => Error::Kafka {
                message: r.reason,
                transient: !r.permanent,
            },
            PublishError::Failed(e) => e,
        }
    }
}

/// What travels with a record to its delivery report. `T` tells the caller which event it was.
#[derive(Debug)]
pub struct Delivery<T> {
    /// The caller's tag, telling which event it was.
    pub tag: T,
    /// The event's id.
    pub event_id: Uuid,
    /// The event's approximate size in memory, for the in-flight byte budget.
    pub bytes: usize,
    /// `Ok` once the broker acknowledged the event, or why it was not delivered.
    pub result: Result<(), Rejection>,
}

/// One producer: takes events in order and reports each one's fate, exactly once, on the channel it was
/// made with (see [`Sinks::sink`]). Within a partition (an aggregate's key) it never lets an event fail and
/// a later one through; once it failed that way it is spent and the caller makes a new one.
pub trait Sink<T>: Send + Sync {
    /// Hands one event of `table` to the producer; its report arrives later, tagged with `tag`. `error`
    /// adds an `error` header (dead letters). An `Err` means the event was not taken (no report follows).
    fn publish(
        &self,
        table: &OutboxTable,
        topic: &str,
        event: &OutboxEvent,
        event_id: Uuid,
        tag: T,
        error: Option<&str>,
    ) -> impl Future<Output = Result<(), PublishError>> + Send;

    /// Fails unless a broker answers within `timeout`.
    fn check_brokers(&self, timeout: Duration) -> impl Future<Output = Result<()>> + Send;

    /// Why the producer stopped for good (every later send would fail), if it did: it must be replaced.
    fn fatal_error(&self) -> Option<String>;

    /// Fails every event the producer still holds (their reports arrive at once, as failures): the attempt
    /// is given up, and the producer is not used again.
    fn purge(&self);

    /// Fails the events the producer holds but never sent (their reports arrive at once, as failures);
    /// what is in flight keeps its real report, since the broker may write it still. For a producer that
    /// stopped and will send nothing more.
    fn purge_unsent(&self);

    /// Drops whatever the producer still holds; its events are sent again by whoever owns them.
    fn abandon(self);

    /// Exactly-once: fences every earlier producer of the slot `key` names, and reads what the last
    /// committed broker transaction covered (`None`: nothing yet). At least once: nothing to do.
    fn begin_transactions(
        &self,
        key: &ProgressKey,
    ) -> impl Future<Output = Result<Option<Progress>>> + Send {
        let _ = key;
        async { Ok(None) }
    }

    /// Exactly-once: commits every event published since the last commit, together with `progress`;
    /// their delivery reports arrive only after the commit. An `Err`: the transaction was aborted and its
    /// events' reports arrive as failures. At least once: nothing to do.
    fn commit(&self, progress: &Progress) -> impl Future<Output = Result<(), Rejection>> + Send {
        let _ = progress;
        async { Ok(()) }
    }
}

/// Makes sinks: one per CDC session and per polling batch that spent its producer.
pub trait Sinks: Clone + Send + Sync + 'static {
    /// The sink it makes.
    type Sink<T: Send + Sync + 'static>: Sink<T>;

    /// A new producer whose reports go to `deliveries`.
    fn sink<T: Send + Sync + 'static>(
        &self,
        settings: &RunSettings,
        deliveries: UnboundedSender<Delivery<T>>,
    ) -> Result<Self::Sink<T>>;

    /// A transactional producer for `--delivery exactly-once`, fencing earlier ones of the slot `key`
    /// names (see [`Sink::begin_transactions`]).
    fn exactly_once_sink<T: Send + Sync + 'static>(
        &self,
        settings: &RunSettings,
        deliveries: UnboundedSender<Delivery<T>>,
        key: &ProgressKey,
    ) -> Result<Self::Sink<T>>;

    /// The start-up check: a broker answers and accepts outboxd's settings (credentials, TLS, options).
    fn check_ready(&self, settings: &RunSettings) -> impl Future<Output = Result<()>> + Send;
}
