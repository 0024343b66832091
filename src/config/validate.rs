//! Raw YAML values to domain types: defaults, meaning, cross-field rules.
//!
//! Checks run in file order and stop at the first problem, so the position in
//! the error is the first place the operator has to look. Every message says
//! what is wrong and what would be accepted.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use serde_saphyr::Spanned;

use super::consumers::Consumers;
use super::limit;
use super::rate::parse_duration;
use super::raw::{OneOrMany, RawConfig, RawLimit, RawMatch, RawRoute, RawServer, RawTls, Text};
use super::types::{
    Config, LimitConfig, ListenerTls, OnLimit, PathMatch, RouteConfig, RouteMatch, ServerConfig,
    UpstreamCa,
};
use super::{Invalid, Pos};

pub(super) type Checked<T> = Result<T, Invalid>;

/// `base` is the directory relative file paths are resolved from (the config file's).
/// `warnings` collects what loads but does less than it seems to (see [`Config::warnings`]).
pub(super) fn config(raw: RawConfig, base: &Path, warnings: &mut Vec<Invalid>) -> Checked<Config> {
    let server = raw
        .server
        .map(|s| server(s, base))
        .transpose()?
        .unwrap_or_default();
    let redis = raw.redis.map(super::redis_section::redis).transpose()?;
    let plans = super::consumers::plans(raw.plans)?;
    let mut consumers = Consumers {
        plans: &plans,
        trusted_proxies: !server.trusted_proxies.is_empty(),
        base,
        files: HashMap::new(),
    };
    let mut shared = Vec::new();
    let mut seen_shared = HashMap::new();
    for raw_limit in raw.limits.unwrap_or_default() {
        shared.push(limit::limit(
            raw_limit,
            redis.is_some(),
            "",
            &mut seen_shared,
            &mut consumers,
            warnings,
        )?);
    }
    let mut routes = Vec::new();
    let mut seen = HashMap::new();
    for raw_route in raw.routes.unwrap_or_default() {
        routes.push(route(
            raw_route,
            redis.is_some(),
            &shared,
            &mut seen,
            &mut consumers,
            warnings,
        )?);
    }
    drop(consumers);
    if routes.is_empty() {
        warnings.push(Invalid::new(
            Pos { line: 1, column: 1 },
            "warning: no routes: every request gets 404",
        ));
    }
    Ok(Config {
        server,
        redis,
        plans,
        limits: shared,
        routes,
        warnings: Vec::new(),
        source_hash: None,
    })
}

fn server(raw: RawServer, base: &Path) -> Checked<ServerConfig> {
    let defaults = ServerConfig::default();
    let listen = raw
        .listen
        .as_ref()
        .map(|t| socket_addr(t, Listener::Proxy))
        .transpose()?;
    let admin = raw
        .admin
        .as_ref()
        .map(|t| socket_addr(t, Listener::Admin))
        .transpose()?;
    let (listen, admin) = (
        listen.unwrap_or(defaults.listen),
        admin.unwrap_or(defaults.admin),
    );
    if same_port(listen, admin) {
        let at = raw.admin.as_ref().or(raw.listen.as_ref()).map_or(TOP, at);
        return Err(Invalid::new(
            at,
            format!(
                "admin {admin} and listen {listen} would bind the same port: give them different ports"
            ),
        ));
    }
    let trusted_proxies = match raw.trusted_proxies {
        Some(list) => items(list)
            .iter()
            .map(trusted_proxy)
            .collect::<Checked<_>>()?,
        None => defaults.trusted_proxies,
    };
    let admin_token = raw.admin_token.as_ref().map(admin_token).transpose()?;
    let tls = raw.tls.map(|t| listener_tls(t, base)).transpose()?;
    let upstream_ca = raw
        .upstream_ca
        .as_ref()
        .map(|t| upstream_ca(t, base))
        .transpose()?;
    Ok(ServerConfig {
        listen,
        admin,
        trusted_proxies,
        grace_period: duration_or(
            raw.grace_period.as_ref(),
            "grace_period",
            defaults.grace_period,
        )?,
        max_waiters: raw
            .max_waiters
            .map_or(Ok(defaults.max_waiters), |n| usize_of(&n))?,
        max_keys: raw
            .max_keys
            .map_or(Ok(defaults.max_keys), |n| max_keys(&n))?,
        admin_token,
        tls,
        upstream_ca,
        log_keys: raw.log_keys.unwrap_or(defaults.log_keys),
        fast_path: raw.fast_path.unwrap_or(defaults.fast_path),
    })
}

/// A file named in the config; relative to the config file's directory.
fn file_path(t: &Text, field: &str, base: &Path) -> Checked<PathBuf> {
    let p = t.value.trim();
    if p.is_empty() {
        return Err(Invalid::new(
            at(t),
            format!("{field} is empty: give the path of a PEM file"),
        ));
    }
    Ok(base.join(p))
}

/// Reads both files now, so `tollgate check` refuses a missing or unusable certificate at its
/// line instead of the listener failing at start-up.
fn listener_tls(raw: Spanned<RawTls>, base: &Path) -> Checked<ListenerTls> {
    let tls_at = at(&raw);
    let raw = raw.value;
    let (Some(cert_t), Some(key_t)) = (raw.cert, raw.key) else {
        return Err(Invalid::new(
            tls_at,
            "tls needs both `cert: PATH` (PEM certificate chain, leaf first) and `key: PATH` (its PEM private key); remove `tls` to serve plain HTTP",
        ));
    };
    let cert = file_path(&cert_t, "tls.cert", base)?;
    let key = file_path(&key_t, "tls.key", base)?;
    let chain = crate::tls::load_certs(&cert)
        .map_err(|e| Invalid::new(at(&cert_t), format!("tls.cert: {e}")))?;
    let key_der = crate::tls::load_key(&key)
        .map_err(|e| Invalid::new(at(&key_t), format!("tls.key: {e}")))?;
    let server_config = crate::tls::server_config(chain, key_der)
        .map_err(|e| Invalid::new(at(&key_t), format!("tls.key: {e}")))?;
    Ok(ListenerTls {
        cert,
        key,
        server_config,
    })
}

fn upstream_ca(t: &Text, base: &Path) -> Checked<UpstreamCa> {
    let path = file_path(t, "upstream_ca", base)?;
    let certs = crate::tls::load_certs(&path)
        .and_then(|certs| crate::tls::check_roots(&certs).map(|()| certs))
        .map_err(|e| Invalid::new(at(t), format!("upstream_ca: {e}")))?;
    Ok(UpstreamCa { path, certs })
}

fn socket_addr(t: &Text, listener: Listener) -> Checked<SocketAddr> {
    listen_addr(&t.value, listener).ok_or_else(|| {
        Invalid::new(
            at(t),
            format!(
                "`{}` is not a listen address: write IP:PORT (0.0.0.0:8080, [::]:8080), :PORT or PORT (every interface), or localhost:PORT",
                t.value
            ),
        )
    })
}

/// Which listener an address is for: a port without a host means every interface for the
/// proxy, but loopback for the admin listener, whose default is loopback too (its endpoints
/// are not for the world unless an address says so).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    /// `server.listen` / `--listen`: a bare port means every IPv4 interface.
    Proxy,
    /// `server.admin` / `--admin`: a bare port means loopback.
    Admin,
}

/// A listener address as operators write it elsewhere: `IP:PORT`, `:PORT` or a bare `PORT`
/// (as nginx's `listen 8080` and Go's `:8080`: every IPv4 interface for the proxy, loopback for
/// the admin listener), or `localhost:PORT` (127.0.0.1). No other host name: a listener is not
/// worth a DNS lookup at load time.
pub fn listen_addr(text: &str, listener: Listener) -> Option<SocketAddr> {
    let s = text.trim();
    if let Ok(addr) = s.parse() {
        return Some(addr);
    }
    let (host, port) = s.rsplit_once(':').unwrap_or(("", s));
    if !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port: u16 = port.parse().ok()?;
    let ip = match host {
        "" if listener == Listener::Admin => std::net::Ipv4Addr::LOCALHOST,
        "" => std::net::Ipv4Addr::UNSPECIFIED,
        h if h.eq_ignore_ascii_case("localhost") => std::net::Ipv4Addr::LOCALHOST,
        _ => return None,
    };
    Some(SocketAddr::from((ip, port)))
}

/// A bare address is a one-host network: `10.0.0.7` is `10.0.0.7/32`.
pub(super) fn trusted_proxy(t: &Text) -> Checked<IpNet> {
    let s = t.value.trim();
    s.parse::<IpNet>()
        .map(|net| net.trunc())
        .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| {
            Invalid::new(
                at(t),
                format!(
                    "trusted_proxies: `{}` is not a CIDR or an IP address (e.g. 10.0.0.0/8, 192.168.1.10, fd00::/8)",
                    t.value
                ),
            )
        })
}

/// The token travels in `Authorization: Bearer TOKEN`, so it must be a valid
/// header value; an empty one would look set while protecting nothing.
fn admin_token(t: &Text) -> Checked<String> {
    if t.value.contains(super::types::REDACTED) {
        return Err(redacted(t));
    }
    if t.value.is_empty() || !t.value.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Invalid::new(
            at(t),
            "admin_token must be non-empty visible ASCII without spaces (it is sent as `Authorization: Bearer TOKEN`); remove it to leave /admin unauthenticated",
        ));
    }
    Ok(t.value.clone())
}

/// `/admin/config` shows secrets as a placeholder; a file saved from it must not load with the
/// placeholder as the secret (a token everyone knows, a Redis user named after it).
pub(super) fn redacted(t: &Text) -> Invalid {
    Invalid::new(
        at(t),
        format!(
            "`{}` is the placeholder /admin/config shows instead of a secret: put the real one back",
            super::types::REDACTED
        ),
    )
}

fn route(
    raw: Spanned<RawRoute>,
    has_redis: bool,
    shared: &[LimitConfig],
    seen: &mut HashMap<String, u64>,
    consumers: &mut Consumers<'_>,
    warnings: &mut Vec<Invalid>,
) -> Checked<RouteConfig> {
    let route_at = at(&raw);
    let raw = raw.value;
    let name = name(raw.name, route_at, seen, None)?;
    let matcher = match raw.matcher {
        Some(m) => route_match(m)?,
        None => RouteMatch {
            path: PathMatch::Prefix("/".to_owned()),
            host: None,
            methods: None,
        },
    };
    let Some(upstream) = raw.upstream else {
        return Err(Invalid::new(
            route_at,
            format!(
                "route `{name}` has no upstream: add `upstream: http://HOST:PORT` (or a list of them)"
            ),
        ));
    };
    let upstream_at = at(&upstream);
    let upstreams = items(upstream)
        .iter()
        .map(upstream_uri)
        .collect::<Checked<Vec<_>>>()?;
    if upstreams.is_empty() {
        return Err(Invalid::new(
            upstream_at,
            "upstream list is empty: give at least one http://HOST:PORT",
        ));
    }
    let mut limits = Vec::new();
    let mut seen_limits = HashMap::new();
    let mut delays = Vec::new();
    for raw_limit in raw.limits.unwrap_or_default() {
        let lc = if let Some(u) = raw_limit.value.use_.clone() {
            let lc = use_shared(raw_limit, &u, shared, &name, &mut seen_limits)?;
            (lc, at(&u))
        } else {
            let pos = raw_limit.value.on_limit.as_ref().map_or(at(&raw_limit), at);
            let lc = limit::limit(
                raw_limit,
                has_redis,
                &name,
                &mut seen_limits,
                consumers,
                warnings,
            )?;
            (lc, pos)
        };
        if lc.0.on_limit == OnLimit::Delay && !lc.0.shadow {
            delays.push((lc.0.name.clone(), lc.0.concurrency.is_some(), lc.1));
            one_wait(&delays)?;
        }
        limits.push(lc.0);
    }
    Ok(RouteConfig {
        name,
        matcher,
        upstreams,
        timeout: positive_duration_or(raw.timeout.as_ref(), "timeout", Duration::from_secs(30))?,
        preserve_host: raw.preserve_host.unwrap_or(true),
        headers: raw.headers.unwrap_or(true),
        limits,
        rejection: raw
            .rejection
            .map(|r| super::rejection::rejection(r, warnings))
            .transpose()?,
    })
}

/// A concurrency limit that queues for a slot (`on_limit: delay`) shares no route with another
/// delay limit: a request would wait in line for a slot, then for the time a rate limit
/// reserved, holding the slot meanwhile (or hold a reservation while in line), and neither
/// `max_delay` would bound the sum; and two slot lines would each hold a place the other
/// waits behind. Refused at the second of the two (`delays`: name, queues for a slot, where).
fn one_wait(delays: &[(String, bool, super::Pos)]) -> Checked<()> {
    let [.., (first, first_slots, _), (second, second_slots, pos)] = delays else {
        return Ok(());
    };
    if !first_slots && !second_slots {
        return Ok(());
    }
    let (slots, other) = if *second_slots {
        (second, first)
    } else {
        (first, second)
    };
    Err(Invalid::new(
        *pos,
        format!(
            "on_limit: delay on concurrency limit `{slots}` cannot share a route with another delay limit (`{other}`): a request would wait for a slot and for a reserved time in turn, holding one while it waits for the other, and no max_delay would bound the sum; use on_limit: reject on one of them"
        ),
    ))
}

/// `- use: NAME`: the top-level limit of that name, drawn on by this route. Alone in its entry:
/// a route that wants another rate defines a limit of its own.
fn use_shared(
    raw: Spanned<RawLimit>,
    u: &Text,
    shared: &[LimitConfig],
    route: &str,
    seen: &mut HashMap<String, u64>,
) -> Checked<LimitConfig> {
    let r = &raw.value;
    let others = [
        r.name.as_ref().map(|_| "name"),
        r.key.as_ref().map(|_| "key"),
        r.on_missing.as_ref().map(|_| "on_missing"),
        r.algorithm.as_ref().map(|_| "algorithm"),
        r.rate.as_ref().map(|_| "rate"),
        r.burst.as_ref().map(|_| "burst"),
        r.scope.as_ref().map(|_| "scope"),
        r.cost.as_ref().map(|_| "cost"),
        r.on_limit.as_ref().map(|_| "on_limit"),
        r.max_delay.as_ref().map(|_| "max_delay"),
        r.shadow.as_ref().map(|_| "shadow"),
        r.consistency.as_ref().map(|_| "consistency"),
        r.sync_interval.as_ref().map(|_| "sync_interval"),
        r.overrides.as_ref().map(|_| "overrides"),
        r.overrides_file.as_ref().map(|_| "overrides_file"),
    ];
    if let Some(field) = others.into_iter().flatten().next() {
        return Err(Invalid::new(
            at(&raw),
            format!(
                "`use: {}` takes no other field (this entry also has `{field}`): the shared limit is defined once in the top-level `limits:`",
                u.value
            ),
        ));
    }
    let wanted = u.value.trim();
    let Some(def) = shared.iter().find(|l| l.name == wanted) else {
        let known = if shared.is_empty() {
            "the config has no top-level `limits:`".to_owned()
        } else {
            format!(
                "top-level limits: {}",
                shared
                    .iter()
                    .map(|l| l.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        return Err(Invalid::new(
            at(u),
            format!("`{wanted}` is not a top-level limit ({known})"),
        ));
    };
    let name_text = Spanned::new(def.name.clone(), u.referenced, u.defined);
    name(Some(name_text), at(u), seen, Some(route))?;
    let mut limit = def.clone();
    limit.shared = true;
    Ok(limit)
}

fn route_match(raw: RawMatch) -> Checked<RouteMatch> {
    let path = match (raw.path, raw.path_prefix) {
        (Some(_), Some(prefix)) => {
            return Err(Invalid::new(
                at(&prefix),
                "match has both `path` and `path_prefix`: use `path` for one exact path or `path_prefix` for a subtree",
            ));
        }
        (Some(exact), None) => PathMatch::Exact(match_path(&exact, "path")?.to_owned()),
        (None, Some(prefix)) => {
            let p = match_path(&prefix, "path_prefix")?.trim_end_matches('/');
            PathMatch::Prefix(if p.is_empty() { "/" } else { p }.to_owned())
        }
        (None, None) => PathMatch::Prefix("/".to_owned()),
    };
    let host = raw.host.as_ref().map(match_host).transpose()?;
    let methods = match raw.methods {
        Some(list) => {
            let list_at = at(&list);
            let methods = items(list)
                .iter()
                .map(method)
                .collect::<Checked<Vec<_>>>()?;
            if methods.is_empty() {
                return Err(Invalid::new(
                    list_at,
                    "methods is empty and would match nothing: list methods, or remove `methods` to match all",
                ));
            }
            Some(methods)
        }
        None => None,
    };
    Ok(RouteMatch {
        path,
        host,
        methods,
    })
}

fn match_path<'a>(t: &'a Text, field: &str) -> Checked<&'a str> {
    let p = t.value.trim();
    if !p.starts_with('/') {
        return Err(Invalid::new(
            at(t),
            format!("{field} `{p}` must start with `/`"),
        ));
    }
    if p.contains(['?', '#']) {
        return Err(Invalid::new(
            at(t),
            format!(
                "{field} `{p}` contains `?` or `#`: routes match the path only, without query or fragment"
            ),
        ));
    }
    Ok(p)
}

/// Stored lowercase and portless: the matcher compares it with the request's
/// host the same way, whatever port the client dialled.
fn match_host(t: &Text) -> Checked<String> {
    let h = t.value.trim();
    let bad = |why: &str| Invalid::new(at(t), format!("host `{h}` {why}"));
    if h.contains('*') {
        return Err(bad(
            "has a wildcard: hosts match exactly (one route per host)",
        ));
    }
    let authority: http::uri::Authority = h
        .parse()
        .map_err(|_| bad("is not a host name: write e.g. api.example.com"))?;
    if authority.as_str().contains('@') {
        return Err(bad("contains `@`: write only the host name"));
    }
    if authority.port().is_some() || authority.host().len() != authority.as_str().len() {
        return Err(bad(
            "has a port: hosts match without their port, write only the host name",
        ));
    }
    // `api.example.com.` is the same host (routing compares requests' hosts without it too).
    let host = authority.host();
    Ok(host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase())
}

fn method(t: &Text) -> Checked<http::Method> {
    let m = t.value.trim().to_ascii_uppercase();
    http::Method::from_bytes(m.as_bytes()).map_err(|_| {
        Invalid::new(
            at(t),
            format!(
                "`{}` is not an HTTP method (e.g. GET, POST, PUT, DELETE)",
                t.value
            ),
        )
    })
}

/// http or https, with a host, a valid port, no credentials and no query:
/// anything else would be dropped or misread silently when forwarding.
fn upstream_uri(t: &Text) -> Checked<http::Uri> {
    let s = t.value.trim();
    let bad = |why: String| Invalid::new(at(t), format!("upstream `{s}` {why}"));
    if s.contains('#') {
        return Err(bad("has a fragment (`#...`): remove it".to_owned()));
    }
    let uri: http::Uri = s.parse().map_err(|e| {
        bad(format!(
            "is not a valid URL ({e}): write http://HOST:PORT or https://HOST"
        ))
    })?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(bad(format!(
                "has scheme {other}: only http and https are supported"
            )));
        }
        None => {
            return Err(bad(
                "has no scheme: write http://... or https://...".to_owned()
            ));
        }
    }
    let Some(authority) = uri.authority().filter(|a| !a.host().is_empty()) else {
        return Err(bad("has no host: write http://HOST:PORT".to_owned()));
    };
    if authority.as_str().contains('@') {
        return Err(bad(
            "contains credentials (`user@`): they are not forwarded; remove them".to_owned(),
        ));
    }
    if let Some(port) = authority.as_str()[authority.host().len()..].strip_prefix(':')
        && !matches!(port.parse::<u16>(), Ok(1..))
    {
        return Err(bad(format!("has an invalid port `{port}`: use 1 to 65535")));
    }
    if uri.query().is_some() {
        return Err(bad(
            "has a query (`?...`): the client's query is forwarded as is; remove it".to_owned(),
        ));
    }
    Ok(uri)
}

// ---- helpers shared with limit.rs ----

/// Where a value was used (for an alias, the alias, not the anchor).
pub(super) fn at<T>(s: &Spanned<T>) -> Pos {
    Pos::of(s.referenced)
}

const TOP: Pos = Pos { line: 1, column: 1 };

pub(super) fn items(list: Spanned<OneOrMany>) -> Vec<Text> {
    list.value.items(list.referenced)
}

/// Checks a route's or a limit's name where it is written, before the rest of
/// its block, so a duplicate is reported at the duplicate. Names end up in
/// metric labels and Redis keys, hence the small alphabet. `route` is the
/// enclosing route's name when checking a limit.
pub(super) fn name(
    raw: Option<Text>,
    owner_at: Pos,
    seen: &mut HashMap<String, u64>,
    route: Option<&str>,
) -> Checked<String> {
    let owner = if route.is_some() { "limit" } else { "route" };
    let Some(t) = raw else {
        return Err(Invalid::new(
            owner_at,
            format!("this {owner} has no `name`: every {owner} needs one"),
        ));
    };
    let ok = !t.value.is_empty()
        && t.value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if !ok {
        return Err(Invalid::new(
            at(&t),
            format!(
                "{owner} name `{}` may only contain letters, digits, `_`, `.` and `-` (it goes into metric labels and Redis keys)",
                t.value
            ),
        ));
    }
    let name_at = at(&t);
    if let Some(first) = seen.insert(t.value.clone(), name_at.line) {
        let (within, unique) = match route {
            Some("") => (" in the top-level `limits`".to_owned(), ""),
            Some(route) => (format!(" in route `{route}`"), " within a route"),
            None => (String::new(), ""),
        };
        return Err(Invalid::new(
            name_at,
            format!(
                "duplicate {owner} name `{}`{within} (first used at line {first}): {owner} names must be unique{unique}",
                t.value
            ),
        ));
    }
    Ok(t.value)
}

pub(super) fn keyword<T: Copy>(t: &Text, field: &str, choices: &[(&str, T)]) -> Checked<T> {
    let v = t.value.trim();
    choices
        .iter()
        .find(|(word, _)| *word == v)
        .map(|(_, value)| *value)
        .ok_or_else(|| {
            let allowed: Vec<&str> = choices.iter().map(|(word, _)| *word).collect();
            Invalid::new(
                at(t),
                format!("`{v}` is not a valid {field}: use {}", allowed.join(" | ")),
            )
        })
}

pub(super) fn duration_or(t: Option<&Text>, field: &str, default: Duration) -> Checked<Duration> {
    match t {
        Some(t) => {
            parse_duration(&t.value).map_err(|e| Invalid::new(at(t), format!("{field}: {e}")))
        }
        None => Ok(default),
    }
}

pub(super) fn positive_duration_or(
    t: Option<&Text>,
    field: &str,
    default: Duration,
) -> Checked<Duration> {
    let d = duration_or(t, field, default)?;
    match t {
        Some(t) if d.is_zero() => Err(Invalid::new(
            at(t),
            format!("{field} must be longer than 0"),
        )),
        _ => Ok(d),
    }
}

/// `server.max_keys`: a whole number of keys, at least [`MIN_MAX_KEYS`](crate::limit::budget::MIN_MAX_KEYS).
fn max_keys(n: &Spanned<u64>) -> Checked<usize> {
    let min = crate::limit::budget::MIN_MAX_KEYS;
    let keys = usize_of(n)?;
    if keys < min {
        return Err(Invalid::new(
            at(n),
            format!(
                "max_keys {keys} is too small: give at least {min} (the keys all in-process limit stores hold together; about {} bytes each), or leave it out for a default from the machine's memory",
                crate::limit::budget::BYTES_PER_KEY
            ),
        ));
    }
    Ok(keys)
}

pub(super) fn usize_of(n: &Spanned<u64>) -> Checked<usize> {
    usize::try_from(n.value).map_err(|_| Invalid::new(at(n), format!("{} is too large", n.value)))
}

/// Whether the two listeners would bind one port (port 0 is any free port, never the same).
/// A wildcard covers its own family, and `[::]` both (Linux binds it dual-stack): `0.0.0.0`
/// and `[::1]` on one port bind side by side.
pub fn same_port(listen: std::net::SocketAddr, admin: std::net::SocketAddr) -> bool {
    let covers = |wild: std::net::SocketAddr, other: std::net::SocketAddr| {
        wild.ip().is_unspecified() && (wild.is_ipv6() || other.is_ipv4())
    };
    listen.port() == admin.port()
        && listen.port() != 0
        && (listen.ip() == admin.ip() || covers(listen, admin) || covers(admin, listen))
}

#[cfg(test)]
mod same_port_tests {
    use super::same_port;

    #[test]
    fn a_wildcard_covers_its_family_and_the_v6_one_both() {
        let at = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
        for (l, a, same) in [
            ("127.0.0.1:80", "127.0.0.1:80", true),
            ("127.0.0.1:80", "127.0.0.2:80", false),
            ("127.0.0.1:80", "127.0.0.1:81", false),
            ("127.0.0.1:0", "127.0.0.1:0", false),
            ("0.0.0.0:80", "127.0.0.1:80", true),
            ("0.0.0.0:80", "[::1]:80", false),
            ("[::]:80", "127.0.0.1:80", true),
            ("[::]:80", "[::1]:80", true),
            ("[::1]:80", "127.0.0.1:80", false),
            ("0.0.0.0:80", "[::]:80", true),
        ] {
            assert_eq!(same_port(at(l), at(a)), same, "{l} {a}");
            assert_eq!(same_port(at(a), at(l)), same, "{a} {l}");
        }
    }
}
