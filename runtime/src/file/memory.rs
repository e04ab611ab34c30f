//! The memory side of a FILE transfer, read and written as one stream of bytes in descriptor
//! order: registered regions, or one host buffer (the I/O leg of a staged transfer).

use std::cell::RefCell;

use crate::desc::{LocalDescList, Region};
use crate::error::InvalidDescriptor;

/// Stream bytes to and from memory. Ranges were checked before the transfer started.
pub(crate) trait StreamMemory {
    /// Bytes in the stream.
    fn len(&self) -> u64;
    /// Copies stream bytes `stream..stream + dst.len()` into `dst`.
    fn copy_out(&self, stream: u64, dst: &mut [u8]);
    /// Copies `src` to stream bytes `stream..stream + src.len()`.
    fn copy_in(&self, stream: u64, src: &[u8]);
}

/// A local descriptor list of registered regions.
pub(crate) struct Regions {
    local: LocalDescList,
    /// Where each descriptor starts in the stream.
    starts: Vec<u64>,
}

impl Regions {
    /// Checks `local` against its regions.
    pub(crate) fn new(local: LocalDescList) -> Result<Self, InvalidDescriptor> {
        rixl_proto::plan::check_local(|i| local.regions().get(i).map(Region::len), local.descs())?;
        let starts = local.stream_starts();
        Ok(Regions { local, starts })
    }

    /// Descriptors in the list.
    pub(crate) fn descriptors(&self) -> usize {
        self.local.len()
    }

    fn pieces(&self, start: u64, len: u64) -> Vec<(usize, u64, u64)> {
        self.local.stream_pieces(&self.starts, start, len)
    }
}

impl StreamMemory for Regions {
    fn len(&self) -> u64 {
        self.local.total_len()
    }

    fn copy_out(&self, stream: u64, dst: &mut [u8]) {
        let regions = self.local.regions();
        let mut pos = 0usize;
        for (r, off, n) in self.pieces(stream, dst.len() as u64) {
            let n = n as usize;
            if let Err(e) = regions[r].read_at(off, &mut dst[pos..pos + n]) {
                tracing::error!(error = %e, "validated local range refused");
            }
            pos += n;
        }
    }

    fn copy_in(&self, stream: u64, src: &[u8]) {
        let regions = self.local.regions();
        let mut pos = 0usize;
        for (r, off, n) in self.pieces(stream, src.len() as u64) {
            let n = n as usize;
            if let Err(e) = regions[r].write_at(off, &src[pos..pos + n]) {
                tracing::error!(error = %e, "validated local range refused");
            }
            pos += n;
        }
    }
}

/// A host buffer written to the file.
pub(crate) struct Outgoing(pub bytes::Bytes);

impl StreamMemory for Outgoing {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn copy_out(&self, stream: u64, dst: &mut [u8]) {
        let at = stream as usize;
        dst.copy_from_slice(&self.0[at..at + dst.len()]);
    }

    fn copy_in(&self, _stream: u64, _src: &[u8]) {
        tracing::error!("a write's buffer was asked to take bytes");
    }
}

/// A host buffer the file is read into.
pub(crate) struct Incoming(RefCell<Vec<u8>>);

impl Incoming {
    pub(crate) fn new(len: usize) -> Self {
        Incoming(RefCell::new(vec![0u8; len]))
    }

    /// The bytes read.
    pub(crate) fn take(&self) -> Vec<u8> {
        std::mem::take(&mut *self.0.borrow_mut())
    }
}

impl StreamMemory for Incoming {
    fn len(&self) -> u64 {
        self.0.borrow().len() as u64
    }

    fn copy_out(&self, stream: u64, dst: &mut [u8]) {
        let at = stream as usize;
        dst.copy_from_slice(&self.0.borrow()[at..at + dst.len()]);
    }

    fn copy_in(&self, stream: u64, src: &[u8]) {
        let at = stream as usize;
        self.0.borrow_mut()[at..at + src.len()].copy_from_slice(src);
    }
}
