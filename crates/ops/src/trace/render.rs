//! The two forms of a [`Trace`]: one JSON object (`--json`) and the human text, several
//! lines with one table of recipients.

use tidemark_protocol::time::format_unix_us;

use super::report::{RecipientState, RecipientTrace, Trace, TraceStatus};

impl RecipientTrace {
    /// One human sentence for the state.
    pub fn describe(&self) -> String {
        match self.state {
            RecipientState::Materialised => "materialised, entry present".into(),
            RecipientState::AckedPossiblyTrimmed => {
                format!(
                    "materialised; acked, possibly trimmed (acked {})",
                    self.acked
                )
            }
            RecipientState::Missing => format!(
                "MISSING: lane W = {} passed the record, no entry, acked only {}",
                self.lane_w, self.acked
            ),
            RecipientState::PendingEntryWritten => format!(
                "pending (lane W = {}); entry written, not yet visible",
                self.lane_w
            ),
            RecipientState::Pending => format!("pending (lane W = {})", self.lane_w),
            RecipientState::LaneNotPresent => "lane not present (nothing materialised)".into(),
        }
    }
}

impl Trace {
    /// The `--json` form: one object.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("a trace serialises");
        if let Some(rs) = v.get_mut("recipients").and_then(|r| r.as_array_mut()) {
            for (j, r) in rs.iter_mut().enumerate() {
                r["materialised"] = self.recipients[j].state.is_materialised().into();
                r["detail"] = self.recipients[j].describe().into();
            }
        }
        v
    }

    /// The human form, several lines.
    pub fn to_human(&self) -> String {
        let (s, o) = (self.shard, self.offset);
        let mut out = format!(
            "trace shard {s} offset {o} ({} shards; core {}, mailbox {})\n",
            self.shards, self.core_url, self.mailbox_url
        );
        out.push_str(&format!(
            "log        dlog:{{{s}}} head {}, {}\n",
            self.log.head,
            match self.log.first {
                Some(f) => format!(
                    "holds offsets {f}..={} ({} records)",
                    self.log.head, self.log.len
                ),
                None => "empty (every record trimmed)".to_string(),
            }
        ));
        match &self.record {
            Some(r) => {
                out.push_str(&format!(
                    "record     offset {} prev {}, from {}, client id {}, sent_at {} ({} µs), \
                     body {} bytes\n",
                    r.offset,
                    r.prev,
                    one_line(&r.sender),
                    one_line(&r.client_id),
                    format_unix_us(r.sent_at_us),
                    r.sent_at_us,
                    r.body_bytes
                ));
                let names: Vec<String> = r.recipients.iter().map(|u| one_line(u)).collect();
                out.push_str(&format!(
                    "           recipients in this shard ({}): {}\n",
                    names.len(),
                    names.join(", ")
                ));
            }
            None => out.push_str(&format!(
                "record     offset {o}: record trimmed from the log (fully materialised); \
                 recipients below are the mailboxes of shard {s} that hold entry {o} (those \
                 that acked it and had it trimmed cannot be found)\n"
            )),
        }
        let w = &self.watermark;
        out.push_str(&format!(
            "watermark  wm:{{{s}}} {}, epoch {}, blob {} bytes, {}, W min {} max {}\n",
            w.layout,
            w.epoch,
            w.blob_bytes,
            if w.uniform { "uniform" } else { "diverged" },
            w.min_w.map_or("-".into(), |v| v.to_string()),
            w.max_w.map_or("-".into(), |v| v.to_string()),
        ));
        match &self.staging_lanes {
            Some(l) => {
                let l: Vec<String> = l.iter().map(|x| x.to_string()).collect();
                out.push_str(&format!(
                    "staging    stg:{{{s}}}:{o}: lanes durable: {}\n",
                    l.join(", ")
                ));
            }
            None => out.push_str(&format!(
                "staging    stg:{{{s}}}:{o}: none (hot path, or collected by GC)\n"
            )),
        }
        if self.recipients.is_empty() {
            out.push_str("recipients none found\n");
        } else {
            let width = self
                .recipients
                .iter()
                .map(|r| one_line(&r.user).chars().count())
                .max()
                .unwrap_or(4)
                .max(9);
            out.push_str(&format!(
                "  {:<width$}  lane  lane W  entry   acked  state\n",
                "recipient"
            ));
            for r in &self.recipients {
                out.push_str(&format!(
                    "  {:<width$}  {:>4}  {:>6}  {:<6}  {:>5}  {}\n",
                    one_line(&r.user),
                    r.lane,
                    if r.lane_present {
                        r.lane_w.to_string()
                    } else {
                        "-".into()
                    },
                    if r.entry.is_some() { "yes" } else { "no" },
                    r.acked,
                    r.describe()
                ));
            }
        }
        out.push_str(&format!(
            "status     {}\n",
            match self.status {
                TraceStatus::Materialised if self.trimmed =>
                    "materialised (record trimmed from the log)",
                TraceStatus::Materialised => "materialised for every recipient",
                TraceStatus::Pending => "pending: some lane W is still below the record",
                TraceStatus::Lost =>
                    "lost: not in the log, and the lowest W is below it (see the problems)",
            }
        ));
        for p in &self.problems {
            out.push_str(&format!("problem    {p}\n"));
        }
        out
    }
}

/// Control characters escaped, so that a user id stays on one line.
pub(super) fn one_line(s: &str) -> String {
    if s.chars().any(char::is_control) {
        s.escape_debug().to_string()
    } else {
        s.to_string()
    }
}
