//! Validation of descriptor lists and their split into work requests (pure logic).
//!
//! A work request covers one contiguous remote range under one rkey and gathers (WRITE) or
//! scatters (READ) it from/to at most `max_sge` local entries, at most `max_msg` bytes in total.
//! Adjacent descriptors are merged: contiguous remote descriptors with the same rkey continue the
//! same request, and contiguous local pieces with the same lkey extend the same entry.

use crate::desc::{Cursor, LocalDesc, RegionInfo, RemoteDesc};
use crate::error::InvalidDescriptor;
use crate::wire::Sge;

/// Limits that bound one work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Scatter/gather entries per request (>= 1).
    pub max_sge: u32,
    /// Bytes per request (>= 1).
    pub max_msg: u64,
}

/// One planned work request: a remote range and `sge_count` local entries from `sge_start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedWr {
    /// Remote start address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// First entry in [`Plan::sges`].
    pub sge_start: u32,
    /// Number of entries.
    pub sge_count: u32,
    /// Bytes moved.
    pub bytes: u64,
}

/// The work requests of a transfer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// The requests, in posting order.
    pub wrs: Vec<PlannedWr>,
    /// Local entries of all requests.
    pub sges: Vec<Sge>,
    /// Total bytes.
    pub bytes: u64,
    /// Every local region is host memory, so small requests may be posted inline.
    pub host: bool,
}

impl Plan {
    /// The entries of request `wr`.
    pub fn sges_of(&self, wr: &PlannedWr) -> &[Sge] {
        let s = wr.sge_start as usize;
        &self.sges[s..s + wr.sge_count as usize]
    }
}

/// Checks a local list (non-empty, no zero lengths, every range inside its region, whose length
/// `region_len(index)` gives); returns the total length.
///
/// # Errors
/// The first problem found, as an [`InvalidDescriptor`].
pub fn check_local(
    region_len: impl Fn(usize) -> Option<u64>,
    local: &[LocalDesc],
) -> Result<u64, InvalidDescriptor> {
    if local.is_empty() {
        return Err(InvalidDescriptor::Empty { side: "local" });
    }
    let mut total = 0u64;
    for (index, d) in local.iter().enumerate() {
        if d.len == 0 {
            return Err(InvalidDescriptor::ZeroLength {
                side: "local",
                index,
            });
        }
        let region_len =
            region_len(d.region as usize).ok_or(InvalidDescriptor::ForeignRegion { index })?;
        let end = d
            .offset
            .checked_add(d.len)
            .ok_or(InvalidDescriptor::Overflow {
                side: "local",
                index,
            })?;
        if end > region_len {
            return Err(InvalidDescriptor::OutOfRange {
                index,
                offset: d.offset,
                len: d.len,
                region_len,
            });
        }
        total = total
            .checked_add(d.len)
            .ok_or(InvalidDescriptor::Overflow {
                side: "local",
                index,
            })?;
    }
    Ok(total)
}

/// Checks both lists; returns the common total length.
///
/// # Errors
/// The first problem found, as an [`InvalidDescriptor`].
pub fn validate(
    regions: &[RegionInfo],
    local: &[LocalDesc],
    remote: &[RemoteDesc],
) -> Result<u64, InvalidDescriptor> {
    let local_total = check_local(|i| regions.get(i).map(|r| r.len), local)?;
    if remote.is_empty() {
        return Err(InvalidDescriptor::Empty { side: "remote" });
    }
    let mut remote_total = 0u64;
    for (index, d) in remote.iter().enumerate() {
        if d.len == 0 {
            return Err(InvalidDescriptor::ZeroLength {
                side: "remote",
                index,
            });
        }
        d.addr
            .checked_add(d.len)
            .ok_or(InvalidDescriptor::Overflow {
                side: "remote",
                index,
            })?;
        remote_total = remote_total
            .checked_add(d.len)
            .ok_or(InvalidDescriptor::Overflow {
                side: "remote",
                index,
            })?;
    }
    if local_total != remote_total {
        return Err(InvalidDescriptor::LengthMismatch {
            local: local_total,
            remote: remote_total,
        });
    }
    Ok(local_total)
}

/// Validates and splits the lists into work requests.
///
/// # Errors
/// As [`validate`].
pub fn plan(
    regions: &[RegionInfo],
    local: &[LocalDesc],
    remote: &[RemoteDesc],
    limits: Limits,
) -> Result<Plan, InvalidDescriptor> {
    let mut out = Plan::default();
    plan_into(&mut out, regions, local, remote, limits)?;
    Ok(out)
}

/// [`plan`] into `out`, reusing its allocations (an engine keeps a few plans for this). On error
/// `out` is left cleared.
///
/// # Errors
/// As [`plan`].
pub fn plan_into(
    out: &mut Plan,
    regions: &[RegionInfo],
    local: &[LocalDesc],
    remote: &[RemoteDesc],
    limits: Limits,
) -> Result<(), InvalidDescriptor> {
    out.wrs.clear();
    out.sges.clear();
    out.bytes = 0;
    out.host = false;
    let total = validate(regions, local, remote)?;
    out.host = regions.iter().all(|r| r.host);
    let max_sge = limits.max_sge.max(1);
    let max_msg = limits.max_msg.clamp(1, u64::from(u32::MAX));
    out.bytes = total;
    // One descriptor a side that fits one request (most small transfers): one entry, one
    // request, without the general walk below (which gives the same plan).
    if let ([l], [r]) = (local, remote) {
        if l.len <= max_msg {
            single_into(out, &regions[l.region as usize], l, r);
            return Ok(());
        }
    }
    out.wrs
        .reserve(remote.len().max(local.len() / max_sge as usize + 1));
    out.sges.reserve(local.len().max(remote.len()));
    let (mut lc, mut rc) = (Cursor::default(), Cursor::default());
    let mut open: Option<PlannedWr> = None;
    while rc.index < remote.len() {
        let r = remote[rc.index];
        let raddr = r.addr + rc.offset;
        // Close the open request if this remote piece cannot continue it.
        if let Some(wr) = open {
            if wr.remote_addr + wr.bytes != raddr || wr.rkey != r.rkey || wr.bytes == max_msg {
                out.wrs.push(wr);
                open = None;
            }
        }
        let wr = open.get_or_insert(PlannedWr {
            remote_addr: raddr,
            rkey: r.rkey,
            sge_start: u32::try_from(out.sges.len()).unwrap_or(u32::MAX),
            sge_count: 0,
            bytes: 0,
        });
        let l = local[lc.index];
        let region = regions[l.region as usize];
        let laddr = region.addr + l.offset + lc.offset;
        let take = (r.len - rc.offset)
            .min(l.len - lc.offset)
            .min(max_msg - wr.bytes);
        let extend = wr.sge_count > 0
            && out.sges.last().is_some_and(|s| {
                s.lkey == region.lkey
                    && s.addr + u64::from(s.length) == laddr
                    && u64::from(s.length) + take <= u64::from(u32::MAX)
            });
        if extend {
            if let Some(s) = out.sges.last_mut() {
                s.length += take as u32;
            }
        } else if wr.sge_count < max_sge {
            out.sges.push(Sge {
                addr: laddr,
                length: take as u32,
                lkey: region.lkey,
            });
            wr.sge_count += 1;
        } else {
            // Full: close it; the next iteration opens a new request at this remote address.
            out.wrs.push(*wr);
            open = None;
            continue;
        }
        wr.bytes += take;
        lc.advance(take, l.len);
        rc.advance(take, r.len);
    }
    out.wrs.extend(open);
    Ok(())
}

/// Plans one checked descriptor a side that fits one request into `out` (cleared first): one
/// entry, one request.
pub(crate) fn single_into(out: &mut Plan, region: &RegionInfo, l: &LocalDesc, r: &RemoteDesc) {
    out.wrs.clear();
    out.sges.clear();
    out.bytes = l.len;
    out.host = region.host;
    out.sges.push(Sge {
        addr: region.addr + l.offset,
        length: l.len as u32,
        lkey: region.lkey,
    });
    out.wrs.push(PlannedWr {
        remote_addr: r.addr,
        rkey: r.rkey,
        sge_start: 0,
        sge_count: 1,
        bytes: l.len,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const REGIONS: [RegionInfo; 2] = [
        RegionInfo {
            addr: 0x10_0000,
            len: 1 << 16,
            lkey: 1,
            host: true,
        },
        RegionInfo {
            addr: 0x90_0000,
            len: 1 << 16,
            lkey: 2,
            host: true,
        },
    ];

    fn ld(region: u32, offset: u64, len: u64) -> LocalDesc {
        LocalDesc {
            region,
            offset,
            len,
        }
    }

    fn rd(addr: u64, len: u64) -> RemoteDesc {
        RemoteDesc { addr, len, rkey: 9 }
    }

    #[test]
    fn rejects_bad_lists_with_the_offending_index() {
        let l = [ld(0, 0, 8)];
        assert_eq!(
            validate(&REGIONS, &[], &[rd(0, 8)]),
            Err(InvalidDescriptor::Empty { side: "local" })
        );
        assert_eq!(
            validate(&REGIONS, &l, &[]),
            Err(InvalidDescriptor::Empty { side: "remote" })
        );
        assert_eq!(
            validate(&REGIONS, &[ld(0, 0, 8), ld(0, 8, 0)], &[rd(0, 8)]),
            Err(InvalidDescriptor::ZeroLength {
                side: "local",
                index: 1
            })
        );
        assert_eq!(
            validate(&REGIONS, &[ld(1, (1 << 16) - 4, 8)], &[rd(0, 8)]),
            Err(InvalidDescriptor::OutOfRange {
                index: 0,
                offset: (1 << 16) - 4,
                len: 8,
                region_len: 1 << 16
            })
        );
        assert_eq!(
            validate(&REGIONS, &[ld(0, u64::MAX, 2)], &[rd(0, 2)]),
            Err(InvalidDescriptor::Overflow {
                side: "local",
                index: 0
            })
        );
        assert_eq!(
            validate(&REGIONS, &l, &[rd(u64::MAX - 3, 8)]),
            Err(InvalidDescriptor::Overflow {
                side: "remote",
                index: 0
            })
        );
        assert_eq!(
            validate(&REGIONS, &l, &[rd(0, 4), rd(100, 5)]),
            Err(InvalidDescriptor::LengthMismatch {
                local: 8,
                remote: 9
            })
        );
        assert_eq!(
            validate(&REGIONS, &[ld(5, 0, 8)], &[rd(0, 8)]),
            Err(InvalidDescriptor::ForeignRegion { index: 0 })
        );
    }

    #[test]
    fn contiguous_blocks_merge_into_one_request() {
        // 64 adjacent 1 KiB blocks on both sides: one request, one entry.
        let local: Vec<_> = (0..64).map(|i| ld(0, i * 1024, 1024)).collect();
        let remote: Vec<_> = (0..64).map(|i| rd(0x5000 + i * 1024, 1024)).collect();
        let p = plan(
            &REGIONS,
            &local,
            &remote,
            Limits {
                max_sge: 4,
                max_msg: 1 << 30,
            },
        )
        .expect("plan");
        assert_eq!(p.wrs.len(), 1);
        assert_eq!(p.sges.len(), 1);
        assert_eq!(p.wrs[0].bytes, 64 * 1024);
    }

    #[test]
    fn scattered_local_blocks_fill_entries_then_split() {
        // 10 non-adjacent local blocks into one remote range, max 4 entries: 3 requests.
        let local: Vec<_> = (0..10).map(|i| ld(0, i * 2048, 1024)).collect();
        let p = plan(
            &REGIONS,
            &local,
            &[rd(0x7000, 10 * 1024)],
            Limits {
                max_sge: 4,
                max_msg: 1 << 30,
            },
        )
        .expect("plan");
        assert_eq!(
            p.wrs.iter().map(|w| w.sge_count).collect::<Vec<_>>(),
            vec![4, 4, 2]
        );
        assert_eq!(p.wrs[1].remote_addr, 0x7000 + 4 * 1024);
    }

    #[test]
    fn large_ranges_split_at_the_message_limit() {
        let p = plan(
            &REGIONS,
            &[ld(0, 0, 10_000)],
            &[rd(0, 10_000)],
            Limits {
                max_sge: 1,
                max_msg: 4096,
            },
        )
        .expect("plan");
        assert_eq!(
            p.wrs.iter().map(|w| w.bytes).collect::<Vec<_>>(),
            vec![4096, 4096, 1808]
        );
        assert_eq!(p.wrs[2].remote_addr, 8192);
        assert_eq!(p.sges[2].addr, REGIONS[0].addr + 8192);
    }

    /// Expands a plan into (local address, remote address) per byte.
    fn expand_plan(p: &Plan) -> Vec<(u64, u64, u32)> {
        let mut v = Vec::new();
        for wr in &p.wrs {
            let mut r = wr.remote_addr;
            for s in p.sges_of(wr) {
                for i in 0..u64::from(s.length) {
                    v.push((s.addr + i, r, wr.rkey));
                    r += 1;
                }
            }
            assert_eq!(r - wr.remote_addr, wr.bytes);
        }
        v
    }

    fn expand_lists(local: &[LocalDesc], remote: &[RemoteDesc]) -> Vec<(u64, u64, u32)> {
        let l: Vec<u64> = local
            .iter()
            .flat_map(|d| {
                let base = REGIONS[d.region as usize].addr + d.offset;
                (0..d.len).map(move |i| base + i)
            })
            .collect();
        let r: Vec<(u64, u32)> = remote
            .iter()
            .flat_map(|d| (0..d.len).map(move |i| (d.addr + i, d.rkey)))
            .collect();
        l.into_iter().zip(r).map(|(a, (b, k))| (a, b, k)).collect()
    }

    fn lists() -> impl Strategy<Value = (Vec<LocalDesc>, Vec<RemoteDesc>)> {
        prop::collection::vec((0u32..2, 0u64..2000, 1u64..300), 1..40).prop_flat_map(|locals| {
            let local: Vec<LocalDesc> = locals.iter().map(|&(r, o, l)| ld(r, o, l)).collect();
            let total: u64 = local.iter().map(|d| d.len).sum();
            // Cut the same total into remote pieces, some adjacent, two rkeys.
            prop::collection::vec((1u64..400, any::<bool>(), 0u32..2), 1..40).prop_map(
                move |cuts| {
                    let mut remote = Vec::new();
                    let (mut left, mut addr) = (total, 0x4000_0000u64);
                    for (len, gap, key) in cuts {
                        if left == 0 {
                            break;
                        }
                        let len = len.min(left);
                        remote.push(RemoteDesc {
                            addr,
                            len,
                            rkey: 9 + key,
                        });
                        addr += len + if gap { 64 } else { 0 };
                        left -= len;
                    }
                    if left > 0 {
                        remote.push(RemoteDesc {
                            addr,
                            len: left,
                            rkey: 9,
                        });
                    }
                    (local.clone(), remote)
                },
            )
        })
    }

    proptest! {
        #[test]
        fn plans_cover_every_byte_in_order_within_limits(
            (local, remote) in lists(),
            max_sge in 1u32..6,
            max_msg in 1u64..700,
        ) {
            let p = plan(&REGIONS, &local, &remote, Limits { max_sge, max_msg }).expect("valid lists");
            for wr in &p.wrs {
                prop_assert!(wr.sge_count >= 1 && wr.sge_count <= max_sge);
                prop_assert!(wr.bytes >= 1 && wr.bytes <= max_msg);
                let sum: u64 = p.sges_of(wr).iter().map(|s| u64::from(s.length)).sum();
                prop_assert_eq!(sum, wr.bytes);
            }
            prop_assert_eq!(p.bytes, local.iter().map(|d| d.len).sum::<u64>());
            prop_assert_eq!(expand_plan(&p), expand_lists(&local, &remote));
        }
    }
}
