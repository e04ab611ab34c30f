//! The per-hop breakdown of write_lat (built with `--features probes`, run by
//! `perf/benches/latency-breakdown`): rixl's probe stamps along one transfer's path, as spans
//! between consecutive points, medians over the run. Without the feature nothing is recorded or
//! printed.

use rixl::runtime::probe::{self, Point};

use super::cycles::Stopwatch;

/// The spans, in path order: (name, from, to). `None` is the ping's own stamps. A lone transfer
/// (one descriptor a side, one request: every `write_lat` hop, prepared or not) opens its slot
/// inside the core's one call, so for it the slot and keep-alive fall into the second span
/// ("credits -> first work request"), and the first covers only the checks before that call.
const SPANS: [(&str, Option<Point>, Option<Point>); 9] = [
    (
        "pre: ping start -> Engine::transfer/post",
        None,
        Some(Point::Entry),
    ),
    (
        "pre: checks, plan, slot + keep-alive",
        Some(Point::Entry),
        Some(Point::SlotOpened),
    ),
    (
        "pre: credits -> first work request",
        Some(Point::SlotOpened),
        Some(Point::Building),
    ),
    (
        "pre: work request build",
        Some(Point::Building),
        Some(Point::Doorbell),
    ),
    (
        "doorbell (provider + syscall)",
        Some(Point::Doorbell),
        Some(Point::Rung),
    ),
    (
        "post: end posting + kick",
        Some(Point::Rung),
        Some(Point::Posted),
    ),
    (
        "post: reap the CQ + route",
        Some(Point::Posted),
        Some(Point::Reaped),
    ),
    ("post: result -> future returns", Some(Point::Reaped), None),
    ("wait for the reply flag", None, None),
];

/// Spans of every measured round.
#[derive(Debug, Default)]
pub struct Breakdown {
    rounds: Vec<[u64; SPANS.len()]>,
    flag_already_set: u64,
}

impl Breakdown {
    /// Records one round: `start` before the ping, `done` when its future returned, `detected`
    /// when the reply flag was seen.
    pub fn record(&mut self, start: u64, done: u64, detected: u64) {
        if !probe::ENABLED {
            return;
        }
        let p = probe::stamps();
        let at = |x: Option<Point>, ping: u64| x.map_or(ping, |x| p[x as usize]);
        let mut row = [0u64; SPANS.len()];
        for (k, (_, from, to)) in SPANS.iter().enumerate() {
            row[k] = at(*to, done).wrapping_sub(at(*from, start));
        }
        row[SPANS.len() - 1] = detected.wrapping_sub(done);
        self.rounds.push(row);
        self.flag_already_set += p[Point::FlagAlreadySet as usize];
    }

    /// Prints the medians (to stderr, `PROBE` lines).
    pub fn print(&self, sw: &Stopwatch) {
        if !probe::ENABLED || self.rounds.is_empty() {
            return;
        }
        eprintln!(
            "PROBE flag already there after the write: {} of {}",
            self.flag_already_set,
            self.rounds.len()
        );
        for (k, (name, ..)) in SPANS.iter().enumerate() {
            let v: Vec<u64> = self.rounds.iter().map(|r| r[k]).collect();
            let m = sw.median_us(&v);
            eprintln!("PROBE {k:2} median {m:7.2} us  {name}");
        }
    }
}
