//! Agent metadata: what a peer needs to reach this agent's memory. A versioned binary format,
//! tagged with the cluster key and validated on load: truncated, forged or oversized blobs are
//! clean errors.
//!
//! ```text
//! "RIXLMD" | version u16 | total length u32 | name (u16 len + utf8) | generation u64
//!          | side-channel address (u16 len + utf8) | node (u16 len + utf8) | process u32
//!          | rails u8 | flags u8 | region count u32
//!          | regions: id u64, addr u64, len u64, rkey u32 per rail, kind u8, bound rails u8
//!          | IPC export count u32 | exports: region id u64, GPU ordinal u32, handle 64 bytes
//!          | removed count u32 | removed region ids u64
//!          | HMAC-SHA256 of everything before, under the cluster key (32 bytes)
//! ```
//!
//! Version 5 added each region's bound rails (a bit per rail: the NICs nearest its memory,
//! which transfers to it prefer). Version 4 replaced the FNV checksum of version 3 with the HMAC tag: a blob is believed only
//! when a holder of the cluster key made it, and the name it carries is covered by the tag.
//! Blobs of versions 1-3 carry no tag and are refused (`IncompatibleVersion`). Decoding checks
//! the tag before it reads a field, bounds every count by the bytes left before it allocates,
//! and is linear in the blob.
//!
//! Flags: bit 2, the agent has no NIC (peers reach it on the side channel and by CUDA IPC
//! only; notifications travel on the side channel). Bit 1, the regions are reached through grants only (their keys name them and reach
//! nothing; a reader asks for its own key per connection).
//!
//! Partial metadata (flags bit 0): a blob with only some regions (`getLocalPartialMD`), merged
//! into what the reader already holds of the same agent generation, with the ids of regions the
//! agent has released since.

use std::collections::HashSet;

use super::auth::{ClusterKey, TAG_LEN};

/// Current format version.
pub const VERSION: u16 = 5;
/// Most rails (NICs) a region can be registered on.
pub const MAX_RAILS: usize = 8;
const MAGIC: &[u8; 6] = b"RIXLMD";
/// Largest blob accepted.
pub const MAX_BLOB: usize = 64 << 20;
const MAX_NAME: usize = 256;
const fn region_bytes(rails: usize) -> usize {
    8 + 8 + 8 + 4 * rails + 1 + 1
}

/// Memory kind of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemKind {
    /// Host memory.
    Dram,
    /// GPU memory registered for GPUDirect RDMA.
    Vram,
}

/// One exported region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Region id (stable for the registration's life).
    pub id: u64,
    /// Start address (iova).
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Remote key (rail 0).
    pub rkey: u32,
    /// Memory kind.
    pub kind: MemKind,
    /// Remote keys of rails 1.. (`rail_rkeys[i - 1]` for rail `i`; unused entries are 0).
    pub rail_rkeys: [u32; MAX_RAILS - 1],
    /// The rails its memory is bound to (bit `i`: rail `i`): the NICs nearest it, which
    /// transfers to it prefer. 0: no NIC reaches it (GPU memory without GPUDirect RDMA): peers
    /// on its node reach it by CUDA IPC only.
    pub bound: u8,
}

impl RegionInfo {
    /// The rails its memory is bound to, in index order.
    pub fn bound_rails(&self) -> impl Iterator<Item = usize> + '_ {
        (0..MAX_RAILS).filter(|i| self.bound & (1 << i) != 0)
    }

    /// The remote key on rail `rail`.
    pub fn rkey_on(&self, rail: usize) -> u32 {
        if rail == 0 {
            self.rkey
        } else {
            self.rail_rkeys.get(rail - 1).copied().unwrap_or(0)
        }
    }
}

/// A peer's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentMetadata {
    /// Agent name (unique in the cluster).
    pub name: String,
    /// Changes every time the agent restarts, so a re-joined peer is recognised.
    pub generation: u64,
    /// Where its side channel listens (`host:port`), or empty.
    pub address: String,
    /// Regions visible to the reader this blob was made for.
    pub regions: Vec<RegionInfo>,
    /// NICs (rails) the agent's regions are registered on (1 without multi-rail).
    pub rails: u8,
    /// The machine it runs on (boot id and host name; empty when unknown).
    pub node: String,
    /// Its process id.
    pub process: u32,
    /// CUDA IPC handles of its VRAM regions (for peers on the same node).
    pub ipc: Vec<IpcExport>,
    /// Whether the blob carries only some regions: merged into the metadata already loaded for
    /// the same generation instead of replacing it.
    pub partial: bool,
    /// Regions released since (partial blobs): the reader forgets them.
    pub removed: Vec<u64>,
    /// Whether its regions are reached through grants only (flags bit 1): the keys above then
    /// name regions and reach nothing; the reader asks for its own key per connection (a
    /// memory window bound to that connection's queue pair).
    pub grants: bool,
    /// Whether the agent has a NIC (flags bit 2 clear): without one, peers reach it on the side
    /// channel and by CUDA IPC only.
    pub nic: bool,
}

/// A VRAM region's CUDA IPC handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    /// Region id.
    pub region: u64,
    /// GPU ordinal of the exporter.
    pub gpu: u32,
    /// The `cuIpcGetMemHandle` handle.
    pub handle: [u8; 64],
}

const IPC_BYTES: usize = 8 + 4 + 64;

/// Why a blob was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// Shorter than its header or its declared length.
    #[error("metadata truncated: {0}")]
    Truncated(&'static str),
    /// Not a rixl metadata blob.
    #[error("not rixl metadata (bad magic)")]
    BadMagic,
    /// Made by an incompatible version.
    #[error("metadata version {0} is not supported (this build reads {VERSION})")]
    IncompatibleVersion(u16),
    /// The tag does not match: forged, corrupted, or made with another cluster key.
    #[error("forged metadata: its tag does not match (tampered, corrupted, or made with another cluster key)")]
    Forged,
    /// Larger than the limits.
    #[error("metadata too large: {0}")]
    TooLarge(String),
    /// Structurally invalid.
    #[error("invalid metadata: {0}")]
    Invalid(String),
}

/// The tag's domain separator.
const TAG_LABEL: &str = "rixl/metadata/v4";

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl AgentMetadata {
    /// Encodes the blob, tagged with `key`.
    ///
    /// # Errors
    /// [`MetadataError::TooLarge`] if a field exceeds the format's limits.
    pub fn encode(&self, key: &ClusterKey) -> Result<Vec<u8>, MetadataError> {
        if self.name.len() > MAX_NAME || self.address.len() > MAX_NAME || self.node.len() > MAX_NAME
        {
            return Err(MetadataError::TooLarge(
                "name or address over 256 bytes".into(),
            ));
        }
        let rails = usize::from(self.rails.max(1));
        if rails > MAX_RAILS {
            return Err(MetadataError::TooLarge(format!("{rails} rails")));
        }
        let size = 6
            + 2
            + 4
            + 2
            + self.name.len()
            + 8
            + 2
            + self.address.len()
            + 2
            + self.node.len()
            + 4
            + 1
            + 4
            + self.regions.len() * region_bytes(rails)
            + 1
            + 4
            + self.ipc.len() * IPC_BYTES
            + 4
            + self.removed.len() * 8
            + TAG_LEN;
        if size > MAX_BLOB {
            return Err(MetadataError::TooLarge(format!("{size} bytes")));
        }
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_be_bytes());
        out.extend_from_slice(&(size as u32).to_be_bytes());
        put_str(&mut out, &self.name);
        out.extend_from_slice(&self.generation.to_be_bytes());
        put_str(&mut out, &self.address);
        put_str(&mut out, &self.node);
        out.extend_from_slice(&self.process.to_be_bytes());
        out.push(rails as u8);
        out.push(
            u8::from(self.partial) | (u8::from(self.grants) << 1) | (u8::from(!self.nic) << 2),
        );
        out.extend_from_slice(&(self.regions.len() as u32).to_be_bytes());
        for r in &self.regions {
            out.extend_from_slice(&r.id.to_be_bytes());
            out.extend_from_slice(&r.addr.to_be_bytes());
            out.extend_from_slice(&r.len.to_be_bytes());
            for rail in 0..rails {
                out.extend_from_slice(&r.rkey_on(rail).to_be_bytes());
            }
            out.push(match r.kind {
                MemKind::Dram => 0,
                MemKind::Vram => 1,
            });
            out.push(r.bound);
        }
        out.extend_from_slice(&(self.ipc.len() as u32).to_be_bytes());
        for x in &self.ipc {
            out.extend_from_slice(&x.region.to_be_bytes());
            out.extend_from_slice(&x.gpu.to_be_bytes());
            out.extend_from_slice(&x.handle);
        }
        out.extend_from_slice(&(self.removed.len() as u32).to_be_bytes());
        for id in &self.removed {
            out.extend_from_slice(&id.to_be_bytes());
        }
        let tag = key.tag(TAG_LABEL, &[&out]);
        out.extend_from_slice(&tag);
        debug_assert_eq!(out.len(), size);
        Ok(out)
    }

    /// Decodes and validates a blob made by a holder of `key`.
    ///
    /// # Errors
    /// A [`MetadataError`] naming what is wrong; [`MetadataError::Forged`] if the tag does not
    /// match (checked before any field is read).
    pub fn decode(b: &[u8], key: &ClusterKey) -> Result<Self, MetadataError> {
        let (body, tag) = Self::frame(b)?;
        if !key.verify(TAG_LABEL, &[body], tag) {
            return Err(MetadataError::Forged);
        }
        Self::parse(body)
    }

    /// Decodes a blob without checking its tag: for the fuzz targets, which reach the body's
    /// parser only this way.
    ///
    /// # Errors
    /// As [`Self::decode`], never [`MetadataError::Forged`].
    #[cfg(feature = "fuzzing")]
    #[doc(hidden)]
    pub fn decode_untagged(b: &[u8]) -> Result<Self, MetadataError> {
        Self::parse(Self::frame(b)?.0)
    }

    /// The blob's checked header: its body (header included) and its tag.
    fn frame(b: &[u8]) -> Result<(&[u8], &[u8]), MetadataError> {
        if b.len() > MAX_BLOB {
            return Err(MetadataError::TooLarge(format!("{} bytes", b.len())));
        }
        if b.len() < 12 {
            return Err(MetadataError::Truncated("header"));
        }
        if &b[..6] != MAGIC {
            return Err(MetadataError::BadMagic);
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != VERSION {
            return Err(MetadataError::IncompatibleVersion(version));
        }
        let total = u32::from_be_bytes([b[8], b[9], b[10], b[11]]) as usize;
        if b.len() < total {
            return Err(MetadataError::Truncated("shorter than its declared length"));
        }
        if b.len() > total || total < 12 + TAG_LEN {
            return Err(MetadataError::Invalid(format!(
                "declared length {total}, got {}",
                b.len()
            )));
        }
        Ok(b.split_at(total - TAG_LEN))
    }

    /// The body after its header was checked.
    fn parse(body: &[u8]) -> Result<Self, MetadataError> {
        let mut r = Reader { b: body, at: 12 };
        let name = r.string()?;
        if name.is_empty() {
            return Err(MetadataError::Invalid("empty agent name".into()));
        }
        let generation = r.u64()?;
        let address = r.string()?;
        let node = r.string()?;
        let process = r.u32()?;
        let rails = usize::from(r.u8()?);
        if rails == 0 || rails > MAX_RAILS {
            return Err(MetadataError::Invalid(format!("{rails} rails")));
        }
        let flags = r.u8()?;
        if flags & !0b111 != 0 {
            return Err(MetadataError::Invalid(format!("flags {flags:#x}")));
        }
        let (partial, grants, nic) = (flags & 1 != 0, flags & 2 != 0, flags & 4 == 0);
        let count = r.u32()? as usize;
        // The IPC and removed counts (4 bytes each) follow the regions.
        if count.saturating_mul(region_bytes(rails)).saturating_add(8) > body.len() - r.at {
            return Err(MetadataError::Invalid(format!(
                "{count} regions do not fit the blob"
            )));
        }
        let mut regions = Vec::with_capacity(count);
        let mut vram = HashSet::new();
        for _ in 0..count {
            let (id, addr, len, rkey) = (r.u64()?, r.u64()?, r.u64()?, r.u32()?);
            let mut rail_rkeys = [0u32; MAX_RAILS - 1];
            for k in rail_rkeys.iter_mut().take(rails - 1) {
                *k = r.u32()?;
            }
            let kind = match r.u8()? {
                0 => MemKind::Dram,
                1 => MemKind::Vram,
                k => return Err(MetadataError::Invalid(format!("memory kind {k}"))),
            };
            let bound = r.u8()?;
            if rails < 8 && bound >> rails != 0 {
                return Err(MetadataError::Invalid(format!(
                    "region {id}: bound to rails {bound:#04x} of {rails}"
                )));
            }
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(MetadataError::Invalid(format!("region {id}: bad range")));
            }
            if kind == MemKind::Vram {
                vram.insert(id);
            }
            regions.push(RegionInfo {
                id,
                addr,
                len,
                rkey,
                kind,
                rail_rkeys,
                bound,
            });
        }
        let n = r.u32()? as usize;
        if n.saturating_mul(IPC_BYTES).saturating_add(4) > body.len() - r.at {
            return Err(MetadataError::Invalid(format!(
                "{n} IPC exports do not fit the blob"
            )));
        }
        let mut ipc = Vec::with_capacity(n);
        for _ in 0..n {
            let (region, gpu) = (r.u64()?, r.u32()?);
            let handle: [u8; 64] = r
                .take(64)?
                .try_into()
                .map_err(|_| MetadataError::Truncated("IPC handle"))?;
            if !vram.contains(&region) {
                return Err(MetadataError::Invalid(format!(
                    "IPC export for region {region}, which is not a VRAM region"
                )));
            }
            ipc.push(IpcExport {
                region,
                gpu,
                handle,
            });
        }
        let n = r.u32()? as usize;
        if n.saturating_mul(8) != body.len() - r.at {
            return Err(MetadataError::Invalid(format!(
                "{n} removed regions do not fit the blob"
            )));
        }
        let mut removed = Vec::with_capacity(n);
        for _ in 0..n {
            removed.push(r.u64()?);
        }
        Ok(AgentMetadata {
            name,
            generation,
            address,
            regions,
            rails: rails as u8,
            node,
            process,
            ipc,
            partial,
            removed,
            grants,
            nic,
        })
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], MetadataError> {
        let s = self
            .b
            .get(self.at..self.at + n)
            .ok_or(MetadataError::Truncated("field"))?;
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, MetadataError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, MetadataError> {
        Ok(u32::from_be_bytes(
            self.take(4)?
                .try_into()
                .map_err(|_| MetadataError::Truncated("u32"))?,
        ))
    }
    fn u64(&mut self) -> Result<u64, MetadataError> {
        Ok(u64::from_be_bytes(
            self.take(8)?
                .try_into()
                .map_err(|_| MetadataError::Truncated("u64"))?,
        ))
    }
    fn string(&mut self) -> Result<String, MetadataError> {
        let n = u16::from_be_bytes(
            self.take(2)?
                .try_into()
                .map_err(|_| MetadataError::Truncated("len"))?,
        ) as usize;
        if n > MAX_NAME {
            return Err(MetadataError::TooLarge(format!("string of {n} bytes")));
        }
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| MetadataError::Invalid("non-UTF-8 string".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> ClusterKey {
        ClusterKey::from_bytes(b"a test cluster key, 32 bytes....").unwrap()
    }

    /// Re-tags a blob edited by a test (as a holder of the key could).
    fn retag(blob: &mut [u8]) {
        let body = blob.len() - TAG_LEN;
        let tag = key().tag(TAG_LABEL, &[&blob[..body]]);
        blob[body..].copy_from_slice(&tag);
    }

    fn sample() -> AgentMetadata {
        AgentMetadata {
            name: "prefill-0".into(),
            generation: 0x1122_3344,
            address: "10.0.0.1:5555".into(),
            regions: (0..3)
                .map(|i| RegionInfo {
                    id: i,
                    addr: 0x7f00_0000_0000 + i * (1 << 20),
                    len: 1 << 20,
                    rkey: 0x100 + i as u32,
                    kind: MemKind::Dram,
                    rail_rkeys: [0x200 + i as u32, 0, 0, 0, 0, 0, 0],
                    bound: if i == 1 { 0b10 } else { 0b01 },
                })
                .collect(),
            rails: 2,
            node: "boot-1234/host-a".into(),
            process: 4242,
            ipc: vec![],
            partial: false,
            removed: vec![],
            grants: true,
            nic: true,
        }
    }

    #[test]
    fn partial_metadata_round_trips_with_removed_regions_and_bad_flags_are_refused() {
        let m = AgentMetadata {
            partial: true,
            regions: sample().regions[1..2].to_vec(),
            removed: vec![7, 9],
            ..sample()
        };
        let blob = m.encode(&key()).expect("encode");
        assert_eq!(AgentMetadata::decode(&blob, &key()).expect("decode"), m);
        // The flags byte: after the header, name, generation, address, node, process, rails.
        let at = 12 + 2 + m.name.len() + 8 + 2 + m.address.len() + 2 + m.node.len() + 4 + 1;
        assert_eq!(blob[at], 0b11, "partial, and grants");
        let nic_less = AgentMetadata {
            nic: false,
            ..m.clone()
        };
        let blob2 = nic_less.encode(&key()).expect("encode");
        assert_eq!(blob2[at], 0b111, "partial, grants, and no NIC");
        assert_eq!(
            AgentMetadata::decode(&blob2, &key()).expect("decode"),
            nic_less
        );
        let mut bad = blob.clone();
        bad[at] = 8;
        retag(&mut bad);
        assert!(matches!(
            AgentMetadata::decode(&bad, &key()),
            Err(MetadataError::Invalid(_))
        ));
        // A region bound to no rail is reachable by CUDA IPC only, and round-trips.
        let mut ipc_only = sample();
        ipc_only.regions[0].bound = 0;
        let blob0 = ipc_only.encode(&key()).expect("encode");
        assert_eq!(
            AgentMetadata::decode(&blob0, &key()).expect("decode"),
            ipc_only
        );
        // A region bound to a rail the agent does not have.
        for bound in [0b100u8, 0x80] {
            let mut r = sample();
            r.regions[0].bound = bound;
            let mut blob = r.encode(&key()).expect("encode");
            // The first region's bound byte ends its 8+8+8+4*2+1+1 bytes after the count.
            let first = at + 1 + 4;
            assert_eq!(blob[first + 33], bound);
            retag(&mut blob);
            assert!(
                matches!(
                    AgentMetadata::decode(&blob, &key()),
                    Err(MetadataError::Invalid(ref m)) if m.contains("bound")
                ),
                "bound {bound:#x}"
            );
        }
    }

    #[test]
    fn round_trips() {
        let m = sample();
        assert_eq!(
            AgentMetadata::decode(&m.encode(&key()).expect("encode"), &key()).expect("decode"),
            m
        );
        let empty = AgentMetadata {
            regions: vec![],
            address: String::new(),
            ..sample()
        };
        assert_eq!(
            AgentMetadata::decode(&empty.encode(&key()).expect("encode"), &key()).expect("decode"),
            empty
        );
    }

    #[test]
    fn every_truncation_and_every_flipped_byte_is_rejected() {
        let blob = sample().encode(&key()).expect("encode");
        for cut in 0..blob.len() {
            assert!(
                AgentMetadata::decode(&blob[..cut], &key()).is_err(),
                "truncated at {cut} accepted"
            );
        }
        for i in 0..blob.len() {
            let mut forged = blob.clone();
            forged[i] ^= 0x40;
            assert!(
                AgentMetadata::decode(&forged, &key()).is_err(),
                "flipped byte {i} accepted"
            );
        }
        let mut longer = blob.clone();
        longer.push(0);
        assert!(AgentMetadata::decode(&longer, &key()).is_err());
    }

    #[test]
    fn typed_errors() {
        let blob = sample().encode(&key()).expect("encode");
        assert_eq!(
            AgentMetadata::decode(b"GET / HTTP/1.1\r\n\r\n", &key()),
            Err(MetadataError::BadMagic)
        );
        // Version 3 blobs carried an FNV sum, no tag; version 4 no bound rails: refused, as are
        // later versions.
        for version in [3u16, 4, 6] {
            let mut other = blob.clone();
            other[6..8].copy_from_slice(&version.to_be_bytes());
            retag(&mut other);
            assert_eq!(
                AgentMetadata::decode(&other, &key()),
                Err(MetadataError::IncompatibleVersion(version))
            );
        }
        let mut forged = blob.clone();
        let n = forged.len();
        forged[n - 20] ^= 1; // inside the last region's fields
        assert_eq!(
            AgentMetadata::decode(&forged, &key()),
            Err(MetadataError::Forged)
        );
        // The right bytes under another key: forged too (an agent of another cluster).
        let other = ClusterKey::from_bytes(b"another cluster's key, 32 bytes.").unwrap();
        assert_eq!(
            AgentMetadata::decode(&blob, &other),
            Err(MetadataError::Forged)
        );
        // A holder of no key cannot rename an agent: the name is under the tag.
        let mut renamed = blob.clone();
        renamed[14] = b'X';
        assert_eq!(
            AgentMetadata::decode(&renamed, &key()),
            Err(MetadataError::Forged)
        );
        assert!(matches!(
            AgentMetadata::decode(&blob[..blob.len() - 1], &key()),
            Err(MetadataError::Truncated(_))
        ));
        let long = AgentMetadata {
            name: "x".repeat(300),
            ..sample()
        };
        assert!(matches!(
            long.encode(&key()),
            Err(MetadataError::TooLarge(_))
        ));
    }

    #[test]
    fn counts_larger_than_the_blob_are_refused_before_allocating() {
        // A holder of the key (or a bug) states 2^32 - 1 regions in a small blob: refused by
        // the bounds check, not by an allocation of 2^32 entries.
        let m = AgentMetadata {
            regions: vec![],
            ..sample()
        };
        let mut blob = m.encode(&key()).expect("encode");
        let at = 12 + 2 + m.name.len() + 8 + 2 + m.address.len() + 2 + m.node.len() + 4 + 1 + 1;
        assert_eq!(&blob[at..at + 4], &[0, 0, 0, 0]);
        blob[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        retag(&mut blob);
        assert!(matches!(
            AgentMetadata::decode(&blob, &key()),
            Err(MetadataError::Invalid(_))
        ));
        assert_eq!(sample().regions[1].rkey_on(1), 0x201);
    }

    #[test]
    fn ipc_exports_round_trip_and_must_name_a_vram_region() {
        let mut m = sample();
        m.regions[2].kind = MemKind::Vram;
        m.ipc = vec![IpcExport {
            region: 2,
            gpu: 3,
            handle: [7; 64],
        }];
        let blob = m.encode(&key()).expect("encode");
        assert_eq!(AgentMetadata::decode(&blob, &key()).expect("decode"), m);
        m.ipc[0].region = 1; // a DRAM region
        assert!(matches!(
            AgentMetadata::decode(&m.encode(&key()).expect("encode"), &key()),
            Err(MetadataError::Invalid(_))
        ));
        assert_eq!(sample().regions[1].rkey_on(0), 0x101);
    }
}
