//! An in-memory broker for tests and fault injection: every sink it makes writes to one log, in an order a
//! Kafka partition could keep (each sink's accepted events in send order, nothing after a failure of the
//! same sink; what several sinks hold at once is written sink by sink, oldest sink first, as two producers'
//! requests may arrive in any order), and its faults are set by the test: refuse an event at hand-over, accept it and fail its
//! delivery, hold delivery reports (a slow or unreachable broker) and release them in any order, slow every
//! hand-over down.
//!
//! Its exactly-once sinks keep Kafka's transactional contract in small: what a transaction delivered
//! reaches the log, and its reports the pipeline, only when it commits (with its progress record, the
//! last of which `begin_transactions` returns); a failed delivery is reported at once; a commit fails
//! (and aborts) when the test says, when the transaction stayed open longer than
//! `transaction.timeout.ms`, or when a later sink of the same slot fenced it.
//!
//! Not a Kafka emulation: no partitions or offsets; enough to drive the pipelines' rules without a
//! broker. The integration tests against Apache Kafka stay for the real thing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;
use uuid::Uuid;

use super::{Delivery, PublishError, Rejection, Sink, Sinks};
use crate::config::RunSettings;
use crate::error::{Error, Result};
use crate::event::OutboxEvent;
use crate::progress::{Progress, ProgressKey};
use crate::table::OutboxTable;

/// A record the broker wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its topic.
    pub topic: String,
    /// Its key: the event's aggregate id.
    pub key: String,
    /// The event's id.
    pub event_id: Uuid,
    /// The `error` header (dead letters).
    pub error: Option<String>,
    /// Its value (`None`: a tombstone).
    pub payload: Option<Vec<u8>>,
}

/// What goes wrong for an event that a fault rule matches.
#[derive(Debug, Clone)]
pub enum Fault {
    /// The producer refuses it at hand-over (as librdkafka refuses a record larger than message.max.bytes).
    RefuseAtHandOver(Rejection),
    /// The producer takes it and its delivery report is this failure; it is not written, and the sink is
    /// spent: every later event it holds fails too (the gap-less guarantee).
    FailAfterAcceptance(Rejection),
}

/// In what order held delivery reports are released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// As the events were sent.
    InOrder,
    /// Last sent first.
    Reversed,
    /// Interleaved: every second report first (0, 2, 4, …, then 1, 3, 5, …), per sink.
    Interleaved,
}

type Matcher = Box<dyn Fn(&str, &OutboxEvent) -> bool + Send + Sync>;

struct FaultRule {
    matches: Matcher,
    fault: Fault,
    /// How many more events it applies to.
    times: usize,
}

#[derive(Default)]
struct BrokerState {
    log: Vec<Record>,
    faults: Vec<FaultRule>,
    holding: bool,
    down: bool,
    sinks: Vec<Weak<dyn Flush>>,
    sinks_made: usize,
    refused_at_hand_over: usize,
    failed_after_acceptance: usize,
    /// How long every hand-over takes (a slow producer or broker).
    publish_delay: Option<Duration>,
    /// The last committed progress record of each slot, by record key.
    progress: HashMap<String, Progress>,
    /// Exactly-once sinks by slot: each one's fenced flag, set when a later one begins.
    transactional: Vec<(String, Arc<AtomicBool>)>,
    /// The next commits fail with these (how many more each).
    commit_faults: Vec<(Rejection, usize)>,
    commits: usize,
    aborts: usize,
}

/// The broker every sink it makes writes to; clones share it.
#[derive(Clone, Default)]
pub struct MemoryBroker {
    state: Arc<Mutex<BrokerState>>,
}

impl MemoryBroker {
    /// A broker that writes every event at once and reports it delivered.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, BrokerState> {
        // A test that panicked while holding the lock fails anyway; its state is still readable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The next `times` events that `matches` (topic, event) meet `fault`.
    pub fn add_fault(
        &self,
        fault: Fault,
        times: usize,
        matches: impl Fn(&str, &OutboxEvent) -> bool + Send + Sync + 'static,
    ) {
        self.lock().faults.push(FaultRule {
            matches: Box::new(matches),
            fault,
            times,
        });
    }

    /// While set, accepted events wait: nothing is written or reported until [`MemoryBroker::release`].
    pub fn hold_reports(&self, hold: bool) {
        let mut state = self.lock();
        state.holding = hold;
        if !hold && !state.down {
            flush_all(&mut state, Release::InOrder, None);
        }
    }

    /// Writes what every sink holds, in send order, and sends the reports in `order`.
    pub fn release(&self, order: Release) {
        flush_all(&mut self.lock(), order, None);
    }

    /// [`MemoryBroker::release`] for the events of one key only (another partition's reports may come
    /// first); the others keep waiting.
    pub fn release_key(&self, key: &str) {
        flush_all(&mut self.lock(), Release::InOrder, Some(key));
    }

    /// Unreachable: accepted events wait (as with [`MemoryBroker::hold_reports`]) and `check_brokers`
    /// fails; back up, what waits is written and reported in order.
    pub fn set_down(&self, down: bool) {
        let mut state = self.lock();
        state.down = down;
        if !down && !state.holding {
            flush_all(&mut state, Release::InOrder, None);
        }
    }

    /// Every hand-over takes `delay` from now on (`None`: none).
    pub fn set_publish_delay(&self, delay: Option<Duration>) {
        self.lock().publish_delay = delay;
    }

    /// The next `times` commits of exactly-once sinks fail with `rejection` (their transactions abort).
    pub fn fail_commits(&self, rejection: Rejection, times: usize) {
        self.lock().commit_faults.push((rejection, times));
    }

    /// Commits and aborts of exactly-once sinks so far.
    pub fn transactions(&self) -> (usize, usize) {
        let state = self.lock();
        (state.commits, state.aborts)
    }

    /// Every record written so far, in write order.
    pub fn records(&self) -> Vec<Record> {
        self.lock().log.clone()
    }

    /// Events accepted and not yet written or failed.
    pub fn held(&self) -> usize {
        let state = self.lock();
        state
            .sinks
            .iter()
            .filter_map(Weak::upgrade)
            .map(|sink| sink.held())
            .sum()
    }

    /// How many sinks (producers) were made.
    pub fn sinks_made(&self) -> usize {
        self.lock().sinks_made
    }

    /// How many faults struck: refusals at hand-over, failures after acceptance.
    pub fn faults_struck(&self) -> (usize, usize) {
        let state = self.lock();
        (state.refused_at_hand_over, state.failed_after_acceptance)
    }
}

fn flush_all(state: &mut BrokerState, order: Release, key: Option<&str>) {
    state.sinks.retain(|sink| sink.strong_count() > 0);
    let sinks: Vec<Arc<dyn Flush>> = state.sinks.iter().filter_map(Weak::upgrade).collect();
    for sink in sinks {
        sink.flush(&mut state.log, order, key);
    }
}

/// What the broker needs of a sink whatever its tag type.
trait Flush: Send + Sync {
    /// Writes (or fails) what it holds of `key` (`None`: everything), in send order.
    fn flush(&self, log: &mut Vec<Record>, order: Release, key: Option<&str>);
    fn held(&self) -> usize;
}

struct Accepted<T> {
    delivery: Delivery<T>,
    record: Record,
    fails: Option<Rejection>,
}

struct SinkState<T> {
    deliveries: UnboundedSender<Delivery<T>>,
    accepted: Vec<Accepted<T>>,
    /// Why the sink is spent, once a delivery failed.
    spent: Option<String>,
    /// An exactly-once sink's open transaction; `None`: at least once.
    transaction: Option<OpenTransaction<T>>,
}

/// What an exactly-once sink's open transaction delivered: written and reported when it commits.
struct OpenTransaction<T> {
    /// `transaction.timeout.ms`: a commit after the transaction was open this long fails.
    timeout: Duration,
    /// When the open transaction took its first event.
    opened_at: Option<Instant>,
    written: Vec<Record>,
    reports: Vec<Delivery<T>>,
    /// Set when a later sink of the same slot began its transactions.
    fenced: Arc<AtomicBool>,
}

impl<T> OpenTransaction<T> {
    fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::SeqCst)
    }
}

impl<T: Send> Flush for Mutex<SinkState<T>> {
    fn flush(&self, log: &mut Vec<Record>, order: Release, key: Option<&str>) {
        let mut state = self.lock().unwrap_or_else(|p| p.into_inner());
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut state.accepted)
            .into_iter()
            .partition(|a| key.is_none_or(|key| a.record.key == key));
        state.accepted = waiting;
        let mut reports = Vec::with_capacity(due.len());
        for accepted in due {
            let Accepted {
                mut delivery,
                record,
                fails,
            } = accepted;
            delivery.result = match (&state.spent, fails) {
                (Some(spent), _) => Err(Rejection::transient(format!(
                    "the producer stopped after an earlier failure: {spent}"
                ))),
                (None, Some(rejection)) => {
                    state.spent = Some(rejection.reason.clone());
                    Err(rejection)
                }
                (None, None) => {
                    match &mut state.transaction {
                        Some(open) => open.written.push(record.clone()),
                        None => log.push(record.clone()),
                    }
                    Ok(())
                }
            };
            if let Err(rejection) = &mut delivery.result {
                rejection.topic = Some(record.topic);
            }
            match &mut state.transaction {
                // Held until the commit; failures are reported at once (they abort the transaction).
                Some(open) if delivery.result.is_ok() => open.reports.push(delivery),
                _ => reports.push(delivery),
            }
        }
        let reports = match order {
            Release::InOrder => reports,
            Release::Reversed => reports.into_iter().rev().collect(),
            Release::Interleaved => {
                let (even, odd): (Vec<_>, Vec<_>) = reports
                    .into_iter()
                    .enumerate()
                    .partition(|(i, _)| i % 2 == 0);
                even.into_iter().chain(odd).map(|(_, d)| d).collect()
            }
        };
        for report in reports {
            // The receiver is gone only when its session ended.
            let _ = state.deliveries.send(report);
        }
    }

    fn held(&self) -> usize {
        self.lock()
            .map(|s| s.accepted.len() + s.transaction.as_ref().map_or(0, |t| t.reports.len()))
            .unwrap_or(0)
    }
}

/// A producer of a [`MemoryBroker`].
pub struct MemorySink<T> {
    broker: MemoryBroker,
    state: Arc<Mutex<SinkState<T>>>,
}

impl<T> MemorySink<T> {
    fn state(&self) -> MutexGuard<'_, SinkState<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails what it holds, reporting at once.
    fn fail_held(&self, reason: &str) {
        let mut state = self.state();
        for accepted in std::mem::take(&mut state.accepted) {
            let mut delivery = accepted.delivery;
            delivery.result = Err(Rejection {
                topic: Some(accepted.record.topic),
                ..Rejection::transient(reason.to_string())
            });
            let _ = state.deliveries.send(delivery);
        }
        abort_open_transaction(&mut state, reason);
        state.spent.get_or_insert_with(|| reason.to_string());
    }
}

/// Drops what the open transaction wrote and reports its deliveries failed.
fn abort_open_transaction<T>(state: &mut SinkState<T>, reason: &str) {
    let Some(open) = &mut state.transaction else {
        return;
    };
    open.written.clear();
    open.opened_at = None;
    for mut delivery in std::mem::take(&mut open.reports) {
        delivery.result = Err(Rejection::transient(format!(
            "the transaction aborted: {reason}"
        )));
        let _ = state.deliveries.send(delivery);
    }
}

impl<T: Send + Sync + 'static> Sink<T> for MemorySink<T> {
    async fn publish(
        &self,
        _table: &OutboxTable,
        topic: &str,
        event: &OutboxEvent,
        event_id: Uuid,
        tag: T,
        error: Option<&str>,
    ) -> Result<(), PublishError> {
        let delay = self.broker.lock().publish_delay;
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        let mut broker = self.broker.lock();
        let mut fails = None;
        if let Some(rule) = broker
            .faults
            .iter_mut()
            .find(|rule| rule.times > 0 && (rule.matches)(topic, event))
        {
            rule.times -= 1;
            match rule.fault.clone() {
                Fault::RefuseAtHandOver(rejection) => {
                    broker.refused_at_hand_over += 1;
                    return Err(PublishError::Rejected(rejection));
                }
                Fault::FailAfterAcceptance(rejection) => {
                    broker.failed_after_acceptance += 1;
                    fails = Some(rejection);
                }
            }
        }
        {
            let mut state = self.state();
            if let Some(spent) = &state.spent {
                return Err(PublishError::Rejected(Rejection::transient(format!(
                    "the producer stopped: {spent}"
                ))));
            }
            if let Some(open) = &mut state.transaction {
                if open.is_fenced() {
                    return Err(PublishError::Rejected(fenced()));
                }
                open.opened_at.get_or_insert_with(Instant::now);
            }
            state.accepted.push(Accepted {
                delivery: Delivery {
                    tag,
                    event_id,
                    bytes: event.size_bytes(),
                    result: Ok(()),
                },
                record: Record {
                    topic: topic.to_string(),
                    key: event.aggregate_id.to_string(),
                    event_id,
                    error: error.map(str::to_string),
                    payload: event.payload.as_ref().map(|p| p.to_vec()),
                },
                fails,
            });
        }
        if !broker.holding && !broker.down {
            self.state.flush(&mut broker.log, Release::InOrder, None);
        }
        Ok(())
    }

    async fn check_brokers(&self, _timeout: Duration) -> Result<()> {
        match self.broker.lock().down {
            true => Err(broker_down()),
            false => Ok(()),
        }
    }

    fn fatal_error(&self) -> Option<String> {
        self.state().spent.clone()
    }

    fn purge(&self) {
        self.fail_held("purged");
    }

    /// The in-memory broker writes what it accepts at once: nothing held is in flight.
    fn purge_unsent(&self) {
        self.fail_held("purged");
    }

    fn abandon(self) {
        self.fail_held("abandoned");
    }

    async fn begin_transactions(&self, key: &ProgressKey) -> Result<Option<Progress>> {
        let mut broker = self.broker.lock();
        let record_key = key.record_key();
        let Some(open) = &self.state().transaction else {
            return Ok(None);
        };
        for (slot, fenced) in &broker.transactional {
            if *slot == record_key && !Arc::ptr_eq(fenced, &open.fenced) {
                fenced.store(true, Ordering::SeqCst);
            }
        }
        broker
            .transactional
            .retain(|(_, fenced)| Arc::strong_count(fenced) > 1 && !fenced.load(Ordering::SeqCst));
        broker
            .transactional
            .push((record_key.clone(), open.fenced.clone()));
        Ok(broker.progress.get(&record_key).cloned())
    }

    async fn commit(&self, progress: &Progress) -> Result<(), Rejection> {
        let mut broker = self.broker.lock();
        // The commit flushes what the producer holds, as Kafka's does; unreachable, it fails.
        if !broker.down {
            self.state.flush(&mut broker.log, Release::InOrder, None);
        }
        let mut state = self.state();
        let Some(open) = &mut state.transaction else {
            return Ok(());
        };
        let failure = if open.is_fenced() {
            Some(fenced())
        } else if broker.down {
            Some(Rejection::transient("the in-memory broker is down".into()))
        } else if let Some((rejection, times)) = broker
            .commit_faults
            .iter_mut()
            .find(|(_, times)| *times > 0)
        {
            *times -= 1;
            Some(rejection.clone())
        } else if open.opened_at.is_some_and(|at| at.elapsed() > open.timeout) {
            Some(Rejection::transient(format!(
                "the transaction was open longer than transaction.timeout.ms ({:?}) and the broker aborted it",
                open.timeout
            )))
        } else {
            None
        };
        if let Some(rejection) = failure {
            broker.aborts += 1;
            let reason = rejection.reason.clone();
            abort_open_transaction(&mut state, &reason);
            return Err(rejection);
        }
        broker.commits += 1;
        broker.log.append(&mut open.written);
        broker
            .progress
            .insert(progress.key.record_key(), progress.clone());
        open.opened_at = None;
        for report in std::mem::take(&mut open.reports) {
            let _ = state.deliveries.send(report);
        }
        Ok(())
    }
}

fn fenced() -> Rejection {
    Rejection {
        producer_broken: true,
        ..Rejection::transient("fenced: a later producer of this slot took over".into())
    }
}

fn broker_down() -> Error {
    Error::Kafka {
        message: "the in-memory broker is down".into(),
        transient: true,
    }
}

impl Sinks for MemoryBroker {
    type Sink<T: Send + Sync + 'static> = MemorySink<T>;

    fn exactly_once_sink<T: Send + Sync + 'static>(
        &self,
        settings: &RunSettings,
        deliveries: UnboundedSender<Delivery<T>>,
        _key: &ProgressKey,
    ) -> Result<MemorySink<T>> {
        Ok(self.new_sink(
            deliveries,
            Some(OpenTransaction {
                timeout: settings.kafka.transaction_timeout(),
                opened_at: None,
                written: Vec::new(),
                reports: Vec::new(),
                fenced: Arc::new(AtomicBool::new(false)),
            }),
        ))
    }

    fn sink<T: Send + Sync + 'static>(
        &self,
        _settings: &RunSettings,
        deliveries: UnboundedSender<Delivery<T>>,
    ) -> Result<MemorySink<T>> {
        Ok(self.new_sink(deliveries, None))
    }

    async fn check_ready(&self, _settings: &RunSettings) -> Result<()> {
        match self.lock().down {
            true => Err(broker_down()),
            false => Ok(()),
        }
    }
}

impl MemoryBroker {
    fn new_sink<T: Send + Sync + 'static>(
        &self,
        deliveries: UnboundedSender<Delivery<T>>,
        transaction: Option<OpenTransaction<T>>,
    ) -> MemorySink<T> {
        let state = Arc::new(Mutex::new(SinkState {
            deliveries,
            accepted: Vec::new(),
            spent: None,
            transaction,
        }));
        let mut broker = self.lock();
        broker.sinks_made += 1;
        let flush: Arc<dyn Flush> = state.clone();
        broker.sinks.push(Arc::downgrade(&flush));
        MemorySink {
            broker: self.clone(),
            state,
        }
    }
}
