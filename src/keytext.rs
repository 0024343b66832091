//! How a key's values are written: escaped so the join of parts is injective and stays printable
//! ASCII without braces, long values hashed. A leaf: the key builder (`key`) writes request values
//! with it, and the config (`config`) writes the keys an operator names (an override's
//! `when.key`, an overrides file) with it, so both meet on the same bytes.

use std::net::IpAddr;

use sha2::{Digest, Sha256};

/// Longest part value kept verbatim; longer ones are hashed.
pub const MAX_PART_LEN: usize = 64;

/// A request's keys, built on the stack: one or two limits' keys fit without an allocation.
pub type KeyBuf = smallvec::SmallVec<[u8; 128]>;

/// A key as an operator types it into the admin API's `?key=`, in the form the gateway stores
/// it. Each `|`-separated part is taken as already stored when it could be (printable ASCII
/// without braces, and not over [`MAX_PART_LEN`] unless it holds an escape); otherwise it is a
/// raw value (`alice smith`, a long API key) and is escaped or hashed as a request's would be.
/// Only a raw value that contains `%` or `|` must be given in its stored form.
pub fn from_admin(given: &str) -> Vec<u8> {
    let mut out = KeyBuf::new();
    from_admin_into(given, &mut out);
    out.into_vec()
}

/// [`from_admin`] into `out` (cleared first), without an allocation for a key that fits
/// [`KeyBuf`]: what a table of a million keys is read with.
pub(crate) fn from_admin_into(given: &str, out: &mut KeyBuf) {
    out.clear();
    // `on_missing: ip`'s fallback key, whose space is its own (values have theirs escaped).
    if given
        .strip_prefix("ip ")
        .is_some_and(|ip| ip.parse::<IpAddr>().is_ok())
    {
        out.extend_from_slice(given.as_bytes());
        return;
    }
    for (i, part) in given.as_bytes().split(|&b| b == b'|').enumerate() {
        if i > 0 {
            out.push(b'|');
        }
        let stored_form = part
            .iter()
            .all(|&b| matches!(b, 0x21..=0x7e) && b != b'{' && b != b'}')
            && (part.len() <= MAX_PART_LEN || part.contains(&b'%'));
        if stored_form {
            out.extend_from_slice(part);
        } else {
            push_escaped(out, part);
        }
    }
}

/// Appends `value` escaped (or, over [`MAX_PART_LEN`], hashed) as one part of a key.
pub(crate) fn push_escaped(out: &mut KeyBuf, value: &[u8]) {
    if value.len() > MAX_PART_LEN {
        let digest = Sha256::digest(value);
        out.push(b'~');
        for b in &digest[..16] {
            out.extend_from_slice(&hex_byte(*b));
        }
        return;
    }
    for &b in value {
        match b {
            b'%' | b'|' | b'{' | b'}' => push_pct(out, b),
            // Keys stay printable ASCII (Redis keys, logs, the admin API's `?key=`).
            0x21..=0x7e => out.push(b),
            _ => push_pct(out, b),
        }
    }
}

fn push_pct(out: &mut KeyBuf, b: u8) {
    out.push(b'%');
    out.extend_from_slice(&hex_byte(b).map(|c| c.to_ascii_uppercase()));
}

fn hex_byte(b: u8) -> [u8; 2] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    [HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]
}
