//! Tidemark's benchmarks.
//!
//! - [`lua`]: the Lua micro-benchmark of ADR-0015 — server-side µs per `EVALSHA` of each
//!   watermark script in its packed-v1 and packed-v2 form, a no-op baseline, and the four
//!   uniform checks the ADR compares. Measured in isolation against a real `redis-server`.
//! - [`load`]: the end-to-end load generator of ADR-0015's "Measured" table (SYSTEM.md §6):
//!   open-loop clients against a fresh local deployment per layout (or a remote one), e2e and
//!   SEND_ACK latency from the intended send time, Redis-side `INFO` deltas, the markdown
//!   table, JSON, and the capacity ladder.
//! - [`idle`]: what connected clients that send nothing cost (server CPU and RSS, Redis
//!   commands/s by command), up to tens of thousands of connections from one machine.
//! - [`plot`]: PNG and SVG figures of those runs, drawn with an embedded font.
//! - [`relay`]: a yardstick, not a server: a WebSocket relay of the client protocol without
//!   Redis, whose CPU per message under `bench load --target` is the floor of the socket work.
//! - [`catchup`] and [`commit`]: the engine's own ceilings without WebSockets — how fast the
//!   materializers drain a backlog, and how many commits per second the gateway's commit path
//!   reaches ([`engine`] holds what they share).

pub mod catchup;
pub mod commit;
pub mod engine;
pub mod idle;
pub mod load;
pub mod lua;
pub mod plot;
pub mod relay;

pub use lua::{LuaBenchOptions, LuaBenchReport};
