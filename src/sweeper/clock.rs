//! The database clock as a sweep reads it, once per batch ([`BatchClock`]).
//!
//! `Store::now` answers with the database's time at some instant between the question and the
//! answer. So, counted on this process's monotonic clock, the database's time now is at most
//! that answer plus the time since the question was sent, and at least the answer plus the
//! time since it came back. A slow answer (a loaded database, a paused process) widens the
//! gap; each decision takes the bound that errs on its safe side:
//!
//! * "is the provider's window still open?" (re-drive, resume cut-off): [`BatchClock::latest`],
//!   so a window is never taken to be open after it closed;
//! * "has enough time passed?" (search lag, processing window): [`BatchClock::earliest`], so a
//!   lookup's empty answer is never trusted before the lag has passed.

use chrono::{DateTime, Utc};
use std::time::Instant;

/// One reading of the database clock, with when it was asked for and when it came back.
#[derive(Debug, Clone, Copy)]
pub(super) struct BatchClock {
    /// What `Store::now` answered.
    pub(super) db_now: DateTime<Utc>,
    /// When it was asked (this process's clock).
    pub(super) asked: Instant,
    /// When the answer came back.
    pub(super) answered: Instant,
}

impl BatchClock {
    /// The database's time now, at the latest.
    pub(super) fn latest(&self) -> DateTime<Utc> {
        self.db_now + since(self.asked)
    }

    /// The database's time now, at the earliest.
    pub(super) fn earliest(&self) -> DateTime<Utc> {
        self.db_now + since(self.answered)
    }
}

fn since(at: Instant) -> chrono::Duration {
    chrono::Duration::from_std(at.elapsed()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_slow_answer_widens_the_bounds_on_both_sides() {
        let asked = Instant::now();
        std::thread::sleep(Duration::from_millis(30));
        let answered = Instant::now();
        let db_now = Utc::now();
        let clock = BatchClock {
            db_now,
            asked,
            answered,
        };
        let (earliest, latest) = (clock.earliest(), clock.latest());
        assert!(earliest >= db_now);
        assert!(latest - earliest >= chrono::Duration::milliseconds(30));
    }
}
