//! Pieces of the answers tollgate writes itself, shared by both codecs: the IETF `RateLimit`
//! fields (draft-ietf-httpapi-ratelimit-headers-10 syntax), numbers, and the hyper codec's
//! rendering of [`super::error::rescue`]'s answer as a `Response`.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use super::Body;
use super::error::{AnswerWriter, ProxyError, rescue};
use crate::limit::algorithm::Micros;
use crate::limit::{Limit, LimitRate};
use crate::snapshot::Route;

pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub(crate) static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub(crate) static X_RATELIMIT_REMAINING: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining");
pub(crate) static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// The answer to `e` as a `Response` (`None`: nobody to answer).
pub(crate) fn answer(e: &ProxyError, route: Option<&Route>) -> Option<Response<Body>> {
    let mut built = Built {
        resp: Response::new(()),
        body: Vec::new(),
    };
    rescue(e, route, &mut built)?;
    Some(built.resp.map(|()| full(built.body)))
}

/// [`rescue`]'s answer, being built for hyper.
struct Built {
    resp: Response<()>,
    body: Vec<u8>,
}

impl AnswerWriter for Built {
    fn status(&mut self, status: StatusCode) {
        *self.resp.status_mut() = status;
    }

    fn field(&mut self, name: &'static HeaderName, value: &[u8]) {
        if let Ok(v) = HeaderValue::from_bytes(value) {
            self.resp.headers_mut().append(name, v);
        }
    }

    fn field_with(&mut self, name: &'static HeaderName, write: impl FnOnce(&mut Vec<u8>)) {
        let mut v = Vec::new();
        write(&mut v);
        if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(v)) {
            self.resp.headers_mut().append(name, v);
        }
    }

    fn body(&mut self) -> &mut Vec<u8> {
        &mut self.body
    }

    fn close(&mut self) {
        self.resp
            .headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// Whole seconds, rounded up: a client that waits this long is admitted.
#[inline]
pub(crate) fn ceil_secs(us: Micros) -> u64 {
    us.div_ceil(1_000_000)
}

/// Appends the `RateLimit` value. Written by hand: this runs on every admitted response, and the
/// formatter's machinery was a visible part of it. Limit names are letters, digits, `_`, `.`
/// and `-` (config validation), so the value needs no escaping.
#[inline]
pub(crate) fn push_ratelimit(
    out: &mut Vec<u8>,
    limit: &Limit,
    remaining: u64,
    reset_after: Micros,
) {
    out.push(b'"');
    out.extend_from_slice(limit.name.as_bytes());
    out.extend_from_slice(b"\";r=");
    push_u64(out, remaining);
    out.extend_from_slice(b";t=");
    push_u64(out, ceil_secs(reset_after));
}

/// The legacy `X-RateLimit-*` fields (a route's `rejection.legacy_headers`), for 429s and
/// admitted responses alike: the COUNT of the rate that applied, the units left, and the seconds until the
/// limit is full again (rounded up). Older clients read these rather than the IETF fields.
#[inline]
pub(crate) fn legacy_fields(
    rate: &LimitRate,
    remaining: u64,
    reset_after: Micros,
) -> [(&'static HeaderName, u64); 3] {
    [
        (&X_RATELIMIT_LIMIT, rate.count),
        (&X_RATELIMIT_REMAINING, remaining),
        (&X_RATELIMIT_RESET, ceil_secs(reset_after)),
    ]
}

/// Appends `n` in decimal (`itoa`: two digits per step; this runs several times per answer).
#[inline]
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
