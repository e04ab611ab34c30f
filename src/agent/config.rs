//! How an agent is set up, who may see a registration, and how a peer's memory is addressed.

use std::time::Duration;

use crate::runtime::{EngineConfig, DEFAULT_IO_MEMORY};

/// Who may see a registration in this agent's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Visibility {
    /// Every peer.
    All,
    /// Only these agents: others never receive its key from our metadata.
    Only(Vec<String>),
}

impl Visibility {
    pub(crate) fn allows(&self, reader: &str) -> bool {
        match self {
            Visibility::All => true,
            Visibility::Only(names) => names.iter().any(|n| n == reader),
        }
    }
}

/// Agent configuration.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AgentConfig {
    /// The engine's configuration.
    pub engine: EngineConfig,
    /// CPU of the agent's engine.
    pub cpu: usize,
    /// glommio I/O memory of the engine's core (locked; the FILE tier stages its I/O there and
    /// falls back to the heap when it is full).
    pub io_memory: usize,
    /// RDMA devices to stripe large transfers over (multi-rail), one engine each on CPUs
    /// `cpu`, `cpu + 1`, ...; empty or one entry: a single rail on `engine.device`. Every DRAM
    /// registration is registered on each rail. Default: `RIXL_RDMA_RAILS` (comma-separated).
    pub rails: Vec<String>,
    /// The longest a connection set-up to a peer may take (the side-channel exchange and the
    /// queue pair's transitions); a transfer also waits no longer than its own deadline.
    pub connect_timeout: Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            engine: EngineConfig::from_env(),
            cpu: 0,
            io_memory: DEFAULT_IO_MEMORY,
            rails: std::env::var("RIXL_RDMA_RAILS")
                .map(|v| {
                    v.split(',')
                        .filter(|s| !s.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
            connect_timeout: Duration::from_secs(5),
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
