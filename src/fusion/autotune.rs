//! Autotune (`HOROVOD_AUTOTUNE=1`): picks the fusion threshold and the cycle time that move the
//! most bytes per second in the running job.
//!
//! Method: coordinate search over a fixed grid. Each candidate is scored by the throughput the
//! job reached while it was in force (allreduced bytes per second over a sampling window,
//! median of `samples_per_candidate` windows, after `warmup` discarded windows); first every
//! fusion threshold at the starting cycle time, then every cycle time at the best threshold;
//! then the best pair stays. Windows in which nothing moved are not samples (an idle job says
//! nothing about the settings). Only rank 0 measures and decides; the background loop
//! broadcasts its choice to every rank at the same cycle, so ranks never fuse differently.
//! The tuner is pure — scores in, settings out — and unit-tested without MPI; `Windows` runs it
//! in the job, one broadcast per window.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::transport::Transport;

/// The settings autotune controls.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    pub fusion_threshold: usize,
    pub cycle_time: Duration,
}

const MIB: usize = 1 << 20;

/// Thresholds tried (bytes).
const THRESHOLDS: [usize; 7] = [
    MIB,
    2 * MIB,
    4 * MIB,
    16 * MIB,
    32 * MIB,
    64 * MIB,
    128 * MIB,
];
/// Cycle times tried (microseconds).
const CYCLES_US: [u64; 5] = [250, 500, 1000, 2500, 5000];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Warmup(usize),
    Thresholds,
    Cycles,
    Done,
}

pub struct Autotuner {
    phase: Phase,
    samples_per_candidate: usize,
    candidate: usize,
    scores: Vec<f64>,
    best_threshold: (usize, f64),
    best_cycle: (Duration, f64),
    current: Params,
    /// Every (settings, score) judged, for the log.
    pub history: Vec<(Params, f64)>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("finite scores"));
    v[v.len() / 2]
}

impl Autotuner {
    pub fn new(start: Params, warmup: usize, samples_per_candidate: usize) -> Autotuner {
        let mut t = Autotuner {
            phase: Phase::Warmup(warmup),
            samples_per_candidate: samples_per_candidate.max(1),
            candidate: 0,
            scores: Vec::new(),
            best_threshold: (start.fusion_threshold, f64::MIN),
            best_cycle: (start.cycle_time, f64::MIN),
            current: start,
            history: Vec::new(),
        };
        if warmup == 0 {
            t.enter_thresholds();
        }
        t
    }

    pub fn current(&self) -> Params {
        self.current
    }

    pub fn done(&self) -> bool {
        self.phase == Phase::Done
    }

    fn enter_thresholds(&mut self) {
        self.phase = Phase::Thresholds;
        self.candidate = 0;
        self.current.fusion_threshold = THRESHOLDS[0];
    }

    /// One window's throughput (bytes per second; windows with no traffic are skipped by the
    /// caller). Returns the settings for the next window.
    pub fn record(&mut self, score: f64) -> Params {
        match self.phase {
            Phase::Done => {}
            Phase::Warmup(left) => {
                if left <= 1 {
                    self.enter_thresholds();
                } else {
                    self.phase = Phase::Warmup(left - 1);
                }
            }
            Phase::Thresholds | Phase::Cycles => {
                self.scores.push(score);
                if self.scores.len() >= self.samples_per_candidate {
                    let s = median(&mut self.scores);
                    self.scores.clear();
                    self.history.push((self.current, s));
                    self.advance(s);
                }
            }
        }
        self.current
    }

    fn advance(&mut self, score: f64) {
        if self.phase == Phase::Thresholds {
            if score > self.best_threshold.1 {
                self.best_threshold = (self.current.fusion_threshold, score);
            }
            self.candidate += 1;
            if self.candidate < THRESHOLDS.len() {
                self.current.fusion_threshold = THRESHOLDS[self.candidate];
            } else {
                self.current.fusion_threshold = self.best_threshold.0;
                self.phase = Phase::Cycles;
                self.candidate = 0;
                self.current.cycle_time = Duration::from_micros(CYCLES_US[0]);
            }
            return;
        }
        if score > self.best_cycle.1 {
            self.best_cycle = (self.current.cycle_time, score);
        }
        self.candidate += 1;
        if self.candidate < CYCLES_US.len() {
            self.current.cycle_time = Duration::from_micros(CYCLES_US[self.candidate]);
        } else {
            self.current.cycle_time = self.best_cycle.0;
            self.phase = Phase::Done;
        }
    }
}

/// Autotune in the running job: counts the global set's cycles and, at the end of each
/// window, has rank 0 score it and every rank take rank 0's next settings.
pub struct Windows {
    tuner: Autotuner,
    /// Cycles per window (agreed).
    window: usize,
    cycles: usize,
    window_start: Instant,
    bytes_at_start: u64,
    /// Rank 0's log of every window's settings and score (`HOROVOD_AUTOTUNE_LOG`).
    log: Option<std::fs::File>,
}

/// What a window's end decided, identical on every rank.
pub struct Decision {
    pub params: Params,
    /// Tuning is over: no more windows (and no more broadcasts).
    pub done: bool,
    /// Bytes the broadcast carried (for metrics).
    pub control_bytes: u64,
}

impl Windows {
    pub fn new(start: Params, warmup: usize, window: usize, log: Option<std::fs::File>) -> Self {
        Windows {
            tuner: Autotuner::new(start, warmup, 3),
            window: window.max(1),
            cycles: 0,
            window_start: Instant::now(),
            bytes_at_start: 0,
            log,
        }
    }

    /// Counts one cycle of the global set; at a window's end, one broadcast over `ctrl` (every
    /// rank at the same cycle). `data_bytes`: the bytes this rank's collectives moved so far.
    pub fn cycle(
        &mut self,
        ctrl: &dyn Transport,
        data_bytes: impl Fn() -> u64,
        me: i32,
    ) -> Result<Option<Decision>> {
        if self.tuner.done() {
            return Ok(None);
        }
        if crate::config::test_fault("autotune", me) {
            return Err(Error::Internal("test fault: autotune".into()));
        }
        self.cycles += 1;
        if !self.cycles.is_multiple_of(self.window) {
            return Ok(None);
        }
        let mut mine = Vec::new();
        if ctrl.rank() == 0 {
            let moved = data_bytes() - self.bytes_at_start;
            let secs = self.window_start.elapsed().as_secs_f64();
            let before = self.tuner.current();
            let next = if moved > 0 && secs > 0.0 {
                let score = moved as f64 / secs;
                if let Some(f) = self.log.as_mut() {
                    use std::io::Write;
                    let _ = writeln!(
                        f,
                        "{},{:.3},{:.0}",
                        before.fusion_threshold,
                        before.cycle_time.as_secs_f64() * 1e3,
                        score
                    );
                }
                self.tuner.record(score)
            } else {
                before
            };
            mine.extend((next.fusion_threshold as u64).to_le_bytes());
            mine.extend((next.cycle_time.as_nanos() as u64).to_le_bytes());
            mine.push(u8::from(self.tuner.done()));
        }
        let got = ctrl.broadcast_bytes(mine, 0)?;
        if got.len() != 17 {
            return Err(Error::Internal(format!(
                "autotune: rank 0's settings came as {} bytes, not 17",
                got.len()
            )));
        }
        let word = |k: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&got[8 * k..8 * k + 8]);
            u64::from_le_bytes(b)
        };
        self.window_start = Instant::now();
        self.bytes_at_start = data_bytes();
        Ok(Some(Decision {
            params: Params {
                fusion_threshold: word(0) as usize,
                cycle_time: Duration::from_nanos(word(1)),
            },
            done: got[16] == 1,
            control_bytes: got.len() as u64,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job whose throughput peaks at 16 MiB and 1 ms, with noise.
    fn throughput(p: Params, noise: f64) -> f64 {
        let t = (p.fusion_threshold as f64 / (16.0 * MIB as f64)).log2();
        let c = (p.cycle_time.as_secs_f64() / 1e-3).log2();
        1e9 / (1.0 + t * t + 0.5 * c * c) * (1.0 + noise)
    }

    #[test]
    fn finds_the_best_grid_point_despite_noise() {
        let start = Params {
            fusion_threshold: 128 * MIB,
            cycle_time: Duration::from_millis(5),
        };
        let mut tuner = Autotuner::new(start, 2, 3);
        let mut p = tuner.current();
        let mut k = 0u64;
        while !tuner.done() {
            // deterministic pseudo-noise up to ±10 %, beaten by the median of three
            k = k
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let noise = if k.is_multiple_of(3) { 0.1 } else { -0.02 };
            p = tuner.record(throughput(p, noise));
        }
        assert_eq!(p.fusion_threshold, 16 * MIB);
        assert_eq!(p.cycle_time, Duration::from_millis(1));
        assert_eq!(tuner.history.len(), THRESHOLDS.len() + CYCLES_US.len());
        // once done, settings stay
        assert_eq!(tuner.record(1.0), p);
    }
}
