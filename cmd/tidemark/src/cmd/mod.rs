//! One module per command group (tikv-ctl's `cmd/` layout): each holds its flags (clap
//! derive), calls one library function per command and prints what it returns. The work
//! itself is in the library crates.
//!
//! - [`serve`]: `up`, `serve` (the service: `tidemark_server::run`).
//! - [`wm`]: `wm …`, `shard …` (maintenance: `tidemark_ops::{wm, shard}`).
//! - [`trace`]: `trace` (`tidemark_ops::trace`); [`status`]: `status` (`tidemark_ops::status`).
//! - [`upgrade`]: `upgrade` (`tidemark_ops::upgrade`).
//! - [`bench`](mod@bench): `bench …` (`tidemark_bench`).
//! - [`client`]: `token`, `secret gen`, `send`, `tail` (`tidemark_client`).
//! - [`exit`]: the exit statuses of every command; [`logs`]: where stderr lines go.

pub mod args;
pub mod bench;
pub mod client;
pub mod exit;
pub mod logs;
pub mod serve;
pub mod status;
pub mod trace;
pub mod upgrade;
pub mod wm;

// ADR-0110: exit statuses of `wm init --force`, `status`, `wm verify`/`inspect` (real Redis)
#[cfg(test)]
mod ops_exit_tests;
