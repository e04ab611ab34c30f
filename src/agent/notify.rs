//! Notifications: small messages between agents (NIXL's `genNotif`), sent on a peer's rail-0
//! connection and delivered to the receiver's notification stream. Where either agent has no
//! NIC (a GPU node whose peers are reached by CUDA IPC only), they travel on the side channel
//! instead, under the same bounds.
//!
//! Bounded end to end: the stream holds at most [`NOTIFICATION_QUEUE`] notifications, each
//! connection's engine inbox at most `INBOX_LIMIT` messages, and each peer may deliver at most
//! [`AgentConfig::notification_rate`](super::AgentConfig::notification_rate) per second. A
//! peer's receiver waits while the stream is full or the peer is over its rate; its connection
//! then stops posting receive buffers, and the sender meets receiver-not-ready back-pressure
//! from the NIC: its `notify` waits, and ends typed at its deadline. Nothing is dropped, and a
//! flooding peer slows only itself.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_channel::mpsc;

use crate::runtime::{ConnId, Message};

use super::snapshot::lock;
use super::{link, sidechannel, Agent, AgentError, Inner};

/// Largest notification (the engine's message size).
pub const MAX_NOTIFICATION: usize = 4096;

/// A notification: the sending agent's name and the message.
pub type Notification = (String, Vec<u8>);

/// The notification stream (a `futures` `Stream` of [`Notification`]s).
pub type Notifications = mpsc::Receiver<Notification>;

/// Notifications the stream holds before the receivers wait for the application.
pub const NOTIFICATION_QUEUE: usize = 1024;

/// How long a notification sent on the side channel waits for room in a full stream before it
/// is refused.
pub const SIDE_NOTIFY_WAIT: Duration = Duration::from_millis(200);

/// A token bucket: `rate` per second, bursts of up to `rate / 10` (at least 16).
#[derive(Debug)]
pub(crate) struct RateCap {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl RateCap {
    fn new(rate: u32) -> Self {
        let rate = f64::from(rate.max(1));
        let burst = (rate / 10.0).max(16.0);
        RateCap {
            rate,
            burst,
            tokens: burst,
            at: Instant::now(),
        }
    }

    /// Takes one token: how long to wait first (zero when one is there).
    fn take(&mut self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst) - 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

impl Agent {
    /// Sends a standalone notification to `peer` (NIXL's `genNotif`).
    ///
    /// ```no_run
    /// # async fn f(prefill: &rixl::agent::Agent, decode: &rixl::agent::Agent)
    /// #     -> Result<(), rixl::agent::AgentError> {
    /// use futures_lite::StreamExt;
    /// let mut inbox = decode.notifications().expect("taken once");
    /// prefill.notify("decode", b"request 17 landed").await?;
    /// let (from, msg) = inbox.next().await.expect("a notification");
    /// assert_eq!((from.as_str(), msg.as_slice()), ("prefill", &b"request 17 landed"[..]));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`], [`AgentError::NotificationTooLarge`], or a transfer error.
    pub async fn notify(&self, peer: &str, msg: &[u8]) -> Result<(), AgentError> {
        if msg.is_empty() || msg.len() > MAX_NOTIFICATION {
            return Err(AgentError::NotificationTooLarge(msg.len()));
        }
        let deadline = std::time::Instant::now() + self.inner.transfer_timeout;
        self.notify_by(peer, msg, deadline).await
    }

    /// Sends `msg` to `peer` on its rail-0 connection, or on the side channel when either agent
    /// has no NIC.
    pub(crate) async fn notify_by(
        &self,
        peer: &str,
        msg: &[u8],
        deadline: Instant,
    ) -> Result<(), AgentError> {
        // A peer that connected to us may be notified before we loaded its metadata: only a
        // peer whose metadata says it has no NIC goes through the side channel.
        let peer_nic = self
            .inner
            .peers
            .load()
            .get(peer)
            .and_then(|p| p.metadata.as_ref().map(|m| m.nic))
            .unwrap_or(true);
        if self.has_nic() && peer_nic {
            let conn = link::ensure(&self.inner, peer, 0, Some(deadline)).await?;
            return self.notify_checked(peer, conn, msg).await;
        }
        let p = self.inner.peer(peer)?;
        if msg.is_empty() || msg.len() > MAX_NOTIFICATION {
            return Err(AgentError::NotificationTooLarge(msg.len()));
        }
        let addr = p.side_channel(peer)?;
        let (inner, peer, msg) = (Arc::clone(&self.inner), peer.to_string(), msg.to_vec());
        let (tx, rx) = futures_channel::oneshot::channel();
        std::thread::Builder::new()
            .name("rixl-notify-send".into())
            .spawn(move || {
                let r = sidechannel::send_notification(&inner, &peer, &addr, &msg, deadline);
                let _ = tx.send(r);
            })
            .map_err(AgentError::ControlThread)?;
        rx.await.unwrap_or(Err(AgentError::Stopped))
    }

    /// Sends `msg` on `conn` to `peer`; a connection that failed doing so is retired.
    pub(crate) async fn notify_checked(
        &self,
        peer: &str,
        conn: ConnId,
        msg: &[u8],
    ) -> Result<(), AgentError> {
        if msg.is_empty() || msg.len() > MAX_NOTIFICATION {
            return Err(AgentError::NotificationTooLarge(msg.len()));
        }
        let sent = self
            .inner
            .rails
            .engine(0)
            .send(conn, msg.to_vec(), None)
            .await;
        if let Err(e) = sent {
            self.inner.retire_failed(peer, &[(0, conn)]).await;
            return Err(e.into());
        }
        Ok(())
    }

    /// The stream of `(peer, message)` notifications received by this agent (taken once).
    pub fn notifications(&self) -> Option<Notifications> {
        lock(&self.inner.notif_rx).take()
    }
}

impl Inner {
    /// Delivers a notification `requester` sent on the side channel: after the requester's rate
    /// cap allows it, and once the stream has room. A stream that stays full for
    /// [`SIDE_NOTIFY_WAIT`] refuses it (the sender gets `ERR`, typed; nothing is dropped
    /// silently), so an undrained stream never holds a side-channel slot for long.
    ///
    /// # Errors
    /// [`AgentError::SideChannel`] when the stream stays full; [`AgentError::Stopped`] once it
    /// is gone.
    pub(crate) async fn deliver(&self, requester: &str, msg: Vec<u8>) -> Result<(), AgentError> {
        let wait = lock(&self.side_caps)
            .entry(requester.to_string())
            .or_insert_with(|| RateCap::new(self.notification_rate))
            .take(Instant::now());
        if !wait.is_zero() {
            tracing::debug!(peer = %requester, ?wait, "notification rate cap reached; waiting");
            futures_timer::Delay::new(wait).await;
        }
        // One sender for the whole side channel: a clone per call would add a slot to the
        // channel each time, and the stream would never be full.
        let mut item = (requester.to_string(), msg);
        let until = Instant::now() + SIDE_NOTIFY_WAIT;
        loop {
            let sent = lock(&self.side_tx).try_send(item);
            match sent {
                Ok(()) => return Ok(()),
                Err(e) if e.is_disconnected() => return Err(AgentError::Stopped),
                Err(e) => item = e.into_inner(),
            }
            if Instant::now() >= until {
                return Err(AgentError::SideChannel(format!(
                    "notification stream full for {SIDE_NOTIFY_WAIT:?}: busy"
                )));
            }
            futures_timer::Delay::new(Duration::from_millis(2)).await;
        }
    }

    /// Delivers messages arriving on `conn` from `peer` to the notification stream until the
    /// connection ends.
    pub(crate) fn spawn_receiver(self: &Arc<Self>, peer: String, conn: ConnId) {
        let engine = self.rails.engine(0).clone();
        let mut tx = self.notif_tx.clone();
        let mut cap = RateCap::new(self.notification_rate);
        let spawned = std::thread::Builder::new()
            .name(format!("rixl-notify-{peer}"))
            .spawn(move || loop {
                match futures_lite::future::block_on(engine.recv(conn)) {
                    Ok(Message::Data(d, _)) => {
                        let wait = cap.take(Instant::now());
                        if !wait.is_zero() {
                            tracing::debug!(%peer, ?wait, "notification rate cap reached; waiting");
                            std::thread::sleep(wait);
                        }
                        // Waits while the stream is full: back-pressure, nothing dropped.
                        let ready =
                            futures_lite::future::block_on(futures_lite::future::poll_fn(|cx| {
                                tx.poll_ready(cx)
                            }));
                        if ready.is_err() || tx.start_send((peer.clone(), d)).is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "notification receiver ended");
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a notification receiver; its peer's notifications wait");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_cap_allows_its_burst_then_paces_to_its_rate() {
        let mut cap = RateCap::new(1000); // burst 100
        let t0 = Instant::now();
        for _ in 0..100 {
            assert_eq!(cap.take(t0), Duration::ZERO);
        }
        let wait = cap.take(t0);
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(1),
            "{wait:?}"
        );
        // 10 ms later: 10 tokens came back (less the one owed).
        let later = t0 + Duration::from_millis(10);
        let waits: Vec<_> = (0..10).map(|_| cap.take(later)).collect();
        assert!(waits[..9].iter().all(|w| w.is_zero()), "{waits:?}");
        assert!(!waits[9].is_zero());
    }
}
