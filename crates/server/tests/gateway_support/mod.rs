//! A whole deployment for gateway tests: one core and one mailbox `redis-server` (real
//! processes), 4 shards in packed-v2, a materializer owning all of them, and the gateway on
//! a loopback port. Plus a small WebSocket client (tokio-tungstenite) and a raw HTTP/1.1
//! client, each waiting with bounded timeouts only.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tidemark_protocol::token;
use tidemark_redis_proc::RedisProcess;
use tidemark_server::gateway::{serve, GatewayError, GatewayOptions};
use tidemark_server::health::HealthBoard;
use tidemark_server::materializer::{MaterializerOptions, Worker};
use tidemark_server::run::{self, Running, ServeOptions};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{Route, Topology};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::{HeaderName, HeaderValue};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::{CancellationToken, DropGuard};

/// Shards of the test deployment.
pub const SHARDS: u32 = 4;

/// Routing in a `SHARDS`-shard deployment.
pub fn route(user: &str) -> Route {
    let t = tidemark_store::topology::Topology::single(SHARDS, Layout::PackedV2, "", "");
    t.validate().unwrap().route(user)
}
/// Token secret of the test gateway.
pub const SECRET: &[u8] = b"gateway test secret";
/// Bound of every single wait.
pub const WAIT: Duration = Duration::from_secs(5);

/// A running deployment.
pub struct Deployment {
    /// Cancels everything when the deployment is dropped.
    _stop: DropGuard,
    pub addr: SocketAddr,
    pub cancel: CancellationToken,
    pub health: Arc<HealthBoard>,
    pub mailbox_url: String,
    pub core_url: String,
    serve: Option<JoinHandle<Result<(), GatewayError>>>,
    worker: Option<JoinHandle<()>>,
    // Dropped last: the Redis processes (killed on drop).
    _core: RedisProcess,
    _mailbox: RedisProcess,
}

/// Starts a deployment whose gateway runs with `dev_auth` on.
pub async fn start() -> Deployment {
    start_with(|_| {}).await
}

/// Starts a deployment; `tweak` adjusts the gateway options (dev auth on, token secret set).
pub async fn start_with(tweak: impl FnOnce(&mut GatewayOptions)) -> Deployment {
    start_full(tweak, MaterializerOptions::default()).await
}

/// Starts a deployment with `materializer` options (e.g. a chunk fault that holds a lane);
/// `tweak` adjusts the gateway options.
pub async fn start_full(
    tweak: impl FnOnce(&mut GatewayOptions),
    materializer: MaterializerOptions,
) -> Deployment {
    let (core, mailbox) = redis_pair();
    let (core_url, mailbox_url) = (core.url(), mailbox.url());
    let topology = Topology::new(
        SHARDS,
        Layout::PackedV2,
        vec![core_url.clone()],
        vec![mailbox_url.clone()],
    );
    let mut store = MailboxStore::connect(&mailbox_url, Layout::PackedV2)
        .await
        .expect("mailbox store");
    for s in 0..SHARDS {
        store
            .init_watermark(s, Layout::PackedV2, 1, 0, false)
            .await
            .expect("init watermark");
    }
    let mut opts = GatewayOptions {
        token_secret: Some(SECRET.to_vec()),
        dev_auth: true,
        recheck_interval: None,
        ..GatewayOptions::default()
    };
    tweak(&mut opts);
    // one process, as `run::serve` wires it (ADR-0041)
    let mut materializer = materializer;
    tidemark_server::gateway::LocalDelivery::wire(&mut opts, &mut materializer);
    let cancel = CancellationToken::new();
    let health = Arc::new(HealthBoard::default());
    let owned: Vec<u32> = (0..SHARDS).collect();
    let map = topology.validate().expect("topology");
    let worker = Worker::start(
        map.clone(),
        0,
        vec![store],
        &owned,
        materializer,
        health.clone(),
    )
    .await
    .expect("materializer start");
    let worker = tokio::spawn({
        let cancel = cancel.clone();
        async move {
            worker.run(cancel).await.expect("materializer run");
        }
    });

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let serve = tokio::spawn(serve(listener, map, opts, health.clone(), cancel.clone()));
    Deployment {
        _stop: cancel.clone().drop_guard(),
        addr,
        cancel,
        health,
        mailbox_url,
        core_url,
        serve: Some(serve),
        worker: Some(worker),
        _core: core,
        _mailbox: mailbox,
    }
}

/// A deployment (dev auth) and `user`'s socket, past its `ready`.
pub async fn start_as(user: &str) -> (Deployment, Ws) {
    let d = start().await;
    let ws = d.ready(user).await;
    (d, ws)
}

/// A deployment in which `from` sent `n` messages to `to` (`msg(i)`: the id and body of the
/// i-th), each acked and delivered to `to` in order: the deployment, `from`'s and `to`'s
/// sockets (connected in that order) and `to`'s seqs.
pub async fn start_exchange(
    from: &str,
    to: &str,
    n: usize,
    msg: impl Fn(usize) -> (String, String),
) -> (Deployment, Ws, Ws, Vec<u64>) {
    let d = start().await;
    let (mut a, mut b) = d.pair(from, to).await;
    let seqs = a.send_many(to, n, msg).await;
    b.expect_seqs(&seqs).await;
    (d, a, b, seqs)
}

/// A core and a mailbox `redis-server`.
fn redis_pair() -> (RedisProcess, RedisProcess) {
    let core = RedisProcess::start().expect("core redis-server");
    (core, RedisProcess::start().expect("mailbox redis-server"))
}

/// Options of `run::serve` for one core and one mailbox instance (`SHARDS` shards in
/// packed-v2) on a loopback port.
pub fn serve_options(
    core_url: String,
    mailbox_url: String,
    gateway: GatewayOptions,
    materializer: MaterializerOptions,
) -> ServeOptions {
    ServeOptions {
        topology: Topology::new(SHARDS, Layout::PackedV2, vec![core_url], vec![mailbox_url]),
        listen: "127.0.0.1:0".parse().unwrap(),
        gateway,
        materializer,
        owned_shards: None,
        node: None,
    }
}

/// The real service (`run::serve`) on loopback with dev auth and two real redis-servers.
pub struct Service {
    /// Cancels the service when it is dropped.
    _stop: DropGuard,
    running: Option<Running>,
    pub core_url: String,
    pub mailbox_url: String,
    _core: RedisProcess,
    _mailbox: RedisProcess,
}

impl Service {
    /// Starts the service with these options.
    pub async fn start(gateway: GatewayOptions, materializer: MaterializerOptions) -> Service {
        let (core, mailbox) = redis_pair();
        let (core_url, mailbox_url) = (core.url(), mailbox.url());
        let opts = serve_options(core_url.clone(), mailbox_url.clone(), gateway, materializer);
        let cancel = CancellationToken::new();
        let running = run::serve(opts, cancel.clone()).await.expect("serve");
        Service {
            _stop: cancel.drop_guard(),
            running: Some(running),
            core_url,
            mailbox_url,
            _core: core,
            _mailbox: mailbox,
        }
    }

    pub fn running(&self) -> &Running {
        self.running.as_ref().unwrap()
    }

    /// `GET path` on the gateway over plain HTTP: status and body.
    pub async fn get_text(&self, path: &str) -> (u16, String) {
        http_at(self.running().addr, "GET", path, &[], None).await
    }

    /// `POST path` on the gateway over plain HTTP: status and JSON reply ([`json_reply`]).
    pub async fn post_json(&self, path: &str, body: &str) -> (u16, Value) {
        json_reply(
            http_at(
                self.running().addr,
                "POST",
                path,
                &[],
                Some(body.as_bytes()),
            )
            .await,
        )
    }

    /// Shuts the service down and checks it stopped cleanly, in time.
    pub async fn stop(mut self) {
        let running = self.running.take().unwrap();
        tokio::time::timeout(2 * WAIT, running.shutdown())
            .await
            .expect("service did not stop in time")
            .expect("service stopped with an error");
    }
}

/// Unix seconds now.
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A valid token for `user`.
pub fn token_for(user: &str) -> String {
    token::sign(SECRET, user, now_unix() + 3600)
}

/// Users `prefix0`, `prefix1`, … whose shards are pairwise different (`n <= SHARDS`).
pub fn users_in_distinct_shards(prefix: &str, n: usize) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for i in 0.. {
        let u = format!("{prefix}{i}");
        if seen.insert(route(&u).shard) {
            out.push(u);
            if out.len() == n {
                break;
            }
        }
    }
    out
}

/// The shard of `user`.
pub fn shard_of(user: &str) -> u32 {
    route(user).shard
}

/// `user`'s offset in the offsets (by shard) of a `send_ack`.
pub fn offset_of(offsets: &serde_json::Map<String, Value>, user: &str) -> u64 {
    offsets[&shard_of(user).to_string()].as_u64().unwrap()
}

/// `user`'s offset in the `offsets` of a reply (`send_ack` frame or HTTP send).
pub fn seq_in(reply: &Value, user: &str) -> u64 {
    reply["offsets"][shard_of(user).to_string()]
        .as_u64()
        .unwrap_or_else(|| panic!("no offset for {user}: {reply}"))
}

/// The bodies of a mailbox page's entries, in order.
pub fn bodies(page: &Value) -> Vec<&str> {
    let entries = page["entries"].as_array().unwrap();
    entries
        .iter()
        .map(|e| e["body"].as_str().unwrap())
        .collect()
}

/// Asserts an HTTP reply is the JSON error `code` with `status`.
pub fn assert_error(reply: &(u16, Value), status: u16, code: &str) {
    let (got, v) = reply;
    assert_eq!(
        (*got, v["error"]["code"].as_str()),
        (status, Some(code)),
        "{v}"
    );
}

/// Polls `f` (every 20 ms, at most `WAIT`) until it gives a value.
pub async fn poll<T, F, Fut>(what: &str, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    poll_within(what, WAIT, f).await
}

/// Polls `f` (every 20 ms, at most `limit`) until it gives a value.
pub async fn poll_within<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `f` (every 20 ms, at most `WAIT`) until it holds.
pub async fn until<F, Fut>(what: &str, f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    until_within(what, WAIT, f).await
}

/// Polls `f` (every 20 ms, at most `limit`) until it holds.
pub async fn until_within<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    poll_within(what, limit, || {
        let held = f();
        async move { held.await.then_some(()) }
    })
    .await
}

/// How many calls of `command` (lower case, as `INFO commandstats` names it) the Redis at `url`
/// has served so far (scripts' own calls included).
pub async fn command_calls(url: &str, command: &str) -> u64 {
    let mut c = redis_at(url).await;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.split(',').next())
        .map_or(0, |v| v.parse().unwrap())
}

/// A connection to the Redis at `url`.
pub async fn redis_at(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).expect("redis URL");
    let conn = client.get_multiplexed_async_connection().await;
    conn.expect("redis connection")
}

/// Connects to the gateway at `addr` with `query`; a refused upgrade gives its status and
/// body.
pub async fn try_ws_at(
    addr: SocketAddr,
    query: &str,
    headers: &[(&str, &str)],
) -> Result<Ws, (u16, String)> {
    let mut req = format!("ws://{addr}/v1/ws?{query}")
        .into_client_request()
        .unwrap();
    for (k, v) in headers {
        let name = HeaderName::from_bytes(k.as_bytes()).unwrap();
        req.headers_mut()
            .insert(name, HeaderValue::from_str(v).unwrap());
    }
    let r = tokio::time::timeout(WAIT, tokio_tungstenite::connect_async(req))
        .await
        .expect("ws connect timed out");
    match r {
        Ok((stream, _)) => Ok(Ws {
            stream,
            pending: VecDeque::new(),
        }),
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            let status = resp.status().as_u16();
            let body = resp
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            Err((status, body))
        }
        Err(e) => panic!("ws connect failed: {e}"),
    }
}

/// Connects to the gateway at `addr` with dev auth as `user` and reads its `ready` frame.
pub async fn ready_at(addr: SocketAddr, user: &str) -> Ws {
    let mut ws = match try_ws_at(addr, &format!("user={}", encode(user)), &[]).await {
        Ok(ws) => ws,
        Err((status, body)) => panic!("upgrade refused: {status} {body}"),
    };
    let ready = ws.recv().await;
    assert_eq!(ready["type"], "ready", "{ready}");
    ws
}

impl Deployment {
    /// `ws://…/v1/ws?<query>`.
    pub fn ws_url(&self, query: &str) -> String {
        format!("ws://{}/v1/ws?{query}", self.addr)
    }

    /// Connects with dev auth as `user`.
    pub async fn ws_user(&self, user: &str) -> Ws {
        self.ws(&format!("user={}", encode(user)), &[]).await
    }

    /// Connects (panics on a refused upgrade).
    pub async fn ws(&self, query: &str, headers: &[(&str, &str)]) -> Ws {
        match self.try_ws(query, headers).await {
            Ok(ws) => ws,
            Err((status, body)) => panic!("upgrade refused: {status} {body}"),
        }
    }

    /// Connects with dev auth as `user` and reads its `ready` frame.
    pub async fn ready(&self, user: &str) -> Ws {
        ready_at(self.addr, user).await
    }

    /// Connects with `query` (e.g. `token=…`) and reads its `ready` frame.
    pub async fn ready_query(&self, query: &str) -> Ws {
        let mut ws = self.ws(query, &[]).await;
        let ready = ws.recv().await;
        assert_eq!(ready["type"], "ready", "{ready}");
        ws
    }

    /// [`Deployment::ready`] for each of `users`, in order.
    pub async fn ready_all<U: AsRef<str>>(&self, users: impl IntoIterator<Item = U>) -> Vec<Ws> {
        let mut all = Vec::new();
        for u in users {
            all.push(self.ready(u.as_ref()).await);
        }
        all
    }

    /// Connects with dev auth as `user`, expecting the stream to resume after `after`.
    pub async fn resume(&self, user: &str, after: u64) -> Ws {
        let mut ws = self.ws_user(user).await;
        ws.expect_ready(user, after).await;
        ws
    }

    /// [`Deployment::ready`] for `first`, then for `second`.
    pub async fn pair(&self, first: &str, second: &str) -> (Ws, Ws) {
        let a = self.ready(first).await;
        (a, self.ready(second).await)
    }

    /// Connects, expecting the upgrade to be refused: its status and body.
    pub async fn refused(&self, query: &str, headers: &[(&str, &str)]) -> (u16, String) {
        let r = self.try_ws(query, headers).await;
        r.err()
            .unwrap_or_else(|| panic!("upgrade accepted: {query:?}"))
    }

    /// Connects; a refused upgrade gives its status and body.
    pub async fn try_ws(&self, query: &str, headers: &[(&str, &str)]) -> Result<Ws, (u16, String)> {
        try_ws_at(self.addr, query, headers).await
    }

    /// One HTTP/1.1 request (`Connection: close`); returns status and body.
    pub async fn http(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> (u16, String) {
        let (status, text) =
            tokio::time::timeout(WAIT, http_at(self.addr, method, path, headers, body))
                .await
                .expect("http request timed out");
        assert_ne!(status, 0, "bad response: {text:?}");
        (status, text)
    }

    /// `GET path` (no headers), the JSON reply parsed.
    pub async fn get(&self, path: &str) -> (u16, Value) {
        json_reply(self.get_text(path).await)
    }

    /// `GET path` (no headers): status and body text.
    pub async fn get_text(&self, path: &str) -> (u16, String) {
        self.http("GET", path, &[], None).await
    }

    /// `POST /v1/messages` as `user` (dev auth) with the JSON `body`.
    pub async fn post_message(&self, user: &str, body: &[u8]) -> (u16, Value) {
        self.post(&format!("/v1/messages?user={user}"), body).await
    }

    /// `POST /v1/mailbox/ack` as `user` (dev auth) with `{"seq":seq}`.
    pub async fn ack(&self, user: &str, seq: u64) -> (u16, Value) {
        let body = format!(r#"{{"seq":{seq}}}"#);
        self.post(&format!("/v1/mailbox/ack?user={user}"), body.as_bytes())
            .await
    }

    /// `method path` with `Authorization: Bearer token`, the JSON reply parsed.
    pub async fn with_token(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<&[u8]>,
    ) -> (u16, Value) {
        let auth = format!("Bearer {token}");
        json_reply(
            self.http(method, path, &[("Authorization", &auth)], body)
                .await,
        )
    }

    /// `POST path` with a JSON `body` (no headers), the JSON reply parsed.
    pub async fn post(&self, path: &str, body: &[u8]) -> (u16, Value) {
        json_reply(self.http("POST", path, &[], Some(body)).await)
    }

    /// A command on the core Redis (a connection of its own).
    pub async fn core_cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.core().await;
        let r = redis::cmd(args[0])
            .arg(&args[1..])
            .query_async(&mut c)
            .await;
        r.unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// A connection to the core Redis.
    pub async fn core(&self) -> redis::aio::MultiplexedConnection {
        redis_at(&self.core_url).await
    }

    /// Pauses every client of the core Redis for `ms` milliseconds (CLIENT PAUSE … ALL).
    pub async fn pause_core(&self, ms: u64) {
        let mut c = self.core().await;
        let paused: redis::RedisResult<()> = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(ms)
            .arg("ALL")
            .query_async(&mut c)
            .await;
        paused.expect("CLIENT PAUSE");
    }

    /// Waits until the entry `seq` is visible in `user`'s mailbox (materialised).
    pub async fn wait_visible(&self, user: &str, seq: u64) {
        let path = format!("/v1/mailbox?user={user}&limit=1&after={}", seq - 1);
        until("never materialized", || async {
            let (_, page) = self.get(&path).await;
            !page["entries"].as_array().unwrap().is_empty()
        })
        .await
    }

    /// Stops everything and checks the gateway returned (joined its tasks) in time.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        let serve = self.serve.take().unwrap();
        let r = tokio::time::timeout(WAIT, serve)
            .await
            .expect("gateway did not stop in time")
            .expect("gateway task panicked");
        r.expect("gateway returned an error");
        let worker = self.worker.take().unwrap();
        tokio::time::timeout(WAIT, worker)
            .await
            .expect("materializer did not stop in time")
            .expect("materializer panicked");
    }
}

/// Percent-encodes everything but unreserved characters.
pub fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One HTTP/1.1 request (`Connection: close`) on `io`, to `host`: the status (0: no HTTP
/// response at all) and the body (de-chunked).
pub async fn request_on<S: AsyncRead + AsyncWrite + Unpin>(
    io: S,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, String) {
    let (status, _, body) = request_on_full(io, host, method, path, headers, body).await;
    (status, body)
}

/// [`request_on`], with the response head (status line and headers) too.
pub async fn request_on_full<S: AsyncRead + AsyncWrite + Unpin>(
    mut io: S,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, String, String) {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body.unwrap_or_default());
    // The server may answer (and close) before reading a body it refuses, or not speak HTTP.
    let _ = io.write_all(&bytes).await;
    let mut resp = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(WAIT, io.read(&mut buf)).await {
            Err(_) => panic!("no end of response: {:?}", String::from_utf8_lossy(&resp)),
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => resp.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&resp).into_owned();
    let Some((status, head, rest)) = split_response(&text) else {
        return (0, String::new(), text);
    };
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, head.to_string(), body)
}

/// One HTTP/1.1 request to `addr` over plain TCP, as [`request_on`].
pub async fn http_at(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, String) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    request_on(tcp, &addr.to_string(), method, path, headers, body).await
}

/// [`http_at`] with the response head: (status, head, body).
pub async fn http_full(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, String, String) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let host = addr.to_string();
    let r = request_on_full(tcp, &host, method, path, headers, body);
    tokio::time::timeout(WAIT, r)
        .await
        .expect("http request timed out")
}

/// The value of header `name` in a response head (case-insensitive), if any.
pub fn header_value<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// A raw HTTP/1.1 response's status, head and body; None when it is not one.
pub fn split_response(text: &str) -> Option<(u16, &str, &str)> {
    if !text.starts_with("HTTP/1.1 ") {
        return None;
    }
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, head, rest))
}

/// A JSON reply parsed (panics if it is not JSON).
pub fn json_reply((status, text): (u16, String)) -> (u16, Value) {
    let v =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {status} {text:?}"));
    (status, v)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// A WebSocket client that reads JSON frames with bounded waits.
pub struct Ws {
    stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
    /// Frames read while looking for another one.
    pending: VecDeque<Value>,
}

impl Ws {
    /// Sends a text frame.
    pub async fn send_text(&mut self, text: &str) {
        self.stream
            .send(Message::Text(text.into()))
            .await
            .expect("ws send");
    }

    /// Sends a JSON frame.
    pub async fn send_json(&mut self, v: &Value) {
        self.send_text(&v.to_string()).await;
    }

    /// Sends a binary frame.
    pub async fn send_binary(&mut self, b: &[u8]) {
        self.stream
            .send(Message::Binary(b.to_vec().into()))
            .await
            .expect("ws send");
    }

    /// The next JSON frame from the socket (not the pending queue).
    async fn read_frame(&mut self) -> Value {
        loop {
            let msg = tokio::time::timeout(WAIT, self.stream.next())
                .await
                .expect("no frame within the wait")
                .expect("socket closed")
                .expect("socket error");
            match msg {
                Message::Text(t) => return serde_json::from_str(t.as_str()).expect("JSON frame"),
                Message::Ping(_) | Message::Pong(_) => continue,
                other => panic!("unexpected message {other:?}"),
            }
        }
    }

    /// The next frame (pending ones first).
    pub async fn recv(&mut self) -> Value {
        match self.pending.pop_front() {
            Some(v) => v,
            None => self.read_frame().await,
        }
    }

    /// The first frame matching `pred`; the others stay pending, in order.
    pub async fn recv_where(&mut self, pred: impl Fn(&Value) -> bool) -> Value {
        if let Some(i) = self.pending.iter().position(&pred) {
            return self.pending.remove(i).unwrap();
        }
        loop {
            let v = self.read_frame().await;
            if pred(&v) {
                return v;
            }
            self.pending.push_back(v);
        }
    }

    /// Takes the first pending frame matching `pred`, without reading the socket.
    pub fn try_pending(&mut self, pred: impl Fn(&Value) -> bool) -> Option<Value> {
        let i = self.pending.iter().position(pred)?;
        self.pending.remove(i)
    }

    /// The next frame of type `ty` (other types stay pending).
    pub async fn recv_type(&mut self, ty: &str) -> Value {
        self.recv_where(|v| v["type"] == ty).await
    }

    /// Sends an `ack` frame.
    pub async fn ack(&mut self, seq: u64) {
        self.send_json(&json!({"type":"ack","seq":seq})).await;
    }

    /// Sends a `sync` frame for `after` and expects exactly `seqs` delivered next, in order.
    pub async fn sync_expect(&mut self, after: u64, seqs: &[u64]) {
        self.send_json(&json!({"type":"sync","after":after})).await;
        self.expect_seqs(seqs).await;
    }

    /// Sends a `send` frame without waiting for its answer.
    pub async fn send_only(&mut self, id: &str, to: &[&str], body: &str) {
        self.send_json(&json!({"type":"send","id":id,"to":to,"body":body}))
            .await;
    }

    /// Sends a message and returns its `send_ack` or `error` (other frames stay pending).
    pub async fn send_msg(&mut self, id: &str, to: &[&str], body: &str) -> Value {
        self.send_only(id, to, body).await;
        self.recv_where(|v| (v["type"] == "send_ack" || v["type"] == "error") && v["id"] == id)
            .await
    }

    /// Sends and expects a `send_ack`; returns its offsets.
    pub async fn send_ok(
        &mut self,
        id: &str,
        to: &[&str],
        body: &str,
    ) -> serde_json::Map<String, Value> {
        let r = self.send_msg(id, to, body).await;
        assert_eq!(r["type"], "send_ack", "{r}");
        r["offsets"].as_object().unwrap().clone()
    }

    /// Sends and expects the error `code` for it (echoing `id`); returns the error frame.
    pub async fn send_refused(&mut self, id: &str, to: &[&str], body: &str, code: &str) -> Value {
        let r = self.send_msg(id, to, body).await;
        assert_eq!(
            (r["type"].as_str(), r["code"].as_str()),
            (Some("error"), Some(code)),
            "{r}"
        );
        assert_eq!(r["id"], id, "{r}");
        r
    }

    /// Sends `n` messages to `to`, one after the other (`msg(i)`: the id and body of the
    /// i-th), each acked; returns `to`'s seqs.
    pub async fn send_many(
        &mut self,
        to: &str,
        n: usize,
        msg: impl Fn(usize) -> (String, String),
    ) -> Vec<u64> {
        let mut seqs = Vec::new();
        for i in 0..n {
            let (id, body) = msg(i);
            seqs.push(offset_of(&self.send_ok(&id, &[to], &body).await, to));
        }
        seqs
    }

    /// Expects the next deliveries to be exactly `seqs`, in order.
    pub async fn expect_seqs(&mut self, seqs: &[u64]) {
        for s in seqs {
            assert_eq!(self.deliver().await["seq"].as_u64(), Some(*s));
        }
    }

    /// Expects the next frame to be `ready` for `user`, resuming after `after`.
    pub async fn expect_ready(&mut self, user: &str, after: u64) {
        let ready = self.recv().await;
        assert_eq!(ready, json!({"type":"ready","user":user,"after":after}));
    }

    /// Expects the next delivery to be `body` at `seq`; returns it.
    pub async fn expect_message(&mut self, seq: u64, body: &str) -> Value {
        let m = self.deliver().await;
        assert_eq!(
            (m["seq"].as_u64(), m["body"].as_str()),
            (Some(seq), Some(body)),
            "{m}"
        );
        m
    }

    /// The next `deliver` frame.
    pub async fn deliver(&mut self) -> Value {
        self.recv_type("deliver").await
    }

    /// A barrier: sends a frame of an unknown type and waits for its error. Frames are
    /// handled in order, so everything sent before has been processed.
    pub async fn barrier(&mut self) {
        self.send_text(r#"{"type":"barrier"}"#).await;
        let e = self
            .recv_where(|v| v["type"] == "error" && v["code"] == "unknown_type")
            .await;
        assert_eq!(e["type"], "error");
    }

    /// Waits for the server's close frame; returns its code.
    pub async fn closed(&mut self) -> Option<u16> {
        loop {
            let msg = tokio::time::timeout(WAIT, self.stream.next())
                .await
                .expect("no close within the wait");
            match msg {
                None => return None,
                Some(Err(_)) => return None,
                Some(Ok(Message::Close(f))) => return f.map(|f| u16::from(f.code)),
                Some(Ok(_)) => continue,
            }
        }
    }

    /// Reads (answering pings) for `d`; returns the JSON frames that arrived. Panics if the
    /// connection ends meanwhile.
    pub async fn quiet_for(&mut self, d: Duration) -> Vec<Value> {
        let until = tokio::time::Instant::now() + d;
        let mut got = Vec::new();
        loop {
            let msg = match tokio::time::timeout_at(until, self.stream.next()).await {
                Err(_) => return got,
                Ok(m) => m,
            };
            match msg {
                Some(Ok(Message::Text(t))) => {
                    got.push(serde_json::from_str(t.as_str()).expect("JSON frame"))
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                other => panic!("connection ended while quiet: {other:?}"),
            }
        }
    }

    /// Closes from the client side.
    pub async fn close(mut self) {
        let _ = self.stream.close(None).await;
    }
}
