//! Tidemark's storage layer on Redis.
//!
//! - [`redis::watermark`]: the packed per-shard watermark of ADR-0015 (codec, validation).
//! - [`redis::scripts`]: the Lua scripts, embedded with `include_str!`, in their packed-v1 and
//!   packed-v2 sets.
//! - [`redis::store`]: one typed wrapper per script, EVALSHA with NOSCRIPT recovery, and the
//!   only call site of `decode_lane_watermarks`.
//! - [`keys`] and [`routing`]: key names and the recipient → (shard, lane) hash.
//! - [`deployment`]: the deployment's identity recorded in every instance (shard count,
//!   instance positions, tables), checked before a process writes anything.

pub mod deployment;
pub mod error;
pub mod keys;
pub mod ops;
pub mod redis;
pub mod routing;
pub mod trace;
pub mod wake;

pub use error::Error;
