//! The static files the gateway serves, embedded in the binary (`include_str!`: no bundler,
//! nothing read from disk or the network at run time), open without credentials — they hold
//! no data; every request they make authenticates like any client's:
//!
//! ```text
//!   GET /                          the console (crates/server/web/index.html)
//!   GET /ops                       the operations view (web/ops.html; reads /v1/admin/status/stream)
//!   GET /console/{file}            their script and style files (console.js, ops.js,
//!                                  ops-view.js, style.css)
//!   GET /v1/client.js              the browser client, an ES module (web/tidemark.js)
//!   GET /v1/openapi.yaml           the HTTP API, OpenAPI 3.1 (docs/openapi.yaml)
//!   GET /v1/ws-frames.schema.json  the WebSocket frames as JSON Schema (docs/ws-frames.schema.json)
//! ```
//!
//! Pages carry a Content-Security-Policy that allows only this origin (scripts, styles,
//! fetches and the WebSocket), no inline script, and no framing.

use axum::extract::rejection::PathRejection;
use axum::extract::Path;
use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};

use super::http::error_response;
use tidemark_protocol::ErrorCode;

/// The console page.
pub(crate) const INDEX_HTML: &str = include_str!("../../web/index.html");
/// The operations page.
pub(crate) const OPS_HTML: &str = include_str!("../../web/ops.html");
/// The browser client.
pub(crate) const CLIENT_JS: &str = include_str!("../../web/tidemark.js");
/// The OpenAPI document of the HTTP API.
pub(crate) const OPENAPI_YAML: &str = include_str!("../../../../docs/openapi.yaml");
/// The JSON Schemas of the WebSocket frames.
pub(crate) const FRAMES_SCHEMA: &str = include_str!("../../../../docs/ws-frames.schema.json");

/// `/console/{file}`: name, content type, text.
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "console.js",
        "text/javascript; charset=utf-8",
        include_str!("../../web/console.js"),
    ),
    (
        "ops.js",
        "text/javascript; charset=utf-8",
        include_str!("../../web/ops.js"),
    ),
    (
        "ops-view.js",
        "text/javascript; charset=utf-8",
        include_str!("../../web/ops-view.js"),
    ),
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("../../web/style.css"),
    ),
];

/// The pages' Content-Security-Policy.
pub(crate) const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

fn file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        body,
    )
        .into_response()
}

fn page(body: &'static str) -> Response {
    let mut r = file("text/html; charset=utf-8", body);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        HeaderName::from_static("x-frame-options"),
        HeaderValue::from_static("DENY"),
    );
    r
}

pub(crate) async fn index() -> Response {
    page(INDEX_HTML)
}

pub(crate) async fn ops() -> Response {
    page(OPS_HTML)
}

pub(crate) async fn client_js() -> Response {
    file("text/javascript; charset=utf-8", CLIENT_JS)
}

pub(crate) async fn openapi() -> Response {
    file("application/yaml; charset=utf-8", OPENAPI_YAML)
}

pub(crate) async fn frames_schema() -> Response {
    file("application/schema+json", FRAMES_SCHEMA)
}

/// `/console/{file}`. A name that does not decode (`%FF`: not UTF-8) names no file either: it
/// is 404 `not_found` with the JSON body like any other, not axum's plain-text 400 (ADR-0125).
pub(crate) async fn asset(name: Result<Path<String>, PathRejection>) -> Response {
    let found = name
        .ok()
        .and_then(|Path(name)| ASSETS.iter().find(|(n, _, _)| *n == name));
    match found {
        Some((_, ty, body)) => file(ty, body),
        None => error_response(ErrorCode::NotFound, "no such file"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_files_are_the_repository_files() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for (embedded, path) in [
            (INDEX_HTML, "web/index.html"),
            (OPS_HTML, "web/ops.html"),
            (CLIENT_JS, "web/tidemark.js"),
            (OPENAPI_YAML, "../../docs/openapi.yaml"),
            (FRAMES_SCHEMA, "../../docs/ws-frames.schema.json"),
        ] {
            assert_eq!(embedded, std::fs::read_to_string(root.join(path)).unwrap());
        }
        // the schemas are JSON
        serde_json::from_str::<serde_json::Value>(FRAMES_SCHEMA).unwrap();
    }

    #[test]
    fn pages_load_only_embedded_files() {
        // every script and style a page names is served here (no network at run time)
        for html in [INDEX_HTML, OPS_HTML] {
            for attr in ["src=\"", "href=\""] {
                for part in html.split(attr).skip(1) {
                    let target = part.split('"').next().unwrap();
                    if target.starts_with('#') || target.starts_with("data:") {
                        continue;
                    }
                    let served = ["/", "/ops", "/v1/client.js"].contains(&target)
                        || target
                            .strip_prefix("/console/")
                            .is_some_and(|n| ASSETS.iter().any(|(a, _, _)| *a == n));
                    assert!(served, "{target} is not an embedded file");
                }
            }
        }
    }
}
