//! Checks made before starting executors, so that a bad environment is a typed error instead of
//! glommio's panic or a silent fallback. Reads `/proc` only.

use std::fs;

use crate::error::RuntimeError;

/// Locked memory glommio needs per executor: its io_memory is registered in three rings, plus
/// the rings themselves.
pub fn memlock_needed(executors: usize, io_memory: usize) -> u64 {
    (executors as u64) * (3 * io_memory as u64 + (512 << 10))
}

/// Soft RLIMIT_MEMLOCK of this process in bytes (`None` = unlimited or unknown).
pub fn memlock_limit() -> Option<u64> {
    let limits = fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let soft = line.split_whitespace().nth(3)?;
    soft.parse().ok()
}

/// Whether this process has CAP_IPC_LOCK (then the memlock limit does not apply).
pub fn has_ipc_lock() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("CapEff:"))
                .and_then(|l| u64::from_str_radix(l.split_whitespace().nth(1)?, 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// Fails if io_uring is disabled or the memlock limit cannot fit `executors` executors.
///
/// # Errors
/// [`RuntimeError::IoUringDisabled`] or [`RuntimeError::MemlockTooLow`].
pub fn check(executors: usize, io_memory: usize) -> Result<(), RuntimeError> {
    if let Some(v) = fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
    {
        if v == 2 {
            return Err(RuntimeError::IoUringDisabled(v));
        }
    }
    check_memlock(
        memlock_limit(),
        has_ipc_lock(),
        memlock_needed(executors, io_memory),
    )
}

fn check_memlock(limit: Option<u64>, ipc_lock: bool, needed: u64) -> Result<(), RuntimeError> {
    match limit {
        Some(limit) if !ipc_lock && limit < needed => {
            Err(RuntimeError::MemlockTooLow { limit, needed })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_rules() {
        let need = memlock_needed(2, 64 << 10);
        assert_eq!(need, 2 * (3 * 65536 + 524288));
        assert!(check_memlock(Some(need - 1), false, need).is_err());
        assert!(
            check_memlock(Some(need - 1), true, need).is_ok(),
            "CAP_IPC_LOCK lifts the limit"
        );
        assert!(check_memlock(None, false, need).is_ok(), "unlimited");
        assert!(matches!(
            check_memlock(Some(8 << 20), false, 64 << 20),
            Err(RuntimeError::MemlockTooLow { limit, needed }) if limit == 8 << 20 && needed == 64 << 20
        ));
        // This machine: the reader works and the check agrees with it.
        let _ = memlock_limit();
        let _ = check(1, 64 << 10);
    }
}
