//! The router and the HTTP endpoints: `POST /v1/messages`, `GET /v1/mailbox`,
//! `POST /v1/mailbox/ack`, `GET /metrics`, `GET /healthz` (the last two on the admin
//! listener instead, when there is one); the operator's `GET /v1/admin/status[/stream]`
//! ([`admin`]) and the embedded console, client and API documents ([`web`]) on the client
//! listener.
//!
//! Request bodies go through the same parsers and limits as WebSocket frames; every failure
//! is an `ErrorBody` with the code's HTTP status.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use tidemark_protocol::{
    parse_ack_request, parse_mailbox_query, parse_send_request, AckResponse, ErrorBody, ErrorCode,
    FrameError, Limits, MailboxPage, SendResponse,
};

use super::auth::{authenticate, Endpoint};
use super::mailbox::PageSizer;
use super::send;
use super::state::Shared;
use super::{admin, web, ws};

/// Which endpoints a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Routes {
    /// Everything (no admin listener).
    All,
    /// The client endpoints only: `/metrics` and `/healthz` are on the admin listener.
    Public,
    /// `/metrics` and `/healthz` only (the admin listener; no auth).
    Admin,
}

/// The gateway's routes for one listener; anything else is 404 `not_found`.
pub(crate) fn router(shared: Arc<Shared>, routes: Routes) -> Router {
    let mut r = Router::new();
    if routes != Routes::Admin {
        r = r
            .route("/v1/ws", get(ws::handler))
            .route("/v1/messages", post(send_message))
            .route("/v1/mailbox", get(read_mailbox))
            .route("/v1/mailbox/ack", post(ack_mailbox))
            .route("/v1/admin/status", get(admin::status))
            .route("/v1/admin/status/stream", get(admin::stream))
            // the routes above answer with data: never cached, never sniffed (ADR-0115; a
            // mailbox page holds bodies its senders chose)
            .layer(axum::middleware::map_response(data_headers))
            // static, open: they hold no data (ADR-0034)
            .route("/", get(web::index))
            .route("/ops", get(web::ops))
            .route("/console/{file}", get(web::asset))
            .route("/v1/client.js", get(web::client_js))
            .route("/v1/openapi.yaml", get(web::openapi))
            .route("/v1/ws-frames.schema.json", get(web::frames_schema));
    }
    if routes != Routes::Public {
        r = r
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz));
    }
    // every error has the JSON body; on the client listener a request without valid
    // credentials is told so (401) before it learns whether a path or method exists
    if routes == Routes::Admin {
        r.fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(shared)
    } else {
        r.fallback(not_found_authenticated)
            .method_not_allowed_fallback(method_not_allowed_authenticated)
            .with_state(shared)
    }
}

/// `Cache-Control: no-store` and `X-Content-Type-Options: nosniff` on a response of the data
/// endpoints: a browser or a proxy keeps no copy of a mailbox page or an admin snapshot, and
/// never reads JSON of attacker-chosen bodies as anything but JSON.
async fn data_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        axum::http::header::CACHE_CONTROL,
        axum::http::HeaderValue::from_static("no-store"),
    );
    h.insert(
        axum::http::header::X_CONTENT_TYPE_OPTIONS,
        axum::http::HeaderValue::from_static("nosniff"),
    );
    r
}

/// An error response: `{"error":{"code":…,"message":…}}` with the code's status.
pub(crate) fn error_response(code: ErrorCode, message: impl Into<String>) -> Response {
    crate::telemetry::count_error(code);
    let body = ErrorBody::new(code, message);
    let status =
        StatusCode::from_u16(body.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(body)).into_response()
}

/// The largest stored mailbox entry the limits allow (body, sender, header).
pub(crate) fn largest_entry(limits: &Limits) -> usize {
    limits.max_body_bytes + tidemark_protocol::MAX_USER_ID_BYTES + 64
}

fn frame_error(e: &FrameError) -> Response {
    error_response(e.error_code(), e.message())
}

fn internal(what: &str, e: &tidemark_store::Error) -> Response {
    tracing::warn!(error = %e, "{what} failed");
    error_response(ErrorCode::Internal, format!("{what} failed; retry"))
}

fn not_found_response() -> Response {
    error_response(ErrorCode::NotFound, "no such endpoint")
}

fn method_not_allowed_response() -> Response {
    error_response(
        ErrorCode::MethodNotAllowed,
        "this endpoint does not take this method",
    )
}

async fn not_found() -> Response {
    not_found_response()
}

async fn method_not_allowed() -> Response {
    method_not_allowed_response()
}

/// 404, after the credentials check (401 first).
async fn not_found_authenticated(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    credentials_first(&shared, &headers, &uri, not_found_response)
}

/// 405, after the credentials check (401 first).
async fn method_not_allowed_authenticated(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    credentials_first(&shared, &headers, &uri, method_not_allowed_response)
}

/// `otherwise()` for a caller with valid credentials, the 401 refusal for anyone else (the
/// other answer is not even built, so it is not counted).
fn credentials_first(
    shared: &Shared,
    headers: &HeaderMap,
    uri: &Uri,
    otherwise: fn() -> Response,
) -> Response {
    match user_of(shared, headers, uri) {
        Err(refused) => refused,
        Ok(_) => otherwise(),
    }
}

/// Authenticates an HTTP request (header token, or `?user=` with dev auth).
#[allow(clippy::result_large_err)]
fn user_of(shared: &Shared, headers: &HeaderMap, uri: &Uri) -> Result<String, Response> {
    authenticate(&shared.opts, headers, uri.query(), Endpoint::Http)
        .map(|caller| caller.user)
        .map_err(|(code, message)| error_response(code, message))
}

/// Reads a request body, refusing (without reading on) one above `max` bytes or one that
/// has not fully arrived within `within` (a client trickling its body holds a connection).
/// The caller (authenticated first: 401 before anything is read) and its body parsed with
/// `parse` (read within the header timeout, at most one frame's bytes); else the error answer.
async fn authed_request<T>(
    shared: &Shared,
    uri: &Uri,
    headers: &HeaderMap,
    body: Body,
    parse: impl FnOnce(&[u8], &Limits) -> Result<T, FrameError>,
) -> Result<(String, T), Response> {
    let user = user_of(shared, headers, uri)?;
    let limits = &shared.opts.limits;
    let within = shared.opts.header_read_timeout;
    let bytes = read_body(headers, body, limits.max_frame_bytes, within).await?;
    let req = parse(&bytes, limits).map_err(|e| frame_error(&e))?;
    Ok((user, req))
}

async fn read_body(
    headers: &HeaderMap,
    body: Body,
    max: usize,
    within: Duration,
) -> Result<Vec<u8>, Response> {
    match tokio::time::timeout(within, read_body_now(headers, body, max)).await {
        Ok(r) => r,
        Err(_) => Err(error_response(
            ErrorCode::BadRequest,
            format!("the request body did not arrive within {within:?}"),
        )),
    }
}

async fn read_body_now(headers: &HeaderMap, body: Body, max: usize) -> Result<Vec<u8>, Response> {
    let too_large = || {
        error_response(
            ErrorCode::FrameTooLarge,
            format!("request body exceeds {max} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let mut out = Vec::with_capacity(declared.map_or(0, |n| n as usize));
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|_| {
            error_response(ErrorCode::BadRequest, "the request body could not be read")
        })?;
        if out.len() + chunk.len() > max {
            return Err(too_large());
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

async fn send_message(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let received = Instant::now();
    let (user, req) = match authed_request(&shared, &uri, &headers, body, parse_send_request).await
    {
        Ok(r) => r,
        Err(r) => return r,
    };
    let permit = match send::reserve(&shared, &user, &req).await {
        Ok(p) => p,
        Err((code, message)) => return error_response(code, message),
    };
    let (id, res) = send::commit(&shared, &user, req).await;
    drop(permit);
    match res {
        Ok(offsets) => {
            metrics::histogram!("tidemark_send_ack_seconds")
                .record(received.elapsed().as_secs_f64());
            Json(SendResponse { id, offsets }).into_response()
        }
        Err((code, message)) => error_response(code, message),
    }
}

async fn read_mailbox(State(shared): State<Arc<Shared>>, uri: Uri, headers: HeaderMap) -> Response {
    let user = match user_of(&shared, &headers, &uri) {
        Ok(u) => u,
        Err(r) => return r,
    };
    let q = match parse_mailbox_query(uri.query().unwrap_or(""), &shared.opts.limits) {
        Ok(q) => q,
        Err(e) => return frame_error(&e),
    };
    let mut mailbox = shared.mailbox(&user);
    let after = match q.after {
        Some(a) => a,
        None => match mailbox.acked().await {
            Ok(a) => a,
            Err(e) => return internal("reading the acked cursor", &e),
        },
    };
    // Up to `limit` entries and about `max_page_bytes`, in reads sized to fetch not much more.
    let limit = q.limit as usize;
    let max_bytes = shared.opts.max_page_bytes.max(1);
    let mut sizer = PageSizer::new(limit, max_bytes, largest_entry(&shared.opts.limits));
    let (mut entries, mut bytes, mut cursor) = (Vec::new(), 0usize, after);
    loop {
        let want = sizer.count().min(limit - entries.len());
        let page = match mailbox.read_visible(cursor, want, max_bytes - bytes).await {
            Ok(p) => p,
            Err(e) => return internal("reading the mailbox", &e),
        };
        sizer.observe(page.entries.len(), page.bytes);
        bytes += page.bytes;
        for e in page.entries {
            match e {
                Ok(e) => {
                    cursor = e.seq;
                    entries.push(e);
                }
                Err(seq) => {
                    return error_response(
                        ErrorCode::Internal,
                        format!("mailbox entry {seq} is unreadable"),
                    )
                }
            }
        }
        if !page.more || entries.len() >= limit || bytes >= max_bytes {
            break;
        }
    }
    Json(MailboxPage::new(entries, after)).into_response()
}

async fn ack_mailbox(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (user, req) = match authed_request(&shared, &uri, &headers, body, parse_ack_request).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let mut mailbox = shared.mailbox(&user);
    // Never trim above the lane's W: those entries have not been visible to anyone.
    let w = match mailbox.visible_w().await {
        Ok(w) => w,
        Err(e) => return internal("reading the watermark", &e),
    };
    match mailbox.ack(req.seq.min(w)).await {
        Ok(acked) => {
            metrics::counter!("tidemark_acks_total").increment(1);
            Json(AckResponse { acked }).into_response()
        }
        Err(e) => internal("ack", &e),
    }
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    crate::telemetry::record_process_metrics();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        shared.metrics.render(),
    )
        .into_response()
}

async fn healthz(State(shared): State<Arc<Shared>>) -> Response {
    let problems = shared.health.problems(shared.opts.stuck_after);
    if problems.is_empty() {
        (StatusCode::OK, "ok").into_response()
    } else {
        let mut text = problems.join("\n");
        text.push('\n');
        (StatusCode::SERVICE_UNAVAILABLE, text).into_response()
    }
}
