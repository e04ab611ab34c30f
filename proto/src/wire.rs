//! The vocabulary shared with the NIC layer: scatter/gather entries, send operations and flags,
//! completion statuses and opcodes. Plain data; `rixl-verbs` turns them into `ibv_*` structs.

use std::fmt;

/// One local scatter/gather entry of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the memory region covering it.
    pub lkey: u32,
}

/// The operation of a send-queue work request. Exhaustive on purpose: the NIC layer maps every
/// operation to its verb, so a new one must be handled there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// RDMA WRITE to `remote_addr` under `rkey`.
    Write {
        /// Remote start address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// RDMA WRITE that also consumes a receive at the peer and delivers `imm`.
    WriteWithImm {
        /// Remote start address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data (host order).
        imm: u32,
    },
    /// RDMA READ from `remote_addr` under `rkey` into the local entries.
    Read {
        /// Remote start address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// SEND, consumed by a receive at the peer.
    Send,
    /// SEND with immediate data.
    SendWithImm {
        /// Immediate data (host order).
        imm: u32,
    },
}

impl SendOp {
    /// Whether the NIC reads local memory for it (everything but READ), so it may go inline.
    pub fn sends_local_data(&self) -> bool {
        !matches!(self, SendOp::Read { .. })
    }
}

/// Flags of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags {
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
    /// Copy the payload into the WQE (small messages; limited by `max_inline_data`).
    pub inline: bool,
    /// Wait for prior RDMA READs to complete first.
    pub fence: bool,
    /// Request a solicited event at the receiver.
    pub solicited: bool,
}

impl SendFlags {
    /// Just `signaled`.
    pub const SIGNALED: Self = SendFlags {
        signaled: true,
        inline: false,
        fence: false,
        solicited: false,
    };
}

macro_rules! wc_status {
    ($($name:ident = $raw:literal $cname:literal),* $(,)?) => {
        /// The status of a work completion (`enum ibv_wc_status`), named.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum WcStatus {
            $(
                #[doc = concat!("`", $cname, "`")]
                $name,
            )*
            /// A value this build does not know.
            Unknown(u32),
        }

        impl WcStatus {
            /// From the raw `ibv_wc_status` value (the values are the verbs ABI; `rixl-verbs`
            /// tests them against its bindings).
            pub fn from_raw(raw: u32) -> Self {
                match raw {
                    $($raw => WcStatus::$name,)*
                    other => WcStatus::Unknown(other),
                }
            }

            /// The raw value.
            pub fn to_raw(self) -> u32 {
                match self {
                    $(WcStatus::$name => $raw,)*
                    WcStatus::Unknown(raw) => raw,
                }
            }

            /// The C name (`IBV_WC_...`).
            pub fn name(self) -> &'static str {
                match self {
                    $(WcStatus::$name => $cname,)*
                    WcStatus::Unknown(_) => "IBV_WC_UNKNOWN",
                }
            }
        }
    };
}

wc_status! {
    Success = 0 "IBV_WC_SUCCESS",
    LocalLengthError = 1 "IBV_WC_LOC_LEN_ERR",
    LocalQpOperationError = 2 "IBV_WC_LOC_QP_OP_ERR",
    LocalEecOperationError = 3 "IBV_WC_LOC_EEC_OP_ERR",
    LocalProtectionError = 4 "IBV_WC_LOC_PROT_ERR",
    WorkRequestFlushError = 5 "IBV_WC_WR_FLUSH_ERR",
    MemoryWindowBindError = 6 "IBV_WC_MW_BIND_ERR",
    BadResponseError = 7 "IBV_WC_BAD_RESP_ERR",
    LocalAccessError = 8 "IBV_WC_LOC_ACCESS_ERR",
    RemoteInvalidRequestError = 9 "IBV_WC_REM_INV_REQ_ERR",
    RemoteAccessError = 10 "IBV_WC_REM_ACCESS_ERR",
    RemoteOperationError = 11 "IBV_WC_REM_OP_ERR",
    RetryExceededError = 12 "IBV_WC_RETRY_EXC_ERR",
    RnrRetryExceededError = 13 "IBV_WC_RNR_RETRY_EXC_ERR",
    LocalRddViolationError = 14 "IBV_WC_LOC_RDD_VIOL_ERR",
    RemoteInvalidRdRequest = 15 "IBV_WC_REM_INV_RD_REQ_ERR",
    RemoteAbortError = 16 "IBV_WC_REM_ABORT_ERR",
    InvalidEecnError = 17 "IBV_WC_INV_EECN_ERR",
    InvalidEecStateError = 18 "IBV_WC_INV_EEC_STATE_ERR",
    FatalError = 19 "IBV_WC_FATAL_ERR",
    ResponseTimeoutError = 20 "IBV_WC_RESP_TIMEOUT_ERR",
    GeneralError = 21 "IBV_WC_GENERAL_ERR",
    TagMatchingError = 22 "IBV_WC_TM_ERR",
    TagMatchingRendezvousIncomplete = 23 "IBV_WC_TM_RNDV_INCOMPLETE",
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcStatus::Unknown(raw) => write!(f, "IBV_WC_UNKNOWN({raw})"),
            s => f.write_str(s.name()),
        }
    }
}

/// The opcode of a work completion (the ones rixl acts on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A SEND completed.
    Send,
    /// An RDMA WRITE completed.
    RdmaWrite,
    /// An RDMA READ completed.
    RdmaRead,
    /// A receive consumed a SEND.
    Recv,
    /// A receive consumed a WRITE_WITH_IMM.
    RecvRdmaWithImm,
    /// Another opcode (raw value).
    Other(u32),
}

/// One work completion, as the core routes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// Its status.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes received (receives).
    pub byte_len: u32,
    /// Immediate data (host order), if any.
    pub imm: Option<u32>,
    /// The local queue pair's number.
    pub qp_num: u32,
}

impl Completion {
    /// A successful completion of `wr_id` on queue pair `qp_num`.
    pub fn success(qp_num: u32, wr_id: u64) -> Self {
        Completion {
            wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::RdmaWrite,
            byte_len: 0,
            imm: None,
            qp_num,
        }
    }

    /// Whether it succeeded.
    pub fn is_success(&self) -> bool {
        self.status == WcStatus::Success
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_through_their_raw_values() {
        for raw in 0..30 {
            assert_eq!(WcStatus::from_raw(raw).to_raw(), raw);
        }
        assert_eq!(WcStatus::from_raw(5), WcStatus::WorkRequestFlushError);
        assert_eq!(WcStatus::from_raw(99).to_string(), "IBV_WC_UNKNOWN(99)");
        assert_eq!(
            WcStatus::RemoteAccessError.to_string(),
            "IBV_WC_REM_ACCESS_ERR"
        );
    }
}
