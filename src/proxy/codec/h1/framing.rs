//! Where a message body ends, found without decoding it: the fast path forwards a body's bytes
//! exactly as they came (chunk sizes, extensions and trailers included), so all it needs is to
//! know which of the bytes it holds still belong to the body. Since the bytes go on as they
//! came, the scanner accepts only what a stricter parser behind it would read the same way.

/// How a message's body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Framing {
    /// `Content-Length: n` (0 for a message without a body).
    Length(u64),
    Chunked(Chunked),
    /// A response without length or chunked coding: it ends when the upstream closes.
    UntilClose,
}

impl Framing {
    pub(crate) fn is_done(&self) -> bool {
        match self {
            Framing::Length(n) => *n == 0,
            Framing::Chunked(c) => c.is_done(),
            Framing::UntilClose => false,
        }
    }

    /// How many bytes at the start of `buf` belong to the body, advancing past them.
    pub(crate) fn advance(&mut self, buf: &[u8]) -> Result<usize, BadChunk> {
        match self {
            Framing::Length(n) => {
                let take = (*n).min(buf.len() as u64);
                *n -= take;
                Ok(take as usize)
            }
            Framing::Chunked(c) => c.scan(buf),
            Framing::UntilClose => Ok(buf.len()),
        }
    }
}

/// The chunked coding is malformed; the exchange cannot go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed chunked body")]
pub(crate) struct BadChunk;

/// A chunk size this large is a client trying something: 2^60 bytes is beyond any real body.
const MAX_CHUNK: u64 = 1 << 60;
/// Digits of one chunk size, leading zeros included (a u64 in hex; stricter than hyper, which
/// only checks for overflow).
const MAX_SIZE_DIGITS: u8 = 16;
/// Bytes of extensions on one chunk-size line, and of the whole trailer section. The bytes
/// pass to the upstream as they came, so what tollgate accepts must be what any parser
/// behind it reads the same way: bounded, and without control bytes.
const MAX_EXT: u32 = 4096;
/// Extension bytes in a whole body, and the trailer section's bytes (its colons and line
/// ends included) and fields: no more than hyper takes (its `CHUNKED_EXTENSIONS_LIMIT`,
/// `TRAILER_LIMIT` and 100 fields, each refused from the limit on), so the fast codec never
/// forwards a body the general path, or a hyper upstream, refuses. Differential fuzzing found
/// the trailer count missing (fuzz/regressions/differential_framing/).
const MAX_EXT_TOTAL: u32 = 16 * 1024;
const MAX_TRAILERS: u32 = 16 * 1024;
const MAX_TRAILER_FIELDS: u8 = 100;

/// Tracks a chunked body (RFC 9112 §7.1) through any split of its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chunked {
    state: State,
    /// The chunk size being read, then the data bytes left in the chunk.
    n: u64,
    /// Digits of the size being read.
    digits: u8,
    /// Extension bytes on this size line; trailer bytes so far.
    extra: u32,
    /// Extension bytes in the body so far.
    ext_total: u32,
    /// Trailer fields so far.
    trailers: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// First digit of a chunk size.
    SizeStart,
    Size,
    /// Whitespace after the size: more of it, `;` or CR may follow (as hyper reads it).
    SizeWs,
    /// Extensions after `;`, up to CR.
    Ext,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    /// Start of a trailer line, or the CR of the final empty line.
    TrailerStart,
    /// A trailer field's name, up to its colon.
    TrailerName,
    /// A trailer field's value, up to CR.
    Trailer,
    TrailerLf,
    EndLf,
    Done,
}

impl Default for Chunked {
    fn default() -> Self {
        Self::new()
    }
}

impl Chunked {
    pub(crate) fn new() -> Self {
        Self {
            state: State::SizeStart,
            n: 0,
            digits: 0,
            extra: 0,
            ext_total: 0,
            trailers: 0,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Whether refusing `b` next is one of this scanner's refusals that hyper's decoder does not
    /// make: the scanner passes the bytes on as they came, so it refuses what another parser
    /// might read otherwise, where hyper decodes leniently and re-frames what it read. They are:
    /// a 17th size digit or a size past 2^60 (hyper: only an overflow of 2^64), a control byte
    /// in an extension or 4 KiB of one on a line (hyper: only a LF, and 16 KiB in all, which
    /// this scanner refuses too), and a bare LF in the trailer section (hyper reads on to the
    /// next CR; its trailer parser then ends the section at the bare LF and ignores the rest).
    /// The fuzz harnesses tell these refusals from the others.
    pub(crate) fn stricter_than_hyper(&self, b: u8) -> bool {
        match self.state {
            State::Size => hex(b).is_some(),
            State::Ext => b != b'\n',
            State::TrailerStart | State::TrailerName | State::Trailer => b == b'\n',
            _ => false,
        }
    }

    /// Consumes from `buf` up to the body's end; returns how many bytes were the body's.
    pub(crate) fn scan(&mut self, buf: &[u8]) -> Result<usize, BadChunk> {
        self.scan_data(buf, |_| {})
    }

    /// [`Chunked::scan`], also saying where the chunks' data is among the bytes consumed, one
    /// range of `buf` at a time and in order: what a decoder keeps (the HTTP/2 codec's bodies
    /// read from a raw upstream connection, `proxy::raw_upstream`).
    #[inline(always)]
    pub(crate) fn scan_data(
        &mut self,
        buf: &[u8],
        mut data: impl FnMut(std::ops::Range<usize>),
    ) -> Result<usize, BadChunk> {
        let mut i = 0;
        while i < buf.len() {
            if self.state == State::Data {
                let take = self.n.min((buf.len() - i) as u64);
                self.n -= take;
                if take > 0 {
                    data(i..i + take as usize);
                }
                i += take as usize;
                if self.n == 0 {
                    self.state = State::DataCr;
                }
                continue;
            }
            let b = buf[i];
            i += 1;
            self.state = match (self.state, b) {
                (State::SizeStart, _) => {
                    self.n = u64::from(hex(b).ok_or(BadChunk)?);
                    self.digits = 1;
                    self.extra = 0;
                    State::Size
                }
                (State::Size, b'\r') => State::SizeLf,
                (State::Size, b';') => State::Ext,
                (State::Size, b' ' | b'\t') => State::SizeWs,
                (State::Size, _) => {
                    let d = hex(b).ok_or(BadChunk)?;
                    self.digits += 1;
                    if self.n > MAX_CHUNK >> 4 || self.digits > MAX_SIZE_DIGITS {
                        return Err(BadChunk);
                    }
                    self.n = self.n * 16 + u64::from(d);
                    State::Size
                }
                (State::SizeWs, b' ' | b'\t') => State::SizeWs,
                (State::SizeWs, b';') => State::Ext,
                (State::SizeWs, b'\r') => State::SizeLf,
                (State::Ext, b'\r') => State::SizeLf,
                (State::Ext, _) if (b >= 0x20 && b != 0x7f) || b == b'\t' => {
                    self.extra += 1;
                    self.ext_total += 1;
                    if self.extra > MAX_EXT || self.ext_total >= MAX_EXT_TOTAL {
                        return Err(BadChunk);
                    }
                    State::Ext
                }
                (State::SizeLf, b'\n') if self.n == 0 => {
                    // The trailers' own budget: the last chunk's extensions do not count.
                    self.extra = 0;
                    State::TrailerStart
                }
                (State::SizeLf, b'\n') => State::Data,
                (State::DataCr, b'\r') => State::DataLf,
                (State::DataLf, b'\n') => State::SizeStart,
                (State::TrailerStart, b'\r') => {
                    self.trailer_byte()?;
                    State::EndLf
                }
                // A trailer is a field line (`name: value`), as hyper's parser requires: one
                // that is not would reach the upstream for it to make sense of.
                (State::TrailerStart | State::TrailerName, _) if is_tchar(b) => {
                    self.trailer_byte()?;
                    State::TrailerName
                }
                (State::TrailerName, b':') => {
                    self.trailer_byte()?;
                    State::Trailer
                }
                (State::Trailer, b'\r') => {
                    self.trailer_byte()?;
                    State::TrailerLf
                }
                (State::Trailer, _) if (b >= 0x20 && b != 0x7f) || b == b'\t' => {
                    self.trailer_byte()?;
                    State::Trailer
                }
                (State::TrailerLf, b'\n') => {
                    self.trailer_byte()?;
                    self.trailers += 1;
                    if self.trailers > MAX_TRAILER_FIELDS {
                        return Err(BadChunk);
                    }
                    State::TrailerStart
                }
                (State::EndLf, b'\n') => {
                    self.trailer_byte()?;
                    self.state = State::Done;
                    return Ok(i);
                }
                (State::Done, _) => return Ok(i - 1),
                _ => return Err(BadChunk),
            };
        }
        Ok(i)
    }

    /// One more byte of the trailer section, within its bound.
    fn trailer_byte(&mut self) -> Result<(), BadChunk> {
        self.extra += 1;
        if self.extra >= MAX_TRAILERS {
            return Err(BadChunk);
        }
        Ok(())
    }
}

/// RFC 9110 `tchar`: what a field name is made of.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Scans `body` fed in pieces cut at `cuts`; returns the bytes counted as body.
    fn scan_split(body: &[u8], cuts: &[usize]) -> Result<(usize, bool), BadChunk> {
        let mut c = Chunked::new();
        let mut at = 0;
        let mut counted = 0;
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
        points.sort_unstable();
        points.push(body.len());
        for p in points {
            if p < at {
                continue;
            }
            let n = c.scan(&body[at..p])?;
            counted += n;
            if c.is_done() {
                return Ok((counted, true));
            }
            assert_eq!(n, p - at, "bytes short of the end are all the body's");
            at = p;
        }
        Ok((counted, c.is_done()))
    }

    fn encode(chunks: &[Vec<u8>], ext: bool, trailers: &[(&str, &str)]) -> Vec<u8> {
        let mut out = Vec::new();
        for c in chunks.iter().filter(|c| !c.is_empty()) {
            out.extend_from_slice(format!("{:X}", c.len()).as_bytes());
            if ext {
                out.extend_from_slice(b";name=\"v\"");
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(c);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n");
        for (k, v) in trailers {
            out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    #[test]
    fn a_body_ends_after_its_last_chunk_and_trailers_and_not_a_byte_later() {
        let mut body = encode(&[b"hello".to_vec(), b" world".to_vec()], false, &[]);
        let len = body.len();
        body.extend_from_slice(b"GET /next HTTP/1.1\r\n");
        let mut c = Chunked::new();
        assert_eq!(c.scan(&body), Ok(len));
        assert!(c.is_done());
        let with_trailer = encode(&[b"x".to_vec()], true, &[("x-sum", "1")]);
        let mut c = Chunked::new();
        assert_eq!(c.scan(&with_trailer), Ok(with_trailer.len()));
        assert!(c.is_done());
    }

    #[test]
    fn malformed_codings_are_refused() {
        for bad in [
            &b"x\r\n"[..],
            b"5\n",
            b"5\r\nhelloX",
            b"0\r\nbad\nline\r\n\r\n",
            b"\r\n",
            b"ffffffffffffffffff\r\n",
            // 2^64 + 15: would wrap to 15 without the bound.
            b"1000000000000000F\r\n",
            b"10000000000000000\r\n\r\n",
            // More than 16 digits, even as leading zeros; junk after the size's whitespace;
            // control bytes in an extension; extensions or trailers past their bounds.
            b"00000000000000005\r\nhello\r\n",
            b"5 x\r\nhello\r\n",
            b"5;a=\x00\r\nhello\r\n",
            b"5;a=\x7f\r\nhello\r\n",
            b"5;\n",
        ] {
            let mut c = Chunked::new();
            assert_eq!(
                c.scan(bad),
                Err(BadChunk),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn long_extensions_and_trailer_sections_are_refused_and_bounded_ones_pass() {
        let mut ext = b"1;".to_vec();
        ext.extend(std::iter::repeat_n(b'a', MAX_EXT as usize + 1));
        ext.extend_from_slice(b"\r\nx\r\n0\r\n\r\n");
        assert_eq!(Chunked::new().scan(&ext), Err(BadChunk));
        let ok = b"1;a=b \t;c\r\nx\r\n5 \t\r\nhello\r\n0000000000000000\r\n\r\n";
        assert_eq!(Chunked::new().scan(ok), Ok(ok.len()));
        let mut trailers = b"0\r\n".to_vec();
        for i in 0..2_000 {
            trailers.extend_from_slice(format!("x-t{i}: v\r\n").as_bytes());
        }
        trailers.extend_from_slice(b"\r\n");
        assert_eq!(Chunked::new().scan(&trailers), Err(BadChunk));
    }

    #[test]
    fn length_framing_counts_down() {
        let mut f = Framing::Length(5);
        assert_eq!(f.advance(b"abc"), Ok(3));
        assert_eq!(f.advance(b"defg"), Ok(2));
        assert!(f.is_done());
        assert_eq!(f.advance(b"x"), Ok(0));
    }

    proptest! {
        /// Wherever the bytes are cut, the scanner finds the same end: the encoded length.
        #[test]
        fn the_end_is_found_through_any_split(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..6),
            ext in any::<bool>(),
            trailer in any::<bool>(),
            cuts in proptest::collection::vec(0usize..400, 0..8),
            tail in proptest::collection::vec(any::<u8>(), 0..10),
        ) {
            let trailers: &[(&str, &str)] = if trailer { &[("x-t", "v")] } else { &[] };
            let body = encode(&chunks, ext, trailers);
            let mut stream = body.clone();
            stream.extend_from_slice(&tail);
            let (counted, done) = scan_split(&stream, &cuts).unwrap();
            prop_assert!(done);
            prop_assert_eq!(counted, body.len());
        }

        /// A body cut short is never taken as complete.
        #[test]
        fn a_truncated_body_is_not_done(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 1..4),
            cut in 0usize..1000,
        ) {
            let body = encode(&chunks, false, &[]);
            let cut = cut % body.len();
            let mut c = Chunked::new();
            prop_assert_eq!(c.scan(&body[..cut]), Ok(cut));
            prop_assert!(!c.is_done());
        }
    }

    #[test]
    fn a_trailer_must_be_a_field_line() {
        for bad in [
            &b"0\r\nT8 v\r\n\r\n"[..],
            b"0\r\n:T: v\r\n\r\n",
            b"0\r\nT v: w\r\n\r\n",
            b"0\r\nT: a\x01b\r\n\r\n",
        ] {
            assert_eq!(Chunked::new().scan(bad), Err(BadChunk), "{bad:?}");
        }
        let good = b"0\r\nX-Sum: 1\t2\r\nEmpty:\r\n\r\n";
        assert_eq!(Chunked::new().scan(good), Ok(good.len()));
    }

    /// Found by differential fuzzing (fuzz/regressions/differential_framing/): hyper refuses
    /// a trailer section of more than 100 fields or 16 KiB (line ends included), and a body
    /// with 16 KiB of extensions in all; the scanner took them and passed them on.
    #[test]
    fn no_more_trailers_or_extensions_than_hyper_takes() {
        let trailers = |n: usize, value: usize| {
            let mut t = b"0\r\n".to_vec();
            for i in 0..n {
                t.extend_from_slice(format!("t{i:03}:{}\r\n", "v".repeat(value)).as_bytes());
            }
            t.extend_from_slice(b"\r\n");
            t
        };
        let at_most = trailers(100, 1);
        assert_eq!(Chunked::new().scan(&at_most), Ok(at_most.len()));
        assert_eq!(Chunked::new().scan(&trailers(101, 1)), Err(BadChunk));
        // 50 lines of 327 bytes and the final CRLF: 16352 bytes; 2 more per line: 16452.
        let bytes = trailers(50, 320);
        assert_eq!(Chunked::new().scan(&bytes), Ok(bytes.len()));
        assert_eq!(Chunked::new().scan(&trailers(50, 322)), Err(BadChunk));
        let extensions = |n: usize| {
            let mut b = Vec::new();
            for _ in 0..n {
                b.extend_from_slice(format!("1;{}\r\nx\r\n", "e".repeat(4000)).as_bytes());
            }
            b.extend_from_slice(b"0\r\n\r\n");
            b
        };
        let four = extensions(4);
        assert_eq!(Chunked::new().scan(&four), Ok(four.len()));
        assert_eq!(Chunked::new().scan(&extensions(5)), Err(BadChunk));
    }
}
