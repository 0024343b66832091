//! The admin listener (axum): `/metrics`, `/healthz`, `/readyz`, `/admin/config`,
//! `/admin/limits/{route}/{limit}?key=..`, `POST /admin/reload`.
//!
//! It runs on its own address (default 127.0.0.1:9090), never on the proxy port, so exposing the
//! proxy does not expose limiter state or reloads. `/admin/*` takes an optional bearer token
//! (`server.admin_token`); `/metrics` and the probes stay open for scrapers and kubelets.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::metrics::Format;
use crate::state::Shared;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let admin = Router::new()
        .route("/admin/config", get(config))
        .route("/admin/limits/{route}/{limit}", get(limit_state))
        .route("/admin/reload", post(reload))
        .route_layer(middleware::from_fn_with_state(
            shared.clone(),
            require_token,
        ));
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .merge(admin)
        .with_state(shared)
}

async fn require_token(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let rt = shared.gateway.snapshot.load();
    if let Some(token) = &rt.config.server.admin_token {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            // The scheme is case-insensitive (RFC 9110 §11.1): `bearer x` is `Bearer x`.
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .is_some_and(|(_, t)| constant_time_eq(t.trim().as_bytes(), token.as_bytes()));
        if !ok {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                Json(json!({"error": "unauthorized"})),
            )
                .into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Classic text unless the scraper prefers OpenMetrics (see [`Format::negotiate`]); `Vary`
/// keeps a cache between scraper and admin port from serving one format for the other.
async fn metrics(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let accept = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok());
    let format = Format::negotiate(accept);
    let body = shared.gateway.metrics.encode(format);
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(format.content_type()),
            ),
            (header::VARY, HeaderValue::from_static("accept")),
        ],
        body,
    )
        .into_response()
}

async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    let (ready, detail) = shared.readiness().await;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(detail)).into_response()
}

async fn config(State(shared): State<Arc<Shared>>) -> Response {
    let rt = shared.gateway.snapshot.load();
    Json(&*rt.config).into_response()
}

async fn reload(State(shared): State<Arc<Shared>>) -> Response {
    match shared.reload().await {
        // The new config's warnings (settings that load but do less than they seem to), as
        // `check` prints them: whoever reloads sees them without reading the log.
        Ok(()) => {
            let warnings: Vec<String> = shared
                .gateway
                .snapshot
                .load()
                .config
                .warnings
                .iter()
                .map(ToString::to_string)
                .collect();
            Json(json!({"result": "success", "warnings": warnings})).into_response()
        }
        Err(e) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"result": "error", "error": e.to_string()})),
        )
            .into_response(),
    }
}

/// The state of one key. `key` is the limit's key as the gateway builds it: its parts' values
/// joined with `|` (for `key: [ip]`, the client address), each part as stored or as the raw
/// value the client sent (see [`crate::key::from_admin`]).
async fn limit_state(
    State(shared): State<Arc<Shared>>,
    Path((route, limit)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let rt = shared.gateway.snapshot.load_full();
    let Some(r) = rt.routes.iter().find(|r| *r.name == *route) else {
        return not_found("no such route");
    };
    let Some(l) = r.limits.limits.iter().find(|l| *l.name == *limit) else {
        return not_found("no such limit on this route");
    };
    // An empty key is no key: requests never get one (an empty value is a missing part).
    let Some(key) = q.get("key").filter(|k| !k.is_empty()) else {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "missing ?key="})),
        )
            .into_response();
    };
    let (s, store) = shared.peek(l, &crate::key::from_admin(key)).await;
    Json(json!({
            "store": store,
            "route": route,
            "limit": limit,
            "key": key,
            "scope": l.scope,
            "algorithm": l.config.algorithm,
            "limit_count": l.config.rate.count,
            "remaining": s.remaining,
        "reset_after_ms": s.reset_after.div_ceil(1000),
    }))
    .into_response()
}

fn not_found(msg: &str) -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"error": msg}))).into_response()
}
