//! The client connection the listener hands the fast codec: plain TCP, or TLS over TCP.
//!
//! One type for both transports, not a second instantiation of the codec: with the codec
//! compiled once for `TcpStream` and once for `TlsStream`, the plain path's exchange was no
//! longer inlined into its connection loop as before (codegen units split the two copies) and
//! ran about 2 % more instructions per request (`bench/instructions.sh`, see
//! docs/benchmarks.md). The price of one type is a branch on the transport per read and write.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp;
use tokio_rustls::server::TlsStream;

use super::ClientIo;

/// A client connection: plain, or TLS after its handshake (boxed: a rustls session is about a
/// kilobyte, a socket a few words).
pub(crate) enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS (ALPN `http/1.1`, or none) over TCP.
    Tls(Box<TlsStream<TcpStream>>),
}

/// The read half of a [`Stream`], borrowed.
pub(crate) enum ReadHalf<'a> {
    /// A socket's, without a lock.
    Plain(tcp::ReadHalf<'a>),
    /// A TLS session's: reading and writing both go through the one rustls session, so the
    /// halves share it under tokio's `split` lock (an uncontended atomic per poll). They are
    /// only taken while a request body and its response are relayed at once.
    Tls(tokio::io::ReadHalf<&'a mut TlsStream<TcpStream>>),
}

/// The write half of a [`Stream`], borrowed.
pub(crate) enum WriteHalf<'a> {
    /// A socket's.
    Plain(tcp::WriteHalf<'a>),
    /// A TLS session's (see [`ReadHalf::Tls`]).
    Tls(tokio::io::WriteHalf<&'a mut TlsStream<TcpStream>>),
}

impl ClientIo for Stream {
    type Reader<'a> = ReadHalf<'a>;
    type Writer<'a> = WriteHalf<'a>;

    fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    fn halves(&mut self) -> (ReadHalf<'_>, WriteHalf<'_>) {
        match self {
            Stream::Plain(s) => {
                let (r, w) = s.split();
                (ReadHalf::Plain(r), WriteHalf::Plain(w))
            }
            Stream::Tls(s) => {
                let (r, w) = tokio::io::split(&mut **s);
                (ReadHalf::Tls(r), WriteHalf::Tls(w))
            }
        }
    }
}

impl AsyncRead for Stream {
    #[inline]
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    #[inline]
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    #[inline]
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

impl AsyncRead for ReadHalf<'_> {
    #[inline]
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ReadHalf::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WriteHalf<'_> {
    #[inline]
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Plain(s) => Pin::new(s).poll_write(cx, buf),
            WriteHalf::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    #[inline]
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Plain(s) => Pin::new(s).poll_flush(cx),
            WriteHalf::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Plain(s) => Pin::new(s).poll_shutdown(cx),
            WriteHalf::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
