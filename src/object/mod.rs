//! The OBJECT tier: an S3-compatible bucket as memory, the archive end of the KV hierarchy
//! (VRAM -> DRAM -> NVMe file -> object store).
//!
//! A registration ([`Agent::register_object`]) names an endpoint, a bucket and a prefix, and is
//! checked at once (bucket and credentials). Its descriptors are [`ObjectDesc`]s (key, offset,
//! length), like NIXL's OBJ backend; a transfer pairs them in order with a local DRAM or VRAM
//! list, as a FILE transfer does.
//!
//! - **Write** gives each object whole: its descriptors cover it from 0 without gaps (objects are
//!   written once, read many). An object of at most [`ObjectConfig::part_size`] bytes is one PUT
//!   (atomic); a larger one a multipart upload, its parts sent [`ObjectConfig::concurrency`] at a
//!   time and aborted on any failure, so no partial object ever becomes visible.
//! - **Read** asks every object's size first (HEAD; an out-of-range descriptor fails before any
//!   byte moves), then reads ranges of at most one part in parallel, each pinned to the ETag
//!   the HEAD saw ([`ObjectError::Changed`] if the object is replaced meanwhile).
//! - **Checksums**: every PUT and part carries a CRC-64/NVME the server verifies (S3 and
//!   s3s-fs do); an object written in one PUT also stores its CRC-64/NVME as user metadata,
//!   which a read of the whole object checks.
//! - Memory is staged through a pool of bounce buffers ([`crate::staging`]): the copy of one
//!   part overlaps the upload of others, and staging memory stays within
//!   `(concurrency + 2) * part_size`. VRAM is copied by the device on blocking threads.
//!
//! The S3 client is `object_store` (Apache Arrow). Its tokio runtime runs on the agent's own
//! I/O threads ("rixl-object"), never on an engine core; the caller awaits a plain future on any
//! executor. Requests still in flight when the caller drops the future or the deadline passes
//! own their memory (region handles), so nothing the I/O touches is freed under it.

mod error;
mod io;
mod plan;
mod profile;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use error::ObjectError;
pub(crate) use io::Runtime;

use crate::agent::{Agent, AgentError, CallOptions};
use crate::runtime::{LocalDescList, Op, TransferStats};
use crate::staging::{BouncePool, Copier, RegionCopier};

/// `len` bytes at `offset` of object `key` (under the registration's prefix).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectDesc {
    /// The object's key, relative to the registration's prefix (`/` separates levels).
    pub key: String,
    /// Offset into the object.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl ObjectDesc {
    /// `len` bytes at `offset` of `key`.
    pub fn new(key: impl Into<String>, offset: u64, len: u64) -> Self {
        ObjectDesc {
            key: key.into(),
            offset,
            len,
        }
    }
}

/// Explicit credentials (otherwise `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
/// `AWS_SESSION_TOKEN`; then the profile `AWS_PROFILE` (or `default`) of `~/.aws/credentials`;
/// then the instance's role).
#[derive(Clone, PartialEq, Eq)]
pub struct ObjectCredentials {
    /// Access key id.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
    /// Session token, for temporary credentials.
    pub session_token: Option<String>,
}

impl std::fmt::Debug for ObjectCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectCredentials")
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

/// Tuning of the OBJECT tier.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ObjectConfig {
    /// Size of a multipart part and of a ranged read (S3 needs at least 5 MiB but for the last
    /// part). Default 8 MiB.
    pub part_size: u64,
    /// Requests of one transfer in flight at once. Default 8.
    pub concurrency: usize,
    /// A transfer's deadline when the call sets none. Default 120 s.
    pub timeout: Duration,
    /// One request's deadline. Default 30 s.
    pub request_timeout: Duration,
    /// Retries of a failed request (with backoff), within the transfer's deadline. Default 2.
    pub max_retries: usize,
    /// Send CRC-64/NVME checksums with every PUT and part, and store one per single-PUT object.
    /// Default true.
    pub checksums: bool,
}

impl Default for ObjectConfig {
    fn default() -> Self {
        ObjectConfig {
            part_size: 8 << 20,
            concurrency: 8,
            timeout: Duration::from_secs(120),
            request_timeout: Duration::from_secs(30),
            max_retries: 2,
            checksums: true,
        }
    }
}

/// What to register: an S3-compatible endpoint, a bucket and a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ObjectSpec {
    /// Endpoint URL (`http://127.0.0.1:9000`); `None`: AWS S3 (or `AWS_ENDPOINT`).
    pub endpoint: Option<String>,
    /// The bucket.
    pub bucket: String,
    /// Prefix of every key (empty: the bucket's root).
    pub prefix: String,
    /// Region (`None`: `AWS_REGION`/`AWS_DEFAULT_REGION`, then the profile's in `~/.aws/config`,
    /// else `us-east-1`).
    pub region: Option<String>,
    /// Credentials (`None`: from the environment).
    pub credentials: Option<ObjectCredentials>,
    /// Tuning.
    pub config: ObjectConfig,
}

impl ObjectSpec {
    /// Objects under `prefix` of `bucket` at `endpoint`, credentials from the environment.
    pub fn new(
        endpoint: impl Into<String>,
        bucket: impl Into<String>,
        prefix: impl Into<String>,
    ) -> Self {
        ObjectSpec {
            endpoint: Some(endpoint.into()),
            bucket: bucket.into(),
            prefix: prefix.into(),
            region: None,
            credentials: None,
            config: ObjectConfig::default(),
        }
    }

    /// With these credentials.
    pub fn credentials(mut self, access_key_id: &str, secret_access_key: &str) -> Self {
        self.credentials = Some(ObjectCredentials {
            access_key_id: access_key_id.into(),
            secret_access_key: secret_access_key.into(),
            session_token: None,
        });
        self
    }

    /// With this tuning.
    pub fn config(mut self, config: ObjectConfig) -> Self {
        self.config = config;
        self
    }
}

/// Counters of one registration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ObjectCounters {
    /// Transfers that passed their checks.
    pub transfers: u64,
    /// Objects written in one PUT.
    pub puts: u64,
    /// Objects written by multipart upload.
    pub multipart_uploads: u64,
    /// Parts uploaded.
    pub parts: u64,
    /// Multipart uploads aborted after a failure.
    pub aborted: u64,
    /// Ranged GETs.
    pub gets: u64,
    /// Bytes written to objects.
    pub bytes_written: u64,
    /// Bytes read from objects.
    pub bytes_read: u64,
    /// Whole-object reads whose stored checksum was checked (and matched).
    pub checksums_verified: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    transfers: AtomicU64,
    puts: AtomicU64,
    multipart_uploads: AtomicU64,
    parts: AtomicU64,
    aborted: AtomicU64,
    gets: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    checksums_verified: AtomicU64,
}

impl Counters {
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    fn snapshot(&self) -> ObjectCounters {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ObjectCounters {
            transfers: l(&self.transfers),
            puts: l(&self.puts),
            multipart_uploads: l(&self.multipart_uploads),
            parts: l(&self.parts),
            aborted: l(&self.aborted),
            gets: l(&self.gets),
            bytes_written: l(&self.bytes_written),
            bytes_read: l(&self.bytes_read),
            checksums_verified: l(&self.checksums_verified),
        }
    }
}

/// A registered bucket prefix (OBJECT memory). Cheap to clone.
#[derive(Clone)]
pub struct ObjectRegistration {
    pub(crate) inner: Arc<io::Store>,
}

impl std::fmt::Debug for ObjectRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectRegistration")
            .field("bucket", &self.inner.bucket)
            .field("prefix", &self.inner.prefix.as_ref())
            .finish()
    }
}

impl ObjectRegistration {
    /// The bucket.
    pub fn bucket(&self) -> &str {
        &self.inner.bucket
    }

    /// The prefix keys are under.
    pub fn prefix(&self) -> &str {
        self.inner.prefix.as_ref()
    }

    /// The tuning in force.
    pub fn config(&self) -> &ObjectConfig {
        &self.inner.config
    }

    /// The counters.
    pub fn counters(&self) -> ObjectCounters {
        self.inner.counters.snapshot()
    }

    /// The bounce pool staging this registration's host transfers.
    pub fn bounce_pool(&self) -> &BouncePool {
        self.inner.pools.host()
    }

    /// Uses `copier` for the copy leg instead of the regions' own copy: a test stands host
    /// memory in for device memory and observes or slows the copies.
    pub fn with_copier(&self, copier: Arc<dyn Copier>) -> ObjectRegistration {
        ObjectRegistration {
            inner: Arc::new(self.inner.with_copier(copier)),
        }
    }

    /// The size of object `key`, or `None` if there is none.
    ///
    /// # Errors
    /// [`ObjectError::InvalidKey`], or a request error.
    pub async fn size(&self, key: &str) -> Result<Option<u64>, ObjectError> {
        io::size(&self.inner, key).await
    }

    /// Deletes object `key` (no error if there is none).
    ///
    /// # Errors
    /// [`ObjectError::InvalidKey`], or a request error.
    pub async fn delete(&self, key: &str) -> Result<(), ObjectError> {
        io::delete(&self.inner, key).await
    }
}

impl Agent {
    /// Registers objects under `spec.prefix` of `spec.bucket` as OBJECT memory. The bucket and
    /// the credentials are checked now (one listing request).
    ///
    /// # Errors
    /// [`ObjectError::Config`], [`ObjectError::NoSuchBucket`], [`ObjectError::Unauthorized`],
    /// [`ObjectError::Request`] (server unreachable), inside [`AgentError::Object`].
    pub async fn register_object(
        &self,
        spec: ObjectSpec,
    ) -> Result<ObjectRegistration, AgentError> {
        let runtime = self.object_runtime()?;
        let store = io::Store::open(runtime, &spec, Arc::new(RegionCopier))?;
        store.check().await?;
        tracing::debug!(agent = %self.name(), bucket = %spec.bucket, prefix = %spec.prefix, "object store registered");
        Ok(ObjectRegistration {
            inner: Arc::new(store),
        })
    }

    /// Writes `local` (DRAM or VRAM) into the objects of `descs`, paired in order (same total
    /// length); each object is given whole. See [`crate::object`].
    ///
    /// # Errors
    /// [`AgentError::Transfer`] for a bad local list, [`AgentError::Object`] otherwise.
    pub async fn write_object(
        &self,
        local: &LocalDescList,
        objects: &ObjectRegistration,
        descs: &[ObjectDesc],
    ) -> Result<TransferStats, AgentError> {
        self.transfer_object(Op::Write, local, objects, descs, CallOptions::new())
            .await
    }

    /// Reads the objects' ranges `descs` into `local` (DRAM or VRAM), paired in order.
    ///
    /// # Errors
    /// As [`Self::write_object`].
    pub async fn read_object(
        &self,
        local: &LocalDescList,
        objects: &ObjectRegistration,
        descs: &[ObjectDesc],
    ) -> Result<TransferStats, AgentError> {
        self.transfer_object(Op::Read, local, objects, descs, CallOptions::new())
            .await
    }

    /// An OBJECT transfer (`Op::Write`: memory to objects) with a deadline from `opts`
    /// (default [`ObjectConfig::timeout`]).
    ///
    /// # Errors
    /// As [`Self::write_object`].
    pub async fn transfer_object(
        &self,
        op: Op,
        local: &LocalDescList,
        objects: &ObjectRegistration,
        descs: &[ObjectDesc],
        opts: CallOptions,
    ) -> Result<TransferStats, AgentError> {
        let timeout = opts.timeout.unwrap_or(objects.inner.config.timeout);
        Ok(io::transfer(&objects.inner, op, local, descs, timeout).await?)
    }
}
