//! A value read without a lock and replaced whole by its (rare) writers: readers on the transfer
//! path load the current snapshot; membership and registration changes clone it, apply their
//! change and publish the new one.

use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::{ArcSwap, Guard};

/// The current `T`, replaced by [`Snapshot::update`].
#[derive(Debug)]
pub(crate) struct Snapshot<T> {
    current: ArcSwap<T>,
    /// Serialises writers (read, modify, publish); readers never take it.
    write: Mutex<()>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<T: Clone> Snapshot<T> {
    pub fn new(value: T) -> Self {
        Snapshot {
            current: ArcSwap::from_pointee(value),
            write: Mutex::new(()),
        }
    }

    /// The current value (lock-free).
    pub fn load(&self) -> Guard<Arc<T>> {
        self.current.load()
    }

    /// Applies `f` to a copy of the current value and publishes it; returns what `f` returned.
    pub fn update<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let _writer = lock(&self.write);
        let mut next = T::clone(&self.current.load());
        let r = f(&mut next);
        self.current.store(Arc::new(next));
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_keep_the_snapshot_they_loaded_while_writers_publish_new_ones() {
        let s = Snapshot::new(vec![1]);
        let before = s.load();
        let n = s.update(|v| {
            v.push(2);
            v.len()
        });
        assert_eq!(n, 2);
        assert_eq!(**before, [1], "an old reader's view does not change");
        assert_eq!(**s.load(), [1, 2]);
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let s = Arc::new(Snapshot::new(Vec::<u32>::new()));
                std::thread::spawn(move || {
                    for k in 0..100 {
                        s.update(|v| v.push(i * 100 + k));
                    }
                    s.load().len()
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().expect("no panic"), 100, "no update is lost");
        }
    }
}
