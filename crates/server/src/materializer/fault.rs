//! Fault injection for tests and fault runs: a hook the chunked path asks before each lane
//! chunk write (and the hint publisher before each wake hint), and a hash-based one for
//! `serve --fault-chunk-fail-pct`.

/// Fault injection for tests and fault runs.
pub trait ChunkFault: Send + Sync {
    /// True: skip this lane chunk write, as if it had failed; `attempt` counts from 0 per
    /// (record, lane).
    fn fail(&self, shard: u32, offset: u64, lane: usize, attempt: u32) -> bool;

    /// True: panic just before record `offset` of `shard` is routed (tests of supervision).
    fn panic_before(&self, _shard: u32, _offset: u64) -> bool {
        false
    }

    /// True: wake hint number `seq` of `shard` is lost on its way (counted as published, never
    /// sent; tests of the gateways' gap detection and sweep, ADR-0035).
    fn lose_hint(&self, _shard: u32, _seq: u64) -> bool {
        false
    }

    /// Called once a lane chunk of record `offset` of `shard` is written, before the advance
    /// that relies on it: a test's hook may remove it from the instance, as a failover to a
    /// replica that had not received it would (ADR-0112).
    fn chunk_written(&self, _shard: u32, _offset: u64, _lane: usize) {}

    /// True: the replies of a hot-path step whose batch of `shard` starts at record `offset`
    /// are lost after its scripts ran, as when the connection drops after Redis executed
    /// them: the step fails as a whole (tests of moves nobody saw applied, ADR-0062).
    fn lose_replies(&self, _shard: u32, _offset: u64) -> bool {
        false
    }

    /// True: the reply of the re-fence of `shard` to `epoch` (a watermark gone back,
    /// ADR-0100) is lost after its script ran, as when the connection drops during the same
    /// failover: the resync fails, and the epoch stored may or may not be the one it asked
    /// for (tests of ADR-0120).
    fn lose_fence_reply(&self, _shard: u32, _epoch: u64) -> bool {
        false
    }
}

/// Fails a given percentage of lane chunk writes, decided by a hash of (shard, offset, lane,
/// attempt), so every chunk eventually lands. For fault runs (`serve --fault-chunk-fail-pct`).
#[derive(Debug, Clone, Copy)]
pub struct RandomChunkFault {
    /// 0..=100; 100 is capped at 90 so that retries can succeed.
    pub percent: u8,
}

impl ChunkFault for RandomChunkFault {
    fn fail(&self, shard: u32, offset: u64, lane: usize, attempt: u32) -> bool {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&(shard, offset, lane, attempt), &mut h);
        let roll = std::hash::Hasher::finish(&h) % 100;
        roll < u64::from(self.percent.min(90))
    }
}
