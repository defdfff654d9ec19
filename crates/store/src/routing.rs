//! Recipient → (shard, lane): one stable 64-bit hash (xxh3) of the recipient id;
//! `shard = h % S`, `lane = (h >> 32) % 64`.

use crate::redis::watermark::LANES;

/// Where a recipient's mailbox lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Route {
    /// Shard `0..S`.
    pub shard: u32,
    /// Lane `0..64`.
    pub lane: usize,
}

/// Routes `id` in a deployment of `shards` shards.
pub fn route(id: &str, shards: u32) -> Route {
    assert!(shards > 0, "a deployment has at least one shard");
    let h = xxhash_rust::xxh3::xxh3_64(id.as_bytes());
    Route {
        shard: (h % u64::from(shards)) as u32,
        lane: ((h >> 32) % LANES as u64) as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_and_in_range() {
        let a = route("alice", 64);
        assert_eq!(a, route("alice", 64));
        for i in 0..1000 {
            let r = route(&format!("u{i}"), 7);
            assert!(r.shard < 7 && r.lane < 64);
        }
    }
}
