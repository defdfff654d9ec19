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
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{Route, Topology};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::{HeaderName, HeaderValue};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;

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
    let core = RedisProcess::start().expect("core redis-server");
    let mailbox = RedisProcess::start().expect("mailbox redis-server");
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

    let mut opts = GatewayOptions {
        token_secret: Some(SECRET.to_vec()),
        dev_auth: true,
        recheck_interval: Duration::from_millis(500),
        ..GatewayOptions::default()
    };
    tweak(&mut opts);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let serve = tokio::spawn(serve(listener, map, opts, health.clone(), cancel.clone()));
    Deployment {
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

    /// Connects; a refused upgrade gives its status and body.
    pub async fn try_ws(&self, query: &str, headers: &[(&str, &str)]) -> Result<Ws, (u16, String)> {
        let mut req = self.ws_url(query).into_client_request().unwrap();
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

    /// One HTTP/1.1 request (`Connection: close`); returns status and body.
    pub async fn http(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> (u16, String) {
        tokio::time::timeout(WAIT, http_request(self.addr, method, path, headers, body))
            .await
            .expect("http request timed out")
    }

    /// HTTP with a JSON reply parsed.
    pub async fn http_json(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> (u16, Value) {
        let (status, text) = self.http(method, path, headers, body).await;
        let v = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {status} {text:?}"));
        (status, v)
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

impl Drop for Deployment {
    fn drop(&mut self) {
        self.cancel.cancel();
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

async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
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
    if let Some(b) = body {
        bytes.extend_from_slice(b);
    }
    s.write_all(&bytes).await.expect("write request");
    let mut resp = Vec::new();
    // The server may answer (and close) before reading a body it refuses.
    let _ = s.read_to_end(&mut resp).await;
    let text = String::from_utf8_lossy(&resp).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad response: {text:?}"));
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, body)
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

    /// Sends a message and returns its `send_ack` or `error` (other frames stay pending).
    pub async fn send_msg(&mut self, id: &str, to: &[&str], body: &str) -> Value {
        self.send_json(&json!({"type":"send","id":id,"to":to,"body":body}))
            .await;
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
