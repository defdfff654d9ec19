//! Shared by the tests that run `tidemark serve` as a child process.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

/// Spawns `cmd` so that it is SIGKILLed when the test process dies (PR_SET_PDEATHSIG), even if
/// the test panics before its drop handlers run.
pub fn spawn_killed_with_us(cmd: &mut Command) -> Child {
    // SAFETY: prctl is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().expect("spawn tidemark")
}
