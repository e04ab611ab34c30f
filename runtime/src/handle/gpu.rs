//! An engine handle's GPU memory: registered for GPUDirect RDMA, or kept without a NIC
//! registration (CUDA IPC, copies, host-staged RDMA).

use std::sync::Arc;

use super::{lost, EngineHandle};
use crate::desc::Region;
use crate::error::RuntimeError;

impl EngineHandle {
    /// See [`Engine::register_gpu`]; on a core without a NIC, plain device memory (for CUDA IPC
    /// and copies; RDMA refuses it).
    ///
    /// # Errors
    /// As [`Engine::register_gpu`], [`RuntimeError::EngineGone`] or [`RuntimeError::EnginePanic`].
    pub async fn register_gpu(&self, ordinal: i32, len: usize) -> Result<Region, RuntimeError> {
        self.on_core(move |s| async move {
            match s.engine {
                Some(e) => e.register_gpu(ordinal, len).await,
                None => glommio::executor()
                    .spawn_blocking(move || {
                        let gpu = rixl_gpudirect::Gpu::open(ordinal)?;
                        rixl_gpudirect::DeviceMemory::alloc(&gpu, len)
                    })
                    .await
                    .map(|m| Region::device(m, s.id))
                    .map_err(RuntimeError::from),
            }
        })
        .await
        .unwrap_or_else(lost)
    }

    /// `len` bytes on GPU `ordinal` registered with no NIC (for CUDA IPC, copies and host-staged
    /// RDMA: what GPU memory is when GPUDirect RDMA is unavailable). Allocated off the core.
    ///
    /// # Errors
    /// [`RuntimeError::Gpu`] without CUDA or for a bad ordinal; [`RuntimeError::EngineGone`] or
    /// [`RuntimeError::EnginePanic`].
    pub async fn gpu_unregistered(&self, ordinal: i32, len: usize) -> Result<Region, RuntimeError> {
        self.on_core(move |s| async move {
            glommio::executor()
                .spawn_blocking(move || {
                    let gpu = rixl_gpudirect::Gpu::open(ordinal)?;
                    rixl_gpudirect::DeviceMemory::alloc(&gpu, len)
                })
                .await
                .map(|m| Region::device(m, s.id))
                .map_err(RuntimeError::from)
        })
        .await
        .unwrap_or_else(lost)
    }

    /// The caller's GPU memory as a region of this core registered with no NIC.
    pub fn device_unregistered(&self, mem: rixl_gpudirect::DeviceMemory) -> Region {
        Region::device(mem, self.id)
    }

    /// See [`Engine::register_device_shared`]; [`RuntimeError::NoNic`] on a core without a NIC.
    ///
    /// # Errors
    /// As [`Engine::register_device_shared`], [`RuntimeError::EngineGone`] or
    /// [`RuntimeError::EnginePanic`].
    pub async fn register_device_shared(
        &self,
        mem: Arc<rixl_gpudirect::DeviceMemory>,
    ) -> Result<Region, RuntimeError> {
        self.on_core(move |s| async move {
            s.rdma(RuntimeError::NoNic)?
                .register_device_shared(mem)
                .await
        })
        .await
        .unwrap_or_else(lost)
    }

    /// See [`Engine::register_device`]; on a core without a NIC, the memory as it is (for CUDA
    /// IPC and copies; RDMA refuses it).
    ///
    /// # Errors
    /// As [`Engine::register_device`], [`RuntimeError::EngineGone`] or [`RuntimeError::EnginePanic`].
    pub async fn register_device(
        &self,
        mem: rixl_gpudirect::DeviceMemory,
    ) -> Result<Region, RuntimeError> {
        self.on_core(move |s| async move {
            match s.engine {
                Some(e) => e.register_device(mem).await,
                None => Ok(Region::device(mem, s.id)),
            }
        })
        .await
        .unwrap_or_else(lost)
    }
}
