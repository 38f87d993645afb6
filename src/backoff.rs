//! Capped exponential backoff with jitter, for reconnects and startup retries. Pure apart from the
//! random jitter source.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// Retry delays that double per attempt from `base` up to `cap`, with jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    /// Starts at attempt 0: the first delay is `base` (before jitter).
    pub fn new(base: Duration, cap: Duration) -> Self {
        Backoff {
            base,
            cap,
            attempt: 0,
        }
    }

    /// The delay before the next attempt: `base * 2^attempt`, capped, then scaled by a random factor in
    /// [0.5, 1.0] so that many clients do not retry in lockstep.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.delay_without_jitter();
        self.attempt = self.attempt.saturating_add(1);
        delay.mul_f64(0.5 + random_fraction() / 2.0)
    }

    /// The delay of the next attempt before jitter: `base * 2^attempt`, at most `cap`.
    pub fn delay_without_jitter(&self) -> Duration {
        let factor = 2u32.saturating_pow(self.attempt.min(30));
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// Starts over from `base` (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// A random number in [0, 1) from the standard library's randomly keyed hasher.
fn random_fraction() -> f64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Delay before retry number `attempts` (1-based) of a failed event: `base * 2^(attempts-1)`, capped, with
/// jitter in [0.5, 1.0] of that.
pub fn retry_delay(base: Duration, cap: Duration, attempts: i32) -> Duration {
    let mut backoff = Backoff::new(base, cap);
    backoff.attempt = attempts.saturating_sub(1).max(0) as u32;
    backoff.next_delay()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_exponentially_up_to_the_cap() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let expected = [100, 200, 400, 800, 1000, 1000];
        for ms in expected {
            assert_eq!(b.delay_without_jitter(), Duration::from_millis(ms));
            let jittered = b.next_delay();
            assert!(
                jittered >= Duration::from_millis(ms / 2) && jittered <= Duration::from_millis(ms),
                "{jittered:?}"
            );
        }
        b.reset();
        assert_eq!(b.delay_without_jitter(), Duration::from_millis(100));
    }

    #[test]
    fn never_overflows() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        for _ in 0..100 {
            b.next_delay();
        }
        assert_eq!(b.delay_without_jitter(), Duration::from_secs(30));
    }

    #[test]
    fn retry_delay_doubles_per_attempt_and_is_capped() {
        let base = Duration::from_secs(1);
        let cap = Duration::from_secs(60);
        for (attempts, full) in [(1, 1), (2, 2), (3, 4), (7, 60), (40, 60)] {
            let delay = retry_delay(base, cap, attempts);
            let full = Duration::from_secs(full);
            assert!(
                delay >= full / 2 && delay <= full,
                "attempt {attempts}: {delay:?}"
            );
        }
    }
}
