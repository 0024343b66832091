//! A route's `rejection:`: what a rate-limited request gets instead of the default 429, and the
//! body template it is written from.
//!
//! The template is compiled here, once per config, into literal and placeholder pieces: the
//! reject path only walks the pieces (`proxy::error` fills them in), it never parses text, so
//! a flood of rejected requests costs what the default answer costs plus the copies. An
//! unknown placeholder is refused at load, where its line and column can be given, rather than
//! sent to clients as written.

use serde::{Serialize, Serializer};
use serde_saphyr::Spanned;

use super::Invalid;
use super::raw::RawRejection;
use super::validate::{Checked, at};

/// The default body, as a template: the body tollgate's own 429 has.
const DEFAULT_BODY: &str = r#"{"error":"rate_limited","route":"{route}","limit":"{limit}","retry_after_ms":{retry_after_ms}}"#;

/// A route's `rejection:` section, validated.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RejectionConfig {
    /// Any 4xx or 5xx; default 429. A 503 tells some clients (and their retry libraries) to
    /// back off the same way, which is why operators pick it.
    #[serde(serialize_with = "serialize_status")]
    pub status: http::StatusCode,
    /// The answer's `Content-Type`; default `application/json`. A JSON type (`application/json`
    /// or `+json`) makes the body's placeholders JSON-escaped.
    #[serde(serialize_with = "serialize_field_value")]
    pub content_type: http::HeaderValue,
    /// The body; default the body of tollgate's own 429.
    pub body: Template,
    /// `X-RateLimit-Limit`, `-Remaining` and `-Reset` beside the IETF fields, on 429s and on
    /// admitted responses, for clients written against the older, unstandardised fields.
    pub legacy_headers: bool,
}

fn serialize_field_value<S: Serializer>(v: &http::HeaderValue, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.to_str().unwrap_or(""))
}

fn serialize_status<S: Serializer>(status: &http::StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}

/// One piece of a compiled [`Template`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text written as it is (`{{` and `}}` already turned into `{` and `}`).
    Text(Box<str>),
    /// `{route}`: the route's name.
    Route,
    /// `{limit}`: the name of the limit that rejected.
    Limit,
    /// `{retry_after}`: whole seconds, rounded up, as `Retry-After` says.
    RetryAfter,
    /// `{retry_after_ms}`: milliseconds, rounded up.
    RetryAfterMs,
}

/// A body template compiled into [`Piece`]s. `{name}` is a placeholder when `name` is made of
/// letters, digits, `_`, `-` and `.`; any other `{` (as in a JSON object's) is text, and `{{`
/// and `}}` write one brace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    source: String,
    pieces: Box<[Piece]>,
    json: bool,
}

/// Why a template does not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// `{name}` names no value tollgate fills in.
    #[error(
        "unknown placeholder `{{{0}}}` in the body: use {{route}}, {{limit}}, {{retry_after}} or {{retry_after_ms}} (write {{{{ and }}}} for literal braces)"
    )]
    UnknownPlaceholder(String),
}

impl Template {
    /// Compiles `source`; `json`: placeholders are JSON-escaped when rendered.
    pub fn compile(source: &str, json: bool) -> Result<Self, TemplateError> {
        let mut pieces = Vec::new();
        let mut text = String::new();
        let mut rest = source;
        while let Some(i) = rest.find(['{', '}']) {
            text.push_str(&rest[..i]);
            let after = &rest[i + 1..];
            let brace = rest.as_bytes()[i];
            if after.as_bytes().first() == Some(&brace) {
                // `{{` or `}}`: one literal brace.
                text.push(char::from(brace));
                rest = &after[1..];
                continue;
            }
            let name_len = after
                .bytes()
                .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
                .count();
            if brace == b'{' && name_len > 0 && after.as_bytes().get(name_len) == Some(&b'}') {
                let piece = match &after[..name_len] {
                    "route" => Piece::Route,
                    "limit" => Piece::Limit,
                    "retry_after" => Piece::RetryAfter,
                    "retry_after_ms" => Piece::RetryAfterMs,
                    other => return Err(TemplateError::UnknownPlaceholder(other.to_owned())),
                };
                if !text.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut text).into()));
                }
                pieces.push(piece);
                rest = &after[name_len + 1..];
            } else {
                // A brace that opens no placeholder (a JSON object's) is text.
                text.push(char::from(brace));
                rest = after;
            }
        }
        text.push_str(rest);
        if !text.is_empty() {
            pieces.push(Piece::Text(text.into()));
        }
        Ok(Self {
            source: source.to_owned(),
            pieces: pieces.into(),
            json,
        })
    }

    /// The pieces, in order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// Placeholders are JSON-escaped (the body's content type is JSON).
    pub fn json(&self) -> bool {
        self.json
    }

    /// The template as the config wrote it.
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// As the config wrote it, so `/admin/config` shows what the file says.
impl Serialize for Template {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.source)
    }
}

/// `application/json`, or a `+json` type (`application/problem+json`), parameters aside.
pub(super) fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json" || essence.ends_with("+json")
}

pub(super) fn rejection(
    raw: Spanned<RawRejection>,
    warnings: &mut Vec<Invalid>,
) -> Checked<RejectionConfig> {
    let raw = raw.value;
    let status = match raw.status {
        None => http::StatusCode::TOO_MANY_REQUESTS,
        Some(s) => match u16::try_from(s.value) {
            Ok(code @ 400..=599) => http::StatusCode::from_u16(code)
                .map_err(|_| Invalid::new(at(&s), "not an HTTP status"))?,
            _ => {
                return Err(Invalid::new(
                    at(&s),
                    format!(
                        "rejection status {} is not a 4xx or 5xx: a rejected request must not look served (use e.g. 429 or 503)",
                        s.value
                    ),
                ));
            }
        },
    };
    let content_type = match &raw.content_type {
        None => http::HeaderValue::from_static("application/json"),
        Some(t) => {
            let v = t.value.trim();
            match http::HeaderValue::from_str(v) {
                Ok(h) if !v.is_empty() => h,
                _ => {
                    return Err(Invalid::new(
                        at(t),
                        format!(
                            "content_type `{v}` is not a field value: give a media type such as application/json or text/plain"
                        ),
                    ));
                }
            }
        }
    };
    let json = is_json(content_type.to_str().unwrap_or(""));
    let body = match &raw.body {
        None => Template::compile(DEFAULT_BODY, true).expect("the default body compiles"),
        Some(t) => {
            let template = Template::compile(&t.value, json)
                .map_err(|e| Invalid::new(at(t), e.to_string()))?;
            if json && !renders_json(&template) {
                warnings.push(Invalid::new(
                    at(t),
                    "warning: content_type is JSON but the body is not JSON once filled in (a placeholder in a JSON string needs its quotes; a literal } after a placeholder is written }})",
                ));
            }
            template
        }
    };
    Ok(RejectionConfig {
        status,
        content_type,
        body,
        legacy_headers: raw.legacy_headers.unwrap_or(false),
    })
}

/// The template filled with sample values parses as JSON: a check at load for what a client
/// would otherwise find out.
fn renders_json(t: &Template) -> bool {
    let mut s = String::new();
    for p in t.pieces() {
        match p {
            Piece::Text(text) => s.push_str(text),
            Piece::Route | Piece::Limit => s.push('x'),
            Piece::RetryAfter | Piece::RetryAfterMs => s.push('1'),
        }
    }
    serde_json::from_str::<serde::de::IgnoredAny>(&s).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(source: &str) -> Vec<Piece> {
        Template::compile(source, true).unwrap().pieces().to_vec()
    }

    fn text(s: &str) -> Piece {
        Piece::Text(s.into())
    }

    #[test]
    fn placeholders_and_text_compile_to_pieces() {
        assert_eq!(
            pieces(r#"{"message":"slow down","retry_after":{retry_after}}"#),
            [
                text(r#"{"message":"slow down","retry_after":"#),
                Piece::RetryAfter,
                text("}"),
            ]
        );
        assert_eq!(
            pieces("{route}{limit}/{retry_after_ms}"),
            [Piece::Route, Piece::Limit, text("/"), Piece::RetryAfterMs]
        );
        assert_eq!(pieces(""), []);
        assert_eq!(pieces("plain"), [text("plain")]);
    }

    #[test]
    fn doubled_braces_are_literal_braces() {
        assert_eq!(pieces("{{route}}"), [text("{route}")]);
        assert_eq!(
            pieces("a {{ {limit} }} b"),
            [text("a { "), Piece::Limit, text(" } b")]
        );
        assert_eq!(pieces("{retry_after}}}"), [Piece::RetryAfter, text("}")]);
        // Braces that open no placeholder stay as they are.
        assert_eq!(pieces("{ } {} {\"a\"} }"), [text("{ } {} {\"a\"} }")]);
    }

    #[test]
    fn unknown_placeholders_are_refused() {
        for (source, name) in [
            ("{retry-after}", "retry-after"),
            ("{ROUTE}", "ROUTE"),
            (r#"{"a":{status}}"#, "status"),
            ("x{limit.name}", "limit.name"),
        ] {
            assert_eq!(
                Template::compile(source, false),
                Err(TemplateError::UnknownPlaceholder(name.into())),
                "{source}"
            );
        }
    }

    #[test]
    fn json_content_types() {
        for t in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/problem+json",
        ] {
            assert!(is_json(t), "{t}");
        }
        for t in ["text/plain", "application/jsonp", "text/json-ish"] {
            assert!(!is_json(t), "{t}");
        }
    }

    #[test]
    fn the_default_body_is_json() {
        let t = Template::compile(DEFAULT_BODY, true).unwrap();
        assert!(renders_json(&t));
        assert!(!renders_json(
            &Template::compile(r#"{"a":{"b":{retry_after}}}"#, true).unwrap()
        ));
    }
}
