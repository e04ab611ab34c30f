//! `rixl-gpudirect`: GPU memory for rixl through the CUDA driver API (`cudarc`, dynamically
//! loaded). Every entry point first checks that `libcuda` can be loaded: cudarc panics on any call
//! when it is absent, so without a driver rixl gets a typed [`Error::NoCuda`], never a panic.
//!
//! - [`probe`]: the driver and its GPUs (name, memory, PCI address) for the topology model;
//! - [`Gpu`], [`DeviceMemory`], [`PinnedHostMemory`]: contexts and memory;
//! - [`GpuRegistration`]: GPUDirect RDMA registration, dma-buf first, nvidia-peermem second;
//! - [`gds`]: GPUDirect Storage (cuFile), loaded at run time when present.

pub mod gds;
mod memory;
mod register;

/// The CUDA crate whose `CudaSlice` [`DeviceMemory::from_cuda_slice`] takes.
pub use cudarc;
pub use memory::{DeviceMemory, Gpu, PinnedHostMemory, DEVICE_ALIGN};
pub use register::{GpuRegistration, RegistrationKind};

use cudarc::driver::{result, sys};

/// Errors of the GPU layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No CUDA driver library could be loaded on this machine.
    #[error("CUDA driver (libcuda) is not available on this machine")]
    NoCuda,
    /// Bad arguments (zero length, a range outside an allocation).
    #[error("{0}")]
    InvalidArgument(String),
    /// A device range reaches outside the allocation it starts in.
    #[error("device range {ptr:#x}+{len} leaves its allocation {base:#x}+{size}")]
    OutsideAllocation {
        /// Start of the range.
        ptr: u64,
        /// Its length.
        len: usize,
        /// Start of the allocation (`cuMemGetAddressRange`).
        base: u64,
        /// The allocation's size.
        size: usize,
    },
    /// Neither dma-buf nor nvidia-peermem could register GPU memory with the NIC.
    #[error("GPU memory registration failed: dma-buf: {dmabuf}; nvidia-peermem: {peermem}")]
    Register {
        /// Why dma-buf failed.
        dmabuf: String,
        /// Why the peermem path failed.
        peermem: String,
    },
    /// A CUDA driver call failed.
    #[error("{call} failed: {code}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The CUresult, by name.
        code: String,
    },
}

pub(crate) fn driver(call: &'static str) -> impl Fn(result::DriverError) -> Error {
    move |e| Error::Driver {
        call,
        code: format!("{:?}", e.0),
    }
}

/// Whether `libcuda` can be loaded. Cheap after the first call.
pub fn cuda_available() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names; it has no
    // preconditions and does not touch cudarc's global library handle.
    unsafe { sys::is_culib_present() }
}

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GpuInfo {
    /// CUDA device ordinal.
    pub ordinal: i32,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Device memory in bytes.
    pub total_memory: usize,
    /// PCI address `dddd:bb:dd.0`, to match GPUs with NICs in the topology.
    pub pci_address: String,
}

/// What the CUDA driver offers on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CudaInfo {
    /// Driver API version, e.g. 12080 for 12.8.
    pub driver_version: i32,
    /// The GPUs.
    pub gpus: Vec<GpuInfo>,
}

/// Loads the driver and lists the GPUs.
///
/// # Errors
/// [`Error::NoCuda`] without a driver; [`Error::Driver`] if initialisation or a query fails.
pub fn probe() -> Result<CudaInfo, Error> {
    if !cuda_available() {
        return Err(Error::NoCuda);
    }
    result::init().map_err(driver("cuInit"))?;
    let mut version = 0i32;
    // SAFETY: the driver is loaded (checked above) and initialised; `version` is a valid
    // out-pointer.
    let rc = unsafe { sys::cuDriverGetVersion(&mut version) };
    rc.result().map_err(driver("cuDriverGetVersion"))?;
    let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    let mut gpus = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(driver("cuDeviceGet"))?;
        let name = result::device::get_name(dev).map_err(driver("cuDeviceGetName"))?;
        // SAFETY: `dev` was returned by `cuDeviceGet` for a valid ordinal.
        let total_memory =
            unsafe { result::device::total_mem(dev) }.map_err(driver("cuDeviceTotalMem"))?;
        let attr = |a| {
            // SAFETY: `dev` was returned by `cuDeviceGet`; `a` is a valid attribute.
            unsafe { result::device::get_attribute(dev, a) }.map_err(driver("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute as A;
        let pci_address = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        gpus.push(GpuInfo {
            ordinal,
            name,
            total_memory,
            pci_address,
        });
    }
    tracing::debug!(driver_version = version, gpus = gpus.len(), "CUDA probed");
    Ok(CudaInfo {
        driver_version: version,
        gpus,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn probe_is_a_typed_result_with_or_without_a_driver() {
        match probe() {
            Err(Error::NoCuda) => {
                assert!(!cuda_available());
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED gpu probe details: no CUDA driver on this machine (typed NoCuda checked)"
                );
            }
            Ok(info) => {
                assert!(
                    info.driver_version >= 12000,
                    "driver {}",
                    info.driver_version
                );
                for g in &info.gpus {
                    assert!(g.total_memory > 0 && !g.name.is_empty());
                    assert_eq!(g.pci_address.len(), 12, "{}", g.pci_address);
                }
            }
            Err(e) => panic!("driver present but probe failed: {e}"),
        }
    }
}
