//! The aggregate gate: decides, for each event the stream decodes, whether it may go to the producer now,
//! must wait in memory (parked), or must go to the polling path, so that no aggregate's events are ever
//! published out of order across the two paths.
//!
//! An aggregate is *blocked* while it has rows waiting in the polling path (handed off at slot creation, by
//! an earlier leader, or after a refusal): none of its later events may reach Kafka ahead of them. A blocked
//! aggregate either parks its later events (held here, published once the polling path has drained it:
//! quick for rows handed off at slot creation) or hands them off too (an aggregate that stays blocked,
//! e.g. behind a poison event being retried). A whole table can be *held* (more blocked aggregates than can
//! be tracked one by one): every event of it goes to the polling path.
//!
//! Pure: no I/O. The session asks the gate and carries its answers out (produce, hand off, query the
//! polling path's pending aggregates); what the polling path still holds comes back through
//! [`AggregateGate::drained`]. It does not own the in-flight window or the watermark.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::pg::outbox::AggregateKey;

/// An aggregate of one outbox table: (index of the table in the settings, aggregate).
pub type GateKey = (usize, AggregateKey);

/// What to do with an event.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission<T> {
    /// Nothing of its aggregate waits elsewhere: hand it to the producer.
    Publish(T),
    /// Its aggregate waits in the polling path: the gate holds it until the aggregate is drained.
    Parked,
    /// Hand these to the polling path (the aggregate's parked events first, then this one): the polling
    /// path orders them among its rows by position.
    HandOff(Vec<T>),
}

/// How a blocked aggregate's later events keep their order behind its rows in the polling path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    Park,
    HandOff,
}

#[derive(Debug, Clone, Copy)]
struct Blocked {
    hold: Hold,
    parked: usize,
    /// A replay holds its rows: it hands off until drained, whatever a check does.
    held: bool,
}

impl Blocked {
    const PARKING: Blocked = Blocked {
        hold: Hold::Park,
        parked: 0,
        held: false,
    };
    const HANDING_OFF: Blocked = Blocked {
        hold: Hold::HandOff,
        parked: 0,
        held: false,
    };
    const HELD: Blocked = Blocked {
        hold: Hold::HandOff,
        parked: 0,
        held: true,
    };
}

/// Blocked aggregates, held tables and parked events. Invariant: an aggregate that hands off has no parked
/// events (they would be published after later events of it that went through the polling path).
pub struct AggregateGate<T> {
    blocked: HashMap<GateKey, Blocked>,
    held_tables: HashSet<usize>,
    /// Parked events in stream order, with their aggregate.
    parked: VecDeque<(GateKey, T)>,
    /// Most events one aggregate parks before it hands off instead (its share of the in-flight window).
    park_limit: usize,
}

impl<T> AggregateGate<T> {
    pub fn new(park_limit: usize) -> Self {
        AggregateGate {
            blocked: HashMap::new(),
            held_tables: HashSet::new(),
            parked: VecDeque::new(),
            park_limit: park_limit.max(1),
        }
    }

    /// `aggregate` has rows waiting in the polling path (found at session start or when the stream meets one,
    /// or released from a held table): its later events park. One already blocked stays as it is.
    pub fn block(&mut self, aggregate: GateKey) {
        if !self.held_tables.contains(&aggregate.0) {
            self.blocked.entry(aggregate).or_insert(Blocked::PARKING);
        }
    }

    /// `aggregate`'s rows in the polling path are held by a replay until the stream has passed them: its later
    /// events go to the polling path from now on, never parked (a parked event would keep the stream from
    /// passing them, and the release waits for that). Returns its parked events, to hand off first.
    pub fn block_handing_off(&mut self, aggregate: GateKey) -> Vec<T> {
        if self.held_tables.contains(&aggregate.0) {
            return Vec::new();
        }
        let parked = self.take_parked_of(&aggregate);
        self.blocked.insert(aggregate, Blocked::HELD);
        parked
    }

    /// Every event of `table` goes to the polling path until [`Self::release_table`].
    pub fn hold_table(&mut self, table: usize) {
        self.held_tables.insert(table);
    }

    /// Decides for one event of `table`; `aggregate` (the event's) is asked only when something is blocked
    /// (it allocates).
    pub fn admit(
        &mut self,
        table: usize,
        event: T,
        aggregate: impl FnOnce(&T) -> AggregateKey,
    ) -> Admission<T> {
        if !self.held_tables.is_empty() && self.held_tables.contains(&table) {
            return Admission::HandOff(vec![event]);
        }
        if self.blocked.is_empty() {
            return Admission::Publish(event);
        }
        let key = (table, aggregate(&event));
        let Some(blocked) = self.blocked.get_mut(&key) else {
            return Admission::Publish(event);
        };
        match blocked.hold {
            Hold::Park if blocked.parked < self.park_limit => {
                blocked.parked += 1;
                self.parked.push_back((key, event));
                Admission::Parked
            }
            Hold::Park => {
                *blocked = Blocked::HANDING_OFF;
                let mut events = self.take_parked_of(&key);
                events.push(event);
                Admission::HandOff(events)
            }
            Hold::HandOff => Admission::HandOff(vec![event]),
        }
    }

    /// Whether an event of `table` and `aggregate` would not be published now.
    pub fn is_blocked(&self, table: usize, aggregate: impl FnOnce() -> AggregateKey) -> bool {
        self.held_tables.contains(&table)
            || (!self.blocked.is_empty() && self.blocked.contains_key(&(table, aggregate())))
    }

    /// An event of `aggregate` was refused for good and goes to the polling path: the aggregate hands off
    /// from now on. Returns its parked events, to hand off as well.
    pub fn refused(&mut self, aggregate: GateKey) -> Vec<T> {
        let parked = self.take_parked_of(&aggregate);
        let held = self.blocked.get(&aggregate).is_some_and(|b| b.held);
        let blocked = if held {
            Blocked::HELD
        } else {
            Blocked::HANDING_OFF
        };
        self.blocked.insert(aggregate, blocked);
        parked
    }

    /// How many aggregates of `table` are blocked.
    pub fn blocked_in(&self, table: usize) -> usize {
        self.blocked.keys().filter(|(t, _)| *t == table).count()
    }

    pub fn has_blocked(&self) -> bool {
        !self.blocked.is_empty() || !self.held_tables.is_empty()
    }

    pub fn has_held_tables(&self) -> bool {
        !self.held_tables.is_empty()
    }

    pub fn parked_len(&self) -> usize {
        self.parked.len()
    }

    /// Every parked event, in stream order, to hand off; their aggregates hand off from now on.
    pub fn hand_off_every_parked(&mut self) -> Vec<T> {
        let parked = std::mem::take(&mut self.parked);
        parked
            .into_iter()
            .map(|(key, event)| {
                if let Some(blocked) = self.blocked.get_mut(&key) {
                    *blocked = Blocked::HANDING_OFF;
                }
                event
            })
            .collect()
    }

    /// Before asking the polling path what it still holds: aggregates that hand off go back to parking, so
    /// that (once the session's hand-offs are written) the answer covers all of them; not those a replay
    /// holds (see [`Self::block_handing_off`]), which hand off until drained.
    pub fn begin_check(&mut self) {
        for blocked in self.blocked.values_mut().filter(|b| !b.held) {
            blocked.hold = Hold::Park;
        }
    }

    /// Held tables, to ask whether few enough of their aggregates wait to track them one by one.
    pub fn held_tables(&self) -> Vec<usize> {
        self.held_tables.iter().copied().collect()
    }

    /// A held table whose waiting aggregates (`pending`, complete, each with whether a replay holds its
    /// rows) are few enough is tracked one by one.
    pub fn release_table(
        &mut self,
        table: usize,
        pending: impl IntoIterator<Item = (AggregateKey, bool)>,
    ) {
        self.held_tables.remove(&table);
        for (aggregate, held) in pending {
            if held {
                self.block_handing_off((table, aggregate));
            } else {
                self.block((table, aggregate));
            }
        }
    }

    /// Tables with blocked aggregates, to ask which of them the polling path still holds.
    pub fn blocked_tables(&self) -> HashSet<usize> {
        self.blocked.keys().map(|(table, _)| *table).collect()
    }

    /// What the polling path still holds: `pending` aggregates of the tables asked, `unknown` the tables
    /// whose answer was incomplete (none of theirs unblocks), `unasked` tables left as they are. Returns
    /// the parked events whose aggregate is no longer blocked, in stream order, to admit again.
    pub fn drained(
        &mut self,
        pending: &HashSet<GateKey>,
        unknown: &HashSet<usize>,
        unasked: &HashSet<usize>,
    ) -> Vec<T> {
        let before = self.blocked.len();
        self.blocked.retain(|aggregate, _| {
            unasked.contains(&aggregate.0)
                || unknown.contains(&aggregate.0)
                || pending.contains(aggregate)
        });
        if self.blocked.len() == before {
            return Vec::new();
        }
        let mut released = Vec::new();
        for (key, event) in std::mem::take(&mut self.parked) {
            if self.blocked.contains_key(&key) {
                self.parked.push_back((key, event));
            } else {
                released.push(event);
            }
        }
        released
    }

    /// Empties the gate's parked events (at shutdown: the slot was not confirmed past them).
    pub fn take_every_parked(&mut self) -> Vec<T> {
        std::mem::take(&mut self.parked)
            .into_iter()
            .map(|(_, event)| event)
            .collect()
    }

    fn take_parked_of(&mut self, aggregate: &GateKey) -> Vec<T> {
        let mut taken = Vec::new();
        for (key, event) in std::mem::take(&mut self.parked) {
            if key == *aggregate {
                taken.push(event);
            } else {
                self.parked.push_back((key, event));
            }
        }
        if let Some(blocked) = self.blocked.get_mut(aggregate) {
            blocked.parked = 0;
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    /// An event of the model: (aggregate, stream position).
    type Event = (u8, i64);

    fn aggregate(id: u8) -> AggregateKey {
        ("Order".into(), id.to_string())
    }

    fn key(id: u8) -> GateKey {
        (0, aggregate(id))
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// The stream decodes an event of this aggregate; `refused`: the producer refuses it for good.
        Stream { aggregate: u8, refused: bool },
        /// The polling path publishes the oldest row it holds of this aggregate.
        Poll(u8),
        /// The session asks the polling path which aggregates it still holds.
        Check,
        /// The in-flight window is full behind parked events.
        WindowFull,
        /// An event of this aggregate produced outside the gate (a handed-off event whose row is gone) was
        /// refused for good: the aggregate hands off from now on.
        RefusedOutside(u8),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (0u8..4, proptest::bool::weighted(0.1))
                .prop_map(|(aggregate, refused)| Step::Stream { aggregate, refused }),
            3 => (0u8..4).prop_map(Step::Poll),
            2 => Just(Step::Check),
            1 => Just(Step::WindowFull),
            1 => (0u8..4).prop_map(Step::RefusedOutside),
        ]
    }

    /// The gate between a stream and a polling path that keeps each aggregate's rows in position order.
    struct World {
        gate: AggregateGate<Event>,
        polling: BTreeMap<u8, BTreeSet<i64>>,
        kafka: Vec<Event>,
        next_position: i64,
    }

    impl World {
        fn new(park_limit: usize, blocked: &[u8], held: bool) -> Self {
            let mut world = World {
                gate: AggregateGate::new(park_limit),
                polling: BTreeMap::new(),
                kafka: Vec::new(),
                next_position: 0,
            };
            // Rows older than the slot, handed off at its creation.
            for &id in blocked {
                world.polling.entry(id).or_default().extend([-2, -1]);
                if !held {
                    world.gate.block(key(id));
                }
            }
            if held {
                world.gate.hold_table(0);
            }
            world
        }

        fn hand_off(&mut self, events: Vec<Event>) {
            for (id, position) in events {
                self.polling.entry(id).or_default().insert(position);
            }
        }

        fn admit(&mut self, event: Event, refused: bool) {
            match self.gate.admit(0, event, |event| aggregate(event.0)) {
                Admission::Publish(event) if refused => {
                    let parked = self.gate.refused(key(event.0));
                    self.hand_off(vec![event]);
                    self.hand_off(parked);
                }
                Admission::Publish(event) => self.kafka.push(event),
                Admission::Parked => {}
                Admission::HandOff(events) => self.hand_off(events),
            }
        }

        fn poll(&mut self, id: u8) {
            if let Some(rows) = self.polling.get_mut(&id) {
                if let Some(position) = rows.pop_first() {
                    self.kafka.push((id, position));
                }
            }
        }

        fn check(&mut self) {
            self.gate.begin_check();
            let pending: HashSet<GateKey> = self
                .polling
                .iter()
                .filter(|(_, rows)| !rows.is_empty())
                .map(|(&id, _)| key(id))
                .collect();
            let mut released = HashSet::new();
            for table in self.gate.held_tables() {
                let waiting: Vec<(AggregateKey, bool)> =
                    pending.iter().map(|(_, a)| (a.clone(), false)).collect();
                self.gate.release_table(table, waiting);
                released.insert(table);
            }
            for event in self.gate.drained(&pending, &HashSet::new(), &released) {
                self.admit(event, false);
            }
        }

        fn run(&mut self, step: &Step) {
            match *step {
                Step::Stream { aggregate, refused } => {
                    let event = (aggregate, self.next_position);
                    self.next_position += 1;
                    self.admit(event, refused);
                }
                Step::Poll(id) => self.poll(id),
                Step::Check => self.check(),
                Step::WindowFull => {
                    let parked = self.gate.hand_off_every_parked();
                    self.hand_off(parked);
                }
                Step::RefusedOutside(id) => {
                    let parked = self.gate.refused(key(id));
                    self.hand_off(parked);
                }
            }
        }

        /// The polling path drains and the session checks until nothing waits anywhere.
        fn settle(&mut self) {
            for _ in 0..1_000 {
                for id in 0..4 {
                    while self.polling.get(&id).is_some_and(|rows| !rows.is_empty()) {
                        self.poll(id);
                    }
                }
                self.check();
                if self.gate.parked_len() == 0
                    && self.polling.values().all(BTreeSet::is_empty)
                    && !self.gate.has_blocked()
                {
                    return;
                }
            }
            panic!("the gate never settled");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// Whatever the interleaving of stream events, refusals, polling-path progress, checks and full
        /// windows: each aggregate reaches Kafka in stream order, every event exactly once.
        #[test]
        fn no_aggregate_is_ever_published_out_of_order(
            steps in proptest::collection::vec(step(), 0..120),
            park_limit in 1usize..4,
            blocked in proptest::collection::vec(0u8..4, 0..3),
            held in proptest::bool::weighted(0.2),
        ) {
            let mut world = World::new(park_limit, &blocked, held);
            for step in &steps {
                world.run(step);
            }
            world.settle();
            let mut last: HashMap<u8, i64> = HashMap::new();
            for &(id, position) in &world.kafka {
                if let Some(&before) = last.get(&id) {
                    prop_assert!(
                        position > before,
                        "aggregate {id}: position {position} published after {before}: {:?}",
                        world.kafka
                    );
                }
                last.insert(id, position);
            }
            let initial: usize = blocked.iter().collect::<HashSet<_>>().len() * 2;
            prop_assert_eq!(world.kafka.len(), world.next_position as usize + initial);
        }
    }

    #[test]
    fn an_unblocked_table_publishes_without_asking_for_the_aggregate() {
        let mut gate = AggregateGate::new(4);
        let admission = gate.admit(0, 7, |_| panic!("nothing is blocked"));
        assert_eq!(admission, Admission::Publish(7));
    }

    #[test]
    fn an_aggregate_parks_up_to_its_limit_then_hands_off_everything_in_order() {
        let mut gate = AggregateGate::new(2);
        gate.block(key(1));
        assert_eq!(gate.admit(0, 10, |_| aggregate(1)), Admission::Parked);
        assert_eq!(gate.admit(0, 11, |_| aggregate(2)), Admission::Publish(11));
        assert_eq!(gate.admit(0, 12, |_| aggregate(1)), Admission::Parked);
        assert_eq!(
            gate.admit(0, 13, |_| aggregate(1)),
            Admission::HandOff(vec![10, 12, 13])
        );
        assert_eq!(
            gate.admit(0, 14, |_| aggregate(1)),
            Admission::HandOff(vec![14])
        );
        assert_eq!(gate.parked_len(), 0);
    }

    #[test]
    fn a_drained_aggregate_releases_its_parked_events_in_order_and_others_stay() {
        let mut gate = AggregateGate::new(8);
        gate.block(key(1));
        gate.block(key(2));
        for (id, event) in [(1, 10), (2, 11), (1, 12)] {
            assert_eq!(gate.admit(0, event, |_| aggregate(id)), Admission::Parked);
        }
        gate.begin_check();
        let pending: HashSet<GateKey> = [key(2)].into();
        assert_eq!(
            gate.drained(&pending, &HashSet::new(), &HashSet::new()),
            [10, 12]
        );
        assert_eq!(gate.parked_len(), 1);
        assert!(!gate.is_blocked(0, || aggregate(1)));
        assert!(gate.is_blocked(0, || aggregate(2)));
    }

    #[test]
    fn a_table_whose_answer_was_cut_unblocks_nothing() {
        let mut gate = AggregateGate::new(8);
        gate.block(key(1));
        assert_eq!(gate.admit(0, 10, |_| aggregate(1)), Admission::Parked);
        let unknown: HashSet<usize> = [0].into();
        assert!(gate
            .drained(&HashSet::new(), &unknown, &HashSet::new())
            .is_empty());
        assert!(gate.is_blocked(0, || aggregate(1)));
    }

    #[test]
    fn a_held_table_hands_every_event_off_until_released() {
        let mut gate = AggregateGate::new(8);
        gate.hold_table(0);
        assert_eq!(
            gate.admit(0, 10, |_| aggregate(1)),
            Admission::HandOff(vec![10])
        );
        assert_eq!(gate.admit(1, 11, |_| aggregate(1)), Admission::Publish(11));
        gate.release_table(0, vec![(aggregate(1), false), (aggregate(3), true)]);
        assert_eq!(gate.admit(0, 12, |_| aggregate(1)), Admission::Parked);
        assert_eq!(gate.admit(0, 13, |_| aggregate(2)), Admission::Publish(13));
        assert_eq!(
            gate.admit(0, 14, |_| aggregate(3)),
            Admission::HandOff(vec![14])
        );
    }

    #[test]
    fn an_aggregate_a_replay_holds_hands_its_later_events_off_instead_of_parking_them() {
        let mut gate = AggregateGate::new(8);
        gate.block((0, aggregate(1)));
        assert_eq!(gate.admit(0, 10, |_| aggregate(1)), Admission::Parked);
        // Held by a replay: what was parked goes first, and nothing parks from now on (a parked event would
        // keep the stream from passing the hand-back the release waits for).
        assert_eq!(gate.block_handing_off((0, aggregate(1))), vec![10]);
        assert_eq!(
            gate.admit(0, 11, |_| aggregate(1)),
            Admission::HandOff(vec![11])
        );
        assert!(gate.block_handing_off((0, aggregate(2))).is_empty());
        assert_eq!(
            gate.admit(0, 12, |_| aggregate(2)),
            Admission::HandOff(vec![12])
        );
        // A check while its rows wait: it still hands off (parking again would wait for the release).
        gate.begin_check();
        let pending: HashSet<GateKey> = [(0, aggregate(1)), (0, aggregate(2))].into();
        assert!(gate
            .drained(&pending, &HashSet::new(), &HashSet::new())
            .is_empty());
        assert_eq!(
            gate.admit(0, 14, |_| aggregate(1)),
            Admission::HandOff(vec![14])
        );
        // Drained: its events are published again.
        gate.begin_check();
        gate.drained(&HashSet::new(), &HashSet::new(), &HashSet::new());
        assert_eq!(gate.admit(0, 15, |_| aggregate(1)), Admission::Publish(15));
        assert_eq!(gate.admit(0, 13, |_| aggregate(3)), Admission::Publish(13));
    }
}
