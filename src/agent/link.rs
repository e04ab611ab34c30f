//! Connection lifecycle: one set-up per peer and rail at a time, shared by every transfer that
//! needs it; set-ups bounded by the caller's deadline and by `connect_timeout`; failed
//! connections retired and replaced on the next transfer, with backoff between failed set-ups.
//!
//! The transfer path reads the peer snapshot only (no lock). This module's mutex is taken when
//! a peer has no connection on a rail: the first caller starts a set-up on a control thread (the
//! side-channel exchange is blocking TCP, off every engine core and off the caller's
//! executor), later callers wait for the same outcome. A set-up that fails closes what it
//! prepared (no queue pair is left behind) and starts a backoff: the next set-up of that peer
//! and rail waits `backoff` (doubling from [`BACKOFF_MIN`] to [`BACKOFF_MAX`]); a caller whose
//! deadline ends first gets [`AgentError::Unreachable`] at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_channel::oneshot;

use super::conns::{Direction, NewConn, QpNumbers};
use super::grants::GrantKeys;
use super::snapshot::lock;
use super::{sidechannel, AgentError, Inner};
use crate::runtime::ConnId;

/// The first backoff after a failed set-up.
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// The longest backoff.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// A connection a set-up made.
struct Made {
    conn: ConnId,
    qpns: QpNumbers,
    /// Our grant keys on it, from the peer's reply.
    keys: Option<GrantKeys>,
}

/// What a set-up ended with, handed to every caller that waited for it.
type Outcome = Result<ConnId, Arc<AgentError>>;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct LinkKey {
    peer: String,
    rail: usize,
}

#[derive(Debug)]
struct Backoff {
    retry_at: Instant,
    delay: Duration,
    error: Arc<AgentError>,
}

#[derive(Debug, Default)]
struct LinkState {
    /// Callers waiting for the set-up in progress (`None`: none in progress).
    connecting: Option<Vec<oneshot::Sender<Outcome>>>,
    /// Set after a failed set-up; cleared by a successful one.
    backoff: Option<Backoff>,
    /// A connection to the peer failed: the next set-up fetches its metadata again first (it may
    /// have restarted with new regions and keys).
    refetch: bool,
}

/// Connection lifecycle counters of an agent (all rails).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LinkCounters {
    /// Set-ups started.
    pub setups: u64,
    /// Set-ups that failed (each closed what it had prepared).
    pub setup_failures: u64,
    /// Callers that waited for a set-up another caller started.
    pub shared: u64,
    /// Connections retired after they failed (closed, replaced on the next transfer).
    pub retired: u64,
    /// Callers refused because the backoff outlasted their deadline.
    pub refused: u64,
}

/// The agent's connection lifecycle state.
#[derive(Debug, Default)]
pub(crate) struct Links {
    states: Mutex<HashMap<LinkKey, LinkState>>,
    setups: AtomicU64,
    setup_failures: AtomicU64,
    shared: AtomicU64,
    retired: AtomicU64,
    refused: AtomicU64,
}

impl Links {
    pub fn counters(&self) -> LinkCounters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LinkCounters {
            setups: get(&self.setups),
            setup_failures: get(&self.setup_failures),
            shared: get(&self.shared),
            retired: get(&self.retired),
            refused: get(&self.refused),
        }
    }

    /// Forgets every state of `peer` (it was invalidated); set-ups in progress still end and
    /// wake their callers.
    pub fn forget(&self, peer: &str) {
        lock(&self.states).retain(|k, s| k.peer != peer || s.connecting.is_some());
    }
}

/// What a caller does next, decided under the lock.
enum Step {
    Wait(oneshot::Receiver<Outcome>),
    Sleep(Duration),
}

/// The connection to `peer` on `rail`: the one made, or one set up now (shared with every
/// concurrent caller), waited for until `deadline` at most.
///
/// # Errors
/// [`AgentError::UnknownPeer`]; [`AgentError::ConnectTimeout`] past `deadline`;
/// [`AgentError::ConnectFailed`] with the set-up's error; [`AgentError::Unreachable`] while a
/// failed set-up's backoff outlasts `deadline`.
pub(crate) async fn ensure(
    inner: &Arc<Inner>,
    peer: &str,
    rail: usize,
    deadline: Option<Instant>,
) -> Result<ConnId, AgentError> {
    // The common case, a live connection: no clock read, no allocation.
    if let Some(c) = current(inner, peer, rail)? {
        return Ok(c);
    }
    let key = LinkKey {
        peer: peer.to_string(),
        rail,
    };
    let started = Instant::now();
    loop {
        let step = {
            let mut states = lock(&inner.links.states);
            // A set-up may have ended since the check above or the last wait: look again under
            // the lock.
            if let Some(c) = current(inner, peer, rail)? {
                return Ok(c);
            }
            let st = states.entry(key.clone()).or_default();
            let now = Instant::now();
            match (&mut st.connecting, &st.backoff) {
                (Some(waiters), _) => {
                    let (tx, rx) = oneshot::channel();
                    waiters.push(tx);
                    inner.links.shared.fetch_add(1, Ordering::Relaxed);
                    Step::Wait(rx)
                }
                (None, Some(b)) if b.retry_at > now => {
                    if deadline.is_some_and(|d| b.retry_at >= d) {
                        inner.links.refused.fetch_add(1, Ordering::Relaxed);
                        return Err(AgentError::Unreachable {
                            peer: peer.to_string(),
                            rail,
                            retry_in: b.retry_at - now,
                            source: Arc::clone(&b.error),
                        });
                    }
                    Step::Sleep(b.retry_at - now)
                }
                (None, _) => {
                    let (tx, rx) = oneshot::channel();
                    st.connecting = Some(vec![tx]);
                    let refetch = std::mem::take(&mut st.refetch);
                    inner.links.setups.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = spawn_setup(inner, key.clone(), refetch) {
                        // No set-up runs: nobody else waits yet (this caller made the entry).
                        st.connecting = None;
                        st.refetch |= refetch;
                        return Err(AgentError::ControlThread(e));
                    }
                    Step::Wait(rx)
                }
            }
        };
        match step {
            Step::Sleep(d) => futures_timer::Delay::new(d).await,
            Step::Wait(rx) => {
                let outcome = match deadline {
                    None => rx.await,
                    Some(d) => {
                        let timer = async {
                            futures_timer::Delay::new(d.saturating_duration_since(Instant::now()))
                                .await;
                            None
                        };
                        match futures_lite::future::or(async { Some(rx.await) }, timer).await {
                            Some(r) => r,
                            None => {
                                return Err(AgentError::ConnectTimeout {
                                    peer: peer.to_string(),
                                    rail,
                                    after: started.elapsed(),
                                })
                            }
                        }
                    }
                };
                return match outcome {
                    Ok(Ok(c)) => Ok(c),
                    Ok(Err(source)) => Err(AgentError::ConnectFailed {
                        peer: peer.to_string(),
                        rail,
                        source,
                    }),
                    // The set-up thread ended without an answer (the agent shut down).
                    Err(_) => Err(AgentError::ConnectFailed {
                        peer: peer.to_string(),
                        rail,
                        source: Arc::new(AgentError::Stopped),
                    }),
                };
            }
        }
    }
}

/// The peer's connection on `rail` in the current snapshot (`Err` if the peer is unknown).
fn current(inner: &Inner, peer: &str, rail: usize) -> Result<Option<ConnId>, AgentError> {
    let peers = inner.peers.load();
    let p = peers
        .get(peer)
        .ok_or_else(|| AgentError::unknown_peer(peer))?;
    Ok(p.conn(rail))
}

/// Runs one set-up on a control thread and hands its outcome to every waiter.
///
/// # Errors
/// The thread could not be started.
fn spawn_setup(inner: &Arc<Inner>, key: LinkKey, refetch: bool) -> std::io::Result<()> {
    let inner = Arc::clone(inner);
    let spawned = std::thread::Builder::new()
        .name(format!("rixl-connect-{}", key.rail))
        .spawn(move || {
            let t0 = Instant::now();
            let deadline = t0 + inner.connect_timeout;
            let r = futures_lite::future::block_on(setup(&inner, &key, refetch, deadline));
            tracing::debug!(peer = %key.peer, rail = key.rail, refetch, ok = r.is_ok(), took = ?t0.elapsed(), "set-up ended");
            finish(&inner, &key, r);
        });
    spawned.map(drop)
}

/// Records a set-up's outcome (the connection is published before any waiter wakes).
fn finish(inner: &Arc<Inner>, key: &LinkKey, r: Result<Made, AgentError>) {
    let mut replaced = None;
    let mut states = lock(&inner.links.states);
    let st = states.entry(key.clone()).or_default();
    let waiters = st.connecting.take().unwrap_or_default();
    let outcome: Outcome = match r {
        Ok(Made { conn, qpns, keys }) => {
            st.backoff = None;
            let made = NewConn {
                conn,
                generation: None,
                qpns,
                keys,
            };
            if let Some(old) = inner.set_conn(&key.peer, Direction::Outbound, key.rail, made) {
                // Set-ups of one peer and rail never overlap, and one starts only when no
                // connection is left: a replaced one is a bug, closed rather than leaked.
                tracing::warn!(peer = %key.peer, rail = key.rail, old = old.0, "replaced an outbound connection");
                replaced = Some(old);
            }
            if key.rail == 0 {
                inner.spawn_receiver(key.peer.clone(), conn);
            }
            tracing::debug!(agent = %inner.name, peer = %key.peer, rail = key.rail, conn = conn.0, "connected");
            Ok(conn)
        }
        Err(e) => {
            inner.links.setup_failures.fetch_add(1, Ordering::Relaxed);
            let delay = st
                .backoff
                .as_ref()
                .map_or(BACKOFF_MIN, |b| (b.delay * 2).min(BACKOFF_MAX));
            tracing::warn!(agent = %inner.name, peer = %key.peer, rail = key.rail, error = %e, backoff = ?delay, "connection set-up failed");
            let error = Arc::new(e);
            st.backoff = Some(Backoff {
                retry_at: Instant::now() + delay,
                delay,
                error: Arc::clone(&error),
            });
            // The next set-up fetches the metadata again: the failure may be a restart.
            st.refetch = true;
            Err(error)
        }
    };
    drop(states);
    for w in waiters {
        let _ = w.send(outcome.clone());
    }
    if let Some(old) = replaced {
        futures_lite::future::block_on(inner.close_conn(key.rail, old));
    }
}

/// One set-up: (metadata again, if asked), a prepared queue pair, the side-channel exchange,
/// the transition to RTS. Whatever fails after the queue pair was prepared closes it.
async fn setup(
    inner: &Arc<Inner>,
    key: &LinkKey,
    refetch: bool,
    deadline: Instant,
) -> Result<Made, AgentError> {
    if inner.stopped.load(Ordering::SeqCst) {
        return Err(AgentError::Stopped);
    }
    let addr = |inner: &Inner| -> Result<String, AgentError> {
        let peers = inner.peers.load();
        let p = peers
            .get(&key.peer)
            .ok_or_else(|| AgentError::NoSideChannel(key.peer.clone()))?;
        p.side_channel(&key.peer)
    };
    if refetch {
        let blob = sidechannel::fetch_metadata(inner, &addr(inner)?, Some(&key.peer), deadline)?;
        inner.load_metadata_as(&blob, Some(&key.peer))?;
    }
    let addr = addr(inner)?;
    let engine = inner.rails.engine(key.rail).clone();
    let (conn, mine) = engine.prepare_connection().await?;
    let connected = async {
        let theirs =
            sidechannel::request_connection(inner, &key.peer, &addr, key.rail, &mine, deadline)?;
        engine.complete_connection(conn, theirs.endpoint).await?;
        Ok::<_, AgentError>(Made {
            conn,
            qpns: QpNumbers {
                local: mine.qpn,
                peer: theirs.endpoint.qpn,
            },
            keys: theirs.keys,
        })
    }
    .await;
    if connected.is_err() {
        engine.close_connection(conn).await;
    }
    connected
}

impl Inner {
    /// The deadline of a call started at `t0` with `opts`.
    pub(crate) fn deadline(&self, opts: &super::CallOptions, t0: Instant) -> Instant {
        t0 + opts.timeout.unwrap_or(self.transfer_timeout)
    }

    /// The connection lifecycle's counters.
    pub(crate) fn link_counters(&self) -> LinkCounters {
        self.links.counters()
    }

    /// Checks the connections a failed transfer used: each one the engine reports failed is
    /// removed from the peer (the next transfer sets up a new one, after fetching the peer's
    /// metadata again) and closed. One whose engine cannot tell (it is gone, or its core has
    /// stalled) is left as it is: closing it would only queue more work on that core.
    pub(crate) async fn retire_failed(&self, peer: &str, used: &[(usize, ConnId)]) {
        for &(rail, conn) in used {
            let engine = self.rails.engine(rail);
            match engine.connection_usable(conn).await {
                Ok(false) => {}
                Ok(true) => continue,
                Err(e) => {
                    tracing::warn!(agent = %self.name, %peer, rail, conn = conn.0, error = %e, "a failed transfer's connection was not checked");
                    continue;
                }
            }
            if !self.remove_conn(peer, rail, conn) {
                // Already retired by a concurrent transfer (or replaced).
                continue;
            }
            lock(&self.links.states)
                .entry(LinkKey {
                    peer: peer.to_string(),
                    rail,
                })
                .or_default()
                .refetch = true;
            self.links.retired.fetch_add(1, Ordering::Relaxed);
            tracing::info!(agent = %self.name, %peer, rail, conn = conn.0, "connection failed; retired, to be replaced on the next transfer");
            self.close_conn(rail, conn).await;
        }
    }
}
