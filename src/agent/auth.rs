//! Agent identity: the agents of one cluster share a secret key, and prove they hold it.
//!
//! - Every side-channel connection is mutually authenticated by an HMAC-SHA256
//!   challenge-response before the name a peer claims is believed (see the side channel, `docs/security.md`).
//! - Every metadata blob carries an HMAC-SHA256 tag over its content, the agent's name
//!   included, checked on load: on the side channel, in etcd, and from the application.
//!
//! Why a shared key and HMAC, not TLS: the agents of one serving cluster are deployed together
//! and already share their configuration; a key is one more line of it, with no certificate
//! authority to run, rotate or get wrong. The side channel carries only metadata and queue-pair
//! endpoints (the data moves over RDMA, which TLS could not cover anyway), so what it needs is
//! authenticity, not secrecy: HMAC gives that in the one round trip the protocol already has.
//! The same key tags the metadata stored in etcd, which TLS on the side channel would not.
//!
//! Keys come from [`AgentConfig::cluster_key`](super::AgentConfig::cluster_key), else from
//! `RIXL_CLUSTER_KEY` (hex) or `RIXL_CLUSTER_KEY_FILE` (a file holding the hex). An agent
//! without a key refuses to start unless it is configured
//! [`insecure`](super::AgentConfig::insecure): it then tags with a key everybody knows (so
//! agents of one build still interoperate and corruption is still caught) and warns on every
//! side-channel connection.

use std::fmt;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a tag (HMAC-SHA256).
pub const TAG_LEN: usize = 32;
/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// The shortest key accepted.
pub const MIN_KEY_LEN: usize = 16;
/// The longest key accepted.
pub const MAX_KEY_LEN: usize = 1024;

/// Why a key could not be had, or a peer was not believed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// No cluster key is configured and the agent is not configured `insecure`.
    #[error("no cluster key: set AgentConfig::cluster_key, RIXL_CLUSTER_KEY (hex) or RIXL_CLUSTER_KEY_FILE, or configure the agent insecure explicitly")]
    NoKey,
    /// The key is not hex.
    #[error("the cluster key is not hex")]
    KeyNotHex(#[source] hex::FromHexError),
    /// The key is too short or too long.
    #[error("the cluster key has {0} bytes; {MIN_KEY_LEN}..={MAX_KEY_LEN} are accepted")]
    KeyLength(usize),
    /// The key file cannot be read.
    #[error("cannot read the cluster key file {path:?}")]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The OS's random source failed (nonces cannot be made).
    #[error("no OS randomness for a nonce")]
    NoRandomness(#[source] getrandom::Error),
    /// A side-channel peer failed the challenge: it does not hold the cluster key, or the
    /// exchange was tampered with.
    #[error("{addr}: side-channel peer claiming to be {claimed:?} failed authentication")]
    Forged {
        /// The peer's address.
        addr: String,
        /// The name it claimed.
        claimed: String,
    },
    /// The peer refused our proof (we hold another key than the cluster's).
    #[error("{addr}: the peer refused our authentication: {reason}")]
    Refused {
        /// The peer's address.
        addr: String,
        /// What it answered.
        reason: String,
    },
    /// An agent name that cannot be used on the wire (empty, over 256 bytes, whitespace or
    /// control characters).
    #[error("invalid agent name {0:?}: 1..=256 bytes, no whitespace or control characters")]
    InvalidName(String),
}

/// The secret the agents of one cluster share. Its `Debug` shows no byte of it.
#[derive(Clone)]
pub struct ClusterKey {
    bytes: Vec<u8>,
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

/// The key of an insecure agent: public, so it authenticates nothing.
const INSECURE_KEY: &[u8] = b"rixl insecure agent: this key is public and proves nothing";

impl ClusterKey {
    /// A fresh random 32-byte key from the OS's CSPRNG.
    ///
    /// # Errors
    /// [`AuthError::NoRandomness`] if the OS has no random source.
    pub fn generate() -> Result<Self, AuthError> {
        let mut bytes = vec![0u8; 32];
        getrandom::getrandom(&mut bytes).map_err(AuthError::NoRandomness)?;
        Ok(ClusterKey { bytes })
    }

    /// A key from raw bytes.
    ///
    /// # Errors
    /// [`AuthError::KeyLength`] outside 16..=1024 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, AuthError> {
        if !(MIN_KEY_LEN..=MAX_KEY_LEN).contains(&bytes.len()) {
            return Err(AuthError::KeyLength(bytes.len()));
        }
        Ok(ClusterKey {
            bytes: bytes.to_vec(),
        })
    }

    /// A key from hex (surrounding whitespace ignored).
    ///
    /// # Errors
    /// [`AuthError::KeyNotHex`], [`AuthError::KeyLength`].
    pub fn from_hex(s: &str) -> Result<Self, AuthError> {
        let s = s.trim();
        if s.len() > 2 * MAX_KEY_LEN {
            return Err(AuthError::KeyLength(s.len() / 2));
        }
        Self::from_bytes(&hex::decode(s).map_err(AuthError::KeyNotHex)?)
    }

    /// A key from a file holding its hex.
    ///
    /// # Errors
    /// [`AuthError::KeyFile`], then as [`Self::from_hex`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, AuthError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::KeyFile {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_hex(&text)
    }

    /// The key named by the environment: `RIXL_CLUSTER_KEY` (hex), else the file
    /// `RIXL_CLUSTER_KEY_FILE`; `None` if neither is set.
    ///
    /// # Errors
    /// As [`Self::from_hex`] and [`Self::from_file`].
    pub fn from_env() -> Result<Option<Self>, AuthError> {
        if let Ok(hex) = std::env::var("RIXL_CLUSTER_KEY") {
            return Self::from_hex(&hex).map(Some);
        }
        match std::env::var_os("RIXL_CLUSTER_KEY_FILE") {
            Some(path) => Self::from_file(path).map(Some),
            None => Ok(None),
        }
    }

    /// The environment's key ([`Self::from_env`]), else one generated once for this process
    /// (the same on every call): for agents that talk only to each other inside one process
    /// (demos, tests). Agents in other processes need the key handed to them.
    ///
    /// # Errors
    /// As [`Self::from_env`] and [`Self::generate`].
    pub fn env_or_process_local() -> Result<Self, AuthError> {
        static LOCAL: std::sync::OnceLock<ClusterKey> = std::sync::OnceLock::new();
        if let Some(k) = Self::from_env()? {
            return Ok(k);
        }
        if let Some(k) = LOCAL.get() {
            return Ok(k.clone());
        }
        let k = Self::generate()?;
        Ok(LOCAL.get_or_init(|| k).clone())
    }

    /// The key as hex (to hand to the other agents of the cluster).
    pub fn to_hex(&self) -> String {
        hex::encode(&self.bytes)
    }

    /// The public key of an insecure agent.
    pub(crate) fn insecure() -> Self {
        ClusterKey {
            bytes: INSECURE_KEY.to_vec(),
        }
    }

    fn hmac(&self, label: &str, parts: &[&[u8]]) -> HmacSha256 {
        // HMAC takes keys of any length: this cannot fail.
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.bytes)
            .unwrap_or_else(|_| unreachable!("HMAC accepts every key length"));
        // Length-prefixed fields: no two field lists give the same input.
        for p in std::iter::once(label.as_bytes()).chain(parts.iter().copied()) {
            m.update(&(p.len() as u64).to_be_bytes());
            m.update(p);
        }
        m
    }

    /// The tag of `parts` under `label` (a domain separator: a tag made for one purpose
    /// never verifies for another).
    pub(crate) fn tag(&self, label: &str, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        self.hmac(label, parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is the tag of `parts` under `label` (compared in constant time).
    pub(crate) fn verify(&self, label: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.hmac(label, parts).verify_slice(tag).is_ok()
    }
}

/// A fresh handshake nonce.
///
/// # Errors
/// [`AuthError::NoRandomness`].
pub(crate) fn nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).map_err(AuthError::NoRandomness)?;
    Ok(n)
}

/// Checks that `name` can travel in a side-channel line and a metadata blob.
///
/// # Errors
/// [`AuthError::InvalidName`].
pub(crate) fn check_name(name: &str) -> Result<(), AuthError> {
    if name.is_empty()
        || name.len() > 256
        || name.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(AuthError::InvalidName(name.chars().take(300).collect()));
    }
    Ok(())
}

/// How an agent proves itself: with the cluster's key, or insecure (it says so).
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub(crate) key: ClusterKey,
    pub(crate) insecure: bool,
}

impl Identity {
    /// The identity an agent configured with `key` / `insecure` runs with.
    ///
    /// # Errors
    /// [`AuthError::NoKey`] without a key (configured or in the environment) unless
    /// `insecure`; a bad key in the environment as [`ClusterKey::from_env`].
    pub(crate) fn resolve(key: Option<ClusterKey>, insecure: bool) -> Result<Self, AuthError> {
        if insecure {
            return Ok(Identity {
                key: ClusterKey::insecure(),
                insecure: true,
            });
        }
        let key = match key {
            Some(k) => k,
            None => ClusterKey::from_env()?.ok_or(AuthError::NoKey)?,
        };
        Ok(Identity {
            key,
            insecure: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_verify_only_with_the_same_key_label_and_fields() {
        let k = ClusterKey::generate().unwrap();
        let t = k.tag("a", &[b"x", b"yz"]);
        assert!(k.verify("a", &[b"x", b"yz"], &t));
        assert!(!k.verify("b", &[b"x", b"yz"], &t), "another label");
        assert!(
            !k.verify("a", &[b"xy", b"z"], &t),
            "fields are length-prefixed"
        );
        assert!(!k.verify("a", &[b"x", b"yz"], &t[..31]), "a short tag");
        let other = ClusterKey::generate().unwrap();
        assert!(!other.verify("a", &[b"x", b"yz"], &t), "another key");
        assert!(!ClusterKey::insecure().verify("a", &[b"x", b"yz"], &t));
    }

    #[test]
    fn keys_parse_from_hex_and_reject_bad_input() {
        let k = ClusterKey::generate().unwrap();
        let back = ClusterKey::from_hex(&format!(" {}\n", k.to_hex())).unwrap();
        assert_eq!(back.to_hex(), k.to_hex());
        assert!(matches!(
            ClusterKey::from_hex("zz"),
            Err(AuthError::KeyNotHex(_))
        ));
        assert!(matches!(
            ClusterKey::from_hex("ééé"),
            Err(AuthError::KeyNotHex(_))
        ));
        assert!(matches!(
            ClusterKey::from_hex("00ff"),
            Err(AuthError::KeyLength(2))
        ));
        assert!(matches!(
            ClusterKey::from_file("/nonexistent/rixl-key"),
            Err(AuthError::KeyFile { .. })
        ));
        assert_eq!(format!("{k:?}"), "ClusterKey(..)", "Debug hides the key");
    }

    #[test]
    fn no_key_refuses_unless_insecure() {
        let k = ClusterKey::generate().unwrap();
        assert!(!Identity::resolve(Some(k), false).unwrap().insecure);
        assert!(Identity::resolve(None, true).unwrap().insecure);
        if std::env::var_os("RIXL_CLUSTER_KEY").is_none()
            && std::env::var_os("RIXL_CLUSTER_KEY_FILE").is_none()
        {
            assert!(matches!(
                Identity::resolve(None, false),
                Err(AuthError::NoKey)
            ));
        }
    }

    #[test]
    fn names_with_whitespace_or_control_characters_are_refused() {
        for bad in ["", "a b", "a\nb", "a\tb", "\u{7f}", &"x".repeat(257)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["prefill-0", "decode/3", "ägent"] {
            check_name(good).unwrap();
        }
    }
}
