//! perftest's report formats and statistics.

use std::time::Duration;

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

/// Nearest-rank percentile `p` (0..=1) of ascending `sorted` samples; 0 when there are none.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[(((sorted.len() as f64) * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// Sorts `v` and takes its percentile `p`.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(v, p)
}

/// Latency statistics of `samples`, each divided by `div` (2 for ping-pong one-way figures).
pub fn lat_from(bytes: u64, samples: &[Duration], div: f64) -> LatRow {
    let mut us: Vec<f64> = samples
        .iter()
        .map(|d| d.as_secs_f64() * 1e6 / div)
        .collect();
    us.sort_by(f64::total_cmp);
    let n = us.len().max(1) as f64;
    let avg = us.iter().sum::<f64>() / n;
    let var = us.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / n;
    let pct = |p: f64| percentile(&us, p);
    LatRow {
        bytes,
        iters: us.len() as u64,
        min: us[0],
        max: us[us.len() - 1],
        typical: us[us.len() / 2],
        avg,
        stdev: var.sqrt(),
        p99: pct(0.99),
        p999: pct(0.999),
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
        let s: Vec<Duration> = (1..=1000).map(Duration::from_micros).collect();
        let l = lat_from(2, &s, 2.0);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(l.min, 0.5) && close(l.max, 500.0), "{l:?}");
        assert!(close(l.typical, 250.5), "{l:?}");
        assert!(close(l.p99, 495.0) && close(l.p999, 499.5), "{l:?}");
        assert!(lat_header().contains("t_typical[usec]") && bw_header(true).contains("Gb/sec"));
        assert!(bw_json(&[r], false).contains("\"BW_average\": 100.00"));
    }
}
