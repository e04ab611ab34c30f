//! Which NICs memory is bound to: the nearest of the NICs an agent has open, and only those
//! equally near (the ones a large transfer is striped over). GPU memory ranks NICs by PCIe
//! distance (same switch, then same root complex, then same NUMA node, then across sockets);
//! host memory by NUMA node.

use crate::model::{Machine, Relation};
use crate::path::{MemoryLocation, GDR_MAX_RELATION};

/// The NICs chosen for some memory.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NicChoice {
    /// The memory.
    pub memory: MemoryLocation,
    /// The chosen NICs, first preferred (small transfers go on it; large ones stripe over all).
    /// Empty when there is no NIC to choose from.
    pub nics: Vec<String>,
    /// How near they are ([`Relation::Unknown`] for NICs without PCI information, such as
    /// software RoCE).
    pub relation: Relation,
}

impl NicChoice {
    /// Whether GPU memory goes to these NICs directly ([`reaches_directly`]).
    pub fn gpudirect(&self) -> bool {
        reaches_directly(self.memory, self.relation)
    }
}

/// Whether memory at `memory` goes directly to a NIC `relation` away: GPU memory when the NIC
/// is no farther than [`GDR_MAX_RELATION`] (GPUDirect RDMA); across sockets, or where locality
/// is unknown, it is staged through host memory when staging is allowed. Host memory always.
pub fn reaches_directly(memory: MemoryLocation, relation: Relation) -> bool {
    match memory {
        MemoryLocation::Gpu { .. } => relation <= GDR_MAX_RELATION,
        MemoryLocation::Host { .. } => true,
    }
}

impl Machine {
    /// The NICs `memory` is bound to among `open` (by name, in any order; `None`: every NIC of
    /// the model): the nearest ones, equally near only, in [`Machine::rails`]' order (equally
    /// near NICs rotated by the GPU's index, so GPUs sharing a switch prefer different NICs
    /// first). A name the model does not know ranks [`Relation::Unknown`].
    pub fn nic_choice(&self, memory: MemoryLocation, open: Option<&[String]>) -> NicChoice {
        let mut ranked: Vec<(String, Relation)> = self
            .rails(memory)
            .into_iter()
            .filter(|r| open.is_none_or(|o| o.contains(&r.nic)))
            .map(|r| (r.nic, r.relation))
            .collect();
        if let Some(open) = open {
            for name in open {
                if self.nic(name).is_none() {
                    ranked.push((name.clone(), Relation::Unknown));
                }
            }
        }
        let Some(best) = ranked.first().map(|r| r.1) else {
            return NicChoice {
                memory,
                nics: Vec::new(),
                relation: Relation::Unknown,
            };
        };
        NicChoice {
            memory,
            nics: ranked
                .into_iter()
                .take_while(|r| r.1 == best)
                .map(|r| r.0)
                .collect(),
            relation: best,
        }
    }

    /// The NUMA node CPU `cpu` belongs to.
    pub fn numa_of_cpu(&self, cpu: u32) -> Option<u32> {
        self.numa
            .iter()
            .find(|n| n.cpus.contains(&cpu))
            .map(|n| n.id)
    }

    /// The NICs an agent opens by default, in the model's NIC order: the choices of GPUs
    /// `gpus` (`None`: every GPU of the model), and for host memory on NUMA node `numa` one of
    /// that node's nearest NICs when no GPU's choice is among them (all of them on a machine
    /// without GPUs). Only NICs the model places on the PCI tree count: software NICs (rxe)
    /// have no locality to choose by, so a model with only those gives none (the caller keeps
    /// its single default device).
    pub fn agent_nics(&self, gpus: Option<&[u32]>, numa: Option<u32>) -> Vec<String> {
        let placed: Vec<String> = self
            .nics
            .iter()
            .filter(|n| !n.pci.address.is_empty())
            .map(|n| n.name.clone())
            .collect();
        if placed.is_empty() {
            return Vec::new();
        }
        let mut wanted: Vec<String> = Vec::new();
        for g in self
            .gpus
            .iter()
            .filter(|g| gpus.is_none_or(|l| l.contains(&g.index)))
        {
            wanted.extend(
                self.nic_choice(MemoryLocation::Gpu { index: g.index }, Some(&placed))
                    .nics,
            );
        }
        let host = self
            .nic_choice(MemoryLocation::Host { numa }, Some(&placed))
            .nics;
        if wanted.is_empty() {
            wanted = host;
        } else if !host.iter().any(|n| wanted.contains(n)) {
            wanted.extend(host.into_iter().take(1));
        }
        placed.into_iter().filter(|n| wanted.contains(n)).collect()
    }
}
