//! Events a session gave up because the broker refused them for good after the producer accepted them (or
//! refused them at hand-over while an earlier event of their aggregate was still on its way): the next
//! session hands each of them, and every event of its aggregate that the slot sends again, to the polling
//! path instead of producing them again. A refusal's content is not kept (the producer's report carries only
//! the event's id): the slot sends the event again with its row as inserted, so that one whose row is gone
//! can be written back for the polling path.
//!
//! Why the whole aggregate: with exactly-once, an earlier event of the aggregate in the aborted Kafka
//! transaction is no more in Kafka than the refused one; it must reach the polling path before it.
//!
//! Pure bookkeeping across sessions, no I/O. The session seeds its gate from it and reports what it met.

use std::collections::{HashMap, HashSet};

use uuid::Uuid;

use super::gate::GateKey;

/// Refused events owed to the polling path, by event id, with their aggregate; and aggregates owed whole (one
/// found waiting in the polling path while an earlier event of it was on its way).
#[derive(Debug, Default)]
pub struct OwedHandOffs {
    owed: HashMap<Uuid, GateKey>,
    aggregates: HashSet<GateKey>,
}

impl OwedHandOffs {
    /// `event_id` of `aggregate` goes to the polling path when the slot sends it again.
    pub fn owe(&mut self, event_id: Uuid, aggregate: GateKey) {
        self.owed.insert(event_id, aggregate);
    }

    /// Every event of `aggregate` the slot sends again goes to the polling path.
    pub fn owe_aggregate(&mut self, aggregate: GateKey) {
        self.aggregates.insert(aggregate);
    }

    /// Whether `event_id` is owed to the polling path.
    pub fn is_owed(&self, event_id: &Uuid) -> bool {
        !self.owed.is_empty() && self.owed.contains_key(event_id)
    }

    /// The aggregates with owed events: they hand off from a session's start until their events passed.
    pub fn aggregates(&self) -> impl Iterator<Item = &GateKey> {
        self.owed.values().chain(&self.aggregates)
    }

    /// The slot sent `event_id` again and the session decided on it.
    pub fn met(&mut self, event_id: &Uuid) {
        if !self.owed.is_empty() {
            self.owed.remove(event_id);
        }
    }

    /// The session read past everything it was sent again without meeting these events (a slot recreated
    /// or another server history): nothing will send them again. Returns them, to report.
    pub fn forget_unmet(&mut self) -> Vec<Uuid> {
        self.aggregates.clear();
        self.owed.drain().map(|(id, _)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(aggregate: &str) -> GateKey {
        (0, ("Order".into(), aggregate.into()))
    }

    #[test]
    fn an_owed_event_is_met_once_and_its_aggregate_is_listed_until_then() {
        let mut owed = OwedHandOffs::default();
        let (a1, a2) = (Uuid::new_v4(), Uuid::new_v4());
        owed.owe(a1, key("A"));
        owed.owe(a2, key("A"));
        assert!(owed.is_owed(&a1) && owed.is_owed(&a2));
        owed.met(&a1);
        assert!(!owed.is_owed(&a1));
        assert_eq!(owed.aggregates().collect::<Vec<_>>(), [&key("A")]);
        owed.met(&a2);
        assert_eq!(owed.aggregates().count(), 0);
    }

    #[test]
    fn what_was_not_met_is_forgotten_and_reported() {
        let mut owed = OwedHandOffs::default();
        let b1 = Uuid::new_v4();
        owed.owe(b1, key("B"));
        owed.owe_aggregate(key("C"));
        assert_eq!(owed.aggregates().count(), 2);
        assert_eq!(owed.forget_unmet(), [b1]);
        assert!(owed.aggregates().next().is_none() && !owed.is_owed(&b1));
    }
}
