//! The OBJECT tier's I/O: the control threads' tokio runtime, the S3 client, and the write and
//! read jobs that run on it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::StreamExt;
use hex::FromHex;
use object_store::aws::{AmazonS3, AmazonS3Builder, Checksum};
use object_store::{
    Attribute, AttributeValue, Attributes, ClientOptions, GetOptions, GetRange, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, RetryConfig,
};

use super::error::ObjectError;
use super::plan::{self, ObjectPlan};
use super::{Counters, ObjectConfig, ObjectDesc, ObjectSpec};
use crate::runtime::{InvalidDescriptor, LocalDescList, Op, TransferStats};
use crate::staging::{self, BouncePool, Copier, StagingPools};

/// How long an abandoned multipart upload's abort may take past the deadline.
const ABORT_GRACE: Duration = Duration::from_secs(2);

/// The user-metadata key of a single-PUT object's CRC-64/NVME (hex).
const CRC_METADATA: &str = "rixl-crc64nvme";

/// The object tier's I/O threads: a tokio runtime of their own, shut down (without waiting)
/// when the agent goes.
pub(crate) struct Runtime {
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("object::Runtime")
    }
}

impl Runtime {
    /// Starts the threads (named `rixl-object-<agent>`).
    pub(crate) fn start(agent: &str) -> Result<Runtime, ObjectError> {
        // TLS goes through rustls with ring; install it unless the process chose a provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(16)
            .thread_name(format!("rixl-object-{agent}"))
            .enable_all()
            .build()
            .map_err(ObjectError::ControlThread)?;
        Ok(Runtime { rt: Some(rt) })
    }

    /// Runs `job` on the I/O threads; the returned future may be awaited on any executor.
    /// `None` if the threads went away first.
    pub(crate) async fn spawn<T: Send + 'static>(
        &self,
        job: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Option<T> {
        let rt = self.rt.as_ref()?;
        let (tx, rx) = futures_channel::oneshot::channel();
        rt.spawn(async move {
            let _ = tx.send(job.await);
        });
        rx.await.ok()
    }

    async fn run<T: Send + 'static>(
        &self,
        job: impl std::future::Future<Output = Result<T, ObjectError>> + Send + 'static,
    ) -> Result<T, ObjectError> {
        self.spawn(job)
            .await
            .unwrap_or(Err(ObjectError::ControlThreadGone))
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// A registration's store: the client, its prefix, its bounce pools, its counters.
pub(crate) struct Store {
    pub bucket: String,
    pub prefix: object_store::path::Path,
    pub config: ObjectConfig,
    pub counters: Arc<Counters>,
    pub pools: StagingPools,
    client: Arc<AmazonS3>,
    runtime: Arc<Runtime>,
    copier: Arc<dyn Copier>,
}

impl Store {
    /// The client for `spec` (nothing is sent yet).
    pub(crate) fn open(
        runtime: Arc<Runtime>,
        spec: &ObjectSpec,
        copier: Arc<dyn Copier>,
    ) -> Result<Store, ObjectError> {
        let cfg = spec.config.clone();
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(&spec.bucket)
            .with_retry(RetryConfig {
                max_retries: cfg.max_retries,
                retry_timeout: cfg.timeout,
                ..RetryConfig::default()
            })
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(cfg.request_timeout)
                    .with_connect_timeout(Duration::from_secs(5)),
            );
        if let Some(e) = &spec.endpoint {
            b = b
                .with_endpoint(e)
                .with_allow_http(e.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        // The shared files (~/.aws) stand in for what neither the spec nor the environment gives.
        let env_keys = std::env::var_os("AWS_ACCESS_KEY_ID").is_some();
        let needed = spec.credentials.is_none() && !env_keys;
        let shared = if needed || spec.region.is_none() {
            match super::profile::load() {
                Ok(p) => p,
                Err(e) if needed => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "AWS profile files ignored (credentials given)");
                    super::profile::Profile::default()
                }
            }
        } else {
            super::profile::Profile::default()
        };
        let region = spec.region.clone().or_else(|| {
            ["AWS_REGION", "AWS_DEFAULT_REGION"]
                .iter()
                .find_map(|v| std::env::var(v).ok())
                .or(shared.region.clone())
        });
        b = b.with_region(region.unwrap_or_else(|| "us-east-1".into()));
        let from_files = shared.credentials.filter(|_| !env_keys);
        if let Some(c) = spec.credentials.as_ref().or(from_files.as_ref()) {
            b = b
                .with_access_key_id(&c.access_key_id)
                .with_secret_access_key(&c.secret_access_key);
            if let Some(t) = &c.session_token {
                b = b.with_token(t);
            }
        }
        if cfg.checksums {
            b = b.with_checksum_algorithm(Checksum::CRC64NVME);
        }
        let client = b.build().map_err(ObjectError::Config)?;
        let prefix = object_store::path::Path::parse(&spec.prefix).map_err(|source| {
            ObjectError::InvalidKey {
                index: 0,
                key: spec.prefix.clone(),
                source,
            }
        })?;
        let part = usize::try_from(cfg.part_size.max(1)).unwrap_or(usize::MAX);
        Ok(Store {
            bucket: spec.bucket.clone(),
            prefix,
            pools: StagingPools::new(part, cfg.concurrency + 2),
            config: cfg,
            counters: Arc::new(Counters::default()),
            client: Arc::new(client),
            runtime,
            copier,
        })
    }

    /// This store with another copy leg (its pools and counters shared).
    pub(crate) fn with_copier(&self, copier: Arc<dyn Copier>) -> Store {
        Store {
            bucket: self.bucket.clone(),
            prefix: self.prefix.clone(),
            config: self.config.clone(),
            counters: Arc::clone(&self.counters),
            pools: self.pools.clone(),
            client: Arc::clone(&self.client),
            runtime: Arc::clone(&self.runtime),
            copier,
        }
    }

    /// One listing under the prefix: the bucket exists and the credentials are good.
    pub(crate) async fn check(&self) -> Result<(), ObjectError> {
        let client = Arc::clone(&self.client);
        let prefix = self.prefix.clone();
        let bucket = self.bucket.clone();
        let deadline = self.config.timeout;
        self.runtime
            .run(async move {
                let listing = client.list_with_delimiter(Some(&prefix));
                match tokio::time::timeout(deadline, listing).await {
                    Err(_) => Err(ObjectError::Timeout(deadline)),
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(match ObjectError::request(&bucket, "list", e) {
                        ObjectError::NotFound { source, .. } => {
                            ObjectError::NoSuchBucket { bucket, source }
                        }
                        ObjectError::Request { source, .. }
                            if source.to_string().contains("NoSuchBucket") =>
                        {
                            ObjectError::NoSuchBucket { bucket, source }
                        }
                        e => e,
                    }),
                }
            })
            .await
    }
}

/// What a job needs, owned (it runs on the I/O threads, maybe after its caller is gone).
struct Job {
    client: Arc<AmazonS3>,
    config: ObjectConfig,
    counters: Arc<Counters>,
    copier: Arc<dyn Copier>,
    pool: BouncePool,
    local: LocalDescList,
    starts: Vec<u64>,
    plans: Vec<ObjectPlan>,
    /// The call's deadline, as a duration.
    timeout: Duration,
}

/// Checks and runs one transfer.
pub(crate) async fn transfer(
    store: &Store,
    op: Op,
    local: &LocalDescList,
    descs: &[ObjectDesc],
    timeout: Duration,
) -> Result<TransferStats, ObjectError> {
    let t0 = Instant::now();
    let invalid = ObjectError::InvalidDescriptor;
    if descs.is_empty() {
        return Err(invalid(InvalidDescriptor::Empty { side: "object" }));
    }
    let local_total =
        rixl_proto::plan::check_local(|i| local.regions().get(i).map(|r| r.len()), local.descs())
            .map_err(invalid)?;
    let mut total = 0u64;
    for (index, d) in descs.iter().enumerate() {
        if d.len == 0 {
            return Err(invalid(InvalidDescriptor::ZeroLength {
                side: "object",
                index,
            }));
        }
        total = total.saturating_add(d.len);
    }
    if total != local_total {
        return Err(invalid(InvalidDescriptor::LengthMismatch {
            local: local_total,
            remote: total,
        }));
    }
    let plans = plan::group(&store.prefix, descs)?;
    if op == Op::Write {
        for p in &plans {
            plan::whole(p)?;
        }
    }
    Counters::add(&store.counters.transfers, 1);
    let job = Arc::new(Job {
        client: Arc::clone(&store.client),
        config: store.config.clone(),
        counters: Arc::clone(&store.counters),
        copier: Arc::clone(&store.copier),
        pool: store.pools.pool_for(local),
        starts: local.stream_starts(),
        local: local.clone(),
        plans,
        timeout,
    });
    let n_descs = local.len();
    let requests = store
        .runtime
        .run(async move {
            let deadline = tokio::time::Instant::now() + timeout;
            let work = async {
                match op {
                    Op::Write => write(job, deadline).await,
                    Op::Read => read(job).await,
                }
            };
            // A write's own deadline aborts its multipart upload; the outer one leaves that
            // abort time to finish.
            let outer = match op {
                Op::Write => deadline + ABORT_GRACE,
                Op::Read => deadline,
            };
            match tokio::time::timeout_at(outer, work).await {
                Ok(r) => r,
                Err(_) => Err(ObjectError::Timeout(timeout)),
            }
        })
        .await?;
    let mut stats = TransferStats::new(total, n_descs, requests, 0);
    stats.total = t0.elapsed();
    Ok(stats)
}

/// Writes every object of the job, `concurrency` requests at once in all.
async fn write(job: Arc<Job>, deadline: tokio::time::Instant) -> Result<usize, ObjectError> {
    let part = job.config.part_size.max(1);
    let (small, large): (Vec<usize>, Vec<usize>) =
        (0..job.plans.len()).partition(|&i| job.plans[i].bytes() <= part);
    let mut requests = small.len();
    let puts = small.into_iter().map(|i| {
        let job = Arc::clone(&job);
        async move { put(&job, &job.plans[i]).await }
    });
    staging::run_bounded(puts, job.config.concurrency).await?;
    for i in large {
        requests += multipart(&job, &job.plans[i], deadline).await?;
    }
    Ok(requests)
}

/// The local memory of bytes `offset..offset+len` of a written object (its runs, given whole by
/// `plan::whole`, are in object order).
fn object_chunk(job: &Job, p: &ObjectPlan, offset: u64, len: u64) -> staging::Chunk {
    let mut pieces = Vec::new();
    let end = offset + len;
    for s in &p.segments {
        let (from, to) = (s.offset.max(offset), (s.offset + s.len).min(end));
        if from < to {
            let c = staging::chunk_of(
                &job.local,
                &job.starts,
                s.stream + (from - s.offset),
                to - from,
            );
            pieces.extend(c.pieces);
        }
    }
    staging::Chunk { pieces }
}

/// One object in one PUT (atomic: it is visible whole or not at all).
async fn put(job: &Job, p: &ObjectPlan) -> Result<(), ObjectError> {
    let chunk = object_chunk(job, p, 0, p.bytes());
    let mut staged = staging::stage_out(&job.pool, Arc::clone(&job.copier), vec![chunk], 1);
    let bounce = staged
        .next()
        .await
        .ok_or(ObjectError::ControlThreadGone)??;
    let mut attributes = Attributes::new();
    if job.config.checksums {
        let crc = crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, bounce.as_bytes());
        attributes.insert(
            Attribute::Metadata(CRC_METADATA.into()),
            AttributeValue::from(hex::encode(crc.to_be_bytes())),
        );
    }
    let len = bounce.as_bytes().len() as u64;
    let opts = PutOptions {
        attributes,
        ..PutOptions::default()
    };
    job.client
        .put_opts(
            &p.location,
            PutPayload::from_bytes(bounce.into_bytes()),
            opts,
        )
        .await
        .map_err(|e| ObjectError::request(&p.key, "put", e))?;
    Counters::add(&job.counters.puts, 1);
    Counters::add(&job.counters.bytes_written, len);
    Ok(())
}

/// One object by multipart upload: parts staged and sent `concurrency` at a time, completed
/// in order, aborted on any failure or at the deadline.
async fn multipart(
    job: &Job,
    p: &ObjectPlan,
    deadline: tokio::time::Instant,
) -> Result<usize, ObjectError> {
    let mut upload = job
        .client
        .put_multipart_opts(&p.location, PutMultipartOptions::default())
        .await
        .map_err(|e| ObjectError::request(&p.key, "multipart upload", e))?;
    // Parts are cut over the object's bytes (its runs may lie apart in the local list), so
    // every part but the last is a whole part_size.
    let (size, part) = (p.bytes(), job.config.part_size.max(1));
    let chunks: Vec<_> = (0..size.div_ceil(part))
        .map(|i| object_chunk(job, p, i * part, part.min(size - i * part)))
        .collect();
    let parts = chunks.len();
    let depth = job.config.concurrency.max(1);
    let sent = async {
        let staged = staging::stage_out(&job.pool, Arc::clone(&job.copier), chunks, depth);
        let lens = staging::drain(staged, depth, |bounce| {
            let len = bounce.as_bytes().len() as u64;
            let part = upload.put_part(PutPayload::from_bytes(bounce.into_bytes()));
            let key = p.key.clone();
            async move {
                part.await
                    .map(|()| len)
                    .map_err(|e| ObjectError::request(&key, "multipart upload", e))
            }
        })
        .await?;
        if lens.len() != parts {
            // The copy stream ended early (its task died): never complete a short object.
            return Err(ObjectError::Staging(staging::StagingError::ThreadGone));
        }
        Counters::add(&job.counters.parts, lens.len() as u64);
        Counters::add(&job.counters.bytes_written, lens.iter().sum());
        Ok::<(), ObjectError>(())
    };
    let outcome = match tokio::time::timeout_at(deadline, sent).await {
        Ok(r) => r,
        Err(_) => Err(ObjectError::Timeout(job.timeout)),
    };
    match outcome {
        Ok(()) => {
            upload
                .complete()
                .await
                .map_err(|e| ObjectError::request(&p.key, "multipart upload", e))?;
            Counters::add(&job.counters.multipart_uploads, 1);
            Ok(parts + 2)
        }
        Err(e) => {
            // Best effort, bounded: the upload never completes either way, so no object appears.
            let aborted = tokio::time::timeout(ABORT_GRACE, upload.abort()).await;
            if matches!(aborted, Ok(Ok(()))) {
                Counters::add(&job.counters.aborted, 1);
            }
            tracing::debug!(key = %p.key, error = %e, "multipart upload abandoned");
            Err(e)
        }
    }
}

/// What a HEAD found.
struct Head {
    size: u64,
    e_tag: Option<String>,
    crc: Option<u64>,
}

async fn head(client: &AmazonS3, p: &ObjectPlan) -> Result<Head, ObjectError> {
    let opts = GetOptions {
        head: true,
        ..GetOptions::default()
    };
    let r = client
        .get_opts(&p.location, opts)
        .await
        .map_err(|e| ObjectError::request(&p.key, "head", e))?;
    let crc = r
        .attributes
        .get(&Attribute::Metadata(CRC_METADATA.into()))
        .and_then(|v| <[u8; 8]>::from_hex(v.as_ref()).ok())
        .map(u64::from_be_bytes);
    Ok(Head {
        size: r.meta.size,
        e_tag: r.meta.e_tag,
        crc,
    })
}

/// Reads every range of the job: all sizes first (nothing moves if one is out of range), then
/// ranged GETs `concurrency` at once, each copied into memory as it lands.
async fn read(job: Arc<Job>) -> Result<usize, ObjectError> {
    let depth = job.config.concurrency.max(1);
    let heads = (0..job.plans.len()).map(|i| {
        let job = Arc::clone(&job);
        async move { head(&job.client, &job.plans[i]).await }
    });
    let heads: Vec<Head> = futures_util::stream::iter(heads)
        .buffered(depth)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    for (p, h) in job.plans.iter().zip(&heads) {
        plan::within(p, h.size)?;
    }
    let state = Arc::new(ReadState {
        verify: job
            .plans
            .iter()
            .zip(&heads)
            .map(|(p, h)| h.crc.filter(|_| plan::covers(p, h.size)))
            .collect(),
        e_tags: heads.into_iter().map(|h| h.e_tag).collect(),
        crcs: job.plans.iter().map(|_| Mutex::new(Vec::new())).collect(),
    });
    let mut legs = Vec::new();
    for (i, p) in job.plans.iter().enumerate() {
        for r in plan::ranges(p, job.config.part_size) {
            legs.push((i, r));
        }
    }
    let requests = legs.len() + job.plans.len();
    let gets = legs.into_iter().map(|(i, r)| {
        let job = Arc::clone(&job);
        let state = Arc::clone(&state);
        async move { read_range(&job, &state, i, r).await }
    });
    staging::run_bounded(gets, depth).await?;
    for (i, p) in job.plans.iter().enumerate() {
        let Some(expected) = state.verify[i] else {
            continue;
        };
        let mut parts = std::mem::take(
            &mut *state.crcs[i]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        parts.sort_unstable_by_key(|&(offset, _, _)| offset);
        let got =
            parts
                .iter()
                .skip(1)
                .fold(parts.first().map_or(0, |p| p.1), |acc, &(_, crc, len)| {
                    crc_fast::checksum_combine(crc_fast::CrcAlgorithm::Crc64Nvme, acc, crc, len)
                });
        if got != expected {
            return Err(ObjectError::Checksum {
                key: p.key.clone(),
                expected,
                got,
            });
        }
        Counters::add(&job.counters.checksums_verified, 1);
    }
    Ok(requests)
}

/// A read's per-object state, shared by its ranges.
struct ReadState {
    /// The ETag each object's ranges are pinned to.
    e_tags: Vec<Option<String>>,
    /// The stored whole-object CRC to check, where the read covers the whole object.
    verify: Vec<Option<u64>>,
    /// (offset, CRC, length) of each range read, per object.
    crcs: Vec<Mutex<Vec<(u64, u64, u64)>>>,
}

/// One range: GET, checksum, copy into memory.
async fn read_range(
    job: &Job,
    state: &ReadState,
    i: usize,
    r: plan::Range,
) -> Result<(), ObjectError> {
    let p = &job.plans[i];
    let bytes = get(job, p, state.e_tags[i].clone(), r.offset, r.len).await?;
    if state.verify[i].is_some() {
        let crc = crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, &bytes);
        state.crcs[i]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((r.offset, crc, r.len));
    }
    let chunk = staging::chunk_of(&job.local, &job.starts, r.stream, r.len);
    staging::copy_in(Arc::clone(&job.copier), chunk, bytes).await?;
    Counters::add(&job.counters.bytes_read, r.len);
    Ok(())
}

/// One ranged GET, pinned to the ETag the HEAD saw.
async fn get(
    job: &Job,
    p: &ObjectPlan,
    e_tag: Option<String>,
    offset: u64,
    len: u64,
) -> Result<Bytes, ObjectError> {
    let opts = GetOptions {
        range: Some(GetRange::Bounded(offset..offset + len)),
        if_match: e_tag,
        ..GetOptions::default()
    };
    let r = job
        .client
        .get_opts(&p.location, opts)
        .await
        .map_err(|e| ObjectError::request(&p.key, "get", e))?;
    let bytes = r
        .bytes()
        .await
        .map_err(|e| ObjectError::request(&p.key, "get", e))?;
    Counters::add(&job.counters.gets, 1);
    if bytes.len() as u64 != len {
        return Err(ObjectError::ShortRead {
            key: p.key.clone(),
            offset,
            expected: len,
            got: bytes.len() as u64,
        });
    }
    Ok(bytes)
}

/// Runs one request `op` on `key` on the I/O threads; a missing object is `Ok(None)`.
async fn on_key<T, F>(
    store: &Store,
    key: &str,
    op: &'static str,
    request: impl FnOnce(Arc<AmazonS3>, object_store::path::Path) -> F,
) -> Result<Option<T>, ObjectError>
where
    F: std::future::Future<Output = object_store::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let fut = request(Arc::clone(&store.client), key_location(store, key)?);
    let key = key.to_string();
    store
        .runtime
        .run(async move {
            match fut.await {
                Ok(v) => Ok(Some(v)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(ObjectError::request(&key, op, e)),
            }
        })
        .await
}

/// The size of `key`, `None` if absent.
pub(crate) async fn size(store: &Store, key: &str) -> Result<Option<u64>, ObjectError> {
    let meta = on_key(store, key, "head", |c, at| async move { c.head(&at).await }).await?;
    Ok(meta.map(|m| m.size))
}

/// Deletes `key` (no error if there is none).
pub(crate) async fn delete(store: &Store, key: &str) -> Result<(), ObjectError> {
    on_key(
        store,
        key,
        "delete",
        |c, at| async move { c.delete(&at).await },
    )
    .await?;
    Ok(())
}

fn key_location(store: &Store, key: &str) -> Result<object_store::path::Path, ObjectError> {
    plan::location(&store.prefix, key).map_err(|source| ObjectError::InvalidKey {
        index: 0,
        key: key.into(),
        source,
    })
}
