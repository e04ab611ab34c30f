//! Arrival flags: waiting, on the engine's core, for a value that a peer's RDMA WRITE puts into
//! local registered memory. It is the cheapest "the data has landed" signal: no receive work
//! request and no completion at the target, only the peer's WRITE (perftest's `write_lat` detects
//! arrival the same way). The peer writes the flag after (or as the last bytes of) the data on the
//! same connection; RC places WRITEs in order.

use std::future::poll_fn;
use std::task::Poll;
use std::time::{Duration, Instant};

use crate::desc::Region;
use crate::error::{InvalidDescriptor, TransferError};

/// The value a flag must reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flag {
    /// One byte, at any offset.
    Byte(u8),
    /// An 8-byte word in native byte order, at an offset that is a multiple of 8 (read with one
    /// load, so never half old, half new). A sequence number here does not wrap.
    Word(u64),
}

/// Checks of the flag per poll of the waiting future, before it yields to other tasks.
const CHECKS_PER_POLL: u32 = 128;

/// How many polls between two clock reads (a clock read is a syscall on some clock sources).
const POLLS_PER_CLOCK_READ: u32 = 64;

impl Flag {
    /// Whether `host` holds this value at `off` (checked by [`Region::flag_memory`]).
    fn is_at(self, host: &rixl_verbs::HostBuffer, off: usize) -> bool {
        match self {
            Flag::Byte(v) => host.load_u8(off).is_ok_and(|x| x == v),
            Flag::Word(v) => host.load_u64(off).is_ok_and(|x| x == v),
        }
    }
}

impl Region {
    /// The host memory and offset of a flag like `expected` at `offset`, once checked.
    fn flag_memory(
        &self,
        offset: u64,
        expected: Flag,
    ) -> Result<(&rixl_verbs::HostBuffer, usize), InvalidDescriptor> {
        let host = self.host_memory().ok_or(InvalidDescriptor::NotHostMemory)?;
        let (len, align) = match expected {
            Flag::Byte(_) => (1, 1),
            Flag::Word(_) => (8, 8),
        };
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(InvalidDescriptor::OutOfRange {
                index: 0,
                offset,
                len,
                region_len: self.len(),
            });
        }
        if !offset.is_multiple_of(align) {
            return Err(InvalidDescriptor::Misaligned { offset, align });
        }
        Ok((host, offset as usize))
    }

    /// Whether the flag at `offset` holds `expected` now.
    ///
    /// # Errors
    /// [`InvalidDescriptor::NotHostMemory`] for GPU memory, [`InvalidDescriptor::OutOfRange`] or
    /// [`InvalidDescriptor::Misaligned`] for a bad offset.
    pub fn flag_is(&self, offset: u64, expected: Flag) -> Result<bool, InvalidDescriptor> {
        let (host, off) = self.flag_memory(offset, expected)?;
        Ok(expected.is_at(host, off))
    }
}

/// Completes when the flag at `offset` of `region` holds `expected`, spinning on the current
/// executor (other tasks, the engine's progress task included, run between spins).
///
/// # Errors
/// A bad region or offset (see [`Region::flag_is`]) before any wait;
/// [`TransferError::Timeout`] if the flag has not arrived within `timeout`.
pub async fn wait_flag(
    region: &Region,
    offset: u64,
    expected: Flag,
    timeout: Duration,
) -> Result<(), TransferError> {
    // Checked once; the spin below only loads.
    let (host, off) = region.flag_memory(offset, expected)?;
    if expected.is_at(host, off) {
        crate::probe::set(crate::probe::Point::FlagAlreadySet, 1);
        return Ok(());
    }
    crate::probe::set(crate::probe::Point::FlagAlreadySet, 0);
    // The clock starts after the first spins: a flag that arrives quickly costs no clock read.
    let mut start: Option<Instant> = None;
    let mut spins = 0u32;
    poll_fn(|cx| {
        // A short tight spin per poll: a yield through the executor costs several times one
        // check, and would add that much to the time to notice the flag.
        for _ in 0..CHECKS_PER_POLL {
            if expected.is_at(host, off) {
                return Poll::Ready(Ok(()));
            }
            std::hint::spin_loop();
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(POLLS_PER_CLOCK_READ) {
            let t0 = *start.get_or_insert_with(Instant::now);
            if t0.elapsed() >= timeout {
                return Poll::Ready(Err(TransferError::Timeout(timeout)));
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<F: std::future::Future>(f: F) -> F::Output {
        glommio::LocalExecutorBuilder::default()
            .io_memory(64 << 10)
            .make()
            .expect("executor")
            .run(f)
    }

    #[test]
    fn a_flag_set_by_another_task_completes_the_wait() {
        let r = Region::unregistered(4096).unwrap();
        let (r2, r3) = (r.clone(), r.clone());
        run(async move {
            let setter = glommio::spawn_local(async move {
                glommio::timer::sleep(Duration::from_millis(5)).await;
                r2.write_at(8, &42u64.to_ne_bytes()).unwrap();
                r2.write_at(4095, &[9]).unwrap();
            });
            wait_flag(&r3, 8, Flag::Word(42), Duration::from_secs(5))
                .await
                .unwrap();
            wait_flag(&r3, 4095, Flag::Byte(9), Duration::from_secs(5))
                .await
                .unwrap();
            setter.await;
        });
    }

    #[test]
    fn a_flag_that_never_arrives_times_out() {
        let r = Region::unregistered(4096).unwrap();
        let got =
            run(async move { wait_flag(&r, 0, Flag::Byte(1), Duration::from_millis(20)).await });
        assert_eq!(got, Err(TransferError::Timeout(Duration::from_millis(20))));
    }

    #[test]
    fn bad_offsets_are_typed_errors() {
        let r = Region::unregistered(4096).unwrap();
        assert!(matches!(
            r.flag_is(4096, Flag::Byte(0)),
            Err(InvalidDescriptor::OutOfRange { offset: 4096, .. })
        ));
        assert!(matches!(
            r.flag_is(u64::MAX, Flag::Word(0)),
            Err(InvalidDescriptor::OutOfRange { .. })
        ));
        assert_eq!(
            r.flag_is(12, Flag::Word(0)),
            Err(InvalidDescriptor::Misaligned {
                offset: 12,
                align: 8
            })
        );
        assert_eq!(r.flag_is(4088, Flag::Word(0)), Ok(true));
    }
}
