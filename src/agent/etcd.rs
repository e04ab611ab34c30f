//! Membership through etcd, with the `etcd-client` gRPC client on a control thread of its own
//! (a current-thread tokio runtime: never on an engine core, never on the caller's executor).
//!
//! An agent that joins:
//! - grants a lease of `ttl` and keeps it alive (keep-alive every ttl/3); its key
//!   `<namespace>/<name>` holds its metadata (regions visible to all) on that lease, PUT again
//!   only when the metadata changes (a registration made or released);
//! - lists the namespace once (loading every peer), then watches it from the list's revision + 1:
//!   a PUT loads that peer's metadata (new or changed), a DELETE is a departure;
//! - after a compaction or a cancelled watch, lists again and reconciles;
//! - on shutdown revokes its lease (its key goes with it).
//!
//! **Outage policy.** etcd is the membership service, not the data path. While etcd is away
//! nothing is invalidated and no connection is touched; the control thread retries with backoff,
//! and when etcd is back it grants a new lease, PUTs again, lists and reconciles. A DELETE (or a
//! peer missing from a list) does not tear a peer down on its own either: the key may have
//! lapsed because the *peer* lost etcd. The departed peer's side channel is asked for its
//! metadata (one second at most): if it answers with the generation already loaded it is kept,
//! otherwise it is invalidated (its connections closed; transfers to it end typed).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use futures_lite::StreamExt;

use super::snapshot::lock;
use super::{sidechannel, Agent, AgentError, Inner};

/// How long the first join may take (members are tried in turn until then).
const JOIN_TIMEOUT: Duration = Duration::from_secs(15);
/// The longest wait between two reconnection attempts while etcd is away.
const RETRY_MAX: Duration = Duration::from_secs(2);
/// How long a departed peer's side channel gets to prove it is alive.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// What the membership thread has seen (for tests and operators).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MembershipCounters {
    /// Sessions with etcd (the first join, then one per reconnection).
    pub sessions: u64,
    /// Sessions (or attempts at one) that ended because a member was unreachable or failed;
    /// each try of a dead member counts.
    pub outages: u64,
    /// Metadata PUTs (the first of each session, then one per change).
    pub puts: u64,
    /// Peers' metadata loaded from PUT events or lists.
    pub loads: u64,
    /// Departures (DELETEs, or peers missing from a list) whose peer was invalidated.
    pub departures: u64,
    /// Departures whose peer still answered on its side channel, and was kept.
    pub kept: u64,
    /// Lists after a compaction or a cancelled watch.
    pub relists: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    sessions: AtomicU64,
    outages: AtomicU64,
    puts: AtomicU64,
    loads: AtomicU64,
    departures: AtomicU64,
    kept: AtomicU64,
    relists: AtomicU64,
}

impl Counters {
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> MembershipCounters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MembershipCounters {
            sessions: g(&self.sessions),
            outages: g(&self.outages),
            puts: g(&self.puts),
            loads: g(&self.loads),
            departures: g(&self.departures),
            kept: g(&self.kept),
            relists: g(&self.relists),
        }
    }
}

/// The running membership: how to stop it.
#[derive(Debug)]
pub(crate) struct Membership {
    stop: tokio::sync::watch::Sender<bool>,
    done: std_mpsc::Receiver<()>,
}

impl Membership {
    /// Revokes the lease and stops the thread (waits up to two seconds for the revoke).
    pub fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.done.recv_timeout(Duration::from_secs(2));
    }
}

struct Session<'a> {
    agent: &'a Agent,
    client: Client,
    key: String,
    prefix: String,
    ttl: Duration,
    /// Peers learned through etcd (the ones a list reconciles).
    known: &'a Mutex<HashSet<String>>,
}

/// Why a session ended.
enum End {
    Stopped,
    Failed(etcd_client::Error),
}

impl From<etcd_client::Error> for End {
    fn from(e: etcd_client::Error) -> Self {
        End::Failed(e)
    }
}

pub(super) fn join(
    inner: &Arc<Inner>,
    agent: Agent,
    endpoints: &str,
    namespace: &str,
    ttl: Duration,
) -> Result<(), AgentError> {
    let endpoints: Vec<String> = endpoints
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(String::from)
        .collect();
    if endpoints.is_empty() {
        return Err(AgentError::InvalidEtcdEndpoints);
    }
    let key = format!("{namespace}/{}", inner.name);
    let prefix = format!("{namespace}/");
    let ttl = ttl.max(Duration::from_secs(2));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (first_tx, first_rx) = std_mpsc::channel::<Result<(), etcd_client::Error>>();
    let (done_tx, done_rx) = std_mpsc::channel();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(AgentError::ControlThread)?;
    std::thread::Builder::new()
        .name(format!("rixl-etcd-{}", inner.name))
        .spawn(move || {
            runtime.block_on(run(agent, endpoints, key, prefix, ttl, stop_rx, first_tx));
            let _ = done_tx.send(());
        })
        .map_err(AgentError::ControlThread)?;
    // The last attempt may start just before JOIN_TIMEOUT: give it its request timeout too.
    match first_rx.recv_timeout(JOIN_TIMEOUT + Duration::from_secs(8)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            let _ = stop_tx.send(true);
            return Err(AgentError::Etcd(e));
        }
        Err(_) => {
            let _ = stop_tx.send(true);
            return Err(AgentError::EtcdTimeout(
                JOIN_TIMEOUT + Duration::from_secs(8),
            ));
        }
    }
    let old = lock(&inner.membership).replace(Membership {
        stop: stop_tx,
        done: done_rx,
    });
    if let Some(old) = old {
        old.stop();
    }
    Ok(())
}

/// The control thread: sessions with etcd until stopped, retrying while it is away.
async fn run(
    agent: Agent,
    endpoints: Vec<String>,
    key: String,
    prefix: String,
    ttl: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
    first: std_mpsc::Sender<Result<(), etcd_client::Error>>,
) {
    let known = Mutex::new(HashSet::new());
    let mut first = Some(first);
    let mut retry = Duration::from_millis(100);
    let counters = &agent.inner.membership_counters;
    // One member at a time, moving to the next one when a session fails: a request routed to a
    // dead member would fail even though the cluster is healthy.
    let mut next = 0;
    let mut failed_in_row = 0;
    let started = Instant::now();
    loop {
        let endpoint = &endpoints[next % endpoints.len()];
        next += 1;
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5));
        let end = match Client::connect([endpoint], Some(opts)).await {
            Ok(client) => {
                let mut s = Session {
                    agent: &agent,
                    client,
                    key: key.clone(),
                    prefix: prefix.clone(),
                    ttl,
                    known: &known,
                };
                Counters::bump(&counters.sessions);
                let (end, established) = s.run(&mut stop, &mut first).await;
                if established {
                    failed_in_row = 0;
                    retry = Duration::from_millis(100);
                }
                end
            }
            Err(e) => End::Failed(e),
        };
        match end {
            End::Stopped => return,
            End::Failed(e) => {
                failed_in_row += 1;
                if first.is_some() {
                    // The first join tries the members in turn (a member just started may not
                    // serve yet) until its time is up.
                    if started.elapsed() >= JOIN_TIMEOUT {
                        if let Some(f) = first.take() {
                            let _ = f.send(Err(e));
                        }
                        return;
                    }
                    tracing::debug!(agent = %agent.inner.name, %endpoint, error = %e, "etcd: joining, trying again");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                        _ = stop.changed() => return,
                    }
                    continue;
                }
                Counters::bump(&counters.outages);
                tracing::warn!(agent = %agent.inner.name, %endpoint, error = %e, retry = ?retry, "etcd member unreachable; the data path is unaffected, trying the next member");
            }
        }
        if failed_in_row < endpoints.len() {
            // Another member may answer at once.
            continue;
        }
        failed_in_row = 0;
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = stop.changed() => return,
        }
        retry = (retry * 2).min(RETRY_MAX);
        if agent.inner.stopped.load(Ordering::SeqCst) {
            return;
        }
    }
}

impl Session<'_> {
    /// Runs the session; also returns whether it was established (lease, PUT and list done).
    async fn run(
        &mut self,
        stop: &mut tokio::sync::watch::Receiver<bool>,
        first: &mut Option<std_mpsc::Sender<Result<(), etcd_client::Error>>>,
    ) -> (End, bool) {
        let mut established = false;
        let end = self.serve(stop, first, &mut established).await;
        (end, established)
    }

    async fn serve(
        &mut self,
        stop: &mut tokio::sync::watch::Receiver<bool>,
        first: &mut Option<std_mpsc::Sender<Result<(), etcd_client::Error>>>,
        established: &mut bool,
    ) -> End {
        let inner = &self.agent.inner;
        let lease = match self
            .client
            .lease_grant(self.ttl.as_secs() as i64, None)
            .await
        {
            Ok(l) => l.id(),
            Err(e) => return End::Failed(e),
        };
        let mut changes = inner.watch_metadata();
        if let Err(e) = self.put(lease).await {
            return End::Failed(e);
        }
        let mut revision = match self.list().await {
            Ok(r) => r,
            Err(e) => return End::Failed(e),
        };
        *established = true;
        if let Some(f) = first.take() {
            let _ = f.send(Ok(()));
        }
        let (mut keeper, mut alive) = match self.client.lease_keep_alive(lease).await {
            Ok(k) => k,
            Err(e) => return End::Failed(e),
        };
        let mut tick = tokio::time::interval(self.ttl / 3);
        loop {
            let opts = WatchOptions::new()
                .with_prefix()
                .with_start_revision(revision + 1);
            let mut watch = match self.client.watch(self.prefix.clone(), Some(opts)).await {
                Ok(w) => w,
                Err(e) => return End::Failed(e),
            };
            // Events until the watch must be made again (compaction, cancel).
            let relist = loop {
                tokio::select! {
                    _ = stop.changed() => {
                        let _ = tokio::time::timeout(Duration::from_secs(1), self.client.lease_revoke(lease)).await;
                        tracing::info!(agent = %inner.name, "left etcd (lease revoked)");
                        return End::Stopped;
                    }
                    _ = tick.tick() => {
                        if let Err(e) = keeper.keep_alive().await {
                            return End::Failed(e);
                        }
                    }
                    r = alive.message() => match r {
                        Ok(Some(r)) if r.ttl() > 0 => {}
                        Ok(_) => return End::Failed(etcd_client::Error::LeaseKeepAliveError("lease expired".into())),
                        Err(e) => return End::Failed(e),
                    },
                    Some(()) = changes.next() => {
                        // Coalesce a burst of registrations into one PUT.
                        while changes.try_recv().is_ok() {}
                        if let Err(e) = self.put(lease).await {
                            return End::Failed(e);
                        }
                    }
                    m = watch.message() => match m {
                        Ok(Some(resp)) => {
                            if resp.canceled() || resp.compact_revision() > 0 {
                                tracing::info!(agent = %inner.name, compact = resp.compact_revision(), reason = resp.cancel_reason(), "etcd watch cancelled; listing again");
                                break true;
                            }
                            if let Some(h) = resp.header() {
                                revision = revision.max(h.revision());
                            }
                            for ev in resp.events() {
                                let Some(kv) = ev.kv() else { continue };
                                match ev.event_type() {
                                    EventType::Put => self.load(kv.key(), kv.value()),
                                    EventType::Delete => self.departed(kv.key()).await,
                                }
                            }
                        }
                        Ok(None) => return End::Failed(etcd_client::Error::WatchError("watch stream ended".into())),
                        Err(e) => return End::Failed(e),
                    },
                }
            };
            if relist {
                Counters::bump(&inner.membership_counters.relists);
                revision = match self.list().await {
                    Ok(r) => r,
                    Err(e) => return End::Failed(e),
                };
            }
        }
    }

    /// PUTs this agent's metadata on `lease`.
    async fn put(&mut self, lease: i64) -> Result<(), etcd_client::Error> {
        let inner = &self.agent.inner;
        let md = match inner.metadata_for("*").encode(&inner.identity.key) {
            Ok(md) => md,
            Err(e) => {
                tracing::warn!(agent = %inner.name, error = %e, "metadata cannot be encoded; not published");
                return Ok(());
            }
        };
        self.client
            .put(
                self.key.clone(),
                md,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await?;
        Counters::bump(&inner.membership_counters.puts);
        Ok(())
    }

    /// Lists the namespace, loads every peer in it and reconciles the ones gone; returns the
    /// list's revision.
    async fn list(&mut self) -> Result<i64, etcd_client::Error> {
        let resp = self
            .client
            .get(self.prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut present = HashSet::new();
        for kv in resp.kvs() {
            if let Some(peer) = self.peer_of(kv.key()) {
                present.insert(peer);
                self.load(kv.key(), kv.value());
            }
        }
        let gone: Vec<String> = lock(self.known)
            .iter()
            .filter(|p| !present.contains(*p))
            .cloned()
            .collect();
        for peer in gone {
            self.depart(&peer).await;
        }
        Ok(revision)
    }

    /// The peer a key names (`None` for our own key or one outside the namespace).
    fn peer_of(&self, key: &[u8]) -> Option<String> {
        let key = std::str::from_utf8(key).ok()?;
        if key == self.key {
            return None;
        }
        key.strip_prefix(&self.prefix).map(String::from)
    }

    fn load(&self, key: &[u8], value: &[u8]) {
        let Some(peer) = self.peer_of(key) else {
            return;
        };
        let inner = &self.agent.inner;
        // The blob must be the key's agent's: checked before anything is loaded.
        match inner.load_metadata_as(value, Some(&peer)) {
            Ok(_) => {
                Counters::bump(&inner.membership_counters.loads);
                tracing::debug!(agent = %inner.name, %peer, "etcd: loaded metadata");
                lock(self.known).insert(peer);
            }
            Err(e) => {
                tracing::warn!(agent = %inner.name, %peer, error = %e, "etcd: rejected metadata")
            }
        }
    }

    async fn departed(&self, key: &[u8]) {
        if let Some(peer) = self.peer_of(key) {
            self.depart(&peer).await;
        }
    }

    /// A peer left the namespace: kept if its side channel still answers with the metadata
    /// generation we have, invalidated otherwise.
    async fn depart(&self, peer: &str) {
        if !lock(self.known).contains(peer) && !self.agent.inner.knows(peer) {
            // Already gone (a DELETE after the list that found it missing, or never loaded).
            return;
        }
        let inner = Arc::clone(&self.agent.inner);
        let p = peer.to_string();
        let alive = tokio::task::spawn_blocking(move || still_there(&inner, &p))
            .await
            .unwrap_or(false);
        let inner = &self.agent.inner;
        if alive {
            Counters::bump(&inner.membership_counters.kept);
            tracing::info!(agent = %inner.name, %peer, "etcd: peer's key is gone but it answers; kept");
            return;
        }
        Counters::bump(&inner.membership_counters.departures);
        lock(self.known).remove(peer);
        tracing::info!(agent = %inner.name, %peer, "etcd: peer left; invalidating");
        if inner.knows(peer) {
            self.agent.invalidate_remote(peer).await;
        }
    }
}

/// Whether `peer`'s side channel answers with the metadata generation loaded now.
fn still_there(inner: &Inner, peer: &str) -> bool {
    let Ok(p) = inner.peer(peer) else {
        return false;
    };
    let Some(md) = p.metadata.as_ref().filter(|m| !m.address.is_empty()) else {
        return false;
    };
    let deadline = Instant::now() + PROBE_TIMEOUT;
    sidechannel::fetch_metadata(inner, &md.address, Some(peer), deadline)
        .ok()
        .and_then(|blob| super::metadata::AgentMetadata::decode(&blob, &inner.identity.key).ok())
        .is_some_and(|fresh| fresh.name == peer && fresh.generation == md.generation)
}

impl Inner {
    /// A stream that yields each time this agent's metadata changes (a registration made or
    /// released).
    pub(crate) fn watch_metadata(&self) -> futures_channel::mpsc::UnboundedReceiver<()> {
        let (tx, rx) = futures_channel::mpsc::unbounded();
        lock(&self.metadata_watchers).push(tx);
        rx
    }

    /// Tells every metadata watcher that the metadata changed.
    pub(crate) fn metadata_changed(&self) {
        lock(&self.metadata_watchers).retain(|w| w.unbounded_send(()).is_ok());
    }
}
