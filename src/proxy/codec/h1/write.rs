//! The fast codec's writers: heads as bytes, from the header rules of
//! [`crate::proxy::forwarding`] and the answers of [`crate::proxy::error::rescue`]. The rules
//! decide; this only spells their decisions as HTTP/1.1.

use http::{HeaderName, StatusCode};

use super::framing::Framing;
use super::head::{ConnectionTokens, Field, RequestHead, push_field};
use crate::proxy::error::AnswerWriter;
use crate::proxy::fields::Name;
use crate::proxy::forwarding::{self, HeadView, HeadWriter, RequestRule};

/// Writes the upstream request head into `out` (cleared first): the request line to
/// `base_path` + `path_and_query`, the fields under the pipeline's request `rule`, then this
/// codec's framing. The one writer of it, for the codec and for the differential fuzz target.
#[inline]
pub(crate) fn upstream_head(
    out: &mut Vec<u8>,
    head: &RequestHead,
    bytes: &[u8],
    fields: &[Field],
    (base_path, path_and_query): (&str, &str),
    rule: &RequestRule<'_>,
) {
    out.clear();
    out.extend_from_slice(head.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(base_path.as_bytes());
    out.extend_from_slice(path_and_query.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let view = FieldsView {
        bytes,
        fields,
        connection: &head.connection,
    };
    let mut w = LineWriter {
        out,
        pass_length: true,
        dated: false,
    };
    forwarding::upstream_request(&view, rule, &mut w);
    if matches!(head.framing, Framing::Chunked(_)) {
        push_field(out, b"transfer-encoding", b"chunked");
    }
    out.extend_from_slice(b"\r\n");
}

/// A parsed head's fields, as offsets into `bytes`.
pub(super) struct FieldsView<'a> {
    pub bytes: &'a [u8],
    pub fields: &'a [Field],
    pub connection: &'a ConnectionTokens,
}

impl HeadView for FieldsView<'_> {
    type Handle = Field;

    #[inline]
    fn each<'a>(&'a self, mut f: impl FnMut(&'a Field, Name, &'a [u8], &'a [u8])) {
        for field in self.fields {
            f(
                field,
                field.kind,
                &self.bytes[field.name.clone()],
                &self.bytes[field.value.clone()],
            );
        }
    }

    #[inline]
    fn named_by_connection(&self, name: &[u8]) -> bool {
        !self.connection.named.is_empty() && self.connection.names(self.bytes, name)
    }
}

/// Writes the rules' decisions as header lines. Framing fields are the codec's: a request's
/// `Content-Length` goes on as it came (`pass_length`), a response's is written again by the
/// codec from what it parsed.
pub(super) struct LineWriter<'a> {
    pub out: &'a mut Vec<u8>,
    pub pass_length: bool,
    /// A `Date` field went on.
    pub dated: bool,
}

impl HeadWriter<Field> for LineWriter<'_> {
    #[inline]
    fn pass(&mut self, _: &Field, kind: Name, name: &[u8], value: &[u8]) {
        self.dated |= kind == Name::Date;
        push_field(self.out, name, value);
    }

    #[inline]
    fn drop_field(&mut self, _: &Field) {}

    #[inline]
    fn framing(&mut self, _: &Field, kind: Name, value: &[u8]) {
        // The parser takes one length only, so this is it.
        if self.pass_length && kind == Name::ContentLength {
            push_field(self.out, b"content-length", value);
        }
    }

    #[inline]
    fn add(&mut self, name: &'static HeaderName, value: &[u8]) {
        push_field(self.out, name.as_str().as_bytes(), value);
    }

    #[inline]
    fn add_list(&mut self, name: &'static HeaderName, parts: &[&[u8]]) {
        self.out.extend_from_slice(name.as_str().as_bytes());
        self.out.extend_from_slice(b": ");
        for (i, p) in parts.iter().enumerate() {
            if i > 0 {
                self.out.extend_from_slice(b", ");
            }
            self.out.extend_from_slice(p);
        }
        self.out.extend_from_slice(b"\r\n");
    }

    #[inline]
    fn add_with(&mut self, name: &'static HeaderName, write: impl FnOnce(&mut Vec<u8>)) {
        self.out.extend_from_slice(name.as_str().as_bytes());
        self.out.extend_from_slice(b": ");
        write(self.out);
        self.out.extend_from_slice(b"\r\n");
    }
}

/// [`crate::proxy::error::rescue`]'s answer as header lines and a body; `Connection: close`
/// is noted rather than written, since the codec writes its own when it closes.
pub(super) struct AnswerLines<'a> {
    pub status: StatusCode,
    pub fields: &'a mut Vec<u8>,
    pub body: &'a mut Vec<u8>,
    pub close: bool,
}

impl AnswerWriter for AnswerLines<'_> {
    #[inline]
    fn status(&mut self, status: StatusCode) {
        self.status = status;
    }

    #[inline]
    fn field(&mut self, name: &'static HeaderName, value: &[u8]) {
        push_field(self.fields, name.as_str().as_bytes(), value);
    }

    #[inline]
    fn field_with(&mut self, name: &'static HeaderName, write: impl FnOnce(&mut Vec<u8>)) {
        self.fields.extend_from_slice(name.as_str().as_bytes());
        self.fields.extend_from_slice(b": ");
        write(self.fields);
        self.fields.extend_from_slice(b"\r\n");
    }

    #[inline]
    fn body(&mut self) -> &mut Vec<u8> {
        self.body
    }

    #[inline]
    fn close(&mut self) {
        self.close = true;
    }
}

/// Appends body bytes; `chunk`: wrapped as one chunk (an upstream body that ends at close,
/// sent chunked so the client connection can stay open).
#[inline]
pub(super) fn push_body(out: &mut Vec<u8>, data: &[u8], chunk: bool) {
    if data.is_empty() {
        return;
    }
    if chunk {
        out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    } else {
        out.extend_from_slice(data);
    }
}

/// `date: ...`, formatted once a second.
pub(super) fn push_date(out: &mut Vec<u8>) {
    use std::cell::RefCell;
    use std::time::SystemTime;
    thread_local! {
        static DATE: RefCell<(u64, [u8; 29])> = const { RefCell::new((u64::MAX, [0; 29])) };
    }
    let secs = coarse_unix_secs();
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        if d.0 != secs {
            let text = httpdate::fmt_http_date(SystemTime::now());
            if text.len() == 29 {
                d.1.copy_from_slice(text.as_bytes());
                d.0 = secs;
            }
        }
        push_field(out, b"date", &d.1);
    });
}

/// Seconds since the epoch from the kernel's coarse clock (updated each tick, read without a
/// timer read): plenty for a `Date` that changes once a second, and cheaper than
/// `SystemTime::now` on every response.
fn coarse_unix_secs() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec for the call's duration.
        if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } == 0 {
            return ts.tv_sec as u64;
        }
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
