//! The route table: first match in file order, compiled once per config.
//!
//! Prefixes match whole path segments (`/api` matches `/api` and `/api/x`, not `/apix`), hosts
//! compare case-insensitively without the port, and methods are a small set. Nothing is parsed
//! or allocated per request.

use http::{Method, Uri};

use crate::config::{PathMatch, RouteMatch};

#[derive(Clone, Debug)]
struct Matcher {
    path: PathMatch,
    host: Option<String>,
    methods: Option<Vec<Method>>,
}

impl Matcher {
    fn matches(&self, method: &Method, host: Option<&[u8]>, path: &str) -> bool {
        let path_ok = match &self.path {
            PathMatch::Exact(p) => path == p,
            PathMatch::Prefix(p) => {
                p == "/"
                    || (path.starts_with(p.as_str())
                        && matches!(path.as_bytes().get(p.len()), None | Some(b'/')))
            }
        };
        path_ok
            && self.host.as_deref().is_none_or(|want| {
                host.is_some_and(|h| bare_host(h).eq_ignore_ascii_case(want.as_bytes()))
            })
            && self
                .methods
                .as_ref()
                .is_none_or(|ms| ms.iter().any(|m| m == method))
    }
}

/// The host a `host:` match compares: without the port, and without the trailing dot of a
/// fully qualified name (`api.example.com.:443` is `api.example.com`, as DNS and nginx's
/// `server_name` read it). Bytes, not text: the fast path would otherwise check every request's
/// `Host` for UTF-8 to route it, though most tables have no `host:` match to compare it with.
fn bare_host(host: &[u8]) -> &[u8] {
    let h = strip_port(host);
    h.strip_suffix(b".").unwrap_or(h)
}

/// `host:port` → `host`, keeping IPv6 literals (`[::1]:80` → `[::1]`).
fn strip_port(host: &[u8]) -> &[u8] {
    if host.starts_with(b"[") {
        return host
            .iter()
            .position(|&b| b == b']')
            .map_or(host, |i| &host[..=i]);
    }
    host.iter()
        .rposition(|&b| b == b':')
        .map_or(host, |i| &host[..i])
}

#[derive(Clone, Debug, Default)]
pub struct RouteTable {
    matchers: Vec<Matcher>,
}

impl RouteTable {
    pub fn new<'a>(routes: impl IntoIterator<Item = &'a RouteMatch>) -> Self {
        Self {
            matchers: routes
                .into_iter()
                .map(|m| Matcher {
                    path: m.path.clone(),
                    host: m.host.clone(),
                    methods: m.methods.clone(),
                })
                .collect(),
        }
    }

    /// Index of the first route whose match holds.
    pub fn find(&self, method: &Method, host: Option<&[u8]>, path: &str) -> Option<usize> {
        self.matchers
            .iter()
            .position(|m| m.matches(method, host, path))
    }
}

/// The request target with percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`)
/// decoded and every other escape's hex digits upper-cased (RFC 3986 §6.2.2.1–2); `None` when the
/// path is already normal. Routing, keys, the dot-segment check and the upstream all see this one
/// spelling: otherwise `/%6Cogin` would miss the `/login` route (and its limits) and still reach
/// `/login` at an upstream that decodes it. Reserved characters stay encoded (`%2F` is not `/`).
pub(crate) fn normalize_path(uri: &Uri) -> Option<Uri> {
    let path = uri.path();
    if !path.contains('%') {
        return None;
    }
    let bytes = path.as_bytes();
    // Bytes, not chars: a path may hold bytes above 0x7f (`http::Uri` takes them), which go on
    // as they came rather than as the two-byte UTF-8 of their Latin-1 reading.
    let mut out = Vec::with_capacity(path.len() + uri.query().map_or(0, |q| q.len() + 1));
    let mut changed = false;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let (Some(h), Some(l)) = (
                bytes.get(i + 1).and_then(|c| hex_value(*c)),
                bytes.get(i + 2).and_then(|c| hex_value(*c)),
            )
        {
            let decoded = h << 4 | l;
            if decoded.is_ascii_alphanumeric() || b"-._~".contains(&decoded) {
                out.push(decoded);
                changed = true;
            } else {
                let upper = [
                    b'%',
                    bytes[i + 1].to_ascii_uppercase(),
                    bytes[i + 2].to_ascii_uppercase(),
                ];
                changed |= upper[1] != bytes[i + 1] || upper[2] != bytes[i + 2];
                out.extend_from_slice(&upper);
            }
            i += 3;
            continue;
        }
        if bytes[i] == b'%' {
            // A `%` that does not start an escape: left as it came, for `path_problem` to
            // refuse. Passed on, it could start one with what follows it decoded (`%%36C` is
            // `%6C`, which the upstream reads as `l`), a path routing never saw.
            return None;
        }
        out.push(bytes[i]);
        i += 1;
    }
    if !changed {
        return None;
    }
    if let Some(q) = uri.query() {
        out.push(b'?');
        out.extend_from_slice(q.as_bytes());
    }
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(http::uri::PathAndQuery::try_from(out).ok()?);
    Uri::from_parts(parts).ok()
}

/// One hex digit's value (percent-encoding, here and in `key`).
pub(crate) fn hex_value(c: u8) -> Option<u8> {
    char::from(c).to_digit(16).map(|d| d as u8)
}

/// Why a request path is refused with 400, if it is: a dot segment, a `%` that does not start
/// an escape, or an escaped NUL. The first could match one route's prefix and reach another
/// path upstream after normalisation; the others are not a path any upstream can mean the same
/// way as tollgate (nginx refuses them too).
pub(crate) fn path_problem(path: &str) -> Option<&'static str> {
    // Most paths have neither: one pass over the bytes answers for them.
    if !path.bytes().any(|b| b == b'.' || b == b'%') {
        return None;
    }
    if has_dot_segment(path) {
        return Some("dot segments are not allowed in the path");
    }
    if path.contains('%') {
        let b = path.as_bytes();
        for (i, _) in path.match_indices('%') {
            match (b.get(i + 1), b.get(i + 2)) {
                (Some(&h), Some(&l)) if h.is_ascii_hexdigit() && l.is_ascii_hexdigit() => {
                    if h == b'0' && l == b'0' {
                        return Some("the path has an escaped NUL (%00)");
                    }
                }
                _ => return Some("the path has a % that does not start an escape (%XX)"),
            }
        }
    }
    None
}

/// Paths with dot segments (plain or percent-encoded) could match one route's prefix and reach
/// another path upstream after normalisation; they are refused with 400 instead of guessed at.
fn has_dot_segment(path: &str) -> bool {
    // Cheap on the request path: segments are only looked at when they are short enough to be
    // one or two dots, written plainly or as `%2e` / `%2E`.
    path.split('/').any(|seg| {
        let s = seg.as_bytes();
        s.len() <= 6 && {
            let mut rest = s;
            let mut dots = 0;
            while !rest.is_empty() {
                if rest[0] == b'.' {
                    rest = &rest[1..];
                } else if rest.len() >= 3
                    && rest[0] == b'%'
                    && rest[1] == b'2'
                    && (rest[2] | 0x20) == b'e'
                {
                    rest = &rest[3..];
                } else {
                    return false;
                }
                dots += 1;
            }
            dots == 1 || dots == 2
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rm(path: PathMatch, host: Option<&str>, methods: Option<Vec<Method>>) -> RouteMatch {
        RouteMatch {
            path,
            host: host.map(str::to_owned),
            methods,
        }
    }

    #[test]
    fn prefix_matches_whole_segments_only() {
        let t = RouteTable::new(&[rm(PathMatch::Prefix("/api".into()), None, None)]);
        assert_eq!(t.find(&Method::GET, None, "/api"), Some(0));
        assert_eq!(t.find(&Method::GET, None, "/api/"), Some(0));
        assert_eq!(t.find(&Method::GET, None, "/api/x/y"), Some(0));
        assert_eq!(t.find(&Method::GET, None, "/apix"), None);
        assert_eq!(t.find(&Method::GET, None, "/"), None);
    }

    #[test]
    fn first_match_in_file_order_with_host_and_methods() {
        let t = RouteTable::new(&[
            rm(
                PathMatch::Exact("/login".into()),
                None,
                Some(vec![Method::POST]),
            ),
            rm(PathMatch::Prefix("/".into()), Some("api.example.com"), None),
            rm(PathMatch::Prefix("/".into()), None, None),
        ]);
        assert_eq!(t.find(&Method::POST, None, "/login"), Some(0));
        assert_eq!(t.find(&Method::GET, None, "/login"), Some(2));
        assert_eq!(
            t.find(&Method::GET, Some(&b"API.example.com:8080"[..]), "/login"),
            Some(1)
        );
        assert_eq!(t.find(&Method::GET, Some(&b"other"[..]), "/x"), Some(2));
        // An IPv6 literal keeps its colons; only the port goes.
        assert_eq!(bare_host(b"[::1]:80"), b"[::1]");
        assert_eq!(bare_host(b"[::1]"), b"[::1]");
        assert_eq!(bare_host(b"h.example.:80"), b"h.example");
        // A fully qualified name's trailing dot is the same host.
        for fqdn in ["api.example.com.", "api.example.com.:443"] {
            assert_eq!(
                t.find(&Method::GET, Some(fqdn.as_bytes()), "/x"),
                Some(1),
                "{fqdn}"
            );
        }
        assert_eq!(t.find(&Method::POST, None, "/login/x"), Some(2));
    }

    #[test]
    fn dot_segments_are_detected() {
        assert_eq!(path_problem("/api/%41%2F%7e"), None);
        assert!(
            path_problem("/api/%zz")
                .unwrap()
                .contains("does not start an escape")
        );
        assert!(path_problem("/api/%4").is_some());
        assert!(path_problem("/api/%").is_some());
        assert!(path_problem("/api/a%00b").unwrap().contains("NUL"));
        assert!(
            path_problem("/api/%2e%2E/x")
                .unwrap()
                .contains("dot segments")
        );
        assert!(has_dot_segment("/api/../admin"));
        assert!(has_dot_segment("/api/%2E%2e/admin"));
        assert!(has_dot_segment("/."));
        assert!(!has_dot_segment("/api/..x/a.b"));
    }

    #[test]
    fn unreserved_escapes_are_decoded_and_others_upper_cased() {
        let n = |u: &str| normalize_path(&u.parse::<Uri>().unwrap()).map(|u| u.to_string());
        assert_eq!(n("/%6cogin").as_deref(), Some("/login"));
        assert_eq!(n("/l%6Fgin/%7Ex?a=%6c").as_deref(), Some("/login/~x?a=%6c"));
        assert_eq!(n("/a%2fb").as_deref(), Some("/a%2Fb"));
        assert_eq!(n("/%2E%2e/x").as_deref(), Some("/../x"));
        assert_eq!(n("/a%2Fb"), None);
        assert_eq!(n("/plain?q=%6c"), None);
        assert_eq!(n("/bad%zz%4"), None);
        assert_eq!(n("http://h:1/%61?x=1").as_deref(), Some("http://h:1/a?x=1"));
    }

    /// Found by fuzzing (fuzz/regressions/path/stray-percent-makes-an-escape): a `%` that
    /// starts no escape, followed by an escape that decodes to a hex digit, made a new escape
    /// that `path_problem` took and routing never decoded: `/%%36Cogin` as `/%6Cogin`, which an
    /// upstream reads as `/login`, past the `/login` route and its limits.
    #[test]
    fn a_stray_percent_is_left_for_path_problem_to_refuse() {
        for raw in [
            "/%%36Cogin",
            "/%%34%31",
            "/a%",
            "/%6C%zz",
            "/LLLLLLLLLLLLLf%%4%41",
        ] {
            let uri: Uri = raw.parse().unwrap();
            assert_eq!(normalize_path(&uri), None, "{raw}");
            assert!(path_problem(uri.path()).is_some(), "{raw}");
        }
    }

    /// Found by fuzzing (fuzz/regressions/path/): bytes above 0x7f in a path with an escape
    /// came out as the UTF-8 of their Latin-1 reading (0xD1 as C3 91), a different path.
    #[test]
    fn bytes_above_ascii_go_on_as_they_came() {
        let raw = &b"/%6cogin/\xd1\xa5%2f??q="[..];
        let uri = Uri::try_from(raw).unwrap();
        let n = normalize_path(&uri).unwrap();
        assert_eq!(n.path().as_bytes(), b"/login/\xd1\xa5%2F");
        assert_eq!(n.query(), Some("?q="));
    }

    /// Against the plain definition (decode `%2e` either case, compare with `.` and `..`) for
    /// every segment of up to seven characters over the bytes that matter.
    #[test]
    fn dot_segment_detection_matches_its_definition() {
        fn reference(path: &str) -> bool {
            path.split('/').any(|seg| {
                let d = seg.replace("%2e", ".").replace("%2E", ".");
                d == "." || d == ".."
            })
        }
        let alphabet = ['.', '%', '2', 'e', 'E', 'x'];
        let mut segs = vec![String::new()];
        for _ in 0..7 {
            let next: Vec<String> = segs
                .iter()
                .flat_map(|s| alphabet.iter().map(move |c| format!("{s}{c}")))
                .collect();
            for seg in &next {
                let path = format!("/a/{seg}/b");
                assert_eq!(has_dot_segment(&path), reference(&path), "{path}");
            }
            segs = next;
        }
    }
}
