//! Transfer-time estimates per peer (NIXL's `estimateXferCost`), from the transfers that
//! completed: a least-squares fit of `time = fixed + bytes × per_byte + requests × per_request`
//! with exponential forgetting, so the model follows the link as it changes. Samples are
//! weighted by 1/time², so the fit minimises relative error: a 4 KiB transfer's estimate is
//! as good as an 8 MiB one's (unweighted, the large transfers' absolute errors would swamp the
//! small ones' whole duration). With too little
//! spread in the samples to separate the terms it falls back to fewer terms (bytes only, then
//! the mean rate).
//!
//! Slow outliers are not learned as they are: once the model gives estimates, a sample over
//! [`CLIP`]× its estimate is dropped, unless [`PERSIST`] such samples came in a row (then the
//! link really got slower and the sample is learned, clipped to [`CLIP`]× the estimate, a
//! bounded step each). A stall of the host or a retransmission then leaves the fit alone. Noise
//! on a link only ever adds time, so fast samples are learned whole: the slow first transfers of
//! a fresh connection are forgotten as soon as the warm ones arrive.

use std::time::Duration;

/// How much one sample weighs against the past (the newest ~1/(1-DECAY) samples dominate).
const DECAY: f64 = 0.97;
/// Samples before an estimate is given.
pub(crate) const MIN_SAMPLES: u64 = 4;
/// The most a sample may exceed the current estimate, as a factor, when it is learned.
const CLIP: f64 = 2.0;
/// Slow samples in a row after which they are learned (clipped): the link changed.
const PERSIST: u32 = 4;

/// One peer's model.
#[derive(Debug, Clone, Default)]
pub(crate) struct RateModel {
    samples: u64,
    /// Weighted sums of x xᵀ (x = [1, bytes, requests]) and of x t, each sample scaled by
    /// 1/t.
    xx: [[f64; 3]; 3],
    xt: [f64; 3],
    /// Decayed sums of time and bytes (the mean-rate fallback).
    time: f64,
    bytes: f64,
    /// Samples over `CLIP`x their estimate, in a row.
    slow_streak: u32,
}

impl RateModel {
    /// Records a transfer of `bytes` in `requests` pieces that took `took`.
    pub fn record(&mut self, bytes: u64, requests: usize, took: Duration) {
        let mut t = took.as_secs_f64();
        if t <= 0.0 || !t.is_finite() {
            return;
        }
        if self.samples >= 2 * MIN_SAMPLES {
            if let Some(e) = self.estimate(bytes, requests).map(|e| e.as_secs_f64()) {
                if e > 0.0 && t > e * CLIP {
                    self.slow_streak += 1;
                    if self.slow_streak < PERSIST {
                        return;
                    }
                    t = e * CLIP;
                } else {
                    self.slow_streak = 0;
                }
            }
        }
        // Relative error: the sample row and its target scaled by 1/t (the target becomes 1).
        let x = [1.0 / t, bytes as f64 / t, requests as f64 / t];
        for i in 0..3 {
            for j in 0..3 {
                self.xx[i][j] = self.xx[i][j] * DECAY + x[i] * x[j];
            }
            self.xt[i] = self.xt[i] * DECAY + x[i];
        }
        self.time = self.time * DECAY + t;
        self.bytes = self.bytes * DECAY + bytes as f64;
        self.samples += 1;
    }

    /// Samples recorded.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The estimated time of `bytes` in `requests` pieces, once enough samples are in.
    pub fn estimate(&self, bytes: u64, requests: usize) -> Option<Duration> {
        if self.samples < MIN_SAMPLES {
            return None;
        }
        let x = [1.0, bytes as f64, requests as f64];
        let fit = solve3(self.xx, self.xt)
            .filter(|c| c.iter().all(|v| v.is_finite()) && c[1] >= 0.0 && c[2] >= 0.0)
            .map(|c| c[0] + c[1] * x[1] + c[2] * x[2])
            .or_else(|| {
                let a = [
                    [self.xx[0][0], self.xx[0][1]],
                    [self.xx[1][0], self.xx[1][1]],
                ];
                solve2(a, [self.xt[0], self.xt[1]])
                    .filter(|c| c[1] >= 0.0)
                    .map(|c| c[0] + c[1] * x[1])
            })
            .or_else(|| {
                // The mean rate: total time over total bytes.
                (self.bytes > 0.0).then(|| self.time / self.bytes * x[1])
            })?;
        Some(Duration::from_secs_f64(fit.max(0.0)))
    }
}

/// Relative size below which a pivot counts as zero (the system is degenerate).
const SINGULAR: f64 = 1e-9;

fn solve2(a: [[f64; 2]; 2], b: [f64; 2]) -> Option<[f64; 2]> {
    let det = a[0][0] * a[1][1] - a[0][1] * a[1][0];
    let scale = (a[0][0] * a[1][1]).abs().max(f64::MIN_POSITIVE);
    if det.abs() <= SINGULAR * scale {
        return None;
    }
    Some([
        (b[0] * a[1][1] - a[0][1] * b[1]) / det,
        (a[0][0] * b[1] - b[0] * a[1][0]) / det,
    ])
}

/// Gaussian elimination with partial pivoting, on columns scaled to unit diagonal (bytes and
/// request counts differ by many orders of magnitude).
fn solve3(a: [[f64; 3]; 3], b: [f64; 3]) -> Option<[f64; 3]> {
    let s: Vec<f64> = (0..3)
        .map(|i| a[i][i].sqrt().max(f64::MIN_POSITIVE))
        .collect();
    let mut m = [[0.0; 4]; 3];
    for i in 0..3 {
        for j in 0..3 {
            m[i][j] = a[i][j] / (s[i] * s[j]);
        }
        m[i][3] = b[i] / s[i];
    }
    for col in 0..3 {
        let pivot = (col..3).max_by(|&x, &y| m[x][col].abs().total_cmp(&m[y][col].abs()))?;
        if m[pivot][col].abs() <= SINGULAR {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col];
        for (row, r) in m.iter_mut().enumerate() {
            if row != col {
                let f = r[col] / pivot_row[col];
                for (x, p) in r.iter_mut().zip(pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    Some([
        m[0][3] / m[0][0] / s[0],
        m[1][3] / m[1][1] / s[1],
        m[2][3] / m[2][2] / s[2],
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(bytes: u64, requests: usize) -> Duration {
        // 20 us fixed, 1 GB/s, 2 us per request.
        Duration::from_secs_f64(20e-6 + bytes as f64 / 1e9 + requests as f64 * 2e-6)
    }

    #[test]
    fn recovers_fixed_per_byte_and_per_request_costs() {
        let mut m = RateModel::default();
        assert_eq!(m.estimate(4096, 1), None, "no estimate before samples");
        for round in 0..5u64 {
            for (bytes, reqs) in [(4096, 1), (65536, 16), (1 << 20, 1), (8 << 20, 128)] {
                m.record(bytes + round, reqs, link(bytes, reqs));
            }
        }
        for (bytes, reqs) in [(4096, 1), (1 << 20, 256), (8 << 20, 1), (256 << 10, 64)] {
            let want = link(bytes, reqs).as_secs_f64();
            let got = m.estimate(bytes, reqs).unwrap().as_secs_f64();
            assert!(
                (got / want - 1.0).abs() < 0.01,
                "{bytes} B in {reqs}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn degenerate_samples_fall_back_to_fewer_terms_and_old_samples_fade() {
        // One request per transfer: the request term cannot be separated from the fixed one.
        let mut m = RateModel::default();
        for bytes in [4096u64, 1 << 20, 4 << 20, 8 << 20] {
            m.record(bytes, 1, link(bytes, 1));
        }
        let got = m.estimate(2 << 20, 1).unwrap().as_secs_f64();
        let want = link(2 << 20, 1).as_secs_f64();
        assert!((got / want - 1.0).abs() < 0.01, "{got} vs {want}");
        // All the same size: the mean rate.
        let mut same = RateModel::default();
        for _ in 0..4 {
            same.record(1 << 20, 1, Duration::from_millis(2));
        }
        let est = same.estimate(2 << 20, 1).unwrap();
        assert!(est >= Duration::from_millis(3) && est <= Duration::from_millis(5));
        // The link gets twice as slow: after a few dozen samples the estimate follows.
        for _ in 0..200 {
            for bytes in [4096u64, 1 << 20, 8 << 20] {
                m.record(bytes, 1, link(bytes, 1) * 2);
            }
        }
        let got = m.estimate(1 << 20, 1).unwrap().as_secs_f64();
        let want = 2.0 * link(1 << 20, 1).as_secs_f64();
        assert!((got / want - 1.0).abs() < 0.05, "{got} vs {want}");
    }

    #[test]
    fn stalls_move_the_estimate_a_bounded_step_and_a_real_change_is_still_followed() {
        let shapes = [(4096u64, 1usize), (65536, 16), (1 << 20, 1), (8 << 20, 128)];
        let mut m = RateModel::default();
        for _ in 0..10 {
            for (bytes, reqs) in shapes {
                m.record(bytes, reqs, link(bytes, reqs));
            }
        }
        // Three 4 KiB transfers stall for 100 ms each (the host was descheduled).
        for _ in 0..3 {
            m.record(4096, 1, Duration::from_millis(100));
        }
        for (bytes, reqs) in shapes {
            let want = link(bytes, reqs).as_secs_f64();
            let got = m.estimate(bytes, reqs).unwrap().as_secs_f64();
            assert!(
                (got / want - 1.0).abs() < 0.30,
                "{bytes} B in {reqs} after stalls: {got} vs {want}"
            );
        }
        // The link becomes ten times slower: clipping slows the step, not the destination.
        for _ in 0..300 {
            for (bytes, reqs) in shapes {
                m.record(bytes, reqs, link(bytes, reqs) * 10);
            }
        }
        for (bytes, reqs) in shapes {
            let want = 10.0 * link(bytes, reqs).as_secs_f64();
            let got = m.estimate(bytes, reqs).unwrap().as_secs_f64();
            assert!(
                (got / want - 1.0).abs() < 0.05,
                "{bytes} B in {reqs} after the change: {got} vs {want}"
            );
        }
    }
}
