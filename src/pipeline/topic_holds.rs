//! Topics the broker refused outright (the principal may not write them): for a while every event bound for
//! one goes to the polling path (which retries it with backoff and dead-letters it after --max-attempts)
//! instead of the producer, so that each new event does not cost the stream another refusal and restart.
//! Each new refusal of a topic holds it twice as long, up to a cap. Pure bookkeeping, no I/O.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// The first hold of a topic; every refusal after it doubles the hold, up to [`LONGEST_HOLD`].
pub const FIRST_HOLD: Duration = Duration::from_secs(30);
/// The longest hold of a topic.
pub const LONGEST_HOLD: Duration = Duration::from_secs(600);

/// Topics held back from the producer, and until when.
#[derive(Debug, Default)]
pub struct TopicHolds {
    /// Topic -> (held until, length of its latest hold).
    holds: HashMap<String, (Instant, Duration)>,
}

impl TopicHolds {
    /// Holds `topic` from `now`; returns how long.
    pub fn hold(&mut self, topic: &str, now: Instant) -> Duration {
        let length = match self.holds.get(topic) {
            Some((_, previous)) => (*previous * 2).min(LONGEST_HOLD),
            None => FIRST_HOLD,
        };
        self.holds.insert(topic.to_string(), (now + length, length));
        length
    }

    /// Whether `topic` is held at `now`.
    pub fn is_held(&self, topic: &str, now: Instant) -> bool {
        !self.holds.is_empty() && self.holds.get(topic).is_some_and(|(until, _)| *until > now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_topic_is_held_for_a_while_then_tried_again() {
        let mut holds = TopicHolds::default();
        let now = Instant::now();
        assert!(!holds.is_held("orders", now));
        assert_eq!(holds.hold("orders", now), FIRST_HOLD);
        assert!(holds.is_held("orders", now + FIRST_HOLD / 2));
        assert!(!holds.is_held("payments", now));
        assert!(!holds.is_held("orders", now + FIRST_HOLD));
    }

    #[test]
    fn every_new_refusal_doubles_the_hold_up_to_the_cap() {
        let mut holds = TopicHolds::default();
        let now = Instant::now();
        let lengths: Vec<Duration> = (0..8).map(|_| holds.hold("orders", now)).collect();
        assert_eq!(lengths[0], FIRST_HOLD);
        assert_eq!(lengths[1], FIRST_HOLD * 2);
        assert_eq!(lengths[2], FIRST_HOLD * 4);
        assert_eq!(*lengths.last().unwrap(), LONGEST_HOLD);
    }
}
