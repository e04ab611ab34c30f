//! Calls made from a task on the engine's own core. Such a call needs no hand-off: its job is
//! started right there, on this executor, instead of going over the core's channel (which
//! wakes the serving task through glommio's cross-thread path and answers through a oneshot
//! woken from another thread). A serving engine whose step loop runs on the engine's core
//! ([`EngineHandle::run_on_core`], `Agent::run_on_core`) pays for a transfer only what the
//! engine's own path costs.

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{run_job, EngineHandle, Inbox, Job, Lost, Served};
use crate::error::RuntimeError;

thread_local! {
    /// The core this thread serves, while its serving task runs.
    static HERE: RefCell<Option<Here>> = const { RefCell::new(None) };
}

struct Here {
    served: Served,
    inbox: Rc<Inbox>,
}

/// How an engine handle's calls reached the core.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandOffCounters {
    /// Calls made on the engine's own core: started there, with no hand-off.
    pub on_core: u64,
    /// Calls sent to the core from another thread.
    pub sent: u64,
}

impl std::ops::AddAssign for HandOffCounters {
    fn add_assign(&mut self, o: HandOffCounters) {
        self.on_core += o.on_core;
        self.sent += o.sent;
    }
}

/// The counters behind [`HandOffCounters`], shared by a handle's clones.
#[derive(Debug, Default)]
pub(super) struct HandOffs {
    on_core: AtomicU64,
    sent: AtomicU64,
}

/// While alive, this thread is the core of the engine `served` serves: calls to its handle
/// from here start their jobs at once. Dropped when the serving task ends.
pub(super) struct OnCore;

impl OnCore {
    pub(super) fn enter(served: &Served, inbox: &Rc<Inbox>) -> OnCore {
        HERE.with(|h| {
            *h.borrow_mut() = Some(Here {
                served: served.clone(),
                inbox: Rc::clone(inbox),
            })
        });
        OnCore
    }
}

impl Drop for OnCore {
    fn drop(&mut self) {
        // At thread exit the slot may already be gone: nothing is left to clear then.
        let _ = HERE.try_with(|h| h.borrow_mut().take());
    }
}

/// What the core serves, when this thread is engine `id`'s core and it still takes calls (not
/// shutting down).
fn served_here(id: u64) -> Option<Served> {
    HERE.try_with(|h| match &*h.borrow() {
        Some(here) if here.served.id == id && !here.inbox.stopping.get() => {
            Some(here.served.clone())
        }
        _ => None,
    })
    .ok()
    .flatten()
}

impl EngineHandle {
    /// Starts `job` on the engine's core: at once when called there, else sent over the
    /// core's channel.
    pub(super) fn start(&self, job: Job) -> Result<(), Lost> {
        if let Some(served) = served_here(self.id) {
            self.hand_offs.on_core.fetch_add(1, Ordering::Relaxed);
            run_job(&served, job);
            return Ok(());
        }
        self.hand_offs.sent.fetch_add(1, Ordering::Relaxed);
        self.tx
            .unbounded_send(super::Command::Run(job))
            .map_err(|_| Lost::Gone)
    }

    /// How this handle's calls (and its clones') reached the core so far.
    pub fn hand_off_counters(&self) -> HandOffCounters {
        HandOffCounters {
            on_core: self.hand_offs.on_core.load(Ordering::Relaxed),
            sent: self.hand_offs.sent.load(Ordering::Relaxed),
        }
    }

    /// Runs `f`'s future as a task on the engine's core and returns its output. Calls that
    /// task makes to this engine (through any clone of this handle, or an agent transfer on
    /// this engine's rail) start on the core without the cross-thread hand-off. Dropping the
    /// returned future cancels the task at its next turn (the transfers it had started are
    /// detached: the in-flight table keeps their memory until the NIC is done). Called on the
    /// core itself, the task is spawned there directly.
    ///
    /// # Errors
    /// [`RuntimeError::EngineGone`] when the engine has shut down (`f` is dropped unrun) and
    /// [`RuntimeError::EnginePanic`] when the task panicked (contained: the core keeps
    /// serving).
    pub async fn run_on_core<T, F, Fut>(&self, f: F) -> Result<T, RuntimeError>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
    {
        self.on_core_or_cancel(move |_| f())
            .await
            .map_err(RuntimeError::from)
    }
}
