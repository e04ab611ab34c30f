//! Shows the glommio 0.9.0 executor parking with a task still runnable, and a wake from
//! another thread bringing it back (what the runtime's watchdog nudges do; see
//! `handle::nudge`).
//!
//! ```text
//! cargo run --release -p rixl-runtime --example glommio_park -- [PREEMPT_NS] [--nudge]
//! ```
//! The executor gets a preemption timer of PREEMPT_NS (default 30,000 ns), short enough that
//! it often fires between the loop's ring poll and its first preemption check: the loop then
//! reads "ran nothing" as "nothing to run" and parks, with a task that yields in a loop still
//! queued. A second task only leaves its waker for the nudger. With `--nudge`, a thread wakes
//! that task every 10 ms. It prints the yields done in the first second and in the next two:
//! a run that parked after it had started shows 0 in the next two seconds without nudges, and
//! keeps counting with them (a run that parked before the waker was left has nothing to nudge
//! with and shows 0 twice).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

fn main() {
    let mut args = std::env::args().skip(1);
    let preempt_ns: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(30_000);
    let nudge = args.next().is_some_and(|a| a == "--nudge");
    let waker: Arc<Mutex<Option<Waker>>> = Arc::default();
    let yields = Arc::new(AtomicU64::new(0));
    let (left, counted) = (Arc::clone(&waker), Arc::clone(&yields));
    let spawned = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .preempt_timer(Duration::from_nanos(preempt_ns))
        .spawn(move || async move {
            glommio::spawn_local(std::future::poll_fn(move |cx| {
                if let Ok(mut w) = left.lock() {
                    *w = Some(cx.waker().clone());
                }
                Poll::<()>::Pending
            }))
            .detach();
            loop {
                counted.fetch_add(1, Ordering::Relaxed);
                futures_lite::future::yield_now().await;
            }
        });
    if let Err(e) = spawned {
        eprintln!("glommio_park: the executor did not start: {e}");
        std::process::exit(1);
    }
    if nudge {
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(10));
            if let Some(w) = waker.lock().ok().and_then(|w| w.clone()) {
                w.wake();
            }
        });
    }
    std::thread::sleep(Duration::from_secs(1));
    let first = yields.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(2));
    let next = yields.load(Ordering::Relaxed) - first;
    println!(
        "preempt {preempt_ns} ns, nudges {}: {first} yields in the first second, {next} in the next two",
        if nudge { "on" } else { "off" }
    );
    // The executor never ends (its task loops or it is parked for good): exit without it.
    std::process::exit(0);
}
