//! Header rewriting between client and upstream: hop-by-hop removal (RFC 9110 §7.6.1) and the
//! `X-Forwarded-*` fields.

use std::net::IpAddr;

use http::header::{
    CONNECTION, CONTENT_LENGTH, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRAILER,
    TRANSFER_ENCODING, UPGRADE,
};
use http::{HeaderMap, HeaderName, HeaderValue};

/// Connection-specific fields that never cross a proxy, besides those `Connection` names.
/// Typed names: a `&str` name is parsed again on every lookup, and this runs twice per request.
static HOP_BY_HOP: [HeaderName; 9] = [
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    TE,
    TRAILER,
    TRANSFER_ENCODING,
    UPGRADE,
    PROXY_AUTHORIZATION,
    // Only meaningful on responses from a proxy, but hop-by-hop all the same.
    PROXY_AUTHENTICATE,
];

static XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
static XFP: HeaderName = HeaderName::from_static("x-forwarded-proto");
static XFH: HeaderName = HeaderName::from_static("x-forwarded-host");

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
pub fn only_chunked(h: &HeaderMap) -> bool {
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
pub fn underscore_lookalike(name: &[u8]) -> bool {
    name.contains(&b'_')
        && FRAMING_AND_FORWARDING.iter().any(|f| {
            f.len() == name.len()
                && f.bytes().zip(name).all(|(a, &b)| {
                    let b = if b == b'_' { b'-' } else { b };
                    a == b.to_ascii_lowercase()
                })
        })
}

/// Removes the hop-by-hop fields, including every field the `Connection` header names.
/// `keep_upgrade`: an upgrade being passed through keeps `Connection: upgrade` and `Upgrade`.
pub fn strip_hop_by_hop(h: &mut HeaderMap, keep_upgrade: bool) {
    // Before `Connection` can name it away: the framing the message came in, not what is left.
    let chunked_framing = h.contains_key(TRANSFER_ENCODING);
    if h.contains_key(CONNECTION) {
        let named: Vec<HeaderName> = h
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .filter(|n| !(keep_upgrade && *n == UPGRADE))
            .collect();
        for n in named {
            h.remove(n);
        }
    }
    // Most messages carry none or one of them: one pass over the names present (comparing a
    // standard name is comparing a number) instead of a hashed removal for each of the nine.
    // The same pass finds `_` spellings of framing and forwarding fields (standard names never
    // hold `_`; custom ones rarely do, and only those are compared).
    let mut present: smallvec::SmallVec<[&'static HeaderName; 4]> = smallvec::SmallVec::new();
    let mut lookalikes: smallvec::SmallVec<[HeaderName; 1]> = smallvec::SmallVec::new();
    for name in h.keys() {
        if let Some(n) = HOP_BY_HOP.iter().find(|n| *n == name) {
            if !(keep_upgrade && (*n == CONNECTION || *n == UPGRADE)) && !present.contains(&n) {
                present.push(n);
            }
        } else if underscore_lookalike(name.as_str().as_bytes()) {
            lookalikes.push(name.clone());
        }
    }
    // RFC 9112 §6.3: a message with both is framed by Transfer-Encoding, and a proxy must drop
    // the Content-Length before passing it on (hyper decodes the chunks but keeps the field;
    // re-sent as the length, it cut the body short). The body is re-framed on the way out.
    if chunked_framing {
        h.remove(CONTENT_LENGTH);
    } else {
        single_length(h);
    }
    for n in present {
        h.remove(n);
    }
    for n in lookalikes {
        h.remove(n);
    }
    if keep_upgrade {
        h.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        // `Upgrade: websocket, h2c` offers both: only what tollgate passes on is offered on.
        let offered = h
            .get_all(UPGRADE)
            .iter()
            .any(|v| v.to_str().map_or(true, |s| s.split(',').any(is_h2c)));
        if offered {
            let kept: Vec<String> = h
                .get_all(UPGRADE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|s| s.split(','))
                .map(str::trim)
                .filter(|t| !t.is_empty() && !is_h2c(t))
                .map(str::to_owned)
                .collect();
            match HeaderValue::from_str(&kept.join(", ")) {
                Ok(v) if !kept.is_empty() => {
                    h.insert(UPGRADE, v);
                }
                _ => {
                    h.remove(UPGRADE);
                }
            }
        }
    }
}

fn is_h2c(token: &str) -> bool {
    token.trim().eq_ignore_ascii_case("h2c")
}

/// The host a request is for: the target's authority when it has one (the absolute form, or
/// HTTP/2's `:authority`), which RFC 9112 §3.2.2 puts before `Host`; else `Host`. Refused, as
/// RFC 9112 §3.2 has a server do with 400: an HTTP/1.1 request without `Host`, any HTTP/1.x
/// request with two, or one whose value is not a host.
pub fn request_host<'a>(
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
/// space...). A table, because every request's `Host` is checked byte by byte: testing each
/// byte against the list of delimiters was 4.6 % of a rejected request's instructions.
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
pub fn valid_host(h: &[u8]) -> bool {
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
pub fn is_upgrade(version: http::Version, h: &HeaderMap) -> bool {
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

/// A header value formatted in a stack buffer: no `String` on the request path, only the
/// value's own bytes. `None` when the text is not a valid field value.
pub fn value_of(args: std::fmt::Arguments<'_>) -> Option<HeaderValue> {
    struct Buf {
        bytes: [u8; 256],
        len: usize,
    }
    impl std::fmt::Write for Buf {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let end = self.len + s.len();
            self.bytes
                .get_mut(self.len..end)
                .ok_or(std::fmt::Error)?
                .copy_from_slice(s.as_bytes());
            self.len = end;
            Ok(())
        }
    }
    let mut buf = Buf {
        bytes: [0; 256],
        len: 0,
    };
    if std::fmt::Write::write_fmt(&mut buf, args).is_ok() {
        HeaderValue::from_bytes(&buf.bytes[..buf.len]).ok()
    } else {
        // Longer than the buffer (a long limit name, a long X-Forwarded-For chain).
        HeaderValue::from_str(&std::fmt::format(args)).ok()
    }
}

/// Sets `X-Forwarded-For` (the peer appended to what came in), `-Proto` and `-Host`.
/// `-Proto`/`-Host` from the client are kept only when the peer is a trusted proxy.
/// `host`: the host the client asked for (`Host`, or the request target's authority, which is
/// where HTTP/2 carries it).
pub fn set_forwarded(
    h: &mut HeaderMap,
    peer: IpAddr,
    peer_trusted: bool,
    proto: &'static str,
    host: Option<&HeaderValue>,
) {
    let mut buf = [0; crate::key::IP_TEXT_MAX];
    let peer_text = crate::key::ip_text(peer, &mut buf);
    let xff = match h.get(&XFF).and_then(|v| v.to_str().ok()) {
        Some(prev) if !prev.trim().is_empty() => {
            // Several XFF lines are one comma list (RFC 9110 §5.3).
            let all: Vec<&str> = h
                .get_all(&XFF)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            let peer = std::str::from_utf8(peer_text).unwrap_or("unknown");
            value_of(format_args!("{}, {peer}", all.join(", ")))
        }
        _ => HeaderValue::from_bytes(peer_text).ok(),
    };
    if let Some(v) = xff {
        h.insert(&XFF, v);
    }
    if !(peer_trusted && h.contains_key(&XFP)) {
        h.insert(&XFP, HeaderValue::from_static(proto));
    }
    if !(peer_trusted && h.contains_key(&XFH)) {
        if let Some(host) = host {
            h.insert(&XFH, host.clone());
        } else {
            h.remove(&XFH);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_listed_and_standard_hop_by_hop_fields() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("upgrade", HeaderValue::from_static("h2c"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn a_length_beside_chunked_framing_goes_even_when_connection_names_the_coding() {
        let mut h = HeaderMap::new();
        h.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("3"));
        h.insert(CONNECTION, HeaderValue::from_static("transfer-encoding"));
        strip_hop_by_hop(&mut h, false);
        assert!(h.is_empty(), "{h:?}");
    }

    #[test]
    fn a_repeated_length_is_passed_on_once() {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("5, 5"));
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.get_all(CONTENT_LENGTH).iter().collect::<Vec<_>>(), ["5"]);
        let mut h = HeaderMap::new();
        h.append(CONTENT_LENGTH, HeaderValue::from_static("7"));
        h.append(CONTENT_LENGTH, HeaderValue::from_static("7"));
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.get_all(CONTENT_LENGTH).iter().collect::<Vec<_>>(), ["7"]);
        let mut h = HeaderMap::new();
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("12"));
        strip_hop_by_hop(&mut h, false);
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
        strip_hop_by_hop(&mut h, false);
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
        strip_hop_by_hop(&mut h, false);
        assert!(h.is_empty(), "{h:?}");

        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("upgrade"));
        h.insert("upgrade", HeaderValue::from_static("h2c, websocket"));
        assert!(is_upgrade(v11, &h));
        strip_hop_by_hop(&mut h, true);
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
    }

    #[test]
    fn values_are_formatted_whole_past_the_stack_buffer_and_refused_when_invalid() {
        assert_eq!(value_of(format_args!("{}-{}", "a", 7)).unwrap(), "a-7");
        let long = "x".repeat(1000);
        assert_eq!(
            value_of(format_args!("{long};r=1")).unwrap(),
            format!("{long};r=1").as_str()
        );
        assert!(value_of(format_args!("bad\n{}", 1)).is_none());
    }

    #[test]
    fn forwarded_fields_from_untrusted_peer_are_replaced() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("api.example.com"));
        h.insert("x-forwarded-for", HeaderValue::from_static("1.1.1.1"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        let host = h.get(http::header::HOST).cloned();
        set_forwarded(
            &mut h,
            "9.9.9.9".parse().unwrap(),
            false,
            "http",
            host.as_ref(),
        );
        assert_eq!(h["x-forwarded-for"], "1.1.1.1, 9.9.9.9");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "api.example.com");
        let mut h2 = HeaderMap::new();
        h2.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        set_forwarded(&mut h2, "10.0.0.1".parse().unwrap(), true, "http", None);
        assert_eq!(h2["x-forwarded-proto"], "https");
        assert_eq!(h2["x-forwarded-for"], "10.0.0.1");
    }
}
