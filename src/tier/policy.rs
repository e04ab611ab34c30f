//! Which block a full tier gives up: a pluggable policy per tier, LRU by default.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// The replacement policy of one tier. The cache tells it which blocks enter, are used and
/// leave; it names a victim when the tier is full.
pub trait Policy: Send {
    /// `block` entered the tier.
    fn added(&mut self, block: u64);
    /// `block` was used (a request asked for it).
    fn touched(&mut self, block: u64);
    /// `block` left the tier.
    fn removed(&mut self, block: u64);
    /// The block to give up, skipping those `keep` holds on to (`None`: none can go).
    fn victim(&self, keep: &dyn Fn(u64) -> bool) -> Option<u64>;
}

/// Least recently used.
#[derive(Debug, Default)]
pub struct Lru {
    clock: u64,
    last: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl Lru {
    fn stamp(&mut self, block: u64) {
        self.clock += 1;
        if let Some(old) = self.last.insert(block, self.clock) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, block);
    }
}

impl Policy for Lru {
    fn added(&mut self, block: u64) {
        self.stamp(block);
    }

    fn touched(&mut self, block: u64) {
        if self.last.contains_key(&block) {
            self.stamp(block);
        }
    }

    fn removed(&mut self, block: u64) {
        if let Some(old) = self.last.remove(&block) {
            self.by_age.remove(&old);
        }
    }

    fn victim(&self, keep: &dyn Fn(u64) -> bool) -> Option<u64> {
        self.by_age.values().copied().find(|&b| !keep(b))
    }
}

/// First in, first out: use does not matter (a baseline to compare LRU with).
#[derive(Debug, Default)]
pub struct Fifo {
    order: VecDeque<u64>,
}

impl Policy for Fifo {
    fn added(&mut self, block: u64) {
        self.order.push_back(block);
    }

    fn touched(&mut self, _block: u64) {}

    fn removed(&mut self, block: u64) {
        self.order.retain(|&b| b != block);
    }

    fn victim(&self, keep: &dyn Fn(u64) -> bool) -> Option<u64> {
        self.order.iter().copied().find(|&b| !keep(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiered_lru_gives_up_the_least_recently_used_block() {
        let mut p = Lru::default();
        for b in [1, 2, 3] {
            p.added(b);
        }
        p.touched(1);
        assert_eq!(p.victim(&|_| false), Some(2));
        assert_eq!(p.victim(&|b| b == 2), Some(3));
        p.removed(2);
        p.touched(9); // not in the tier: ignored
        assert_eq!(p.victim(&|_| false), Some(3));
        assert_eq!(p.victim(&|_| true), None);
        let mut f = Fifo::default();
        for b in [1, 2, 3] {
            f.added(b);
        }
        f.touched(1);
        assert_eq!(f.victim(&|_| false), Some(1));
    }
}
