//! The fast codec's connection loop: heads read (within the head timeout, or until the drain),
//! answers of tollgate's own written, and the close.

use std::pin::Pin;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::client::read_more;
use super::head::{self, ParsedRequest, RequestHead};
use super::write::{AnswerLines, push_date};
use super::{
    ClientIo, Conn, DISCARD_MAX, Ended, HEAD_TIMEOUT, ReadHead, RequestId, Step, WAIT_READ_MAX,
};
use crate::proxy::error::{ProxyError, rescue};
use crate::proxy::exchange::ExchangeEnd;
use crate::proxy::response::push_u64;

/// How long a TLS close waits to write its `close_notify`.
const CLOSE_NOTIFY_TIMEOUT: Duration = Duration::from_secs(2);

impl<S: ClientIo> Conn<S> {
    /// Serves requests until the connection closes or is handed to the general path.
    pub(super) async fn run(&mut self) -> Ended {
        // One wait on the drain signal for the connection's life, not one per request: each
        // new wait is a registration (and its removal) under the signal's lock.
        let mut stop = self.stop.clone();
        let stopped = stop.changed();
        tokio::pin!(stopped);
        loop {
            let head = match self.read_head(stopped.as_mut()).await {
                ReadHead::Head(h) => h,
                ReadHead::Closed => return Ended::Quiet,
                ReadHead::General => return Ended::General(self.rbuf.split().freeze()),
            };
            match self.handle(head).await {
                Step::Keep => {}
                Step::Close { linger } => {
                    self.close(linger).await;
                    return Ended::Closed;
                }
                Step::General(prefix) => return Ended::General(prefix),
            }
        }
    }

    /// `stopped`: resolves when the listener drains (polled only while idle between requests).
    async fn read_head<F: Future>(&mut self, mut stopped: Pin<&mut F>) -> ReadHead {
        let deadline = self.idle_from + HEAD_TIMEOUT;
        loop {
            if !self.rbuf.is_empty() {
                match head::parse_request(&self.rbuf, &mut self.fields) {
                    ParsedRequest::Complete(h) => return ReadHead::Head(h),
                    ParsedRequest::Partial => {}
                    ParsedRequest::General => return ReadHead::General,
                }
            } else if *self.stop.borrow() {
                return ReadHead::Closed;
            }
            tokio::select! {
                biased;
                r = read_more(&mut self.client, &mut self.rbuf) => match r {
                    Ok(n) if n > 0 => {}
                    // A head cut off by the client's close: nothing to answer to.
                    _ => return ReadHead::Closed,
                },
                _ = stopped.as_mut(), if self.rbuf.is_empty() => return ReadHead::Closed,
                () = self.idle.until(deadline) => return ReadHead::Closed,
            }
        }
    }

    /// Marks the end of an exchange: the clock read serves the exchange's end and the next
    /// head's timeout both.
    pub(super) fn ended(&mut self, end: ExchangeEnd) {
        let now = tokio::time::Instant::now();
        self.idle_from = now;
        end.end_at(now.into_std());
    }

    /// Gives up on this request: the general path reads it from its head.
    pub(super) fn general(&mut self, head: Bytes) -> Step {
        let mut all = BytesMut::with_capacity(head.len() + self.rbuf.len());
        all.extend_from_slice(&head);
        all.extend_from_slice(&self.rbuf);
        self.rbuf.clear();
        Step::General(all.freeze())
    }

    /// Sleeps `delay` while watching the client: false when it went away meanwhile.
    pub(super) async fn wait(&mut self, delay: Duration) -> bool {
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => return true,
                r = read_more(&mut self.client, &mut self.rbuf), if self.rbuf.len() < WAIT_READ_MAX => {
                    if !matches!(r, Ok(n) if n > 0) {
                        return false;
                    }
                }
            }
        }
    }

    /// Answers `e` as [`rescue`] says (nothing, when the client is gone); returns the status
    /// sent (0 for none) and what becomes of the connection.
    pub(super) async fn fail(
        &mut self,
        e: &ProxyError,
        end: &ExchangeEnd,
        head: &mut RequestHead,
        bytes: &Bytes,
        rid: &RequestId,
    ) -> (u16, Step) {
        let (mut fields, mut body) = std::mem::take(&mut self.scratch);
        fields.clear();
        body.clear();
        let mut answer = AnswerLines {
            status: StatusCode::OK,
            fields: &mut fields,
            body: &mut body,
            close: false,
        };
        let step = match rescue(e, end.route(), &mut answer) {
            None => (0, Step::Close { linger: false }),
            Some(status) => {
                let close = answer.close;
                end.answered(status.as_u16());
                let step = self
                    .answer(status, &fields, &body, close, head, bytes, rid)
                    .await;
                (status.as_u16(), step)
            }
        };
        self.scratch = (fields, body);
        step
    }

    /// Sends an answer of tollgate's own (header fields as `name: value\r\n` lines). The part
    /// of the request's body already here is dropped, and the connection stays usable when
    /// that was all of it; a body still coming is not waited for (the answer goes at once and
    /// the connection closes, reading off what the client still sends for a moment, see
    /// [`Conn::close`]).
    #[allow(clippy::too_many_arguments)]
    async fn answer(
        &mut self,
        status: StatusCode,
        fields: &[u8],
        body: &[u8],
        close_asked: bool,
        head: &mut RequestHead,
        bytes: &Bytes,
        rid: &RequestId,
    ) -> Step {
        let body_read = match head.framing.advance(&self.rbuf) {
            Ok(n) => {
                self.rbuf.advance(n);
                head.framing.is_done()
            }
            Err(_) => false,
        };
        let close = close_asked || head.connection.close || !body_read || *self.stop.borrow();
        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(fields);
        head::push_field(out, b"x-request-id", rid.bytes(bytes));
        out.extend_from_slice(b"content-length: ");
        push_u64(out, body.len() as u64);
        out.extend_from_slice(b"\r\n");
        push_date(out);
        if close {
            head::push_field(out, b"connection", b"close");
        }
        out.extend_from_slice(b"\r\n");
        if head.method != Method::HEAD {
            out.extend_from_slice(body);
        }
        if self.client.write_all(&self.out).await.is_err()
            || (self.client.is_tls() && self.client.flush().await.is_err())
        {
            return Step::Close { linger: false };
        }
        if close {
            Step::Close { linger: !body_read }
        } else {
            Step::Keep
        }
    }

    /// Closes the connection after its last response. With `linger`, what the client may still
    /// be sending is read off for a moment first, so the close does not reset the connection
    /// before the client has read the response.
    pub(super) async fn close(&mut self, linger: bool) {
        if self.client.is_tls() {
            // `close_notify` is a write: a client that reads nothing more must not hold the
            // task.
            let _ = tokio::time::timeout(CLOSE_NOTIFY_TIMEOUT, self.client.shutdown()).await;
        } else {
            let _ = self.client.shutdown().await;
        }
        if linger {
            let drain = async {
                let mut left = DISCARD_MAX;
                let mut buf = [0u8; 4096];
                while let Ok(n) = self.client.read(&mut buf).await {
                    if n == 0 || n >= left {
                        break;
                    }
                    left -= n;
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(2), drain).await;
        }
    }
}
