//! Engine ids: every engine (and every core without a NIC, for its host regions) gets one, and
//! each region records the id of the engine it is registered with.

use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// A fresh engine id.
pub(crate) fn next_engine_id() -> u64 {
    NEXT_ENGINE.fetch_add(1, Ordering::Relaxed)
}
