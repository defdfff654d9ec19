//! Progress bars (indicatif, on stderr, only with `progress`): one while clients connect,
//! one while sending and draining, refreshed by [`tick`] with the acks, deliveries and the
//! current send rate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;

use super::shared::Shared;
use crate::load::LoadOptions;

/// Progress-bar refresh.
const TICK: Duration = Duration::from_millis(250);

/// A bar of `len` steps drawn with `template`; hidden without `opts.progress`.
pub(super) fn bar(opts: &LoadOptions, len: u64, template: &str) -> ProgressBar {
    if !opts.progress {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb
}

/// Refreshes the sending bar every [`TICK`] until `stop`.
pub(super) async fn tick(
    pb: ProgressBar,
    shared: Arc<Shared>,
    sent: Arc<AtomicU64>,
    stop: CancellationToken,
    fanout: u64,
) {
    let mut last = (Instant::now(), 0u64);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = sleep(TICK) => {}
        }
        let now = Instant::now();
        let s = sent.load(Ordering::Relaxed);
        let rate = (s - last.1) as f64 / now.duration_since(last.0).as_secs_f64().max(1e-3);
        last = (now, s);
        pb.set_position(s);
        pb.set_message(format!(
            "acked {} delivered {}/{} rate {:.0}/s",
            shared.acks.total(),
            shared.delivered.load(Ordering::Relaxed),
            s * fanout,
            rate
        ));
    }
}
