//! perftest's report formats and statistics.

use std::time::Duration;

use hdrhistogram::Histogram;

/// One bandwidth result row.
#[derive(Debug, Clone, Copy)]
pub struct BwRow {
    pub bytes: u64,
    pub iters: u64,
    /// Bytes per second, best window.
    pub peak: f64,
    /// Bytes per second, whole run.
    pub avg: f64,
    /// Messages per second.
    pub msg_rate: f64,
}

pub fn bw_header(gbits: bool) -> String {
    let unit = if gbits { "Gb/sec" } else { "MiB/sec" };
    format!(" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]")
}

fn bw_unit(v: f64, gbits: bool) -> f64 {
    if gbits {
        v * 8.0 / 1e9
    } else {
        v / (1u64 << 20) as f64
    }
}

pub fn bw_line(r: &BwRow, gbits: bool) -> String {
    format!(
        " {:<10} {:<10}       {:.2}             {:.2}  \t\t   {:.6}",
        r.bytes,
        r.iters,
        bw_unit(r.peak, gbits),
        bw_unit(r.avg, gbits),
        r.msg_rate / 1e6
    )
}

/// Bandwidth from completion stamps `(seconds since start, messages completed)` of equally sized
/// messages: peak = the best of 5 equal time slices of the run (completions are observed in
/// bursts, so finer slices overstate it), average = the whole run.
pub fn bw_from(bytes: u64, completions: &[(f64, u64)], elapsed: f64) -> BwRow {
    let n: u64 = completions.iter().map(|c| c.1).sum();
    let slices = 5usize;
    let mut per = [0u64; 5];
    if elapsed > 0.0 {
        for &(t, k) in completions {
            let i = ((t / elapsed) * slices as f64) as usize;
            per[i.min(slices - 1)] += k;
        }
    }
    let slice = elapsed / slices as f64;
    tracing::debug!(?per, elapsed, "completions per fifth of the run");
    let mut peak: f64 = 0.0;
    if slice > 0.0 {
        for &c in &per {
            peak = peak.max((c * bytes) as f64 / slice);
        }
    }
    let avg = (n * bytes) as f64 / elapsed;
    BwRow {
        bytes,
        iters: n,
        peak: peak.max(avg),
        avg,
        msg_rate: n as f64 / elapsed,
    }
}

/// One latency result row (microseconds).
#[derive(Debug, Clone, Copy)]
pub struct LatRow {
    pub bytes: u64,
    pub iters: u64,
    pub min: f64,
    pub max: f64,
    pub typical: f64,
    pub avg: f64,
    pub stdev: f64,
    pub p99: f64,
    pub p999: f64,
}

pub fn lat_header() -> &'static str {
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
}

pub fn lat_line(r: &LatRow) -> String {
    format!(
        " {:<7} {:<10}   {:<7.2}        {:<7.2}      {:<7.2}     \t       {:<7.2}     \t{:<7.2}   \t\t{:<7.2}   \t\t{:<7.2}",
        r.bytes, r.iters, r.min, r.max, r.typical, r.avg, r.stdev, r.p99, r.p999
    )
}

/// Durations (recorded in nanoseconds, 3 significant digits) and their statistics in
/// microseconds, from an HDR histogram.
#[derive(Debug, Clone)]
pub struct Durations(Histogram<u64>);

impl Default for Durations {
    fn default() -> Self {
        // An auto-resizing histogram from 1 ns; 3 significant digits are always valid.
        Durations(Histogram::new(3).expect("a histogram of 3 significant digits"))
    }
}

impl FromIterator<Duration> for Durations {
    fn from_iter<I: IntoIterator<Item = Duration>>(it: I) -> Self {
        let mut h = Durations::default();
        for d in it {
            h.record(d);
        }
        h
    }
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

impl Durations {
    pub fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        if self.0.record(ns).is_err() {
            // Beyond what the histogram can grow to: counted at its highest value.
            self.0.saturating_record(ns);
        }
    }

    /// How many durations were recorded.
    pub fn len(&self) -> u64 {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The shortest (to the histogram's precision); 0 when there are none.
    pub fn min_us(&self) -> f64 {
        us(self.0.min())
    }

    /// The longest (to the histogram's precision); 0 when there are none.
    pub fn max_us(&self) -> f64 {
        if self.is_empty() {
            0.0
        } else {
            us(self.0.max())
        }
    }

    pub fn mean_us(&self) -> f64 {
        self.0.mean() / 1e3
    }

    /// Standard deviation (of the population).
    pub fn stdev_us(&self) -> f64 {
        self.0.stdev() / 1e3
    }

    /// Nearest-rank quantile `q` (0..=1); 0 when there are none.
    pub fn quantile_us(&self, q: f64) -> f64 {
        us(self.0.value_at_quantile(q))
    }
}

/// Latency statistics of `samples`, each divided by `div` (2 for ping-pong one-way figures):
/// t_typical is the median, as perftest's.
pub fn lat_from(bytes: u64, samples: &[Duration], div: f64) -> LatRow {
    let h: Durations = samples.iter().copied().collect();
    LatRow {
        bytes,
        iters: h.len(),
        min: h.min_us() / div,
        max: h.max_us() / div,
        typical: h.quantile_us(0.5) / div,
        avg: h.mean_us() / div,
        stdev: h.stdev_us() / div,
        p99: h.quantile_us(0.99) / div,
        p999: h.quantile_us(0.999) / div,
    }
}

pub fn bw_json(rows: &[BwRow], gbits: bool) -> String {
    let r: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"MsgSize\": {}, \"n_iterations\": {}, \"BW_peak\": {:.2}, \"BW_average\": {:.2}, \"MsgRate\": {:.6}}}",
                r.bytes,
                r.iters,
                bw_unit(r.peak, gbits),
                bw_unit(r.avg, gbits),
                r.msg_rate / 1e6
            )
        })
        .collect();
    format!("{{\"results\": [{}]}}\n", r.join(", "))
}

pub fn lat_json(rows: &[LatRow]) -> String {
    let r: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"MsgSize\": {}, \"n_iterations\": {}, \"t_min\": {:.2}, \"t_max\": {:.2}, \"t_typical\": {:.2}, \"t_avg\": {:.2}, \"t_stdev\": {:.2}, \"percentile_99\": {:.2}, \"percentile_99_9\": {:.2}}}",
                r.bytes, r.iters, r.min, r.max, r.typical, r.avg, r.stdev, r.p99, r.p999
            )
        })
        .collect();
    format!("{{\"results\": [{}]}}\n", r.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_and_latency_statistics() {
        // 100 messages of 1 MiB, one every 10 ms: 100 MiB/s on average and at peak.
        let t: Vec<(f64, u64)> = (1..=100).map(|i| ((i as f64 - 0.5) * 0.01, 1)).collect();
        let r = bw_from(1 << 20, &t, 1.0);
        assert!((r.avg / (1u64 << 20) as f64 - 100.0).abs() < 1e-9);
        assert!((r.peak / (1u64 << 20) as f64 - 100.0).abs() < 1e-6);
        assert!((r.msg_rate - 100.0).abs() < 1e-9);
        assert!(bw_line(&r, false).contains("100.00"));
        assert!(bw_line(&r, true).contains("0.84"), "{}", bw_line(&r, true));
        // 1..=1000 us round trips, reported one-way: exact where the histogram's buckets are
        // single nanoseconds (below 2048 ns), else within its 3 significant digits.
        let s: Vec<Duration> = (1..=1000).map(Duration::from_micros).collect();
        let l = lat_from(2, &s, 2.0);
        let close = |a: f64, b: f64| (a - b).abs() <= b * 1e-3;
        assert_eq!((l.iters, l.min), (1000, 0.5), "{l:?}");
        assert!(close(l.max, 500.0) && l.max >= 500.0, "{l:?}");
        assert!(close(l.typical, 250.0), "{l:?}");
        assert!(close(l.avg, 250.25), "{l:?}");
        assert!(close(l.stdev, 144.337), "{l:?}");
        assert!(close(l.p99, 495.0) && close(l.p999, 499.5), "{l:?}");
        // A tail: 1 % of 100 us among 2 us ones moves the 99.9th percentile, not the 99th.
        let tail: Durations = (0..1000)
            .map(|i| Duration::from_micros(if i % 100 == 0 { 100 } else { 2 }))
            .collect();
        assert_eq!(tail.quantile_us(0.5), 2.0);
        assert_eq!(tail.quantile_us(0.99), 2.0);
        assert!(close(tail.quantile_us(0.999), 100.0));
        assert_eq!((tail.min_us(), tail.len()), (2.0, 1000));
        let none = Durations::default();
        assert_eq!(
            (
                none.min_us(),
                none.max_us(),
                none.mean_us(),
                none.quantile_us(0.99)
            ),
            (0.0, 0.0, 0.0, 0.0)
        );
        assert!(lat_header().contains("t_typical[usec]") && bw_header(true).contains("Gb/sec"));
        assert!(bw_json(&[r], false).contains("\"BW_average\": 100.00"));
    }
}
