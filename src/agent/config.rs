//! How an agent is set up, who may see a registration, and how a peer's memory is addressed.

use std::time::Duration;

use super::auth::ClusterKey;
use crate::runtime::{Access, EngineConfig, DEFAULT_IO_MEMORY};

/// Who may see a registration in this agent's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Visibility {
    /// Every peer, READ and WRITE.
    All,
    /// Only these agents, READ and WRITE: others never receive its key from our metadata.
    Only(Vec<String>),
    /// Every peer, READ only (weights served to many readers): with NIC grants, a WRITE
    /// completes with a remote access error.
    ReadOnly,
    /// These agents, each with its own rights.
    Granted(Vec<PeerAccess>),
}

/// One agent's rights to a region ([`Visibility::Granted`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAccess {
    /// The agent.
    pub agent: String,
    /// What it may do.
    pub access: Access,
}

impl Visibility {
    /// What `reader` may do with the region (`None`: it may not see it).
    pub fn access_for(&self, reader: &str) -> Option<Access> {
        match self {
            Visibility::All => Some(Access::ReadWrite),
            Visibility::ReadOnly => Some(Access::Read),
            Visibility::Only(names) => names
                .iter()
                .any(|n| n == reader)
                .then_some(Access::ReadWrite),
            Visibility::Granted(g) => g.iter().find(|p| p.agent == reader).map(|p| p.access),
        }
    }

    pub(crate) fn allows(&self, reader: &str) -> bool {
        self.access_for(reader).is_some()
    }

    /// This visibility with `agent`'s rights set to `access` (`None`: none), everyone else's
    /// kept; `None` for a region every peer sees (`All`, `ReadOnly`), whose rights are not
    /// per agent.
    pub(crate) fn with_access(&self, agent: &str, access: Option<Access>) -> Option<Visibility> {
        let mut list: Vec<PeerAccess> = match self {
            Visibility::Only(names) => names
                .iter()
                .map(|n| PeerAccess {
                    agent: n.clone(),
                    access: Access::ReadWrite,
                })
                .collect(),
            Visibility::Granted(g) => g.clone(),
            Visibility::All | Visibility::ReadOnly => return None,
        };
        list.retain(|p| p.agent != agent);
        list.extend(access.map(|access| PeerAccess {
            agent: agent.to_string(),
            access,
        }));
        Some(Visibility::Granted(list))
    }
}

/// Agent configuration.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AgentConfig {
    /// The engine's configuration.
    pub engine: EngineConfig,
    /// CPU of the agent's engine. Default: the first this process may run on
    /// ([`crate::runtime::available_cpus`]: a `taskset` or a container's cpuset).
    pub cpu: usize,
    /// glommio I/O memory of the engine's core (locked; the FILE tier stages its I/O there and
    /// falls back to the heap when it is full).
    pub io_memory: usize,
    /// RDMA devices to open (one rail each, an engine each on CPUs `cpu`, `cpu + 1`, ...).
    /// Empty: with `engine.device` unset (`RIXL_RDMA_DEVICE`), the NICs the topology says this
    /// agent's GPUs and NUMA node are nearest to ([`Self::gpus`]); when the model places no
    /// NIC (software RoCE only), a single rail on the first device. Every registration is
    /// registered on each rail, and bound to the nearest ones ([`super::Agent::binding`]).
    /// Default: `RIXL_RDMA_RAILS` (comma-separated).
    pub rails: Vec<String>,
    /// The machine model NICs are chosen from. `None`: this machine's (hwloc + NVML), or the
    /// hwloc XML export named by `RIXL_TOPOLOGY_XML`.
    pub topology: Option<std::sync::Arc<crate::topology::Machine>>,
    /// The GPUs (PCI-bus order) whose memory this agent registers: with neither
    /// [`Self::rails`] nor `engine.device` set, the agent opens their nearest NICs (and the
    /// nearest of its CPU's NUMA node). `None`: `RIXL_GPUS` (comma-separated), else every GPU of
    /// the model.
    pub gpus: Option<Vec<u32>>,
    /// The longest a connection set-up to a peer may take (the side-channel exchange and the
    /// queue pair's transitions); a transfer also waits no longer than its own deadline.
    pub connect_timeout: Duration,
    /// The key the agents of this cluster share: side-channel peers prove they hold it, and it
    /// tags every metadata blob. `None`: `RIXL_CLUSTER_KEY` (hex), else the file named by
    /// `RIXL_CLUSTER_KEY_FILE`; without either, [`Agent::new`](super::Agent::new) fails
    /// unless [`Self::insecure`].
    pub cluster_key: Option<ClusterKey>,
    /// Runs without a cluster key: any client can claim any name and metadata is not
    /// protected. Only for a trusted, closed network; the agent warns on every side-channel
    /// connection.
    pub insecure: bool,
    /// The most side-channel connections served at once (more wait in the kernel's accept
    /// queue).
    pub max_side_channel_connections: usize,
    /// The largest metadata blob a side-channel fetch accepts, in bytes (1 MiB; at least 1 KiB,
    /// at most the format's 64 MiB). Hello and request lines have fixed limits of 1 and 4 KiB.
    pub max_control_message: usize,
    /// Notifications one peer may deliver per second (bursts of a tenth of it); a faster peer
    /// is slowed by back-pressure, nothing is dropped.
    pub notification_rate: u32,
    /// Peers reach our memory only through grants the NIC enforces (default; `RIXL_NIC_GRANTS=0`
    /// turns it off): regions are registered without remote access, and each peer gets a
    /// type-2 memory window per region it may reach, bound to the queue pair of its own
    /// connection, with its rights ([`Visibility::access_for`]). Off: a region's own rkey
    /// reaches it from any queue pair (as NIXL), and read-only visibility is not enforced.
    pub nic_grants: bool,
}

impl AgentConfig {
    /// This configuration with `key` as its cluster key.
    pub fn with_cluster_key(mut self, key: ClusterKey) -> Self {
        self.cluster_key = Some(key);
        self
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            engine: EngineConfig::from_env(),
            cpu: crate::runtime::cpu_at(0),
            io_memory: DEFAULT_IO_MEMORY,
            rails: std::env::var("RIXL_RDMA_RAILS")
                .map(|v| {
                    v.split(',')
                        .filter(|s| !s.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
            topology: None,
            gpus: std::env::var("RIXL_GPUS")
                .ok()
                .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect()),
            connect_timeout: Duration::from_secs(5),
            cluster_key: None,
            insecure: false,
            max_side_channel_connections: 256,
            max_control_message: 1 << 20,
            notification_rate: 100_000,
            nic_grants: std::env::var("RIXL_NIC_GRANTS").map_or(true, |v| v != "0"),
        }
    }
}

/// A remote descriptor in a peer's terms: `len` bytes at `offset` of its region `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRef {
    /// The peer's region id (from its metadata).
    pub region: u64,
    /// Offset into the region.
    pub offset: u64,
    /// Length.
    pub len: u64,
}
