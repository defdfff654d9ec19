//! The library side of the `tidemark` CLI's client commands: tokens, secrets, one-shot send,
//! tail, entry formatting and message ids.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Unix µs as an RFC 3339 UTC timestamp: the one formatter, in `tidemark_protocol::time`.
pub use tidemark_protocol::time::format_unix_us;
use tidemark_protocol::Entry;

use crate::client::{Auth, Client, Event, Offsets};
use crate::dedup::SeqDedup;
use crate::error::Error;

/// How long [`send_once`] waits for the `send_ack`.
pub const SEND_ONCE_TIMEOUT: Duration = Duration::from_secs(10);

/// The environment variable holding the token secret, when no secret file is given.
pub use tidemark_protocol::secret::SECRET_ENV_VAR;

fn now_since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// Signs a bearer token for `user`, valid for `ttl` from now (rounded up to whole seconds).
///
/// A zero `ttl`, or one whose expiry (unix seconds) would not fit a `u64`, is
/// [`Error::BadTtl`]: a token is never minted with a wrapped or saturated expiry.
///
/// # Panics
///
/// If `user` is not a valid user id (1..=128 bytes, no control character), like
/// [`tidemark_protocol::token::sign`]; check with [`tidemark_protocol::is_valid_user_id`]
/// first when the name comes from a user.
pub fn make_token(secret: &[u8], user: &str, ttl: Duration) -> Result<String, Error> {
    make_token_with(secret, user, ttl, false)
}

/// [`make_token`], or with `admin` an admin token (`"admin":true`: it may also read the
/// operator's `GET /v1/admin/status`; [`tidemark_protocol::token::sign_admin`]).
pub fn make_token_with(
    secret: &[u8],
    user: &str,
    ttl: Duration,
    admin: bool,
) -> Result<String, Error> {
    if ttl.is_zero() {
        return Err(Error::BadTtl(
            "a token lifetime of 0 is expired at once".into(),
        ));
    }
    let ttl_secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    let exp = now_since_epoch()
        .as_secs()
        .checked_add(ttl_secs)
        .ok_or_else(|| {
            Error::BadTtl(format!(
                "{ttl_secs} s from now is past the largest expiry a token can hold"
            ))
        })?;
    Ok(if admin {
        tidemark_protocol::token::sign_admin(secret, user, exp)
    } else {
        tidemark_protocol::token::sign(secret, user, exp)
    })
}

/// Parses a token lifetime: whole seconds with an optional unit, `s`, `m`, `h` or `d`
/// (`3600`, `90s`, `15m`, `24h`, `7d`). Zero, and a value whose number of seconds does not fit
/// a `u64` (e.g. `213503982334602d`), is [`Error::BadTtl`] rather than a wrapped value.
pub fn parse_ttl(s: &str) -> Result<Duration, Error> {
    let (num, mul) = match s.char_indices().last() {
        Some((i, 's')) => (&s[..i], 1),
        Some((i, 'm')) => (&s[..i], 60),
        Some((i, 'h')) => (&s[..i], 3600),
        Some((i, 'd')) => (&s[..i], 86400),
        _ => (s, 1),
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::BadTtl(format!(
            "{s:?} is not a duration (whole seconds with an optional unit: 90s, 15m, 24h, 7d)"
        )));
    }
    let secs = num
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| Error::BadTtl(format!("{s:?} is too large (more than 2^64-1 seconds)")))?;
    if secs == 0 {
        return Err(Error::BadTtl(format!(
            "{s:?}: a token lifetime of 0 is expired at once"
        )));
    }
    Ok(Duration::from_secs(secs))
}

/// Reads the token secret with the one loader all of Tidemark uses
/// ([`tidemark_protocol::secret::load`]): the contents of `secret_file` when given (an
/// unreadable file is an error, no fallback), else the value of the environment variable
/// `env_var` (normally [`SECRET_ENV_VAR`]); whitespace trimmed at both ends, at least
/// [`tidemark_protocol::secret::MIN_SECRET_BYTES`] bytes left, else [`Error::Secret`].
pub fn read_secret(secret_file: Option<&Path>, env_var: &str) -> Result<Vec<u8>, Error> {
    Ok(tidemark_protocol::secret::load(secret_file, env_var)?.into_bytes())
}

/// A fresh client message id, `cli-<unix_ms>-<16 hex digits>`.
///
/// The hex part hashes the time in nanoseconds, the process id and a process-wide counter
/// with std's randomly keyed SipHash, so ids differ across calls, processes and machines
/// with overwhelming probability.
pub fn new_message_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = now_since_epoch();
    let mut h = RandomState::new().build_hasher();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    format!("cli-{}-{:016x}", now.as_millis(), h.finish())
}

/// Connects, sends one message, waits for its `send_ack` ([`SEND_ONCE_TIMEOUT`]), closes,
/// and returns the shard offsets. `id` defaults to [`new_message_id`]; pass one explicitly
/// to be able to print it or retry with it (a retry after [`Error::retryable`] errors must
/// reuse the id).
pub async fn send_once(
    ws_url: &str,
    auth: &Auth,
    to: Vec<String>,
    body: String,
    id: Option<String>,
) -> Result<Offsets, Error> {
    let id = id.unwrap_or_else(new_message_id);
    let client = Client::connect(ws_url, auth).await?;
    let result = client
        .send_and_wait(&id, &to, &body, SEND_ONCE_TIMEOUT)
        .await;
    client.close().await;
    result
}

/// What [`tail_with`] does when the connection is lost.
#[derive(Debug, Clone, Copy)]
pub struct Reconnect {
    /// Stop trying (and return the last error) after this long without a connection.
    pub give_up_after: std::time::Duration,
}

/// Connects and streams the mailbox: every delivered entry is passed to `out` once (repeats
/// are dropped with [`SeqDedup`]), in arrival order. With `after`, sends `sync` first so
/// entries above `after` are delivered again (even below `ready.after`); with `ack`, acks
/// each entry's seq after `out` returns. Returns `Ok(())` when the connection closes, or
/// [`Error::Server`] if the server rejects one of its frames. [`tail_with`] reconnects.
pub async fn tail(
    ws_url: &str,
    auth: &Auth,
    after: Option<u64>,
    ack: bool,
    out: impl FnMut(&Entry),
) -> Result<(), Error> {
    tail_with(ws_url, auth, after, ack, None, out, |_| {}).await
}

/// [`tail`] that survives the server going away when `reconnect` is given: it reconnects with
/// a backoff (250 ms doubling to 5 s) and sends `sync` after the highest seq up to which it
/// has passed every entry to `out` (not merely the highest seen: entries of the stream from
/// `ready.after` can arrive before those of a `sync` below it), so nothing is skipped and
/// nothing is shown twice; retryable `error` frames (`internal`, `overloaded`) are reported
/// and the stream goes on. The backoff is reset only by a connection that delivered a new
/// entry or stayed up 10 s, so a server that accepts and closes at once is not hammered; a
/// connection closed before its `sync` could be queued is lost like any other. It gives up,
/// returning the last error, after `give_up_after` without a connection, or at once on an
/// error that no retry can fix (`unauthorized`, `token_expired`, …). `note` receives one line
/// for each of these events (connected, lost, reconnected, a retryable server error).
pub async fn tail_with(
    ws_url: &str,
    auth: &Auth,
    after: Option<u64>,
    ack: bool,
    reconnect: Option<Reconnect>,
    mut out: impl FnMut(&Entry),
    mut note: impl FnMut(&str),
) -> Result<(), Error> {
    let mut backoff = Backoff::default();
    let mut client = match reconnect {
        Some(r) => connect_retrying(ws_url, auth, r, &mut backoff, false, &mut note).await?,
        None => Client::connect(ws_url, auth).await?,
    };
    let start = after.unwrap_or(client.ready_after());
    let mut dedup = SeqDedup::new(start);
    let mut resume = Resume::new(start);
    resume.connected(client.ready_after());
    if let Some(after) = after {
        sync_or_lost(&client, after, reconnect.is_some()).await?;
    }
    note(&format!(
        "connected to {ws_url} as {}; streaming after {start}",
        client.user(),
    ));
    loop {
        let connected_at = std::time::Instant::now();
        let mut progressed = false;
        while let Some(event) = client.next_event().await {
            match event {
                Event::Deliver(entry) => {
                    resume.delivered(entry.seq);
                    if !dedup.admit(entry.seq) {
                        continue;
                    }
                    progressed = true;
                    out(&entry);
                    if ack {
                        // A failed ack means the connection is gone: the loop ends with Closed.
                        let _ = client.ack(entry.seq).await;
                    }
                }
                Event::Error { code, message, .. } => {
                    let e = Error::Server { code, message };
                    if reconnect.is_some() && e.retryable() {
                        note(&format!("server: {e} (the stream goes on)"));
                        continue;
                    }
                    client.close().await;
                    return Err(e);
                }
                Event::SendAck { .. } => {}
                Event::Closed => break,
            }
        }
        let Some(r) = reconnect else {
            return Ok(());
        };
        // A connection that brought something new, or lasted, ends a run of failures; one
        // that the server closed at once (a restart loop, a proxy without a backend) does
        // not, so the next attempt waits its turn.
        let stable = progressed || connected_at.elapsed() >= STABLE_CONNECTION;
        if stable {
            backoff.reset();
        }
        let last = resume.upto();
        note(&format!(
            "connection lost; reconnecting (resuming after {last})"
        ));
        client = connect_retrying(ws_url, auth, r, &mut backoff, !stable, &mut note).await?;
        resume.connected(client.ready_after());
        // A close read before the sync is queued is one more lost connection: the event
        // stream ends with Closed and the loop reconnects.
        sync_or_lost(&client, last, true).await?;
        note(&format!("reconnected; resuming after {last}"));
    }
}

/// How long a connection must stay up to reset [`tail_with`]'s reconnect backoff (when it
/// delivered nothing new).
const STABLE_CONNECTION: Duration = Duration::from_secs(10);

/// Queues `sync` after `after`. When the connection is already gone ([`Error::Closed`]) and
/// `reconnecting`, that is not an error: the event stream ends with [`Event::Closed`] and the
/// caller reconnects.
async fn sync_or_lost(client: &Client, after: u64, reconnecting: bool) -> Result<(), Error> {
    match client.sync(after).await {
        Err(Error::Closed) if reconnecting => Ok(()),
        r => r,
    }
}

/// Where [`tail_with`] resumes after a lost connection: the highest seq up to which every
/// entry above the start has been passed to `out` (not merely the highest seq seen).
///
/// A connection streams from its `ready.after` (the acked cursor) at once, and a `sync`
/// restarts the stream only when the server reads it (`docs/protocol.md`: deliveries in
/// flight arrive first). So `tail --after 100` with the cursor at 500 may see 501…520 before
/// 101…: resuming after 520 would skip 101…500 for good. Each of the two streams of a
/// connection is in seq order and without holes from where it starts, so a delivery moves the
/// resume point only when its stream started at or below it: the restarted stream always
/// (it starts at the resume point of the connect), the first one only when `ready.after` is
/// at or below the resume point. A delivery belongs to the restarted stream once a seq at or
/// below `ready.after`, or one not above the previous, has been seen on the connection.
#[derive(Debug, Clone)]
pub(crate) struct Resume {
    upto: u64,
    ready_after: u64,
    last: Option<u64>,
    restarted: bool,
}

impl Resume {
    /// Nothing passed yet above `start`.
    pub(crate) fn new(start: u64) -> Self {
        Resume {
            upto: start,
            ready_after: start,
            last: None,
            restarted: false,
        }
    }

    /// A new connection, whose first stream starts after `ready_after`; a `sync` after
    /// [`upto`](Resume::upto) follows.
    pub(crate) fn connected(&mut self, ready_after: u64) {
        self.ready_after = ready_after;
        self.last = None;
        self.restarted = false;
    }

    /// A `deliver` of `seq` arrived (new or a repeat: either way, passed to `out` by now).
    pub(crate) fn delivered(&mut self, seq: u64) {
        if seq <= self.ready_after || self.last.is_some_and(|l| seq <= l) {
            self.restarted = true;
        }
        self.last = Some(seq);
        if self.restarted || self.ready_after <= self.upto {
            self.upto = self.upto.max(seq);
        }
    }

    /// The seq to resume after.
    pub(crate) fn upto(&self) -> u64 {
        self.upto
    }
}

/// [`tail_with`]'s reconnect delays: 250 ms doubling to 5 s.
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(250);
    const MAX: Duration = Duration::from_secs(5);

    /// The delay to wait now; the next one doubles.
    fn step(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(Self::MAX);
        d
    }

    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: Self::FIRST }
    }
}

/// Connects, retrying retryable failures with `backoff` until `r.give_up_after`; with
/// `wait_first`, waits a step of the backoff before the first attempt too.
async fn connect_retrying(
    ws_url: &str,
    auth: &Auth,
    r: Reconnect,
    backoff: &mut Backoff,
    wait_first: bool,
    note: &mut impl FnMut(&str),
) -> Result<Client, Error> {
    let start = std::time::Instant::now();
    let mut reported = false;
    if wait_first {
        tokio::time::sleep(backoff.step()).await;
    }
    loop {
        match Client::connect(ws_url, auth).await {
            Ok(c) => return Ok(c),
            Err(e) if !e.retryable() || start.elapsed() >= r.give_up_after => {
                note(&format!("giving up: {e}"));
                return Err(e);
            }
            Err(e) => {
                if !reported {
                    note(&format!("cannot connect ({e}); retrying"));
                    reported = true;
                }
                let left = r.give_up_after.saturating_sub(start.elapsed());
                tokio::time::sleep(backoff.step().min(left)).await;
            }
        }
    }
}

/// One human-readable line for an entry: `#<seq> <UTC time> <from>: <body>`, e.g.
/// `#3471 2025-11-30T08:00:00.000000Z alice: hi`. Control characters in `from` and `body`
/// (newlines, tabs, escapes) are shown escaped (`\n`, `\u{1b}`) so the line stays one line.
pub fn format_entry(e: &Entry) -> String {
    format!(
        "#{} {} {}: {}",
        e.seq,
        format_unix_us(e.sent_at_us),
        one_line(&e.from),
        one_line(&e.body)
    )
}

fn one_line(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidemark_protocol::token::verify;

    fn entry(seq: u64, sent_at_us: u64, from: &str, body: &str) -> Entry {
        Entry {
            seq,
            from: from.into(),
            body: body.into(),
            sent_at_us,
        }
    }

    #[test]
    fn format_entry_line() {
        assert_eq!(
            format_entry(&entry(3471, 1_764_489_600_000_000, "alice", "hi")),
            "#3471 2025-11-30T08:00:00.000000Z alice: hi"
        );
        assert_eq!(
            format_entry(&entry(
                1,
                1_764_489_600_123_456,
                "bob",
                "two\nlines\tand \u{1b}[31m"
            )),
            "#1 2025-11-30T08:00:00.123456Z bob: two\\nlines\\tand \\u{1b}[31m"
        );
        assert_eq!(
            format_entry(&entry(0, 0, "Ünï", "")),
            "#0 1970-01-01T00:00:00.000000Z Ünï: "
        );
    }

    #[test]
    fn make_token_verifies() {
        let secret = b"client test secret";
        let now = now_since_epoch().as_secs();
        let t = make_token(secret, "alice", Duration::from_secs(3600)).unwrap();
        let claims = verify(secret, &t, now).unwrap();
        assert_eq!(claims.user, "alice");
        assert!((now + 3600..=now + 3602).contains(&claims.expires_at_unix));
        // Expired once the ttl has passed; wrong secret never verifies.
        assert_eq!(
            verify(secret, &t, claims.expires_at_unix)
                .unwrap_err()
                .code(),
            "token_expired"
        );
        assert_eq!(
            verify(b"other", &t, now).unwrap_err().code(),
            "token_bad_signature"
        );
        // A sub-second ttl rounds up: still valid right now.
        let t = make_token(secret, "bob", Duration::from_millis(1)).unwrap();
        assert!(verify(secret, &t, now).is_ok());
        assert!(!verify(secret, &t, now).unwrap().admin);
        // admin tokens carry the claim
        let t = make_token_with(secret, "ops", Duration::from_secs(60), true).unwrap();
        let claims = verify(secret, &t, now).unwrap();
        assert_eq!((claims.user.as_str(), claims.admin), ("ops", true));
    }

    #[test]
    #[should_panic(expected = "token user")]
    fn make_token_refuses_empty_user() {
        let _ = make_token(b"s", "", Duration::from_secs(1));
    }

    #[test]
    fn ttls() {
        for (s, secs) in [
            ("1", 1),
            ("3600", 3600),
            ("90s", 90),
            ("15m", 900),
            ("24h", 86400),
            ("7d", 604800),
            ("213503982334601d", 213_503_982_334_601 * 86400),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(parse_ttl(s).unwrap(), Duration::from_secs(secs), "{s}");
        }
        for s in [
            "",
            "s",
            "d",
            "0",
            "0s",
            "0d",
            "-1",
            "+5",
            "1.5h",
            "1w",
            "24 h",
            " 24h",
            "1e3",
            // overflow: 213503982334602 days and 2^64 seconds
            "213503982334602d",
            "18446744073709551616",
            "18446744073709551615m",
            "999999999999999999999999h",
        ] {
            let e = parse_ttl(s).unwrap_err();
            assert_eq!(e.code(), "bad_ttl", "{s}");
        }
        assert!(parse_ttl("213503982334602d")
            .unwrap_err()
            .to_string()
            .contains("too large"));
        assert!(parse_ttl("0").unwrap_err().to_string().contains("0"));
        // an expiry that does not fit u64 and a zero ttl are refused by make_token too
        for ttl in [Duration::from_secs(u64::MAX), Duration::ZERO] {
            assert_eq!(make_token(b"s", "a", ttl).unwrap_err().code(), "bad_ttl");
        }
    }

    #[test]
    fn read_secret_sources() {
        let dir = std::env::temp_dir().join(format!("tidemark-client-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        let good = "0123456789abcdef0123456789abcdef";
        std::fs::write(&file, format!("{good} \n\r\n")).unwrap();
        // Unique variable names: tests run in parallel threads.
        let var = "TIDEMARK_CLIENT_TEST_SECRET_A";
        std::env::set_var(var, format!(" {good}-env\n"));
        assert_eq!(read_secret(Some(&file), var).unwrap(), good.as_bytes());
        assert_eq!(
            read_secret(None, var).unwrap(),
            format!("{good}-env").as_bytes()
        );

        // Refusals: (file, variable, code, what the message names).
        let missing = dir.join("missing");
        let unset = "TIDEMARK_CLIENT_TEST_SECRET_UNSET";
        let refusals = [
            (Some(missing.as_path()), var, "secret_unreadable", "missing"),
            (None, unset, "secret_missing", unset),
        ];
        for (file, var, code, named) in refusals {
            let e = read_secret(file, var).unwrap_err();
            assert_eq!(e.code(), code, "{e}");
            assert!(e.to_string().contains(named), "{e}");
        }
        for short in ["\n", "  \t ", "short secret"] {
            std::fs::write(&file, short).unwrap();
            let e = read_secret(Some(&file), var).unwrap_err();
            assert_eq!(e.code(), "secret_too_short", "{short:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The resume point moves only over entries known to follow it without a hole: with
    /// `tail --after 100` and the cursor at 500, the stream from 500 in flight before the
    /// sync does not move it; the restarted stream does.
    #[test]
    fn resume_point_skips_nothing() {
        let mut r = Resume::new(100);
        r.connected(500);
        for seq in 501..=520 {
            r.delivered(seq);
        }
        assert_eq!(r.upto(), 100);
        r.delivered(101); // the restarted stream: below what came before
        r.delivered(102);
        assert_eq!(r.upto(), 102);
        r.delivered(600); // still the restarted stream
        assert_eq!(r.upto(), 600);

        // Reconnected with the cursor at 500 again: its stream (501, …) does not move the
        // point; the restarted one, starting at or below ready.after, does.
        let mut r = Resume::new(100);
        r.connected(500);
        r.delivered(501);
        assert_eq!(r.upto(), 100);
        let mut r2 = r.clone();
        r.delivered(150); // at or below ready.after: restarted
        assert_eq!(r.upto(), 150);
        r2.delivered(501); // a repeat: restarted
        assert_eq!(r2.upto(), 501);

        // A cursor at or below the point: every entry follows the point without a hole.
        let mut r = Resume::new(100);
        r.connected(100);
        r.delivered(105);
        r.delivered(110);
        assert_eq!(r.upto(), 110);
        r.connected(90);
        r.delivered(95); // a repeat below the point: no move back
        assert_eq!(r.upto(), 110);
        r.delivered(120);
        assert_eq!(r.upto(), 120);
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut b = Backoff::default();
        let steps: Vec<u64> = (0..7).map(|_| b.step().as_millis() as u64).collect();
        assert_eq!(steps, [250, 500, 1000, 2000, 4000, 5000, 5000]);
        b.reset();
        assert_eq!(b.step(), Duration::from_millis(250));
    }

    #[test]
    fn message_ids_are_fresh() {
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| new_message_id()).collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            let parts: Vec<&str> = id.split('-').collect();
            assert_eq!(parts.len(), 3, "{id}");
            assert_eq!(parts[0], "cli");
            assert!(parts[1].parse::<u64>().unwrap() > 1_700_000_000_000);
            assert_eq!(parts[2].len(), 16);
            assert!(parts[2].chars().all(|c| c.is_ascii_hexdigit()));
            assert!(id.len() <= 128);
        }
    }
}
