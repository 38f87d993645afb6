//! Pure ack watermark: which LSN may be confirmed to the slot, given events that finish out of order.
//!
//! Entries are kept in stream order: transactions (open until their Commit arrives) and keepalive markers (a
//! server `wal_end` seen while no transaction was open). An entry is finished when it is committed and every
//! event in it is broker-acknowledged and has `published_at` written. The confirmable LSN is the position of
//! the last entry of the longest finished prefix, so a transaction is confirmed only after it and every earlier
//! one are done, and an idle stream confirms the server's latest `wal_end`.
//!
//! A hold ([`Watermark::hold_until`]) keeps the confirmed position from entering a range: after outboxd wrote
//! something the slot's position will rest on (a hand-off, committed after the event's transaction), no
//! position between the event and that write is confirmed, only one at or past the write. A standby's
//! copy of a failover slot follows the confirmed position as far as that standby flushed WAL, so it is then
//! either still before the event (which is sent again) or on a standby that holds the write.
//!
//! The highest position ever confirmed on the current server history survives a reconnect
//! ([`Watermark::resume_at`]), so transactions the server re-sends below it can be recognised: PG 15 can move
//! the slot back after a restart. A new session still starts from (and reports) the slot's own position, so
//! nothing the server holds between the two is skipped unseen. Owns no I/O.

use std::collections::VecDeque;

use crate::lsn::Lsn;

/// Identifies one transaction in the watermark. Ids from before a restart are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TxnId(u64);

#[derive(Debug)]
struct Entry {
    /// `None` while the transaction's Commit has not arrived.
    position: Option<Lsn>,
    pending_events: u64,
    /// Events of the entry already finished (acknowledged), not yet confirmed to the server.
    finished_events: u64,
    /// The transaction's commit time, when known (keepalive markers have none).
    commit_micros: Option<i64>,
}

/// The ack watermark of one replication stream (see the module's documentation).
#[derive(Debug, Default)]
pub struct Watermark {
    entries: VecDeque<Entry>,
    /// Id of `entries[0]`.
    first_id: u64,
    /// Confirmed in this session: what status updates report.
    confirmed: Lsn,
    /// The highest position confirmed on this server history, across sessions.
    highest: Lsn,
    /// Commit time of the latest transaction confirmed on this history (`None` before one, or after a
    /// restart of the process: then nothing is taken for re-sent).
    highest_commit_micros: Option<i64>,
    open: Option<TxnId>,
    /// Finished events the server has not been told about yet: in entries still queued, or in popped ones
    /// (`confirmable_unreported`) whose position was not sent yet. A crash re-sends them.
    finished_unreported: u64,
    confirmable_unreported: u64,
    /// While above `confirmed`: nothing below it is confirmed (see [`Watermark::hold_until`]).
    hold: Lsn,
    /// A hold that may be lowered again (see [`Watermark::provisional_hold`]).
    provisional: Lsn,
}

impl Watermark {
    /// Starts from a position already confirmed (for example the slot's `confirmed_flush_lsn`).
    pub fn new(confirmed: Lsn) -> Self {
        Watermark {
            confirmed,
            highest: confirmed,
            ..Default::default()
        }
    }

    /// The position confirmed in this session (the slot's, at its start); moves only forwards within it.
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// The highest position confirmed on this server history, across sessions.
    pub fn highest_confirmed(&self) -> Lsn {
        self.highest
    }

    /// A new session on the same server history starts from the slot's own position. What lies between it
    /// and the highest confirmed position is re-sent by the server and recognised by
    /// [`Watermark::is_resent`]; everything in flight is forgotten (it is re-sent too). A slot moved past
    /// the highest position (by another instance) leaves no commit time to compare with: nothing counts as
    /// re-sent until this session confirms a transaction.
    pub fn resume_at(&mut self, slot_position: Lsn) {
        self.restart();
        self.confirmed = slot_position;
        if slot_position > self.highest {
            self.highest = slot_position;
            self.highest_commit_micros = None;
        }
    }

    /// True when the server is re-sending a transaction this history already confirmed (PG 15 can move
    /// `confirmed_flush_lsn` back after a restart): its commit record starts below the highest confirmed
    /// position, and it committed no later than the latest confirmed transaction. A transaction below that
    /// position that committed later is new: the server's WAL diverged from what was confirmed (a restore
    /// from a snapshot that was written past the old position) and it must not be dropped.
    pub fn is_resent(&self, final_lsn: Lsn, commit_micros: i64) -> bool {
        final_lsn < self.highest
            && self
                .highest_commit_micros
                .is_some_and(|c| commit_micros <= c)
    }

    /// True when a transaction at `final_lsn` lies below the highest confirmed position (re-sent or not).
    pub fn is_below_confirmed(&self, final_lsn: Lsn) -> bool {
        final_lsn < self.highest
    }

    /// Confirms no position below `position` from now on, except the one already confirmed: the next one
    /// confirmed is at or past it. Survives a reconnect on the same server history (the write it stands for
    /// is still there to cover), not a new history ([`Watermark::reset`]).
    pub fn hold_until(&mut self, position: Lsn) {
        if position > self.confirmed {
            self.hold = self.hold.max(position);
        }
    }

    /// Like [`Watermark::hold_until`], but replaced by the next call (`Lsn::ZERO`: none): a hold whose
    /// position is only a bound for now, lowered once the write it stands for is found. Dropped on a
    /// reconnect: it stands for events met again after the confirmed position, which the server sends
    /// again, and which are held again when met.
    pub fn provisional_hold(&mut self, position: Lsn) {
        self.provisional = position;
    }

    /// Every standby that could keep a copy of the slot has flushed WAL up to `flushed`: a hold at or below
    /// it protects nothing any more (each of them has the write), and ends.
    pub fn standbys_flushed(&mut self, flushed: Lsn) {
        if self.hold <= flushed {
            self.hold = Lsn::ZERO;
        }
    }

    /// True while a hold keeps finished transactions from being confirmed: their events stay unreported
    /// until the stream passes the hold, so reading must go on (see `window`).
    pub fn holding(&self) -> bool {
        self.held_below() > self.confirmed
    }

    fn held_below(&self) -> Lsn {
        self.hold.max(self.provisional)
    }

    /// Forgets everything in flight (after a reconnect the server re-sends it); keeps the confirmed position.
    pub fn restart(&mut self) {
        self.provisional = Lsn::ZERO;
        self.first_id += self.entries.len() as u64;
        self.entries.clear();
        self.open = None;
        self.finished_unreported = 0;
        self.confirmable_unreported = 0;
    }

    /// Starts over on another server history (see `history`): forgets the confirmed position and everything
    /// in flight, and takes `confirmed` (the slot's own position there). The only way it moves backwards.
    pub fn reset(&mut self, confirmed: Lsn) {
        self.restart();
        self.confirmed = confirmed;
        self.highest = confirmed;
        self.highest_commit_micros = None;
        self.hold = Lsn::ZERO;
    }

    /// A Begin arrived.
    pub fn begin(&mut self) -> TxnId {
        let id = TxnId(self.first_id + self.entries.len() as u64);
        self.entries.push_back(Entry {
            position: None,
            pending_events: 0,
            finished_events: 0,
            commit_micros: None,
        });
        self.open = Some(id);
        id
    }

    /// An event of `txn` was handed to the broker.
    pub fn event_started(&mut self, txn: TxnId) {
        if let Some(entry) = self.entry_mut(txn) {
            entry.pending_events += 1;
        }
    }

    /// An event of `txn` is acknowledged by the broker and its `published_at` is written.
    pub fn event_finished(&mut self, txn: TxnId) {
        if let Some(entry) = self.entry_mut(txn) {
            entry.pending_events = entry.pending_events.saturating_sub(1);
            entry.finished_events += 1;
            if entry.position.is_some() {
                self.finished_unreported += 1;
            }
        }
    }

    /// Finished events of committed transactions whose position the server has not been sent yet (see
    /// [`Watermark::reported`]): a crash now would have the server send them again. Those of the open
    /// transaction count from its Commit on, so that a transaction larger than any window can still finish.
    pub fn unreported_events(&self) -> u64 {
        self.finished_unreported
    }

    /// The position last returned by [`Watermark::advance`] was sent to the server: the events up to it are
    /// no longer re-sent after a crash.
    pub fn reported(&mut self) {
        self.finished_unreported -= self.confirmable_unreported;
        self.confirmable_unreported = 0;
    }

    /// The Commit of `txn` arrived; `end_lsn` is the position to confirm once it is finished.
    pub fn commit(&mut self, txn: TxnId, end_lsn: Lsn) {
        if let Some(entry) = self.entry_mut(txn) {
            if entry.position.replace(end_lsn).is_none() {
                self.finished_unreported += entry.finished_events;
            }
        }
        if self.open == Some(txn) {
            self.open = None;
        }
    }

    /// [`Watermark::commit`], remembering when the transaction committed (see [`Watermark::is_resent`]).
    pub fn commit_at(&mut self, txn: TxnId, end_lsn: Lsn, commit_micros: i64) {
        if let Some(entry) = self.entry_mut(txn) {
            entry.commit_micros = Some(commit_micros);
        }
        self.commit(txn, end_lsn);
    }

    /// A keepalive reported the server's `wal_end`. Outside a transaction everything up to it has been
    /// received, so it becomes confirmable once everything before it is finished.
    pub fn keepalive(&mut self, wal_end: Lsn) {
        if self.open.is_some() || wal_end <= self.confirmed {
            return;
        }
        match self.entries.back_mut() {
            Some(last)
                if last.pending_events == 0 && last.position.is_some_and(|p| p <= wal_end) =>
            {
                // A trailing finished entry can simply be moved forward; keeps the queue short while idle.
                last.position = Some(wal_end);
            }
            _ => self.entries.push_back(Entry {
                position: Some(wal_end),
                pending_events: 0,
                finished_events: 0,
                commit_micros: None,
            }),
        }
    }

    /// Pops the finished prefix and returns the (possibly advanced) confirmed position. Under a hold, only as
    /// far as the last finished entry at or past it: the entries before it wait for one.
    pub fn advance(&mut self) -> Lsn {
        let finished = self
            .entries
            .iter()
            .map_while(|entry| entry.position.filter(|_| entry.pending_events == 0));
        let held_below = self.held_below();
        let confirmable = finished
            .enumerate()
            .filter(|(_, position)| *position >= held_below)
            .last()
            .map_or(0, |(index, _)| index + 1);
        for front in self.entries.drain(..confirmable) {
            if let Some(position) = front.position {
                self.confirmed = self.confirmed.max(position);
            }
            self.highest = self.highest.max(self.confirmed);
            if let Some(commit) = front.commit_micros {
                self.highest_commit_micros =
                    Some(self.highest_commit_micros.map_or(commit, |c| c.max(commit)));
            }
            self.confirmable_unreported += front.finished_events;
        }
        self.first_id += confirmable as u64;
        self.merge_held_prefix();
        self.confirmed
    }

    /// Under a hold, the finished transactions at the front (all below the hold: `advance` pops up to the
    /// last one at or past it) become one entry at the last one's position, so that memory stays flat
    /// however many the hold keeps waiting. Ids of the entries behind them do not change.
    fn merge_held_prefix(&mut self) {
        let finished = self
            .entries
            .iter()
            .take_while(|entry| entry.position.is_some() && entry.pending_events == 0)
            .count();
        if finished < 2 {
            return;
        }
        let merged = self
            .entries
            .drain(..finished)
            .reduce(|earlier, later| Entry {
                position: later.position,
                pending_events: 0,
                finished_events: earlier.finished_events + later.finished_events,
                commit_micros: earlier.commit_micros.max(later.commit_micros),
            });
        if let Some(merged) = merged {
            self.entries.push_front(merged);
        }
        self.first_id += finished as u64 - 1;
    }

    /// Transactions and markers not yet confirmed.
    pub fn unconfirmed_entries(&self) -> usize {
        self.entries.len()
    }

    fn entry_mut(&mut self, txn: TxnId) -> Option<&mut Entry> {
        let index = txn.0.checked_sub(self.first_id)?;
        self.entries.get_mut(usize::try_from(index).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_events_count_as_unreported_until_their_position_was_sent() {
        let mut w = Watermark::new(Lsn(100));
        let t1 = w.begin();
        w.event_started(t1);
        w.event_started(t1);
        w.commit(t1, Lsn(200));
        let t2 = w.begin();
        w.event_started(t2);
        w.commit(t2, Lsn(300));
        w.event_finished(t2);
        w.event_finished(t1);
        assert_eq!(w.unreported_events(), 2);
        assert_eq!(w.advance(), Lsn(100));
        w.reported();
        assert_eq!(w.unreported_events(), 2, "nothing confirmable was sent");
        w.event_finished(t1);
        assert_eq!(w.advance(), Lsn(300));
        assert_eq!(w.unreported_events(), 3, "confirmable, not sent yet");
        w.reported();
        assert_eq!(w.unreported_events(), 0);
        // The open transaction's finished events count from its Commit on.
        let t3 = w.begin();
        w.event_started(t3);
        w.event_started(t3);
        w.event_finished(t3);
        assert_eq!(w.unreported_events(), 0);
        w.commit(t3, Lsn(400));
        assert_eq!(w.unreported_events(), 1);
        w.event_finished(t3);
        assert_eq!(w.unreported_events(), 2);
        w.restart();
        assert_eq!(
            w.unreported_events(),
            0,
            "a restart re-sends everything anyway"
        );
    }

    #[test]
    fn a_hold_confirms_nothing_between_the_confirmed_position_and_it() {
        let mut w = Watermark::new(Lsn(100));
        let t1 = w.begin();
        w.event_started(t1);
        w.commit(t1, Lsn(200));
        let t2 = w.begin();
        w.event_started(t2);
        w.commit(t2, Lsn(300));
        // t1's event is handed off by a write that ends at 350: neither 200 nor 300 may be confirmed.
        w.event_finished(t1);
        w.hold_until(Lsn(350));
        w.event_finished(t2);
        assert_eq!(w.advance(), Lsn(100));
        assert!(w.holding());
        assert_eq!(w.unreported_events(), 2, "held events stay unreported");
        w.keepalive(Lsn(340));
        assert_eq!(w.advance(), Lsn(100), "340 is still below the hold");
        w.keepalive(Lsn(360));
        assert_eq!(w.advance(), Lsn(360), "everything up to 360 at once");
        assert!(!w.holding());
        // A hold below the confirmed position holds nothing.
        w.hold_until(Lsn(300));
        assert!(!w.holding());
    }

    #[test]
    fn a_hold_ends_once_the_standbys_flushed_past_it() {
        let mut w = Watermark::new(Lsn(100));
        let t = w.begin();
        w.event_started(t);
        w.commit(t, Lsn(200));
        w.hold_until(Lsn(350));
        w.event_finished(t);
        w.standbys_flushed(Lsn(349));
        assert_eq!(
            w.advance(),
            Lsn(100),
            "a standby may still lack the write at 349"
        );
        w.standbys_flushed(Lsn(350));
        assert!(!w.holding());
        assert_eq!(w.advance(), Lsn(200));
    }

    #[test]
    fn a_provisional_hold_can_be_lowered_and_a_reconnect_drops_it() {
        let mut w = Watermark::new(Lsn(100));
        for end in [200, 300] {
            let t = w.begin();
            w.event_started(t);
            w.commit(t, Lsn(end));
            w.event_finished(t);
        }
        w.provisional_hold(Lsn(900));
        w.keepalive(Lsn(500));
        assert_eq!(w.advance(), Lsn(100), "500 is below the provisional hold");
        assert_eq!(w.unconfirmed_entries(), 1, "three held entries merged");
        assert_eq!(w.unreported_events(), 2);
        // The write was found to end at 450: the hold is lowered to it.
        w.hold_until(Lsn(450));
        w.provisional_hold(Lsn::ZERO);
        assert_eq!(w.advance(), Lsn(500));
        // A reconnect drops a provisional hold (what it stands for is sent again), not a hold.
        w.provisional_hold(Lsn(900));
        w.hold_until(Lsn(700));
        w.restart();
        assert!(w.holding());
        w.standbys_flushed(Lsn(700));
        assert!(!w.holding());
    }

    #[test]
    fn transactions_a_hold_keeps_waiting_take_one_entry() {
        let mut w = Watermark::new(Lsn(100));
        w.hold_until(Lsn(1_000_000));
        for i in 1..=10_000 {
            let t = w.begin();
            w.event_started(t);
            w.commit_at(t, Lsn(100 + i), i as i64);
            w.event_finished(t);
            assert_eq!(w.advance(), Lsn(100));
        }
        // An unfinished transaction behind them keeps its id.
        let open = w.begin();
        w.event_started(open);
        w.commit(open, Lsn(20_000));
        let later = w.begin();
        w.commit(later, Lsn(30_000));
        assert_eq!(w.advance(), Lsn(100));
        assert_eq!(w.unconfirmed_entries(), 3, "one merged entry, then two");
        assert_eq!(w.unreported_events(), 10_000);
        w.event_finished(open);
        w.keepalive(Lsn(1_000_000));
        assert_eq!(w.advance(), Lsn(1_000_000));
        w.reported();
        assert_eq!(w.unreported_events(), 0);
        assert_eq!(w.unconfirmed_entries(), 0);
    }

    #[test]
    fn a_hold_survives_a_reconnect_but_not_a_new_history() {
        let mut w = Watermark::new(Lsn(100));
        w.hold_until(Lsn(500));
        w.restart();
        let t = w.begin();
        w.commit(t, Lsn(400));
        assert_eq!(
            w.advance(),
            Lsn(100),
            "the re-sent transaction waits for the hold"
        );
        let t = w.begin();
        w.commit(t, Lsn(500));
        assert_eq!(w.advance(), Lsn(500));
        w.hold_until(Lsn(900));
        w.reset(Lsn(50));
        assert!(!w.holding());
        let t = w.begin();
        w.commit(t, Lsn(60));
        assert_eq!(w.advance(), Lsn(60));
    }

    #[test]
    fn confirms_only_the_finished_prefix() {
        let mut w = Watermark::new(Lsn(100));
        let t1 = w.begin();
        w.event_started(t1);
        w.event_started(t1);
        w.commit(t1, Lsn(200));
        let t2 = w.begin();
        w.event_started(t2);
        w.commit(t2, Lsn(300));

        // The later transaction finishing first confirms nothing.
        w.event_finished(t2);
        assert_eq!(w.advance(), Lsn(100));
        w.event_finished(t1);
        assert_eq!(w.advance(), Lsn(100), "t1 still has an unfinished event");
        w.event_finished(t1);
        assert_eq!(w.advance(), Lsn(300));
        assert_eq!(w.unconfirmed_entries(), 0);
    }

    #[test]
    fn uncommitted_transaction_is_never_confirmed() {
        let mut w = Watermark::new(Lsn(0));
        let t = w.begin();
        w.event_started(t);
        w.event_finished(t);
        assert_eq!(w.advance(), Lsn(0));
        w.commit(t, Lsn(50));
        assert_eq!(w.advance(), Lsn(50));
    }

    #[test]
    fn idle_keepalive_is_confirmed_when_nothing_is_in_flight() {
        let mut w = Watermark::new(Lsn(10));
        w.keepalive(Lsn(500));
        assert_eq!(w.advance(), Lsn(500));
        // A keepalive behind the confirmed position changes nothing.
        w.keepalive(Lsn(400));
        assert_eq!(w.advance(), Lsn(500));
    }

    #[test]
    fn keepalive_waits_behind_unfinished_transactions() {
        let mut w = Watermark::new(Lsn(0));
        let t = w.begin();
        w.event_started(t);
        w.commit(t, Lsn(100));
        w.keepalive(Lsn(900));
        assert_eq!(w.advance(), Lsn(0));
        w.event_finished(t);
        assert_eq!(w.advance(), Lsn(900));
    }

    #[test]
    fn keepalive_inside_an_open_transaction_is_ignored() {
        let mut w = Watermark::new(Lsn(0));
        let t = w.begin();
        w.keepalive(Lsn(900));
        w.commit(t, Lsn(100));
        assert_eq!(w.advance(), Lsn(100));
    }

    #[test]
    fn repeated_keepalives_do_not_grow_the_queue() {
        let mut w = Watermark::new(Lsn(0));
        let t = w.begin();
        w.event_started(t);
        w.commit(t, Lsn(100));
        for lsn in 200..300 {
            w.keepalive(Lsn(lsn));
        }
        assert!(w.unconfirmed_entries() <= 2);
        w.event_finished(t);
        assert_eq!(w.advance(), Lsn(299));
    }

    #[test]
    fn restart_keeps_confirmed_and_ignores_stale_ids() {
        let mut w = Watermark::new(Lsn(0));
        let t1 = w.begin();
        w.event_started(t1);
        w.commit(t1, Lsn(100));
        w.event_finished(t1);
        assert_eq!(w.advance(), Lsn(100));
        let stale = w.begin();
        w.event_started(stale);
        w.commit(stale, Lsn(200));
        w.restart();
        // A late ack for the abandoned transaction must not touch the new one.
        let fresh = w.begin();
        w.event_started(fresh);
        w.event_finished(stale);
        w.commit(fresh, Lsn(200));
        assert_eq!(w.advance(), Lsn(100));
        assert!(w.is_below_confirmed(Lsn(99)));
        assert!(!w.is_below_confirmed(Lsn(100)));
        w.event_finished(fresh);
        assert_eq!(w.advance(), Lsn(200));
    }

    #[test]
    fn transaction_whose_events_were_all_filtered_confirms_at_commit() {
        let mut w = Watermark::new(Lsn(0));
        let t = w.begin();
        w.commit(t, Lsn(42));
        assert_eq!(w.advance(), Lsn(42));
    }

    #[test]
    fn confirmed_never_moves_backwards_within_a_session() {
        let mut w = Watermark::new(Lsn(1000));
        let t = w.begin();
        w.commit(t, Lsn(500));
        assert_eq!(w.advance(), Lsn(1000));
    }

    #[test]
    fn resuming_behind_the_highest_position_reports_the_slot_and_recognises_resent_transactions() {
        let mut w = Watermark::new(Lsn(0));
        let t = w.begin();
        w.commit_at(t, Lsn(1000), 5_000);
        assert_eq!(w.advance(), Lsn(1000));
        // The server came back with the slot at 400 (PG 15 after a restart, or a restored snapshot).
        w.resume_at(Lsn(400));
        assert_eq!(w.confirmed(), Lsn(400), "report the slot's own position");
        assert_eq!(w.highest_confirmed(), Lsn(1000));
        assert!(w.is_resent(Lsn(999), 5_000), "committed no later: re-sent");
        assert!(w.is_resent(Lsn(500), 4_000));
        assert!(
            !w.is_resent(Lsn(999), 5_001),
            "committed later at an old position: new"
        );
        assert!(
            !w.is_resent(Lsn(1000), 4_000),
            "at or past the position: new"
        );
        let resent = w.begin();
        w.commit(resent, Lsn(700));
        assert_eq!(w.advance(), Lsn(700));
        assert_eq!(w.highest_confirmed(), Lsn(1000));
        // A slot another instance moved ahead raises both, and leaves no commit time to compare with.
        w.resume_at(Lsn(1500));
        assert_eq!(
            (w.confirmed(), w.highest_confirmed()),
            (Lsn(1500), Lsn(1500))
        );
        assert!(!w.is_resent(Lsn(999), 4_000));
    }

    #[test]
    fn reset_forgets_the_old_history() {
        let mut w = Watermark::new(Lsn(0));
        let t = w.begin();
        w.commit_at(t, Lsn(1000), 5_000);
        w.advance();
        w.reset(Lsn(10));
        assert_eq!((w.confirmed(), w.highest_confirmed()), (Lsn(10), Lsn(10)));
        assert!(!w.is_resent(Lsn(5), 1));
    }

    #[test]
    fn nothing_is_taken_for_resent_before_a_transaction_was_confirmed() {
        // After a restart of outboxd itself the slot's position is known but no commit time.
        let mut w = Watermark::new(Lsn(0));
        w.resume_at(Lsn(1000));
        assert!(!w.is_resent(Lsn(500), 0));
    }
}
