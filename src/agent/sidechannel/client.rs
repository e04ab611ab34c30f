//! The side channel's client: one authenticated exchange per TCP connection (blocking, on a
//! control thread), for metadata, a connection or grant keys.

use super::*;

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
pub(in crate::agent) fn fetch_metadata(
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
pub(in crate::agent) struct Accepted {
    pub endpoint: Endpoint,
    pub keys: Option<GrantKeys>,
}

/// The longest reply carrying grant keys `me` accepts (proof, endpoint, keys; hex).
fn keys_reply_limit(me: &Inner) -> usize {
    2 * TAG_LEN + 1 + HELLO_MAX + 2 * me.limits.message
}

/// Asks `peer`'s agent at `addr` for a connection on `rail` to our endpoint `mine`; returns its
/// endpoint and our grant keys on it.
pub(in crate::agent) fn request_connection(
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
pub(in crate::agent) fn request_grants(
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

/// Delivers notification `msg` to `peer`'s agent at `addr` on the side channel (an agent
/// without a NIC, or a peer without one); returns once it is in the peer's stream.
pub(in crate::agent) fn send_notification(
    me: &Inner,
    peer: &str,
    addr: &str,
    msg: &[u8],
    deadline: Instant,
) -> Result<(), AgentError> {
    let line = exchange(
        me,
        addr,
        Some(peer),
        &format!("NOTIFY {}", hex::encode(msg)),
        HELLO_MAX,
        deadline,
    )?;
    if line == "OK" {
        Ok(())
    } else {
        Err(sc(format!("unexpected notification reply {line:?}")))
    }
}
