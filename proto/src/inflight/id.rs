//! Work request ids: `signaled` (bit 63) | generation (bits 32..62) | slot key (bits 0..32).

const SIGNALED_BIT: u64 = 1 << 63;
// 30 bits: bit 62 marks receive work requests (see the engine).
pub(super) const GEN_MASK: u32 = 0x3fff_ffff;

/// Encodes a work request id.
pub fn encode_wr_id(key: u32, generation: u32, signaled: bool) -> u64 {
    (if signaled { SIGNALED_BIT } else { 0 })
        | (u64::from(generation & GEN_MASK) << 32)
        | u64::from(key)
}

/// Decodes a work request id into (key, generation, signaled).
pub fn decode_wr_id(wr_id: u64) -> (u32, u32, bool) {
    (
        wr_id as u32,
        ((wr_id >> 32) as u32) & GEN_MASK,
        wr_id & SIGNALED_BIT != 0,
    )
}

/// A handle to one slot: key + generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId {
    /// Slab key.
    pub key: u32,
    /// Generation (30 bits).
    pub generation: u32,
}

impl SlotId {
    /// The `wr_id` for a work request of this slot.
    pub fn wr_id(self, signaled: bool) -> u64 {
        encode_wr_id(self.key, self.generation, signaled)
    }
}
