//! Tidemark's operator tools: the library behind `tidemark wm …`, `tidemark shard …` and
//! `tidemark trace`, built on the store crate and above it (nothing in the service imports
//! this crate). The binary parses arguments, calls one function here and prints what it
//! returns; exit codes stay the binary's.
//!
//! - [`wm`]: watermarks of a mailbox instance — create (`init`), read (`inspect`, `verify`),
//!   the offline downgrade to packed-v1, and why a watermark is missing.
//! - [`shard`]: maintenance of one shard — `fence` (raise its epoch), `rebase` (after a restore
//!   behind the trimmed log).
//! - [`status`]: live nodes and every shard's owner, epoch, W, head and lag.
//! - [`trace`]: follows one message from its log record to every mailbox entry, read-only.
//! - [`upgrade`]: raises a deployment's identity version from 2 to 3 (ADR-0056).
//!
//! Everything reads and writes Redis through the store crate's typed functions
//! ([`tidemark_store::redis::store::MailboxStore`], [`tidemark_store::inspect`],
//! [`tidemark_store::deployment`]); no raw command is sent from here.

pub mod shard;
pub mod status;
pub mod trace;
pub mod upgrade;
pub mod wm;

use tidemark_store::redis::watermark::Layout;

/// Parses a layout argument (`packed-v1`, `packed-v2`).
pub fn parse_layout(s: &str) -> Result<Layout, String> {
    s.parse()
}
