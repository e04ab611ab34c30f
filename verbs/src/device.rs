//! Device enumeration and opening.

use std::ffi::CStr;
use std::io;
use std::ptr::NonNull;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::sys;

/// The list of RDMA devices of this host (`ibv_get_device_list`).
#[derive(Debug)]
pub struct DeviceList {
    list: NonNull<*mut sys::ibv_device>,
    len: usize,
}

// SAFETY: the list is an immutable array owned by this value; libibverbs allows using it from any
// thread.
unsafe impl Send for DeviceList {}
// SAFETY: as above; no method mutates the array.
unsafe impl Sync for DeviceList {}

impl DeviceList {
    /// Lists the devices.
    ///
    /// # Errors
    /// [`Error::NoDevice`] when the kernel has no RDMA support (`ENOSYS`) or no device exists;
    /// the failing verb's error variant for other failures.
    pub fn new() -> Result<Self> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the call has no other preconditions.
        let raw = unsafe { sys::ibv_get_device_list(&mut n) };
        let Some(list) = NonNull::new(raw) else {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::ENOSYS) | Some(libc::ENODEV) | Some(libc::ENOENT) => {
                    Err(Error::NoDevice {
                        reason: format!(
                            "ibv_get_device_list: {err} (kernel without RDMA support?)"
                        ),
                    })
                }
                _ => Err(Error::GetDeviceList(err)),
            };
        };
        let len = usize::try_from(n).unwrap_or(0);
        Ok(DeviceList { list, len })
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The devices.
    pub fn iter(&self) -> impl Iterator<Item = Device<'_>> {
        (0..self.len).map(move |i| {
            // SAFETY: `i < len`, the array holds `len` non-null device pointers that live as long
            // as the list.
            let raw = unsafe { *self.list.as_ptr().add(i) };
            Device { raw, _list: self }
        })
    }

    /// Finds a device by name (`rxe0`, `mlx5_0`), or the first one when `name` is `None`.
    ///
    /// # Errors
    /// [`Error::NoDevice`] when the list is empty, [`Error::DeviceNotFound`] when no device has
    /// that name.
    pub fn find(&self, name: Option<&str>) -> Result<Device<'_>> {
        let mut iter = self.iter();
        match name {
            None => iter.next().ok_or_else(|| Error::NoDevice {
                reason: "device list is empty".into(),
            }),
            Some(want) => iter.find(|d| d.name() == want).ok_or_else(|| {
                if self.is_empty() {
                    Error::NoDevice {
                        reason: "device list is empty".into(),
                    }
                } else {
                    Error::DeviceNotFound {
                        name: want.to_string(),
                        available: self.iter().map(|d| d.name().to_string()).collect(),
                    }
                }
            }),
        }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed exactly once; contexts opened
        // from it do not reference it (libibverbs keeps devices alive while opened).
        unsafe { sys::ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// One device of a [`DeviceList`].
#[derive(Debug, Clone, Copy)]
pub struct Device<'a> {
    raw: *mut sys::ibv_device,
    _list: &'a DeviceList,
}

impl Device<'_> {
    /// The kernel name of the device, e.g. `rxe0`.
    pub fn name(&self) -> &str {
        // SAFETY: `raw` is a live device of the list; the name is a NUL-terminated string owned by
        // libibverbs for the lifetime of the list.
        let name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(self.raw)) };
        name.to_str().unwrap_or("<non-utf8>")
    }

    /// The node GUID (host byte order).
    pub fn guid(&self) -> u64 {
        // SAFETY: `raw` is a live device of the list.
        u64::from_be(unsafe { sys::ibv_get_device_guid(self.raw) })
    }

    /// Opens the device.
    ///
    /// # Errors
    /// the failing verb's error variant if `ibv_open_device` fails.
    pub fn open(&self) -> Result<Context> {
        // SAFETY: `raw` is a live device of the list.
        let ctx = unsafe { sys::ibv_open_device(self.raw) };
        let ctx = NonNull::new(ctx).ok_or_else(|| Error::last_os(Error::OpenDevice))?;
        Ok(Context::from_raw_owned(ctx, self.name().to_string()))
    }

    /// The raw device pointer.
    pub fn as_raw(&self) -> *mut sys::ibv_device {
        self.raw
    }
}
