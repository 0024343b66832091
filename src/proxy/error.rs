//! Every way an exchange can end without the upstream's answer, by who failed, and [`rescue`]:
//! the one function that turns it into what the client gets (status, fields, JSON body) and
//! logs it. Both codecs render its answer through [`AnswerWriter`], so a refusal, a 429 or a
//! 502 reads the same whichever codec served the request.

use std::io;

use http::header::{ALLOW, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, StatusCode};

use super::response::{
    RATELIMIT, RATELIMIT_POLICY, ceil_secs, legacy_fields, push_ratelimit, push_u64,
};
use crate::config::{Piece, RejectionConfig, Template};
use crate::limit::Limit;
use crate::limit::algorithm::Rejection;
use crate::snapshot::Route;

/// Why tollgate answers instead of the upstream.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    /// The client's request is malformed for a proxy (target, path, `Host`).
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    /// The client's request body broke its framing (a malformed chunk).
    #[error("malformed request body")]
    MalformedBody,
    /// The client's request body ended (its connection closed) before its length.
    #[error("request body cut short")]
    BodyCutShort,
    /// `CONNECT`: tollgate forwards to its routes' upstreams; it is not a tunnel to an address
    /// the client names (nginx and Envoy refuse it unless configured as a forward proxy).
    #[error("CONNECT is not served")]
    ConnectNotAllowed,
    /// A request body in a transfer coding besides `chunked` (`gzip, chunked`): tollgate would
    /// pass on only the chunked layer, and the upstream would read gzip bytes as plain ones
    /// (RFC 9112 §6.1: 501; nginx answers the same).
    #[error("a transfer coding besides chunked")]
    CodingNotImplemented,
    /// No route matches.
    #[error("no route")]
    NoRoute,
    /// The route's limit (by index) rejected the request.
    #[error("rate limited by limit {limit}")]
    Limited {
        /// Index into the route's limits.
        limit: usize,
        /// Which of the limit's rates the key was decided under (its `RateLimit-Policy`).
        rate: u16,
        /// The algorithm's answer: when to come back.
        rejection: Rejection,
    },
    /// `on_missing: reject` and the key part is absent: the status of any rejection (`reject`
    /// means 429 throughout the config), with its own error and no `Retry-After` (no wait makes
    /// a key part appear).
    #[error("key part {part} missing for limit {limit}")]
    MissingKey {
        /// Index into the route's limits.
        limit: usize,
        /// The key part, as configured.
        part: String,
    },
    /// A key part sent with several differing values: the request is malformed for this route.
    #[error("key part {part} ambiguous for limit {limit}")]
    AmbiguousKey {
        /// Index into the route's limits.
        limit: usize,
        /// The key part, as configured.
        part: String,
    },
    /// Redis could not answer and `redis.on_error: deny`.
    #[error("limiter unavailable for limit {limit}")]
    LimiterUnavailable {
        /// Index into the route's limits.
        limit: usize,
    },
    /// No valid answer from the upstream: refused, failed, closed early, or not HTTP. The
    /// error's text says the whole cause (the connector's errors print their chain).
    #[error("{0}")]
    Upstream(Box<dyn std::error::Error + Send + Sync>),
    /// The upstream sent a `101` to a request that asked for no protocol switch.
    #[error("upstream switched protocols unasked")]
    SwitchedUnasked,
    /// No response head within the route's timeout.
    #[error("upstream timed out")]
    UpstreamTimeout,
    /// The client went away: nobody to answer.
    #[error("client gone")]
    ClientGone,
    /// Refused only for lack of a slot of a concurrency limit with `on_limit: delay`: not an
    /// answer yet, but the request's place to wait ([`crate::proxy::Gateway::wait_for_slot`],
    /// which each codec calls). Answered as that limit's 429 should it ever be written.
    #[error("waiting for a slot of limit {}", .0.limit)]
    Queued(Box<SlotWait>),
    /// tollgate panicked while handling the request, before any of its answer went out. The
    /// code that caught it logged and counted it (`crate::panics`); the answer is a 500 and
    /// the connection closes, since what the panic left half-done (a request body half read,
    /// an upstream half written) cannot be trusted for another request.
    #[error("internal error")]
    Panicked,
}

/// Where a request refused for lack of a concurrency slot waits: the limit, its key's line in
/// the limit's store, the limit's answer should it not wait, and when it was first decided
/// (its `max_delay` counts from then).
#[derive(Debug)]
pub(crate) struct SlotWait {
    /// Index of the concurrency limit in the route's limits.
    pub limit: usize,
    /// The key's hash in the limit's store: its line.
    pub hash: u64,
    /// The limit's answer, written if the request does not wait.
    pub rejection: Rejection,
    /// When the request was first decided.
    pub started: std::time::Instant,
}

impl From<io::Error> for ProxyError {
    fn from(e: io::Error) -> Self {
        ProxyError::Upstream(Box::new(e))
    }
}

/// Where [`rescue`] writes its answer: a `Response` for hyper, bytes for the fast codec.
pub(crate) trait AnswerWriter {
    /// The answer's status, first.
    fn status(&mut self, status: StatusCode);
    /// A header field of the answer.
    fn field(&mut self, name: &'static HeaderName, value: &[u8]);
    /// A header field of the answer whose value `write` appends.
    fn field_with(&mut self, name: &'static HeaderName, write: impl FnOnce(&mut Vec<u8>));
    /// The body, appended to.
    fn body(&mut self) -> &mut Vec<u8>;
    /// The connection closes after this answer (`Connection: close`).
    fn close(&mut self);
}

/// A limit's rejection, as the route answers it (a limit is a route's: there is always one).
fn limited(
    out: &mut impl AnswerWriter,
    route: &Route,
    (limit, rate): (usize, u16),
    rejection: &Rejection,
) -> StatusCode {
    let limit = &route.limits.limits[limit];
    match &route.rejection {
        None => {
            too_many_requests(out, route, (limit, rate), rejection);
            StatusCode::TOO_MANY_REQUESTS
        }
        Some(custom) => custom_rejection(out, route, custom, (limit, rate), rejection),
    }
}

static JSON: &[u8] = b"application/json";
static ALLOWED: &[u8] = b"GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS, TRACE";

/// The answer to `e` on `route` (none before routing), written to `out`, and logged. `None`
/// when there is nobody to answer ([`ProxyError::ClientGone`]); else the status written.
pub(crate) fn rescue(
    e: &ProxyError,
    route: Option<&Route>,
    out: &mut impl AnswerWriter,
) -> Option<StatusCode> {
    let route_name = route.map_or("", |r| &*r.name);
    let limit_name = |i: usize| route.map_or("", |r| &*r.limits.limits[i].name);
    let status = match e {
        ProxyError::ClientGone => return None,
        ProxyError::BadRequest(why) => {
            error(out, StatusCode::BAD_REQUEST, "bad_request", |b| {
                b.extend_from_slice(b",\"message\":");
                push_json_str(b, why);
            });
            StatusCode::BAD_REQUEST
        }
        ProxyError::MalformedBody | ProxyError::BodyCutShort => {
            error(out, StatusCode::BAD_REQUEST, "bad_request", |b| {
                b.extend_from_slice(b",\"message\":");
                push_json_str(b, &e.to_string());
            });
            StatusCode::BAD_REQUEST
        }
        ProxyError::ConnectNotAllowed => {
            out.status(StatusCode::METHOD_NOT_ALLOWED);
            out.field(&CONTENT_TYPE, JSON);
            out.field(&ALLOW, ALLOWED);
            out.body().extend_from_slice(br#"{"error":"method_not_allowed","message":"CONNECT is not served: tollgate is a reverse proxy, not a tunnel"}"#);
            StatusCode::METHOD_NOT_ALLOWED
        }
        ProxyError::CodingNotImplemented => {
            out.status(StatusCode::NOT_IMPLEMENTED);
            out.field(&CONTENT_TYPE, JSON);
            out.close();
            out.body().extend_from_slice(
                br#"{"error":"not_implemented","message":"only the chunked transfer coding is supported"}"#,
            );
            StatusCode::NOT_IMPLEMENTED
        }
        ProxyError::NoRoute => {
            error(out, StatusCode::NOT_FOUND, "not_found", |b| {
                b.extend_from_slice(br#","message":"no route matches this request""#)
            });
            StatusCode::NOT_FOUND
        }
        ProxyError::Limited {
            limit,
            rate,
            rejection,
        } => limited(out, route?, (*limit, *rate), rejection),
        ProxyError::Queued(q) => limited(out, route?, (q.limit, 0), &q.rejection),
        ProxyError::MissingKey { limit, part } => {
            let s = StatusCode::TOO_MANY_REQUESTS;
            error(out, s, "missing_key", |b| {
                names(b, route_name, limit_name(*limit));
                b.extend_from_slice(b",\"part\":");
                push_json_str(b, part);
            });
            s
        }
        ProxyError::AmbiguousKey { limit, part } => {
            error(out, StatusCode::BAD_REQUEST, "ambiguous_key", |b| {
                names(b, route_name, limit_name(*limit));
                b.extend_from_slice(b",\"part\":");
                push_json_str(b, part);
                b.extend_from_slice(
                    br#","message":"the key part has several different values; send one""#,
                );
            });
            StatusCode::BAD_REQUEST
        }
        ProxyError::LimiterUnavailable { limit } => {
            out.status(StatusCode::SERVICE_UNAVAILABLE);
            out.field(&RETRY_AFTER, b"1");
            error_body(out, "limiter_unavailable", |b| {
                names(b, route_name, limit_name(*limit))
            });
            StatusCode::SERVICE_UNAVAILABLE
        }
        ProxyError::Upstream(_) | ProxyError::SwitchedUnasked => {
            tracing::warn!(route = %route_name, error = %e, "upstream request failed");
            error(out, StatusCode::BAD_GATEWAY, "bad_gateway", |b| {
                b.extend_from_slice(b",\"route\":");
                push_json_str(b, route_name);
                b.extend_from_slice(br#","message":"no valid answer from the upstream: connection refused or failed, or not HTTP""#);
            });
            StatusCode::BAD_GATEWAY
        }
        ProxyError::Panicked => {
            out.close();
            error(
                out,
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                |b| {
                    b.extend_from_slice(b",\"route\":");
                    push_json_str(b, route_name);
                    b.extend_from_slice(
                        br#","message":"tollgate failed while handling this request""#,
                    );
                },
            );
            StatusCode::INTERNAL_SERVER_ERROR
        }
        ProxyError::UpstreamTimeout => {
            tracing::warn!(route = %route_name, timeout = ?route.map(|r| r.timeout), "upstream timed out");
            error(out, StatusCode::GATEWAY_TIMEOUT, "gateway_timeout", |b| {
                b.extend_from_slice(b",\"route\":");
                push_json_str(b, route_name);
                b.extend_from_slice(br#","message":"upstream did not answer in time""#);
            });
            StatusCode::GATEWAY_TIMEOUT
        }
    };
    Some(status)
}

/// 429 with `Retry-After` and the `RateLimit` fields. On a rejection `t` is the time until
/// this request would be admitted: the same as `Retry-After`, which is what a client reading
/// only the `RateLimit` field needs. Route and limit names are letters, digits, `_`, `.` and
/// `-` (config validation): no JSON escaping.
#[inline]
fn too_many_requests(
    out: &mut impl AnswerWriter,
    route: &Route,
    (limit, rate): (&Limit, u16),
    r: &Rejection,
) {
    out.status(StatusCode::TOO_MANY_REQUESTS);
    out.field(&CONTENT_TYPE, JSON);
    rate_fields(out, limit, rate, r);
    let b = out.body();
    b.extend_from_slice(b"{\"error\":\"rate_limited\",\"route\":\"");
    b.extend_from_slice(route.name.as_bytes());
    b.extend_from_slice(b"\",\"limit\":\"");
    b.extend_from_slice(limit.name.as_bytes());
    b.extend_from_slice(b"\",\"retry_after_ms\":");
    push_u64(b, r.retry_after.div_ceil(1000));
    b.push(b'}');
}

/// `Retry-After` and the `RateLimit` fields of a rejection, default or custom; the policy is
/// the rate the key was decided under (`rate`, an index into [`Limit::rates`]).
#[inline]
fn rate_fields(out: &mut impl AnswerWriter, limit: &Limit, rate: u16, r: &Rejection) {
    out.field_with(&RETRY_AFTER, |v| push_u64(v, retry_after_secs(r)));
    if limit.algorithm.is_concurrency() {
        // The IETF fields describe a rate; a concurrency limit has slots, and says when to
        // come back in `Retry-After` only.
        return;
    }
    out.field(&RATELIMIT_POLICY, limit.rate(rate).policy.as_bytes());
    out.field_with(&RATELIMIT, |v| {
        push_ratelimit(v, limit, r.remaining, r.retry_after)
    });
}

/// `Retry-After`'s whole seconds, rounded up and at least 1 (a `0` reads as "now" to clients
/// that would then spin).
#[inline]
fn retry_after_secs(r: &Rejection) -> u64 {
    ceil_secs(r.retry_after).max(1)
}

/// A route's own `rejection:` answer. Out of line and cold: the routes without one keep the
/// default 429's code path as it was, and the template is only walked here, never parsed.
#[cold]
#[inline(never)]
fn custom_rejection(
    out: &mut impl AnswerWriter,
    route: &Route,
    custom: &RejectionConfig,
    (limit, rate): (&Limit, u16),
    r: &Rejection,
) -> StatusCode {
    out.status(custom.status);
    out.field(&CONTENT_TYPE, custom.content_type.as_bytes());
    rate_fields(out, limit, rate, r);
    if custom.legacy_headers && !limit.algorithm.is_concurrency() {
        for (name, n) in legacy_fields(limit.rate(rate), r.remaining, r.reset_after) {
            out.field_with(name, |v| push_u64(v, n));
        }
    }
    render(out.body(), &custom.body, &route.name, &limit.name, r);
    custom.status
}

/// `template` filled in for this rejection: names JSON-escaped when the body is JSON, the
/// waits as `Retry-After` (whole seconds) and in milliseconds, both rounded up.
fn render(b: &mut Vec<u8>, template: &Template, route: &str, limit: &str, r: &Rejection) {
    let name = |b: &mut Vec<u8>, s: &str| {
        if template.json() {
            push_json_escaped(b, s);
        } else {
            b.extend_from_slice(s.as_bytes());
        }
    };
    for piece in template.pieces() {
        match piece {
            Piece::Text(text) => b.extend_from_slice(text.as_bytes()),
            Piece::Route => name(b, route),
            Piece::Limit => name(b, limit),
            Piece::RetryAfter => push_u64(b, retry_after_secs(r)),
            Piece::RetryAfterMs => push_u64(b, r.retry_after.div_ceil(1000)),
        }
    }
}

/// A JSON error answer: `{"error":KIND` + what `rest` appends + `}`.
fn error(
    out: &mut impl AnswerWriter,
    status: StatusCode,
    kind: &str,
    rest: impl FnOnce(&mut Vec<u8>),
) {
    out.status(status);
    error_body(out, kind, rest);
}

fn error_body(out: &mut impl AnswerWriter, kind: &str, rest: impl FnOnce(&mut Vec<u8>)) {
    out.field(&CONTENT_TYPE, JSON);
    let b = out.body();
    b.extend_from_slice(b"{\"error\":\"");
    b.extend_from_slice(kind.as_bytes());
    b.push(b'"');
    rest(b);
    b.push(b'}');
}

/// `,"route":R,"limit":L`.
fn names(b: &mut Vec<u8>, route: &str, limit: &str) {
    b.extend_from_slice(b",\"route\":");
    push_json_str(b, route);
    b.extend_from_slice(b",\"limit\":");
    push_json_str(b, limit);
}

/// `s` as a JSON string.
#[inline]
fn push_json_str(b: &mut Vec<u8>, s: &str) {
    b.push(b'"');
    push_json_escaped(b, s);
    b.push(b'"');
}

/// `s` escaped as the inside of a JSON string (RFC 8259 §7): the one place tollgate's answers
/// escape text, whether into its own JSON or into a route's JSON template. Runs that need no
/// escape (a whole route or limit name, always) are copied at once: byte by byte, a custom
/// rejection's two names cost more than the rest of its body.
fn push_json_escaped(b: &mut Vec<u8>, s: &str) {
    let needs_escape = |c: &u8| matches!(c, b'"' | b'\\' | 0..=0x1f | 0x7f);
    let mut rest = s.as_bytes();
    while let Some(i) = rest.iter().position(needs_escape) {
        b.extend_from_slice(&rest[..i]);
        let c = rest[i];
        match c {
            b'"' => b.extend_from_slice(b"\\\""),
            b'\\' => b.extend_from_slice(b"\\\\"),
            b'\n' => b.extend_from_slice(b"\\n"),
            b'\r' => b.extend_from_slice(b"\\r"),
            b'\t' => b.extend_from_slice(b"\\t"),
            _ => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                b.extend_from_slice(&[
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(c >> 4)],
                    HEX[usize::from(c & 15)],
                ]);
            }
        }
        rest = &rest[i + 1..];
    }
    b.extend_from_slice(rest);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Text {
        status: Option<StatusCode>,
        fields: Vec<(String, String)>,
        body: Vec<u8>,
    }

    impl AnswerWriter for Text {
        fn status(&mut self, status: StatusCode) {
            self.status = Some(status);
        }
        fn field(&mut self, name: &'static HeaderName, value: &[u8]) {
            self.fields.push((
                name.to_string(),
                String::from_utf8_lossy(value).into_owned(),
            ));
        }
        fn field_with(&mut self, name: &'static HeaderName, write: impl FnOnce(&mut Vec<u8>)) {
            let mut v = Vec::new();
            write(&mut v);
            self.field(name, &v);
        }
        fn body(&mut self) -> &mut Vec<u8> {
            &mut self.body
        }
        fn close(&mut self) {
            self.fields.push(("connection".into(), "close".into()));
        }
    }

    fn answer(e: ProxyError) -> Text {
        let mut t = Text::default();
        let status = rescue(&e, None, &mut t);
        assert_eq!(status, t.status);
        serde_json::from_slice::<serde_json::Value>(&t.body).expect("the body is JSON");
        t
    }

    #[test]
    fn who_failed_decides_the_status() {
        for (e, status) in [
            (ProxyError::BadRequest("x"), 400),
            (ProxyError::MalformedBody, 400),
            (ProxyError::BodyCutShort, 400),
            (ProxyError::ConnectNotAllowed, 405),
            (ProxyError::CodingNotImplemented, 501),
            (ProxyError::NoRoute, 404),
            (
                ProxyError::MissingKey {
                    limit: 0,
                    part: "header:x".into(),
                },
                429,
            ),
            (
                ProxyError::AmbiguousKey {
                    limit: 0,
                    part: "header:x".into(),
                },
                400,
            ),
            (ProxyError::LimiterUnavailable { limit: 0 }, 503),
            (ProxyError::from(io::Error::other("refused")), 502),
            (ProxyError::SwitchedUnasked, 502),
            (ProxyError::UpstreamTimeout, 504),
            (ProxyError::Panicked, 500),
        ] {
            assert_eq!(answer(e).status.map(|s| s.as_u16()), Some(status));
        }
        let mut t = Text::default();
        assert_eq!(rescue(&ProxyError::ClientGone, None, &mut t), None);
        assert!(t.status.is_none() && t.body.is_empty());
    }

    #[test]
    fn a_panic_is_a_500_that_closes_the_connection() {
        let t = answer(ProxyError::Panicked);
        assert!(
            t.fields
                .contains(&("connection".to_owned(), "close".to_owned())),
            "{:?}",
            t.fields
        );
        let body: serde_json::Value = serde_json::from_slice(&t.body).unwrap();
        assert_eq!(body["error"], "internal_error");
    }

    fn rendered(source: &str, json: bool, route: &str, retry_after: u64) -> String {
        let t = Template::compile(source, json).unwrap();
        let r = Rejection {
            retry_after,
            remaining: 0,
            reset_after: retry_after,
        };
        let mut b = b"before:".to_vec();
        render(&mut b, &t, route, "per-key", &r);
        String::from_utf8(b).unwrap()
    }

    #[test]
    fn templates_are_filled_in() {
        assert_eq!(
            rendered(
                r#"{"message":"slow down","retry_after":{retry_after}}"#,
                true,
                "search",
                17_250_000
            ),
            r#"before:{"message":"slow down","retry_after":18}"#
        );
        assert_eq!(
            rendered(
                "{route}/{limit}: {retry_after}s {retry_after_ms}ms {{x}}",
                false,
                "search",
                1_000_001
            ),
            "before:search/per-key: 2s 1001ms {x}"
        );
        // Under a second still says 1 (as Retry-After does); milliseconds round up.
        assert_eq!(
            rendered("{retry_after} {retry_after_ms}", false, "r", 1),
            "before:1 1"
        );
    }

    #[test]
    fn names_are_json_escaped_in_json_bodies_only() {
        let body = rendered(r#"{"route":"{route}"}"#, true, "a\"b\\c\n\u{1}", 1);
        let v: serde_json::Value = serde_json::from_str(&body["before:".len()..]).unwrap();
        assert_eq!(v["route"], "a\"b\\c\n\u{1}");
        assert_eq!(rendered("{route}", false, "a\"b", 1), "before:a\"b");
    }

    #[test]
    fn json_escaping_is_what_serde_json_reads_back() {
        let all: String = (0u8..0x80).map(char::from).chain("é☃".chars()).collect();
        let mut b = Vec::new();
        push_json_str(&mut b, &all);
        assert_eq!(serde_json::from_slice::<String>(&b).unwrap(), all);
    }

    #[test]
    fn messages_are_escaped_as_json() {
        let t = answer(ProxyError::BadRequest("a \"quoted\"\nline"));
        let v: serde_json::Value = serde_json::from_slice(&t.body).unwrap();
        assert_eq!(v["message"], "a \"quoted\"\nline");
        assert_eq!(v["error"], "bad_request");
    }
}
