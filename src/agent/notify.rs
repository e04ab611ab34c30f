//! Notifications: small messages between agents (NIXL's `genNotif`), sent on a peer's rail-0
//! connection and delivered to the receiver's notification stream.

use std::sync::Arc;

use futures_channel::mpsc;

use crate::runtime::{ConnId, Message};

use super::snapshot::lock;
use super::{link, Agent, AgentError, Inner};

/// Largest notification (the engine's message size).
pub const MAX_NOTIFICATION: usize = 4096;

/// A notification: the sending agent's name and the message.
pub type Notification = (String, Vec<u8>);

/// The notification stream (a `futures` `Stream` of [`Notification`]s).
pub type Notifications = mpsc::UnboundedReceiver<Notification>;

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
        let conn = link::ensure(&self.inner, peer, 0, Some(deadline)).await?;
        self.notify_checked(peer, conn, msg).await
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
    /// Delivers messages arriving on `conn` from `peer` to the notification stream until the
    /// connection ends.
    pub(crate) fn spawn_receiver(self: &Arc<Self>, peer: String, conn: ConnId) {
        let engine = self.rails.engine(0).clone();
        let tx = self.notif_tx.clone();
        std::thread::spawn(move || loop {
            match futures_lite::future::block_on(engine.recv(conn)) {
                Ok(Message::Data(d, _)) => {
                    if tx.unbounded_send((peer.clone(), d)).is_err() {
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
    }
}
