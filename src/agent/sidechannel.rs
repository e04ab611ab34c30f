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
//! grant keys on our connection whose queue pair is `qpn` (windows it lacks are bound first). The requester's generation (its
//! incarnation) tags the connection, so that when its new metadata arrives later only its old
//! incarnation's connections are closed.
//!
//! Bounds: the server runs on one control thread (tokio, current-thread): a connection is a
//! task, never a thread, and gets no queue pair before it is authenticated. At most
//! `max_side_channel_connections` are served at once (more wait in the kernel's accept queue
//! until a slot frees: back-pressure, not refusal), each whole exchange within
//! `connect_timeout`. A hello line may hold 1 KiB and a request 4 KiB, so a client that has not
//! proved itself makes the server buffer at most 5 KiB (an oversized line gets `ERR message too
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
/// The longest request line (a CONNECT is about 100 bytes): what a client that has not yet
/// proved itself can make the server buffer, with its hello.
const REQUEST_MAX: usize = 4096;
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
        _ => Err(sc("unknown request")),
    }
}

// ---- client --------------------------------------------------------------------------------

/// A side-channel client stream to `addr`, connected by `deadline`.
fn connect(addr: &str, deadline: Instant) -> Result<TcpStream, AgentError> {
    let io = |source: std::io::Error| AgentError::SideChannelIo {
        addr: addr.to_string(),
        source,
    };
    let target = addr
        .to_socket_addrs()
        .map_err(io)?
        .next()
        .ok_or_else(|| io(std::io::ErrorKind::AddrNotAvailable.into()))?;
    let s = TcpStream::connect_timeout(&target, left(addr, deadline)?).map_err(io)?;
    s.set_nodelay(true).ok();
    Ok(s)
}

/// Time left before `deadline`, or a timeout error.
fn left(addr: &str, deadline: Instant) -> Result<Duration, AgentError> {
    match deadline.checked_duration_since(Instant::now()) {
        Some(d) if !d.is_zero() => Ok(d),
        _ => Err(AgentError::SideChannelIo {
            addr: addr.to_string(),
            source: std::io::ErrorKind::TimedOut.into(),
        }),
    }
}

/// Reads one line of at most `limit` bytes by `deadline` (without its newline).
fn read_line(
    r: &mut BufReader<TcpStream>,
    addr: &str,
    limit: usize,
    deadline: Instant,
) -> Result<String, AgentError> {
    let io = |source: std::io::Error| AgentError::SideChannelIo {
        addr: addr.to_string(),
        source,
    };
    r.get_ref()
        .set_read_timeout(Some(left(addr, deadline)?))
        .map_err(io)?;
    let mut l = String::new();
    let n = Read::take(&mut *r, limit as u64 + 1)
        .read_line(&mut l)
        .map_err(io)?;
    if n == 0 {
        return Err(AgentError::SideChannel(format!(
            "{addr} closed the side channel"
        )));
    }
    if !l.ends_with('\n') {
        return Err(AgentError::MessageTooLarge {
            addr: addr.to_string(),
            limit,
        });
    }
    l.pop();
    Ok(l)
}

/// One authenticated request to `addr` (whose agent must be `expect`, when given); the reply,
/// of at most `reply_limit` bytes, by `deadline`.
fn exchange(
    me: &Inner,
    addr: &str,
    expect: Option<&str>,
    request: &str,
    reply_limit: usize,
    deadline: Instant,
) -> Result<String, AgentError> {
    let s = connect(addr, deadline)?;
    let io = |source: std::io::Error| AgentError::SideChannelIo {
        addr: addr.to_string(),
        source,
    };
    s.set_write_timeout(Some(left(addr, deadline)?))
        .map_err(io)?;
    let mut w = s.try_clone().map_err(io)?;
    let mut r = BufReader::new(s);
    let key = &me.identity.key;
    let client_nonce = auth::nonce()?;
    writeln!(
        w,
        "{VERSION} HELLO {} {}",
        me.name,
        hex::encode(client_nonce)
    )
    .map_err(io)?;
    let line = read_line(&mut r, addr, HELLO_MAX, deadline)?;
    if let Some(reason) = line.strip_prefix("ERR ") {
        return Err(AgentError::SideChannel(format!("{addr}: {reason}")));
    }
    let Some(Challenge {
        name: server,
        nonce: server_nonce,
        proof,
    }) = parse_challenge(&line)
    else {
        return Err(sc(format!("{addr}: not a rixl side channel")));
    };
    let forged = || {
        AgentError::Auth(AuthError::Forged {
            addr: addr.to_string(),
            claimed: server.to_string(),
        })
    };
    let (Some(server_nonce), Some(proof)) = (server_nonce, proof) else {
        return Err(forged());
    };
    let x = Exchange {
        client: &me.name,
        server,
        client_nonce: &client_nonce,
        server_nonce: &server_nonce,
    };
    if !key.verify(SERVER_PROOF, &x.fields(&[]), &proof) {
        tracing::warn!(agent = %me.name, %addr, claimed = %server, "side channel: the server failed authentication");
        return Err(forged());
    }
    if let Some(expected) = expect.filter(|e| *e != server) {
        return Err(AgentError::WrongPeer {
            expected: expected.to_string(),
            found: server.to_string(),
        });
    }
    if me.identity.insecure {
        tracing::warn!(agent = %me.name, %addr, peer = %server, "insecure side channel: the peer's name is not authenticated");
    }
    let mine = key.tag(CLIENT_PROOF, &x.fields(&[request.as_bytes()]));
    writeln!(w, "{} {request}", hex::encode(mine)).map_err(io)?;
    let line = read_line(&mut r, addr, reply_limit, deadline)?;
    if let Some(reason) = line.strip_prefix("ERR ") {
        return Err(AgentError::Auth(AuthError::Refused {
            addr: addr.to_string(),
            reason: reason.to_string(),
        }));
    }
    let (proof, reply) = split_proof(&line);
    let proven = proof.is_some_and(|p| {
        key.verify(
            REPLY_PROOF,
            &x.fields(&[request.as_bytes(), reply.as_bytes()]),
            &p,
        )
    });
    if !proven {
        return Err(forged());
    }
    match reply.strip_prefix("ERR ") {
        Some(e) => Err(AgentError::SideChannel(e.to_string())),
        None => Ok(reply.to_string()),
    }
}

/// The metadata `addr`'s agent (`expect`, when given) grants us, fetched by `deadline`.
pub(super) fn fetch_metadata(
    me: &Inner,
    addr: &str,
    expect: Option<&str>,
    deadline: Instant,
) -> Result<Vec<u8>, AgentError> {
    // The reply: its proof, a space, the blob in hex.
    let limit = 2 * TAG_LEN + 1 + 2 * me.limits.message.min(MAX_BLOB);
    decode_hex(&exchange(me, addr, expect, "MD", limit, deadline)?)
}

/// What a `CONNECT` got: the peer's endpoint, and its grant keys on the new connection (none
/// from a peer without NIC grants).
pub(super) struct Accepted {
    pub endpoint: Endpoint,
    pub keys: Option<GrantKeys>,
}

/// The longest reply carrying grant keys `me` accepts (proof, endpoint, keys; hex).
fn keys_reply_limit(me: &Inner) -> usize {
    2 * TAG_LEN + 1 + HELLO_MAX + 2 * me.limits.message
}

/// Asks `peer`'s agent at `addr` for a connection on `rail` to our endpoint `mine`; returns its
/// endpoint and our grant keys on it.
pub(super) fn request_connection(
    me: &Inner,
    peer: &str,
    addr: &str,
    rail: usize,
    mine: &Endpoint,
    deadline: Instant,
) -> Result<Accepted, AgentError> {
    let request = format!(
        "CONNECT {} {rail} {}",
        hex::encode(mine.to_bytes()),
        me.generation
    );
    let line = exchange(
        me,
        addr,
        Some(peer),
        &request,
        keys_reply_limit(me),
        deadline,
    )?;
    let mut f = line.split(' ');
    let endpoint = Endpoint::from_bytes(&decode_hex(f.next().unwrap_or_default())?).map_err(sc)?;
    let keys = f
        .next()
        .map(|k| GrantKeys::decode(&decode_hex(k)?))
        .transpose()?;
    Ok(Accepted { endpoint, keys })
}

/// Asks `peer`'s agent at `addr` for our grant keys on its connection on `rail` whose queue
/// pair is `qpn`.
pub(super) fn request_grants(
    me: &Inner,
    peer: &str,
    addr: &str,
    rail: usize,
    qpn: u32,
    deadline: Instant,
) -> Result<GrantKeys, AgentError> {
    let line = exchange(
        me,
        addr,
        Some(peer),
        &format!("GRANTS {rail} {qpn}"),
        keys_reply_limit(me),
        deadline,
    )?;
    GrantKeys::decode(&decode_hex(&line)?)
}

// ---- server --------------------------------------------------------------------------------

/// Listens on `addr`; serves on a control thread of its own.
pub(super) fn listen(inner: &Arc<Inner>, addr: &str) -> Result<SocketAddr, AgentError> {
    let io = |source: std::io::Error| AgentError::SideChannelIo {
        addr: addr.to_string(),
        source,
    };
    let listener = std::net::TcpListener::bind(addr).map_err(io)?;
    listener.set_nonblocking(true).map_err(io)?;
    let local = listener.local_addr().map_err(io)?;
    *lock(&inner.address) = local.to_string();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(AgentError::ControlThread)?;
    let weak = Arc::downgrade(inner);
    std::thread::Builder::new()
        .name(format!("rixl-side-channel-{}", inner.name))
        .spawn(move || runtime.block_on(accept_loop(weak, listener)))
        .map_err(AgentError::ControlThread)?;
    if inner.identity.insecure {
        tracing::warn!(agent = %inner.name, %local, "side channel listening INSECURE: any client can claim any name");
    } else {
        tracing::info!(agent = %inner.name, %local, "side channel listening");
    }
    Ok(local)
}

async fn accept_loop(weak: Weak<Inner>, listener: std::net::TcpListener) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "side channel: cannot serve");
            return;
        }
    };
    let Some(cap) = weak.upgrade().map(|i| i.limits.connections) else {
        return;
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(cap));
    let mut slot = None;
    loop {
        // A free slot first: while every slot is busy, new connections wait in the kernel's
        // accept queue (bounded by the kernel, no memory of ours) instead of being refused.
        let event = tokio::select! {
            s = Arc::clone(&slots).acquire_owned(), if slot.is_none() => Event::Slot(s.ok()),
            r = listener.accept(), if slot.is_some() => Event::Accepted(r),
            _ = tokio::time::sleep(STOP_POLL) => Event::Tick,
        };
        let Some(inner) = weak.upgrade() else { return };
        if inner.stopped.load(Ordering::SeqCst) {
            return;
        }
        let (stream, from) = match event {
            Event::Tick => {
                if slot.is_none() && slots.available_permits() == 0 {
                    Counters::bump(&inner.side_counters.full);
                }
                continue;
            }
            Event::Slot(s) => {
                slot = s;
                continue;
            }
            Event::Accepted(Ok(s)) => s,
            Event::Accepted(Err(e)) => {
                // Out of descriptors, mostly: let some connections end first.
                tracing::warn!(agent = %inner.name, error = %e, "side channel: accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let Some(slot) = slot.take() else { continue };
        Counters::bump(&inner.side_counters.accepted);
        tokio::spawn(async move {
            let _slot = slot;
            let within = inner.connect_timeout;
            match tokio::time::timeout(within, serve(&inner, stream, from)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(agent = %inner.name, %from, error = %e, "side-channel request failed")
                }
                Err(_) => {
                    Counters::bump(&inner.side_counters.timed_out);
                    tracing::debug!(agent = %inner.name, %from, "side-channel exchange timed out");
                }
            }
        });
    }
}

/// What the accept loop woke up for.
enum Event {
    Slot(Option<tokio::sync::OwnedSemaphorePermit>),
    Accepted(std::io::Result<(tokio::net::TcpStream, SocketAddr)>),
    Tick,
}

/// Why a line could not be read.
enum LineError {
    Closed,
    TooLarge,
    NotUtf8,
    Io(std::io::Error),
}

async fn read_line_async<R: tokio::io::AsyncBufRead + Unpin>(
    r: &mut R,
    limit: usize,
) -> Result<String, LineError> {
    let mut buf = Vec::new();
    let n = tokio::io::AsyncReadExt::take(&mut *r, limit as u64 + 1)
        .read_until(b'\n', &mut buf)
        .await
        .map_err(LineError::Io)?;
    if n == 0 {
        return Err(LineError::Closed);
    }
    if buf.last() != Some(&b'\n') {
        return Err(LineError::TooLarge);
    }
    buf.pop();
    String::from_utf8(buf).map_err(|_| LineError::NotUtf8)
}

/// A refusal the client can read, then the connection closes.
async fn refuse(w: &mut tokio::net::tcp::OwnedWriteHalf, reason: &str) {
    let _ = w.write_all(format!("ERR {reason}\n").as_bytes()).await;
    let _ = w.shutdown().await;
}

/// Reads one line of at most `limit` bytes from the client at `from`. A line refused for its
/// size or its form is answered (`ERR ...`) before the connection closes; each refusal is
/// counted.
async fn read_or_refuse(
    inner: &Inner,
    from: SocketAddr,
    r: &mut tokio::io::BufReader<tokio::net::tcp::OwnedReadHalf>,
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    limit: usize,
) -> Result<String, AgentError> {
    let counters = &inner.side_counters;
    let (e, answer) = match read_line_async(r, limit).await {
        Ok(l) => return Ok(l),
        Err(LineError::Closed) => (sc(format!("{from} closed the side channel")), None),
        Err(LineError::TooLarge) => {
            Counters::bump(&counters.oversized);
            tracing::warn!(agent = %inner.name, %from, limit, "side channel: a line over its size limit; connection closed");
            let e = AgentError::MessageTooLarge {
                addr: from.to_string(),
                limit,
            };
            (e, Some("message too large"))
        }
        Err(LineError::NotUtf8) => {
            Counters::bump(&counters.malformed);
            (
                sc(format!("{from}: a line that is not UTF-8")),
                Some("malformed line"),
            )
        }
        Err(LineError::Io(source)) => (
            AgentError::SideChannelIo {
                addr: from.to_string(),
                source,
            },
            None,
        ),
    };
    if let Some(reason) = answer {
        refuse(w, reason).await;
    }
    Err(e)
}

/// Serves one connection: the handshake, one request.
async fn serve(
    inner: &Arc<Inner>,
    stream: tokio::net::TcpStream,
    from: SocketAddr,
) -> Result<(), AgentError> {
    stream.set_nodelay(true).ok();
    let (r, mut w) = stream.into_split();
    let mut r = tokio::io::BufReader::new(r);
    let counters = &inner.side_counters;
    let io = |source: std::io::Error| AgentError::SideChannelIo {
        addr: from.to_string(),
        source,
    };
    let hello = read_or_refuse(inner, from, &mut r, &mut w, HELLO_MAX).await?;
    let Some((client, client_nonce)) = parse_hello(&hello) else {
        Counters::bump(&counters.malformed);
        refuse(&mut w, "bad hello").await;
        return Err(sc(format!("{from}: bad hello")));
    };
    let key = &inner.identity.key;
    let server_nonce = auth::nonce()?;
    let x = Exchange {
        client,
        server: &inner.name,
        client_nonce: &client_nonce,
        server_nonce: &server_nonce,
    };
    let proof = key.tag(SERVER_PROOF, &x.fields(&[]));
    w.write_all(
        format!(
            "{VERSION} CHALLENGE {} {} {}\n",
            inner.name,
            hex::encode(server_nonce),
            hex::encode(proof)
        )
        .as_bytes(),
    )
    .await
    .map_err(io)?;
    let line = read_or_refuse(inner, from, &mut r, &mut w, REQUEST_MAX).await?;
    let (proof, request) = split_proof(&line);
    let proven =
        proof.is_some_and(|p| key.verify(CLIENT_PROOF, &x.fields(&[request.as_bytes()]), &p));
    if !proven {
        Counters::bump(&counters.auth_failures);
        tracing::warn!(agent = %inner.name, %from, claimed = %client, "side channel: a client failed authentication (no or another cluster key); refused");
        refuse(&mut w, "authentication failed").await;
        return Err(AgentError::Auth(AuthError::Forged {
            addr: from.to_string(),
            claimed: client.to_string(),
        }));
    }
    Counters::bump(&counters.authenticated);
    if inner.identity.insecure {
        tracing::warn!(agent = %inner.name, %from, peer = %client, "insecure side channel: serving a client whose name is not authenticated");
    }
    let reply = match answer(inner, client, request).await {
        Ok(r) => r,
        Err(e) => {
            if matches!(e, AgentError::SideChannel(_)) {
                Counters::bump(&counters.malformed);
            }
            format!("ERR {e}")
        }
    };
    let proof = key.tag(
        REPLY_PROOF,
        &x.fields(&[request.as_bytes(), reply.as_bytes()]),
    );
    w.write_all(format!("{} {reply}\n", hex::encode(proof)).as_bytes())
        .await
        .map_err(io)?;
    w.shutdown().await.map_err(io)
}

/// The reply to an authenticated `requester`'s request.
async fn answer(inner: &Arc<Inner>, requester: &str, request: &str) -> Result<String, AgentError> {
    match parse_request(request)? {
        Request::Metadata => Ok(hex::encode(
            inner.metadata_for(requester).encode(&inner.identity.key)?,
        )),
        Request::Connect {
            endpoint,
            rail,
            generation,
        } => {
            // On a task of its own: the exchange's timeout must not cut a set-up off between
            // the engine's steps (a queue pair made and never recorded, or recorded without
            // its receiver). One that ends after the client gave up is replaced by its next
            // CONNECT.
            let (inner, requester, endpoint) = (
                Arc::clone(inner),
                requester.to_string(),
                endpoint.to_string(),
            );
            let (mine, keys) = tokio::spawn(async move {
                accept_connection(&inner, &requester, &endpoint, rail, generation).await
            })
            .await
            .map_err(|e| sc(format!("connection set-up task: {e}")))??;
            Ok(format!(
                "{} {}",
                hex::encode(mine.to_bytes()),
                hex::encode(keys.encode())
            ))
        }
        Request::Grants { rail, qpn } => {
            // The requester may ask as soon as our CONNECT reached it, before our set-up has
            // recorded the connection: it is waited for (half the set-up timeout at most).
            let find = || {
                inner
                    .peers
                    .load()
                    .get(requester)
                    .and_then(|p| p.conns.by_local_qpn(rail, qpn))
            };
            let until = Instant::now() + inner.connect_timeout / 2;
            let conn = loop {
                if let Some(c) = find() {
                    break c;
                }
                if Instant::now() >= until {
                    return Err(sc(format!(
                        "no connection of {requester} on rail {rail} is queue pair {qpn}"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            };
            let (inner, requester) = (Arc::clone(inner), requester.to_string());
            let keys = tokio::spawn(async move { inner.grant_conn(&requester, rail, conn).await })
                .await
                .map_err(|e| sc(format!("grant task: {e}")))??;
            Ok(hex::encode(keys.encode()))
        }
    }
}

/// An authenticated peer asked for a connection: make ours, connect it to theirs, start
/// receiving its notifications.
async fn accept_connection(
    inner: &Arc<Inner>,
    requester: &str,
    ep: &str,
    rail: usize,
    generation: u64,
) -> Result<(Endpoint, GrantKeys), AgentError> {
    if rail >= inner.rails.len() {
        return Err(AgentError::SideChannel(format!("no rail {rail} here")));
    }
    let engine = inner.rails.engine(rail).clone();
    let theirs = Endpoint::from_bytes(&decode_hex(ep)?).map_err(sc)?;
    let (conn, mine) = engine.prepare_connection().await?;
    if let Err(e) = engine.complete_connection(conn, theirs).await {
        engine.close_connection(conn).await;
        return Err(e.into());
    }
    // The requester connects only when it has no connection on this rail: one it made to us
    // before is gone on its side.
    let qpns = QpNumbers {
        local: mine.qpn,
        peer: theirs.qpn,
    };
    let made = NewConn {
        conn,
        generation: Some(generation),
        qpns,
        keys: None,
    };
    let old = inner.set_conn(requester, Direction::Inbound, rail, made);
    if rail == 0 {
        inner.spawn_receiver(requester.to_string(), conn);
    }
    if let Some(old) = old {
        inner.close_conn(rail, old).await;
    }
    // The requester's windows, bound before it learns the connection is there.
    match inner.grant_conn(requester, rail, conn).await {
        Ok(keys) => Ok((mine, keys)),
        Err(e) => {
            inner.remove_conn(requester, rail, conn);
            inner.close_conn(rail, conn).await;
            Err(e)
        }
    }
}
