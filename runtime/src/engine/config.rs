//! An engine's configuration.

use std::time::Duration;

use rixl_verbs::ConnectOptions;

/// How the progress task waits for completions while work is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PollMode {
    /// Poll the CQ, yielding to other tasks between polls (lowest latency; the core is busy only
    /// while work is in flight).
    #[default]
    Busy,
    /// Arm the CQ and wait for its completion event off the core (glommio's blocking pool); for
    /// latency-insensitive users who want no spinning at all.
    Event,
}

/// Engine configuration.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EngineConfig {
    /// RDMA device name (`None`: the first device).
    pub device: Option<String>,
    /// Port and GID index, and the QP transport parameters.
    pub connect: ConnectOptions,
    /// Send queue depth of each connection.
    pub send_queue_depth: u32,
    /// Receive buffers posted per connection for SEND / WRITE_WITH_IMM messages.
    pub recv_buffers: u32,
    /// Largest message `send` carries (size of each receive buffer).
    pub max_message: u32,
    /// Most connections; the CQ is sized so it can never overflow with all of them full.
    pub max_connections: u32,
    /// Signal at least every this many work requests (and the last of every batch).
    pub signal_interval: u32,
    /// WRITEs and SENDs of at most this many bytes are copied into the work request
    /// (`IBV_SEND_INLINE`): the NIC needs no DMA read of the source, which cuts small-message
    /// latency. Requested from the device per connection (perftest's default is 220); a device
    /// that refuses it gets queue pairs without inline data. 0 disables.
    pub max_inline: u32,
    /// Most work requests posted with one doorbell.
    pub post_batch: u32,
    /// Completions reaped per poll.
    pub poll_batch: usize,
    /// Busy or event polling.
    pub poll_mode: PollMode,
    /// Default deadline of a transfer.
    pub transfer_timeout: Duration,
    /// How long the engine's core may stop running (no heartbeat: its heartbeat task runs
    /// every eighth of this, up to 1 s apart; at least 100 ms) before a call from another
    /// thread waiting on it ends with `EngineStalled` (noticed within twice this): a core that
    /// stops (a job blocking its thread, a reactor that never wakes) turns into a typed error
    /// instead of a hang. A call that only takes long on a running core (a large
    /// registration, a receive, a close) is not cut short. Calls made on the core itself are
    /// not bounded (they stop with it).
    pub stall_timeout: Duration,
    /// Busy mode: how many empty polls after the last activity the engine keeps spinning for
    /// awaited receives before it falls back to polling every 200 µs.
    pub recv_spin_polls: u32,
    /// CQ polls a waiting transfer makes itself when it is the only one in flight on the engine
    /// (and a receive when nothing is in flight) before it waits for the progress task's
    /// wake-up: the completion mode of a lone request-response loop, which then costs no
    /// executor turn. 0 turns it off (every wait after the first poll goes through the
    /// progress task).
    pub spin_polls: u32,
    /// Measure per-transfer prepare/post/total times in [`crate::TransferStats`] (off by default: it
    /// reads the clock several times per transfer, which is costly on some clock sources).
    pub timing: bool,
    /// Coalesce small transfers (on by default; see [`rixl_proto::CoreConfig::coalesce`]): a
    /// transfer of at most [`rixl_proto::COALESCE_MAX_WRS`] work requests is posted at once
    /// when it is the only transfer in flight on the engine or the first of its progress turn
    /// on its connection; the others of the turn are queued and posted together at its end, up
    /// to `post_batch` requests per doorbell, and only the batch's last request (plus every
    /// [`rixl_proto::COALESCE_SIGNAL_INTERVAL`]-th) is signaled; the others complete with it
    /// (RC completes in order). A request-response loop (one transfer at a time) is never
    /// queued; many concurrent small transfers share doorbells and completions. `false`
    /// posts every transfer at once with its own doorbell.
    pub coalesce: bool,
    /// How long an engine's core spins for new work before it sleeps (glommio's
    /// `spin_before_park`; zero: it sleeps at once). A sleeping core takes a cross-thread
    /// wake-up (an eventfd and a scheduler round, tens of µs in a VM) to see the next command
    /// from another thread, such as a CUDA-IPC transfer's copies to await.
    pub spin_before_park: Duration,
    /// How long a thread that called an engine handle's transfer or post from outside the
    /// engine's core polls for the reply before its future returns `Pending` (zero: not at
    /// all). A reply within it costs the caller no wake-up (a futex and a scheduler round,
    /// 15-20 µs on the development VM); past it, the caller has spent this much CPU and waits
    /// as before. Calls made on an engine core never spin: that would hold up the core.
    pub reply_spin: Duration,
    /// Fail to start when no RDMA device can be opened (`false`: such a core still serves host
    /// memory and the FILE tier; RDMA calls then fail with a typed error).
    pub require_nic: bool,
    /// The FILE tier's queue depth and I/O size.
    pub file: crate::file::FileConfig,
    /// Peers reach memory only through grants (off by default): registrations carry no
    /// remote access of their own, and [`Engine::grant`](super::Engine::grant) binds a type-2
    /// memory window per region on the queue pair of the peer it is granted to. The agent
    /// turns it on.
    pub window_grants: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        let mut connect = ConnectOptions::default();
        connect.gid_index = 1;
        EngineConfig {
            device: None,
            connect,
            send_queue_depth: 512,
            recv_buffers: 64,
            max_message: 4096,
            max_connections: 16,
            signal_interval: 32,
            post_batch: 64,
            poll_batch: 32,
            max_inline: 220,
            poll_mode: PollMode::Busy,
            transfer_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(60),
            recv_spin_polls: 50_000,
            spin_polls: 256,
            timing: false,
            coalesce: true,
            spin_before_park: Duration::from_micros(100),
            reply_spin: Duration::from_micros(20),
            require_nic: true,
            file: crate::file::FileConfig::default(),
            window_grants: false,
        }
    }
}

impl EngineConfig {
    /// Device and GID index from `RIXL_RDMA_DEVICE` / `RIXL_GID_INDEX` when set.
    pub fn from_env() -> Self {
        let mut c = EngineConfig {
            device: std::env::var("RIXL_RDMA_DEVICE").ok(),
            ..Self::default()
        };
        if let Some(g) = std::env::var("RIXL_GID_INDEX")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            c.connect.gid_index = g;
        }
        c
    }
}
