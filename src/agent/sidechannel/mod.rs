//! The TCP side channel: a peer fetches our metadata (scoped for it) and sets up its
//! connection, after both sides proved they hold the cluster key.
//!
//! One exchange per TCP connection, text lines:
//!
//! ```text
//! client: RIXL1 HELLO <client name> <client nonce hex>
//! server: RIXL1 CHALLENGE <server name> <server nonce hex> <server proof hex>
//! client: <client proof hex> <request>
//! server: <reply proof hex> <reply>              (or `ERR <reason>`, unproven, on refusal)
//! ```
//!
//! Proofs are HMAC-SHA256 tags under the cluster key over both names and both nonces (the
//! client's proof also over its request, the reply's over request and reply), each with its own
//! label: a proof made for one connection, one direction or one request verifies for no other.
//! The server believes the client's name only once its proof verifies, and serves the request
//! as that name; the client believes the server's name and reply the same way.
//!
//! Requests: `MD` → the metadata blob we grant the requester, hex; `CONNECT <endpoint hex>
//! <rail> <generation>` → our endpoint hex and the requester's grant keys on the new
//! connection, hex (see `grants`), or `ERR <reason>`; `GRANTS <rail> <qpn>` → the requester's
//! grant keys on our connection whose queue pair is `qpn` (windows it lacks are bound first);
//! `NOTIFY <message hex>` → `OK` once the notification is in our stream (agents without a NIC
//! send their notifications this way). The requester's generation (its
//! incarnation) tags the connection, so that when its new metadata arrives later only its old
//! incarnation's connections are closed.
//!
//! Bounds: the server runs on one control thread (tokio, current-thread): a connection is a
//! task, never a thread, and gets no queue pair before it is authenticated. At most
//! `max_side_channel_connections` are served at once (more wait in the kernel's accept queue
//! until a slot frees: back-pressure, not refusal), each whole exchange within
//! `connect_timeout`. A hello line may hold 1 KiB and a request 8.25 KiB, so a client that has
//! not proved itself makes the server buffer at most 9.25 KiB (an oversized line gets `ERR message too
//! large` and the connection is closed); a client accepts a metadata reply of at most
//! `max_control_message` bytes of blob.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use super::auth::{self, AuthError, NONCE_LEN, TAG_LEN};
use super::conns::{Direction, NewConn, QpNumbers};
use super::grants::GrantKeys;
use super::metadata::MAX_BLOB;
use super::snapshot::lock;
use super::{AgentError, Inner};
use crate::verbs::Endpoint;

/// The protocol's version word.
const VERSION: &str = "RIXL1";
/// The longest hello or challenge line.
const HELLO_MAX: usize = 1024;
/// The longest request line (a CONNECT is about 100 bytes, a NOTIFY with the largest
/// notification in hex about 8 KiB): what a client that has not yet proved itself can make the
/// server buffer, with its hello.
const REQUEST_MAX: usize = 2 * super::notify::MAX_NOTIFICATION + 256;
/// How often the accept loop looks whether the agent stopped.
const STOP_POLL: Duration = Duration::from_millis(200);

const SERVER_PROOF: &str = "rixl/side-channel/server";
const CLIENT_PROOF: &str = "rixl/side-channel/client";
const REPLY_PROOF: &str = "rixl/side-channel/reply";

/// What the side channel's server has seen ([`crate::agent::Agent::side_channel_counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SideChannelCounters {
    /// Connections accepted and served.
    pub accepted: u64,
    /// Times (200 ms apart) every one of the `max_side_channel_connections` slots was busy and
    /// new connections waited in the kernel's accept queue.
    pub full: u64,
    /// Clients whose proof verified (their requests were served).
    pub authenticated: u64,
    /// Clients that failed authentication (no key, another key, a forged or replayed proof).
    pub auth_failures: u64,
    /// Lines over their kind's size limit.
    pub oversized: u64,
    /// Exchanges that did not finish within `connect_timeout`.
    pub timed_out: u64,
    /// Malformed hello lines or requests.
    pub malformed: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    accepted: AtomicU64,
    full: AtomicU64,
    authenticated: AtomicU64,
    auth_failures: AtomicU64,
    oversized: AtomicU64,
    timed_out: AtomicU64,
    malformed: AtomicU64,
}

impl Counters {
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> SideChannelCounters {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SideChannelCounters {
            accepted: r(&self.accepted),
            full: r(&self.full),
            authenticated: r(&self.authenticated),
            auth_failures: r(&self.auth_failures),
            oversized: r(&self.oversized),
            timed_out: r(&self.timed_out),
            malformed: r(&self.malformed),
        }
    }
}

fn sc(e: impl std::fmt::Display) -> AgentError {
    AgentError::SideChannel(e.to_string())
}

fn decode_hex(s: &str) -> Result<Vec<u8>, AgentError> {
    hex::decode(s).map_err(|e| AgentError::SideChannel(format!("bad hex: {e}")))
}

/// A nonce or tag in hex, `n` bytes.
fn fixed_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

/// The fields every proof of one exchange covers.
struct Exchange<'a> {
    client: &'a str,
    server: &'a str,
    client_nonce: &'a [u8; NONCE_LEN],
    server_nonce: &'a [u8; NONCE_LEN],
}

impl Exchange<'_> {
    fn fields<'b>(&'b self, more: &[&'b [u8]]) -> Vec<&'b [u8]> {
        let mut v: Vec<&[u8]> = vec![
            self.client.as_bytes(),
            self.server.as_bytes(),
            self.client_nonce,
            self.server_nonce,
        ];
        v.extend_from_slice(more);
        v
    }
}

// ---- lines ---------------------------------------------------------------------------------

/// A client's hello: its claimed name and its nonce (`None`: malformed).
pub(crate) fn parse_hello(line: &str) -> Option<(&str, [u8; NONCE_LEN])> {
    let mut f = line.split(' ');
    match (f.next(), f.next(), f.next(), f.next(), f.next()) {
        (Some(VERSION), Some("HELLO"), Some(name), Some(nonce), None) => {
            auth::check_name(name).ok()?;
            Some((name, fixed_hex::<NONCE_LEN>(nonce)?))
        }
        _ => None,
    }
}

/// A server's challenge: its name, then its nonce and proof (`None` each when malformed).
pub(crate) struct Challenge<'a> {
    name: &'a str,
    nonce: Option<[u8; NONCE_LEN]>,
    proof: Option<[u8; TAG_LEN]>,
}

/// A server's challenge line (`None`: not a rixl side channel).
pub(crate) fn parse_challenge(line: &str) -> Option<Challenge<'_>> {
    let mut f = line.split(' ');
    match (f.next(), f.next(), f.next(), f.next(), f.next(), f.next()) {
        (Some(VERSION), Some("CHALLENGE"), Some(name), Some(nonce), Some(proof), None) => {
            Some(Challenge {
                name,
                nonce: fixed_hex::<NONCE_LEN>(nonce),
                proof: fixed_hex::<TAG_LEN>(proof),
            })
        }
        _ => None,
    }
}

/// A line that starts with a proof: the proof (`None` when it is not one) and the rest.
pub(crate) fn split_proof(line: &str) -> (Option<[u8; TAG_LEN]>, &str) {
    let (proof, rest) = line.split_once(' ').unwrap_or((line, ""));
    (fixed_hex::<TAG_LEN>(proof), rest)
}

/// An authenticated client's request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request<'a> {
    /// `MD`: the metadata we grant it.
    Metadata,
    /// `CONNECT <endpoint hex> <rail> <generation>`: a connection on `rail`.
    Connect {
        endpoint: &'a str,
        rail: usize,
        generation: u64,
    },
    /// `GRANTS <rail> <qpn>`: the requester's keys on our connection on `rail` whose queue
    /// pair is `qpn`.
    Grants { rail: usize, qpn: u32 },
    /// `NOTIFY <message hex>`: a notification from the requester.
    Notify(Vec<u8>),
}

/// A request line.
///
/// # Errors
/// [`AgentError::SideChannel`] for an unknown or malformed request.
pub(crate) fn parse_request(request: &str) -> Result<Request<'_>, AgentError> {
    let mut f = request.split(' ');
    match (f.next(), f.next(), f.next(), f.next(), f.next()) {
        (Some("MD"), None, ..) => Ok(Request::Metadata),
        (Some("CONNECT"), Some(endpoint), Some(rail), Some(generation), None) => {
            match (rail.parse::<usize>(), generation.parse::<u64>()) {
                (Ok(rail), Ok(generation)) => Ok(Request::Connect {
                    endpoint,
                    rail,
                    generation,
                }),
                _ => Err(sc("bad rail or generation")),
            }
        }
        (Some("GRANTS"), Some(rail), Some(qpn), None, _) => {
            match (rail.parse::<usize>(), qpn.parse::<u32>()) {
                (Ok(rail), Ok(qpn)) => Ok(Request::Grants { rail, qpn }),
                _ => Err(sc("bad rail or queue pair number")),
            }
        }
        (Some("NOTIFY"), Some(msg), None, ..) => {
            let msg = hex::decode(msg).map_err(|_| sc("bad notification hex"))?;
            if msg.is_empty() || msg.len() > super::notify::MAX_NOTIFICATION {
                return Err(AgentError::NotificationTooLarge(msg.len()));
            }
            Ok(Request::Notify(msg))
        }
        _ => Err(sc("unknown request")),
    }
}

mod client;
mod server;

pub(super) use client::{fetch_metadata, request_connection, request_grants, send_notification};
pub(super) use server::listen;
