//! The TCP side channel: a peer fetches our metadata (scoped for it) and sets up its connection.
//! Text lines: `MD <requester>` → hex metadata; `CONNECT <requester> <endpoint hex> [rail
//! [generation]]` → our endpoint hex (or `ERR <reason>`); without a rail, rail 0; the
//! requester's generation (its incarnation) tags the connection, so that when its new metadata
//! arrives later only its old incarnation's connections are closed.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::future::block_on;

use super::peers::Direction;
use super::snapshot::lock;
use super::{AgentError, Inner};
use crate::verbs::Endpoint;

const MAX_LINE: usize = 256 << 20;

fn decode_hex(s: &str) -> Result<Vec<u8>, AgentError> {
    hex::decode(s).map_err(|e| AgentError::SideChannel(format!("bad hex: {e}")))
}

fn sc(e: impl std::fmt::Display) -> AgentError {
    AgentError::SideChannel(e.to_string())
}

fn read_line<R: BufRead>(r: &mut R) -> Result<String, AgentError> {
    let mut l = String::new();
    let n = std::io::Read::take(r, MAX_LINE as u64)
        .read_line(&mut l)
        .map_err(sc)?;
    if n == 0 {
        return Err(AgentError::SideChannel(
            "peer closed the side channel".into(),
        ));
    }
    Ok(l.trim_end().to_string())
}

/// A side-channel client stream to `addr`, every step bounded by `deadline`.
fn connect(addr: &str, deadline: Instant) -> Result<TcpStream, AgentError> {
    let io = |source: std::io::Error| AgentError::SideChannelIo {
        addr: addr.to_string(),
        source,
    };
    let left = || -> Result<Duration, AgentError> {
        match deadline.checked_duration_since(Instant::now()) {
            Some(d) if !d.is_zero() => Ok(d),
            _ => Err(io(std::io::ErrorKind::TimedOut.into())),
        }
    };
    let target = addr
        .to_socket_addrs()
        .map_err(io)?
        .next()
        .ok_or_else(|| io(std::io::ErrorKind::AddrNotAvailable.into()))?;
    let s = TcpStream::connect_timeout(&target, left()?).map_err(io)?;
    s.set_read_timeout(Some(left()?)).map_err(io)?;
    s.set_write_timeout(Some(left()?)).map_err(io)?;
    s.set_nodelay(true).ok();
    Ok(s)
}

/// Sends one request line to `addr` and reads the reply line, by `deadline`.
fn exchange(addr: &str, request: &str, deadline: Instant) -> Result<String, AgentError> {
    let s = connect(addr, deadline)?;
    let io = |source: std::io::Error| AgentError::SideChannelIo {
        addr: addr.to_string(),
        source,
    };
    let mut w = s.try_clone().map_err(io)?;
    writeln!(w, "{request}").map_err(io)?;
    let line = read_line(&mut BufReader::new(s))?;
    match line.strip_prefix("ERR ") {
        Some(e) => Err(AgentError::SideChannel(e.to_string())),
        None => Ok(line),
    }
}

pub(super) fn listen(inner: &Arc<Inner>, addr: &str) -> Result<SocketAddr, AgentError> {
    let listener = TcpListener::bind(addr)
        .map_err(|e| AgentError::SideChannel(format!("listen {addr}: {e}")))?;
    let local = listener.local_addr().map_err(sc)?;
    *lock(&inner.address) = local.to_string();
    let weak = Arc::downgrade(inner);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Some(inner) = weak.upgrade() else { return };
            if inner.stopped.load(Ordering::SeqCst) {
                return;
            }
            let Ok(stream) = stream else { continue };
            let inner2 = Arc::clone(&inner);
            std::thread::spawn(move || {
                if let Err(e) = serve(&inner2, stream) {
                    tracing::debug!(error = %e, "side-channel request failed");
                }
            });
        }
    });
    tracing::info!(agent = %inner.name, %local, "side channel listening");
    Ok(local)
}

fn serve(inner: &Arc<Inner>, stream: TcpStream) -> Result<(), AgentError> {
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(sc)?;
    let mut w = stream.try_clone().map_err(sc)?;
    let mut r = BufReader::new(stream);
    let line = read_line(&mut r)?;
    let f: Vec<&str> = line.split(' ').collect();
    let reply = match f.as_slice() {
        ["MD", requester] => hex::encode(inner.metadata_for(requester).encode()?),
        ["CONNECT", requester, ep, rest @ ..] if rest.len() <= 2 => {
            // Optional rail (default 0) and the requester's incarnation (default unknown).
            let rail = rest.first().map_or(Ok(0), |r| r.parse::<usize>());
            let generation = rest.get(1).map(|g| g.parse::<u64>());
            match (rail, generation.transpose()) {
                (Ok(rail), Ok(generation)) => {
                    match accept_connection(inner, requester, ep, rail, generation) {
                        Ok(mine) => hex::encode(mine.to_bytes()),
                        Err(e) => format!("ERR {e}"),
                    }
                }
                _ => "ERR bad rail or generation".into(),
            }
        }
        _ => "ERR unknown request".into(),
    };
    writeln!(w, "{reply}").map_err(sc)
}

/// A peer asked for a connection: make ours, connect it to theirs, start receiving its
/// notifications.
fn accept_connection(
    inner: &Arc<Inner>,
    requester: &str,
    ep: &str,
    rail: usize,
    generation: Option<u64>,
) -> Result<Endpoint, AgentError> {
    if rail >= inner.rails.len() {
        return Err(AgentError::SideChannel(format!("no rail {rail} here")));
    }
    let engine = inner.rails.engine(rail).clone();
    let theirs = Endpoint::from_bytes(&decode_hex(ep)?).map_err(sc)?;
    let (conn, mine) = block_on(engine.prepare_connection())?;
    block_on(engine.complete_connection(conn, theirs))?;
    // The requester connects only when it has no connection on this rail: one it made to us
    // before is gone on its side.
    if let Some(old) = inner.set_conn(requester, Direction::Inbound, rail, conn, generation) {
        block_on(engine.close_connection(old));
    }
    if rail == 0 {
        inner.spawn_receiver(requester.to_string(), conn);
    }
    Ok(mine)
}

/// The metadata `addr`'s agent grants `me`, fetched by `deadline`.
pub(super) fn fetch_metadata(
    me: &str,
    addr: &str,
    deadline: Instant,
) -> Result<Vec<u8>, AgentError> {
    decode_hex(&exchange(addr, &format!("MD {me}"), deadline)?)
}

/// Asks `addr`'s agent for a connection on `rail` to our endpoint `mine`; returns its endpoint.
pub(super) fn request_connection(
    me: &Inner,
    addr: &str,
    rail: usize,
    mine: &Endpoint,
    deadline: Instant,
) -> Result<Endpoint, AgentError> {
    let request = format!(
        "CONNECT {} {} {rail} {}",
        me.name,
        hex::encode(mine.to_bytes()),
        me.generation
    );
    let line = exchange(addr, &request, deadline)?;
    Endpoint::from_bytes(&decode_hex(&line)?).map_err(sc)
}
