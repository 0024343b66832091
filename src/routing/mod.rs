//! The route table: first match in file order, compiled once per config.
//!
//! Prefixes match whole path segments (`/api` matches `/api` and `/api/x`, not `/apix`), hosts
//! compare case-insensitively without the port, and methods are a small set. Nothing is parsed
//! or allocated per request.

use http::Method;

use crate::config::{PathMatch, RouteMatch};

#[derive(Clone, Debug)]
struct Matcher {
    path: PathMatch,
    host: Option<String>,
    methods: Option<Vec<Method>>,
}

impl Matcher {
    fn matches(&self, method: &Method, host: Option<&str>, path: &str) -> bool {
        let path_ok = match &self.path {
            PathMatch::Exact(p) => path == p,
            PathMatch::Prefix(p) => {
                p == "/"
                    || (path.starts_with(p.as_str())
                        && matches!(path.as_bytes().get(p.len()), None | Some(b'/')))
            }
        };
        path_ok
            && self
                .host
                .as_deref()
                .is_none_or(|want| host.is_some_and(|h| strip_port(h).eq_ignore_ascii_case(want)))
            && self
                .methods
                .as_ref()
                .is_none_or(|ms| ms.iter().any(|m| m == method))
    }
}

/// `host:port` → `host`, keeping IPv6 literals (`[::1]:80` → `[::1]`).
fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.find(']').map_or(host, |i| &host[..=i]);
    }
    host.rsplit_once(':').map_or(host, |(h, _)| h)
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
    pub fn find(&self, method: &Method, host: Option<&str>, path: &str) -> Option<usize> {
        self.matchers
            .iter()
            .position(|m| m.matches(method, host, path))
    }
}

/// Paths with dot segments (plain or percent-encoded) could match one route's prefix and reach
/// another path upstream after normalisation; they are refused with 400 instead of guessed at.
pub fn has_dot_segment(path: &str) -> bool {
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
            t.find(&Method::GET, Some("API.example.com:8080"), "/login"),
            Some(1)
        );
        assert_eq!(t.find(&Method::GET, Some("other"), "/x"), Some(2));
        assert_eq!(t.find(&Method::POST, None, "/login/x"), Some(2));
    }

    #[test]
    fn dot_segments_are_detected() {
        assert!(has_dot_segment("/api/../admin"));
        assert!(has_dot_segment("/api/%2E%2e/admin"));
        assert!(has_dot_segment("/."));
        assert!(!has_dot_segment("/api/..x/a.b"));
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
