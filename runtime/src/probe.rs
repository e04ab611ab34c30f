//! Latency probes (cargo feature `probes`, off by default): cycle-counter stamps at named points
//! of one transfer's path on the calling thread, read back by a benchmark after each transfer
//! (`perf/benches/latency-breakdown`), and optional busy delays just before or after the doorbell
//! (`RIXL_EXP_PRE` / `RIXL_EXP_POST`, in cycle-counter ticks) to show what lies on the critical
//! path. Without the feature every function here is empty and inlined away.

/// A point of the transfer path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Point {
    /// `Engine::transfer` or `Engine::post` was entered.
    Entry = 0,
    /// The in-flight slot is open (keep-alive taken).
    SlotOpened = 1,
    /// The first work request is being built.
    Building = 2,
    /// Just before the doorbell (`ibv_post_send`).
    Doorbell = 3,
    /// Just after it.
    Rung = 4,
    /// Posting ended (the future is about to wait).
    Posted = 5,
    /// The future's own reap of the CQ is done.
    Reaped = 6,
    /// The future has its result.
    Finished = 7,
    /// 1 if a flag was already set on its first check (`wait_flag`), else 0.
    FlagAlreadySet = 8,
}

/// Number of points.
pub const POINTS: usize = 9;

/// Where a busy delay is injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delay {
    /// Just before the doorbell (`RIXL_EXP_PRE`).
    BeforeDoorbell = 0,
    /// Just after it (`RIXL_EXP_POST`).
    AfterDoorbell = 1,
}

#[cfg(feature = "probes")]
mod imp {
    use std::cell::Cell;
    use std::sync::OnceLock;

    use super::{Delay, Point, POINTS};

    thread_local! {
        static STAMPS: Cell<[u64; POINTS]> = const { Cell::new([0; POINTS]) };
    }

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
            0
        }
    }

    #[inline]
    pub fn set(p: Point, v: u64) {
        STAMPS.with(|s| {
            let mut a = s.get();
            a[p as usize] = v;
            s.set(a);
        });
    }

    pub fn stamps() -> [u64; POINTS] {
        STAMPS.with(Cell::get)
    }

    pub fn delay(d: Delay) {
        static DELAYS: OnceLock<[u64; 2]> = OnceLock::new();
        let delays = DELAYS.get_or_init(|| {
            let get = |n: &str| {
                std::env::var(n)
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0u64)
            };
            [get("RIXL_EXP_PRE"), get("RIXL_EXP_POST")]
        });
        let n = delays[d as usize];
        if n > 0 {
            let t0 = ticks();
            while ticks().wrapping_sub(t0) < n {
                std::hint::spin_loop();
            }
        }
    }
}

/// Stamps `p` with the cycle counter (no-op without the `probes` feature).
#[inline]
pub fn stamp(p: Point) {
    #[cfg(feature = "probes")]
    imp::set(p, imp::ticks());
    #[cfg(not(feature = "probes"))]
    let _ = p;
}

/// Sets `p` to `v` (no-op without the `probes` feature).
#[inline]
pub fn set(p: Point, v: u64) {
    #[cfg(feature = "probes")]
    imp::set(p, v);
    #[cfg(not(feature = "probes"))]
    let _ = (p, v);
}

/// Busy-waits the delay configured for `d` (no-op without the `probes` feature).
#[inline]
pub fn delay(d: Delay) {
    #[cfg(feature = "probes")]
    imp::delay(d);
    #[cfg(not(feature = "probes"))]
    let _ = d;
}

/// This thread's stamps, by [`Point`] (all zero without the `probes` feature).
pub fn stamps() -> [u64; POINTS] {
    #[cfg(feature = "probes")]
    return imp::stamps();
    #[cfg(not(feature = "probes"))]
    [0; POINTS]
}

/// Whether the probes are compiled in.
pub const ENABLED: bool = cfg!(feature = "probes");
