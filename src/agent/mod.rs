//! The `Agent`: what a serving engine programs against (NIXL's northbound semantics, async and
//! typed). It owns one engine per rail, memory registrations with export scoping, peers'
//! metadata, lazily made connections, and a notification stream.
//!
//! - [`registry`](Registration): DRAM, VRAM and FILE registrations and the metadata made from
//!   them;
//! - peers: metadata loaded from a blob, the side channel or etcd, read lock-free on every
//!   transfer;
//! - requests: READ/WRITE by the peer's region ids, prepared requests, index selections; the
//!   transport (RDMA, CUDA IPC, FILE) is picked per descriptor pair;
//! - notifications.

pub mod auth;
mod cache;
mod config;
mod conns;
pub(crate) mod error;
mod estimate;
mod etcd;
mod files;
pub(crate) mod grants;
mod handle;
mod link;
pub mod metadata;
mod nics;
mod notify;
mod peers;
pub(crate) mod registry;
mod requests;
pub(crate) mod sidechannel;
mod snapshot;
mod staged;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_channel::mpsc;

use crate::nvlink::plan::IpcPaths;
use crate::runtime::{EngineHandle, EnginePool, Rails};
use metadata::MAX_RAILS;
use snapshot::{lock, Snapshot};

pub use crate::runtime::Access;
pub use crate::runtime::{STRIPE_MIN, STRIPE_SLICE};
pub use auth::{AuthError, ClusterKey};
pub use config::{AgentConfig, PeerAccess, RemoteRef, Visibility};
pub use error::AgentError;
pub use etcd::MembershipCounters;
pub use files::FileRegistration;
pub use grants::GrantCounters;
pub use handle::{CallOptions, Transfer, TransferStatus};
pub use link::{LinkCounters, BACKOFF_MAX, BACKOFF_MIN};
pub use nics::{Bind, NicBinding};
pub use notify::{
    Notification, Notifications, MAX_NOTIFICATION, NOTIFICATION_QUEUE, SIDE_NOTIFY_WAIT,
};
pub use registry::{MemoryInfo, Registration, RegistrationCounters, Released};
pub use requests::{PreparedLocal, PreparedRemote, TransferRequest};
pub use sidechannel::SideChannelCounters;
pub use staged::{StagingCalibration, StagingCounters, STAGE_CHUNK, STAGE_SLOTS};

pub(crate) struct Inner {
    name: String,
    generation: u64,
    /// One engine per NIC (rail 0 also serves the FILE tier, notifications and IPC copies).
    rails: Rails,
    /// The engines' pools, rail 0 first (taken on shutdown).
    pools: Mutex<Vec<EnginePool>>,
    regs: Snapshot<registry::Registrations>,
    /// Live NIC registrations of caller memory by address (the registration cache).
    cache: Mutex<registry::MrCache>,
    next_id: AtomicU64,
    /// This machine's identity in metadata (boot id and host name).
    node: String,
    /// The same-node GPU path (planning, copy streams, peers' opened exports).
    ipc: IpcPaths,
    peers: Snapshot<peers::PeerMap>,
    address: Mutex<String>,
    notif_tx: mpsc::Sender<Notification>,
    /// Notifications a peer may deliver per second ([`AgentConfig::notification_rate`]).
    notification_rate: u32,
    /// The side channel's one sender into the notification stream.
    side_tx: Mutex<mpsc::Sender<Notification>>,
    /// The rate caps of peers' notifications on the side channel, by peer.
    side_caps: Mutex<std::collections::HashMap<String, notify::RateCap>>,
    notif_rx: Mutex<Option<Notifications>>,
    stopped: AtomicBool,
    /// Connection set-ups, their backoff, and retired connections.
    links: link::Links,
    /// The longest a connection set-up may take ([`AgentConfig::connect_timeout`]).
    connect_timeout: std::time::Duration,
    /// A call's deadline when it sets none (the engine's `transfer_timeout`).
    transfer_timeout: std::time::Duration,
    /// Membership through etcd, once joined.
    membership: Mutex<Option<etcd::Membership>>,
    membership_counters: etcd::Counters,
    /// Told when this agent's metadata changes (membership PUTs it again).
    metadata_watchers: Mutex<Vec<mpsc::UnboundedSender<()>>>,
    /// The cluster key this agent proves itself with (or the public one, insecure).
    identity: auth::Identity,
    /// The side channel's bounds.
    limits: SideChannelLimits,
    side_counters: sidechannel::Counters,
    /// Whether peers reach our memory through NIC grants only ([`AgentConfig::nic_grants`]).
    nic_grants: bool,
    /// The windows bound for peers.
    grants: grants::GrantTable,
    /// The OBJECT tier's I/O threads, started by the first object registration.
    objects: std::sync::OnceLock<Arc<crate::object::Runtime>>,
    /// The machine model and each rail's NIC: what registrations are bound by.
    nics: nics::Nics,
    /// Host-staged RDMA's registered slots (made on first use) and counters.
    stage_area: Mutex<Option<Arc<staged::StageArea>>>,
    staging: Mutex<StagingCounters>,
    /// Staged registrations (the transfer path skips the lookup while there are none).
    staged_regs: std::sync::atomic::AtomicUsize,
    /// Registrations whose staging is chosen by measurement, and how many are undecided.
    auto_stage: Mutex<std::collections::HashMap<u64, staged::AutoStage>>,
    auto_pending: std::sync::atomic::AtomicUsize,
}

/// The side channel's bounds ([`AgentConfig::max_side_channel_connections`],
/// [`AgentConfig::max_control_message`]).
#[derive(Debug, Clone, Copy)]
struct SideChannelLimits {
    connections: usize,
    message: usize,
}

/// Connections held by the engines and known to the agent ([`Agent::connection_census`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionCensus {
    /// Connections each rail's engine holds (rail 0 first), closing ones included; 0 for an
    /// engine that did not answer.
    pub engines: Vec<usize>,
    /// Rails whose engine did not answer (gone, or its core stalled): what they hold is not
    /// known.
    pub unanswered: Vec<usize>,
    /// Connections the agent's peers use or accepted (all rails).
    pub known: usize,
}

impl ConnectionCensus {
    /// Whether every engine answered and every connection they hold is one the agent knows.
    pub fn balanced(&self) -> bool {
        self.unanswered.is_empty() && self.engines.iter().sum::<usize>() == self.known
    }
}

/// This machine in metadata: the kernel's boot id (unique per boot) and the host name.
fn node_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}/{}", boot.trim(), host.trim())
}

/// The agent. `Send + Sync`; clone it freely.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl Agent {
    /// Starts an agent named `name` (unique in the cluster) with its engine.
    ///
    /// # Errors
    /// - [`AgentError::Auth`]: no cluster key ([`AgentConfig::cluster_key`], `RIXL_CLUSTER_KEY`
    ///   or `RIXL_CLUSTER_KEY_FILE`) and not configured [`AgentConfig::insecure`], a bad key,
    ///   or a name that cannot travel on the wire (empty, over 256 bytes, whitespace);
    /// - [`AgentError::Runtime`] if the engine cannot start (no device, memlock, ...).
    pub fn new(name: &str, cfg: AgentConfig) -> Result<Agent, AgentError> {
        auth::check_name(name)?;
        let identity = auth::Identity::resolve(cfg.cluster_key.clone(), cfg.insecure)?;
        if identity.insecure {
            tracing::warn!(agent = %name, "agent configured INSECURE: peers' names are not authenticated and metadata is not protected");
        }
        let machine = match (cfg.topology.clone(), std::env::var_os("RIXL_TOPOLOGY_XML")) {
            (Some(m), _) => m,
            (None, Some(p)) => Arc::new(crate::topology::hwloc::from_xml_file(
                std::path::Path::new(&p),
            )?),
            // Discovered once per process (hwloc and NVML take about 19 ms on the development
            // VM): every agent of the process shares the model.
            (None, None) => {
                static MACHINE: std::sync::OnceLock<Arc<crate::topology::Machine>> =
                    std::sync::OnceLock::new();
                Arc::clone(MACHINE.get_or_init(|| Arc::new(crate::nvlink::discover_machine())))
            }
        };
        let home_numa = machine.numa_of_cpu(cfg.cpu as u32);
        let mut devices = cfg.rails.clone();
        let mut chosen = false;
        if devices.is_empty() && cfg.engine.device.is_none() {
            devices = machine.agent_nics(cfg.gpus.as_deref(), home_numa);
            chosen = !devices.is_empty();
            if chosen {
                tracing::info!(agent = %name, nics = ?devices, gpus = ?cfg.gpus, numa = ?home_numa, "NICs chosen from the topology");
            }
        }
        let mut first = cfg.engine.clone();
        first.window_grants = cfg.nic_grants;
        if let Some(d) = devices.first() {
            if devices.len() > 1 || first.device.is_none() {
                first.device = Some(d.clone());
            }
        }
        let first_pool = match EnginePool::start(&first, &[cfg.cpu], cfg.io_memory) {
            Ok(p) => p,
            // A NIC the topology chose that does not open (port down, a management NIC): the
            // configured default device instead, alone.
            Err(e) if chosen => {
                tracing::warn!(agent = %name, nic = ?first.device, error = %e, "the topology's NIC did not open: using the default device");
                devices.clear();
                let mut c = cfg.engine.clone();
                c.window_grants = cfg.nic_grants;
                EnginePool::start(&c, &[cfg.cpu], cfg.io_memory)?
            }
            Err(e) => return Err(e.into()),
        };
        let mut pools = vec![first_pool];
        for (i, dev) in devices.iter().enumerate().skip(1).take(MAX_RAILS - 1) {
            let mut c = cfg.engine.clone();
            c.device = Some(dev.clone());
            c.window_grants = cfg.nic_grants;
            match EnginePool::start(&c, &[crate::runtime::cpu_after(cfg.cpu, i)], cfg.io_memory) {
                Ok(p) => pools.push(p),
                Err(e) if chosen => {
                    tracing::warn!(agent = %name, nic = %dev, error = %e, "a NIC the topology chose did not open: left out");
                }
                Err(e) => return Err(e.into()),
            }
        }
        let engines: Vec<EngineHandle> = pools.iter().map(|p| p.handles()[0].clone()).collect();
        let names: Vec<String> = engines
            .iter()
            .map(|e| e.device_name().unwrap_or_default().to_string())
            .collect();
        let (notif_tx, notif_rx) = mpsc::channel(notify::NOTIFICATION_QUEUE);
        let side_tx = notif_tx.clone();
        let generation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id());
        let node = node_identity();
        Ok(Agent {
            inner: Arc::new(Inner {
                name: name.to_string(),
                generation,
                rails: Rails::new(engines),
                pools: Mutex::new(pools),
                regs: Snapshot::new(Default::default()),
                cache: Mutex::new(Default::default()),
                next_id: AtomicU64::new(1),
                ipc: IpcPaths::new(node.clone(), std::process::id()),
                node,
                peers: Snapshot::new(Default::default()),
                address: Mutex::new(String::new()),
                notif_tx,
                notification_rate: cfg.notification_rate,
                side_caps: Mutex::new(Default::default()),
                side_tx: Mutex::new(side_tx),
                notif_rx: Mutex::new(Some(notif_rx)),
                stopped: AtomicBool::new(false),
                links: link::Links::default(),
                connect_timeout: cfg.connect_timeout,
                transfer_timeout: cfg.engine.transfer_timeout,
                membership: Mutex::new(None),
                membership_counters: Default::default(),
                metadata_watchers: Mutex::new(Vec::new()),
                identity,
                limits: SideChannelLimits {
                    connections: cfg.max_side_channel_connections.max(1),
                    message: cfg.max_control_message.clamp(1024, metadata::MAX_BLOB),
                },
                side_counters: Default::default(),
                nic_grants: cfg.nic_grants,
                grants: Default::default(),
                objects: std::sync::OnceLock::new(),
                stage_area: Mutex::new(None),
                staging: Mutex::new(StagingCounters::default()),
                staged_regs: std::sync::atomic::AtomicUsize::new(0),
                auto_stage: Mutex::new(Default::default()),
                auto_pending: std::sync::atomic::AtomicUsize::new(0),
                nics: nics::Nics {
                    names,
                    machine,
                    home_numa,
                },
            }),
        })
    }

    /// The OBJECT tier's I/O threads (started on first use).
    pub(crate) fn object_runtime(&self) -> Result<Arc<crate::object::Runtime>, AgentError> {
        if let Some(rt) = self.inner.objects.get() {
            return Ok(Arc::clone(rt));
        }
        let rt = Arc::new(crate::object::Runtime::start(&self.inner.name)?);
        Ok(Arc::clone(self.inner.objects.get_or_init(|| rt)))
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether the agent's core has an RDMA device. Without one (`engine.require_nic = false` on
    /// a machine without RDMA) it registers host memory and files, and peers cannot reach it.
    pub fn has_nic(&self) -> bool {
        self.inner.rails.engine(0).has_nic()
    }

    /// Engine counters of each rail (rail 0 first).
    pub async fn rail_counters(&self) -> Vec<crate::runtime::EngineCounters> {
        let mut v = Vec::new();
        for e in self.inner.rails.engines() {
            if let Ok((c, _)) = e.counters().await {
                v.push(c);
            }
        }
        v
    }

    /// Transfers in flight on each rail's engine (rail 0 first): slots whose work the NIC may
    /// still touch, abandoned transfers draining included.
    pub async fn rail_inflight(&self) -> Vec<usize> {
        let mut v = Vec::new();
        for e in self.inner.rails.engines() {
            if let Ok((_, n)) = e.counters().await {
                v.push(n);
            }
        }
        v
    }

    /// How often the watchdog nudged each rail's engine core (rail 0 first): woke it after it
    /// went without a heartbeat (see [`crate::runtime::EngineHandle::nudges`]).
    pub fn core_nudges(&self) -> Vec<u64> {
        self.inner
            .rails
            .engines()
            .iter()
            .map(|e| e.nudges())
            .collect()
    }

    /// The connection lifecycle's counters: set-ups (shared by concurrent callers), failed
    /// set-ups, connections retired after a failure, callers refused during a backoff.
    pub fn link_counters(&self) -> LinkCounters {
        self.inner.link_counters()
    }

    /// Connections each rail's engine holds (rail 0 first), next to the connections the agent
    /// knows of: equal when nothing leaked.
    pub async fn connection_census(&self) -> ConnectionCensus {
        let mut engines = Vec::new();
        let mut unanswered = Vec::new();
        for (rail, e) in self.inner.rails.engines().iter().enumerate() {
            match e.connections().await {
                Ok(n) => engines.push(n),
                Err(err) => {
                    tracing::warn!(agent = %self.inner.name, rail, error = %err, "an engine did not answer the connection census");
                    unanswered.push(rail);
                    engines.push(0);
                }
            }
        }
        ConnectionCensus {
            engines,
            unanswered,
            known: self.inner.conn_count(),
        }
    }

    /// What the side channel's server has seen: connections accepted and refused, clients
    /// authenticated and refused, oversized lines, timeouts.
    pub fn side_channel_counters(&self) -> SideChannelCounters {
        self.inner.side_counters.snapshot()
    }

    /// Number of rails (NICs) this agent stripes over.
    pub fn rails(&self) -> usize {
        self.inner.rails.len()
    }

    /// Runs `f`'s future as a task on the core of rail `rail`'s engine (rail 0: the agent's
    /// first NIC) and returns its output. A serving engine that runs its step loop there pays
    /// no cross-thread hand-off for the transfers it starts on that rail (from any clone of
    /// this agent): they start on the core at once, and the engine's own path is all they
    /// cost (docs/perf.md). Dropping the returned future cancels the task at its next turn;
    /// the transfers it had started are detached, and the in-flight table keeps their memory
    /// until the NIC is done.
    ///
    /// The task runs on the engine's executor: it must not block. The agent's synchronous
    /// calls that wait for an engine (`load_remote_metadata` of a peer that re-joined, which
    /// closes its old connections) belong on other threads.
    ///
    /// ```no_run
    /// # async fn f(agent: &rixl::agent::Agent, local: rixl::runtime::LocalDescList,
    /// #     remote: Vec<rixl::agent::RemoteRef>) -> Result<(), rixl::agent::AgentError> {
    /// let a = agent.clone();
    /// let stats = agent
    ///     .run_on_core(0, move || async move { a.write("decode", &local, &remote).await })
    ///     .await??;
    /// # let _ = stats; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`AgentError::BadIndex`] for a rail the agent does not have; [`AgentError::Runtime`]
    /// when the engine has shut down or the task panicked (contained: the core keeps serving).
    pub async fn run_on_core<T, F, Fut>(&self, rail: usize, f: F) -> Result<T, AgentError>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T> + 'static,
    {
        let engines = self.inner.rails.engines();
        let Some(engine) = engines.get(rail) else {
            return Err(AgentError::BadIndex {
                index: rail,
                len: engines.len(),
            });
        };
        Ok(engine.run_on_core(f).await?)
    }

    /// How calls reached the engines' cores, summed over the rails: started on the core itself
    /// (from a task of [`Self::run_on_core`]) or sent from another thread.
    pub fn hand_off_counters(&self) -> crate::runtime::HandOffCounters {
        let mut sum = crate::runtime::HandOffCounters::default();
        for e in self.inner.rails.engines() {
            sum += e.hand_off_counters();
        }
        sum
    }

    /// What membership through etcd has seen ([`Self::join_etcd`]): sessions, outages, PUTs,
    /// loads, departures.
    pub fn membership_counters(&self) -> MembershipCounters {
        self.inner.membership_counters.snapshot()
    }

    /// Leaves etcd (the lease is revoked, so the key goes at once), stops the side channel and
    /// the engines.
    pub fn shutdown(&self) {
        // Stopped first: a peer that sees our key go and probes the side channel must find it
        // closed.
        self.inner.stopped.store(true, Ordering::SeqCst);
        if let Some(m) = lock(&self.inner.membership).take() {
            m.stop();
        }
        // Every grant ends before the queue pairs go (a window keeps its queue pair alive).
        self.inner.grants.revoke_all();
        for p in lock(&self.inner.pools).drain(..) {
            p.shutdown();
        }
    }
}

/// An agent is shared by a serving engine's threads: checked when this compiles.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Agent>();
};
