//! When the background thread wakes: how it waits for the next command (polling briefly after
//! a submission, then asleep) and how soon it votes again while tensors wait.

use std::time::Instant;

use crossbeam::channel::{Receiver, RecvTimeoutError};

use crate::runtime::Command;

/// How long the background thread polls (when polling is on) for the next submission after one arrived, instead
/// of sleeping: a framework submits a step's gradients in a burst, and waking a sleeping
/// thread costs every submitter a system call, longer than the rest of an enqueue
/// (BENCHMARKS.md, "Figures moved out of comments").
pub(crate) const POLL_AFTER_SUBMIT: std::time::Duration = std::time::Duration::from_micros(200);

/// The next command before `deadline`: polled (yielding the core between polls) until
/// `poll_until`, then waited for asleep. `Ok(None)`: none came.
pub(crate) fn next_command(
    rx: &Receiver<Command>,
    deadline: Instant,
    poll_until: Instant,
) -> std::result::Result<Option<Command>, RecvTimeoutError> {
    loop {
        match rx.try_recv() {
            Ok(cmd) => return Ok(Some(cmd)),
            Err(crossbeam::channel::TryRecvError::Disconnected) => {
                return Err(RecvTimeoutError::Disconnected);
            }
            Err(crossbeam::channel::TryRecvError::Empty) => {}
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        if now >= poll_until {
            return match rx.recv_timeout(deadline - now) {
                Ok(cmd) => Ok(Some(cmd)),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(e) => Err(e),
            };
        }
        std::thread::yield_now();
    }
}

/// How soon to vote again while tensors wait (`waiting`): at once after a vote that ran
/// batches, else after the last delay doubled, from 20 us up to the cycle time. Zero (the
/// cycle timer rules) when nothing waits.
pub(crate) fn revote_delay(
    waiting: bool,
    progressed: bool,
    last: std::time::Duration,
    cycle: std::time::Duration,
) -> std::time::Duration {
    if !waiting || progressed {
        return std::time::Duration::ZERO;
    }
    (last * 2)
        .max(std::time::Duration::from_micros(20))
        .min(cycle)
}

#[cfg(test)]
mod tests {
    use super::{next_command, revote_delay};
    use crate::runtime::Command;
    use crossbeam::channel::{RecvTimeoutError, unbounded};
    use std::time::{Duration, Instant};

    #[test]
    fn next_command_polls_then_sleeps_until_the_deadline() {
        let ms = Duration::from_millis;
        let (tx, rx) = unbounded();
        // nothing comes: none at the deadline, after polling part of the time
        let t = Instant::now();
        assert!(matches!(next_command(&rx, t + ms(3), t + ms(1)), Ok(None)));
        assert!(t.elapsed() >= ms(3));
        // a command that comes while polling, and one that comes while asleep
        for poll in [ms(500), Duration::ZERO] {
            let tx2 = tx.clone();
            let sender = std::thread::spawn(move || {
                std::thread::sleep(ms(2));
                tx2.send(Command::Shutdown).unwrap();
            });
            let t = Instant::now();
            let got = next_command(&rx, t + ms(5000), t + poll);
            assert!(matches!(got, Ok(Some(Command::Shutdown))), "poll {poll:?}");
            assert!(t.elapsed() < ms(4000));
            sender.join().unwrap();
        }
        // a command already there is returned even past the deadline
        tx.send(Command::Shutdown).unwrap();
        let past = Instant::now() - ms(1);
        assert!(matches!(next_command(&rx, past, past), Ok(Some(_))));
        drop(tx);
        assert!(matches!(
            next_command(&rx, Instant::now() + ms(5), Instant::now()),
            Err(RecvTimeoutError::Disconnected)
        ));
    }

    #[test]
    fn revote_backs_off_to_the_cycle_time_and_resets_on_progress() {
        let ms = Duration::from_millis(1);
        let us = Duration::from_micros;
        let mut d = Duration::ZERO;
        let mut seen = Vec::new();
        for _ in 0..8 {
            d = revote_delay(true, false, d, ms);
            seen.push(d);
        }
        assert_eq!(
            &seen[..7],
            &[us(20), us(40), us(80), us(160), us(320), us(640), ms]
        );
        assert_eq!(revote_delay(true, true, d, ms), Duration::ZERO);
        assert_eq!(revote_delay(false, false, d, ms), Duration::ZERO);
        // a zero cycle time (HOROVOD_CYCLE_TIME=0) never waits
        assert_eq!(
            revote_delay(true, false, us(20), Duration::ZERO),
            Duration::ZERO
        );
    }
}
