//! The shards a worker owns ([`OwnedShards`]): their states in one `Vec`, kept in shard order.
//!
//! A worker looks at every owned shard several times per step (the scan at its top, the
//! search for pending records, the hint and GC pass after it; ADR-0076, ADR-0077), and looks
//! one up by number for every shard a read returned. A worker owns a few dozen shards, fixed
//! at its start, so a sorted `Vec` walks them without a tree's pointer chasing and finds one by
//! a binary search (ADR-0078). The methods are the subset of `BTreeMap<u32, OwnedShard>`'s the
//! materializer used, with the same meaning, so the walks keep their shard order.

use std::ops::Index;

use super::shard::OwnedShard;

/// Every shard this worker owns (running or stopped), in ascending shard order, at most one
/// state per shard number (each state's `shard` field is its key).
#[derive(Default)]
pub(super) struct OwnedShards {
    shards: Vec<OwnedShard>,
}

impl OwnedShards {
    fn find(&self, s: u32) -> Result<usize, usize> {
        self.shards.binary_search_by_key(&s, |sh| sh.shard)
    }

    /// The state of shard `s`, if this worker owns it.
    pub(super) fn get(&self, s: &u32) -> Option<&OwnedShard> {
        self.find(*s).ok().map(|i| &self.shards[i])
    }

    /// The state of shard `s`, if this worker owns it, to change.
    pub(super) fn get_mut(&mut self, s: &u32) -> Option<&mut OwnedShard> {
        self.find(*s).ok().map(|i| &mut self.shards[i])
    }

    /// Adds shard `s`'s state (`sh.shard` must be `s`), or replaces it and returns the old
    /// one, as `BTreeMap::insert` does.
    pub(super) fn insert(&mut self, s: u32, sh: OwnedShard) -> Option<OwnedShard> {
        assert_eq!(sh.shard, s, "a shard's state is kept under its own number");
        match self.find(s) {
            Ok(i) => Some(std::mem::replace(&mut self.shards[i], sh)),
            Err(i) => {
                self.shards.insert(i, sh);
                None
            }
        }
    }

    /// The states in shard order.
    pub(super) fn values(&self) -> std::slice::Iter<'_, OwnedShard> {
        self.shards.iter()
    }

    /// The states in shard order, to change (never their `shard`: the order depends on it).
    pub(super) fn values_mut(&mut self) -> std::slice::IterMut<'_, OwnedShard> {
        self.shards.iter_mut()
    }

    /// The shard numbers, ascending.
    pub(super) fn keys(&self) -> impl Iterator<Item = &u32> + '_ {
        self.shards.iter().map(|sh| &sh.shard)
    }

    /// How many shards this worker owns.
    pub(super) fn len(&self) -> usize {
        self.shards.len()
    }
}

impl Index<&u32> for OwnedShards {
    type Output = OwnedShard;

    /// The state of shard `s`; panics if this worker does not own it (as `BTreeMap` does).
    fn index(&self, s: &u32) -> &OwnedShard {
        self.get(s).expect("a shard this worker owns")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn state(s: u32, tag: u64) -> OwnedShard {
        let mut sh = OwnedShard::stopped(s, 0);
        sh.read_pos = tag;
        sh
    }

    proptest! {
        /// Any sequence of inserts and lookups answers as a `BTreeMap` does, and walks in the
        /// same (shard) order.
        #[test]
        fn answers_as_a_btreemap(ops in prop::collection::vec((0u32..80, any::<u64>(), any::<bool>()), 0..200)) {
            let mut ours = OwnedShards::default();
            let mut model: BTreeMap<u32, u64> = BTreeMap::new();
            for (s, tag, insert) in ops {
                if insert {
                    let old = ours.insert(s, state(s, tag)).map(|sh| sh.read_pos);
                    prop_assert_eq!(old, model.insert(s, tag));
                } else {
                    prop_assert_eq!(ours.get(&s).map(|sh| sh.read_pos), model.get(&s).copied());
                    if let Some(sh) = ours.get_mut(&s) {
                        sh.read_pos = sh.read_pos.wrapping_add(1);
                        *model.get_mut(&s).unwrap() = sh.read_pos;
                    }
                }
            }
            prop_assert_eq!(ours.len(), model.len());
            let keys: Vec<u32> = ours.keys().copied().collect();
            prop_assert_eq!(keys, model.keys().copied().collect::<Vec<_>>());
            let vals: Vec<u64> = ours.values().map(|sh| sh.read_pos).collect();
            prop_assert_eq!(vals, model.values().copied().collect::<Vec<_>>());
            for (s, tag) in &model {
                prop_assert_eq!(ours[s].read_pos, *tag);
            }
        }
    }

    #[test]
    #[should_panic(expected = "its own number")]
    fn a_state_under_another_number_is_refused() {
        OwnedShards::default().insert(3, state(4, 0));
    }
}
