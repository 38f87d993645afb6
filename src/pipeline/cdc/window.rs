//! The in-flight window: how much the session has read from the stream and not yet finished, by events
//! and by bytes. Reading stops while it is full.
//!
//! The events window also counts events finished but not yet reported to the server (a crash re-sends
//! them too, so the window bounds what a crash re-sends); the bytes window counts only what is in flight
//! (it bounds memory). Pure: the session counts, the watermark says how many finished events are
//! unreported.

#[derive(Debug)]
pub struct InFlightWindow {
    max_events: usize,
    max_bytes: usize,
    events: usize,
    bytes: usize,
}

impl InFlightWindow {
    pub fn new(max_events: usize, max_bytes: usize) -> Self {
        InFlightWindow {
            max_events,
            max_bytes,
            events: 0,
            bytes: 0,
        }
    }

    /// Events read and not finished.
    pub fn events(&self) -> usize {
        self.events
    }

    /// Room for another event, given `unreported` finished events the server was not told about.
    pub fn is_open(&self, unreported: u64) -> bool {
        let unreported = usize::try_from(unreported).unwrap_or(usize::MAX);
        self.events.saturating_add(unreported) < self.max_events && self.bytes < self.max_bytes
    }

    /// An event of `bytes` was read.
    pub fn start(&mut self, bytes: usize) {
        self.events += 1;
        self.bytes += bytes;
    }

    /// An event of `bytes` finished (acknowledged, handed off, skipped or dropped).
    pub fn finish(&mut self, bytes: usize) {
        self.events = self.events.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closes_at_either_bound_and_counts_unreported_events_against_the_events_bound() {
        let mut window = InFlightWindow::new(3, 1_000);
        window.start(10);
        window.start(10);
        assert!(window.is_open(0));
        assert!(!window.is_open(1), "2 in flight and 1 unreported fill 3");
        window.start(10);
        assert!(!window.is_open(0));
        window.finish(10);
        assert!(window.is_open(0));
        window.start(2_000);
        assert!(!window.is_open(0), "the bytes bound");
        window.finish(2_000);
        assert_eq!(window.events(), 2);
        assert!(window.is_open(0));
    }

    #[test]
    fn a_single_event_larger_than_the_bytes_bound_still_passes() {
        let mut window = InFlightWindow::new(10, 100);
        assert!(window.is_open(0));
        window.start(5_000);
        assert!(!window.is_open(0));
        window.finish(5_000);
        window.finish(5_000);
        assert_eq!(window.events(), 0, "never below zero");
        assert!(window.is_open(0));
    }
}
