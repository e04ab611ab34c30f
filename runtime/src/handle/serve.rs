//! The serving task of a core: it takes the commands other threads send to the core's
//! [`EngineHandle`] and starts their jobs there.
//!
//! After a command it spins for the next one (for `EngineConfig::spin_before_park`) with no
//! waker registered on the channel, so a call from another thread in that window costs its
//! sender no cross-thread wake and the core no turn of glommio's main loop (which re-arms its
//! timers through io_uring): the next look at the inbox takes it. It does not spin while a job's
//! task is still running and may need the reactor (file I/O, a blocking call, a timer: every
//! job but an RDMA transfer or post on a busy-polled engine), nor for longer than
//! [`MAX_SPIN_PHASE`] before it goes pending once, so glommio's own loop gets its turn and what
//! it serves (I/O, timers, wake-ups from other threads, including those of tasks no job counts,
//! such as a FILE worker left running after its deadline) is not kept waiting by this task.
//! Other tasks that keep the core busy (a busy-polling progress loop) hold that loop off until
//! glommio's preemption timer fires, as before.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use futures_channel::{mpsc, oneshot};
use futures_lite::StreamExt;

use super::{contained, local, Command, EngineHandle, Job, Served};
use crate::engine::{Engine, EngineConfig};
use crate::file::FileStore;
use crate::supervise;
use local::HandOffs;

/// The longest the serving task spins at a stretch before it lets glommio's main loop run
/// (foreign wake-ups of other tasks, timers, I/O completions).
const MAX_SPIN_PHASE: Duration = Duration::from_millis(1);

/// Empty looks at the inbox between two clock reads while spinning (a clock read is a system
/// call on some clock sources).
const LOOKS_PER_CLOCK_READ: u32 = 64;

impl Engine {
    /// Serves a [`EngineHandle`]: returns the handle and the task future to spawn on this
    /// engine's executor (it ends on shutdown or when every handle is dropped).
    pub fn handle(&self) -> (EngineHandle, impl Future<Output = ()>) {
        serve_core(Some(self.clone()), self.id(), self.config().clone())
    }
}

/// Serves a core: its RDMA engine when it has one, host memory otherwise, and its FILE tier.
/// `cfg` is the core's configuration (the engine's, or the one given to a core without a NIC):
/// the FILE tier's depth and I/O size and the default deadline come from it.
pub(crate) fn serve_core(
    engine: Option<Engine>,
    id: u64,
    cfg: EngineConfig,
) -> (EngineHandle, impl Future<Output = ()>) {
    let (tx, rx) = mpsc::unbounded();
    let handle = EngineHandle {
        tx,
        id,
        nic: engine.is_some(),
        device: engine.as_ref().map(|e| Arc::from(e.device_name().as_str())),
        hand_offs: Arc::default(),
        reply_spin: cfg.reply_spin,
        transfer_timeout: cfg.transfer_timeout,
        liveness: super::bound::Liveness::new(cfg.stall_timeout),
    };
    let served = Served {
        files: Rc::new(FileStore::new(cfg.file)),
        cfg: Rc::new(cfg),
        engine,
        id,
        live: Rc::default(),
    };
    let inbox = Rc::new(Inbox {
        rx: RefCell::new(rx),
        shutdown: RefCell::new(Vec::new()),
        stopping: Cell::new(false),
        waker: RefCell::new(None),
    });
    if let Some(e) = &served.engine {
        let (served, inbox) = (served.clone(), Rc::clone(&inbox));
        e.set_command_pump(Box::new(move || inbox.pump(&served)));
    }
    let hand_offs = Arc::clone(&handle.hand_offs);
    let liveness = Arc::clone(&handle.liveness);
    super::bound::watch_core(&liveness);
    let serving = async move {
        // The core beats for as long as it serves (dropping the task cancels it).
        let _heartbeat = glommio::spawn_local(liveness.beat());
        serve(served, inbox, hand_offs).await;
    };
    (handle, serving)
}

/// The tasks jobs started on this core that are still running and may need its reactor.
#[derive(Default)]
pub(super) struct LiveJobs {
    count: Cell<usize>,
    /// The serving task, waiting for the last of them to end.
    waker: RefCell<Option<Waker>>,
}

impl LiveJobs {
    /// Counts a job's task as running until the returned guard is dropped.
    pub(super) fn enter(self: &Rc<Self>) -> LiveJob {
        self.count.set(self.count.get() + 1);
        LiveJob(Rc::clone(self))
    }

    fn idle(&self) -> bool {
        self.count.get() == 0
    }
}

/// A running job's task (see [`LiveJobs::enter`]).
pub(super) struct LiveJob(Rc<LiveJobs>);

impl Drop for LiveJob {
    fn drop(&mut self) {
        let live = &self.0;
        live.count.set(live.count.get().saturating_sub(1));
        if live.idle() {
            if let Some(w) = live.waker.borrow_mut().take() {
                w.wake();
            }
        }
    }
}

/// The commands other threads sent to a core. Taken by the serving task, and by the progress
/// loop at every turn ([`Inbox::pump`]), whichever comes first.
pub(super) struct Inbox {
    rx: RefCell<mpsc::UnboundedReceiver<Command>>,
    /// Shutdowns the pump took, for the serving task to carry out.
    shutdown: RefCell<Vec<oneshot::Sender<()>>>,
    /// A shutdown was taken: the pump takes nothing more (what comes after it never runs).
    pub(super) stopping: Cell<bool>,
    /// The serving task, told of a shutdown the pump took.
    waker: RefCell<Option<Waker>>,
}

/// What a look at the inbox found.
enum Look {
    Command(Command),
    Empty,
    /// Every handle is gone.
    Closed,
}

/// What the serving task's wait ended on.
enum Waited {
    Command(Command),
    /// The last running job task ended: time to spin again.
    JobsEnded,
    Closed,
}

/// The end of one wait of the serving task.
struct Wait {
    ended: Waited,
    /// Whether the task went pending (so glommio's loop had its turn).
    went_pending: bool,
}

impl Inbox {
    /// Starts every command waiting (jobs only spawn their tasks, so this is quick); a
    /// shutdown is left to the serving task.
    fn pump(&self, served: &Served) {
        if self.stopping.get() {
            return;
        }
        loop {
            let cmd = match self.rx.try_borrow_mut() {
                Ok(mut rx) => match rx.try_recv() {
                    Ok(cmd) => cmd,
                    Err(_) => return,
                },
                Err(_) => return,
            };
            match cmd {
                Command::Run(job) => run_job(served, job),
                Command::Shutdown(done) => {
                    self.stopping.set(true);
                    self.shutdown.borrow_mut().push(done);
                    if let Some(w) = self.waker.borrow_mut().take() {
                        w.wake();
                    }
                    return;
                }
            }
        }
    }

    /// A command waiting now (a shutdown the pump took first), registering no waker.
    fn look(&self) -> Look {
        if let Some(done) = self.shutdown.borrow_mut().pop() {
            return Look::Command(Command::Shutdown(done));
        }
        match self.rx.borrow_mut().try_recv() {
            Ok(cmd) => Look::Command(cmd),
            Err(mpsc::TryRecvError::Empty) => Look::Empty,
            Err(mpsc::TryRecvError::Closed) => Look::Closed,
        }
    }

    /// Waits for the next command, or, when job tasks are running, for the last of them to
    /// end, and whether the task went pending meanwhile.
    async fn wait(&self, live: &LiveJobs) -> Wait {
        let mut on_jobs = false;
        let mut pending = false;
        let ended = std::future::poll_fn(|cx| {
            if let Some(done) = self.shutdown.borrow_mut().pop() {
                return Poll::Ready(Waited::Command(Command::Shutdown(done)));
            }
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            match self.rx.borrow_mut().poll_next(cx) {
                Poll::Ready(Some(cmd)) => return Poll::Ready(Waited::Command(cmd)),
                Poll::Ready(None) => return Poll::Ready(Waited::Closed),
                Poll::Pending => {}
            }
            if !live.idle() {
                on_jobs = true;
                *live.waker.borrow_mut() = Some(cx.waker().clone());
            } else if on_jobs {
                return Poll::Ready(Waited::JobsEnded);
            }
            pending = true;
            Poll::Pending
        })
        .await;
        Wait {
            ended,
            went_pending: pending,
        }
    }
}

/// When the serving task keeps spinning for the next command: for `window` after the last
/// one, and at most [`MAX_SPIN_PHASE`] since it last waited.
struct Spin {
    window: Duration,
    looks: u32,
    /// A command was taken since the last clock read.
    took: bool,
    last_command: Option<Instant>,
    phase: Option<Instant>,
}

impl Spin {
    fn new(window: Duration) -> Self {
        Spin {
            window,
            looks: 0,
            took: false,
            last_command: None,
            phase: None,
        }
    }

    /// A command was taken.
    fn took(&mut self) {
        self.took = true;
    }

    /// After an empty look: whether to look again (instead of waiting).
    fn again(&mut self) -> bool {
        if self.window.is_zero() {
            return false;
        }
        self.looks = self.looks.wrapping_add(1);
        if !self.looks.is_multiple_of(LOOKS_PER_CLOCK_READ) {
            return true;
        }
        let now = Instant::now();
        let phase = *self.phase.get_or_insert(now);
        if std::mem::take(&mut self.took) || self.last_command.is_none() {
            self.last_command = Some(now);
        }
        let last = self.last_command.unwrap_or(now);
        now.duration_since(last) < self.window && now.duration_since(phase) < MAX_SPIN_PHASE
    }

    /// The serving task waited (went pending, so glommio's loop could run): the next spin is
    /// a new phase.
    fn waited(&mut self) {
        *self = Spin::new(self.window);
    }
}

/// Starts a job. It only spawns its task (which contains its own panics); a panic here must
/// not end the core's service either.
pub(super) fn run_job(served: &Served, job: Job) {
    if let Err(p) = supervise::catching_sync(|| job(served.clone())) {
        let _ = contained(served.engine.as_ref(), p);
    }
}

async fn serve(served: Served, inbox: Rc<Inbox>, hand_offs: Arc<HandOffs>) {
    // The pump holds the engine (and the engine the pump): let go of it however this ends.
    let _release = ReleasePump(served.engine.clone());
    // Calls made on this core from here on start their jobs here.
    let _here = local::OnCore::enter(&served, &inbox);
    let mut spin = Spin::new(served.cfg.spin_before_park);
    loop {
        let cmd = match inbox.look() {
            Look::Command(cmd) => {
                if matches!(cmd, Command::Run(_)) {
                    hand_offs.note_taken_without_wake();
                }
                cmd
            }
            Look::Closed => return,
            Look::Empty if served.live.idle() && spin.again() => {
                futures_lite::future::yield_now().await;
                continue;
            }
            Look::Empty => {
                let wait = inbox.wait(&served.live).await;
                // A wait answered at once gave glommio's loop no turn: the phase goes on.
                if wait.went_pending {
                    spin.waited();
                }
                match wait.ended {
                    Waited::Command(cmd) => cmd,
                    Waited::JobsEnded => continue,
                    Waited::Closed => return,
                }
            }
        };
        spin.took();
        match cmd {
            Command::Run(job) => run_job(&served, job),
            Command::Shutdown(done) => {
                inbox.stopping.set(true);
                served.files.close_all().await;
                if let Some(e) = &served.engine {
                    e.clear_command_pump();
                    e.clone().shutdown().await;
                }
                let _ = done.send(());
                // Shutdowns asked for meanwhile are done too.
                for d in inbox.shutdown.borrow_mut().drain(..) {
                    let _ = d.send(());
                }
                return;
            }
        }
    }
}

/// Clears an engine's command pump when dropped (the serving task ends, on any path).
struct ReleasePump(Option<Engine>);

impl Drop for ReleasePump {
    fn drop(&mut self) {
        if let Some(e) = &self.0 {
            e.clear_command_pump();
        }
    }
}
