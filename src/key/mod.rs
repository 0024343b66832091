//! Limit keys: which client a request counts against.
//!
//! A key is the limit's parts (`ip`, `ip_prefix:V4,V6`, `header:NAME`, `query:NAME`, `path`,
//! `method`, `route`, `literal:TEXT`) joined with `|`. Values are escaped (`%` → `%25`, `|` → `%7C`, braces →
//! `%7B`/`%7D`, anything outside printable ASCII → `%XX`) so the join is injective — a client cannot craft one part that spells two — and
//! so no value can break a Redis Cluster `{hash tag}`. A value longer than
//! [`MAX_PART_LEN`] bytes is replaced by `~` and a SHA-256 prefix, so a client cannot make the
//! gateway store kilobytes per key.
//!
//! The client IP is the socket peer, unless the peer is in `server.trusted_proxies`: then
//! `X-Forwarded-For` (or RFC 7239 `Forwarded`) is walked right to left, skipping trusted hops,
//! and the first untrusted address is the client. A client outside the trusted set can write
//! any header it likes and still be keyed by its own address. `ip_prefix` keys by that
//! address's network ([`PrefixText`]): an IPv6 client owns a whole /64 and can rotate
//! addresses in it.

pub mod client_ip;

use std::net::IpAddr;

use http::{HeaderMap, Method, Uri};

use crate::config::{KeyPart, OnMissing};

pub use client_ip::client_ip;

use crate::keytext::push_escaped;
pub use crate::keytext::{KeyBuf, MAX_PART_LEN, from_admin};

/// What the key of one limit is made of, compiled from the config.
#[derive(Clone, Debug, PartialEq)]
pub struct KeySpec {
    /// Joined with `|` in this order; never empty.
    pub parts: Vec<KeyPart>,
    /// What [`KeySpec::build`] does when a part is absent from the request.
    pub on_missing: OnMissing,
}

/// The parts of a request a key can be built from.
pub struct RequestParts<'a> {
    /// For `method` parts.
    pub method: &'a Method,
    /// For `path` and `query:NAME` parts.
    pub uri: &'a Uri,
    /// For `header:NAME` parts.
    pub headers: &'a HeaderMap,
    /// The client's address, already resolved through `trusted_proxies`: the `ip` part, and the
    /// key under `on_missing: ip`.
    pub client_ip: IpAddr,
    /// `client_ip`'s text when the caller has it already (the HTTP/1.1 path keeps its peer's
    /// per connection), so a key's `ip` part does not format it again.
    pub client_ip_text: Option<&'a [u8]>,
    /// The matched route's name, for `route` parts.
    pub route: &'a str,
    /// The socket peer is in `server.trusted_proxies`: its headers may name a plan (an
    /// override's `when.header`); anyone else's never do.
    pub peer_trusted: bool,
}

/// Result of building one limit's key.
#[derive(Debug, PartialEq, Eq)]
pub enum KeyOutcome {
    /// The key was appended to the buffer.
    Built,
    /// A part is absent and the limit says `on_missing: skip`: the limit does not apply.
    Skip,
    /// A part is absent and the limit says `on_missing: reject`; names the part.
    Reject(String),
    /// A header or query part appears more than once with different values; names the part.
    /// Which one the upstream reads (the first, the last, all joined) is its own choice, so
    /// keying on any one would let a client be charged under one value and served under
    /// another. The request is refused (400) whatever `on_missing` says.
    Ambiguous(String),
}

impl KeySpec {
    /// Appends this limit's key for `req` to `out`. On `Skip`/`Reject` `out` is left as it was.
    pub fn build(&self, req: &RequestParts<'_>, out: &mut KeyBuf) -> KeyOutcome {
        let start = out.len();
        for (i, part) in self.parts.iter().enumerate() {
            if i > 0 {
                out.push(b'|');
            }
            let present = match part {
                KeyPart::Ip => {
                    push_client_ip(out, req);
                    true
                }
                KeyPart::Header(name) if name == http::header::COOKIE => {
                    push_cookie(out, req.headers)
                }
                KeyPart::Header(name) => match header_value(req.headers, name) {
                    Value::One(v) => {
                        push_escaped(out, v);
                        true
                    }
                    Value::Absent => false,
                    Value::Differing => {
                        out.truncate(start);
                        return KeyOutcome::Ambiguous(part.to_string());
                    }
                },
                KeyPart::Query(name) => match query_value(req.uri.query(), name) {
                    Value::One(v) => {
                        // Decoded first: `%61bc` and `abc` are one value to the upstream, so
                        // they are one key here.
                        let mut value = smallvec::SmallVec::<[u8; 64]>::new();
                        value.extend(form_decoded(v));
                        push_escaped(out, &value);
                        true
                    }
                    Value::Absent => false,
                    Value::Differing => {
                        out.truncate(start);
                        return KeyOutcome::Ambiguous(part.to_string());
                    }
                },
                KeyPart::Path => {
                    push_escaped(out, req.uri.path().as_bytes());
                    true
                }
                KeyPart::Method => {
                    // Escaped: an extension method may contain `|` or `%` (both are tchars).
                    push_escaped(out, req.method.as_str().as_bytes());
                    true
                }
                KeyPart::Route => {
                    out.extend_from_slice(req.route.as_bytes());
                    true
                }
                KeyPart::Literal(text) => {
                    push_escaped(out, text.as_bytes());
                    true
                }
                KeyPart::IpPrefix { v4, v6 } => {
                    // Hex digits, `:`, `.` and `/` only: nothing to escape.
                    out.extend_from_slice(PrefixText::new(req.client_ip, *v4, *v6).as_bytes());
                    true
                }
            };
            if !present {
                out.truncate(start);
                return match self.on_missing {
                    OnMissing::Skip => KeyOutcome::Skip,
                    OnMissing::Reject => KeyOutcome::Reject(part.to_string()),
                    OnMissing::Ip => {
                        // `ip <address>`: the space is escaped in every value (`%20`), so no
                        // header or query value, whatever it spells, can make this key.
                        out.extend_from_slice(b"ip ");
                        push_client_ip(out, req);
                        KeyOutcome::Built
                    }
                };
            }
        }
        KeyOutcome::Built
    }
}

fn push_client_ip(out: &mut KeyBuf, req: &RequestParts<'_>) {
    match req.client_ip_text {
        Some(text) => out.extend_from_slice(text),
        None => out.extend_from_slice(IpText::new(req.client_ip).as_bytes()),
    }
}

/// The network of an address in CIDR text (`203.0.113.0/24`, `2001:db8:1:2::/64`): the address
/// with every bit past the prefix cleared, then `/LENGTH`. IPv4 clients, IPv4-mapped IPv6 ones
/// included (a dual-stack socket's view of an IPv4 peer), take `v4` bits; other IPv6 clients
/// `v6` bits. `v4` above 32 or `v6` above 128 (config validation refuses both) keep the whole
/// address.
pub struct PrefixText {
    buf: [u8; PREFIX_TEXT_MAX],
    len: u8,
}

/// Longest CIDR text: an IPv6 address's text, `/` and three digits.
const PREFIX_TEXT_MAX: usize = IP_TEXT_MAX + 4;

impl PrefixText {
    /// `ip`'s network of `v4` (IPv4) or `v6` (IPv6) bits, as text.
    pub fn new(ip: IpAddr, v4: u8, v6: u8) -> Self {
        let (network, bits) = match ip.to_canonical() {
            IpAddr::V4(a) => {
                let bits = v4.min(32);
                let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
                (IpAddr::V4((a.to_bits() & mask).into()), bits)
            }
            IpAddr::V6(a) => {
                let bits = v6.min(128);
                let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
                (IpAddr::V6((a.to_bits() & mask).into()), bits)
            }
        };
        let mut buf = [0; PREFIX_TEXT_MAX];
        let mut len = match network {
            IpAddr::V4(_) => {
                let mut text = [0; IP_TEXT_MAX];
                let t = ip_text(network, &mut text);
                buf[..t.len()].copy_from_slice(t);
                t.len()
            }
            IpAddr::V6(a) => {
                // Not through `ip_text`: that would write a network that happens to lie in
                // ::ffff:0:0/96 as IPv4 text, and the key must say which family it is.
                use std::io::Write;
                let mut cursor = std::io::Cursor::new(&mut buf[..]);
                let _ = write!(cursor, "{a}");
                cursor.position() as usize
            }
        };
        buf[len] = b'/';
        len += 1;
        let mut digits = itoa::Buffer::new();
        let d = digits.format(bits).as_bytes();
        buf[len..len + d.len()].copy_from_slice(d);
        len += d.len();
        Self {
            buf,
            len: len as u8,
        }
    }

    /// The CIDR text.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }
}

/// An address's text ([`ip_text`]) kept by value: formatted once for a connection's peer.
#[derive(Clone, Copy)]
pub struct IpText {
    buf: [u8; IP_TEXT_MAX],
    len: u8,
}

impl IpText {
    /// Formats `ip` once, as [`ip_text`] does.
    pub fn new(ip: IpAddr) -> Self {
        let mut buf = [0; IP_TEXT_MAX];
        let len = ip_text(ip, &mut buf).len() as u8;
        Self { buf, len }
    }

    /// The address's text.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }
}

/// Longest text of an address: an IPv6 address with an embedded IPv4 one.
pub const IP_TEXT_MAX: usize = 45;

/// `ip` (IPv4-mapped IPv6 as plain IPv4) as text in `buf`, the same text `Display` writes.
/// IPv4 is written by hand: the formatter's machinery was a measurable part of every request,
/// which writes the client address into a key and into `X-Forwarded-For`.
pub fn ip_text(ip: IpAddr, buf: &mut [u8; IP_TEXT_MAX]) -> &[u8] {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let mut len = 0;
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf[len] = b'.';
                    len += 1;
                }
                if octet >= 100 {
                    buf[len] = b'0' + octet / 100;
                    len += 1;
                }
                if octet >= 10 {
                    buf[len] = b'0' + octet / 10 % 10;
                    len += 1;
                }
                buf[len] = b'0' + octet % 10;
                len += 1;
            }
            &buf[..len]
        }
        v6 => {
            use std::io::Write;
            let mut cursor = std::io::Cursor::new(&mut buf[..]);
            // 45 bytes hold any IPv6 text.
            let _ = write!(cursor, "{v6}");
            let len = cursor.position() as usize;
            &buf[..len]
        }
    }
}

/// What a request holds for a header or query key part.
enum Value<'a> {
    /// Not there, or empty: as nginx's `limit_req` does not account an empty key, an empty
    /// value is no value (`on_missing` decides), not one bucket every such client shares.
    Absent,
    /// One value (or the same value repeated).
    One(&'a [u8]),
    /// Several values that differ.
    Differing,
}

fn header_value<'a>(headers: &'a HeaderMap, name: &http::HeaderName) -> Value<'a> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Value::Absent;
    };
    if values.any(|v| v != first) {
        Value::Differing
    } else if first.is_empty() {
        Value::Absent
    } else {
        Value::One(first.as_bytes())
    }
}

/// The `Cookie` field is one value sent in pieces (HTTP/2 clients send each cookie as its own
/// field line, RFC 9113 §8.2.3), so its pieces are joined with `; ` as the upstream rejoins
/// them, not taken for differing values.
fn push_cookie(out: &mut KeyBuf, headers: &HeaderMap) -> bool {
    let mut joined = smallvec::SmallVec::<[u8; 128]>::new();
    for v in headers.get_all(http::header::COOKIE) {
        if v.is_empty() {
            continue;
        }
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    if joined.is_empty() {
        return false;
    }
    push_escaped(out, &joined);
    true
}

/// The raw (still percent-encoded) value of the `name=` parameter; a bare `name` or `name=` is
/// empty, so absent.
fn query_value<'a>(query: Option<&'a str>, name: &str) -> Value<'a> {
    let mut found: Option<&[u8]> = None;
    for pair in query.unwrap_or("").split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if !form_decoded(k.as_bytes()).eq(name.bytes()) {
            continue;
        }
        match found {
            None => found = Some(v.as_bytes()),
            Some(f) if form_decoded(f).eq(form_decoded(v.as_bytes())) => {}
            Some(_) => return Value::Differing,
        }
    }
    match found {
        Some(v) if !v.is_empty() => Value::One(v),
        _ => Value::Absent,
    }
}

/// A query component as a server reads it (`application/x-www-form-urlencoded`): `+` is a space
/// and `%XX` a byte; a `%` not followed by two hex digits is itself.
fn form_decoded(raw: &[u8]) -> impl Iterator<Item = u8> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let b = *raw.get(i)?;
        i += 1;
        Some(match b {
            b'+' => b' ',
            b'%' => match (
                raw.get(i).and_then(|c| crate::routing::hex_value(*c)),
                raw.get(i + 1).and_then(|c| crate::routing::hex_value(*c)),
            ) {
                (Some(h), Some(l)) => {
                    i += 2;
                    h << 4 | l
                }
                _ => b'%',
            },
            _ => b,
        })
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn ip_text_is_what_display_writes() {
        let mut buf = [0; IP_TEXT_MAX];
        let mut check = |ip: IpAddr| {
            let text = std::str::from_utf8(ip_text(ip, &mut buf))
                .unwrap()
                .to_owned();
            assert_eq!(text, ip.to_canonical().to_string(), "{ip:?}");
            // The copy a connection keeps holds the same text, the longest included.
            assert_eq!(IpText::new(ip).as_bytes(), text.as_bytes(), "{ip:?}");
        };
        for n in (0..=u32::MAX)
            .step_by(9_973_919)
            .chain([0, u32::MAX, 0x0a00_0563])
        {
            check(IpAddr::from(n.to_be_bytes()));
        }
        for v6 in [
            "::1",
            "::",
            "2001:db8::1",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "::ffff:1.2.3.4",
            "::ffff:255.255.255.255",
            "::1.2.3.4",
            "fe80::1:2:3:4",
        ] {
            check(v6.parse().unwrap());
        }
    }

    use super::*;
    use http::HeaderValue;

    fn prefix(ip: &str, v4: u8, v6: u8) -> String {
        let t = PrefixText::new(ip.parse().unwrap(), v4, v6);
        String::from_utf8(t.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn ip_prefix_truncates_to_the_family_s_length_in_cidr_text() {
        assert_eq!(prefix("203.0.113.77", 24, 64), "203.0.113.0/24");
        assert_eq!(prefix("203.0.113.77", 32, 64), "203.0.113.77/32");
        assert_eq!(prefix("203.0.113.77", 0, 64), "0.0.0.0/0");
        assert_eq!(prefix("203.0.113.77", 20, 64), "203.0.112.0/20");
        assert_eq!(
            prefix("2001:db8:1:2:aaaa:bbbb:cccc:dddd", 32, 64),
            "2001:db8:1:2::/64"
        );
        assert_eq!(prefix("2001:db8:1:2::99", 32, 56), "2001:db8:1::/56");
        assert_eq!(prefix("2001:db8:1:2ff::1", 32, 56), "2001:db8:1:200::/56");
        assert_eq!(prefix("2001:db8::1", 32, 128), "2001:db8::1/128");
        assert_eq!(prefix("2001:db8::1", 32, 0), "::/0");
        // The longest text fits.
        assert_eq!(
            prefix("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 32, 127),
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe/127"
        );
    }

    /// A dual-stack socket sees an IPv4 peer as `::ffff:a.b.c.d`: it is an IPv4 client, and
    /// takes the IPv4 length, so one client has one key whichever socket it came through.
    #[test]
    fn ip_prefix_takes_mapped_addresses_as_ipv4() {
        assert_eq!(prefix("::ffff:198.51.100.9", 24, 64), "198.51.100.0/24");
        assert_eq!(
            prefix("::ffff:198.51.100.9", 24, 64),
            prefix("198.51.100.9", 24, 64)
        );
        assert_eq!(prefix("0:0:0:0:0:ffff:1:2", 16, 112), "0.1.0.0/16");
        // An IPv6 network is written as IPv6 text, even one that looks mapped.
        assert_eq!(prefix("0:0:0:1:0:ffff:1:2", 32, 96), "::1:0:ffff:0:0/96");
    }

    #[test]
    fn ip_prefix_keys_share_a_network() {
        let uri: Uri = "/".parse().unwrap();
        let h = HeaderMap::new();
        let spec = KeySpec {
            parts: vec![KeyPart::IpPrefix { v4: 24, v6: 64 }, KeyPart::Route],
            on_missing: OnMissing::Skip,
        };
        let key = |ip: &str| {
            let mut req = parts(&uri, &h);
            req.client_ip = ip.parse().unwrap();
            build(&spec, &req)
        };
        assert_eq!(
            key("2001:db8:1:2::1"),
            (KeyOutcome::Built, "2001:db8:1:2::/64|users".into())
        );
        assert_eq!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff::7"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_eq!(
            key("10.1.2.3"),
            (KeyOutcome::Built, "10.1.2.0/24|users".into())
        );
    }

    fn parts<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> RequestParts<'a> {
        RequestParts {
            method: &Method::GET,
            uri,
            headers,
            client_ip: "10.1.2.3".parse().unwrap(),
            client_ip_text: None,
            route: "users",
            peer_trusted: false,
        }
    }

    fn build(spec: &KeySpec, req: &RequestParts<'_>) -> (KeyOutcome, String) {
        let mut out = KeyBuf::new();
        let o = spec.build(req, &mut out);
        (o, String::from_utf8(out.into_vec()).unwrap())
    }

    #[test]
    fn parts_join_in_order() {
        let uri: Uri = "/v1/users?id=7&x=y".parse().unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-user", HeaderValue::from_static("alice"));
        let spec = KeySpec {
            parts: vec![
                KeyPart::Ip,
                KeyPart::Header("x-user".parse().unwrap()),
                KeyPart::Query("id".into()),
                KeyPart::Query("x".into()),
                KeyPart::Path,
                KeyPart::Method,
                KeyPart::Route,
                KeyPart::Literal("v1".into()),
            ],
            on_missing: OnMissing::Skip,
        };
        let (o, k) = build(&spec, &parts(&uri, &h));
        assert_eq!(o, KeyOutcome::Built);
        assert_eq!(k, "10.1.2.3|alice|7|y|/v1/users|GET|users|v1");
    }

    /// A client sending two values cannot be charged under one and served under the other:
    /// the request is refused. The same value twice, and an empty value, are not ambiguous;
    /// an empty value is absent, as nginx does not account an empty key.
    #[test]
    fn repeated_values_must_agree_and_empty_ones_are_absent() {
        let spec = |part: KeyPart| KeySpec {
            parts: vec![part],
            on_missing: OnMissing::Reject,
        };
        let header = spec(KeyPart::Header("x-key".parse().unwrap()));
        let query = spec(KeyPart::Query("k".into()));
        let root: Uri = "/".parse().unwrap();
        let headers = |values: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append("x-key", HeaderValue::from_static(v));
            }
            h
        };
        let by_header = |values: &[&'static str]| build(&header, &parts(&root, &headers(values)));
        assert_eq!(
            by_header(&["rand", "real"]).0,
            KeyOutcome::Ambiguous("header:x-key".into())
        );
        assert_eq!(
            by_header(&["real", "real"]),
            (KeyOutcome::Built, "real".into())
        );
        assert_eq!(
            by_header(&[""]).0,
            KeyOutcome::Reject("header:x-key".into())
        );
        let none = HeaderMap::new();
        let by_query = |q: &str| build(&query, &parts(&q.parse().unwrap(), &none));
        assert_eq!(
            by_query("/?k=rand&k=real").0,
            KeyOutcome::Ambiguous("query:k".into())
        );
        assert_eq!(
            by_query("/?k=a+b&x=1&k=a%20b"),
            (KeyOutcome::Built, "a%20b".into())
        );
        for empty in ["/?k=", "/?k", "/?k=&x=1"] {
            assert_eq!(
                by_query(empty).0,
                KeyOutcome::Reject("query:k".into()),
                "{empty}"
            );
        }
        // Cookie pieces (one field line each over HTTP/2) are one value, joined as the
        // upstream joins them.
        let cookie = spec(KeyPart::Header(http::header::COOKIE));
        let mut h = HeaderMap::new();
        h.append("cookie", HeaderValue::from_static("a=1"));
        h.append("cookie", HeaderValue::from_static("b=2"));
        assert_eq!(
            build(&cookie, &parts(&root, &h)),
            (KeyOutcome::Built, "a=1;%20b=2".into())
        );
    }

    #[test]
    fn missing_part_follows_on_missing() {
        let uri: Uri = "/".parse().unwrap();
        let h = HeaderMap::new();
        let mut spec = KeySpec {
            parts: vec![KeyPart::Header("x-user".parse().unwrap())],
            on_missing: OnMissing::Skip,
        };
        assert_eq!(build(&spec, &parts(&uri, &h)).0, KeyOutcome::Skip);
        spec.on_missing = OnMissing::Ip;
        assert_eq!(
            build(&spec, &parts(&uri, &h)),
            (KeyOutcome::Built, "ip 10.1.2.3".into())
        );
        spec.on_missing = OnMissing::Reject;
        assert_eq!(
            build(&spec, &parts(&uri, &h)).0,
            KeyOutcome::Reject("header:x-user".into())
        );
    }

    #[test]
    fn the_on_missing_ip_key_cannot_be_spelled_by_a_value() {
        let uri: Uri = "/?u=ip+10.1.2.3".parse().unwrap();
        let spec = KeySpec {
            parts: vec![KeyPart::Header("x-user".parse().unwrap())],
            on_missing: OnMissing::Ip,
        };
        let fallback = build(&spec, &parts(&uri, &HeaderMap::new())).1;
        for forged in ["ip 10.1.2.3", "ip:10.1.2.3", "ip%2010.1.2.3"] {
            let mut h = HeaderMap::new();
            h.insert("x-user", HeaderValue::from_static(forged));
            assert_ne!(build(&spec, &parts(&uri, &h)).1, fallback, "{forged}");
        }
        let by_query = KeySpec {
            parts: vec![KeyPart::Query("u".into())],
            on_missing: OnMissing::Ip,
        };
        assert_ne!(
            build(&by_query, &parts(&uri, &HeaderMap::new())).1,
            fallback
        );
    }

    #[test]
    fn query_values_and_names_are_keyed_as_the_upstream_decodes_them() {
        let spec = KeySpec {
            parts: vec![KeyPart::Query("api_key".into())],
            on_missing: OnMissing::Skip,
        };
        let h = HeaderMap::new();
        let key = |q: &str| build(&spec, &parts(&q.parse().unwrap(), &h));
        let plain = key("/?api_key=a%20b");
        assert_eq!(plain, (KeyOutcome::Built, "a%20b".into()));
        for same in [
            "/?api_key=a+b",
            "/?api_key=%61%20b",
            "/?api%5Fkey=a%20%62",
            "/?x=1&api_key=a+b",
        ] {
            assert_eq!(key(same), plain, "{same}");
        }
        // A `%` that escapes nothing is a literal `%` (escaped in the key as `%25`).
        assert_eq!(key("/?api_key=100%"), (KeyOutcome::Built, "100%25".into()));
        assert_eq!(key("/?other=1").0, KeyOutcome::Skip);
    }

    #[test]
    fn separators_in_values_cannot_forge_another_key() {
        let uri: Uri = "/".parse().unwrap();
        let spec = KeySpec {
            parts: vec![
                KeyPart::Header("a".parse().unwrap()),
                KeyPart::Header("b".parse().unwrap()),
            ],
            on_missing: OnMissing::Skip,
        };
        let mut h1 = HeaderMap::new();
        h1.insert("a", HeaderValue::from_static("p|q"));
        h1.insert("b", HeaderValue::from_static("r"));
        let mut h2 = HeaderMap::new();
        h2.insert("a", HeaderValue::from_static("p"));
        h2.insert("b", HeaderValue::from_static("q|r"));
        let k1 = build(&spec, &parts(&uri, &h1)).1;
        let k2 = build(&spec, &parts(&uri, &h2)).1;
        assert_ne!(k1, k2);
        assert!(!k1.contains('{') && !k1.contains('}'));
    }

    #[test]
    fn long_values_are_hashed_to_a_bounded_size() {
        let uri: Uri = "/".parse().unwrap();
        let spec = KeySpec {
            parts: vec![KeyPart::Header("x-user".parse().unwrap())],
            on_missing: OnMissing::Skip,
        };
        let mut h = HeaderMap::new();
        h.insert(
            "x-user",
            HeaderValue::from_str(&"a".repeat(10_000)).unwrap(),
        );
        let (_, k1) = build(&spec, &parts(&uri, &h));
        assert_eq!(k1.len(), 33);
        assert!(k1.starts_with('~'));
        h.insert(
            "x-user",
            HeaderValue::from_str(&"a".repeat(10_001)).unwrap(),
        );
        let (_, k2) = build(&spec, &parts(&uri, &h));
        assert_ne!(k1, k2);
    }

    #[test]
    fn the_admin_api_takes_raw_values_and_stored_keys_alike() {
        use super::from_admin;
        let stored = |v: &[u8]| {
            let mut out = KeyBuf::new();
            super::push_escaped(&mut out, v);
            out.into_vec()
        };
        assert_eq!(from_admin("127.0.0.1"), b"127.0.0.1");
        assert_eq!(from_admin("alice smith"), stored(b"alice smith"));
        assert_eq!(from_admin("alice%20smith"), b"alice%20smith");
        let long = "k".repeat(100);
        assert_eq!(from_admin(&long), stored(long.as_bytes()));
        assert!(from_admin(&long).starts_with(b"~"));
        // on_missing: ip's fallback key, and a value that only looks like it.
        assert_eq!(from_admin("ip 10.0.0.7"), b"ip 10.0.0.7");
        assert_eq!(from_admin("ip alice"), stored(b"ip alice"));
        let mut two = b"1.2.3.4|".to_vec();
        two.extend(stored("é".as_bytes()));
        assert_eq!(from_admin("1.2.3.4|é"), two);
    }
}
