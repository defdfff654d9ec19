//! Tidemark's benchmarks.
//!
//! - [`lua`]: the Lua micro-benchmark of ADR-0015 — server-side µs per `EVALSHA` of each
//!   watermark script in its packed-v1 and packed-v2 form, a no-op baseline, and the four
//!   uniform checks the ADR compares. Measured in isolation against a real `redis-server`.
//!
//! The end-to-end load generator will live next to it as its own module.

pub mod lua;

pub use lua::{LuaBenchOptions, LuaBenchReport};
