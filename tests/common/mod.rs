//! Helpers of the host tests of the local tiers (FILE, OBJECT, staging, the tiered cache):
//! an agent that runs with or without a NIC, patterned DRAM, and reading a region back.
#![allow(dead_code)] // each test crate uses its own subset

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rixl::agent::{Agent, AgentConfig, Registration, Visibility};
use rixl::runtime::Region;
use rixl::staging::{Copier, RegionCopier, StagingError};

/// An agent named `name` on the process's cluster key, with or without a NIC.
pub fn local_agent(name: &str) -> Agent {
    rixl_testkit::init_logs();
    let mut cfg = AgentConfig::default()
        .with_cluster_key(rixl::agent::ClusterKey::env_or_process_local().expect("a cluster key"));
    cfg.engine.require_nic = false;
    cfg.io_memory = 1 << 20;
    Agent::new(name, cfg).expect("agent starts with or without a NIC")
}

/// `len` bytes of registered DRAM, filled with `seed`'s pattern (zero without one).
pub async fn dram(a: &Agent, len: usize, seed: Option<u64>) -> Registration {
    let r = a.register(len, Visibility::All).await.unwrap();
    if let Some(seed) = seed {
        r.region()
            .write_at(0, &rixl_testkit::patterned(len, seed))
            .unwrap();
    }
    r
}

/// `len` bytes at `offset` of `r`.
pub fn bytes(r: &Region, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    r.read_at(offset, &mut v).unwrap();
    v
}

/// A stand-in for the device's copy engine: host memory, a delay per copy, a count, and the
/// time intervals the copies ran in (to see them overlap the I/O).
pub struct StandIn {
    delay: Duration,
    pub copies: AtomicUsize,
    pub fail: AtomicBool,
    pub spans: Mutex<Vec<(Instant, Instant)>>,
}

impl StandIn {
    pub fn new(delay: Duration) -> Arc<Self> {
        Arc::new(StandIn {
            delay,
            copies: AtomicUsize::new(0),
            fail: AtomicBool::new(false),
            spans: Mutex::new(Vec::new()),
        })
    }

    fn copy(&self, f: impl FnOnce() -> Result<(), StagingError>) -> Result<(), StagingError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(StagingError::Closed);
        }
        let t0 = Instant::now();
        std::thread::sleep(self.delay);
        let r = f();
        self.spans.lock().unwrap().push((t0, Instant::now()));
        self.copies.fetch_add(1, Ordering::SeqCst);
        r
    }
}

impl Copier for StandIn {
    fn device_to_host(
        &self,
        region: &Region,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), StagingError> {
        self.copy(|| RegionCopier.device_to_host(region, offset, dst))
    }

    fn host_to_device(&self, src: &[u8], region: &Region, offset: u64) -> Result<(), StagingError> {
        self.copy(|| RegionCopier.host_to_device(src, region, offset))
    }
}
