//! GPUDirect RDMA: GPU memory registered with a NIC, through dma-buf first and nvidia-peermem
//! (`ibv_reg_mr` on the device pointer) as the fallback.

use std::os::fd::AsFd;
use std::sync::Arc;

use rixl_verbs::{AccessFlags, MemoryRegion, ProtectionDomain, Registered};

use crate::memory::DeviceMemory;
use crate::Error;

/// How GPU memory was registered with the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegistrationKind {
    /// `cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr` (kernel >= 5.12, no extra module).
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer, through the nvidia-peermem kernel module.
    PeerMem,
}

/// GPU memory registered with a NIC: RDMA work requests may use `addr()`/`lkey()` locally and
/// peers `addr()`/`rkey()` remotely. The region is deregistered before the memory is freed.
#[derive(Debug)]
pub struct GpuRegistration {
    /// The memory is shared: multi-rail agents register one allocation with every NIC.
    reg: Registered<Arc<DeviceMemory>>,
    kind: RegistrationKind,
}

impl GpuRegistration {
    /// Registers `mem` with `pd`: dma-buf first, nvidia-peermem second.
    ///
    /// # Errors
    /// [`Error::Register`] with both attempts' reasons.
    pub fn register(
        pd: &ProtectionDomain,
        mem: DeviceMemory,
        access: AccessFlags,
    ) -> Result<GpuRegistration, Error> {
        Self::register_shared(pd, Arc::new(mem), access)
    }

    /// Registers memory shared with other registrations (one per NIC: multi-rail) with `pd`,
    /// dma-buf first, nvidia-peermem second. The memory is freed when the last registration
    /// that holds it has deregistered.
    ///
    /// # Errors
    /// [`Error::Register`] with both attempts' reasons.
    pub fn register_shared(
        pd: &ProtectionDomain,
        mem: Arc<DeviceMemory>,
        access: AccessFlags,
    ) -> Result<GpuRegistration, Error> {
        let dmabuf = match mem.export_dmabuf() {
            Ok(fd) => {
                // SAFETY: `mem` (a handle on the memory) is moved into the returned value, whose
                // `Registered` drops it only after deregistering, so the exported memory
                // outlives the registration.
                match unsafe {
                    MemoryRegion::register_dmabuf(
                        pd,
                        fd.as_fd(),
                        mem.dmabuf_offset(),
                        mem.len(),
                        mem.addr(),
                        access,
                    )
                } {
                    Ok(mr) => {
                        return Ok(Self::done(mr, mem, RegistrationKind::DmaBuf));
                    }
                    Err(e) => e.to_string(),
                }
            }
            Err(e) => e.to_string(),
        };
        // SAFETY: as above; with nvidia-peermem the NIC driver pins the device pages behind this
        // unified address for the region's lifetime.
        match unsafe { MemoryRegion::register_raw(pd, mem.addr() as *mut u8, mem.len(), access) } {
            Ok(mr) => Ok(Self::done(mr, mem, RegistrationKind::PeerMem)),
            Err(e) => Err(Error::Register {
                dmabuf,
                peermem: e.to_string(),
            }),
        }
    }

    fn done(mr: MemoryRegion, mem: Arc<DeviceMemory>, kind: RegistrationKind) -> GpuRegistration {
        tracing::info!(
            gpu = mem.gpu().ordinal(),
            len = mem.len(),
            ?kind,
            "GPU memory registered"
        );
        GpuRegistration {
            // SAFETY: `mr` covers `mem`'s allocation, which `Registered` drops its handle on only
            // after deregistering; other holders of the `Arc` keep it alive longer, never
            // shorter.
            reg: unsafe { Registered::from_parts(mr, mem) },
            kind,
        }
    }

    /// Which mechanism registered it.
    pub fn kind(&self) -> RegistrationKind {
        self.kind
    }

    /// The memory.
    pub fn memory(&self) -> &DeviceMemory {
        self.reg.memory()
    }

    /// The memory, shared: to register it with another NIC ([`Self::register_shared`]).
    pub fn shared_memory(&self) -> Arc<DeviceMemory> {
        Arc::clone(self.reg.memory())
    }

    /// The NIC registration.
    pub fn region(&self) -> &MemoryRegion {
        self.reg.region()
    }

    /// Device address (the iova).
    pub fn addr(&self) -> u64 {
        self.reg.memory().addr()
    }

    /// Length.
    pub fn len(&self) -> usize {
        self.reg.memory().len()
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.reg.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.reg.rkey()
    }
}

// SAFETY: forwards to `Registered`, which deregisters before the device memory is freed.
unsafe impl rixl_verbs::OwnedRegistration for GpuRegistration {
    fn memory_region(&self) -> &MemoryRegion {
        self.reg.region()
    }
}
