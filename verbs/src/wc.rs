//! Work completions.

use std::fmt;

use crate::error::Error;
use crate::sys;

macro_rules! wc_status {
    ($($name:ident = $raw:ident),* $(,)?) => {
        /// The status of a work completion, by name (`ibv_wc_status`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum WcStatus {
            $(
                #[doc = concat!("`", stringify!($raw), "`")]
                $name,
            )*
            /// A status this crate does not know.
            Unknown(u32),
        }

        impl WcStatus {
            /// Decodes a raw status.
            pub fn from_raw(raw: u32) -> Self {
                match raw {
                    $(sys::ibv_wc_status::$raw => WcStatus::$name,)*
                    other => WcStatus::Unknown(other),
                }
            }

            /// The C name, e.g. `IBV_WC_REM_ACCESS_ERR`.
            pub fn name(self) -> &'static str {
                match self {
                    $(WcStatus::$name => stringify!($raw),)*
                    WcStatus::Unknown(_) => "IBV_WC_UNKNOWN",
                }
            }
        }
    };
}

wc_status! {
    Success = IBV_WC_SUCCESS,
    LocalLengthError = IBV_WC_LOC_LEN_ERR,
    LocalQpOperationError = IBV_WC_LOC_QP_OP_ERR,
    LocalEecOperationError = IBV_WC_LOC_EEC_OP_ERR,
    LocalProtectionError = IBV_WC_LOC_PROT_ERR,
    WorkRequestFlushError = IBV_WC_WR_FLUSH_ERR,
    MemoryWindowBindError = IBV_WC_MW_BIND_ERR,
    BadResponseError = IBV_WC_BAD_RESP_ERR,
    LocalAccessError = IBV_WC_LOC_ACCESS_ERR,
    RemoteInvalidRequestError = IBV_WC_REM_INV_REQ_ERR,
    RemoteAccessError = IBV_WC_REM_ACCESS_ERR,
    RemoteOperationError = IBV_WC_REM_OP_ERR,
    RetryExceededError = IBV_WC_RETRY_EXC_ERR,
    RnrRetryExceededError = IBV_WC_RNR_RETRY_EXC_ERR,
    LocalRddViolationError = IBV_WC_LOC_RDD_VIOL_ERR,
    RemoteInvalidRdRequest = IBV_WC_REM_INV_RD_REQ_ERR,
    RemoteAbortError = IBV_WC_REM_ABORT_ERR,
    InvalidEecnError = IBV_WC_INV_EECN_ERR,
    InvalidEecStateError = IBV_WC_INV_EEC_STATE_ERR,
    FatalError = IBV_WC_FATAL_ERR,
    ResponseTimeoutError = IBV_WC_RESP_TIMEOUT_ERR,
    GeneralError = IBV_WC_GENERAL_ERR,
    TagMatchingError = IBV_WC_TM_ERR,
    TagMatchingRendezvousIncomplete = IBV_WC_TM_RNDV_INCOMPLETE,
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcStatus::Unknown(raw) => write!(f, "IBV_WC_UNKNOWN({raw})"),
            s => f.write_str(s.name()),
        }
    }
}

/// The operation a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcOpcode {
    /// SEND (also SEND_WITH_IMM) on the send queue.
    Send,
    /// RDMA WRITE (also WRITE_WITH_IMM) on the send queue.
    RdmaWrite,
    /// RDMA READ.
    RdmaRead,
    /// RECV of a SEND.
    Recv,
    /// RECV consumed by an RDMA WRITE_WITH_IMM.
    RecvRdmaWithImm,
    /// Something else (atomics, ...), raw value.
    Other(u32),
}

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
}
