//! FILE memory: a registered file (a local tier) and how the agent registers one.

use std::sync::Arc;

use crate::runtime::{FileInfo, FileSpec};

use super::{Agent, AgentError};

/// A registered file (FILE memory, a local tier). The file is closed when the last handle is
/// dropped and no transfer uses it any more.
#[derive(Clone)]
pub struct FileRegistration {
    pub(crate) inner: Arc<FileRegInner>,
    /// A copy leg that stages every transfer ([`FileRegistration::with_copier`]).
    pub(crate) copier: Option<Arc<dyn crate::staging::Copier>>,
}

pub(crate) struct FileRegInner {
    pub info: FileInfo,
    pub path: std::path::PathBuf,
    pub engine: crate::runtime::EngineHandle,
    /// Bounce buffers of staged transfers (VRAM).
    pub pools: crate::staging::StagingPools,
    /// The file registered with GPUDirect Storage, on first use where it is present.
    pub gds: std::sync::OnceLock<Option<Arc<crate::gpudirect::gds::GdsFile>>>,
}

impl FileRegInner {
    /// The file through GPUDirect Storage, if present and the file registers with it.
    pub(crate) fn gds_file(&self) -> Option<Arc<crate::gpudirect::gds::GdsFile>> {
        self.gds
            .get_or_init(|| {
                let gds = crate::transport::gds()?;
                match crate::gpudirect::gds::GdsFile::open(&gds, &self.path) {
                    Ok(f) => Some(Arc::new(f)),
                    Err(e) => {
                        tracing::warn!(path = %self.path.display(), error = %e, "GPUDirect Storage refused the file: staging it");
                        None
                    }
                }
            })
            .clone()
    }

    /// The bounce pool for `local`'s memory.
    pub(crate) fn pool_for(
        &self,
        local: &crate::runtime::LocalDescList,
    ) -> crate::staging::BouncePool {
        self.pools.pool_for(local)
    }
}

impl Drop for FileRegInner {
    fn drop(&mut self) {
        self.engine.close_file(self.info.id);
    }
}

impl std::fmt::Debug for FileRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileRegistration")
            .field("path", &self.inner.path)
            .field("info", &self.inner.info)
            .finish()
    }
}

impl FileRegistration {
    /// Registered size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.info.size
    }

    /// Writes must start and end on multiples of this (the device's O_DIRECT block size).
    pub fn alignment(&self) -> u64 {
        self.inner.info.alignment
    }

    /// Whether I/O bypasses the page cache (false on tmpfs).
    pub fn direct(&self) -> bool {
        self.inner.info.direct
    }

    /// The path.
    pub fn path(&self) -> &std::path::Path {
        &self.inner.path
    }

    /// This file with every transfer staged through bounce buffers by `copier`, as VRAM is: a
    /// test stands host memory in for device memory, observes or slows the copy leg.
    pub fn with_copier(&self, copier: Arc<dyn crate::staging::Copier>) -> FileRegistration {
        FileRegistration {
            inner: Arc::clone(&self.inner),
            copier: Some(copier),
        }
    }

    /// This file without an injected copy leg (host memory goes direct again).
    pub fn unstaged(&self) -> FileRegistration {
        FileRegistration {
            inner: Arc::clone(&self.inner),
            copier: None,
        }
    }

    /// The host bounce pool of staged transfers.
    pub fn bounce_pool(&self) -> &crate::staging::BouncePool {
        self.inner.pools.host()
    }
}

impl Agent {
    /// Registers a file as FILE memory (a local tier): opened with O_DIRECT on the agent's core;
    /// the create modes reserve `spec.size` bytes up front. Its descriptors are
    /// [`FileDesc`](crate::runtime::FileDesc)s (offset, length) inside `spec.size`.
    ///
    /// # Errors
    /// [`AgentError::File`] (not found, exists, too small, no space, ...).
    pub async fn register_file(&self, spec: FileSpec) -> Result<FileRegistration, AgentError> {
        let path = spec.path.clone();
        let engine = self.inner.rails.engine(0);
        let info = engine.open_file(spec).await?;
        tracing::debug!(agent = %self.inner.name, path = %path.display(), size = info.size, "file registered");
        Ok(FileRegistration {
            inner: Arc::new(FileRegInner {
                info,
                path,
                engine: engine.clone(),
                pools: crate::staging::StagingPools::new(
                    crate::transport::STAGE_CHUNK as usize,
                    crate::transport::STAGE_DEPTH + 2,
                ),
                gds: std::sync::OnceLock::new(),
            }),
            copier: None,
        })
    }
}
