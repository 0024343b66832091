//! One exchange on the fast codec, through the pipeline's phases: route, keys and admission,
//! the upstream request under the header rules, the response filtered back, and the end.

use std::pin::pin;
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use http::uri::Scheme;
use http::{HeaderMap, HeaderName, HeaderValue, Uri};

use super::client::{client_gone, exchange};
use super::framing::Framing;
use super::head::{self, Field, RequestHead, ResponseHead};
use super::relay::{Pump, relay, relay_duplex};
use super::write::{FieldsView, LineWriter, push_body, push_date, upstream_head};
use super::{ClientIo, Conn, Failure, RequestId, Step, WAIT_READ_MAX};
use crate::key::{RequestParts, client_ip};
use crate::limit::HeaderInfo;
use crate::panics::Panic;
use crate::proxy::error::ProxyError;
use crate::proxy::exchange::ExchangeEnd;
use crate::proxy::forwarding::{self, RequestRule, ResponseRule};
use crate::proxy::pipeline::{self, Tries};
use crate::proxy::response::push_u64;
use crate::proxy::{AbandonGuard, request_id};
use crate::routing::normalize_path;
use crate::snapshot::{ConfigSnapshot, Route, Upstream};

impl<S: ClientIo> Conn<S> {
    pub(super) async fn handle(&mut self, mut head: RequestHead) -> Step {
        let started = Instant::now();
        let bytes = self.rbuf.split_to(head.len).freeze();
        let Ok(raw_uri) = Uri::from_maybe_shared(bytes.slice(head.target.clone())) else {
            return self.general(bytes);
        };
        let normalized = normalize_path(&raw_uri);
        let uri = normalized.as_ref().unwrap_or(&raw_uri);
        let mut end = ExchangeEnd::begin(self.gateway.snapshot.load_full(), started);
        // `parse_request` checked it is a host (ASCII, no space or control byte).
        let host = head.host.clone().map(|r| &bytes[r]);
        let routed = pipeline::route(end.snapshot(), &head.method, Ok(host), uri.path());
        if let Ok(i) = routed {
            let route = &end.snapshot().routes[i];
            // A route that settles costs from the response's trailers needs them read, which
            // this codec (relaying a body's bytes as they come) does not: hyper serves it.
            if !route.upstreams.iter().all(|u| u.scheme == Scheme::HTTP) || route.limits.settles {
                return self.general(bytes);
            }
            end.routed(i);
        }
        let rt = &**end.snapshot();
        let rid = match head.request_id.clone() {
            Some(r) if request_id::sane(&bytes[r.clone()]) => RequestId::Client(r),
            _ => RequestId::Ours(request_id::generate_hex()),
        };
        let step = match routed {
            Err(e) => {
                let (status, step) = self.fail(&e, &end, &mut head, &bytes, &rid).await;
                tracing::debug!(request_id = %rid.log(&bytes), method = %head.method, status, "not routed");
                step
            }
            Ok(idx) => {
                let route = &rt.routes[idx];
                let caught = {
                    let phases = pin!(self.route(rt, route, &end, &mut head, &bytes, uri, &rid));
                    crate::panics::catch_pinned(phases).await
                };
                match caught {
                    Ok((_, step)) => step,
                    Err(p) => self.panicked(&p, &end, &mut head, &bytes, &rid).await,
                }
            }
        };
        self.ended(end);
        step
    }

    /// A panic caught in a routed request's phases (`crate::panics`): answered 500 when
    /// nothing of the response has gone out, and the connection closes either way (what the
    /// panic left half-done, a body half read or half relayed, cannot carry another request).
    async fn panicked(
        &mut self,
        p: &Panic,
        end: &ExchangeEnd,
        head: &mut RequestHead,
        bytes: &Bytes,
        rid: &RequestId,
    ) -> Step {
        let answered = end.is_answered();
        let then = if answered {
            "response cut: connection closed"
        } else {
            "answered 500, connection closed"
        };
        let metrics = &self.gateway.metrics;
        crate::proxy::request_panicked(metrics, self.peer, end.route(), rid.log(bytes), then, p);
        if answered {
            return Step::Close { linger: false };
        }
        self.fail(&ProxyError::Panicked, end, head, bytes, rid)
            .await
            .1
    }

    /// Keys, admission, and the forward of an admitted request; the status sent (0 for none)
    /// and what becomes of the connection.
    #[allow(clippy::too_many_arguments)]
    async fn route(
        &mut self,
        rt: &ConfigSnapshot,
        route: &Route,
        end: &ExchangeEnd,
        head: &mut RequestHead,
        bytes: &Bytes,
        uri: &Uri,
        rid: &RequestId,
    ) -> (u16, Step) {
        let peer_ip = self.peer.ip();
        let trusted = !rt.trusted_proxies.is_empty()
            && rt
                .trusted_proxies
                .iter()
                .any(|n| n.contains(&peer_ip.to_canonical()));
        // The key reads fields only through `header:` parts, or forwarding fields from a
        // trusted peer: otherwise no map is built.
        let map = if !route.limits.is_empty() && (trusted || route.limits.reads_headers) {
            header_map(bytes, &self.fields)
        } else {
            HeaderMap::new()
        };
        let client = client_ip(peer_ip, &map, &rt.trusted_proxies);
        let parts = RequestParts {
            method: &head.method,
            uri,
            headers: &map,
            client_ip: client,
            client_ip_text: (client == peer_ip).then_some(self.peer_text.as_bytes()),
            route: &route.name,
            peer_trusted: crate::key::client_ip::peer_trusted(peer_ip, &rt.trusted_proxies),
        };
        let admitted = match self.gateway.admit(rt, route, &parts, rid.log(bytes)).await {
            Ok(a) => a,
            Err(ProxyError::Queued(q)) => {
                let gone = client_gone(&mut self.client, &mut self.rbuf);
                let waited = self
                    .gateway
                    .wait_for_slot(rt, route, &parts, rid.log(bytes), q, gone);
                match waited.await {
                    Ok(a) => a,
                    Err(e) => return self.fail(&e, end, head, bytes, rid).await,
                }
            }
            Err(e) => return self.fail(&e, end, head, bytes, rid).await,
        };
        // Held on this exchange's stack, beside its end guard: the slots go back when this
        // returns, the response sent (or the client gone, or the upstream failed).
        let held = admitted.held;
        if !admitted.delay.is_zero() {
            // A client that leaves before its slot: the slot stays consumed, the abandonment
            // is counted (the guard), nothing is forwarded.
            let guard = AbandonGuard(admitted.delayed_by.map(|i| &route.limits.limits[i]));
            if !self.wait(admitted.delay).await {
                return (0, Step::Close { linger: false });
            }
            std::mem::forget(guard);
        }
        drop(admitted.waiter);
        let info = admitted.info.filter(|_| route.headers);
        let watch_client = held.slots() > 0;
        let (status, step) = self
            .forward(
                route,
                end,
                head,
                bytes,
                uri,
                rid,
                trusted,
                info,
                watch_client,
            )
            .await;
        tracing::debug!(request_id = %rid.log(bytes), route = %route.name, method = %head.method, status, "request");
        (status, step)
    }

    /// Forwards an admitted request; returns the status sent and what becomes of the connection.
    #[allow(clippy::too_many_arguments)]
    async fn forward(
        &mut self,
        route: &Route,
        end: &ExchangeEnd,
        head: &mut RequestHead,
        bytes: &Bytes,
        uri: &Uri,
        rid: &RequestId,
        trusted: bool,
        info: Option<HeaderInfo>,
        watch_client: bool,
    ) -> (u16, Step) {
        let t0 = Instant::now();
        let mut pump = Pump::default();
        let deadline = tokio::time::Instant::from_std(t0) + route.timeout;
        let mut tries = Tries::new(route, t0);
        let mut done = None;
        while let Some(upstream) = tries.next_upstream() {
            let pool = &upstream.pools.raw;
            self.write_upstream_head(route, upstream, head, bytes, uri, rid, trusted);
            let tried = self
                .route_timer
                .within(
                    deadline,
                    exchange(
                        pool,
                        &self.out,
                        &head.method,
                        &mut head.framing,
                        &mut pump,
                        &mut self.client,
                        &mut self.rbuf,
                        &mut self.ubuf,
                        &mut self.ufields,
                        t0,
                        watch_client,
                    ),
                )
                .await;
            done = Some(match tried {
                Ok(Ok((up, resp))) => Ok((pool, up, resp)),
                Ok(Err(Failure::Connect(e))) => {
                    tries.refused(upstream, Box::new(e));
                    continue;
                }
                Ok(Err(f)) => Err(f.into()),
                Err(_) => Err(ProxyError::UpstreamTimeout),
            });
            break;
        }
        let exchanged = tries.outcome(done);
        let (pool, mut up, resp) = match exchanged {
            Ok(x) => x,
            Err(e) => return self.fail(&e, end, head, bytes, rid).await,
        };
        // The request body still coming when the response starts: the client connection closes
        // after this exchange (whatever of the body the upstream does not take is read off).
        let body_sent = head.framing.is_done() && pump.pending.is_empty();
        let close = head.connection.close || !body_sent || *self.stop.borrow();
        let mut framing = resp.framing.clone();
        let rechunk = framing == Framing::UntilClose;
        // The body bytes that came with the head go out with it, in one write.
        let Ok(n) = framing.advance(&self.ubuf[resp.len..]) else {
            let e = ProxyError::Upstream("the upstream sent a malformed body".into());
            return self.fail(&e, end, head, bytes, rid).await;
        };
        end.answered(resp.status);
        self.write_client_head(route, &resp, bytes, rid, info.as_ref(), close);
        self.ubuf.advance(resp.len);
        push_body(&mut self.out, &self.ubuf[..n], rechunk);
        self.ubuf.advance(n);
        // The route's timeout bounds the whole exchange: a body still coming at the deadline
        // is cut (see `proxy::deadline`, which does the same on the hyper codec). Two `within`
        // arms rather than one over an async block or a `future::Either` of the two relays,
        // which cost more per request.
        let relayed = if body_sent {
            self.route_timer
                .within(
                    deadline,
                    relay(
                        &mut self.client,
                        &mut up,
                        &mut self.ubuf,
                        &mut self.out,
                        &mut framing,
                        rechunk,
                    ),
                )
                .await
        } else {
            self.route_timer
                .within(
                    deadline,
                    relay_duplex(
                        &mut self.client,
                        &mut self.rbuf,
                        &mut head.framing,
                        &mut pump,
                        &mut up,
                        &mut self.ubuf,
                        &mut self.out,
                        &mut framing,
                        rechunk,
                    ),
                )
                .await
        };
        match relayed {
            Ok(Ok(())) => {}
            Ok(Err(cut)) => {
                tracing::debug!(route = %route.name, %cut, "response cut short");
                return (resp.status, Step::Close { linger: false });
            }
            Err(_) => {
                tracing::warn!(route = %route.name, "upstream timed out in the response body: cut");
                return (resp.status, Step::Close { linger: false });
            }
        }
        let request_done = head.framing.is_done() && pump.pending.is_empty() && !pump.broken;
        if request_done && !resp.closes && !rechunk && self.ubuf.is_empty() {
            pool.checkin(up, Instant::now());
        }
        self.ubuf.clear();
        if self.ubuf.capacity() > WAIT_READ_MAX {
            // One answer with a long head (up to ~400 KiB) does not stay with a kept-alive
            // client connection.
            self.ubuf = BytesMut::new();
        }
        if self.out.capacity() > WAIT_READ_MAX {
            self.out = Vec::new();
        }
        let step = if close {
            // A body that was still coming at the head may have been followed by more bytes.
            Step::Close {
                linger: !body_sent || !head.framing.is_done(),
            }
        } else {
            Step::Keep
        };
        (resp.status, step)
    }

    /// The request head for `upstream`, under the pipeline's request rule.
    #[allow(clippy::too_many_arguments)]
    fn write_upstream_head(
        &mut self,
        route: &Route,
        upstream: &Upstream,
        head: &RequestHead,
        bytes: &Bytes,
        uri: &Uri,
        rid: &RequestId,
        trusted: bool,
    ) {
        let client_host = head.host.clone().map(|r| &bytes[r]);
        let rule = RequestRule {
            trusted,
            proto: self.gateway.proto,
            peer: self.peer_text.as_bytes(),
            client_host,
            host: Some(match client_host {
                Some(h) if route.preserve_host => h,
                _ => upstream.host.as_bytes(),
            }),
            own_request_id: match rid {
                RequestId::Ours(id) => Some(id),
                RequestId::Client(_) => None,
            },
            upgrade: false,
        };
        let target = (
            upstream.base_path.as_str(),
            uri.path_and_query().map_or("/", |p| p.as_str()),
        );
        upstream_head(&mut self.out, head, bytes, &self.fields, target, &rule);
    }

    /// The response head for the client, under the pipeline's response rule; the framing is
    /// this codec's (the length as parsed, or chunked).
    fn write_client_head(
        &mut self,
        route: &Route,
        resp: &ResponseHead,
        bytes: &Bytes,
        rid: &RequestId,
        info: Option<&HeaderInfo>,
        close: bool,
    ) {
        let out = &mut self.out;
        let up = &self.ubuf[..resp.len];
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        push_u64(out, u64::from(resp.status));
        out.push(b' ');
        if resp.reason.is_empty() {
            let canonical = http::StatusCode::from_u16(resp.status)
                .ok()
                .and_then(|s| s.canonical_reason())
                .unwrap_or("");
            out.extend_from_slice(canonical.as_bytes());
        } else {
            out.extend_from_slice(&up[resp.reason.clone()]);
        }
        out.extend_from_slice(b"\r\n");
        let rule = ResponseRule {
            request_id: rid.bytes(bytes),
            ratelimit: info.map(|i| (&route.limits.limits[i.limit], i)),
            switched: false,
            legacy: route.legacy_headers,
        };
        let view = FieldsView {
            bytes: up,
            fields: &self.ufields,
            connection: &resp.connection,
        };
        let mut w = LineWriter {
            out,
            pass_length: false,
            dated: false,
        };
        forwarding::client_response(&view, &rule, &mut w);
        let dated = w.dated;
        let length_framed = matches!(resp.framing, Framing::Length(_));
        if let (true, Some(n)) = (length_framed, resp.length) {
            out.extend_from_slice(b"content-length: ");
            push_u64(out, n);
            out.extend_from_slice(b"\r\n");
        }
        if !length_framed {
            head::push_field(out, b"transfer-encoding", b"chunked");
        }
        if !dated {
            push_date(out);
        }
        if close {
            head::push_field(out, b"connection", b"close");
        }
        out.extend_from_slice(b"\r\n");
    }
}

impl From<Failure> for ProxyError {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Client => ProxyError::ClientGone,
            Failure::BadBody => ProxyError::MalformedBody,
            // The upstream connection, holding half a request, is dropped.
            Failure::CutShort => ProxyError::BodyCutShort,
            Failure::Upstream(e) | Failure::Connect(e) => e.into(),
        }
    }
}

/// The request's fields as a map, for keys that read them.
fn header_map(bytes: &Bytes, fields: &[Field]) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(fields.len());
    for f in fields {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(&bytes[f.name.clone()]),
            HeaderValue::from_maybe_shared(bytes.slice(f.value.clone())),
        ) {
            map.append(n, v);
        }
    }
    map
}
