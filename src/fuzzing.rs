//! Fuzz harnesses: one plain function per target of `fuzz/` (cargo-fuzz), each taking the
//! fuzzer's bytes and panicking when a property it checks does not hold. The fuzz targets call
//! them on nightly under libFuzzer; `tests/it/fuzz_corpus.rs` calls the same functions on
//! stable with every committed corpus and regression input, so a finding stays fixed.
//!
//! This module is the only door the fuzz crate and that test use into the library, so the rest
//! of the crate can become private: what a harness needs it reaches from here.
//!
//! The properties, per target (see `docs/fuzzing.md`):
//! - [`request_head`]: the fast codec's request parser never panics, and a head it takes is
//!   self-consistent (offsets inside the head, a valid `Host`, framing from exactly the fields
//!   that say it, no shorter prefix complete).
//! - [`chunked`]: the chunked scanner finds the same end (or the same refusal) however the bytes
//!   are split, and never counts a byte past the final CRLF.
//! - [`response_head`]: the response parser never panics and its framing follows RFC 9112 §6.3.
//! - [`path`]: normalisation is idempotent, keeps the query and the decoded bytes, and never
//!   makes a path that passed `path_problem` fail it (or the reverse).
//! - [`keys`]: the trusted-proxy walk believes nothing from an untrusted peer; keys stay
//!   printable, their parts stay separable, short values round-trip through the escaping, and
//!   the admin API's reading of a raw value is the key a request with it gets.
//! - [`config`]: any text gives a `Config` or a `PATH:LINE:COL` error, never a panic.
//! - [`admin_query`]: the admin API's `?key=` (axum's query extractor, then
//!   `key::from_admin`) never panics and gives a stored-form key, idempotently.
//! - [`differential_framing`]: for the same bytes, the fast codec and hyper (as tollgate's
//!   general path configures it) agree on each request the fast codec takes — method, target,
//!   fields, body, and so where it ends — and what the fast codec would forward upstream parses,
//!   by a plain hyper server acting as the upstream, into the same request modulo the
//!   documented rewrites.
//! - [`differential_response`]: for the same upstream response bytes, the fast codec (its
//!   response parser and body framing) and hyper's client (as the general path's connector
//!   configures it) agree on the final status, the header fields, where the body ends and what
//!   it is, or both refuse.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use ipnet::IpNet;

use crate::config::{KeyPart, OnMissing};
use crate::key::{KeyBuf, KeyOutcome, KeySpec, MAX_PART_LEN, RequestParts};
use crate::proxy::codec::h1::framing::{Chunked, Framing};
use crate::proxy::codec::h1::head::{
    FAST_MAX_HEAD, Field, MAX_RESPONSE_HEAD, ParsedRequest, ParsedResponse, RequestHead,
    parse_request, parse_response,
};
use crate::proxy::fields::{Name, classify};
use crate::proxy::forwarding::RequestRule;
use crate::proxy::headers::{underscore_lookalike, valid_host};
use crate::routing::{normalize_path, path_problem};

/// A harness: the fuzzer's bytes in, a panic out when a property does not hold.
pub type Harness = fn(&[u8]);

/// Every target: its name (the fuzz target's and its corpus folder's) and its harness.
pub const TARGETS: &[(&str, Harness)] = &[
    ("request_head", request_head),
    ("chunked", chunked),
    ("response_head", response_head),
    ("path", path),
    ("keys", keys),
    ("config", config),
    ("admin_query", admin_query),
    ("differential_framing", differential_framing),
    ("differential_response", differential_response),
];

// ---------------------------------------------------------------------------------------------
// request_head

/// The fast codec's request-head parser.
pub fn request_head(data: &[u8]) {
    let mut fields = Vec::new();
    match parse_request(data, &mut fields) {
        ParsedRequest::Complete(h) => {
            check_request_head(data, &h, &fields);
            // The head alone is the same head.
            let ParsedRequest::Complete(again) = parse_request(&data[..h.len], &mut Vec::new())
            else {
                panic!("the head alone is not complete");
            };
            assert_eq!(again.len, h.len);
            assert_eq!(again.framing, h.framing);
            // No shorter prefix is a complete head (the codec parses whatever it has read).
            for k in prefixes(h.len) {
                assert!(
                    !matches!(
                        parse_request(&data[..k], &mut Vec::new()),
                        ParsedRequest::Complete(_)
                    ),
                    "a prefix of {k} bytes is complete, the head is {}",
                    h.len
                );
            }
        }
        ParsedRequest::Partial => assert!(data.len() < FAST_MAX_HEAD),
        ParsedRequest::General => {}
    }
}

/// Some lengths below `len`: the last few and a spread of the others.
fn prefixes(len: usize) -> impl Iterator<Item = usize> {
    let tail = len.saturating_sub(4)..len;
    let spread = (0..len).step_by((len / 8).max(1));
    tail.chain(spread)
}

fn check_request_head(data: &[u8], h: &RequestHead, fields: &[Field]) {
    assert!(h.len <= data.len() && h.len <= FAST_MAX_HEAD);
    assert!(
        data[..h.len].ends_with(b"\n"),
        "a head ends with its empty line"
    );
    assert!(h.target.end <= h.len && data[h.target.clone()].starts_with(b"/"));
    assert_ne!(h.method, Method::CONNECT);
    let host = h.host.clone().expect("a taken head has a Host");
    assert!(valid_host(&data[host]));
    let (mut lengths, mut codings) = (0, 0);
    for f in fields {
        assert!(f.name.end <= h.len && f.value.end <= h.len);
        let name = &data[f.name.clone()];
        let value = &data[f.value.clone()];
        assert_eq!(f.kind, classify(name));
        assert!(!name.is_empty());
        assert!(
            !value.iter().any(|&b| b == b'\r' || b == b'\n' || b == 0),
            "a field value holds a line break or NUL: {value:?}"
        );
        match f.kind {
            Name::ContentLength => lengths += 1,
            Name::TransferEncoding => codings += 1,
            Name::Upgrade | Name::Expect => panic!("taken with Upgrade or Expect"),
            _ => {}
        }
    }
    match &h.framing {
        Framing::Length(n) => {
            assert_eq!(codings, 0);
            assert!(lengths <= 1);
            if lengths == 0 {
                assert_eq!(*n, 0);
            }
        }
        Framing::Chunked(_) => assert_eq!((lengths, codings), (0, 1)),
        Framing::UntilClose => panic!("a request framed until close"),
    }
}

// ---------------------------------------------------------------------------------------------
// chunked

/// The chunked scanner, whole and split. The first byte chooses the split.
pub fn chunked(data: &[u8]) {
    let Some((&seed, body)) = data.split_first() else {
        return;
    };
    let mut whole = Chunked::new();
    let whole_result = whole.scan(body);
    // The same bytes in pieces of 1..=16 bytes (seed 0: byte by byte).
    let step = usize::from(seed % 16) + 1;
    let mut split = Chunked::new();
    let mut counted = 0;
    let mut split_result = Ok(0);
    for piece in body.chunks(step) {
        match split.scan(piece) {
            Ok(n) => {
                assert!(n <= piece.len());
                counted += n;
                if split.is_done() {
                    break;
                }
                assert_eq!(n, piece.len(), "bytes short of the end are all the body's");
            }
            Err(e) => {
                split_result = Err(e);
                break;
            }
        }
    }
    if split_result.is_ok() {
        split_result = Ok(counted);
    }
    assert_eq!(whole_result, split_result, "whole and split disagree");
    assert_eq!(whole.is_done(), split.is_done());
    if let Ok(n) = whole_result {
        assert!(n <= body.len());
        if whole.is_done() {
            assert!(body[..n].ends_with(b"\r\n"));
            // The body alone ends at the same place.
            let mut alone = Chunked::new();
            assert_eq!(alone.scan(&body[..n]), Ok(n));
            assert!(alone.is_done());
        } else {
            assert_eq!(n, body.len());
        }
    }
    // Length framing counts down exactly.
    let mut f = Framing::Length(u64::from(seed));
    let took = f.advance(body).expect("length framing never fails");
    assert_eq!(took, body.len().min(usize::from(seed)));
}

// ---------------------------------------------------------------------------------------------
// response_head

/// The fast codec's response-head parser. The first byte's low bit: the request was HEAD.
pub fn response_head(data: &[u8]) {
    let Some((&flags, buf)) = data.split_first() else {
        return;
    };
    let head_request = flags & 1 == 1;
    let mut fields = Vec::new();
    match parse_response(buf, head_request, &mut fields) {
        ParsedResponse::Complete(r) => {
            assert!(r.len <= buf.len());
            assert!((100..=999).contains(&r.status));
            assert!(r.reason.end <= r.len);
            assert!(
                !buf[r.reason.clone()]
                    .iter()
                    .any(|&b| b == b'\r' || b == b'\n')
            );
            let mut te = false;
            for f in &fields {
                assert!(f.name.end <= r.len && f.value.end <= r.len);
                let value = &buf[f.value.clone()];
                assert!(!value.iter().any(|&b| b == b'\r' || b == b'\n'));
                te |= f.kind == Name::TransferEncoding;
            }
            let no_body = head_request
                || (100..200).contains(&r.status)
                || r.status == 204
                || r.status == 304;
            if no_body {
                assert_eq!(r.framing, Framing::Length(0));
            }
            if te || (100..200).contains(&r.status) || r.status == 204 {
                assert_eq!(r.length, None);
            }
            if let (Framing::Length(n), false) = (&r.framing, no_body) {
                assert_eq!(r.length, Some(*n), "a framing length is the one passed on");
            }
            if te && !no_body {
                assert!(matches!(
                    r.framing,
                    Framing::Chunked(_) | Framing::UntilClose
                ));
            }
            // The head alone is the same head.
            let ParsedResponse::Complete(again) =
                parse_response(&buf[..r.len], head_request, &mut Vec::new())
            else {
                panic!("the head alone is not complete");
            };
            assert_eq!((again.len, again.framing), (r.len, r.framing));
        }
        ParsedResponse::Partial => assert!(buf.len() < MAX_RESPONSE_HEAD),
        ParsedResponse::Invalid => {}
    }
}

// ---------------------------------------------------------------------------------------------
// path

/// Path normalisation and the refusals beside it.
pub fn path(data: &[u8]) {
    let Ok(uri) = Uri::try_from(data) else {
        return;
    };
    let problem = path_problem(uri.path());
    let Some(n) = normalize_path(&uri) else {
        return;
    };
    assert_eq!(n.query(), uri.query(), "the query is kept");
    assert_eq!(n.scheme(), uri.scheme());
    assert_eq!(n.authority(), uri.authority());
    assert!(normalize_path(&n).is_none(), "normalising is idempotent");
    assert_eq!(
        pct_decoded(n.path().as_bytes()),
        pct_decoded(uri.path().as_bytes()),
        "the path means the same bytes"
    );
    assert_eq!(
        problem.is_some(),
        path_problem(n.path()).is_some(),
        "normalising changes whether the path is refused: {:?} → {:?}",
        uri.path(),
        n.path()
    );
}

/// `%XX` decoded; a `%` that does not start an escape is itself.
fn pct_decoded(p: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(p.len());
    let mut i = 0;
    while i < p.len() {
        if p[i] == b'%'
            && let (Some(h), Some(l)) = (
                p.get(i + 1).and_then(|c| char::from(*c).to_digit(16)),
                p.get(i + 2).and_then(|c| char::from(*c).to_digit(16)),
            )
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(p[i]);
            i += 1;
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// keys

const PEERS: [&str; 4] = ["10.0.0.1", "192.0.2.7", "::ffff:10.0.0.2", "2001:db8::1"];
const TRUSTED: [&[&str]; 4] = [
    &[],
    &["10.0.0.0/8"],
    &["10.0.0.0/8", "2001:db8::/32"],
    &["0.0.0.0/0", "::/0"],
];

/// Keys from header values and the query, and the client address from the forwarding fields.
///
/// Input: a first byte choosing the peer and the trusted set, then lines: `name:value` is a
/// field, the first line without a colon is the query string.
pub fn keys(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let peer: IpAddr = PEERS[usize::from(sel & 3)].parse().expect("peer");
    let nets: Vec<IpNet> = TRUSTED[usize::from(sel >> 2 & 3)]
        .iter()
        .map(|n| n.parse().expect("net"))
        .collect();
    let mut headers = HeaderMap::new();
    let mut query: Option<&[u8]> = None;
    for line in rest.split(|&b| b == b'\n') {
        match line.iter().position(|&b| b == b':') {
            Some(i) if i > 0 => {
                if let (Ok(n), Ok(v)) = (
                    HeaderName::from_bytes(&line[..i]),
                    HeaderValue::from_bytes(line[i + 1..].trim_ascii()),
                ) {
                    headers.append(n, v);
                }
            }
            _ => {
                query.get_or_insert(line);
            }
        }
    }
    let peer_c = peer.to_canonical();
    let client = crate::key::client_ip(peer, &headers, &nets);
    assert_eq!(
        client,
        client.to_canonical(),
        "the client address is canonical"
    );
    if nets.is_empty() || !nets.iter().any(|n| n.contains(&peer_c)) {
        assert_eq!(client, peer_c, "an untrusted peer is the client");
    }
    if client != peer_c {
        assert!(
            headers.contains_key("x-forwarded-for") || headers.contains_key("forwarded"),
            "{client} without a forwarding field"
        );
    }
    let uri = match query.and_then(|q| std::str::from_utf8(q).ok()) {
        Some(q) => Uri::try_from(format!("/p?{q}")).unwrap_or_else(|_| Uri::from_static("/p")),
        None => Uri::from_static("/p"),
    };
    let method = Method::from_bytes(b"M|%").expect("an extension method");
    let parts = RequestParts {
        method: &method,
        uri: &uri,
        headers: &headers,
        client_ip: client,
        client_ip_text: None,
        route: "r",
        peer_trusted: false,
    };
    let x_user = HeaderName::from_static("x-user");
    let spec = KeySpec {
        parts: vec![
            KeyPart::Header(x_user.clone()),
            KeyPart::Query("id".into()),
            KeyPart::Path,
            KeyPart::Method,
            KeyPart::Ip,
            KeyPart::Header(http::header::COOKIE),
            KeyPart::Route,
        ],
        on_missing: OnMissing::Ip,
    };
    let mut out = KeyBuf::new();
    let outcome = spec.build(&parts, &mut out);
    assert!(
        matches!(outcome, KeyOutcome::Built | KeyOutcome::Ambiguous(_)),
        "{outcome:?}"
    );
    if outcome == KeyOutcome::Built {
        if let Some(ip) = out.strip_prefix(b"ip ") {
            assert_eq!(ip, client.to_string().as_bytes());
        } else {
            assert_stored_form(&out);
            assert_eq!(
                out.split(|&b| b == b'|').count(),
                spec.parts.len(),
                "one part per part: {:?}",
                String::from_utf8_lossy(&out)
            );
        }
    }
    // One part at a time: short values come back through the escaping, and the admin API
    // reads a raw value (without `%` or `|`) as the key a request with it gets.
    let one = |part: KeyPart, raw: Option<Vec<u8>>| {
        let spec = KeySpec {
            parts: vec![part],
            on_missing: OnMissing::Skip,
        };
        let mut out = KeyBuf::new();
        if spec.build(&parts, &mut out) != KeyOutcome::Built {
            return;
        }
        assert_stored_form(&out);
        let Some(raw) = raw else { return };
        if raw.len() <= MAX_PART_LEN {
            assert_eq!(pct_decoded(&out), raw, "escaping round-trips");
        } else {
            assert_eq!(out.len(), 33, "a long value is hashed");
        }
        if let Ok(text) = std::str::from_utf8(&raw)
            && !text.contains(['%', '|'])
            && text
                .strip_prefix("ip ")
                .is_none_or(|ip| ip.parse::<IpAddr>().is_err())
        {
            assert_eq!(
                crate::key::from_admin(text),
                out.to_vec(),
                "the admin API's key for {text:?}"
            );
        }
    };
    let header_raw = {
        let mut all = headers.get_all(&x_user).iter();
        all.next().map(|v| v.as_bytes().to_vec())
    };
    one(KeyPart::Header(x_user), header_raw);
    let query_raw = uri.query().and_then(|q| {
        q.split('&')
            .find_map(|p| p.strip_prefix("id="))
            .map(|v| form_decoded(v.as_bytes()))
    });
    one(KeyPart::Query("id".into()), query_raw);
    one(KeyPart::Ip, None);
    one(KeyPart::Header(http::header::COOKIE), None);
}

/// A query value as a server reads it: `+` a space, `%XX` a byte.
fn form_decoded(v: &[u8]) -> Vec<u8> {
    let spaced: Vec<u8> = v
        .iter()
        .map(|&b| if b == b'+' { b' ' } else { b })
        .collect();
    pct_decoded(&spaced)
}

/// What a stored key is made of: printable ASCII without braces (a Redis Cluster hash tag).
fn assert_stored_form(key: &[u8]) {
    assert!(
        key.iter()
            .all(|&b| (0x21..=0x7e).contains(&b) && b != b'{' && b != b'}'),
        "not a stored key: {:?}",
        String::from_utf8_lossy(key)
    );
}

// ---------------------------------------------------------------------------------------------
// config

/// `routes.yaml` text: a config, or an error at a position in the file.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("/nonexistent-fuzz/routes.yaml");
    match crate::config::parse_str(path, text) {
        Ok(_) => {}
        // In a file the config names (an overrides file): its own path, line and column.
        Err(e) if e.path != path => {
            assert!(e.line >= 1 && e.column >= 1, "no position: {e}");
        }
        Err(e) => {
            assert!(e.line >= 1 && e.column >= 1, "no position: {e}");
            // Lines as YAML counts them: a CR alone breaks a line too.
            let lines = text
                .replace("\r\n", "\n")
                .replace('\r', "\n")
                .matches('\n')
                .count() as u64
                + 1;
            assert!(e.line <= lines, "line {} of {lines}: {e}", e.line);
            let shown = e.to_string();
            let prefix = format!("{}:{}:{}: ", path.display(), e.line, e.column);
            assert!(shown.starts_with(&prefix), "{shown}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// admin_query

/// The admin API's query string for `/admin/limits/{route}/{limit}?key=..`.
pub fn admin_query(data: &[u8]) {
    let mut target = b"/admin/limits/r/l?".to_vec();
    target.extend_from_slice(data);
    let Ok(uri) = Uri::try_from(target) else {
        return;
    };
    type Q = std::collections::HashMap<String, String>;
    let Ok(axum::extract::Query(q)) = axum::extract::Query::<Q>::try_from_uri(&uri) else {
        return;
    };
    let Some(key) = q.get("key").filter(|k| !k.is_empty()) else {
        return;
    };
    let stored = crate::key::from_admin(key);
    let text = String::from_utf8(stored.clone()).expect("a key is ASCII");
    if let Some(ip) = text.strip_prefix("ip ") {
        assert!(ip.parse::<IpAddr>().is_ok(), "{text:?}");
    } else {
        for part in stored.split(|&b| b == b'|') {
            assert_stored_form(part);
        }
    }
    assert_eq!(
        crate::key::from_admin(&text),
        stored,
        "a stored key given back is the same key"
    );
}

// ---------------------------------------------------------------------------------------------
// differential_framing

/// A request as a parser saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    method: Method,
    target: String,
    /// Field values by lower-case name, in order.
    fields: BTreeMap<String, Vec<Vec<u8>>>,
    /// The decoded body; `None` when reading it failed.
    body: Option<Bytes>,
}

/// A request the fast codec takes: what it parsed, and its bytes as they go upstream.
struct Taken {
    method: Method,
    /// The target as the codec reads it (`http::Uri`), before normalisation.
    target: String,
    /// After normalisation: what goes upstream.
    upstream_target: String,
    fields: BTreeMap<String, Vec<Vec<u8>>>,
    /// The body's bytes as they came (a chunked body still chunked).
    raw_body: Vec<u8>,
    chunked: bool,
    /// The request head and body the fast codec writes to the upstream.
    upstream: Vec<u8>,
    /// Lower-case names the client's `Connection` lists.
    connection_named: Vec<String>,
    host: Vec<u8>,
    content_length: Option<Vec<u8>>,
}

/// The peer's address in `X-Forwarded-For`.
const PEER: &[u8] = b"192.0.2.1";
/// The request id the fast codec would generate.
const OUR_ID: &[u8] = b"0123456789abcdef0123456789abcdef";

/// The fast codec and hyper, on the same bytes.
pub fn differential_framing(data: &[u8]) {
    let taken = fast_codec(data);
    let seen = hyper_reads(Bytes::copy_from_slice(data), Server::General);
    for (i, t) in taken.iter().enumerate() {
        let Some(h) = seen.get(i) else {
            panic!(
                "the fast codec takes request {i} ({} {}), hyper reads {} request(s)",
                t.method,
                t.target,
                seen.len()
            );
        };
        assert_eq!(t.method, h.method, "request {i}: method");
        assert_eq!(t.target, h.target, "request {i}: target");
        assert_eq!(t.fields, h.fields, "request {i}: fields");
        let Some(body) = &h.body else {
            panic!("request {i}: the fast codec takes a body hyper cannot read");
        };
        if !t.chunked {
            assert_eq!(&t.raw_body[..], &body[..], "request {i}: body");
        }
    }
    if taken.is_empty() {
        return;
    }
    // What the fast codec forwards, read by an upstream.
    let mut upstream = Vec::new();
    for t in &taken {
        upstream.extend_from_slice(&t.upstream);
    }
    let up = hyper_reads(Bytes::from(upstream), Server::Upstream);
    assert_eq!(up.len(), taken.len(), "the upstream reads as many requests");
    for (i, ((t, u), h)) in taken.iter().zip(&up).zip(&seen).enumerate() {
        check_forwarded(i, t, u, h);
    }
}

/// What the upstream reads of request `i` against what the client sent (`h`, as hyper read it).
fn check_forwarded(i: usize, t: &Taken, u: &Seen, h: &Seen) {
    assert_eq!(u.method, t.method, "upstream {i}: method");
    assert_eq!(u.target, t.upstream_target, "upstream {i}: target");
    assert_eq!(u.body, h.body, "upstream {i}: body");
    let one = |name: &str| -> Option<&Vec<u8>> {
        let v = u.fields.get(name)?;
        assert_eq!(v.len(), 1, "upstream {i}: one {name}");
        v.first()
    };
    assert_eq!(one("host"), Some(&t.host), "upstream {i}: host");
    let xff = one("x-forwarded-for").expect("x-forwarded-for");
    assert!(xff.ends_with(PEER), "upstream {i}: x-forwarded-for {xff:?}");
    assert!(one("x-forwarded-proto").is_some());
    // The client's ids when its first is sane (all of them, as the hyper codec passes them
    // too), else exactly ours.
    let ids = u.fields.get("x-request-id");
    match h.fields.get("x-request-id") {
        // Named by `Connection`: hop-by-hop, so not forwarded.
        Some(client) if t.connection_named.iter().any(|c| c == "x-request-id") => {
            if crate::proxy::request_id::sane(&client[0]) {
                assert_eq!(ids, None, "upstream {i}: a request id named by Connection");
            }
        }
        Some(client) if crate::proxy::request_id::sane(&client[0]) => {
            assert_eq!(ids, Some(client), "upstream {i}: the client's request ids");
        }
        _ => assert_eq!(one("x-request-id").map(Vec::as_slice), Some(OUR_ID)),
    }
    assert_eq!(one("content-length"), t.content_length.as_ref());
    assert_eq!(
        one("transfer-encoding").map(Vec::as_slice),
        t.chunked.then_some(&b"chunked"[..]),
        "upstream {i}: transfer-encoding"
    );
    for hop in [
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
    ] {
        assert!(!u.fields.contains_key(hop), "upstream {i}: {hop} forwarded");
    }
    // Every other field: as the client sent it, or gone because its `Connection` named it or
    // it is spelled like a framing or forwarding field.
    let rewritten = |n: &str| {
        matches!(
            n,
            "host"
                | "x-forwarded-for"
                | "x-forwarded-proto"
                | "x-forwarded-host"
                | "x-request-id"
                | "content-length"
                | "transfer-encoding"
        )
    };
    for (name, values) in &h.fields {
        if rewritten(name) {
            continue;
        }
        let gone = t.connection_named.iter().any(|c| c == name)
            || underscore_lookalike(name.as_bytes())
            || matches!(
                classify(name.as_bytes()),
                Name::Connection | Name::HopByHop | Name::Upgrade | Name::Expect
            );
        if gone {
            assert!(!u.fields.contains_key(name), "upstream {i}: {name} kept");
        } else {
            assert_eq!(
                u.fields.get(name),
                Some(values),
                "upstream {i}: field {name}"
            );
        }
    }
    for name in u.fields.keys() {
        assert!(
            rewritten(name) || h.fields.contains_key(name),
            "upstream {i}: {name} appeared"
        );
    }
}

/// The fast codec's reading of a connection's bytes: each request it takes, until one it hands
/// to hyper (from then on hyper reads the rest, so there is nothing to disagree about), one it
/// refuses, a `Connection: close`, or the end of the bytes.
fn fast_codec(data: &[u8]) -> Vec<Taken> {
    let mut taken = Vec::new();
    let mut fields = Vec::new();
    let mut at = 0;
    loop {
        let buf = &data[at..];
        let ParsedRequest::Complete(mut head) = parse_request(buf, &mut fields) else {
            return taken;
        };
        // As `dispatch`: a target `http::Uri` does not take goes to hyper.
        let Ok(uri) = Uri::try_from(&buf[head.target.clone()]) else {
            return taken;
        };
        let chunked = matches!(head.framing, Framing::Chunked(_));
        let rest = &buf[head.len..];
        let Ok(n) = head.framing.advance(rest) else {
            // Refused (400) and closed.
            return taken;
        };
        if !head.framing.is_done() {
            // The body is not all there: the connection ends within it.
            return taken;
        }
        taken.push(taken_request(
            buf,
            &head,
            &fields,
            &uri,
            &rest[..n],
            chunked,
        ));
        if head.connection.close {
            return taken;
        }
        at += head.len + n;
    }
}

fn taken_request(
    buf: &[u8],
    head: &RequestHead,
    fields: &[Field],
    uri: &Uri,
    body: &[u8],
    chunked: bool,
) -> Taken {
    let mut map: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
    let mut content_length = None;
    let mut connection_named = Vec::new();
    for f in fields {
        let name = String::from_utf8_lossy(&buf[f.name.clone()]).to_ascii_lowercase();
        let value = buf[f.value.clone()].to_vec();
        if f.kind == Name::ContentLength {
            content_length = Some(value.clone());
        }
        if f.kind == Name::Connection {
            // As the codec reads it: `close`, `keep-alive` and `upgrade` are options, not names.
            connection_named.extend(
                value
                    .split(|&b| b == b',')
                    .map(|t| String::from_utf8_lossy(t.trim_ascii()).to_ascii_lowercase())
                    .filter(|t| !matches!(t.as_str(), "close" | "keep-alive" | "upgrade")),
            );
        }
        map.entry(name).or_default().push(value);
    }
    let normalized = normalize_path(uri);
    let upstream_target = normalized
        .as_ref()
        .unwrap_or(uri)
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let host = buf[head.host.clone().expect("a taken head has a Host")].to_vec();
    let mut upstream = Vec::new();
    write_upstream_head(&mut upstream, buf, head, fields, &upstream_target, &host);
    upstream.extend_from_slice(body);
    Taken {
        method: head.method.clone(),
        target: uri.path_and_query().map_or("/", |p| p.as_str()).to_owned(),
        upstream_target,
        fields: map,
        raw_body: body.to_vec(),
        chunked,
        upstream,
        connection_named,
        host,
        content_length,
    }
}

/// The upstream request head, written by the codec's own writer (`h1::upstream_head`) for a
/// route with `preserve_host`, an upstream without a base path, a peer that is not trusted.
fn write_upstream_head(
    out: &mut Vec<u8>,
    buf: &[u8],
    head: &RequestHead,
    fields: &[Field],
    target: &str,
    host: &[u8],
) {
    let own_id = match &head.request_id {
        Some(r) if crate::proxy::request_id::sane(&buf[r.clone()]) => None,
        _ => Some(OUR_ID),
    };
    let rule = RequestRule {
        trusted: false,
        proto: "http",
        peer: PEER,
        client_host: Some(host),
        host: Some(host),
        own_request_id: own_id,
        upgrade: false,
    };
    crate::proxy::codec::h1::upstream_head(out, head, buf, fields, ("", target), &rule);
}

#[derive(Clone, Copy)]
enum Server {
    /// tollgate's general path: its builder (`auto`, HTTP/1 settings as served).
    General,
    /// A plain hyper HTTP/1 server, as an upstream.
    Upstream,
}

/// The requests hyper reads from `data` sent on one connection (then the client's write side
/// shut), each answered with an empty 200.
fn hyper_reads(data: Bytes, server: Server) -> Vec<Seen> {
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let record = record.clone();
        async move {
            use http_body_util::BodyExt;
            let (parts, body) = req.into_parts();
            let body = body.collect().await.ok().map(|c| c.to_bytes());
            let mut fields: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
            for (n, v) in &parts.headers {
                fields
                    .entry(n.as_str().to_owned())
                    .or_default()
                    .push(v.as_bytes().to_vec());
            }
            record.lock().expect("lock").push(Seen {
                method: parts.method,
                target: parts
                    .uri
                    .path_and_query()
                    .map_or_else(|| parts.uri.to_string(), |p| p.as_str().to_owned()),
                fields,
                body,
            });
            Ok::<_, std::convert::Infallible>(http::Response::new(
                http_body_util::Empty::<Bytes>::new(),
            ))
        }
    });
    let io = hyper_util::rt::TokioIo::new(Answering::at_once(data));
    RT.with(|rt| {
        rt.block_on(async {
            match server {
                Server::General => {
                    let builder = crate::proxy::codec::general::builder();
                    let _ = builder.serve_connection_with_upgrades(io, svc).await;
                }
                Server::Upstream => {
                    // Half-close: the end of these bytes is not the end of the connection.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .half_close(true)
                        .serve_connection(io, svc)
                        .await;
                }
            }
        })
    });
    std::mem::take(&mut *seen.lock().expect("lock"))
}

// ---------------------------------------------------------------------------------------------
// differential_response

/// A response as a reader of the upstream's bytes saw it.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// No final response head (malformed, cut short, a `101` nobody asked for): the exchange
    /// fails before anything reaches the client (502 on both codecs).
    Refused,
    Head {
        status: u16,
        /// Field values by lower-case name, in order.
        fields: BTreeMap<String, Vec<Vec<u8>>>,
        /// The decoded body; `None`: it could not be read to its end (malformed, or the
        /// connection ended before its framing did), so the client sees it cut.
        body: Option<Bytes>,
    },
}

/// The fast codec and hyper's client, on the same upstream bytes (then the upstream closes its
/// side). The first byte's low bit: the request was HEAD (else GET).
pub fn differential_response(data: &[u8]) {
    let Some((&flags, bytes)) = data.split_first() else {
        return;
    };
    let head_request = flags & 1 == 1;
    let (fast, strict) = fast_response(bytes, head_request);
    let hyper = hyper_response(Bytes::copy_from_slice(bytes), head_request);
    match (&fast, &hyper) {
        (Answer::Refused, Answer::Refused) => {}
        (
            Answer::Head {
                status: fs,
                fields: ff,
                body: fb,
            },
            Answer::Head {
                status: hs,
                fields: hf,
                body: hb,
            },
        ) => {
            assert_eq!(fs, hs, "status");
            assert_eq!(ff, hf, "fields");
            match (fb, hb) {
                (Some(f), Some(h)) => assert_eq!(f, h, "body"),
                (None, None) => {}
                // The refusals where the fast codec's scanner is stricter on purpose (see
                // `fast_response`): hyper reads on, and re-frames what it read.
                (None, Some(_)) if strict => {}
                _ => panic!(
                    "one reads the body to its end, the other not: fast {fb:?}, hyper {hb:?}"
                ),
            }
        }
        _ => panic!("fast codec {fast:?}, hyper {hyper:?}"),
    }
}

/// The fast codec's reading of an upstream's bytes, as `h1::client` and `h1::relay` do it with
/// every byte at hand: informational heads skipped, a `101` refused, the final head, then the
/// body by its framing; a body the framing ends before the bytes do stops there (the codec does
/// not read on), one that needs more than the bytes is cut. A chunked body is passed on as it
/// came, so what the client decodes is hyper's reading of exactly those bytes.
///
/// The second value: the chunked body was refused where the scanner is stricter than hyper on
/// purpose ([`Chunked::stricter_than_hyper`]): hyper reads on and the general path re-frames
/// the body for its client, while the fast codec passes the bytes on as they came, so it
/// refuses what a client might read otherwise (a bare LF in the trailers, which hyper's
/// trailer parser takes as their end, ignoring the rest; a NUL in an extension).
fn fast_response(bytes: &[u8], head_request: bool) -> (Answer, bool) {
    let mut fields = Vec::new();
    let mut at = 0;
    let head = loop {
        match parse_response(&bytes[at..], head_request, &mut fields) {
            ParsedResponse::Complete(h) if h.status == 101 => return (Answer::Refused, false),
            ParsedResponse::Complete(h) if h.status < 200 => at += h.len,
            ParsedResponse::Complete(h) => break h,
            ParsedResponse::Partial | ParsedResponse::Invalid => return (Answer::Refused, false),
        }
    };
    let buf = &bytes[at..];
    let mut map: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
    for f in &fields {
        map.entry(String::from_utf8_lossy(&buf[f.name.clone()]).to_ascii_lowercase())
            .or_default()
            .push(buf[f.value.clone()].to_vec());
    }
    let rest = &buf[head.len..];
    let mut framing = head.framing.clone();
    let mut strict = false;
    let body = match framing.advance(rest) {
        Err(_) => {
            strict = matches!(head.framing, Framing::Chunked(_)) && refused_as_stricter(rest);
            None
        }
        Ok(n) if framing.is_done() || framing == Framing::UntilClose => Some(&rest[..n]),
        Ok(_) => None,
    };
    let body = body.map(|raw| match head.framing {
        Framing::Chunked(_) => {
            let mut wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
            wire.extend_from_slice(raw);
            match hyper_response(Bytes::from(wire), false) {
                Answer::Head { body: Some(b), .. } => b,
                other => {
                    panic!("the fast codec takes a chunked body hyper cannot decode: {other:?}")
                }
            }
        }
        _ => Bytes::copy_from_slice(raw),
    });
    let answer = Answer::Head {
        status: head.status,
        fields: map,
        body,
    };
    (answer, strict)
}

/// The chunked scanner refuses `body` where it is stricter than hyper on purpose
/// ([`Chunked::stricter_than_hyper`]).
fn refused_as_stricter(body: &[u8]) -> bool {
    let mut c = Chunked::new();
    for b in body {
        let before = c.clone();
        if c.scan(std::slice::from_ref(b)).is_err() {
            return before.stricter_than_hyper(*b);
        }
    }
    false
}

/// hyper's client (`http1::Builder` as `connector::http1` builds it) sending a GET (or HEAD)
/// and reading the answer from `data`; a `101` is refused, as the general path's forward does.
fn hyper_response(data: Bytes, head_request: bool) -> Answer {
    use http_body_util::BodyExt;
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
    }
    let io = hyper_util::rt::TokioIo::new(Answering {
        data,
        at: 0,
        asked: false,
        waker: None,
    });
    RT.with(|rt| {
        rt.block_on(async {
            let Ok((mut sender, conn)) = hyper::client::conn::http1::Builder::new()
                .handshake::<_, http_body_util::Empty<Bytes>>(io)
                .await
            else {
                return Answer::Refused;
            };
            let conn = tokio::spawn(conn);
            let method = if head_request {
                Method::HEAD
            } else {
                Method::GET
            };
            let req = http::Request::builder()
                .method(method)
                .uri("/")
                .header(http::header::HOST, "upstream")
                .body(http_body_util::Empty::new())
                .expect("a request");
            let answer = match sender.send_request(req).await {
                Err(_) => Answer::Refused,
                Ok(r) if r.status() == http::StatusCode::SWITCHING_PROTOCOLS => Answer::Refused,
                Ok(r) => {
                    let (parts, body) = r.into_parts();
                    let mut fields: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
                    for (n, v) in &parts.headers {
                        fields
                            .entry(n.as_str().to_owned())
                            .or_default()
                            .push(v.as_bytes().to_vec());
                    }
                    Answer::Head {
                        status: parts.status.as_u16(),
                        fields,
                        body: body.collect().await.ok().map(|c| c.to_bytes()),
                    }
                }
            };
            conn.abort();
            answer
        })
    })
}

/// A peer that sends `data` (then shuts its write side) once something has been written to
/// it, or at once when made [`Answering::at_once`]; what is written is dropped. An upstream
/// waits: hyper's client takes bytes that come before its request for a protocol error.
struct Answering {
    data: Bytes,
    at: usize,
    asked: bool,
    waker: Option<std::task::Waker>,
}

impl Answering {
    /// A connection whose peer sent `data` and shut its write side.
    fn at_once(data: Bytes) -> Self {
        Answering {
            data,
            at: 0,
            asked: true,
            waker: None,
        }
    }
}

impl tokio::io::AsyncRead for Answering {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.asked {
            self.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = buf.remaining().min(self.data.len() - self.at);
        buf.put_slice(&self.data[self.at..self.at + n]);
        self.at += n;
        Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for Answering {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.asked = true;
        if let Some(w) = self.waker.take() {
            w.wake();
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_codec_and_hyper_agree_on_where_a_response_ends() {
        /// HEAD, the upstream's bytes, the body both read.
        type Case = (bool, &'static [u8], Option<&'static [u8]>);
        let cases: [Case; 6] = [
            (false, b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhelloNEXT", Some(b"hello")),
            (
                false,
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\nNEXT",
                Some(b"hello"),
            ),
            (
                false,
                b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                Some(b"ok"),
            ),
            (false, b"HTTP/1.0 200 OK\r\n\r\nuntil the close", Some(b"until the close")),
            (true, b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", Some(b"")),
            (false, b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhel", None),
        ];
        for (head, bytes, body) in cases {
            let mut data = vec![u8::from(head)];
            data.extend_from_slice(bytes);
            differential_response(&data);
            let (Answer::Head { body: read, .. }, false) = fast_response(bytes, head) else {
                panic!("refused: {bytes:?}");
            };
            assert_eq!(read.as_deref(), body, "{bytes:?}");
        }
        // A bare LF in a trailer line: refused by the fast codec, read on by hyper, whose
        // trailer parser stops at the empty line and leaves `c`.
        let bare_lf =
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\na: b\n\nc\r\n\r\n";
        let mut data = vec![0];
        data.extend_from_slice(bare_lf);
        differential_response(&data);
        assert!(fast_response(bare_lf, false).1);
        // At a line's start too (right after the last chunk, or after a whole trailer line).
        for bytes in [
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\nc\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\na: b\r\n\nc\r\n\r\n",
        ] {
            let mut data = vec![0];
            data.extend_from_slice(bytes);
            differential_response(&data);
            assert!(fast_response(bytes, false).1, "{bytes:?}");
        }
        // A NUL in an extension, 17 size digits: hyper reads both.
        for bytes in [
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0;a\x00b\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n00000000000000000\r\n\r\n",
        ] {
            let mut data = vec![0];
            data.extend_from_slice(bytes);
            differential_response(&data);
            assert!(fast_response(bytes, false).1, "{bytes:?}");
            assert!(matches!(
                hyper_response(Bytes::copy_from_slice(bytes), false),
                Answer::Head { body: Some(_), .. }
            ));
        }
        // A chunk line the scanner refuses for what hyper refuses too is no strictness.
        let both = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5x\r\nhello\r\n0\r\n\r\n";
        assert!(!fast_response(both, false).1);
        assert!(matches!(
            hyper_response(Bytes::from_static(bare_lf), false),
            Answer::Head { body: Some(_), .. }
        ));
        let refused: [&[u8]; 3] = [
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\n",
        ];
        for bytes in refused {
            let mut data = vec![0];
            data.extend_from_slice(bytes);
            differential_response(&data);
            assert_eq!(fast_response(bytes, false).0, Answer::Refused, "{bytes:?}");
        }
    }

    #[test]
    fn the_differential_compares_requests_both_read() {
        let data = b"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\nX-Sum: 1\r\n\r\nGET /%6Cogin HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi";
        let taken = fast_codec(data);
        assert_eq!(taken.len(), 2);
        assert_eq!(taken[1].upstream_target, "/login");
        let seen = hyper_reads(Bytes::from_static(data), Server::General);
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].body.as_deref(), Some(&b"hello"[..]));
        differential_framing(data);
    }

    /// At the bounds of hyper's trailer and extension limits, the chunked scanner takes a
    /// body exactly when hyper reads it.
    #[test]
    fn the_scanner_takes_what_hyper_takes_at_its_limits() {
        let head = b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n";
        let check = |body: Vec<u8>| {
            let mut data = head.to_vec();
            data.extend_from_slice(&body);
            let fast = fast_codec(&data).len();
            let hyper = hyper_reads(Bytes::from(data), Server::General);
            let read = hyper.first().is_some_and(|s| s.body.is_some());
            assert_eq!(fast == 1, read, "body of {} bytes", body.len());
        };
        for total in 16_370..16_390 {
            // One trailer `t:` of `total` bytes with its CRLF, then the final CRLF.
            let mut b = b"0\r\nt:".to_vec();
            b.extend(std::iter::repeat_n(b'v', total - 4 - 2));
            b.extend_from_slice(b"\r\n\r\n");
            check(b);
        }
        for n in 99..=101 {
            let mut b = b"0\r\n".to_vec();
            for i in 0..n {
                b.extend_from_slice(format!("t{i}: v\r\n").as_bytes());
            }
            b.extend_from_slice(b"\r\n");
            check(b);
        }
        for total in 16_380..16_388 {
            let mut b = Vec::new();
            let mut left = total;
            while left > 0 {
                let n = left.min(4000);
                b.extend_from_slice(format!("1;{}\r\nx\r\n", "e".repeat(n)).as_bytes());
                left -= n;
            }
            b.extend_from_slice(b"0\r\n\r\n");
            check(b);
        }
    }
}
