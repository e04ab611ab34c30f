//! The OBJECT tier's errors.

use std::time::Duration;

use crate::staging::StagingError;

/// An OBJECT-tier error. Nothing is reported done that is not: a failed write leaves no object
/// (a single PUT is atomic, a multipart upload is aborted), a failed read names what failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ObjectError {
    /// The store could not be configured (bad endpoint, missing region, ...).
    #[error("object store configuration: {0}")]
    Config(#[source] object_store::Error),
    /// An AWS shared credentials or config file could not be parsed.
    #[error("AWS profile file {path}: {source}")]
    Profile {
        /// The file.
        path: String,
        /// The parser's error.
        #[source]
        source: ini::ParseError,
    },
    /// The bucket does not exist.
    #[error("bucket {bucket:?} does not exist")]
    NoSuchBucket {
        /// The bucket.
        bucket: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// A descriptor list that cannot be a transfer (empty, zero-length, outside its region,
    /// lengths that differ).
    #[error(transparent)]
    InvalidDescriptor(crate::runtime::InvalidDescriptor),
    /// The server refused the credentials (or their rights).
    #[error("the object store refused the credentials for {what}")]
    Unauthorized {
        /// The bucket or key.
        what: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// The object does not exist.
    #[error("object {key:?} not found")]
    NotFound {
        /// The key (under the registration's prefix).
        key: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// A key that is not a valid object name (empty, `.`/`..` segments, control characters).
    #[error("descriptor {index}: invalid object key {key:?}")]
    InvalidKey {
        /// Index of the descriptor.
        index: usize,
        /// The key.
        key: String,
        /// Why.
        #[source]
        source: object_store::path::Error,
    },
    /// A read outside the object.
    #[error("descriptor {index}: bytes {offset}..{} of object {key:?} are outside its {size} bytes", .offset.saturating_add(*.len))]
    OutOfRange {
        /// Index of the descriptor.
        index: usize,
        /// The key.
        key: String,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The object's size.
        size: u64,
    },
    /// A write must give each object whole: its descriptors, in list order, cover it from 0
    /// without gaps or overlaps (objects are written once, not patched).
    #[error("descriptor {index}: object {key:?} is written whole, so this descriptor must start at {expected}, not {offset}")]
    NotWhole {
        /// Index of the descriptor.
        index: usize,
        /// The key.
        key: String,
        /// Its offset.
        offset: u64,
        /// Where the object's previous descriptor ended.
        expected: u64,
    },
    /// The object was replaced while it was being read (its ETag changed).
    #[error("object {key:?} changed while it was being read")]
    Changed {
        /// The key.
        key: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// The bytes read do not match the checksum stored with the object.
    #[error("object {key:?}: CRC-64/NVME {got:#018x} of the bytes read, {expected:#018x} stored")]
    Checksum {
        /// The key.
        key: String,
        /// Stored checksum.
        expected: u64,
        /// Checksum of what arrived.
        got: u64,
    },
    /// The server answered a range with the wrong number of bytes.
    #[error("object {key:?}: {got} bytes for a {expected}-byte range at {offset}")]
    ShortRead {
        /// The key.
        key: String,
        /// Range start.
        offset: u64,
        /// Bytes asked for.
        expected: u64,
        /// Bytes received.
        got: u64,
    },
    /// A request failed (server error, refused connection, server gone, retries exhausted).
    #[error("object {key:?}: {op} failed")]
    Request {
        /// The key (or the prefix, for a listing).
        key: String,
        /// The request: "put", "multipart upload", "get", "head", "list".
        op: &'static str,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// The transfer did not finish within its deadline (requests still in flight are
    /// cancelled; a multipart upload is aborted).
    #[error("the object transfer took longer than {0:?}")]
    Timeout(Duration),
    /// Staging between memory and bounce buffers failed.
    #[error(transparent)]
    Staging(#[from] StagingError),
    /// The I/O control thread could not be started.
    #[error("cannot start the object I/O thread: {0}")]
    ControlThread(#[source] std::io::Error),
    /// The I/O control thread went away before answering.
    #[error("the object I/O thread went away")]
    ControlThreadGone,
}

impl ObjectError {
    /// The error of request `op` on `key`.
    pub(crate) fn request(key: &str, op: &'static str, e: object_store::Error) -> Self {
        use object_store::Error as E;
        match e {
            E::NotFound { .. } => ObjectError::NotFound {
                key: key.into(),
                source: e,
            },
            E::PermissionDenied { .. } | E::Unauthenticated { .. } => ObjectError::Unauthorized {
                what: key.into(),
                source: e,
            },
            E::Precondition { .. } => ObjectError::Changed {
                key: key.into(),
                source: e,
            },
            e => {
                // S3 refuses credentials with a 403 whose code the client does not map.
                if refused(&e) {
                    ObjectError::Unauthorized {
                        what: key.into(),
                        source: e,
                    }
                } else {
                    ObjectError::Request {
                        key: key.into(),
                        op,
                        source: e,
                    }
                }
            }
        }
    }
}

/// Whether `e` (or an error under it) is the server refusing who we are: HTTP 403, or one of
/// S3's codes for unknown keys and bad signatures.
fn refused(e: &object_store::Error) -> bool {
    const CODES: [&str; 5] = [
        "403 Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "NotSignedUp",
    ];
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        let text = err.to_string();
        if CODES.iter().any(|c| text.contains(c)) {
            return true;
        }
        next = err.source();
    }
    false
}
