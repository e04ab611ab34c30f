//! The TCP side channel: a peer fetches our metadata (scoped for it) and sets up its connection.
//! Text lines: `MD <requester>` → hex metadata; `CONNECT <requester> <endpoint hex> [rail]` →
//! our endpoint hex (or `ERR <reason>`); without a rail, rail 0.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_lite::future::block_on;

use super::snapshot::lock;
use super::{AgentError, Inner};
use crate::runtime::ConnId;
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

fn connect(addr: &str) -> Result<TcpStream, AgentError> {
    let s = TcpStream::connect(addr)
        .map_err(|e| AgentError::SideChannel(format!("connect {addr}: {e}")))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(sc)?;
    s.set_nodelay(true).ok();
    Ok(s)
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
        ["CONNECT", requester, ep] => match accept_connection(inner, requester, ep, 0) {
            Ok(mine) => hex::encode(mine.to_bytes()),
            Err(e) => format!("ERR {e}"),
        },
        ["CONNECT", requester, ep, rail] => match rail
            .parse::<usize>()
            .map_err(|_| AgentError::SideChannel("bad rail".into()))
            .and_then(|rail| accept_connection(inner, requester, ep, rail))
        {
            Ok(mine) => hex::encode(mine.to_bytes()),
            Err(e) => format!("ERR {e}"),
        },
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
) -> Result<Endpoint, AgentError> {
    if rail >= inner.rails.len() {
        return Err(AgentError::SideChannel(format!("no rail {rail} here")));
    }
    let engine = inner.rails.engine(rail).clone();
    let theirs = Endpoint::from_bytes(&decode_hex(ep)?).map_err(sc)?;
    let (conn, mine) = block_on(engine.prepare_connection())?;
    block_on(engine.complete_connection(conn, theirs))?;
    if let Some(old) = inner.set_conn(requester, rail, conn) {
        block_on(engine.close_connection(old));
    }
    if rail == 0 {
        inner.spawn_receiver(requester.to_string(), conn);
    }
    Ok(mine)
}

pub(super) fn fetch_metadata(me: &str, addr: &str) -> Result<Vec<u8>, AgentError> {
    let s = connect(addr)?;
    let mut w = s.try_clone().map_err(sc)?;
    writeln!(w, "MD {me}").map_err(sc)?;
    let line = read_line(&mut BufReader::new(s))?;
    if let Some(e) = line.strip_prefix("ERR ") {
        return Err(AgentError::SideChannel(e.to_string()));
    }
    decode_hex(&line)
}

/// The connection to `peer` on rail 0 (see [`ensure_rail`]).
pub(super) async fn ensure_connection(
    inner: &Arc<Inner>,
    peer: &str,
) -> Result<ConnId, AgentError> {
    ensure_rail(inner, peer, 0).await
}

/// The connection to `peer` on `rail`, made on first use through its side channel (the engine
/// calls are awaited; only the short side-channel exchange is blocking I/O). Rail 0 also
/// delivers the peer's notifications.
pub(super) async fn ensure_rail(
    inner: &Arc<Inner>,
    peer: &str,
    rail: usize,
) -> Result<ConnId, AgentError> {
    let addr = {
        let peers = inner.peers.load();
        let p = peers
            .get(peer)
            .ok_or_else(|| AgentError::UnknownPeer(peer.to_string()))?;
        if let Some(c) = p.conn(rail) {
            return Ok(c);
        }
        p.metadata
            .as_ref()
            .map(|m| m.address.clone())
            .filter(|a| !a.is_empty())
            .ok_or_else(|| {
                AgentError::SideChannel(format!("peer {peer} has no side-channel address"))
            })?
    };
    let engine = inner.rails.engine(rail).clone();
    let (conn, mine) = engine.prepare_connection().await?;
    let s = connect(&addr)?;
    let mut w = s.try_clone().map_err(sc)?;
    writeln!(
        w,
        "CONNECT {} {} {rail}",
        inner.name,
        hex::encode(mine.to_bytes())
    )
    .map_err(sc)?;
    let line = read_line(&mut BufReader::new(s))?;
    if let Some(e) = line.strip_prefix("ERR ") {
        engine.close_connection(conn).await;
        return Err(AgentError::SideChannel(format!(
            "{peer} refused the connection (rail {rail}): {e}"
        )));
    }
    let theirs = Endpoint::from_bytes(&decode_hex(&line)?).map_err(sc)?;
    engine.complete_connection(conn, theirs).await?;
    inner.set_conn(peer, rail, conn);
    if rail == 0 {
        inner.spawn_receiver(peer.to_string(), conn);
    }
    tracing::debug!(agent = %inner.name, %peer, rail, "connected lazily");
    Ok(conn)
}
