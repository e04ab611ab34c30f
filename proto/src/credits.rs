//! Send-queue credits of one queue pair (pure logic).
//!
//! A send-queue slot is free again only when a *signaled* work request at or after it completes
//! (RC completes in order). So the engine signals at least every `interval` requests and the last
//! of every batch, and remembers, per signaled request, how many slots its completion frees.

/// Credits of one send queue.
#[derive(Debug, Clone)]
pub struct SendCredits {
    free: u32,
    depth: u32,
    interval: u32,
    since_signal: u32,
    frees: FreeRing,
}

/// How many slots each outstanding signaled request frees, oldest first. A ring of `depth`
/// entries: each signaled request holds at least one slot, so no more are ever outstanding
/// (it grows if that were broken). Its push and pop are a few instructions inlined into the
/// latency path's post and completion, where `VecDeque`'s were calls.
#[derive(Debug, Clone)]
struct FreeRing {
    buf: Box<[u32]>,
    head: usize,
    len: usize,
}

impl FreeRing {
    fn new(capacity: u32) -> Self {
        FreeRing {
            buf: vec![0; capacity.max(1) as usize].into_boxed_slice(),
            head: 0,
            len: 0,
        }
    }

    #[inline(always)]
    fn push_back(&mut self, n: u32) {
        if self.len == self.buf.len() {
            self.grow();
        }
        let mut i = self.head + self.len;
        if i >= self.buf.len() {
            i -= self.buf.len();
        }
        self.buf[i] = n;
        self.len += 1;
    }

    #[inline(always)]
    fn pop_front(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let n = self.buf[self.head];
        self.head += 1;
        if self.head == self.buf.len() {
            self.head = 0;
        }
        self.len -= 1;
        Some(n)
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[cold]
    fn grow(&mut self) {
        let old = std::mem::take(self);
        let mut buf = Vec::with_capacity(old.buf.len() * 2);
        buf.extend(old.iter());
        let len = buf.len();
        buf.resize(old.buf.len() * 2, 0);
        *self = FreeRing {
            buf: buf.into_boxed_slice(),
            head: 0,
            len,
        };
    }

    /// Oldest first.
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len).map(|k| self.buf[(self.head + k) % self.buf.len()])
    }
}

impl Default for FreeRing {
    fn default() -> Self {
        FreeRing::new(1)
    }
}

impl SendCredits {
    /// A queue of `depth` slots, signaling at least every `interval` requests.
    pub fn new(depth: u32, interval: u32) -> Self {
        SendCredits {
            free: depth,
            depth,
            interval: interval.max(1),
            since_signal: 0,
            frees: FreeRing::new(depth),
        }
    }

    /// Free slots.
    pub fn available(&self) -> u32 {
        self.free
    }

    /// Whether no posted request awaits completion.
    pub fn is_idle(&self) -> bool {
        self.frees.is_empty()
    }

    /// Plans the signal flags of a batch of `n` requests (`n <= available()`): every
    /// `interval`-th request and the last one are signaled. Call [`Self::commit`] after posting.
    pub fn plan(&self, n: u32) -> BatchPlan {
        self.plan_every(n, self.interval)
    }

    /// As [`Self::plan`], signaling at least every `interval` requests (a tighter interval than
    /// the connection's, for batches whose transfers complete with the next signal).
    pub fn plan_every(&self, n: u32, interval: u32) -> BatchPlan {
        BatchPlan {
            n,
            since: self.since_signal,
            interval: interval.clamp(1, self.interval),
        }
    }

    /// Records a posted batch.
    pub fn commit(&mut self, plan: BatchPlan) {
        debug_assert!(plan.n <= self.free, "posted past the send queue depth");
        self.free -= plan.n;
        let mut since = plan.since;
        for signaled in plan.flags() {
            since += 1;
            if signaled {
                self.frees.push_back(since);
                since = 0;
            }
        }
        // Every batch ends signaled.
        self.since_signal = 0;
    }

    /// Records one posted request, signaled, as its own batch: [`Self::commit`] of
    /// `plan(1)` without the plan (the latency path's post).
    #[inline]
    pub fn commit_one_signaled(&mut self) {
        debug_assert!(self.free > 0, "posted past the send queue depth");
        self.free -= 1;
        self.frees.push_back(self.since_signal + 1);
        self.since_signal = 0;
    }

    /// A signaled request completed (successfully or flushed): frees its slots.
    #[inline]
    pub fn on_signaled_completion(&mut self) {
        if let Some(n) = self.frees.pop_front() {
            self.free = (self.free + n).min(self.depth);
        }
    }
}

/// Signal flags of one batch (computed, not stored: the hot path allocates nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    n: u32,
    since: u32,
    interval: u32,
}

impl BatchPlan {
    /// Whether request `i` of the batch is signaled.
    pub fn is_signaled(&self, i: u32) -> bool {
        i + 1 == self.n || (self.since + i + 1).is_multiple_of(self.interval)
    }

    /// The index of the first request signaled for the interval (it may lie past the batch).
    fn first_interval_signal(&self) -> u32 {
        // `since` is below the interval but for a batch planned with a tighter one: no division
        // (a helper call on emulated CPUs, tens of cycles on real ones) on the usual path.
        let since = if self.since < self.interval {
            self.since
        } else {
            self.since % self.interval
        };
        self.interval - since - 1
    }

    /// Number of signaled requests.
    pub fn signaled(&self) -> u32 {
        if self.n == 0 {
            return 0;
        }
        let first = self.first_interval_signal();
        if first >= self.n {
            return 1;
        }
        let tail = self.n - 1 - first;
        let every = tail / self.interval + 1;
        every + u32::from(!tail.is_multiple_of(self.interval))
    }

    /// The flags in order (one division per batch, not per request: this runs for every work
    /// request posted).
    pub fn flags(&self) -> Flags {
        Flags {
            i: 0,
            n: self.n,
            next: self.first_interval_signal(),
            interval: self.interval,
        }
    }
}

/// The signal flags of a [`BatchPlan`], in order.
#[derive(Debug, Clone)]
pub struct Flags {
    i: u32,
    n: u32,
    next: u32,
    interval: u32,
}

impl Iterator for Flags {
    type Item = bool;

    fn next(&mut self) -> Option<bool> {
        if self.i >= self.n {
            return None;
        }
        let i = self.i;
        self.i += 1;
        let at_interval = i == self.next;
        if at_interval {
            self.next += self.interval;
        }
        Some(at_interval || i + 1 == self.n)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.n - self.i) as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Flags {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_free_ring_is_a_fifo_across_wraps_and_growth() {
        let mut ring = FreeRing::new(3);
        let mut model = std::collections::VecDeque::new();
        // Pushes and pops that wrap the ring many times, then more than it holds at once.
        for step in 0..40u32 {
            let pushes = if step == 30 { 7 } else { 1 + step % 3 };
            for k in 0..pushes {
                ring.push_back(step * 10 + k);
                model.push_back(step * 10 + k);
            }
            let pops = if step == 30 {
                2
            } else {
                pushes.min(model.len() as u32)
            };
            for _ in 0..pops {
                assert_eq!(ring.pop_front(), model.pop_front(), "step {step}");
            }
            assert_eq!(ring.iter().collect::<Vec<_>>(), Vec::from(model.clone()));
        }
        while let Some(n) = model.pop_front() {
            assert_eq!(ring.pop_front(), Some(n));
        }
        assert!(ring.is_empty());
        assert_eq!(ring.pop_front(), None);
    }

    #[test]
    fn one_signaled_request_commits_as_a_planned_batch_of_one() {
        // After every mix of earlier batches (unsignaled requests pending or not), the shortcut
        // leaves the credits as commit(plan(1)) does, and both free the same on completion.
        for first in 0..6u32 {
            let mut a = SendCredits::new(16, 4);
            if first > 0 {
                let p = a.plan_every(first, 4);
                a.commit(p);
                // A batch ends signaled; leave an unsignaled tail counted in `since_signal`.
                a.since_signal = first % 3;
            }
            let mut b = a.clone();
            a.commit(a.plan(1));
            b.commit_one_signaled();
            assert_eq!(
                (a.free, a.since_signal, a.frees.iter().collect::<Vec<_>>()),
                (b.free, b.since_signal, b.frees.iter().collect::<Vec<_>>()),
                "after a batch of {first}"
            );
            while !a.is_idle() {
                a.on_signaled_completion();
                b.on_signaled_completion();
                assert_eq!(a.available(), b.available());
            }
            assert!(b.is_idle());
            assert_eq!(b.available(), 16);
        }
    }

    #[test]
    fn signals_every_interval_and_the_last_of_each_batch() {
        let c = SendCredits::new(64, 4);
        let p = c.plan(10);
        let want = [
            false, false, false, true, false, false, false, true, false, true,
        ];
        assert_eq!(p.flags().collect::<Vec<_>>(), want);
        assert_eq!(p.signaled(), 3);
    }

    #[test]
    fn the_flag_iterator_and_count_agree_with_the_rule_for_every_batch_shape() {
        for interval in 1..=9 {
            for since in 0..12 {
                for n in 0..40 {
                    let p = BatchPlan { n, since, interval };
                    let rule: Vec<bool> = (0..n).map(|i| p.is_signaled(i)).collect();
                    assert_eq!(
                        p.flags().collect::<Vec<_>>(),
                        rule,
                        "{n} {since} {interval}"
                    );
                    let count = rule.iter().filter(|s| **s).count() as u32;
                    assert_eq!(p.signaled(), count, "{n} {since} {interval}");
                }
            }
        }
    }

    #[test]
    fn exhaustion_blocks_until_signaled_completions_free_slots() {
        let mut c = SendCredits::new(8, 4);
        let p = c.plan(8);
        c.commit(p);
        assert_eq!(c.available(), 0, "queue full: nothing more may be posted");
        c.on_signaled_completion();
        assert_eq!(
            c.available(),
            4,
            "the first signaled request frees itself and the 3 before it"
        );
        let p = c.plan(2);
        assert_eq!(p.flags().collect::<Vec<_>>(), [false, true]);
        c.commit(p);
        assert_eq!(c.available(), 2);
        c.on_signaled_completion();
        c.on_signaled_completion();
        assert_eq!(c.available(), 8);
        assert!(c.is_idle());
        // Stray completions never create credits beyond the depth.
        c.on_signaled_completion();
        assert_eq!(c.available(), 8);
    }

    #[test]
    fn flushed_completions_free_like_successful_ones() {
        let mut c = SendCredits::new(16, 16);
        for n in [5, 7] {
            let p = c.plan(n);
            c.commit(p);
        }
        assert_eq!(c.available(), 4);
        // The QP fails: both signaled requests come back flushed, in order.
        c.on_signaled_completion();
        assert_eq!(c.available(), 9);
        c.on_signaled_completion();
        assert_eq!(c.available(), 16);
    }
}
