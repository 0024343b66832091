//! The admin listener (axum): `/metrics`, `/healthz`, `/readyz`, `/admin/config`,
//! `GET` and `DELETE /admin/limits/{route}/{limit}?key=..` (one key's state; forget it),
//! `GET /admin/limits/{route}/{limit}/top?n=..` (the keys rejected most in the last minute),
//! `POST /admin/reload`.
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

use crate::limit::Applied;
use crate::limit::top::CAPACITY;
use crate::limit::{Forgotten, Limit};
use crate::metrics::Format;
use crate::snapshot::ConfigSnapshot;
use crate::state::Shared;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let admin = Router::new()
        .route("/admin/config", get(config))
        .route(
            "/admin/limits/{route}/{limit}",
            get(limit_state).delete(limit_reset),
        )
        .route("/admin/limits/{route}/{limit}/top", get(limit_top))
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

/// Why an `/admin/limits/..` request names nothing to act on, and the answer it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BadTarget {
    /// 404: no route of that name.
    UnknownRoute,
    /// 404: the route has no limit of that name.
    UnknownLimit,
    /// 400: no `?key=`, or an empty one.
    MissingKey,
    /// 400: `?n=` is not a positive integer.
    BadN,
}

impl IntoResponse for BadTarget {
    fn into_response(self) -> Response {
        let (status, msg) = match self {
            BadTarget::UnknownRoute => (StatusCode::NOT_FOUND, "no such route"),
            BadTarget::UnknownLimit => (StatusCode::NOT_FOUND, "no such limit on this route"),
            BadTarget::MissingKey => (StatusCode::BAD_REQUEST, "missing ?key="),
            BadTarget::BadN => (StatusCode::BAD_REQUEST, "n must be a positive integer"),
        };
        (status, Json(json!({"error": msg}))).into_response()
    }
}

/// The route's limit named in the path.
fn find_limit<'a>(
    rt: &'a ConfigSnapshot,
    route: &str,
    limit: &str,
) -> Result<&'a Limit, BadTarget> {
    let r = rt
        .routes
        .iter()
        .find(|r| *r.name == *route)
        .ok_or(BadTarget::UnknownRoute)?;
    r.limits
        .limits
        .iter()
        .find(|l| *l.name == *limit)
        .ok_or(BadTarget::UnknownLimit)
}

/// `?key=`. An empty key is no key: requests never get one (an empty value is a missing
/// part).
fn key_param(q: &HashMap<String, String>) -> Result<&str, BadTarget> {
    q.get("key")
        .map(String::as_str)
        .filter(|k| !k.is_empty())
        .ok_or(BadTarget::MissingKey)
}

/// The limit and the key of an `/admin/limits/{route}/{limit}?key=..` request.
fn limit_and_key<'a>(
    rt: &'a ConfigSnapshot,
    (route, limit): (&str, &str),
    q: &'a HashMap<String, String>,
) -> Result<(&'a Limit, &'a str), BadTarget> {
    Ok((find_limit(rt, route, limit)?, key_param(q)?))
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
    let (l, key) = match limit_and_key(&rt, (&route, &limit), &q) {
        Ok(found) => found,
        Err(bad) => return bad.into_response(),
    };
    let stored = crate::key::from_admin(key);
    // An override on the key (or the overrides file) decides its rate; one on the client's
    // address or headers needs a request, so the limit's own rate is shown then.
    let (rate, exempt) = match l.rate_for_key(&stored) {
        Applied::Rate(r) => (r, false),
        Applied::Exempt => (0, true),
    };
    let (s, store) = shared.peek(l, rate, &stored).await;
    let applied = l.rate(rate);
    Json(json!({
        "store": store,
        "route": route,
        "limit": limit,
        "key": key,
        "scope": l.scope,
        "algorithm": l.config.algorithm,
        "limit_count": applied.count,
        "plan": applied.plan.as_deref(),
        "exempt": exempt,
        "shared": l.config.shared,
        "remaining": s.remaining,
        "reset_after_ms": s.reset_after.div_ceil(1000),
        // `reserve_ahead`: the burst Redis decides this key against (`remaining` counts
        // against it); absent otherwise.
        "reserve_burst": applied.reserve.as_ref().map(|r| r.algorithm.quota().burst),
    }))
    .into_response()
}

/// Forgets one key (`?key=` as for the state above): in this instance's local store,
/// in-process tier and eventual counts, and in Redis for a global limit. 200 with what was
/// held where; 503 when Redis did not confirm, with what this instance forgot all the same
/// (retrying is safe: a reset of a full key changes nothing).
async fn limit_reset(
    State(shared): State<Arc<Shared>>,
    Path((route, limit)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let rt = shared.gateway.snapshot.load_full();
    let (l, key) = match limit_and_key(&rt, (&route, &limit), &q) {
        Ok(found) => found,
        Err(bad) => return bad.into_response(),
    };
    let forgotten =
        |f: Forgotten| json!({"local": f.local, "deny_tier": f.deny_tier, "eventual": f.eventual});
    match shared.reset(l, &crate::key::from_admin(key)).await {
        Ok(r) => Json(json!({
            "result": "reset",
            "route": route,
            "limit": limit,
            "key": key,
            "scope": l.scope,
            "in_process": forgotten(r.in_process),
            "redis_keys_deleted": r.redis_deleted,
        }))
        .into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "result": "error",
                "error": e.to_string(),
                "route": route,
                "limit": limit,
                "key": key,
                "scope": l.scope,
                "in_process": forgotten(e.in_process),
                "redis_keys_deleted": null,
            })),
        )
            .into_response(),
    }
}

/// `GET .../top` without `?n=`.
const DEFAULT_TOP: usize = 10;

/// The keys this instance rejected most for this limit in the last minute, most first, with
/// their counts (see [`crate::limit::top`] for the window and the error bound). `?n=` (default
/// 10) is capped at the summary's capacity.
async fn limit_top(
    State(shared): State<Arc<Shared>>,
    Path((route, limit)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let rt = shared.gateway.snapshot.load_full();
    let l = match find_limit(&rt, &route, &limit) {
        Ok(l) => l,
        Err(bad) => return bad.into_response(),
    };
    let n = match q.get("n").map(|n| n.parse::<usize>()) {
        None => DEFAULT_TOP,
        Some(Ok(n)) if n > 0 => n.min(CAPACITY),
        Some(_) => return BadTarget::BadN.into_response(),
    };
    let top = shared.top(l, n);
    let keys: Vec<serde_json::Value> = top
        .keys
        .iter()
        .map(|k| {
            json!({
                "key": String::from_utf8_lossy(&k.key),
                "count": k.count,
                "error": k.error,
                "truncated": k.truncated,
            })
        })
        .collect();
    Json(json!({
        "route": route,
        "limit": limit,
        "n": n,
        "capacity": CAPACITY,
        "window_ms": top.window / 1000,
        "rejected": top.rejected,
        "keys": keys,
    }))
    .into_response()
}
