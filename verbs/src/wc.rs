//! Work completions.

use std::fmt;

use crate::error::Error;
use crate::sys;

pub use rixl_proto::wire::{Completion, WcOpcode, WcStatus};

/// One work completion (`ibv_wc`), layout-compatible so a slice of them can be polled into.
#[repr(transparent)]
#[derive(Clone, Copy, Default)]
pub struct WorkCompletion(pub(crate) sys::ibv_wc);

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &format_args!("{:#x}", self.wr_id()))
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .finish()
    }
}

impl WorkCompletion {
    /// The id the work request was posted with.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// The status.
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.0.status)
    }

    /// Whether the status is success.
    pub fn is_success(&self) -> bool {
        self.0.status == sys::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// The completion as a `Result`: `Err(Error::Completion)` for an error status.
    ///
    /// # Errors
    /// [`Error::Completion`] with the status by name when it is not success.
    pub fn result(&self) -> Result<(), Error> {
        if self.is_success() {
            Ok(())
        } else {
            Err(Error::Completion {
                status: self.status(),
                wr_id: self.wr_id(),
                vendor_err: self.0.vendor_err,
            })
        }
    }

    /// The operation. Only meaningful for successful completions.
    pub fn opcode(&self) -> WcOpcode {
        match self.0.opcode {
            sys::ibv_wc_opcode::IBV_WC_SEND => WcOpcode::Send,
            sys::ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            sys::ibv_wc_opcode::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            sys::ibv_wc_opcode::IBV_WC_RECV => WcOpcode::Recv,
            sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            other => WcOpcode::Other(other),
        }
    }

    /// Bytes received (receive completions).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// Immediate data in host byte order, when the completion carries one.
    pub fn imm_data(&self) -> Option<u32> {
        if self.0.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM != 0 {
            // SAFETY: with IBV_WC_WITH_IMM set the union holds `imm_data`; any bit pattern is a
            // valid u32.
            Some(u32::from_be(unsafe { self.0.__bindgen_anon_1.imm_data }))
        } else {
            None
        }
    }

    /// The local queue pair number.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// Provider-specific error detail.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }

    /// The fields the transfer core routes on.
    pub fn completion(&self) -> Completion {
        Completion {
            wr_id: self.wr_id(),
            status: self.status(),
            opcode: self.opcode(),
            byte_len: self.byte_len(),
            imm: self.imm_data(),
            qp_num: self.qp_num(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cores_status_values_are_the_verbs_abi() {
        use sys::ibv_wc_status as s;
        let pairs = [
            (s::IBV_WC_SUCCESS, WcStatus::Success),
            (s::IBV_WC_LOC_LEN_ERR, WcStatus::LocalLengthError),
            (s::IBV_WC_LOC_PROT_ERR, WcStatus::LocalProtectionError),
            (s::IBV_WC_WR_FLUSH_ERR, WcStatus::WorkRequestFlushError),
            (s::IBV_WC_REM_ACCESS_ERR, WcStatus::RemoteAccessError),
            (s::IBV_WC_RETRY_EXC_ERR, WcStatus::RetryExceededError),
            (s::IBV_WC_RNR_RETRY_EXC_ERR, WcStatus::RnrRetryExceededError),
            (
                s::IBV_WC_REM_INV_RD_REQ_ERR,
                WcStatus::RemoteInvalidRdRequest,
            ),
            (s::IBV_WC_GENERAL_ERR, WcStatus::GeneralError),
            (
                s::IBV_WC_TM_RNDV_INCOMPLETE,
                WcStatus::TagMatchingRendezvousIncomplete,
            ),
        ];
        for (raw, status) in pairs {
            assert_eq!(WcStatus::from_raw(raw), status, "{raw}");
            assert_eq!(status.to_raw(), raw);
        }
    }
}
