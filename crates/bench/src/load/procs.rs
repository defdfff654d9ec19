//! CPU and memory of the OS processes a run can see: this one (`/proc/self`: user + system
//! CPU, resident memory) and each remote gateway, from its `/metrics`
//! (`process_cpu_seconds_total`, `process_resident_memory_bytes`, which the gateway sets
//! from its own `/proc/self` when the page is requested).

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::info::ReadPolicy;
use super::Error;

/// A process's counters at one instant.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcSample {
    pub at: Instant,
    /// User + system CPU, seconds.
    pub cpu_s: Option<f64>,
    /// Resident memory, bytes.
    pub rss_bytes: Option<u64>,
}

/// This process, now (Linux; `None` figures elsewhere).
pub(crate) fn self_sample() -> ProcSample {
    // SAFETY: sysconf only reads configuration values.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let cpu_s = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            // the command name (field 2) may hold spaces: count the fields after its ')'
            let rest = stat.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            // after ')' the state is field 3, so utime (14) and stime (15) are at 11 and 12
            let u: f64 = f.get(11)?.parse().ok()?;
            let s: f64 = f.get(12)?.parse().ok()?;
            (ticks > 0).then(|| (u + s) / ticks as f64)
        });
    let rss_bytes = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|statm| statm.split_whitespace().nth(1)?.parse::<u64>().ok())
        .filter(|_| page > 0)
        .map(|pages| pages * page as u64);
    ProcSample {
        at: Instant::now(),
        cpu_s,
        rss_bytes,
    }
}

/// `http://host:port/metrics` of a gateway's `ws://host:port/…` URL (the client listener,
/// which serves `/metrics` unless the gateway has an admin listener: then give its URL).
pub fn metrics_url_of(ws_url: &str) -> String {
    let (scheme, rest) = match ws_url.split_once("://") {
        Some(("wss", rest)) => ("https", rest),
        Some((_, rest)) => ("http", rest),
        None => ("http", ws_url),
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    format!("{scheme}://{authority}/metrics")
}

/// A gateway's `/metrics`, read over plain HTTP/1.0.
pub(crate) struct MetricsSource {
    pub url: String,
    /// `host:port` to connect to.
    addr: String,
    /// `Host` header.
    host: String,
    path: String,
    policy: ReadPolicy,
}

impl MetricsSource {
    /// `url`: `http://host[:port]/path` (`https` is not supported: use the gateway's admin
    /// listener, which is plain HTTP).
    pub fn new(url: &str, policy: ReadPolicy) -> Result<MetricsSource, Error> {
        let bad = |why: &str| Error::Invalid(format!("metrics URL {url:?}: {why}"));
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad("want http://host:port/metrics (plain HTTP: the admin listener)"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/metrics"),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(bad("want http://host:port/metrics"));
        }
        let has_port = match authority.rsplit_once(':') {
            Some((_, p)) => !p.contains(']'),
            None => false,
        };
        let addr = if has_port {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        Ok(MetricsSource {
            url: url.to_owned(),
            addr,
            host: authority.to_owned(),
            path: path.to_owned(),
            policy,
        })
    }

    /// One reading, retried per the policy; `Err` says why it is missing.
    pub async fn sample(&self) -> Result<ProcSample, String> {
        self.policy
            .run(|_| self.read_once())
            .await
            .map_err(|why| format!("{}: {why}", self.url))
    }

    async fn read_once(&self) -> Result<ProcSample, String> {
        /// Larger pages are refused (a gateway's is a few tens of KiB).
        const MAX: u64 = 16 << 20;
        let mut stream = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| e.to_string())?;
        let request = format!(
            "GET {} HTTP/1.0\r\nHost: {}\r\nUser-Agent: tidemark-bench\r\n\r\n",
            self.path, self.host
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut bytes = Vec::new();
        (&mut stream)
            .take(MAX)
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| e.to_string())?;
        let at = Instant::now();
        let text = String::from_utf8_lossy(&bytes);
        let (head, body) = text.split_once("\r\n\r\n").ok_or("not an HTTP response")?;
        let status = head.lines().next().unwrap_or_default();
        if status.split_whitespace().nth(1) != Some("200") {
            return Err(format!(
                "{status} (with an admin listener, give its URL: --metrics-url)"
            ));
        }
        let (cpu_s, rss) = parse_metrics(body);
        if cpu_s.is_none() {
            return Err("no process_cpu_seconds_total on the page".into());
        }
        Ok(ProcSample {
            at,
            cpu_s,
            rss_bytes: rss.map(|b| b as u64),
        })
    }
}

/// `process_cpu_seconds_total` and `process_resident_memory_bytes` of a Prometheus text page.
pub(crate) fn parse_metrics(text: &str) -> (Option<f64>, Option<f64>) {
    let mut cpu = None;
    let mut rss = None;
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        let (Some(name), Some(value)) = (parts.next(), parts.next()) else {
            continue;
        };
        let slot = match name {
            "process_cpu_seconds_total" => &mut cpu,
            "process_resident_memory_bytes" => &mut rss,
            _ => continue,
        };
        *slot = value.parse::<f64>().ok().filter(|v| v.is_finite());
    }
    (cpu, rss)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let a = self_sample();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let b = self_sample();
        let (a_cpu, b_cpu) = (a.cpu_s.unwrap(), b.cpu_s.unwrap());
        assert!(b_cpu >= a_cpu, "{a_cpu} {b_cpu}");
        assert!(b.rss_bytes.unwrap() > 1 << 20);
    }

    #[test]
    fn metrics_urls() {
        assert_eq!(
            metrics_url_of("ws://127.0.0.1:7400/v1/ws"),
            "http://127.0.0.1:7400/metrics"
        );
        assert_eq!(
            metrics_url_of("wss://gw.example:443/v1/ws?x=1"),
            "https://gw.example:443/metrics"
        );
        let p = ReadPolicy::default();
        let m = MetricsSource::new("http://127.0.0.1:9100/metrics", p).unwrap();
        assert_eq!(
            (m.addr.as_str(), m.path.as_str()),
            ("127.0.0.1:9100", "/metrics")
        );
        let m = MetricsSource::new("http://[::1]", p).unwrap();
        assert_eq!((m.addr.as_str(), m.path.as_str()), ("[::1]:80", "/metrics"));
        for bad in ["https://h:1/metrics", "ws://h:1/", "http:///metrics"] {
            assert!(MetricsSource::new(bad, p).is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_metrics() {
        let page = "# HELP process_cpu_seconds_total User and system CPU time.\n\
                    # TYPE process_cpu_seconds_total gauge\n\
                    process_cpu_seconds_total 12.5\n\
                    process_resident_memory_bytes 104857600\n\
                    tidemark_open_connections 3\n";
        assert_eq!(parse_metrics(page), (Some(12.5), Some(104_857_600.0)));
        assert_eq!(parse_metrics(""), (None, None));
    }
}
