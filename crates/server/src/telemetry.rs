//! Process-wide telemetry: one Prometheus recorder for the `metrics` facade (installed once,
//! rendered by the gateway's `/metrics`), and `tracing` structured logs.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The Prometheus handle, installing the global recorder on first use. Several services in
/// one process (tests) share it.
pub fn metrics_handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(&[
                    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                ])
                .expect("static buckets")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (embedding); then ours only renders.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}
