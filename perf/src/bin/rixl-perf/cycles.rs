//! rixl-perf's clock for latency samples and bandwidth stamps: the CPU's cycle counter, as
//! perftest's `get_cycles()`. A clock read through the OS is a syscall on some clock sources (an
//! emulated guest's HPET: 1.5-1.7 µs per `clock_gettime`, measured in the rxe guest), and two of
//! them per ping-pong round would sit on the measured path where perftest's cost nothing. The
//! counter's rate is measured against the monotonic clock over the run itself.

use std::time::{Duration, Instant};

/// The shortest span a rate is measured over (a shorter run waits for the rest).
const MIN_SPAN: Duration = Duration::from_millis(20);

/// The cycle counter now: `rdtsc` on x86_64, `cntvct_el0` on aarch64, elsewhere nanoseconds of
/// the monotonic clock.
#[inline]
pub fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        tick_counter::x86_64_tick_counter()
    }
    #[cfg(target_arch = "aarch64")]
    {
        tick_counter::aarch64_tick_counter()
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// A measurement span: ticks read within it convert to time at the rate measured over it.
#[derive(Debug, Clone, Copy)]
pub struct Stopwatch {
    at: Instant,
    ticks: u64,
}

impl Stopwatch {
    pub fn start() -> Self {
        Stopwatch {
            at: Instant::now(),
            ticks: ticks(),
        }
    }

    /// Ticks since the start.
    pub fn since_start(&self, t: u64) -> u64 {
        t.wrapping_sub(self.ticks)
    }

    /// The counter's rate in ticks per second since the start (blocks the thread for the rest
    /// of [`MIN_SPAN`] if less has passed).
    pub fn rate(&self) -> f64 {
        let spent = self.at.elapsed();
        if spent < MIN_SPAN {
            std::thread::sleep(MIN_SPAN - spent);
        }
        let (secs, n) = (self.at.elapsed().as_secs_f64(), self.since_start(ticks()));
        (n.max(1) as f64) / secs
    }

    /// `spans` (in ticks) as durations, at the rate measured since the start.
    pub fn durations(&self, spans: &[u64]) -> Vec<Duration> {
        let rate = self.rate();
        spans
            .iter()
            .map(|&t| Duration::from_secs_f64(t as f64 / rate))
            .collect()
    }

    /// The median of `spans` (in ticks), in microseconds.
    pub fn median_us(&self, spans: &[u64]) -> f64 {
        let d: super::stats::Durations = self.durations(spans).into_iter().collect();
        d.quantile_us(0.5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_convert_to_the_time_that_passed() {
        let sw = Stopwatch::start();
        let (at, t0) = (Instant::now(), ticks());
        std::thread::sleep(Duration::from_millis(30));
        let (span, real) = (ticks().wrapping_sub(t0), at.elapsed());
        let d = sw.durations(&[span])[0];
        // The same span by the monotonic clock, within 10 % (plus a millisecond for the reads).
        let slack = real / 10 + Duration::from_millis(1);
        assert!(
            d >= Duration::from_millis(29) && d + slack >= real && d <= real + slack,
            "a 30 ms sleep ({real:?} by the monotonic clock) measured as {d:?}"
        );
    }
}
