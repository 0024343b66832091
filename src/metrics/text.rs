//! The exposition formats `/metrics` speaks, and the classic text format derived from
//! prometheus-client's OpenMetrics output.
//!
//! prometheus-client 0.25 writes only OpenMetrics, where a counter family is announced without
//! its `_total` (`# TYPE x counter`, then `x_total` samples). A classic text-format parser (the
//! contract promises the Prometheus text format) looks a family up by its sample names, so it
//! reads those counters as untyped. The two formats differ in a handful of lines per family, so
//! rewriting those lines is smaller and safer than a second encoder for every metric type, and
//! the OpenMetrics answer Prometheus asks for stays byte for byte the crate's.

/// An exposition format `/metrics` can answer in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text exposition format 0.0.4, the default.
    Text,
    /// OpenMetrics 1.0.0 text, for scrapers that ask for it (Prometheus does).
    OpenMetrics,
}

impl Format {
    /// Chooses the format from the request's `Accept` values as Prometheus client libraries do
    /// (client_golang's `expfmt.Negotiate`): the media range with the highest `q` wins (on a
    /// tie, the one listed first), and anything else, or no `Accept`, means classic text. So
    /// Prometheus, which prefers `application/openmetrics-text`, keeps the format it asks for,
    /// while curl, scripts and classic parsers get the one the contract names.
    pub fn negotiate<'a>(accept: impl IntoIterator<Item = &'a str>) -> Self {
        let mut best = (0.0_f32, Format::Text);
        for range in accept.into_iter().flat_map(|v| v.split(',')) {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim();
            let format = if media.eq_ignore_ascii_case("application/openmetrics-text") {
                Format::OpenMetrics
            } else if media.eq_ignore_ascii_case("text/plain") {
                Format::Text
            } else {
                continue;
            };
            let q = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                // An unreadable weight counts as 0, as in client_golang.
                .map_or(1.0, |(_, v)| v.trim().parse().unwrap_or(0.0));
            if q > best.0 {
                best = (q, format);
            }
        }
        best.1
    }

    /// The `Content-Type` of a `/metrics` answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// Appends to `out` the classic text form of `openmetrics`, as prometheus-client 0.25 writes it.
///
/// Line by line, borrowing from the input (one pass, no allocation beyond `out`):
/// - `# HELP`/`# TYPE` of a counter name the family with `_total`, as its samples are named; an
///   info family becomes the gauge `_info` (its samples' name, value 1) as client_python does;
///   `unknown` is spelt `untyped`. HELP's `\"` escape, OpenMetrics-only, is unescaped.
/// - `# UNIT` and `# EOF` are dropped, as are `_created` samples and exemplars (` # {..} v`).
/// - Sample lines otherwise pass unchanged: names, label escapes and values are common to both.
///
/// Sample timestamps (seconds in OpenMetrics, milliseconds here) are not converted: the crate
/// never writes them.
pub(super) fn openmetrics_to_text(openmetrics: &str, out: &mut String) {
    out.reserve(openmetrics.len() + 256);
    // A HELP line waits for its TYPE, which says whether its name takes a suffix.
    let mut help: Option<(&str, &str)> = None;
    // The current family's name, to recognise its `_created` samples.
    let mut family = "";
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            flush_help(help.take(), "", out);
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let (suffix, kind) = match kind {
                "counter" => ("_total", kind),
                "info" => ("_info", "gauge"),
                "unknown" => ("", "untyped"),
                _ => ("", kind),
            };
            match help.take() {
                Some(h) if h.0 == name => flush_help(Some(h), suffix, out),
                other => flush_help(other, "", out),
            }
            for part in ["# TYPE ", name, suffix, " ", kind, "\n"] {
                out.push_str(part);
            }
            family = name;
        } else if line.starts_with('#') || line.is_empty() {
            // `# UNIT`, `# EOF`: OpenMetrics only.
        } else {
            flush_help(help.take(), "", out);
            if sample_name(line).strip_prefix(family) != Some("_created") {
                out.push_str(without_exemplar(line));
                out.push('\n');
            }
        }
    }
    flush_help(help, "", out);
}

fn flush_help(help: Option<(&str, &str)>, suffix: &str, out: &mut String) {
    let Some((name, text)) = help else { return };
    for part in ["# HELP ", name, suffix, " "] {
        out.push_str(part);
    }
    // Classic HELP escapes only `\\` and `\n`; `\\"` is an escaped backslash before a quote.
    let mut rest = text;
    while let Some(i) = rest.find('\\') {
        let (before, after) = rest.split_at(i);
        out.push_str(before);
        let escaped = &after[..after[1..].chars().next().map_or(1, |c| 1 + c.len_utf8())];
        out.push_str(if escaped == "\\\"" { "\"" } else { escaped });
        rest = &after[escaped.len()..];
    }
    out.push_str(rest);
    out.push('\n');
}

/// The metric name a sample line starts with.
fn sample_name(line: &str) -> &str {
    line.find(['{', ' ']).map_or(line, |i| &line[..i])
}

/// The sample without its exemplar. ` # ` may appear inside a quoted label value, so the search
/// starts after the label set.
fn without_exemplar(line: &str) -> &str {
    if !line.contains(" # ") {
        return line;
    }
    let labels_end = label_set_end(line);
    match line[labels_end..].find(" # ") {
        Some(i) => &line[..labels_end + i],
        None => line,
    }
}

/// The byte offset just past the sample's label set (or its name, when it has none).
fn label_set_end(line: &str) -> usize {
    let name = sample_name(line).len();
    if !line[name..].starts_with('{') {
        return name;
    }
    let (mut quoted, mut escaped) = (false, false);
    for (i, b) in line.bytes().enumerate().skip(name + 1) {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b'}' if !quoted => return i + 1,
            _ => {}
        }
    }
    line.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What prometheus-client 0.25 writes for tollgate's kinds of families, plus the parts it can
    /// write for others (unit, info, exemplars) and HELP escapes.
    const OPENMETRICS: &str = r#"# HELP tollgate_requests Requests answered, by route and HTTP status.
# TYPE tollgate_requests counter
tollgate_requests_total{route="users",status="200"} 2
tollgate_requests_total{route="a # b \" }",status="429"} 1 # {trace_id="x # y"} 1.0 1700000000.5
tollgate_requests_created{route="users",status="200"} 1700000000.0
# HELP tollgate_request_duration_seconds Whole request, a \\ b\nc \"quoted\" \\"x.
# TYPE tollgate_request_duration_seconds histogram
tollgate_request_duration_seconds_sum{route="users"} 0.00305
tollgate_request_duration_seconds_count{route="users"} 2
tollgate_request_duration_seconds_bucket{le="0.0001",route="users"} 1 # {id="1"} 0.00005
tollgate_request_duration_seconds_bucket{le="+Inf",route="users"} 2
# HELP tollgate_local_keys Keys held by the in-process limit stores.
# TYPE tollgate_local_keys gauge
tollgate_local_keys 3
# HELP tollgate_body_bytes Bytes.
# TYPE tollgate_body_bytes gauge
# UNIT tollgate_body_bytes bytes
tollgate_body_bytes 7
# HELP tollgate_build Build.
# TYPE tollgate_build info
tollgate_build_info{version="0.1.0"} 1
# HELP tollgate_misc Misc.
# TYPE tollgate_misc unknown
tollgate_misc 1.5
# EOF
"#;

    const TEXT: &str = r#"# HELP tollgate_requests_total Requests answered, by route and HTTP status.
# TYPE tollgate_requests_total counter
tollgate_requests_total{route="users",status="200"} 2
tollgate_requests_total{route="a # b \" }",status="429"} 1
# HELP tollgate_request_duration_seconds Whole request, a \\ b\nc "quoted" \\"x.
# TYPE tollgate_request_duration_seconds histogram
tollgate_request_duration_seconds_sum{route="users"} 0.00305
tollgate_request_duration_seconds_count{route="users"} 2
tollgate_request_duration_seconds_bucket{le="0.0001",route="users"} 1
tollgate_request_duration_seconds_bucket{le="+Inf",route="users"} 2
# HELP tollgate_local_keys Keys held by the in-process limit stores.
# TYPE tollgate_local_keys gauge
tollgate_local_keys 3
# HELP tollgate_body_bytes Bytes.
# TYPE tollgate_body_bytes gauge
tollgate_body_bytes 7
# HELP tollgate_build_info Build.
# TYPE tollgate_build_info gauge
tollgate_build_info{version="0.1.0"} 1
# HELP tollgate_misc Misc.
# TYPE tollgate_misc untyped
tollgate_misc 1.5
"#;

    #[test]
    fn openmetrics_becomes_classic_text() {
        let mut out = String::new();
        openmetrics_to_text(OPENMETRICS, &mut out);
        assert_eq!(out, TEXT);
    }

    #[test]
    fn accept_picks_openmetrics_only_when_preferred() {
        let om = Format::OpenMetrics;
        let text = Format::Text;
        for (accept, want) in [
            // Prometheus 2.x and 3.x scrape headers.
            (
                "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                om,
            ),
            (
                "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
                om,
            ),
            ("Application/OpenMetrics-Text; Version=1.0.0", om),
            ("", text),
            ("*/*", text),
            ("text/plain", text),
            ("text/plain;q=0.5, application/openmetrics-text;q=0.9", om),
            (
                "application/openmetrics-text;q=0.3, text/plain;version=0.0.4",
                text,
            ),
            ("application/openmetrics-text;q=0", text),
            ("application/openmetrics-text;q=zero", text),
            ("text/plain, application/openmetrics-text", text),
        ] {
            assert_eq!(Format::negotiate([accept]), want, "Accept: {accept}");
        }
        // Several Accept fields read as one list.
        assert_eq!(
            Format::negotiate(["text/plain;q=0.1", "application/openmetrics-text"]),
            om
        );
    }
}
