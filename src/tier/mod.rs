//! A tiered KV-block cache over the agent's memories: hot blocks in VRAM or DRAM (the engine's
//! KV cache), warm ones in a host DRAM tier, cold ones in an NVMe file, and the archive in an
//! object store. NIXL's backends moved through one API, with the policy of Dynamo's KV block
//! manager or LMCache: demote what is cold, promote on a hit, reload only when reloading is
//! cheaper than recomputing.
//!
//! - Blocks are named by a `u64` (a hash of their tokens and prefix, so equal prefixes are one
//!   block). The hot and host tiers are slots of a registered region each, and hold a block in
//!   one of the two. The file and the object store keep a block once written (write once, read
//!   many): demoting a block that is already there writes nothing.
//! - When the hot tier is full, the policy's victims move to the host tier; when that is full,
//!   its victims go to the file (one scattered write); when the file is full, its victims are
//!   archived as one object each (one transfer of many PUTs), unless already archived.
//! - [`TieredCache::acquire`] places a request's blocks in the hot tier. Blocks found below are
//!   reloaded with one scattered transfer per tier, when the measured cost of that tier
//!   (seconds per block, from its past reloads) is below the cost of recomputing them
//!   ([`TierConfig::recompute_per_block`]); otherwise, and for blocks found nowhere, the engine
//!   recomputes them into the slot it is given.
//! - Each tier's replacement is a [`Policy`]: [`Lru`] by default, [`Fifo`] or the caller's own.

mod policy;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

pub use policy::{Fifo, Lru, Policy};

use crate::agent::{Agent, AgentError, FileRegistration, Registration};
use crate::object::{ObjectDesc, ObjectRegistration};
use crate::runtime::{FileDesc, LocalDescList, Region};

/// A tier of the hierarchy, hottest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// The engine's KV cache (VRAM, or DRAM on a host without a GPU).
    Hot,
    /// Host DRAM.
    Host,
    /// An NVMe file.
    File,
    /// An object store.
    Object,
}

impl Tier {
    /// Every tier, hottest first.
    pub const ALL: [Tier; 4] = [Tier::Hot, Tier::Host, Tier::File, Tier::Object];

    fn index(self) -> usize {
        self as usize
    }
}

/// A tiered cache's error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TierError {
    /// A transfer between tiers failed.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// A copy between the hot and host regions failed.
    #[error("copying a block between the hot and host tiers: {0}")]
    Copy(#[source] crate::verbs::Error),
    /// A request asks for more blocks than the hot tier holds.
    #[error("a request of {asked} blocks does not fit the hot tier's {capacity}")]
    TooManyBlocks {
        /// Blocks asked for.
        asked: usize,
        /// Hot slots.
        capacity: usize,
    },
    /// A tier's memory is smaller than its blocks.
    #[error("the {tier:?} tier needs {needed} bytes, its memory has {len}")]
    TooSmall {
        /// The tier.
        tier: Tier,
        /// Bytes its blocks need.
        needed: u64,
        /// Bytes it has.
        len: u64,
    },
    /// Blocks must be a whole number of 4 KiB pages (the file tier's O_DIRECT alignment).
    #[error("a block of {0} bytes is not a multiple of 4096")]
    UnalignedBlock(u64),
}

/// Sizes of a tiered cache.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TierConfig {
    /// Bytes per block (a multiple of 4096).
    pub block_len: u64,
    /// Blocks of the hot tier.
    pub hot_blocks: usize,
    /// Blocks of the host tier.
    pub host_blocks: usize,
    /// Blocks of the file tier.
    pub file_blocks: usize,
    /// What recomputing one block costs (prefill of its tokens).
    pub recompute_per_block: Duration,
}

impl TierConfig {
    /// A configuration of these sizes.
    pub fn new(
        block_len: u64,
        hot_blocks: usize,
        host_blocks: usize,
        file_blocks: usize,
        recompute_per_block: Duration,
    ) -> Self {
        TierConfig {
            block_len,
            hot_blocks,
            host_blocks,
            file_blocks,
            recompute_per_block,
        }
    }
}

/// What one tier saw.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[non_exhaustive]
pub struct TierCounters {
    /// Requested blocks found in this tier (and not above it).
    pub hits: u64,
    /// Bytes written into this tier.
    pub bytes_in: u64,
    /// Bytes read out of this tier to promote blocks.
    pub bytes_out: u64,
    /// Demotions that wrote nothing: the block was already stored (write once).
    pub writes_skipped: u64,
    /// Groups of hits reloaded from this tier.
    pub reloads: u64,
    /// Groups of hits recomputed because reloading measured slower.
    pub recomputes: u64,
    /// Measured cost of reloading one block from this tier (`None`: not measured yet).
    pub per_block: Option<Duration>,
}

/// What the cache did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[non_exhaustive]
pub struct TierStats {
    /// Blocks requested.
    pub lookups: u64,
    /// Blocks found in no tier (recomputed).
    pub misses: u64,
    /// Blocks the engine was asked to recompute (misses and hits not worth reloading).
    pub recomputed: u64,
    /// Per tier, hottest first ([`Tier::ALL`]).
    pub tiers: [TierCounters; 4],
}

impl TierStats {
    /// The counters of `tier`.
    pub fn tier(&self, tier: Tier) -> &TierCounters {
        &self.tiers[tier.index()]
    }
}

/// Where a requested block now is in the hot tier, and how it got there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// The block.
    pub block: u64,
    /// Its hot slot (bytes `slot * block_len..` of the hot region).
    pub slot: usize,
    /// `None`: the engine must compute it into the slot now. `Some(tier)`: its bytes are
    /// there, from `tier` ([`Tier::Hot`]: it was already there).
    pub from: Option<Tier>,
}

/// Fixed slots of one tier with their policy.
struct Slots {
    at: HashMap<u64, usize>,
    free: Vec<usize>,
    policy: Box<dyn Policy>,
}

impl Slots {
    fn new(n: usize, policy: Box<dyn Policy>) -> Self {
        Slots {
            at: HashMap::new(),
            free: (0..n).rev().collect(),
            policy,
        }
    }

    fn get(&self, b: u64) -> Option<usize> {
        self.at.get(&b).copied()
    }

    fn put(&mut self, b: u64) -> Option<usize> {
        let s = self.free.pop()?;
        self.at.insert(b, s);
        self.policy.added(b);
        Some(s)
    }

    fn remove(&mut self, b: u64) -> Option<usize> {
        let s = self.at.remove(&b)?;
        self.free.push(s);
        self.policy.removed(b);
        Some(s)
    }

    /// Victims enough to leave `n` slots free, none of them in `keep`.
    fn victims(&self, n: usize, keep: &HashSet<u64>) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::new();
        while self.free.len() + out.len() < n {
            let chosen = |b: u64| keep.contains(&b) || out.contains(&b);
            match self.policy.victim(&chosen) {
                Some(v) => out.push(v),
                None => break,
            }
        }
        out
    }
}

/// Measured reload cost of one tier: an exponentially weighted mean of seconds per block.
#[derive(Debug, Default, Clone, Copy)]
struct Cost {
    per_block: Option<f64>,
    /// Groups recomputed since the last measurement.
    declined: u32,
}

/// A tier judged too slow is still reloaded once every this many groups, so its estimate
/// follows the tier (a first, cold measurement does not rule it out for good).
const PROBE_EVERY: u32 = 16;

impl Cost {
    fn record(&mut self, blocks: usize, took: Duration) {
        let x = took.as_secs_f64() / blocks.max(1) as f64;
        self.per_block = Some(self.per_block.map_or(x, |m| 0.7 * m + 0.3 * x));
        self.declined = 0;
    }
}

/// The cache. Not `Sync`: one engine step loop owns it.
pub struct TieredCache {
    agent: Agent,
    cfg: TierConfig,
    hot_mem: Registration,
    host_mem: Registration,
    file: FileRegistration,
    objects: ObjectRegistration,
    hot: Slots,
    host: Slots,
    stored: Slots,
    archived: HashSet<u64>,
    costs: [Cost; 4],
    stats: TierStats,
}

impl std::fmt::Debug for TieredCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredCache")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// The object key of a block.
pub fn block_key(block: u64) -> String {
    format!("blocks/{}", hex::encode(block.to_be_bytes()))
}

impl TieredCache {
    /// A cache over `hot` and `host` (regions of at least `hot_blocks` and `host_blocks`
    /// blocks), `file` (at least `file_blocks`) and `objects`, each tier replaced by a policy
    /// from `policy`.
    ///
    /// # Errors
    /// [`TierError::UnalignedBlock`], [`TierError::TooSmall`].
    pub fn new(
        agent: &Agent,
        cfg: TierConfig,
        hot: Registration,
        host: Registration,
        file: FileRegistration,
        objects: ObjectRegistration,
        policy: impl Fn() -> Box<dyn Policy>,
    ) -> Result<Self, TierError> {
        if cfg.block_len == 0 || !cfg.block_len.is_multiple_of(4096) {
            return Err(TierError::UnalignedBlock(cfg.block_len));
        }
        let fits = |tier, blocks: usize, len: u64| {
            let needed = blocks as u64 * cfg.block_len;
            (needed <= len)
                .then_some(())
                .ok_or(TierError::TooSmall { tier, needed, len })
        };
        fits(Tier::Hot, cfg.hot_blocks, hot.region().len())?;
        fits(Tier::Host, cfg.host_blocks, host.region().len())?;
        fits(Tier::File, cfg.file_blocks, file.size())?;
        Ok(TieredCache {
            agent: agent.clone(),
            hot: Slots::new(cfg.hot_blocks, policy()),
            host: Slots::new(cfg.host_blocks, policy()),
            stored: Slots::new(cfg.file_blocks, policy()),
            cfg,
            hot_mem: hot,
            host_mem: host,
            file,
            objects,
            archived: HashSet::new(),
            costs: [Cost::default(); 4],
            stats: TierStats::default(),
        })
    }

    /// The hot tier's memory (blocks at `slot * block_len`).
    pub fn hot_region(&self) -> &Region {
        self.hot_mem.region()
    }

    /// The configuration.
    pub fn config(&self) -> &TierConfig {
        &self.cfg
    }

    /// What the cache did so far.
    pub fn stats(&self) -> TierStats {
        let mut s = self.stats;
        for t in Tier::ALL {
            s.tiers[t.index()].per_block =
                self.costs[t.index()].per_block.map(Duration::from_secs_f64);
        }
        s
    }

    /// The hottest tier holding `block`, if any.
    pub fn locate(&self, block: u64) -> Option<Tier> {
        if self.hot.get(block).is_some() {
            Some(Tier::Hot)
        } else if self.host.get(block).is_some() {
            Some(Tier::Host)
        } else if self.stored.get(block).is_some() {
            Some(Tier::File)
        } else if self.archived.contains(&block) {
            Some(Tier::Object)
        } else {
            None
        }
    }

    /// Places `blocks` in the hot tier (see the module docs) and says where each is. Blocks
    /// with `from: None` must be computed into their slot by the caller before the next call.
    ///
    /// # Errors
    /// [`TierError::TooManyBlocks`]; a failed transfer or copy (the cache's indexes stay
    /// consistent: a block whose move failed is dropped from the tiers it was moving between).
    pub async fn acquire(&mut self, blocks: &[u64]) -> Result<Vec<Placed>, TierError> {
        let mut unique: Vec<u64> = Vec::with_capacity(blocks.len());
        for &b in blocks {
            if !unique.contains(&b) {
                unique.push(b);
            }
        }
        if unique.len() > self.cfg.hot_blocks {
            return Err(TierError::TooManyBlocks {
                asked: unique.len(),
                capacity: self.cfg.hot_blocks,
            });
        }
        self.stats.lookups += unique.len() as u64;
        for &b in &unique {
            self.hot.policy.touched(b);
            self.host.policy.touched(b);
            self.stored.policy.touched(b);
        }
        let keep: HashSet<u64> = unique.iter().copied().collect();
        let missing: Vec<u64> = unique
            .iter()
            .copied()
            .filter(|&b| self.hot.get(b).is_none())
            .collect();
        self.stats.tiers[Tier::Hot.index()].hits += (unique.len() - missing.len()) as u64;
        self.make_hot_room(missing.len(), &keep).await?;
        let mut groups: [Vec<(u64, usize)>; 4] = Default::default();
        let mut out = Vec::with_capacity(unique.len());
        for &b in &unique {
            if let Some(slot) = self.hot.get(b) {
                out.push(Placed {
                    block: b,
                    slot,
                    from: Some(Tier::Hot),
                });
                continue;
            }
            let from = self.locate(b);
            let slot = self.hot.put(b).ok_or(TierError::TooManyBlocks {
                asked: unique.len(),
                capacity: self.cfg.hot_blocks,
            })?;
            match from {
                Some(t) => groups[t.index()].push((b, slot)),
                None => self.stats.misses += 1,
            }
            out.push(Placed {
                block: b,
                slot,
                from: None,
            });
        }
        for t in [Tier::Host, Tier::File, Tier::Object] {
            let group = std::mem::take(&mut groups[t.index()]);
            if group.is_empty() {
                continue;
            }
            let c = &mut self.stats.tiers[t.index()];
            c.hits += group.len() as u64;
            if !self.worth_reloading(t, group.len()) {
                self.stats.tiers[t.index()].recomputes += 1;
                if t == Tier::Host {
                    // The hot and host tiers hold a block in one place: the recomputed copy
                    // replaces the host one.
                    for &(b, _) in &group {
                        self.host.remove(b);
                    }
                }
                continue;
            }
            if let Err(e) = self.reload(t, &group).await {
                // Nothing placed by this call holds its bytes now: give the slots back, so no
                // later request takes them for hits.
                for p in &out {
                    if p.from != Some(Tier::Hot) {
                        self.hot.remove(p.block);
                    }
                }
                return Err(e);
            }
            for p in out.iter_mut() {
                if group.iter().any(|&(b, _)| b == p.block) {
                    p.from = Some(t);
                }
            }
        }
        self.stats.recomputed += out.iter().filter(|p| p.from.is_none()).count() as u64;
        Ok(out)
    }

    /// Whether reloading `n` blocks from `t` is expected to beat recomputing them. A tier not
    /// measured yet is tried, to measure it, and one judged slower is tried again every
    /// [`PROBE_EVERY`] groups.
    fn worth_reloading(&mut self, t: Tier, n: usize) -> bool {
        let recompute = self.cfg.recompute_per_block.as_secs_f64() * n as f64;
        let cost = &mut self.costs[t.index()];
        match cost.per_block {
            None => true,
            Some(s) if s * (n as f64) < recompute => true,
            Some(_) => {
                cost.declined += 1;
                cost.declined >= PROBE_EVERY
            }
        }
    }

    fn block_at(&self, slot: usize) -> u64 {
        slot as u64 * self.cfg.block_len
    }

    /// Copies one block between the hot and host regions.
    fn copy(&self, from: &Region, fs: usize, to: &Region, ts: usize) -> Result<(), TierError> {
        let mut buf = vec![0u8; self.cfg.block_len as usize];
        from.read_at(self.block_at(fs), &mut buf)
            .map_err(TierError::Copy)?;
        to.write_at(self.block_at(ts), &buf)
            .map_err(TierError::Copy)
    }

    /// Reloads `group` ((block, hot slot)) from `t` into the hot tier, measuring it.
    async fn reload(&mut self, t: Tier, group: &[(u64, usize)]) -> Result<(), TierError> {
        let len = self.cfg.block_len;
        let t0 = Instant::now();
        match t {
            Tier::Host => {
                for &(b, slot) in group {
                    let hs = self.host.remove(b).unwrap_or_default();
                    self.copy(self.host_mem.region(), hs, self.hot_mem.region(), slot)?;
                }
            }
            Tier::File => {
                let mut local = LocalDescList::new();
                let mut descs = Vec::with_capacity(group.len());
                for &(b, slot) in group {
                    let fs = self.stored.get(b).unwrap_or_default();
                    local.push(self.hot_mem.region(), self.block_at(slot), len);
                    descs.push(FileDesc::new(self.block_at(fs), len));
                }
                self.agent.read_file(&local, &self.file, &descs).await?;
            }
            Tier::Object | Tier::Hot => {
                let mut local = LocalDescList::new();
                let mut descs = Vec::with_capacity(group.len());
                for &(b, slot) in group {
                    local.push(self.hot_mem.region(), self.block_at(slot), len);
                    descs.push(ObjectDesc::new(block_key(b), 0, len));
                }
                self.agent
                    .read_object(&local, &self.objects, &descs)
                    .await?;
            }
        }
        self.costs[t.index()].record(group.len(), t0.elapsed());
        let c = &mut self.stats.tiers[t.index()];
        c.reloads += 1;
        c.bytes_out += group.len() as u64 * len;
        self.stats.tiers[Tier::Hot.index()].bytes_in += group.len() as u64 * len;
        Ok(())
    }

    /// Frees `n` hot slots: victims (not in `keep`) move to the host tier.
    async fn make_hot_room(&mut self, n: usize, keep: &HashSet<u64>) -> Result<(), TierError> {
        let victims = self.hot.victims(n, keep);
        if victims.is_empty() {
            return Ok(());
        }
        self.make_host_room(victims.len(), keep).await?;
        for v in victims {
            let hs = self.hot.remove(v).unwrap_or_default();
            let Some(slot) = self.host.put(v) else {
                // No host room (the file could not take the host's victims): the block is
                // dropped (still in the file or the store, if it was written there).
                tracing::warn!(block = v, "tiered cache: no host slot, block dropped");
                continue;
            };
            if let Err(e) = self.copy(self.hot_mem.region(), hs, self.host_mem.region(), slot) {
                self.host.remove(v);
                return Err(e);
            }
            self.stats.tiers[Tier::Host.index()].bytes_in += self.cfg.block_len;
        }
        Ok(())
    }

    /// Frees `n` host slots (keeping `keep`): victims not yet in the file are written to it in one transfer.
    async fn make_host_room(&mut self, n: usize, keep: &HashSet<u64>) -> Result<(), TierError> {
        let victims = self.host.victims(n, keep);
        if victims.is_empty() {
            return Ok(());
        }
        let new: Vec<u64> = victims
            .iter()
            .copied()
            .filter(|&v| self.stored.get(v).is_none())
            .collect();
        self.stats.tiers[Tier::File.index()].writes_skipped += (victims.len() - new.len()) as u64;
        self.make_file_room(new.len(), keep).await?;
        let len = self.cfg.block_len;
        let mut local = LocalDescList::new();
        let mut descs = Vec::new();
        for &v in &new {
            let Some(fs) = self.stored.put(v) else { break };
            let hs = self.host.get(v).unwrap_or_default();
            local.push(self.host_mem.region(), self.block_at(hs), len);
            descs.push(FileDesc::new(self.block_at(fs), len));
        }
        if !descs.is_empty() {
            if let Err(e) = self.agent.write_file(&local, &self.file, &descs).await {
                for &v in &new {
                    self.stored.remove(v);
                }
                return Err(e.into());
            }
            self.stats.tiers[Tier::File.index()].bytes_in += descs.len() as u64 * len;
        }
        // Only victims now held by the file leave the host tier (the file may have had no room
        // for some).
        for v in victims {
            if self.stored.get(v).is_some() {
                self.host.remove(v);
            }
        }
        Ok(())
    }

    /// Frees `n` file slots (keeping `keep`): victims not yet archived are read back and written to the object
    /// store (one object each, one transfer), then leave the file.
    async fn make_file_room(&mut self, n: usize, keep: &HashSet<u64>) -> Result<(), TierError> {
        let victims = self.stored.victims(n, keep);
        if victims.is_empty() {
            return Ok(());
        }
        let new: Vec<u64> = victims
            .iter()
            .copied()
            .filter(|v| !self.archived.contains(v))
            .collect();
        self.stats.tiers[Tier::Object.index()].writes_skipped += (victims.len() - new.len()) as u64;
        if !new.is_empty() {
            let len = self.cfg.block_len;
            let scratch = self
                .agent
                .register(
                    (new.len() as u64 * len) as usize,
                    crate::agent::Visibility::Only(Vec::new()),
                )
                .await?;
            let mut local = LocalDescList::new();
            let mut fdescs = Vec::new();
            let mut odescs = Vec::new();
            for (i, &v) in new.iter().enumerate() {
                let fs = self.stored.get(v).unwrap_or_default();
                local.push(scratch.region(), i as u64 * len, len);
                fdescs.push(FileDesc::new(self.block_at(fs), len));
                odescs.push(ObjectDesc::new(block_key(v), 0, len));
            }
            self.agent.read_file(&local, &self.file, &fdescs).await?;
            self.agent
                .write_object(&local, &self.objects, &odescs)
                .await?;
            self.archived.extend(new.iter().copied());
            self.stats.tiers[Tier::Object.index()].bytes_in += new.len() as u64 * len;
        }
        for v in victims {
            self.stored.remove(v);
        }
        Ok(())
    }
}
