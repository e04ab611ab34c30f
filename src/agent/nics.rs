//! NIC binding: which of the agent's NICs (its rails) each registration's transfers go on,
//! chosen from the machine's topology (hwloc + NVML, [`crate::topology`]).
//!
//! - GPU memory is bound to the NICs with the best PCIe path to its GPU: same switch, then
//!   same root complex, then same NUMA node, then across sockets.
//! - Host memory is bound to the NICs on its own NUMA node (read from `/proc/self/numa_maps`,
//!   else the engine CPU's node).
//! - Only equally near NICs are kept, so a transfer stripes only over NICs that are equally
//!   close; a small transfer goes on the first.
//! - [`Agent::bind`] overrides the choice per registration.
//!
//! Every registration is registered on every rail regardless, so a peer reaches it on any rail;
//! the binding is the preference both sides' transfers follow ([`crate::runtime::lanes`]).

use std::sync::Arc;

use crate::runtime::{LocalDescList, RemoteDescList};
use crate::topology::{Machine, MemoryLocation, NicChoice, Relation};

use super::metadata::MAX_RAILS;
use super::{Agent, AgentError, Inner, Registration};

/// What a registration's NIC binding is set from ([`Agent::bind`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Bind {
    /// From the topology: the nearest NICs to its GPU or NUMA node (the default).
    Auto,
    /// From the topology, as if the memory were at this location (host memory standing in for
    /// a GPU's, or memory whose NUMA node the agent cannot see).
    Location(MemoryLocation),
    /// These NICs, by verbs device name, the first preferred.
    Nics(Vec<String>),
}

/// A registration's NIC binding ([`Agent::binding`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NicBinding {
    /// Where the memory is, as the choice saw it.
    pub location: MemoryLocation,
    /// The rails (indexes into [`Agent::nics`]) it is bound to, the first preferred.
    pub rails: Vec<usize>,
    /// Their NICs.
    pub nics: Vec<String>,
    /// How near they are to the memory ([`Relation::Unknown`] for NICs without PCI
    /// information, such as software RoCE, or when set by name).
    pub relation: Relation,
    /// Whether it was set by [`Agent::bind`] rather than chosen.
    pub overridden: bool,
}

impl NicBinding {
    /// Whether the memory reaches its NICs without a socket crossing (GPUDirect RDMA for GPU
    /// memory; always for host memory).
    pub fn gpudirect(&self) -> bool {
        crate::topology::reaches_directly(self.location, self.relation)
    }

    /// The bound rails as the bit mask metadata carries (bit `i`: rail `i`).
    pub(crate) fn mask(&self) -> u8 {
        let m = self
            .rails
            .iter()
            .filter(|&&r| r < MAX_RAILS)
            .fold(0u8, |m, &r| m | (1 << r));
        if m == 0 {
            1
        } else {
            m
        }
    }
}

/// The agent's view of its machine and NICs.
#[derive(Debug)]
pub(crate) struct Nics {
    /// The machine model the choices are made from.
    pub machine: Arc<Machine>,
    /// Each rail's NIC name (empty on a core without one).
    pub names: Vec<String>,
    /// The NUMA node of the agent's engine CPU (host memory whose node is unknown).
    pub home_numa: Option<u32>,
}

impl Nics {
    /// The topology's choice for memory at `location` among the agent's NICs.
    pub fn choice(&self, location: MemoryLocation) -> NicChoice {
        let open: Vec<String> = self
            .names
            .iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect();
        self.machine.nic_choice(location, Some(&open))
    }

    /// The binding of memory at `location`: the topology's choice among the agent's NICs.
    pub fn choose(&self, location: MemoryLocation) -> NicBinding {
        let choice = self.choice(location);
        let rails: Vec<usize> = choice
            .nics
            .iter()
            .filter_map(|n| self.names.iter().position(|x| x == n))
            .collect();
        NicBinding {
            location,
            rails: if rails.is_empty() { vec![0] } else { rails },
            nics: choice.nics,
            relation: choice.relation,
            overridden: false,
        }
    }

    /// The binding to `nics` by name.
    ///
    /// # Errors
    /// [`AgentError::UnknownNic`] for a name that is not one of the agent's NICs, or none.
    pub fn named(
        &self,
        location: MemoryLocation,
        nics: &[String],
    ) -> Result<NicBinding, AgentError> {
        if nics.is_empty() {
            return Err(AgentError::UnknownNic {
                nic: String::new(),
                have: self.names.clone(),
            });
        }
        let mut rails = Vec::with_capacity(nics.len());
        for n in nics {
            match self.names.iter().position(|x| x == n) {
                Some(r) if !rails.contains(&r) => rails.push(r),
                Some(_) => {}
                None => {
                    return Err(AgentError::UnknownNic {
                        nic: n.clone(),
                        have: self.names.clone(),
                    })
                }
            }
        }
        Ok(NicBinding {
            location,
            nics: rails.iter().map(|&r| self.names[r].clone()).collect(),
            rails,
            relation: Relation::Unknown,
            overridden: true,
        })
    }

    /// Where host memory at `addr` lives: its pages' NUMA node, else the engine CPU's.
    pub fn host_location(&self, addr: u64) -> MemoryLocation {
        let numa = if self.machine.numa.len() > 1 {
            std::fs::read_to_string("/proc/self/numa_maps")
                .ok()
                .and_then(|maps| numa_of(&maps, addr))
                .or(self.home_numa)
        } else {
            self.home_numa
        };
        MemoryLocation::Host { numa }
    }

    /// Where memory of GPU `ordinal` (CUDA's numbering) lives in the model: matched by PCI bus
    /// id, else the ordinal itself.
    pub fn gpu_location(&self, ordinal: i32) -> MemoryLocation {
        let by_pci = crate::gpudirect::probe().ok().and_then(|c| {
            let g = c.gpus.iter().find(|g| g.ordinal == ordinal)?;
            let bus = crate::topology::normalize_pci(&g.pci_address);
            self.machine
                .gpus
                .iter()
                .find(|m| m.pci.address == bus)
                .map(|m| m.index)
        });
        MemoryLocation::Gpu {
            index: by_pci.unwrap_or(ordinal.max(0) as u32),
        }
    }
}

/// The NUMA node most of the pages of the mapping containing `addr` are on, from the text of
/// `/proc/self/numa_maps` (a line per mapping: start address in hex, policy, then `N<node>=<pages>`
/// fields). `None` when the mapping has no pages yet or is not listed.
pub(crate) fn numa_of(maps: &str, addr: u64) -> Option<u32> {
    let line = maps
        .lines()
        .filter_map(|l| {
            let start = u64::from_str_radix(l.split(' ').next()?, 16).ok()?;
            (start <= addr).then_some((start, l))
        })
        .max_by_key(|(start, _)| *start)?
        .1;
    line.split(' ')
        .filter_map(|f| {
            let (node, pages) = f.strip_prefix('N')?.split_once('=')?;
            Some((node.parse::<u32>().ok()?, pages.parse::<u64>().ok()?))
        })
        .max_by_key(|&(_, pages)| pages)
        .map(|(node, _)| node)
}

/// The first of `remote`'s regions (the peer `p`'s memory) that no NIC reaches, if any
/// (one load when the peer has none).
pub(crate) fn ipc_only_target(p: &super::peers::Peer, remote: &RemoteDescList) -> Option<u64> {
    if !p.ipc_only {
        return None;
    }
    let mut last = None;
    for d in &remote.0 {
        if last == Some(d.rkey) {
            continue;
        }
        last = Some(d.rkey);
        if let Some(info) = p.by_rkey.get(&d.rkey).filter(|i| i.bound == 0) {
            return Some(info.id);
        }
    }
    None
}

impl Inner {
    /// The rails a transfer of `local` to or from `remote` (the peer `p`'s memory) goes on:
    /// where both bindings meet ([`crate::runtime::lanes`]), the first alone for a small
    /// transfer. Rail 0 alone when either agent has one rail.
    pub(crate) fn lanes_for(
        &self,
        p: &super::peers::Peer,
        local: &LocalDescList,
        remote: &RemoteDescList,
    ) -> Vec<usize> {
        let shared = self.rails.len().min(self.peer_rails(p));
        if shared <= 1 {
            return vec![0];
        }
        let regs = self.regs.load();
        let mut mine: Option<Vec<usize>> = None;
        for r0 in local.regions() {
            if let Some(g) = regs.values().find(|g| g.region.same(r0)) {
                let b = &g.binding.rails;
                mine = Some(match mine {
                    None => b.clone(),
                    Some(m) => m.into_iter().filter(|x| b.contains(x)).collect(),
                });
            }
        }
        let mut mask = u8::MAX;
        let mut last = None;
        for d in &remote.0 {
            if last == Some(d.rkey) {
                continue;
            }
            last = Some(d.rkey);
            if let Some(info) = p.by_rkey.get(&d.rkey) {
                mask &= info.bound;
            }
        }
        let theirs: Vec<usize> = (0..MAX_RAILS).filter(|i| mask & (1 << i) != 0).collect();
        let lanes = crate::runtime::lanes(&mine.unwrap_or_default(), &theirs, shared);
        self.rails.stripes(local.total_len(), &lanes)
    }

    /// The binding of a new registration of `region`'s memory.
    pub(crate) fn bind_new(&self, region: &crate::runtime::Region) -> NicBinding {
        let location = match region.gpu_memory() {
            Some(m) => self.nics.gpu_location(m.gpu().ordinal()),
            None => self.nics.host_location(region.addr()),
        };
        self.nics.choose(location)
    }
}

impl Agent {
    /// The NICs this agent opened, one per rail (rail 0 first; an empty name on a core without
    /// a NIC).
    pub fn nics(&self) -> &[String] {
        &self.inner.nics.names
    }

    /// The machine model NICs are chosen from ([`crate::agent::AgentConfig::topology`], else
    /// this machine's, discovered when the agent started).
    pub fn topology(&self) -> &Machine {
        &self.inner.nics.machine
    }

    /// The topology's choice among this agent's NICs for memory at `location`: what a new
    /// registration there is bound to, and what `rixl topo --json --nics ...` prints.
    pub fn nic_choice(&self, location: MemoryLocation) -> NicChoice {
        self.inner.nics.choice(location)
    }

    /// The NICs `reg`'s transfers go on (`None`: another agent's registration).
    pub fn binding(&self, reg: &Registration) -> Option<NicBinding> {
        if !reg.belongs_to(&self.inner) {
            return None;
        }
        self.inner
            .regs
            .load()
            .get(&reg.id())
            .map(|r| r.binding.clone())
    }

    /// Binds `reg` to other NICs ([`Bind`]): a location for the topology to choose from, NIC
    /// names, or the topology's own choice again. Peers learn the new binding with the next
    /// metadata they load.
    ///
    /// # Errors
    /// [`AgentError::UnknownLocalRegion`] for another agent's registration;
    /// [`AgentError::UnknownNic`] for a NIC this agent did not open.
    pub fn bind(&self, reg: &Registration, bind: Bind) -> Result<NicBinding, AgentError> {
        if !reg.belongs_to(&self.inner) {
            return Err(AgentError::UnknownLocalRegion(reg.id()));
        }
        let cur = Arc::clone(
            self.inner
                .regs
                .load()
                .get(&reg.id())
                .ok_or(AgentError::UnknownLocalRegion(reg.id()))?,
        );
        let binding = match bind {
            Bind::Auto => self.inner.bind_new(&cur.region),
            Bind::Location(location) => NicBinding {
                overridden: true,
                ..self.inner.nics.choose(location)
            },
            Bind::Nics(names) => self.inner.nics.named(cur.binding.location, &names)?,
        };
        drop(cur);
        let id = reg.id();
        let b = binding.clone();
        self.inner.regs.update(move |regs| {
            if let Some(r) = regs.get(&id) {
                let mut new = (**r).clone();
                new.binding = b;
                regs.insert(id, Arc::new(new));
            }
        });
        tracing::info!(agent = %self.inner.name, region = id, nics = ?binding.nics, relation = %binding.relation, "registration bound");
        self.inner.metadata_changed();
        Ok(binding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::metadata::{MemKind, RegionInfo};
    use crate::runtime::RemoteDesc;

    #[test]
    fn nic_less_regions_no_nic_reaches_are_refused_for_rdma_before_anything_is_posted() {
        let region = |id: u64, bound: u8| RegionInfo {
            id,
            addr: id << 20,
            len: 1 << 20,
            rkey: id as u32,
            kind: MemKind::Vram,
            rail_rkeys: [0; MAX_RAILS - 1],
            bound,
        };
        let desc = |rkey: u32| RemoteDesc {
            addr: u64::from(rkey) << 20,
            len: 4096,
            rkey,
        };
        let mut p = super::super::peers::Peer {
            by_rkey: [(1, region(1, 0b01)), (2, region(2, 0))]
                .into_iter()
                .collect(),
            ..Default::default()
        };
        let list = RemoteDescList(vec![desc(1), desc(1), desc(2)]);
        // Not flagged as having IPC-only regions: one load, no lookup.
        assert_eq!(ipc_only_target(&p, &list), None);
        p.ipc_only = true;
        assert_eq!(ipc_only_target(&p, &list), Some(2));
        assert_eq!(ipc_only_target(&p, &RemoteDescList(vec![desc(1)])), None);
    }

    #[test]
    fn nic_choice_numa_maps_name_the_node_most_pages_are_on() {
        let maps = "\
55d0c0000000 default file=/usr/bin/x mapped=10 N0=10 kernelpagesize_kB=4
7f0000000000 default anon=300 dirty=300 N0=100 N1=200 kernelpagesize_kB=4
7f0000200000 bind:1 anon=5 dirty=5 N1=5 kernelpagesize_kB=4
7f1000000000 default
";
        assert_eq!(numa_of(maps, 0x7f00_0000_0000), Some(1));
        assert_eq!(
            numa_of(maps, 0x7f00_0010_0000),
            Some(1),
            "inside the mapping"
        );
        assert_eq!(numa_of(maps, 0x55d0_c000_1000), Some(0));
        assert_eq!(numa_of(maps, 0x7f10_0000_0000), None, "no pages yet");
        assert_eq!(numa_of(maps, 0x1000), None, "below every mapping");
        assert_eq!(numa_of("garbage\n\n", 0x1000), None);
    }
}
