//! Exit statuses, one table for every command (scripts rely on them), and the mapping of a
//! store error to one of them.
//!
//! | status | meaning |
//! | --- | --- |
//! | 0 | done |
//! | 1 | failed (Redis, I/O, …: `error: …` on stderr); `wm downgrade` skipped a shard; `serve`/`up` whose stop was cut short (a second Ctrl-C or SIGTERM, or `--shutdown-timeout`, ADR-0122) |
//! | 2 | [`EXIT_REFUSED`]: refused, nothing was started or written (like clap's usage errors) |
//! | 3 | [`EXIT_CORRUPT`]: a corrupt watermark (`wm verify`, `status`: any shard whose watermark cannot be read; a `wm:{s}` that is not a hash) |
//! | 4 | [`EXIT_MISSING`]: a missing watermark |
//! | 5 | [`EXIT_PROBLEMS`]: `trace` found an inconsistency; `upgrade` raised the version but a process appeared meanwhile |

use std::process::ExitCode;

use tidemark_ops as ops;

/// Exit status for a corrupt watermark (scripts rely on it).
pub const EXIT_CORRUPT: u8 = 3;
/// Exit status for a missing watermark.
pub const EXIT_MISSING: u8 = 4;
/// Exit status for a refused configuration (bad token secret, unsafe flags): like clap's
/// usage errors, and nothing was started.
pub const EXIT_REFUSED: u8 = 2;
/// Exit status of a trace that found an inconsistency (listed as `problem` lines / in
/// "problems").
pub const EXIT_PROBLEMS: u8 = 5;

/// Prints `error: <why>` and returns [`EXIT_REFUSED`].
pub fn refuse(why: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {why}");
    ExitCode::from(EXIT_REFUSED)
}

/// [`store_exit`], and for a missing watermark one line on why (`ops::wm::explain_missing`).
pub async fn missing_or_store_exit(url: &str, shard: u32, e: &tidemark_store::Error) -> ExitCode {
    let code = store_exit(e);
    if e.code() == "no_watermark" {
        eprintln!("{}", ops::wm::explain_missing(url, shard).await);
    }
    code
}

/// Prints a store error (`corrupt: …` or `error: …`) and returns its status:
/// [`EXIT_CORRUPT`], [`EXIT_MISSING`] or 1.
pub fn store_exit(e: &tidemark_store::Error) -> ExitCode {
    if e.is_corrupt() {
        eprintln!("corrupt: {e}");
        ExitCode::from(EXIT_CORRUPT)
    } else if e.code() == "no_watermark" {
        eprintln!("error: {e}");
        ExitCode::from(EXIT_MISSING)
    } else {
        eprintln!("error: {e}");
        ExitCode::FAILURE
    }
}
