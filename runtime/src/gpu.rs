//! Device copies as futures: a CUDA copy enqueued on a stream completes when its event does; the
//! future polls `cuEventQuery` from the engine's core between other tasks (no thread blocks).

use std::time::{Duration, Instant};

use rixl_nvlink::ipc::{IpcError, PendingCopy};

/// Waits for `copy` on the current executor, yielding between polls.
///
/// # Errors
/// [`IpcError::Driver`] if the copy failed.
pub async fn wait_copy(mut copy: PendingCopy) -> Result<(), IpcError> {
    loop {
        if copy.poll()? {
            return Ok(());
        }
        futures_lite::future::yield_now().await;
    }
}

/// Polls (each followed by a yield) between two clock reads in [`wait_copy_for`].
const POLLS_PER_CLOCK_READ: u32 = 64;

/// [`wait_copy`] for at most `timeout`. Past it, the answer is [`IpcError::Timeout`] and the
/// copies are left to finish in a detached task on this executor, which keeps their memory alive
/// until the GPU is done with it. It must run on a glommio executor (an engine's core).
///
/// # Errors
/// [`IpcError::Driver`] if the copy failed; [`IpcError::Timeout`] after `timeout`.
pub async fn wait_copy_for(mut copy: PendingCopy, timeout: Duration) -> Result<(), IpcError> {
    let deadline = Instant::now() + timeout;
    let mut polls = 0u32;
    loop {
        if copy.poll()? {
            return Ok(());
        }
        polls = polls.wrapping_add(1);
        // The clock is read at the first wait, then every few polls.
        if (polls == 1 || polls.is_multiple_of(POLLS_PER_CLOCK_READ)) && Instant::now() >= deadline
        {
            crate::supervise::spawn("device copy wait", async move {
                let _ = wait_copy(copy).await;
            });
            return Err(IpcError::Timeout(timeout));
        }
        futures_lite::future::yield_now().await;
    }
}
