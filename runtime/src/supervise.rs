//! Engine supervision. glommio hands a panicking task's panic to its executor, which ends the
//! core's thread and with it every connection and every later call (`EngineGone`). Every task
//! rixl runs on an engine core is therefore polled under `catch_unwind` here: a panic ends only
//! that task. Unwinding drops the task's future, and with it any transfer it owned: that
//! transfer's slot is detached, so its posted work drains and its memory stays registered in
//! the in-flight table until the NIC is done. The caller of a panicked call gets a typed
//! `EnginePanic` error; the progress task, which every transfer of the engine depends on, is
//! restarted after failing the engine's connections (see `engine::progress`).

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_lite::FutureExt;

/// A contained panic: the panic's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Panicked(pub(crate) String);

/// The message of a panic payload (`panic!` with a literal or a format string), or a
/// placeholder for other payloads.
fn message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_owned()
    }
}

/// Runs `fut` to its end, containing a panic in it.
///
/// # Errors
/// [`Panicked`] if polling `fut` panicked (the future is dropped then).
pub(crate) async fn catching<F: Future>(fut: F) -> Result<F::Output, Panicked> {
    AssertUnwindSafe(fut)
        .catch_unwind()
        .await
        .map_err(|p| Panicked(message(&*p)))
}

/// Calls `f`, containing a panic in it.
///
/// # Errors
/// [`Panicked`] if `f` panicked.
pub(crate) fn catching_sync<T>(f: impl FnOnce() -> T) -> Result<T, Panicked> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(|p| Panicked(message(&*p)))
}

/// Spawns `fut` as a detached task on the current core; a panic in it is logged and ends only
/// this task. `what` names the task in the log.
pub(crate) fn spawn(what: &'static str, fut: impl Future<Output = ()> + 'static) {
    glommio::spawn_local(async move {
        if let Err(Panicked(msg)) = catching(fut).await {
            tracing::error!(task = what, panic = %msg, "a task on an engine core panicked; it alone ended");
        }
    })
    .detach();
}

/// Panics if the fail point `name` is configured to (`fail::cfg(name, "1*panic")` or the
/// `FAILPOINTS` variable); does nothing without the `failpoints` feature. Other fail-rs
/// actions (`sleep(ms)`, `pause`) work as well.
#[inline(always)]
pub(crate) fn fail_point(name: &'static str) {
    #[cfg(feature = "failpoints")]
    fail::fail_point!(name);
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Whether the fail point `name` is configured to `return` (`fail::cfg(name, "1*return")`):
/// the caller then injects its fault. Always false without the `failpoints` feature.
#[inline(always)]
pub(crate) fn fail_return(name: &'static str) -> bool {
    #[cfg(feature = "failpoints")]
    return fail::eval(name, |_| ()).is_some();
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = name;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_contained_with_its_message() {
        let r = futures_lite::future::block_on(catching(async {
            panic!("boom {}", 7);
        }));
        assert_eq!(r, Err::<(), _>(Panicked("boom 7".into())));
        let r = catching_sync(|| -> u32 { panic!("static") });
        assert_eq!(r, Err(Panicked("static".into())));
        assert_eq!(catching_sync(|| 3), Ok(3));
    }

    #[test]
    fn a_panicking_future_is_dropped_so_its_guards_run() {
        struct Guard<'a>(&'a std::cell::Cell<bool>);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                self.0.set(true);
            }
        }
        let dropped = std::cell::Cell::new(false);
        let r = futures_lite::future::block_on(catching(async {
            let _g = Guard(&dropped);
            futures_lite::future::yield_now().await;
            panic!("after a yield");
        }));
        assert!(r.is_err());
        assert!(dropped.get(), "the task's state was dropped");
    }
}
