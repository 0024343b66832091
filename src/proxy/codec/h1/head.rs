//! Request and response heads as the fast path sees them: parsed once with `httparse` into
//! offsets of the connection's buffer, classified by the few names a proxy acts on, and written
//! back out field by field — no `HeaderMap`, no per-field allocation.
//!
//! Anything this does not handle plainly (another HTTP version, a protocol switch, `Expect`,
//! an ambiguous body length, an oversized head) is not an error here: the request goes to the
//! general path, whose answers for those cases are the reference.

use std::mem::MaybeUninit;
use std::ops::Range;

use http::Method;

use super::framing::{Chunked, Framing};
pub(crate) use crate::proxy::fields::Name;
use crate::proxy::fields::classify;
use crate::proxy::headers::valid_host;

/// Fields in a head the fast path parses; more go to the general path.
pub(crate) const MAX_FIELDS: usize = 64;
/// Longest head the fast path parses; longer ones go to the general path (which answers 431
/// past its own limit).
pub(crate) const FAST_MAX_HEAD: usize = 16 * 1024;
/// An upstream response head the fast path reads: as much as the general path's client
/// (hyper's defaults, 100 fields in about 400 KiB), so both paths pass on the same answers.
pub(crate) const MAX_RESPONSE_FIELDS: usize = 100;
pub(crate) const MAX_RESPONSE_HEAD: usize = 8192 + 4096 * 100;

/// One field: name and value as offsets into the head's buffer, and what the name is.
#[derive(Debug, Clone)]
pub(crate) struct Field {
    pub name: Range<usize>,
    pub value: Range<usize>,
    pub kind: Name,
}

impl Field {
    /// `h` as offsets (`at` maps a slice of the parsed buffer to its range), classified.
    fn of(h: &httparse::Header<'_>, at: &impl Fn(&[u8]) -> Range<usize>) -> Self {
        Self {
            name: at(h.name.as_bytes()),
            value: at(h.value),
            kind: classify(h.name.as_bytes()),
        }
    }
}

/// What the `Connection` fields said.
#[derive(Debug, Default, Clone)]
pub(crate) struct ConnectionTokens {
    pub close: bool,
    pub keep_alive: bool,
    pub upgrade: bool,
    /// Other tokens: names of fields that are hop-by-hop for this message.
    pub named: smallvec::SmallVec<[Range<usize>; 2]>,
}

impl ConnectionTokens {
    fn read(&mut self, buf: &[u8], value: Range<usize>) {
        let mut start = value.start;
        for i in value.start..=value.end {
            if i == value.end || buf[i] == b',' {
                let mut t = start..i;
                while t.start < t.end && buf[t.start].is_ascii_whitespace() {
                    t.start += 1;
                }
                while t.end > t.start && buf[t.end - 1].is_ascii_whitespace() {
                    t.end -= 1;
                }
                let tok = &buf[t.clone()];
                if tok.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if tok.eq_ignore_ascii_case(b"keep-alive") {
                    self.keep_alive = true;
                } else if tok.eq_ignore_ascii_case(b"upgrade") {
                    self.upgrade = true;
                } else if !tok.is_empty() {
                    self.named.push(t);
                }
                start = i + 1;
            }
        }
    }

    /// The field is named by `Connection` and so must not be forwarded.
    pub(crate) fn names(&self, buf: &[u8], name: &[u8]) -> bool {
        self.named
            .iter()
            .any(|t| buf[t.clone()].eq_ignore_ascii_case(name))
    }
}

/// A request head the fast path takes.
#[derive(Debug)]
pub(crate) struct RequestHead {
    pub method: Method,
    pub target: Range<usize>,
    pub len: usize,
    pub host: Option<Range<usize>>,
    pub request_id: Option<Range<usize>>,
    pub framing: Framing,
    pub connection: ConnectionTokens,
    pub x_forwarded_for: bool,
    pub x_forwarded_proto: bool,
    pub x_forwarded_host: bool,
}

pub(crate) enum ParsedRequest {
    Complete(RequestHead),
    /// More bytes needed.
    Partial,
    /// Not for the fast path (see the module doc); the general path reads it from the start.
    General,
}

/// Parses the request head at the start of `buf`; `fields` is refilled (kept across requests
/// so it is allocated once per connection).
pub(crate) fn parse_request(buf: &[u8], fields: &mut Vec<Field>) -> ParsedRequest {
    // Uninitialised: filling 64 empty fields for each request was a visible part of its cost.
    let mut raw = [const { MaybeUninit::uninit() }; MAX_FIELDS];
    let mut req = httparse::Request::new(&mut []);
    let len = match req.parse_with_uninit_headers(buf, &mut raw) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < FAST_MAX_HEAD => {
            return ParsedRequest::Partial;
        }
        _ => return ParsedRequest::General,
    };
    if len > FAST_MAX_HEAD || req.version != Some(1) {
        return ParsedRequest::General;
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return ParsedRequest::General;
    };
    if !path.starts_with('/') {
        // Absolute form, authority form (CONNECT), `*`.
        return ParsedRequest::General;
    }
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return ParsedRequest::General;
    };
    if method == Method::CONNECT {
        // Refused there, whatever its target's form.
        return ParsedRequest::General;
    }
    let at = offsets(buf);
    let mut head = RequestHead {
        method,
        target: at(path.as_bytes()),
        len,
        host: None,
        request_id: None,
        framing: Framing::Length(0),
        connection: ConnectionTokens::default(),
        x_forwarded_for: false,
        x_forwarded_proto: false,
        x_forwarded_host: false,
    };
    fields.clear();
    let mut length: Option<u64> = None;
    let mut chunked = false;
    for h in req.headers.iter() {
        let field = Field::of(h, &at);
        let kind = field.kind;
        match kind {
            Name::Host if head.host.is_none() => head.host = Some(field.value.clone()),
            // Two Host fields: the general path answers 400.
            Name::Host => return ParsedRequest::General,
            Name::RequestId if head.request_id.is_none() => {
                head.request_id = Some(field.value.clone())
            }
            Name::ContentLength => {
                if length.is_some() {
                    return ParsedRequest::General;
                }
                match parse_length(h.value) {
                    Some(n) => length = Some(n),
                    None => return ParsedRequest::General,
                }
            }
            Name::TransferEncoding => {
                if chunked || !trimmed(h.value).eq_ignore_ascii_case(b"chunked") {
                    return ParsedRequest::General;
                }
                chunked = true;
            }
            Name::Connection => head.connection.read(buf, field.value.clone()),
            Name::Upgrade | Name::Expect => return ParsedRequest::General,
            Name::XForwardedFor => head.x_forwarded_for = true,
            Name::XForwardedProto => head.x_forwarded_proto = true,
            Name::XForwardedHost => head.x_forwarded_host = true,
            _ => {}
        }
        fields.push(field);
    }
    // No Host, or one that is not a host: the general path answers 400.
    if head.connection.upgrade
        || !head
            .host
            .as_ref()
            .is_some_and(|r| valid_host(&buf[r.clone()]))
    {
        return ParsedRequest::General;
    }
    head.framing = match (length, chunked) {
        (Some(_), true) => return ParsedRequest::General,
        (Some(n), false) => Framing::Length(n),
        (None, true) => Framing::Chunked(Chunked::new()),
        (None, false) => Framing::Length(0),
    };
    ParsedRequest::Complete(head)
}

/// A response head from an upstream.
#[derive(Debug)]
pub(crate) struct ResponseHead {
    pub status: u16,
    pub reason: Range<usize>,
    pub len: usize,
    pub framing: Framing,
    pub connection: ConnectionTokens,
    /// HTTP/1.0 without `keep-alive`, or `Connection: close`: the upstream closes after it.
    pub closes: bool,
    /// The `Content-Length` to pass on, written once however the upstream spelled it (`5, 5`,
    /// two fields): what it frames by, or what a HEAD or 304 answer announces. `None` beside
    /// `Transfer-Encoding`, on 1xx and 204, and when absent.
    pub length: Option<u64>,
}

pub(crate) enum ParsedResponse {
    Complete(ResponseHead),
    Partial,
    Invalid,
}

/// Parses the response head at the start of `buf`. `head_request`: the request was HEAD, so
/// the response has no body whatever its fields say.
pub(crate) fn parse_response(
    buf: &[u8],
    head_request: bool,
    fields: &mut Vec<Field>,
) -> ParsedResponse {
    let mut raw = [const { MaybeUninit::uninit() }; MAX_FIELDS];
    match parse_response_in(&mut raw, buf, head_request, fields) {
        // Rare: the room the general path's client gives (hyper's 100 fields), on the heap.
        Err(httparse::Error::TooManyHeaders) => {
            let mut raw = vec![MaybeUninit::uninit(); MAX_RESPONSE_FIELDS];
            parse_response_in(&mut raw, buf, head_request, fields)
                .unwrap_or(ParsedResponse::Invalid)
        }
        Err(_) => ParsedResponse::Invalid,
        Ok(parsed) => parsed,
    }
}

fn parse_response_in<'b>(
    raw: &mut [MaybeUninit<httparse::Header<'b>>],
    buf: &'b [u8],
    head_request: bool,
    fields: &mut Vec<Field>,
) -> Result<ParsedResponse, httparse::Error> {
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, buf, raw)?
    {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial if buf.len() < MAX_RESPONSE_HEAD => {
            return Ok(ParsedResponse::Partial);
        }
        httparse::Status::Partial => return Ok(ParsedResponse::Invalid),
    };
    let (Some(status), Some(version)) = (resp.code, resp.version) else {
        return Ok(ParsedResponse::Invalid);
    };
    // httparse takes any three digits; a status is 100 to 999 (RFC 9110 §15, and what hyper's
    // client takes): `002` would go to the client as `HTTP/1.1 2`.
    if !(100..=999).contains(&status) {
        return Ok(ParsedResponse::Invalid);
    }
    let at = offsets(buf);
    // An empty reason may be httparse's own `""` (a missing reason, or one with obs-text),
    // which is not in `buf`: only a reason with bytes is an offset.
    let reason = resp
        .reason
        .filter(|r| !r.is_empty())
        .map_or(0..0, |r| at(r.as_bytes()));
    fields.clear();
    let mut length: Option<u64> = None;
    let mut te: Option<Range<usize>> = None;
    let mut bad_length = false;
    let mut connection = ConnectionTokens::default();
    for h in resp.headers.iter() {
        let field = Field::of(h, &at);
        let kind = field.kind;
        match kind {
            // As hyper's client reads it: a list of one value (`5, 5`), over any fields.
            Name::ContentLength => {
                for v in h.value.split(|b| *b == b',') {
                    match (length, parse_response_length(v)) {
                        (None, Some(n)) => length = Some(n),
                        (Some(a), Some(b)) if a == b => {}
                        _ => bad_length = true,
                    }
                }
            }
            Name::TransferEncoding => te = Some(field.value.clone()),
            Name::Connection => connection.read(buf, field.value.clone()),
            _ => {}
        }
        fields.push(field);
    }
    let no_body = head_request || (100..200).contains(&status) || status == 204 || status == 304;
    // RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing (it has likely
    // come through something that did not understand the coding). hyper's client, the general
    // path's, refuses such a response where a body may follow; so does this parser, rather than
    // read it until the close (found by differential fuzzing,
    // fuzz/regressions/differential_response/).
    if version == 0 && te.is_some() && !no_body {
        return Ok(ParsedResponse::Invalid);
    }
    // A length only matters where it frames the body (no Transfer-Encoding, a body to come) or
    // announces one (HEAD, 304): a bad one is refused there and dropped elsewhere, as hyper
    // does. 1xx and 204 carry none (RFC 9110 §8.6: an upstream's `0` is not passed on).
    if bad_length {
        if te.is_none() && !no_body {
            return Ok(ParsedResponse::Invalid);
        }
        length = None;
    }
    if te.is_some() || (100..200).contains(&status) || status == 204 {
        length = None;
    }
    let framing = if no_body {
        Framing::Length(0)
    } else if let Some(te) = te {
        // The final coding decides; anything but chunked runs until the upstream closes. A value
        // with a byte beyond visible ASCII names no coding at all, as hyper's client (the general
        // path's) reads it (`HeaderValue::to_str` fails): until the close too, never chunked
        // (found by differential fuzzing, fuzz/regressions/differential_response/).
        let value = &buf[te];
        let visible = value
            .iter()
            .all(|&b| b == b'\t' || (b' '..=b'~').contains(&b));
        let last = value.rsplit(|b| *b == b',').next().unwrap_or_default();
        if visible && trimmed(last).eq_ignore_ascii_case(b"chunked") {
            Framing::Chunked(Chunked::new())
        } else {
            Framing::UntilClose
        }
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        Framing::UntilClose
    };
    let closes = connection.close || (version == 0 && !connection.keep_alive);
    Ok(ParsedResponse::Complete(ResponseHead {
        status,
        reason,
        len,
        framing,
        connection,
        closes,
        length,
    }))
}

/// Where a slice `httparse` returned lies in `buf`, as offsets.
fn offsets(buf: &[u8]) -> impl Fn(&[u8]) -> Range<usize> {
    let base = buf.as_ptr() as usize;
    move |s: &[u8]| {
        let start = s.as_ptr() as usize - base;
        start..start + s.len()
    }
}

fn trimmed(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &v[start..end]
}

/// A request's `Content-Length`: at most 18 digits (anything longer goes to the general path,
/// which reads it as hyper does).
fn parse_length(v: &[u8]) -> Option<u64> {
    let v = trimmed(v);
    if v.is_empty() || v.len() > 18 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0, |n, d| n * 10 + u64::from(d - b'0')))
}

/// The largest body length hyper's client takes (`u64::MAX - 2`; it keeps the last two values
/// for "chunked" and "until the close").
const MAX_RESPONSE_LENGTH: u64 = u64::MAX - 2;

/// An upstream's `Content-Length` as hyper's client (the general path's) reads it: any number
/// of digits, leading zeros included, up to [`MAX_RESPONSE_LENGTH`]. Reading it any other way
/// would make the two codecs answer the same upstream differently (found by differential
/// fuzzing: 51 digits, most of them leading zeros).
fn parse_response_length(v: &[u8]) -> Option<u64> {
    let v = trimmed(v);
    if v.is_empty() {
        return None;
    }
    v.iter()
        .try_fold(0u64, |n, &d| {
            if !d.is_ascii_digit() {
                return None;
            }
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })
        .filter(|&n| n <= MAX_RESPONSE_LENGTH)
}

/// Appends `name: value\r\n`.
#[inline(always)]
pub(crate) fn push_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(text: &str) -> Option<RequestHead> {
        match parse_request(text.as_bytes(), &mut Vec::new()) {
            ParsedRequest::Complete(h) => Some(h),
            _ => None,
        }
    }

    #[test]
    fn a_plain_request_is_taken_with_its_facts() {
        let text = "POST /a?b=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close, X-Secret\r\nX-Forwarded-For: 1.1.1.1\r\n\r\nhello";
        let mut fields = Vec::new();
        let ParsedRequest::Complete(h) = parse_request(text.as_bytes(), &mut fields) else {
            panic!("not complete");
        };
        assert_eq!(h.method, Method::POST);
        assert_eq!(&text[h.target.clone()], "/a?b=1");
        assert_eq!(&text[h.host.clone().unwrap()], "x");
        assert_eq!(h.framing, Framing::Length(5));
        assert!(h.connection.close);
        assert!(h.connection.names(text.as_bytes(), b"x-secret"));
        assert!(h.x_forwarded_for);
        assert_eq!(&text[h.len..], "hello");
        assert_eq!(fields.len(), 4);
    }

    #[test]
    fn what_the_general_path_decides_goes_there() {
        for text in [
            "GET / HTTP/1.0\r\n\r\n",
            "GET http://x/ HTTP/1.1\r\nHost: x\r\n\r\n",
            "CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n",
            "CONNECT /x HTTP/1.1\r\nHost: x\r\n\r\n",
            "OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: h\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            "GET / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a b\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: u@h\r\n\r\n",
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            "GARBAGE\r\n\r\n",
        ] {
            assert!(
                matches!(
                    parse_request(text.as_bytes(), &mut Vec::new()),
                    ParsedRequest::General
                ),
                "{text:?}"
            );
        }
        assert!(matches!(
            parse_request(b"GET / HTTP/1.1\r\nHost:", &mut Vec::new()),
            ParsedRequest::Partial
        ));
        assert!(req("GET / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: Chunked\r\n\r\n").is_some());
    }

    #[test]
    fn response_framing_follows_rfc_9112() {
        let cases: [(&str, bool, Framing); 7] = [
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n",
                false,
                Framing::Length(3),
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n",
                true,
                Framing::Length(0),
            ),
            ("HTTP/1.1 204 No Content\r\n\r\n", false, Framing::Length(0)),
            (
                "HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
                false,
                Framing::Length(0),
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 3\r\n\r\n",
                false,
                Framing::Chunked(Chunked::new()),
            ),
            ("HTTP/1.1 200 OK\r\n\r\n", false, Framing::UntilClose),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
                false,
                Framing::UntilClose,
            ),
        ];
        for (text, head, framing) in cases {
            let ParsedResponse::Complete(r) =
                parse_response(text.as_bytes(), head, &mut Vec::new())
            else {
                panic!("{text:?}");
            };
            assert_eq!(r.framing, framing, "{text:?}");
        }
        let ParsedResponse::Complete(r) = parse_response(
            b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
            false,
            &mut Vec::new(),
        ) else {
            panic!();
        };
        assert!(r.closes);
        assert!(matches!(
            parse_response(
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                false,
                &mut Vec::new()
            ),
            ParsedResponse::Invalid
        ));
    }

    /// Found by fuzzing (fuzz/regressions/response_head/): a reason with obs-text, or none,
    /// is httparse's static `""`, whose offset in the buffer overflowed.
    #[test]
    fn a_reason_httparse_drops_is_an_empty_range() {
        for text in [
            &b"HTTP/1.1 200 \xff\xff\xff\xffContent-Length: 3\r\n\r\n"[..],
            b"HTTP/1.1 200 \xffok\r\nContent-Length: 3\r\n\r\n",
            b"HTTP/1.1 200\r\nContent-Length: 3\r\n\r\n",
        ] {
            let ParsedResponse::Complete(r) = parse_response(text, false, &mut Vec::new()) else {
                panic!("{text:?}");
            };
            assert_eq!(r.reason, 0..0, "{text:?}");
        }
    }

    /// Found by differential fuzzing (fuzz/regressions/differential_response/): an HTTP/1.0
    /// response with Transfer-Encoding was read until the close where hyper's client refuses
    /// it; both now refuse it when a body may follow, and take it when none can.
    #[test]
    fn an_http_1_0_response_with_transfer_encoding_and_a_body_is_invalid() {
        for text in [
            &b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"HTTP/1.0 200\nTrAnsfer-Encoding: ,\t    )\tn'th: \n\n",
        ] {
            assert!(matches!(
                parse_response(text, false, &mut Vec::new()),
                ParsedResponse::Invalid
            ));
        }
        for (text, head) in [
            (
                &b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
                true,
            ),
            (
                b"HTTP/1.0 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
            ),
            (
                b"HTTP/1.0 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
            ),
        ] {
            let ParsedResponse::Complete(r) = parse_response(text, head, &mut Vec::new()) else {
                panic!("{text:?}");
            };
            assert_eq!(r.framing, Framing::Length(0));
        }
    }

    /// Found by differential fuzzing (fuzz/regressions/differential_response/): a
    /// Transfer-Encoding value with obs-text ending in `chunked` was read as chunked, where
    /// hyper's client reads no coding in it and the body until the close.
    #[test]
    fn a_transfer_encoding_with_obs_text_is_not_chunked() {
        for (text, framing) in [
            (
                &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: g\x86zip, chunked\r\n\r\n"[..],
                Framing::UntilClose,
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip,\tchunked\r\n\r\n",
                Framing::Chunked(Chunked::new()),
            ),
        ] {
            let ParsedResponse::Complete(r) = parse_response(text, false, &mut Vec::new()) else {
                panic!("{text:?}");
            };
            assert_eq!(r.framing, framing, "{text:?}");
        }
    }

    /// Found by differential fuzzing (fuzz/regressions/differential_response/): an upstream's
    /// length of more than 18 digits (leading zeros) was refused, where hyper's client takes
    /// any length it can hold.
    #[test]
    fn a_response_length_is_read_as_hyper_reads_it() {
        let length = |v: &str| {
            let text = format!("HTTP/1.1 200 OK\r\nContent-Length: {v}\r\n\r\n");
            match parse_response(text.as_bytes(), false, &mut Vec::new()) {
                ParsedResponse::Complete(r) => Some(r.framing),
                _ => None,
            }
        };
        let zeros = "0".repeat(40);
        assert_eq!(length(&format!("{zeros}5")), Some(Framing::Length(5)));
        assert_eq!(
            length("18446744073709551613"),
            Some(Framing::Length(u64::MAX - 2))
        );
        for refused in [
            "18446744073709551614",
            "18446744073709551616",
            "99999999999999999999999",
            "5x",
            "+5",
            "",
        ] {
            assert_eq!(length(refused), None, "{refused}");
        }
    }

    /// Found by fuzzing (fuzz/regressions/response_head/status-below-100): a status of `002`.
    #[test]
    fn a_status_below_100_is_invalid() {
        for text in [&b"HTTP/1.1 002 OK\r\n\r\n"[..], b"HTTP/1.1 099 X\r\n\r\n"] {
            assert!(matches!(
                parse_response(text, false, &mut Vec::new()),
                ParsedResponse::Invalid
            ));
        }
    }
}
