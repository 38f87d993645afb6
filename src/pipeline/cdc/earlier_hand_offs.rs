//! Events met again in the stream whose rows an earlier session or process handed to the polling path: from
//! when each may be confirmed. Pure bookkeeping of one session, no I/O.
//!
//! A hand-off (the row's `handoff_at`) is the only record that its event is still owed, and it commits after
//! the event's transaction. No position between the two may be confirmed: a standby's copy of a failover slot
//! would follow it on a standby that has the event but not the hand-off, and after a promotion nothing would
//! publish the event. The session that wrote a hand-off holds its confirmations until the stream passes it;
//! a process killed before that leaves the next one to meet the event again and find it handed off, without
//! knowing where the hand-off ended. outboxd writes, in each hand-off's transaction, a logical decoding
//! message naming its events (`pg::outbox::HANDED_OFF_MESSAGE`): its commit in the stream is that end.
//!
//! An event found handed off whose hand-off was decoded already (while the event waited to be looked up) is
//! confirmable from that end. One whose hand-off is still ahead is finished at once too (so the watermark's
//! entries behind it merge and memory stays flat), under a provisional hold at the server's WAL position read
//! after its row was found handed off (its hand-off had committed by then): when the hand-off's message
//! comes, the hold is lowered to its end. A hand-off written without a message (by `outboxd replay`, `audit
//! --heal`, or an older outboxd) never comes: the provisional hold stays until the stream passes it, or until
//! every standby that could keep a copy of the slot flushed past it. Any login may emit a message with
//! outboxd's prefix; a forged one can only lower a hold early, which opens again the window it closes for a
//! standby that lags behind the stream. Memory: one position per event waiting (a provisional hold), and
//! the ids of hand-offs decoded while events wait to be looked up, only for those events.

use std::collections::{BTreeMap, HashMap, HashSet};

use uuid::Uuid;

use crate::lsn::Lsn;

/// An outbox row: the index of its table in the settings' tables, and its event id.
pub type RowKey = (usize, Uuid);

/// See the module's documentation.
#[derive(Debug, Default)]
pub struct EarlierHandOffs {
    /// Hand-offs decoded while events waited to be looked up (of those events only): each one's end.
    seen: HashMap<RowKey, Lsn>,
    /// Events found handed off whose hand-off was not decoded yet: the WAL position read after each was
    /// found (an event id can be met in more than one transaction: one position each).
    awaiting: HashMap<RowKey, Vec<Lsn>>,
    /// The positions of `awaiting`, counted: the highest is the provisional hold.
    provisional: BTreeMap<Lsn, usize>,
}

impl EarlierHandOffs {
    /// The stream decoded a transaction ending at `end` that handed `events` off. `buffered`: the events
    /// still waiting to be looked up (a hand-off of one of them is remembered). Returns whether an event
    /// waiting for its hand-off met it: then nothing below `end` may be confirmed any more.
    pub fn hand_offs_committed(
        &mut self,
        events: Vec<RowKey>,
        end: Lsn,
        buffered: &HashSet<RowKey>,
    ) -> bool {
        let mut met = false;
        for key in events {
            if let Some(positions) = self.awaiting.get_mut(&key) {
                // The earliest wait is this hand-off's (a later one of the same id waits on).
                let earliest = positions
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, position)| **position)
                    .map(|(index, _)| index);
                let position = earliest.map(|index| positions.swap_remove(index));
                if positions.is_empty() {
                    self.awaiting.remove(&key);
                }
                if let Some(position) = position {
                    self.forget_provisional(position);
                    met = true;
                }
            } else if buffered.contains(&key) {
                self.seen.insert(key, end);
            }
        }
        met
    }

    /// The row of `key` was found handed off; `past_the_hand_off`: the server's WAL position read after that.
    /// Returns the end of its hand-off when it was decoded already (nothing below it may be confirmed any
    /// more); otherwise the event waits for it under a provisional hold. A decoded end serves one event:
    /// another of the same id met later waits (the end remembered may be an earlier row's).
    pub fn found_handed_off(&mut self, key: RowKey, past_the_hand_off: Lsn) -> Option<Lsn> {
        if let Some(end) = self.seen.remove(&key) {
            return Some(end);
        }
        self.awaiting
            .entry(key)
            .or_default()
            .push(past_the_hand_off);
        *self.provisional.entry(past_the_hand_off).or_default() += 1;
        None
    }

    /// Every event looked up: the hand-offs decoded so far concern none still to come.
    pub fn looked_up(&mut self) {
        self.seen.clear();
    }

    /// The stream has passed `position` (a transaction committing at it begins, or a keepalive outside a
    /// transaction), or every standby that could keep a copy of the slot flushed WAL past it: the waits at
    /// or below it end (those for a message that never comes too). Returns the highest of them: nothing
    /// below it may be confirmed any more.
    pub fn passed(&mut self, position: Lsn) -> Option<Lsn> {
        let ended: Vec<Lsn> = self
            .provisional
            .range(..=position)
            .map(|(position, _)| *position)
            .collect();
        let highest = *ended.last()?;
        for ended in &ended {
            self.provisional.remove(ended);
        }
        self.awaiting.retain(|_, positions| {
            positions.retain(|waits_for| *waits_for > position);
            !positions.is_empty()
        });
        Some(highest)
    }

    /// The provisional hold: nothing below it may be confirmed while events wait for their hand-off
    /// ([`Lsn::ZERO`] when none waits).
    pub fn provisional_hold(&self) -> Lsn {
        self.provisional
            .last_key_value()
            .map_or(Lsn::ZERO, |(position, _)| *position)
    }

    /// Whether events wait for their hand-off.
    pub fn waiting(&self) -> bool {
        !self.provisional.is_empty()
    }

    fn forget_provisional(&mut self, position: Lsn) {
        if let Some(count) = self.provisional.get_mut(&position) {
            *count -= 1;
            if *count == 0 {
                self.provisional.remove(&position);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u128) -> RowKey {
        (0, Uuid::from_u128(n))
    }

    fn buffered(keys: &[RowKey]) -> HashSet<RowKey> {
        keys.iter().copied().collect()
    }

    #[test]
    fn a_hand_off_decoded_before_the_lookup_gives_its_end() {
        let mut e = EarlierHandOffs::default();
        assert!(!e.hand_offs_committed(
            vec![key(1), key(2), key(3)],
            Lsn(500),
            &buffered(&[key(1), key(2)])
        ));
        assert_eq!(e.found_handed_off(key(1), Lsn(900)), Some(Lsn(500)));
        assert!(!e.waiting());
        // Only events waiting to be looked up are remembered.
        assert_eq!(e.found_handed_off(key(3), Lsn(900)), None);
        assert!(e.waiting());
        e.looked_up();
        assert_eq!(
            e.found_handed_off(key(2), Lsn(950)),
            None,
            "forgotten once looked up"
        );
    }

    #[test]
    fn a_hand_off_still_ahead_lowers_the_provisional_hold_to_its_end_when_it_commits() {
        let mut e = EarlierHandOffs::default();
        assert_eq!(e.found_handed_off(key(1), Lsn(900)), None);
        assert_eq!(e.found_handed_off(key(2), Lsn(950)), None);
        assert_eq!(e.provisional_hold(), Lsn(950));
        // A transaction beginning before the WAL positions read ends no wait.
        assert_eq!(e.passed(Lsn(400)), None);
        assert!(e.hand_offs_committed(vec![key(2), key(3)], Lsn(450), &HashSet::new()));
        assert_eq!(e.provisional_hold(), Lsn(900), "key 2's wait ended");
        assert!(e.hand_offs_committed(vec![key(1)], Lsn(460), &HashSet::new()));
        assert!(!e.waiting());
        assert_eq!(e.provisional_hold(), Lsn::ZERO);
    }

    #[test]
    fn a_hand_off_without_a_message_ends_its_wait_once_the_stream_passes_the_position_read() {
        let mut e = EarlierHandOffs::default();
        assert_eq!(e.found_handed_off(key(1), Lsn(900)), None);
        assert_eq!(e.found_handed_off(key(2), Lsn(700)), None);
        assert_eq!(e.passed(Lsn(699)), None);
        assert_eq!(e.passed(Lsn(899)), Some(Lsn(700)));
        assert_eq!(e.provisional_hold(), Lsn(900));
        assert_eq!(e.passed(Lsn(900)), Some(Lsn(900)));
        assert!(!e.waiting());
    }

    #[test]
    fn an_event_id_met_in_two_transactions_waits_twice() {
        let mut e = EarlierHandOffs::default();
        assert_eq!(e.found_handed_off(key(1), Lsn(900)), None);
        assert_eq!(e.found_handed_off(key(1), Lsn(1_200)), None);
        assert!(e.hand_offs_committed(vec![key(1)], Lsn(850), &HashSet::new()));
        assert!(e.waiting(), "the second wait goes on");
        assert_eq!(e.provisional_hold(), Lsn(1_200));
        assert_eq!(e.passed(Lsn(1_200)), Some(Lsn(1_200)));
        assert!(!e.waiting());
    }

    #[test]
    fn a_hand_off_end_remembered_serves_one_event_of_its_id() {
        let mut e = EarlierHandOffs::default();
        // Two rows of one event id wait to be looked up; the hand-off of the first was decoded.
        e.hand_offs_committed(vec![key(1)], Lsn(500), &buffered(&[key(1)]));
        assert_eq!(e.found_handed_off(key(1), Lsn(900)), Some(Lsn(500)));
        assert_eq!(
            e.found_handed_off(key(1), Lsn(900)),
            None,
            "the second waits for its own hand-off"
        );
        assert_eq!(e.provisional_hold(), Lsn(900));
    }
}
