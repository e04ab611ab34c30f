//! A central metadata store on a real etcd server (v3 JSON gateway over HTTP/1.1, no gRPC stack).
//! Agents publish their metadata under `<namespace>/<name>` with a short lease that they keep
//! renewing, so an agent that dies disappears; watchers load new or changed metadata and forget
//! agents whose key was deleted. Everything runs on its own threads, off the data-path cores.
//!
//! Only regions visible to all agents are published: scoped regions are served per requester by
//! the side channel only.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};

use super::{AgentError, Inner};

/// Base64 (standard alphabet, padded), as etcd's JSON gateway carries keys and values.
pub fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// Base64 decoding.
///
/// # Errors
/// [`base64::DecodeError`] for invalid input.
pub fn unb64(s: &str) -> Result<Vec<u8>, base64::DecodeError> {
    base64::engine::general_purpose::STANDARD.decode(s)
}

fn err(e: impl std::fmt::Display) -> AgentError {
    AgentError::SideChannel(format!("etcd: {e}"))
}

/// A POST to the gateway; returns the JSON body (the first JSON value for streaming endpoints).
fn post(endpoint: &str, path: &str, body: &Value) -> Result<Value, AgentError> {
    let mut s = TcpStream::connect(endpoint).map_err(err)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(err)?;
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(err)?;
    let mut r = BufReader::new(s);
    let chunked = read_headers(&mut r)?;
    let mut stream = BodyStream {
        r,
        chunked,
        buf: Vec::new(),
    };
    stream.next_value()?.ok_or_else(|| err("empty response"))
}

/// Reads the status line and headers; returns whether the body is chunked.
fn read_headers<R: BufRead>(r: &mut R) -> Result<bool, AgentError> {
    let mut line = String::new();
    r.read_line(&mut line).map_err(err)?;
    if !line.starts_with("HTTP/1.1 200") {
        return Err(err(format!("gateway answered {}", line.trim())));
    }
    let mut chunked = false;
    loop {
        line.clear();
        r.read_line(&mut line).map_err(err)?;
        let l = line.trim();
        if l.is_empty() {
            return Ok(chunked);
        }
        if l.to_ascii_lowercase().starts_with("transfer-encoding:")
            && l.to_ascii_lowercase().contains("chunked")
        {
            chunked = true;
        }
    }
}

/// Yields the JSON values of a (possibly chunked, possibly streaming) body.
struct BodyStream<R: BufRead> {
    r: R,
    chunked: bool,
    buf: Vec<u8>,
}

impl<R: BufRead> BodyStream<R> {
    fn fill(&mut self) -> Result<bool, AgentError> {
        if self.chunked {
            let mut size = String::new();
            if self.r.read_line(&mut size).map_err(err)? == 0 {
                return Ok(false);
            }
            let n = usize::from_str_radix(size.trim(), 16).map_err(err)?;
            if n == 0 {
                return Ok(false);
            }
            let at = self.buf.len();
            self.buf.resize(at + n, 0);
            self.r.read_exact(&mut self.buf[at..]).map_err(err)?;
            let mut crlf = [0u8; 2];
            self.r.read_exact(&mut crlf).map_err(err)?;
            Ok(true)
        } else {
            let mut tmp = [0u8; 8192];
            let n = self.r.read(&mut tmp).map_err(err)?;
            self.buf.extend_from_slice(&tmp[..n]);
            Ok(n > 0)
        }
    }

    fn next_value(&mut self) -> Result<Option<Value>, AgentError> {
        loop {
            let mut it = serde_json::Deserializer::from_slice(&self.buf).into_iter::<Value>();
            match it.next() {
                Some(Ok(v)) => {
                    let used = it.byte_offset();
                    self.buf.drain(..used);
                    return Ok(Some(v));
                }
                Some(Err(e)) if !e.is_eof() => return Err(err(e)),
                _ => {}
            }
            if !self.fill()? {
                return Ok(None);
            }
        }
    }
}

fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// Publishes `inner`'s metadata under `<namespace>/<name>` and keeps it alive; watches the
/// namespace and loads or forgets peers. Returns once the initial state is loaded.
pub(super) fn join(
    inner: &Arc<Inner>,
    agent: super::Agent,
    endpoint: &str,
    namespace: &str,
    ttl: Duration,
) -> Result<(), AgentError> {
    let key = format!("{namespace}/{}", inner.name);
    let publish = {
        let (endpoint, key) = (endpoint.to_string(), key.clone());
        let inner = Arc::clone(inner);
        move || -> Result<(), AgentError> {
            // A fresh lease each time; the previous one lapses, so a dead agent's key expires.
            let lease = post(
                &endpoint,
                "/v3/lease/grant",
                &json!({"TTL": ttl.as_secs().max(2)}),
            )?;
            let id = lease["ID"]
                .as_str()
                .ok_or_else(|| err("no lease id"))?
                .to_string();
            let md = inner.metadata_for("*").encode()?;
            post(
                &endpoint,
                "/v3/kv/put",
                &json!({"key": b64(key.as_bytes()), "value": b64(&md), "lease": id}),
            )?;
            Ok(())
        }
    };
    publish()?;
    // Initial state.
    let pfx = format!("{namespace}/");
    let range = post(
        endpoint,
        "/v3/kv/range",
        &json!({"key": b64(pfx.as_bytes()), "range_end": b64(&prefix_end(pfx.as_bytes()))}),
    )?;
    let rev: u64 = range["header"]["revision"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    for kv in range["kvs"].as_array().into_iter().flatten() {
        apply(&agent, &key, kv, false);
    }
    // Keep-alive.
    let inner_k = Arc::clone(inner);
    std::thread::spawn(move || {
        while !inner_k.stopped.load(Ordering::SeqCst) {
            std::thread::sleep(ttl / 3);
            if inner_k.stopped.load(Ordering::SeqCst) {
                return;
            }
            if let Err(e) = publish() {
                tracing::warn!(error = %e, "etcd: republishing metadata failed");
            }
        }
    });
    // Watch.
    let (endpoint, pfx_key) = (endpoint.to_string(), pfx);
    let inner_w = Arc::clone(inner);
    std::thread::spawn(move || {
        while !inner_w.stopped.load(Ordering::SeqCst) {
            if let Err(e) = watch(&agent, &endpoint, &pfx_key, &key, rev + 1) {
                tracing::warn!(error = %e, "etcd watch ended; restarting");
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    });
    Ok(())
}

fn watch(
    agent: &super::Agent,
    endpoint: &str,
    pfx: &str,
    own: &str,
    rev: u64,
) -> Result<(), AgentError> {
    let mut s = TcpStream::connect(endpoint).map_err(err)?;
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .map_err(err)?;
    let body = json!({"create_request": {"key": b64(pfx.as_bytes()), "range_end": b64(&prefix_end(pfx.as_bytes())), "start_revision": rev.to_string()}}).to_string();
    write!(s, "POST /v3/watch HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).map_err(err)?;
    let mut r = BufReader::new(s);
    let chunked = loop {
        match read_headers(&mut r) {
            Ok(c) => break c,
            Err(AgentError::SideChannel(m))
                if m.contains("timed out")
                    || m.contains("WouldBlock")
                    || m.contains("temporarily") =>
            {
                continue
            }
            Err(e) => return Err(e),
        }
    };
    let mut stream = BodyStream {
        r,
        chunked,
        buf: Vec::new(),
    };
    loop {
        if agent.inner.stopped.load(Ordering::SeqCst) {
            return Ok(());
        }
        match stream.next_value() {
            Ok(Some(v)) => {
                for ev in v["result"]["events"].as_array().into_iter().flatten() {
                    let delete = ev["type"].as_str() == Some("DELETE");
                    apply(agent, own, &ev["kv"], delete);
                }
            }
            Ok(None) => return Err(err("watch stream closed")),
            Err(AgentError::SideChannel(m))
                if m.contains("timed out")
                    || m.contains("Resource temporarily")
                    || m.contains("would block") => {}
            Err(e) => return Err(e),
        }
    }
}

fn apply(agent: &super::Agent, own: &str, kv: &Value, delete: bool) {
    let Some(key) = kv["key"]
        .as_str()
        .and_then(|k| unb64(k).ok())
        .and_then(|k| String::from_utf8(k).ok())
    else {
        return;
    };
    if key == own {
        return;
    }
    let peer = key.rsplit('/').next().unwrap_or_default().to_string();
    if delete {
        tracing::info!(agent = %agent.inner.name, %peer, "etcd: peer left; invalidating");
        let known = agent.inner.knows(&peer);
        if known {
            futures_lite::future::block_on(agent.invalidate_remote(&peer));
        }
        return;
    }
    match kv["value"].as_str().map(unb64) {
        Some(Ok(blob)) => match agent.load_remote_metadata(&blob) {
            Ok(name) => {
                tracing::debug!(agent = %agent.inner.name, peer = %name, "etcd: loaded metadata")
            }
            Err(e) => tracing::warn!(%peer, error = %e, "etcd: rejected metadata"),
        },
        _ => tracing::warn!(%peer, "etcd: value is not base64"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for data in [
            &b""[..],
            b"f",
            b"fo",
            b"foo",
            b"foob",
            b"fooba",
            b"foobar",
            &[0, 255, 128, 7],
        ] {
            assert_eq!(unb64(&b64(data)).expect("decode"), data);
        }
        assert_eq!(b64(b"foobar"), "Zm9vYmFy");
        assert_eq!(b64(b"fo"), "Zm8=");
        assert!(unb64("Zm9v!").is_err());
    }
}
