//! Responses tollgate writes itself: errors with a JSON body, 429 with `Retry-After` and the
//! IETF `RateLimit` fields (draft-ietf-httpapi-ratelimit-headers-10 syntax).
//!
//! One function per status keeps the JSON shape and headers in one place; a rejection's
//! numbers come from the algorithm's [`Rejection`], never recomputed here.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use super::Body;
use crate::limit::algorithm::{Micros, Rejection};
use crate::limit::{HeaderInfo, Limit};

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

fn json(status: StatusCode, body: String) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn escape(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

pub fn not_found() -> Response<Body> {
    json(
        StatusCode::NOT_FOUND,
        r#"{"error":"not_found","message":"no route matches this request"}"#.into(),
    )
}

/// `CONNECT`: tollgate forwards requests to its routes' upstreams; it is not a tunnel to an
/// address the client names (nginx and Envoy refuse it unless configured as a forward proxy).
pub fn connect_not_allowed() -> Response<Body> {
    let mut r = json(
        StatusCode::METHOD_NOT_ALLOWED,
        r#"{"error":"method_not_allowed","message":"CONNECT is not served: tollgate is a reverse proxy, not a tunnel"}"#.into(),
    );
    r.headers_mut().insert(
        http::header::ALLOW,
        HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS, TRACE"),
    );
    r
}

/// A request body in a transfer coding besides `chunked` (`gzip, chunked`): tollgate would
/// pass on only the chunked layer, and the upstream would read gzip bytes as plain ones
/// (RFC 9112 §6.1: 501; nginx answers the same).
pub fn coding_not_implemented() -> Response<Body> {
    let mut r = json(
        StatusCode::NOT_IMPLEMENTED,
        r#"{"error":"not_implemented","message":"only the chunked transfer coding is supported"}"#
            .into(),
    );
    r.headers_mut()
        .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    r
}

pub fn bad_request(message: &str) -> Response<Body> {
    json(
        StatusCode::BAD_REQUEST,
        format!(r#"{{"error":"bad_request","message":{}}}"#, escape(message)),
    )
}

/// `on_missing: reject`: the same status as any rejection (`reject` means 429 throughout the
/// config), with its own error so a client can tell it apart; no `Retry-After`, since no wait
/// makes a missing key part appear.
pub fn missing_key(route: &str, limit: &str, part: &str) -> Response<Body> {
    json(
        StatusCode::TOO_MANY_REQUESTS,
        format!(
            r#"{{"error":"missing_key","route":{},"limit":{},"part":{}}}"#,
            escape(route),
            escape(limit),
            escape(part)
        ),
    )
}

/// A key part sent with several differing values (see `KeyOutcome::Ambiguous`): the request
/// is malformed for this route, so 400, and no `Retry-After`.
pub fn ambiguous_key(route: &str, limit: &str, part: &str) -> Response<Body> {
    json(
        StatusCode::BAD_REQUEST,
        format!(
            r#"{{"error":"ambiguous_key","route":{},"limit":{},"part":{},"message":"the key part has several different values; send one"}}"#,
            escape(route),
            escape(limit),
            escape(part)
        ),
    )
}

pub fn bad_gateway(route: &str) -> Response<Body> {
    json(
        StatusCode::BAD_GATEWAY,
        format!(
            r#"{{"error":"bad_gateway","route":{},"message":"no valid answer from the upstream: connection refused or failed, or not HTTP"}}"#,
            escape(route)
        ),
    )
}

pub fn gateway_timeout(route: &str) -> Response<Body> {
    json(
        StatusCode::GATEWAY_TIMEOUT,
        format!(
            r#"{{"error":"gateway_timeout","route":{},"message":"upstream did not answer in time"}}"#,
            escape(route)
        ),
    )
}

pub fn unavailable(route: &str, limit: &str) -> Response<Body> {
    let mut r = json(
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            r#"{{"error":"limiter_unavailable","route":{},"limit":{}}}"#,
            escape(route),
            escape(limit)
        ),
    );
    r.headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// Whole seconds, rounded up: a client that waits this long is admitted.
pub fn ceil_secs(us: Micros) -> u64 {
    us.div_ceil(1_000_000)
}

pub fn too_many_requests(route: &str, limit: &Limit, r: &Rejection) -> Response<Body> {
    let retry_ms = r.retry_after.div_ceil(1000);
    let mut resp = json(
        StatusCode::TOO_MANY_REQUESTS,
        format!(
            r#"{{"error":"rate_limited","route":{},"limit":{},"retry_after_ms":{}}}"#,
            escape(route),
            escape(&limit.name),
            retry_ms
        ),
    );
    let h = resp.headers_mut();
    h.insert(
        RETRY_AFTER,
        HeaderValue::from(ceil_secs(r.retry_after).max(1)),
    );
    // On a rejection `t` is the time until this request would be admitted: the same as
    // Retry-After, which is what a client reading only the RateLimit field needs.
    set_ratelimit(
        h,
        limit,
        &HeaderInfo {
            limit: 0,
            remaining: r.remaining,
            reset_after: r.retry_after,
        },
    );
    resp
}

/// `RateLimit-Policy: "name";q=COUNT;w=SECONDS` and `RateLimit: "name";r=REMAINING;t=SECONDS`.
pub fn set_ratelimit(h: &mut HeaderMap, limit: &Limit, info: &HeaderInfo) {
    h.insert(&RATELIMIT_POLICY, limit.policy.clone());
    if let Some(v) = ratelimit_value(limit, info) {
        h.insert(&RATELIMIT, v);
    }
}

/// The `RateLimit` field's value: `"name";r=R;t=T`.
pub fn ratelimit_value(limit: &Limit, info: &HeaderInfo) -> Option<HeaderValue> {
    let mut v = Vec::with_capacity(limit.name.len() + 48);
    push_ratelimit(&mut v, limit, info.remaining, info.reset_after);
    HeaderValue::from_maybe_shared(Bytes::from(v)).ok()
}

/// Appends the `RateLimit` value. Written by hand: this runs on every admitted response, and the
/// formatter's machinery was a visible part of it. Limit names are letters, digits, `_`, `.`
/// and `-` (config validation), so the value needs no escaping.
pub fn push_ratelimit(out: &mut Vec<u8>, limit: &Limit, remaining: u64, reset_after: Micros) {
    out.push(b'"');
    out.extend_from_slice(limit.name.as_bytes());
    out.extend_from_slice(b"\";r=");
    push_u64(out, remaining);
    out.extend_from_slice(b";t=");
    push_u64(out, ceil_secs(reset_after));
}

/// [`too_many_requests`] for the fast HTTP/1.1 path, without building a `Response`: appends its
/// header fields (`name: value\r\n` each, in the same order) to `fields` and its JSON to
/// `body`. Route and limit names need no JSON escaping (see [`push_ratelimit`]).
pub fn write_too_many_requests(
    fields: &mut Vec<u8>,
    body: &mut Vec<u8>,
    route: &str,
    limit: &Limit,
    r: &Rejection,
) {
    fields.extend_from_slice(b"content-type: application/json\r\nretry-after: ");
    push_u64(fields, ceil_secs(r.retry_after).max(1));
    fields.extend_from_slice(b"\r\nratelimit-policy: ");
    fields.extend_from_slice(limit.policy.as_bytes());
    fields.extend_from_slice(b"\r\nratelimit: ");
    push_ratelimit(fields, limit, r.remaining, r.retry_after);
    fields.extend_from_slice(b"\r\n");
    body.extend_from_slice(b"{\"error\":\"rate_limited\",\"route\":\"");
    body.extend_from_slice(route.as_bytes());
    body.extend_from_slice(b"\",\"limit\":\"");
    body.extend_from_slice(limit.name.as_bytes());
    body.extend_from_slice(b"\",\"retry_after_ms\":");
    push_u64(body, r.retry_after.div_ceil(1000));
    body.push(b'}');
}

/// Appends `n` in decimal (`itoa`: two digits per step; this runs several times per answer).
pub(crate) fn push_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::push_u64;

    #[test]
    fn decimal_digits_are_appended() {
        for n in [0, 7, 10, 99, 100, 123_456_789, u64::MAX] {
            let mut out = b"x".to_vec();
            push_u64(&mut out, n);
            assert_eq!(out, format!("x{n}").as_bytes());
        }
    }
}
