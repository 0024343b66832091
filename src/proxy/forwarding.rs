//! The header rules of a proxied exchange, written once for both codecs: which fields of the
//! client's request go on to the upstream and which tollgate sets (`Host`, `X-Forwarded-*`,
//! `X-Request-Id`), and which fields of the upstream's response go back to the client and which
//! tollgate sets (`X-Request-Id`, the `RateLimit` fields).
//!
//! A rule reads a head through [`HeadView`] and says what to do through [`HeadWriter`]: the
//! fast HTTP/1.1 codec views the field offsets it parsed and writes bytes, the hyper codec views
//! a `HeaderMap` and edits it in place. Framing (`Content-Length`, `Transfer-Encoding`) is the
//! codec's own business; a rule only hands those fields to [`HeadWriter::framing`].

use http::HeaderName;
use http::header::{CONNECTION, HOST, UPGRADE};

use super::fields::Name;
use super::request_id::X_REQUEST_ID;
use super::response::{RATELIMIT, RATELIMIT_POLICY, legacy_fields, push_ratelimit, push_u64};
use crate::limit::{HeaderInfo, Limit};

pub(crate) static XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(crate) static XFP: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub(crate) static XFH: HeaderName = HeaderName::from_static("x-forwarded-host");

/// A head's fields as a codec holds them.
pub(crate) trait HeadView {
    /// What a codec needs to pass or drop a field it holds (nothing, for one that copies bytes).
    type Handle: ?Sized;

    /// Calls `f` with each field, in order: its handle, what its name means, name and value.
    fn each<'a>(&'a self, f: impl FnMut(&'a Self::Handle, Name, &'a [u8], &'a [u8]));

    /// The message's `Connection` names this field: hop-by-hop for it (RFC 9110 §7.6.1).
    fn named_by_connection(&self, name: &[u8]) -> bool;
}

/// Where a rule's decisions go; each codec renders them its own way.
pub(crate) trait HeadWriter<H: ?Sized> {
    /// The field goes on as it came.
    fn pass(&mut self, field: &H, kind: Name, name: &[u8], value: &[u8]);
    /// The field does not go on.
    fn drop_field(&mut self, field: &H);
    /// `Content-Length` or `Transfer-Encoding`: the codec frames the message itself.
    fn framing(&mut self, field: &H, kind: Name, value: &[u8]);
    /// A field of tollgate's own.
    fn add(&mut self, name: &'static HeaderName, value: &[u8]);
    /// A field of tollgate's own made of `parts` joined by `", "` (one list, RFC 9110 §5.3).
    fn add_list(&mut self, name: &'static HeaderName, parts: &[&[u8]]);
    /// A field of tollgate's own whose value `write` appends.
    fn add_with(&mut self, name: &'static HeaderName, write: impl FnOnce(&mut Vec<u8>));
}

/// What the request rule needs beyond the client's fields.
pub(crate) struct RequestRule<'a> {
    /// The peer is one of `trusted_proxies`: its `X-Forwarded-Proto` and `-Host` are believed.
    pub trusted: bool,
    /// This listener's scheme, for `X-Forwarded-Proto`.
    pub proto: &'static str,
    /// The peer's address as text, appended to `X-Forwarded-For`.
    pub peer: &'a [u8],
    /// The host the client asked for (routing's), for `X-Forwarded-Host`.
    pub client_host: Option<&'a [u8]>,
    /// The `Host` to send; `None` leaves it to the codec's client (HTTP/2's `:authority`).
    pub host: Option<&'a [u8]>,
    /// tollgate's own request id, when the client's was missing or not sane (the client's
    /// passes as it came).
    pub own_request_id: Option<&'a [u8]>,
    /// The request switches protocols (WebSocket): `Connection: upgrade` and `Upgrade` go on.
    pub upgrade: bool,
}

/// The client's request head as it goes to the upstream.
///
/// Hop-by-hop fields go, and so do fields the client's `Connection` names, except those that
/// frame the message (dropping `Content-Length` would let the body be read upstream as a request
/// of its own). `X-Forwarded-For` is what came in (blank lines left out) with the peer appended;
/// `-Proto` and `-Host` are the client's only from a trusted proxy.
#[inline]
pub(crate) fn upstream_request<V: HeadView>(
    view: &V,
    rule: &RequestRule<'_>,
    out: &mut impl HeadWriter<V::Handle>,
) {
    let mut xff: smallvec::SmallVec<[&[u8]; 4]> = smallvec::SmallVec::new();
    // Every line of the chain that says something goes on (a blank line adds no hop), unless
    // `Connection` names the field; the client-address walk reads the same lines.
    let mut xff_named = false;
    let mut xfp_passed = false;
    let mut xfh_passed = false;
    let mut upgrade = false;
    view.each(|field, kind, name, value| {
        let named = || view.named_by_connection(name);
        match kind {
            Name::ContentLength | Name::TransferEncoding => out.framing(field, kind, value),
            Name::Host | Name::Connection | Name::HopByHop => out.drop_field(field),
            Name::Upgrade => {
                upgrade |= rule.upgrade;
                out.drop_field(field)
            }
            Name::XForwardedFor => {
                xff_named = xff_named || named();
                if let Some(v) = visible(value).filter(|v| !v.trim_ascii().is_empty()) {
                    xff.push(v);
                }
                out.drop_field(field)
            }
            Name::XForwardedProto if rule.trusted && !named() => {
                xfp_passed = true;
                out.pass(field, kind, name, value)
            }
            Name::XForwardedHost if rule.trusted && !named() => {
                xfh_passed = true;
                out.pass(field, kind, name, value)
            }
            Name::XForwardedProto | Name::XForwardedHost => out.drop_field(field),
            Name::RequestId if rule.own_request_id.is_some() || named() => out.drop_field(field),
            _ if named() => out.drop_field(field),
            _ => out.pass(field, kind, name, value),
        }
    });
    if let Some(host) = rule.host {
        out.add(&HOST, host);
    }
    if xff_named {
        xff.clear();
    }
    xff.push(rule.peer);
    out.add_list(&XFF, &xff);
    if !xfp_passed {
        out.add(&XFP, rule.proto.as_bytes());
    }
    if !xfh_passed && let Some(h) = rule.client_host {
        out.add(&XFH, h);
    }
    if let Some(id) = rule.own_request_id {
        out.add(&X_REQUEST_ID, id);
    }
    if upgrade {
        upgrade_fields(view, out);
    }
}

/// `Connection: upgrade` and what the client offered in `Upgrade`, but `h2c`: a switch of the
/// client's own connection to HTTP/2, which tollgate speaks itself; passed on, an upstream that
/// accepts it turns the connection into a tunnel past routing and limits.
fn upgrade_fields<V: HeadView>(view: &V, out: &mut impl HeadWriter<V::Handle>) {
    let mut offered: smallvec::SmallVec<[&[u8]; 2]> = smallvec::SmallVec::new();
    view.each(|_, kind, _, value| {
        if kind == Name::Upgrade {
            offered.extend(
                value
                    .split(|b| *b == b',')
                    .map(<[u8]>::trim_ascii)
                    .filter(|t| !t.is_empty() && !t.eq_ignore_ascii_case(b"h2c")),
            );
        }
    });
    out.add(&CONNECTION, b"upgrade");
    if !offered.is_empty() {
        out.add_list(&UPGRADE, &offered);
    }
}

/// What the response rule needs beyond the upstream's fields.
pub(crate) struct ResponseRule<'a> {
    /// The exchange's request id, sent back whatever the upstream said.
    pub request_id: &'a [u8],
    /// The limit whose `RateLimit` fields the response carries, replacing the upstream's.
    pub ratelimit: Option<(&'a Limit, &'a HeaderInfo)>,
    /// A `101 Switching Protocols` being passed through: `Connection` and `Upgrade` go on.
    pub switched: bool,
    /// The route's `rejection.legacy_headers`: `X-RateLimit-*` go with the `RateLimit` fields,
    /// replacing the upstream's.
    pub legacy: bool,
}

/// The upstream's response head as it goes to the client.
#[inline]
pub(crate) fn client_response<V: HeadView>(
    view: &V,
    rule: &ResponseRule<'_>,
    out: &mut impl HeadWriter<V::Handle>,
) {
    view.each(|field, kind, name, value| match kind {
        Name::ContentLength | Name::TransferEncoding => out.framing(field, kind, value),
        Name::Upgrade if rule.switched => out.pass(field, kind, name, value),
        Name::Connection | Name::Upgrade | Name::HopByHop | Name::RequestId => {
            out.drop_field(field)
        }
        Name::RateLimit | Name::RateLimitPolicy if rule.ratelimit.is_some() => {
            out.drop_field(field)
        }
        Name::LegacyRateLimit if rule.legacy && rule.ratelimit.is_some() => out.drop_field(field),
        _ if view.named_by_connection(name) => out.drop_field(field),
        _ => out.pass(field, kind, name, value),
    });
    if rule.switched {
        out.add(&CONNECTION, b"upgrade");
    }
    out.add(&X_REQUEST_ID, rule.request_id);
    if let Some((limit, info)) = rule.ratelimit {
        out.add(&RATELIMIT_POLICY, limit.rate(info.rate).policy.as_bytes());
        out.add_with(&RATELIMIT, |v| {
            push_ratelimit(v, limit, info.remaining, info.reset_after)
        });
        if rule.legacy {
            for (name, n) in legacy_fields(limit.rate(info.rate), info.remaining, info.reset_after)
            {
                out.add_with(name, |v| push_u64(v, n));
            }
        }
    }
}

/// The field's text when it is visible ASCII (what `HeaderValue::to_str` accepts).
#[inline]
fn visible(v: &[u8]) -> Option<&[u8]> {
    v.iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
        .then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::fields::classify;

    /// A head as a list of fields, written out as `name: value` lines: the rules' own test
    /// codec.
    struct Lines(Vec<(String, String)>);

    impl HeadView for Lines {
        type Handle = ();
        fn each<'a>(&'a self, mut f: impl FnMut(&'a (), Name, &'a [u8], &'a [u8])) {
            for (n, v) in &self.0 {
                f(&(), classify(n.as_bytes()), n.as_bytes(), v.as_bytes());
            }
        }
        fn named_by_connection(&self, name: &[u8]) -> bool {
            self.0.iter().any(|(n, v)| {
                n.eq_ignore_ascii_case("connection")
                    && v.split(',')
                        .any(|t| t.trim().as_bytes().eq_ignore_ascii_case(name))
            })
        }
    }

    #[derive(Default)]
    struct Out(Vec<String>);

    impl HeadWriter<()> for Out {
        fn pass(&mut self, _: &(), _: Name, name: &[u8], value: &[u8]) {
            self.0.push(format!(
                "{}: {}",
                String::from_utf8_lossy(name),
                String::from_utf8_lossy(value)
            ));
        }
        fn drop_field(&mut self, _: &()) {}
        fn framing(&mut self, _: &(), _: Name, _: &[u8]) {
            self.0.push("<framing>".into());
        }
        fn add(&mut self, name: &'static HeaderName, value: &[u8]) {
            self.pass(&(), Name::Other, name.as_str().as_bytes(), value);
        }
        fn add_list(&mut self, name: &'static HeaderName, parts: &[&[u8]]) {
            self.add(name, &parts.join(&b", "[..]));
        }
        fn add_with(&mut self, name: &'static HeaderName, write: impl FnOnce(&mut Vec<u8>)) {
            let mut v = Vec::new();
            write(&mut v);
            self.add(name, &v);
        }
    }

    fn head(fields: &[(&str, &str)]) -> Lines {
        Lines(
            fields
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
        )
    }

    fn request(fields: &[(&str, &str)], trusted: bool) -> Vec<String> {
        let mut out = Out::default();
        let rule = RequestRule {
            trusted,
            proto: "http",
            peer: b"9.9.9.9",
            client_host: Some(b"api.example.com"),
            host: Some(b"up:8080"),
            own_request_id: None,
            upgrade: false,
        };
        upstream_request(&head(fields), &rule, &mut out);
        out.0
    }

    #[test]
    fn hop_by_hop_and_connection_named_fields_stay_behind_but_framing_does_not() {
        let out = request(
            &[
                ("Host", "api.example.com"),
                ("Connection", "close, x-secret, content-length"),
                ("x-secret", "1"),
                ("keep-alive", "timeout=5"),
                ("te", "trailers"),
                ("Content-Length", "3"),
                ("X_Forwarded_For", "6.6.6.6"),
                ("x-kept", "1"),
            ],
            false,
        );
        assert_eq!(
            out,
            [
                "<framing>",
                "x-kept: 1",
                "host: up:8080",
                "x-forwarded-for: 9.9.9.9",
                "x-forwarded-proto: http",
                "x-forwarded-host: api.example.com",
            ]
        );
    }

    #[test]
    fn forwarded_fields_are_believed_only_from_a_trusted_peer() {
        let fields = [
            ("x-forwarded-for", "1.1.1.1"),
            ("X-Forwarded-For", "2.2.2.2"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "front.example"),
        ];
        let untrusted = request(&fields, false);
        assert!(untrusted.contains(&"x-forwarded-for: 1.1.1.1, 2.2.2.2, 9.9.9.9".into()));
        assert!(untrusted.contains(&"x-forwarded-proto: http".into()));
        assert!(untrusted.contains(&"x-forwarded-host: api.example.com".into()));
        let trusted = request(&fields, true);
        assert!(trusted.contains(&"x-forwarded-proto: https".into()));
        assert!(trusted.contains(&"x-forwarded-host: front.example".into()));
        assert!(!trusted.iter().any(|f| f == "x-forwarded-proto: http"));
        // A blank line adds no hop, wherever it stands.
        let blank = request(
            &[
                ("x-forwarded-for", " "),
                ("x-forwarded-for", "3.3.3.3"),
                ("x-forwarded-for", ""),
                ("x-forwarded-for", "4.4.4.4"),
            ],
            false,
        );
        assert!(
            blank.contains(&"x-forwarded-for: 3.3.3.3, 4.4.4.4, 9.9.9.9".into()),
            "{blank:?}"
        );
        // Named by Connection: the client's chain goes, the peer stays.
        let named = request(
            &[
                ("connection", "x-forwarded-for"),
                ("x-forwarded-for", "1.1.1.1"),
            ],
            false,
        );
        assert!(named.contains(&"x-forwarded-for: 9.9.9.9".into()));
    }

    #[test]
    fn an_upgrade_keeps_connection_upgrade_and_drops_an_h2c_offer() {
        let mut out = Out::default();
        let rule = RequestRule {
            trusted: false,
            proto: "http",
            peer: b"9.9.9.9",
            client_host: None,
            host: None,
            own_request_id: Some(b"abc"),
            upgrade: true,
        };
        let fields = head(&[
            ("connection", "Upgrade"),
            ("upgrade", "h2c, websocket"),
            ("x-request-id", "client"),
        ]);
        upstream_request(&fields, &rule, &mut out);
        assert_eq!(
            out.0,
            [
                "x-forwarded-for: 9.9.9.9",
                "x-forwarded-proto: http",
                "x-request-id: abc",
                "connection: upgrade",
                "upgrade: websocket",
            ]
        );
    }

    #[test]
    fn a_response_loses_hop_by_hop_fields_and_gets_the_request_id() {
        let mut out = Out::default();
        let rule = ResponseRule {
            request_id: b"rid",
            ratelimit: None,
            switched: false,
            legacy: true,
        };
        let fields = head(&[
            ("Connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
            ("Transfer-Encoding", "chunked"),
            ("x-request-id", "upstream's"),
            ("RateLimit", "\"up\";r=1;t=1"),
            ("X-RateLimit-Limit", "5"),
            ("etag", "\"x\""),
        ]);
        client_response(&fields, &rule, &mut out);
        assert_eq!(
            out.0,
            [
                "<framing>",
                "RateLimit: \"up\";r=1;t=1",
                // Without RateLimit fields of tollgate's own, the upstream's legacy ones stay.
                "X-RateLimit-Limit: 5",
                "etag: \"x\"",
                "x-request-id: rid",
            ]
        );
    }
}
