//! `X-Request-Id`: kept from the client when it is sane, generated otherwise, sent upstream and
//! back, and carried in log lines.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderMap, HeaderName, HeaderValue};

pub(crate) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client-supplied id kept; longer (or non-visible-ASCII) ones are replaced.
const MAX_LEN: usize = 128;

/// The request's id, inserting a fresh one into `headers` when absent or unusable. Marked
/// never to be indexed by HPACK wherever it goes (the response to an HTTP/2 client, a request
/// to an HTTP/2 upstream): a value unique to each request only churns a connection's dynamic
/// table (see `headers::never_index_varying`).
pub(crate) fn ensure(headers: &mut HeaderMap) -> HeaderValue {
    if let Some(v) = headers.get_mut(&X_REQUEST_ID)
        && sane(v.as_bytes())
    {
        v.set_sensitive(true);
        return v.clone();
    }
    let mut id = generate();
    id.set_sensitive(true);
    headers.insert(&X_REQUEST_ID, id.clone());
    id
}

/// An id as log lines show it, made text only when a line is written: most requests write
/// none, and checking 32 bytes for UTF-8 was a visible part of a 429's cost.
#[derive(Clone, Copy)]
pub(crate) struct LogId<'a>(pub &'a [u8]);

impl std::fmt::Display for LogId<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Ours are hex and a client's are kept only when visible ASCII (`sane`).
        f.write_str(std::str::from_utf8(self.0).unwrap_or("-"))
    }
}

/// A client's id is kept when it is this: not empty, not long, visible ASCII only.
pub(crate) fn sane(v: &[u8]) -> bool {
    !v.is_empty() && v.len() <= MAX_LEN && v.iter().all(|b| b.is_ascii_graphic())
}

fn generate() -> HeaderValue {
    HeaderValue::from_bytes(&generate_hex()).unwrap_or_else(|_| HeaderValue::from_static("0"))
}

/// 32 hex digits: a per-process random prefix and a counter — unique without a random number
/// generator on the request path.
pub(crate) fn generate_hex() -> [u8; 32] {
    static PREFIX: OnceLock<[u8; 16]> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let prefix = PREFIX.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        hex16(h.finish())
    });
    let mut hex = [0u8; 32];
    hex[..16].copy_from_slice(prefix);
    hex[16..].copy_from_slice(&hex16(COUNTER.fetch_add(1, Ordering::Relaxed)));
    hex
}

fn hex16(n: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, d) in out.iter_mut().enumerate() {
        *d = b"0123456789abcdef"[((n >> (60 - 4 * i)) & 0xf) as usize];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_a_sane_id_and_replaces_others() {
        let mut h = HeaderMap::new();
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("abc-123"));
        assert_eq!(ensure(&mut h), "abc-123");
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("has space"));
        let id = ensure(&mut h);
        assert_eq!(id.len(), 32);
        assert_eq!(h[&X_REQUEST_ID], id);
        let mut h2 = HeaderMap::new();
        assert_ne!(ensure(&mut h2), id, "ids are unique");
    }

    #[test]
    fn ids_are_the_prefix_then_the_counter_in_hex() {
        assert_eq!(&hex16(0x0123_4567_89ab_cdef), b"0123456789abcdef");
        assert_eq!(&hex16(u64::MAX), b"ffffffffffffffff");
        let (a, b) = (generate_hex(), generate_hex());
        assert_eq!(a[..16], b[..16]);
        let n = |h: &[u8]| u64::from_str_radix(std::str::from_utf8(h).unwrap(), 16).unwrap();
        assert!(n(&b[16..]) > n(&a[16..]));
    }
}
