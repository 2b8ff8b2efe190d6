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
//! Pure: scores in, settings out — unit-tested without MPI.

use std::time::Duration;

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
