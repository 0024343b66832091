//! What a header field's name means to a proxy, told once for both codecs: the fast codec
//! classifies each field as it parses, the hyper codec as the rules in [`super::forwarding`]
//! visit a `HeaderMap`.

/// The names the proxy acts on; everything else is copied through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Name {
    Other,
    Host,
    ContentLength,
    TransferEncoding,
    Connection,
    /// Hop-by-hop besides `Connection` and `Transfer-Encoding` (RFC 9110 §7.6.1 and the usual
    /// proxy fields): never forwarded.
    HopByHop,
    Upgrade,
    Expect,
    XForwardedFor,
    XForwardedProto,
    XForwardedHost,
    RequestId,
    RateLimit,
    RateLimitPolicy,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`: replaced when the route sends its own.
    LegacyRateLimit,
    Date,
}

/// The [`Name`] of a field name, in any letter case.
pub(crate) fn classify(name: &[u8]) -> Name {
    let is = |s: &str| name.eq_ignore_ascii_case(s.as_bytes());
    match name.len() {
        2 if is("te") => Name::HopByHop,
        4 if is("host") => Name::Host,
        4 if is("date") => Name::Date,
        6 if is("expect") => Name::Expect,
        7 if is("upgrade") => Name::Upgrade,
        7 if is("trailer") => Name::HopByHop,
        9 if is("ratelimit") => Name::RateLimit,
        10 if is("connection") => Name::Connection,
        10 if is("keep-alive") => Name::HopByHop,
        12 if is("x-request-id") => Name::RequestId,
        14 if is("content-length") => Name::ContentLength,
        15 if is("x-forwarded-for") => Name::XForwardedFor,
        16 if is("x-forwarded-host") => Name::XForwardedHost,
        16 if is("proxy-connection") => Name::HopByHop,
        16 if is("ratelimit-policy") => Name::RateLimitPolicy,
        17 if is("transfer-encoding") => Name::TransferEncoding,
        17 if is("x-forwarded-proto") => Name::XForwardedProto,
        17 if is("x-ratelimit-limit") || is("x-ratelimit-reset") => Name::LegacyRateLimit,
        18 if is("proxy-authenticate") => Name::HopByHop,
        19 if is("proxy-authorization") => Name::HopByHop,
        21 if is("x-ratelimit-remaining") => Name::LegacyRateLimit,
        _ if super::headers::underscore_lookalike(name) => Name::HopByHop,
        _ => Name::Other,
    }
}
