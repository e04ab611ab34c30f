//! The side channel's server: a task per connection on the agent's control thread, bounded
//! slots, and the answers to authenticated requests.

use super::*;

/// Listens on `addr`; serves on a control thread of its own.
pub(in crate::agent) fn listen(inner: &Arc<Inner>, addr: &str) -> Result<SocketAddr, AgentError> {
    let io = |source: std::io::Error| AgentError::SideChannelIo {
        addr: addr.to_string(),
        source,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(AgentError::ControlThread)?;
    let listener = {
        // The listener belongs to the runtime that serves it.
        let _in = runtime.enter();
        bind(addr).map_err(io)?
    };
    let local = listener.local_addr().map_err(io)?;
    *lock(&inner.address) = local.to_string();
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

/// The side channel's accept queue in the kernel (capped by `net.core.somaxconn`): room for a
/// burst of peers connecting at once, such as a cluster's agents joining together, while every
/// serving slot is busy. With the 128 that `std`'s listeners get, a burst past the slots and
/// the queue had its connection attempts dropped and retried a second later: in the flood
/// test, 3,279 dropped attempts and 41 s for 10,000 bogus connections.
const ACCEPT_BACKLOG: u32 = 4096;

/// A listener on the first of `addr`'s addresses that binds (as `std`'s `bind`, with address
/// reuse), with [`ACCEPT_BACKLOG`]. Called inside the serving runtime.
fn bind(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in std::net::ToSocketAddrs::to_socket_addrs(addr)? {
        let listen = || {
            let socket = if a.is_ipv4() {
                tokio::net::TcpSocket::new_v4()?
            } else {
                tokio::net::TcpSocket::new_v6()?
            };
            socket.set_reuseaddr(true)?;
            socket.bind(a)?;
            socket.listen(ACCEPT_BACKLOG)
        };
        match listen() {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address to listen on")
    }))
}

async fn accept_loop(weak: Weak<Inner>, listener: tokio::net::TcpListener) {
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
        Request::Notify(msg) => {
            inner.deliver(requester, msg).await?;
            Ok("OK".into())
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
