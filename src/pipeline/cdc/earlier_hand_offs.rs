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
//! confirmable from there at once; one whose hand-off is still ahead waits for it. A hand-off written without
//! a message (by `outboxd replay`, `audit --heal`, or an older outboxd) never comes: the event waits until
//! the stream passes the server's WAL position read after its row was found handed off (its hand-off had
//! committed by then). Any login may emit a message with outboxd's prefix; a forged one can only release an
//! event early, which opens again the window it closes for a standby left out of `synchronized_standby_slots`.

use std::collections::HashMap;

use uuid::Uuid;

use crate::lsn::Lsn;
use crate::pipeline::watermark::TxnId;

/// An outbox row: the index of its table in the settings' tables, and its event id.
pub type RowKey = (usize, Uuid);

/// An event released: its transaction in the watermark, and the position below which nothing may be
/// confirmed any more (its hand-off's end, or a position past it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    pub txn: TxnId,
    pub hold_until: Lsn,
}

#[derive(Debug, Clone, Copy)]
struct Awaiting {
    txn: TxnId,
    /// The server's WAL position read after the row was found handed off: its hand-off ended before it.
    past_the_hand_off: Lsn,
}

/// See the module's documentation.
#[derive(Debug, Default)]
pub struct EarlierHandOffs {
    /// Hand-offs decoded while events waited to be looked up: each event's hand-off end.
    seen: HashMap<RowKey, Lsn>,
    /// Events found handed off whose hand-off the stream has not passed yet.
    awaiting: HashMap<RowKey, Awaiting>,
}

impl EarlierHandOffs {
    /// The stream decoded a transaction ending at `end` that handed `events` off. `remember`: events still
    /// wait to be looked up (one of them may be among these). Returns the events now released.
    pub fn hand_offs_committed(
        &mut self,
        events: Vec<RowKey>,
        end: Lsn,
        remember: bool,
    ) -> Vec<Released> {
        let mut released = Vec::new();
        for key in events {
            if let Some(awaiting) = self.awaiting.remove(&key) {
                released.push(Released {
                    txn: awaiting.txn,
                    hold_until: end,
                });
            } else if remember {
                self.seen.insert(key, end);
            }
        }
        released
    }

    /// Whether `key`'s hand-off was decoded already (then [`EarlierHandOffs::found_handed_off`] releases it
    /// at once, without a WAL position).
    pub fn seen(&self, key: &RowKey) -> bool {
        self.seen.contains_key(key)
    }

    /// The row of `key`, an event of `txn`, was found handed off; `past_the_hand_off`: the server's WAL
    /// position read after that (needed only when its hand-off was not decoded yet). Returns it released
    /// when its hand-off was decoded already; otherwise it waits.
    pub fn found_handed_off(
        &mut self,
        key: RowKey,
        txn: TxnId,
        past_the_hand_off: Option<Lsn>,
    ) -> Option<Released> {
        if let Some(end) = self.seen.get(&key) {
            return Some(Released {
                txn,
                hold_until: *end,
            });
        }
        // Without a position to wait for (a caller's mistake) the event is released with no hold: never
        // kept waiting for good.
        let Some(past_the_hand_off) = past_the_hand_off else {
            return Some(Released {
                txn,
                hold_until: Lsn(0),
            });
        };
        self.awaiting.insert(
            key,
            Awaiting {
                txn,
                past_the_hand_off,
            },
        );
        None
    }

    /// Every event looked up: the hand-offs decoded so far concern none still to come.
    pub fn looked_up(&mut self) {
        self.seen.clear();
    }

    /// The stream has passed `position` (a transaction committing at it begins, or a keepalive outside a
    /// transaction), or every standby that could keep a copy of the slot flushed WAL past it: events whose
    /// hand-off ended before it are released (those that were waiting for a message that never comes too).
    pub fn passed(&mut self, position: Lsn) -> Vec<Released> {
        if self.awaiting.is_empty() {
            return Vec::new();
        }
        let mut released = Vec::new();
        self.awaiting.retain(|_, awaiting| {
            if awaiting.past_the_hand_off <= position {
                released.push(Released {
                    txn: awaiting.txn,
                    hold_until: awaiting.past_the_hand_off,
                });
                false
            } else {
                true
            }
        });
        released
    }

    /// Whether events wait for their hand-off: what is finished after them cannot be confirmed before, so
    /// reading must go on (see `window`).
    pub fn waiting(&self) -> bool {
        !self.awaiting.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::watermark::Watermark;

    fn key(n: u128) -> RowKey {
        (0, Uuid::from_u128(n))
    }

    fn txns(n: usize) -> Vec<TxnId> {
        let mut w = Watermark::new(Lsn(0));
        (0..n).map(|_| w.begin()).collect()
    }

    #[test]
    fn a_hand_off_decoded_before_the_lookup_releases_the_event_at_its_end() {
        let t = txns(1);
        let mut e = EarlierHandOffs::default();
        assert!(e
            .hand_offs_committed(vec![key(1), key(2)], Lsn(500), true)
            .is_empty());
        assert!(e.seen(&key(1)));
        assert_eq!(
            e.found_handed_off(key(1), t[0], None),
            Some(Released {
                txn: t[0],
                hold_until: Lsn(500)
            })
        );
        assert!(!e.waiting());
        e.looked_up();
        assert!(!e.seen(&key(2)));
    }

    #[test]
    fn a_hand_off_still_ahead_releases_the_event_when_it_commits() {
        let t = txns(2);
        let mut e = EarlierHandOffs::default();
        assert_eq!(e.found_handed_off(key(1), t[0], Some(Lsn(900))), None);
        assert_eq!(e.found_handed_off(key(2), t[1], Some(Lsn(900))), None);
        assert!(e.waiting());
        // A transaction beginning before the WAL position read releases nothing.
        assert!(e.passed(Lsn(400)).is_empty());
        assert_eq!(
            e.hand_offs_committed(vec![key(2), key(3)], Lsn(450), false),
            vec![Released {
                txn: t[1],
                hold_until: Lsn(450)
            }]
        );
        assert!(e.waiting());
        assert!(!e.seen(&key(3)), "nothing waits to be looked up");
    }

    #[test]
    fn a_hand_off_without_a_message_releases_the_event_once_the_stream_passes_the_position_read() {
        let t = txns(1);
        let mut e = EarlierHandOffs::default();
        assert_eq!(e.found_handed_off(key(1), t[0], Some(Lsn(900))), None);
        assert!(e.passed(Lsn(899)).is_empty());
        assert_eq!(
            e.passed(Lsn(900)),
            vec![Released {
                txn: t[0],
                hold_until: Lsn(900)
            }]
        );
        assert!(!e.waiting());
    }

    #[test]
    fn without_a_position_to_wait_for_an_event_not_seen_is_released_without_a_hold() {
        let t = txns(1);
        let mut e = EarlierHandOffs::default();
        assert_eq!(
            e.found_handed_off(key(1), t[0], None),
            Some(Released {
                txn: t[0],
                hold_until: Lsn(0)
            })
        );
        assert!(!e.waiting());
    }
}
