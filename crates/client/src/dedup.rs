//! Dropping repeated deliveries.

use std::collections::BTreeSet;

/// Remembers which mailbox seqs were already processed, so repeats are dropped.
///
/// The protocol delivers at least once: reconnects, `sync` and retries repeat entries, and
/// after a `sync` below the current position, entries of the old stream still in flight
/// arrive *before* the restarted stream's lower seqs. The plain rule "drop a seq at or below
/// the highest seen" would then lose the restarted stream; this keeps the set of seqs seen
/// above a floor instead, so every seq above the floor is admitted exactly once, in whatever
/// order it arrives.
///
/// Memory is bounded: past `capacity` remembered seqs, the smallest is forgotten and becomes
/// the floor (a seq at or below it is then treated as seen).
#[derive(Debug, Clone)]
pub struct SeqDedup {
    floor: u64,
    seen: BTreeSet<u64>,
    capacity: usize,
}

impl SeqDedup {
    /// Default number of seqs remembered above the floor.
    pub const DEFAULT_CAPACITY: usize = 65_536;

    /// Admits seqs strictly above `floor` (e.g. `ready.after`, or the `after` of a `sync`).
    pub fn new(floor: u64) -> Self {
        Self::with_capacity(floor, Self::DEFAULT_CAPACITY)
    }

    /// Like [`new`](SeqDedup::new), remembering at most `capacity` (≥ 1) seqs.
    pub fn with_capacity(floor: u64, capacity: usize) -> Self {
        SeqDedup {
            floor,
            seen: BTreeSet::new(),
            capacity: capacity.max(1),
        }
    }

    /// Whether `seq` is new (and records it): false for a seq at or below the floor or
    /// already admitted.
    pub fn admit(&mut self, seq: u64) -> bool {
        if seq <= self.floor || !self.seen.insert(seq) {
            return false;
        }
        if self.seen.len() > self.capacity {
            if let Some(min) = self.seen.pop_first() {
                self.floor = min;
            }
        }
        true
    }

    /// The highest seq admitted so far (or the floor).
    pub fn highest(&self) -> u64 {
        self.seen.last().copied().unwrap_or(self.floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_each_seq_once_above_the_floor() {
        let mut d = SeqDedup::new(10);
        assert!(!d.admit(3));
        assert!(!d.admit(10));
        assert!(d.admit(11));
        assert!(d.admit(50));
        assert!(!d.admit(50));
        // A restarted stream's lower seqs after in-flight higher ones.
        assert!(d.admit(20));
        assert!(!d.admit(11));
        assert_eq!(d.highest(), 50);
    }

    #[test]
    fn capacity_moves_the_floor() {
        let mut d = SeqDedup::with_capacity(0, 2);
        assert!(d.admit(5));
        assert!(d.admit(6));
        assert!(d.admit(7)); // forgets 5, floor becomes 5
        assert!(!d.admit(5));
        assert!(!d.admit(4));
        assert!(!d.admit(6));
        assert!(d.admit(8));
        assert_eq!(d.highest(), 8);
        assert_eq!(SeqDedup::new(9).highest(), 9);
    }
}
