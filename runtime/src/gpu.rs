//! Device copies as futures: a CUDA copy enqueued on a stream completes when its event does; the
//! future polls `cuEventQuery` from the engine's core between other tasks (no thread blocks).

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
