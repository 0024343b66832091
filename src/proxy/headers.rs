//! The hyper codec's side of the header rules: a `HeaderMap` viewed and edited in place by the
//! rules of [`super::forwarding`], the framing fields put right for hyper to frame the message
//! again, and the checks of a request head hyper leaves to its user (`Host`, codings, upgrades).

use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING, UPGRADE};
use http::{HeaderMap, HeaderName, HeaderValue};

use super::fields::{Name, classify};
use super::forwarding::{HeadView, HeadWriter};

impl HeadView for HeaderMap {
    type Handle = HeaderName;

    fn each<'a>(&'a self, mut f: impl FnMut(&'a HeaderName, Name, &'a [u8], &'a [u8])) {
        for (name, value) in self {
            f(
                name,
                classify(name.as_str().as_bytes()),
                name.as_str().as_bytes(),
                value.as_bytes(),
            );
        }
    }

    fn named_by_connection(&self, name: &[u8]) -> bool {
        self.get_all(CONNECTION).iter().any(|v| {
            v.as_bytes()
                .split(|b| *b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(name))
        })
    }
}

/// The rules' decisions on a `HeaderMap`, applied by [`MapEdit::apply`] once they are all in:
/// fields to drop (by name: a rule decides by name, so all lines of one name alike), fields to
/// add, and whether the message came chunked.
#[derive(Default)]
pub(crate) struct MapEdit {
    dropped: smallvec::SmallVec<[HeaderName; 4]>,
    added: smallvec::SmallVec<[(&'static HeaderName, HeaderValue); 6]>,
    chunked: bool,
}

impl HeadWriter<HeaderName> for MapEdit {
    fn pass(&mut self, _: &HeaderName, _: Name, _: &[u8], _: &[u8]) {}

    fn drop_field(&mut self, field: &HeaderName) {
        if !self.dropped.contains(field) {
            self.dropped.push(field.clone());
        }
    }

    fn framing(&mut self, _: &HeaderName, kind: Name, _: &[u8]) {
        self.chunked |= kind == Name::TransferEncoding;
    }

    fn add(&mut self, name: &'static HeaderName, value: &[u8]) {
        if let Ok(v) = HeaderValue::from_bytes(value) {
            self.added.push((name, v));
        }
    }

    fn add_list(&mut self, name: &'static HeaderName, parts: &[&[u8]]) {
        let mut v = Vec::with_capacity(parts.iter().map(|p| p.len() + 2).sum());
        for (i, p) in parts.iter().enumerate() {
            if i > 0 {
                v.extend_from_slice(b", ");
            }
            v.extend_from_slice(p);
        }
        self.add_with(name, |out| *out = v);
    }

    fn add_with(&mut self, name: &'static HeaderName, write: impl FnOnce(&mut Vec<u8>)) {
        let mut v = Vec::new();
        write(&mut v);
        if let Ok(v) = HeaderValue::from_maybe_shared(bytes::Bytes::from(v)) {
            self.added.push((name, v));
        }
    }
}

impl MapEdit {
    /// Applies the decisions. RFC 9112 §6.3: a message with both framings is framed by
    /// `Transfer-Encoding`, and a proxy must drop the `Content-Length` before passing it on
    /// (hyper decodes the chunks but keeps the field; re-sent as the length, it cut the body
    /// short). hyper frames the body again on the way out, so `Transfer-Encoding` goes too.
    pub(crate) fn apply(self, h: &mut HeaderMap) {
        for n in &self.dropped {
            h.remove(n);
        }
        h.remove(TRANSFER_ENCODING);
        if self.chunked {
            h.remove(CONTENT_LENGTH);
        } else {
            single_length(h);
        }
        for (name, value) in self.added {
            h.append(name, value);
        }
    }
}

/// Marks the response fields whose values change from one response to the next as never to be
/// indexed by HPACK (RFC 7541 §7.1.3), for a response going out over HTTP/2: `X-Request-Id`,
/// the `RateLimit` counters and `Retry-After` (each request), `Date` (each second). Indexed, each new value went into the connection's dynamic table and every
/// later response walked all the entries of its name before adding one more: with a unique
/// `X-Request-Id` per response that walk was 50 comparisons and a sixth of an h2 stream's
/// instructions (docs/benchmarks.md). Values that repeat (`Server`, `Content-Type`,
/// `RateLimit-Policy`) stay indexable. nginx indexes none of its response fields.
pub(crate) fn never_index_varying(h: &mut HeaderMap) {
    use super::request_id::X_REQUEST_ID;
    use super::response::{RATELIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET};
    use http::header::{DATE, RETRY_AFTER};
    for (name, value) in h.iter_mut() {
        if name == X_REQUEST_ID
            || name == DATE
            || name == RATELIMIT
            || name == RETRY_AFTER
            || name == X_RATELIMIT_REMAINING
            || name == X_RATELIMIT_RESET
        {
            value.set_sensitive(true);
        }
    }
}

/// `Content-Length: 5, 5` (or two fields of 5), which hyper reads as 5, is passed on as the one
/// `5` it means: as a list it breaks HTTP/2 clients (a malformed length) and strict HTTP/1.1
/// ones. Differing values never get here (hyper refuses them).
fn single_length(h: &mut HeaderMap) {
    let mut all = h.get_all(CONTENT_LENGTH).iter();
    let (Some(first), rest) = (all.next(), all.next().is_some()) else {
        return;
    };
    if !rest && !first.as_bytes().contains(&b',') {
        return;
    }
    let one = h
        .get_all(CONTENT_LENGTH)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .try_fold(None, |seen: Option<&[u8]>, v| match seen {
            Some(s) if s != v => Err(()),
            _ => Ok(Some(v)),
        });
    match one {
        Ok(Some(v)) => {
            if let Ok(v) = HeaderValue::from_bytes(v) {
                h.insert(CONTENT_LENGTH, v);
            }
        }
        _ => {
            h.remove(CONTENT_LENGTH);
        }
    }
}

/// Whether a request's `Transfer-Encoding` (if any) is `chunked` alone, the one coding a body
/// is passed on in.
pub(crate) fn only_chunked(h: &HeaderMap) -> bool {
    let mut codings = h
        .get_all(TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(|c| c.trim_ascii())
        .filter(|c| !c.is_empty());
    match codings.next() {
        None => true,
        Some(first) => first.eq_ignore_ascii_case(b"chunked") && codings.next().is_none(),
    }
}

/// Fields that frame a message or that tollgate sets, spelled with `-`.
const FRAMING_AND_FORWARDING: [&str; 10] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-real-ip",
    "x-request-id",
];

/// `X_Forwarded_For`, `Transfer_Encoding`…: a name with `_` where one of those has `-`. CGI,
/// WSGI, Rack and PHP turn both spellings into the same variable (`HTTP_X_FORWARDED_FOR`), so
/// a client could set through one what tollgate sets or frames by the other: forge its
/// forwarded address, or have a body framed differently upstream. Never passed on, either way
/// (nginx drops every name with `_` by default; other names with `_` pass here).
pub(crate) fn underscore_lookalike(name: &[u8]) -> bool {
    name.contains(&b'_')
        && FRAMING_AND_FORWARDING.iter().any(|f| {
            f.len() == name.len()
                && f.bytes().zip(name).all(|(a, &b)| {
                    let b = if b == b'_' { b'-' } else { b };
                    a == b.to_ascii_lowercase()
                })
        })
}

fn is_h2c(token: &str) -> bool {
    token.trim().eq_ignore_ascii_case("h2c")
}

/// The host a request is for: the target's authority when it has one (the absolute form, or
/// HTTP/2's `:authority`), which RFC 9112 §3.2.2 puts before `Host`; else `Host`. Refused, as
/// RFC 9112 §3.2 has a server do with 400: an HTTP/1.1 request without `Host`, any HTTP/1.x
/// request with two, or one whose value is not a host.
pub(crate) fn request_host<'a>(
    version: http::Version,
    uri: &'a http::Uri,
    h: &'a HeaderMap,
) -> Result<Option<&'a str>, &'static str> {
    let field = if version <= http::Version::HTTP_11 {
        let mut all = h.get_all(http::header::HOST).iter();
        let first = all.next();
        if all.next().is_some() {
            return Err("more than one Host field");
        }
        match first {
            None if version == http::Version::HTTP_11 => {
                return Err("an HTTP/1.1 request needs a Host field");
            }
            Some(v) if !valid_host(v.as_bytes()) => return Err("the Host field is not a host"),
            v => v,
        }
    } else {
        h.get(http::header::HOST)
    };
    match uri.authority() {
        // The absolute form's or HTTP/2's authority, checked as `Host` is: userinfo
        // (`http://u@h/`) is an error there too (RFC 9110 §4.2.4, RFC 9113 §8.3.1), and would
        // otherwise choose the route and reach the upstream's `Host`.
        Some(a) if !valid_host(a.as_str().as_bytes()) => {
            Err("the request target's authority is not a host")
        }
        Some(a) => Ok(Some(a.as_str())),
        None => Ok(field.and_then(|v| v.to_str().ok())),
    }
}

/// The bytes of a reg-name: unreserved, pct-encoded and sub-delims characters (no `@`, `/`,
/// space...). A table, because every request's `Host` is checked byte by byte, and testing each
/// byte against the list of delimiters was a visible part of a rejected request's cost.
static REG_NAME: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = (b as u8).is_ascii_alphanumeric();
        b += 1;
    }
    let delims = b"-._~%!$&'()*+,;=";
    let mut i = 0;
    while i < delims.len() {
        t[delims[i] as usize] = true;
        i += 1;
    }
    t
};

/// Whether a `Host` value is `uri-host [":" port]` (RFC 9110 §7.2; empty is allowed, for a
/// target without an authority). RFC 9112 §3.2 has a server answer 400 to anything else, and a
/// value like `a b` or `u@h` would otherwise reach routing, `X-Forwarded-Host` and the upstream.
pub(crate) fn valid_host(h: &[u8]) -> bool {
    let (host, port) = if let Some(rest) = h.strip_prefix(b"[") {
        // IP-literal: an IPv6 address (hex digits, colons, an embedded IPv4's dots).
        let Some(end) = rest.iter().position(|&b| b == b']') else {
            return false;
        };
        if !rest[..end]
            .iter()
            .all(|b| b.is_ascii_hexdigit() || b":.".contains(b))
        {
            return false;
        }
        (&b""[..], &rest[end + 1..])
    } else {
        match h.iter().position(|&b| b == b':') {
            Some(i) => (&h[..i], &h[i..]),
            None => (h, &b""[..]),
        }
    };
    let reg_name = host.iter().all(|&b| REG_NAME[b as usize]);
    let port_ok = match port {
        [] => true,
        [b':', digits @ ..] => digits.iter().all(u8::is_ascii_digit),
        _ => false,
    };
    reg_name && port_ok
}

/// An HTTP/1.1 request asking to switch protocols (`Connection: upgrade` plus `Upgrade`) to
/// something other than `h2c`.
///
/// `h2c` is a switch of the client's own connection to HTTP/2, which tollgate speaks itself
/// (prior knowledge); passed on, an upstream that accepts it turns the connection into a raw
/// tunnel past routing and limits. Such a request is forwarded as the plain HTTP/1.1 request it
/// also is (the `Upgrade` field dropped as hop-by-hop), as nginx and Envoy do.
pub(crate) fn is_upgrade(version: http::Version, h: &HeaderMap) -> bool {
    version == http::Version::HTTP_11
        && h.get_all(UPGRADE).iter().any(|v| {
            v.to_str()
                .is_ok_and(|s| s.split(',').any(|t| !t.trim().is_empty() && !is_h2c(t)))
        })
        && h.get_all(CONNECTION).iter().any(|v| {
            v.to_str().is_ok_and(|s| {
                s.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::forwarding::{RequestRule, upstream_request};

    /// The request rule on `h`, less the forwarding fields it always adds.
    fn strip(h: &mut HeaderMap, upgrade: bool) {
        let mut edit = MapEdit::default();
        let rule = RequestRule {
            trusted: false,
            proto: "http",
            peer: b"192.0.2.1",
            client_host: None,
            host: None,
            own_request_id: None,
            upgrade,
        };
        upstream_request(h, &rule, &mut edit);
        edit.apply(h);
        h.remove("x-forwarded-for");
        h.remove("x-forwarded-proto");
    }

    #[test]
    fn a_length_beside_chunked_framing_goes_even_when_connection_names_the_coding() {
        let mut h = HeaderMap::new();
        h.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("3"));
        h.insert(CONNECTION, HeaderValue::from_static("transfer-encoding"));
        strip(&mut h, false);
        assert!(h.is_empty(), "{h:?}");
    }

    #[test]
    fn a_repeated_length_is_passed_on_once() {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("5, 5"));
        strip(&mut h, false);
        assert_eq!(h.get_all(CONTENT_LENGTH).iter().collect::<Vec<_>>(), ["5"]);
        let mut h = HeaderMap::new();
        h.append(CONTENT_LENGTH, HeaderValue::from_static("7"));
        h.append(CONTENT_LENGTH, HeaderValue::from_static("7"));
        strip(&mut h, false);
        assert_eq!(h.get_all(CONTENT_LENGTH).iter().collect::<Vec<_>>(), ["7"]);
        let mut h = HeaderMap::new();
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("12"));
        strip(&mut h, false);
        assert_eq!(h.get_all(CONTENT_LENGTH).iter().collect::<Vec<_>>(), ["12"]);
    }

    #[test]
    fn only_chunked_alone_is_a_coding_passed_on() {
        let te = |v: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in v {
                h.append(TRANSFER_ENCODING, HeaderValue::from_static(v));
            }
            only_chunked(&h)
        };
        assert!(te(&[]));
        assert!(te(&["chunked"]));
        assert!(te(&["Chunked "]));
        assert!(!te(&["gzip, chunked"]));
        assert!(!te(&["gzip", "chunked"]));
        assert!(!te(&["chunked, chunked"]));
        assert!(!te(&["identity"]));
    }

    #[test]
    fn underscore_spellings_of_framing_and_forwarding_fields_are_dropped() {
        for bad in [
            "X_Forwarded_For",
            "transfer_encoding",
            "Content_Length",
            "x-forwarded_host",
            "X_REAL_IP",
        ] {
            assert!(underscore_lookalike(bad.as_bytes()), "{bad}");
        }
        for ok in [
            "api_key",
            "x_custom",
            "x-forwarded-for",
            "host",
            "x_forwarded_fo",
        ] {
            assert!(!underscore_lookalike(ok.as_bytes()), "{ok}");
        }
        let mut h = HeaderMap::new();
        h.insert("x_forwarded_for", HeaderValue::from_static("6.6.6.6"));
        h.insert("api_key", HeaderValue::from_static("k"));
        strip(&mut h, false);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("api_key"));
    }

    #[test]
    fn the_reg_name_table_is_rfc_3986s_character_set() {
        for b in 0..=255u8 {
            let want = b.is_ascii_alphanumeric() || b"-._~%!$&'()*+,;=".contains(&b);
            assert_eq!(REG_NAME[b as usize], want, "byte {b:#04x}");
        }
    }

    #[test]
    fn host_values_are_a_host_and_an_optional_port() {
        for ok in [
            "api.example.com",
            "api.example.com:8080",
            "127.0.0.1:80",
            "[::1]:8080",
            "[2001:db8::1]",
            "h:",
            "",
            "xn--bcher-kva.example",
        ] {
            assert!(valid_host(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "a b", "u@h", "h:80:80", "h:8o", "h/x", "[::1", "[::1]x", "[zz]", "h\t",
        ] {
            assert!(!valid_host(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn an_h2c_upgrade_is_not_passed_on_and_is_dropped_from_a_list() {
        let v11 = http::Version::HTTP_11;
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("Upgrade, HTTP2-Settings"),
        );
        h.insert("upgrade", HeaderValue::from_static("h2c"));
        h.insert(
            "http2-settings",
            HeaderValue::from_static("AAMAAABkAAQAoAAAAAIAAAAA"),
        );
        assert!(!is_upgrade(v11, &h));
        strip(&mut h, false);
        assert!(h.is_empty(), "{h:?}");

        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("upgrade"));
        h.insert("upgrade", HeaderValue::from_static("h2c, websocket"));
        assert!(is_upgrade(v11, &h));
        strip(&mut h, true);
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
    }
}
