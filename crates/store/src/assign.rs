//! Which node should own which shard: a balanced assignment every node computes on its own
//! from the same list of live nodes, without a coordinator (issue 13, ADR-0030).
//!
//! ```text
//! capacity(node i of N, nodes sorted by id) = ⌊S/N⌋ + (1 if i < S mod N)
//! score(node, shard)                        = xxh3_64("<node id>\0<shard>")
//! pairs (shard, node) by score, highest first; a pair is taken when its shard is still free
//! and its node still has capacity.
//! ```
//!
//! Every node gets ⌊S/N⌋ or ⌈S/N⌉ shards. A shard goes to the node that scores it highest
//! unless that node is full, so when a node joins or leaves mostly the shards it takes or
//! gives move (rendezvous hashing with capacities), not a reshuffle of everything. Nodes that
//! see the same live set compute the same answer; while views differ, leases keep one owner
//! per shard and the assignment converges once they agree.

/// Which nodes may own shards: of `nodes` (id, the watermark layout it writes), those writing
/// the newest layout among them (ADR-0033). During a rolling upgrade from packed-v1 to
/// packed-v2 the shards therefore go to the upgraded nodes only, as soon as one is live: each
/// shard moves once from old code to new and is never assigned back to old code, which could
/// not own it once converted. A node that names no layout (a build before ADR-0033) ranks
/// below every layout; a layout this code does not know ranks above every layout it knows (it
/// is newer). Returns the ids in the order given.
pub fn eligible(nodes: &[(String, Option<String>)]) -> Vec<&str> {
    let newest = nodes.iter().map(|(_, l)| layout_rank(l.as_deref())).max();
    nodes
        .iter()
        .filter(|(_, l)| Some(layout_rank(l.as_deref())) == newest)
        .map(|(id, _)| id.as_str())
        .collect()
}

fn layout_rank(layout: Option<&str>) -> u8 {
    use crate::redis::watermark::Layout;
    match layout.map(|l| Layout::from_bytes(l.as_bytes())) {
        None => 0,
        Some(Some(Layout::PackedV1)) => 1,
        Some(Some(Layout::PackedV2)) => 2,
        Some(None) => u8::MAX,
    }
}

/// For each shard `0..shards`, the index in `nodes` of the node that should own it. `nodes`
/// must be non-empty, without duplicates; its order does not matter (ties in capacity are
/// broken by id, not by position).
pub fn balanced(shards: u32, nodes: &[String]) -> Vec<usize> {
    assert!(!nodes.is_empty(), "an assignment needs at least one node");
    let n = nodes.len();
    let mut by_id: Vec<usize> = (0..n).collect();
    by_id.sort_by(|&a, &b| nodes[a].cmp(&nodes[b]));
    let (base, extra) = (shards as usize / n, shards as usize % n);
    let mut capacity = vec![0usize; n];
    for (rank, &i) in by_id.iter().enumerate() {
        capacity[i] = base + usize::from(rank < extra);
    }
    let mut pairs: Vec<(u64, u32, usize)> = Vec::with_capacity(shards as usize * n);
    for s in 0..shards {
        for (i, node) in nodes.iter().enumerate() {
            pairs.push((score(node, s), s, i));
        }
    }
    // highest score first; ties (practically never) by shard, then by node id
    pairs.sort_unstable_by(|a, b| {
        b.0.cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(nodes[a.2].cmp(&nodes[b.2]))
    });
    let mut owner = vec![usize::MAX; shards as usize];
    let mut left = shards as usize;
    for (_, s, i) in pairs {
        if left == 0 {
            break;
        }
        if owner[s as usize] == usize::MAX && capacity[i] > 0 {
            owner[s as usize] = i;
            capacity[i] -= 1;
            left -= 1;
        }
    }
    owner
}

/// Moves, in `owner` (from [`balanced`] over `nodes`), each shard whose owner has not reached
/// the shard's core instance (`core_of`) to the node that reaches it with the highest score
/// for the shard (ADR-0113): `unreached[i]` lists the core instances `nodes[i]` has not
/// reached for a lease TTL. A shard no node reaches keeps its owner (the instance is down for
/// everyone: nothing to gain by moving it). Every node computes the same result from the same
/// live list. Capacity is not balanced again: a node that cannot reach an instance is the
/// exception, and the shards it gives up spread over the others by score.
pub fn around_unreached(
    owner: &mut [usize],
    nodes: &[String],
    unreached: &[Vec<usize>],
    core_of: impl Fn(u32) -> usize,
) {
    if unreached.iter().all(Vec::is_empty) {
        return;
    }
    for (s, o) in owner.iter_mut().enumerate() {
        let s = s as u32;
        let core = core_of(s);
        if !unreached[*o].contains(&core) {
            continue;
        }
        let best = (0..nodes.len())
            .filter(|&i| !unreached[i].contains(&core))
            .max_by(|&a, &b| {
                score(&nodes[a], s)
                    .cmp(&score(&nodes[b], s))
                    .then(nodes[b].cmp(&nodes[a]))
            });
        if let Some(i) = best {
            *o = i;
        }
    }
}

fn score(node: &str, shard: u32) -> u64 {
    let mut key = Vec::with_capacity(node.len() + 6);
    key.extend_from_slice(node.as_bytes());
    key.push(0);
    key.extend_from_slice(&shard.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("node-{i}")).collect()
    }

    /// The owner id of every shard.
    fn owners(shards: u32, nodes: &[String]) -> Vec<String> {
        balanced(shards, nodes)
            .into_iter()
            .map(|i| nodes[i].clone())
            .collect()
    }

    proptest! {
        #[test]
        fn every_node_gets_floor_or_ceil(shards in 1u32..300, n in 1usize..9) {
            let nodes = ids(n);
            let a = balanced(shards, &nodes);
            let mut count = vec![0u32; n];
            for &i in &a {
                prop_assert!(i < n);
                count[i] += 1;
            }
            let (lo, hi) = (shards / n as u32, shards.div_ceil(n as u32));
            prop_assert!(count.iter().all(|&c| c == lo || c == hi), "{count:?}");
        }

        #[test]
        fn the_order_of_the_list_does_not_matter(shards in 1u32..200, n in 1usize..7, rot in 0usize..7) {
            let nodes = ids(n);
            let mut turned = nodes.clone();
            turned.rotate_left(rot % n);
            prop_assert_eq!(owners(shards, &nodes), owners(shards, &turned));
        }
    }

    #[test]
    fn only_the_newest_layout_owns_shards() {
        let n = |id: &str, l: Option<&str>| (id.to_string(), l.map(str::to_string));
        let v1 = Some("packed-v1");
        let v2 = Some("packed-v2");
        // all old: all eligible
        assert_eq!(eligible(&[n("a", v1), n("b", v1)]), ["a", "b"]);
        // one upgraded: only it
        assert_eq!(eligible(&[n("a", v1), n("b", v2), n("c", v1)]), ["b"]);
        assert_eq!(eligible(&[n("a", v2), n("b", v2), n("c", v1)]), ["a", "b"]);
        // a record without a layout ranks lowest; an unknown layout highest
        assert_eq!(eligible(&[n("a", None), n("b", v1)]), ["b"]);
        assert_eq!(eligible(&[n("a", None), n("b", None)]), ["a", "b"]);
        assert_eq!(eligible(&[n("a", v2), n("b", Some("packed-v3"))]), ["b"]);
        assert!(eligible(&[]).is_empty());
    }

    /// A node joining takes about its share; the others keep the rest.
    #[test]
    fn a_join_or_a_leave_moves_about_one_share() {
        for (shards, n) in [(64u32, 2usize), (64, 3), (256, 4), (1024, 7)] {
            let before = owners(shards, &ids(n));
            let after = owners(shards, &ids(n + 1));
            let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
            let share = shards.div_ceil(n as u32 + 1) as usize;
            // the newcomer's share, plus a little reshuffling among full nodes
            assert!(
                moved <= share + share / 2 + n,
                "{shards}/{n}: moved {moved}, share {share}"
            );
            let back = owners(shards, &ids(n));
            assert_eq!(back, before, "leaving again restores the assignment");
        }
    }

    /// ADR-0113: the shards of a core instance a node does not reach go to the nodes that
    /// reach it; nothing else moves; an instance nobody reaches moves nothing.
    #[test]
    fn a_shard_goes_around_a_node_that_does_not_reach_its_core() {
        let nodes = ids(3);
        let core_of = |s: u32| (s % 2) as usize;
        let plain = balanced(64, &nodes);
        let moved = |unreached: Vec<Vec<usize>>| {
            let mut owner = plain.clone();
            around_unreached(&mut owner, &nodes, &unreached, core_of);
            owner
        };
        assert_eq!(moved(vec![vec![], vec![], vec![]]), plain);
        let owner = moved(vec![vec![], vec![1], vec![]]);
        for s in 0..64u32 {
            let (was, is) = (plain[s as usize], owner[s as usize]);
            if core_of(s) == 1 && was == 1 {
                assert_ne!(
                    is, 1,
                    "shard {s} still on the node that cannot reach core 1"
                );
            } else {
                assert_eq!(is, was, "shard {s} moved for nothing");
            }
        }
        assert!(plain
            .iter()
            .enumerate()
            .any(|(s, &o)| o == 1 && core_of(s as u32) == 1));
        // every node computes the same, whatever the order it lists the nodes in
        let mut rev_nodes = nodes.clone();
        rev_nodes.reverse();
        let mut rev = balanced(64, &rev_nodes);
        around_unreached(&mut rev, &rev_nodes, &[vec![], vec![1], vec![]], core_of);
        for s in 0..64 {
            assert_eq!(rev_nodes[rev[s]], nodes[owner[s]], "shard {s}");
        }
        // core 1 down for everyone: nothing moves
        assert_eq!(moved(vec![vec![1], vec![1], vec![1]]), plain);
    }
}
