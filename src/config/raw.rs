//! The YAML as written, before any meaning is given to it.
//!
//! Every struct refuses unknown keys, so a misspelt field is an error and not a
//! silently ignored default. Values that need checking beyond their YAML type
//! are kept as text inside [`Spanned`], so validation can still name the line
//! and column and can word its own message about what is allowed. Required
//! fields are `Option` here too: serde-saphyr places "missing field" at the
//! last key it read, while validation can point at the mapping that lacks it.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde_saphyr::{Localizer, Location, RenderOptions, SnippetMode, Spanned};

use super::{Invalid, Pos};

pub(super) type Text = Spanned<String>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub server: Option<RawServer>,
    pub redis: Option<Spanned<RawRedis>>,
    pub plans: Option<Spanned<BTreeMap<String, Spanned<RawPlan>>>>,
    pub limits: Option<Vec<Spanned<RawLimit>>>,
    pub routes: Option<Vec<Spanned<RawRoute>>>,
}

/// One entry of `plans:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPlan {
    pub rate: Option<Text>,
    pub burst: Option<Spanned<u64>>,
}

/// One entry of a limit's `overrides:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOverride {
    pub when: Option<Spanned<RawWhen>>,
    pub plan: Option<Text>,
    pub rate: Option<Text>,
    pub burst: Option<Spanned<u64>>,
    pub exempt: Option<Spanned<bool>>,
}

/// An override's `when:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWhen {
    pub ip: Option<Spanned<OneOrMany>>,
    pub key: Option<Spanned<OneOrMany>>,
    pub header: Option<Spanned<BTreeMap<String, Text>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub listen: Option<Text>,
    pub admin: Option<Text>,
    pub trusted_proxies: Option<Spanned<OneOrMany>>,
    pub grace_period: Option<Text>,
    pub max_waiters: Option<Spanned<u64>>,
    pub max_keys: Option<Spanned<u64>>,
    pub admin_token: Option<Text>,
    pub tls: Option<Spanned<RawTls>>,
    pub upstream_ca: Option<Text>,
    pub log_keys: Option<bool>,
    pub fast_path: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    pub cert: Option<Text>,
    pub key: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRedis {
    pub url: Option<Text>,
    pub cluster: Option<Spanned<OneOrMany>>,
    pub sentinel: Option<Spanned<RawSentinel>>,
    pub timeout: Option<Text>,
    pub on_error: Option<Text>,
    pub pool_size: Option<Spanned<u64>>,
    pub batch_max: Option<Spanned<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSentinel {
    pub master: Option<Text>,
    pub nodes: Option<Spanned<OneOrMany>>,
    pub username: Option<Text>,
    pub password: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub name: Option<Text>,
    #[serde(rename = "match")]
    pub matcher: Option<RawMatch>,
    pub upstream: Option<Spanned<OneOrMany>>,
    pub timeout: Option<Text>,
    pub preserve_host: Option<bool>,
    pub headers: Option<bool>,
    pub limits: Option<Vec<Spanned<RawLimit>>>,
    pub rejection: Option<Spanned<RawRejection>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRejection {
    pub status: Option<Spanned<u64>>,
    pub content_type: Option<Text>,
    pub body: Option<Text>,
    pub legacy_headers: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMatch {
    pub path: Option<Text>,
    pub path_prefix: Option<Text>,
    pub host: Option<Text>,
    pub methods: Option<Spanned<OneOrMany>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimit {
    /// `- use: NAME`: the top-level limit of that name (and nothing else in the entry).
    #[serde(rename = "use")]
    pub use_: Option<Text>,
    pub name: Option<Text>,
    pub key: Option<Spanned<OneOrMany>>,
    pub on_missing: Option<Text>,
    pub algorithm: Option<Text>,
    pub rate: Option<Text>,
    pub burst: Option<Spanned<u64>>,
    pub scope: Option<Text>,
    pub cost: Option<Spanned<u64>>,
    pub on_limit: Option<Text>,
    pub max_delay: Option<Text>,
    pub shadow: Option<bool>,
    pub consistency: Option<Text>,
    pub sync_interval: Option<Text>,
    pub align: Option<Text>,
    pub timezone: Option<Text>,
    pub overrides: Option<Vec<Spanned<RawOverride>>>,
    pub overrides_file: Option<Text>,
    // Limits that end after the response (config/after.rs).
    pub max_in_flight: Option<Spanned<u64>>,
    pub lease: Option<Text>,
    pub retry_after: Option<Text>,
    pub settle: Option<Spanned<RawSettle>>,
    // Strict global gcra limits spent in process (config/reserve.rs).
    pub reserve_ahead: Option<Text>,
}

/// A limit's `settle:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSettle {
    pub cost_header: Option<Text>,
    pub refund_status: Option<Spanned<Statuses>>,
}

/// `refund_status: [500-599, 429]`, or one of them alone: status codes and inclusive ranges,
/// numbers or text. Hand-written for the same reason as [`OneOrMany`], and to take bare
/// numbers (`429`) as well as ranges (`500-599`, which YAML reads as text).
#[derive(Debug)]
pub(super) enum Statuses {
    One(String),
    Many(Vec<Spanned<StatusText>>),
}

impl Statuses {
    /// Each item with its position; `at` is where the whole node is.
    pub(super) fn items(self, at: Location) -> Vec<Spanned<String>> {
        match self {
            Self::One(value) => vec![Spanned::new(value, at, at)],
            Self::Many(items) => items
                .into_iter()
                .map(|i| Spanned::new(i.value.0, i.referenced, i.defined))
                .collect(),
        }
    }
}

/// One status or range of `refund_status`, as text whether YAML read a number or a string.
#[derive(Debug)]
pub(super) struct StatusText(pub String);

struct StatusVisitor;

impl<'de> Visitor<'de> for StatusVisitor {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a status code (429) or a range (500-599)")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<String, E> {
        Ok(v.to_string())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<String, E> {
        Ok(v.to_string())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }
}

impl<'de> Deserialize<'de> for StatusText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StatusVisitor).map(StatusText)
    }
}

impl<'de> Deserialize<'de> for Statuses {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StatusesVisitor;

        impl<'de> Visitor<'de> for StatusesVisitor {
            type Value = Statuses;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a status code, a range (500-599), or a list of them")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Statuses, E> {
                Ok(Statuses::One(v.to_string()))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Statuses, E> {
                Ok(Statuses::One(v.to_string()))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Statuses, E> {
                Ok(Statuses::One(v.to_owned()))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Statuses, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Statuses::Many(items))
            }
        }

        deserializer.deserialize_any(StatusesVisitor)
    }
}

/// `upstream: URL` or `upstream: [URL, ...]` (likewise `key`, `methods`, ...).
///
/// Hand-written rather than `#[serde(untagged)]`: untagged enums buffer their
/// input and serde-saphyr then loses every position inside. Wrapped in
/// `Spanned`, the single form takes the wrapper's position.
#[derive(Debug)]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<Text>),
}

impl OneOrMany {
    /// Each item with its position; `at` is where the whole node is.
    pub(super) fn items(self, at: Location) -> Vec<Text> {
        match self {
            Self::One(value) => vec![Spanned::new(value, at, at)],
            Self::Many(items) => items,
        }
    }
}

impl<'de> Deserialize<'de> for OneOrMany {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OneOrManyVisitor;

        impl<'de> Visitor<'de> for OneOrManyVisitor {
            type Value = OneOrMany;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of strings")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<OneOrMany, E> {
                Ok(OneOrMany::One(v.to_owned()))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<OneOrMany, E> {
                Ok(OneOrMany::One(v))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<OneOrMany, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(OneOrMany::Many(items))
            }
        }

        deserializer.deserialize_any(OneOrManyVisitor)
    }
}

/// YAML text to [`RawConfig`]; syntax, type, unknown-key and duplicate-key
/// errors come out with their position and a message without it.
pub(super) fn parse(text: &str) -> Result<RawConfig, Invalid> {
    serde_saphyr::from_str::<RawConfig>(text).map_err(|e| {
        let at = e.location().map_or(Pos { line: 1, column: 1 }, Pos::of);
        Invalid::new(at, plain_message(&e))
    })
}

/// The library's user-facing wording, minus the " at line L, column C" suffix
/// and the source snippet: the position is already in `PATH:LINE:COL`. Type
/// mismatches are reworded in YAML terms ("invalid u64" means nothing to an
/// operator).
pub(super) fn plain_message(e: &serde_saphyr::Error) -> String {
    use serde_saphyr::Error;
    match e.without_snippet() {
        Error::InvalidScalar { ty: "boolean", .. } => return "expected true or false".to_owned(),
        Error::InvalidScalar { ty, .. } if ty.starts_with('u') => {
            return "expected a whole number (digits only: no sign, no fraction)".to_owned();
        }
        Error::Unexpected {
            expected: "sequence start",
            ..
        } => return "expected a list (`- item` lines or `[a, b]`)".to_owned(),
        Error::Unexpected {
            expected: "mapping start",
            ..
        } => return "expected a mapping (`key: value` lines or `{key: value}`)".to_owned(),
        _ => {}
    }
    struct NoLocation;
    impl Localizer for NoLocation {
        fn attach_location<'a>(&self, base: Cow<'a, str>, _: Location) -> Cow<'a, str> {
            base
        }
    }
    let formatter = serde_saphyr::UserMessageFormatter.with_localizer(&NoLocation);
    let mut options = RenderOptions::new(&formatter);
    options.snippets = SnippetMode::Off;
    e.render_with_options(options)
}
