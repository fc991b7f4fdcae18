//! The gate of a model call: which `Host` and `Origin` are answered (the check against DNS
//! rebinding), that the body is sent as JSON, where the key is, and the refusals written as
//! the Python server writes them (`JSONResponse`: `json.dumps(..., ensure_ascii=False,
//! separators=(",", ":"))`), so a client cannot tell which plane answered.

use std::collections::HashSet;
use std::fmt::Write as _;

/// The names of the loopback interface a browser sends in `Host`.
pub const LOOPBACK_HOSTS: [&str; 3] = ["127.0.0.1", "localhost", "[::1]"];

/// The `Host` names a server answers; `None`: any (`--allow-host '*'`).
#[derive(Clone, Debug)]
pub struct Hosts(Option<HashSet<String>>);

impl Hosts {
    /// Answer exactly these names (already in the form `host_name` gives: lowercased,
    /// IPv6 literals in brackets).
    pub fn only<I: IntoIterator<Item = String>>(names: I) -> Self {
        Self(Some(names.into_iter().collect()))
    }

    /// Answer any name (behind a proxy that checks it).
    pub fn any() -> Self {
        Self(None)
    }

    /// Whether a request with this `Host` value is answered.
    pub fn host_allowed(&self, value: Option<&str>) -> bool {
        match &self.0 {
            None => true,
            Some(names) => names.contains(&host_name(value.unwrap_or(""))),
        }
    }

    /// Whether a request with this `Origin` value is answered: none (not a browser's
    /// cross-site request), or one naming an allowed host.
    pub fn origin_allowed(&self, value: Option<&str>) -> bool {
        let (Some(value), Some(names)) = (value, &self.0) else {
            return true;
        };
        match origin_netloc(value) {
            Some(netloc) if !netloc.is_empty() => names.contains(&host_name(netloc)),
            _ => false,
        }
    }
}

/// The host of a `Host` value, lowercased, without its port ("" if none, or if what follows
/// the host is not a port: `[::1]evil.example` names no host of ours).
pub fn host_name(value: &str) -> String {
    let text = value.trim().to_lowercase();
    let (host, rest) = if text.starts_with('[') {
        match text.find(']') {
            Some(end) if end > 0 => (&text[..=end], &text[end + 1..]),
            _ => return String::new(),
        }
    } else if text.matches(':').count() == 1 {
        let at = text.find(':').unwrap_or(text.len());
        (&text[..at], &text[at..])
    } else {
        (text.as_str(), "")
    };
    let port_ok = rest.is_empty()
        || rest
            .strip_prefix(':')
            .is_some_and(|port| port.bytes().all(|b| b.is_ascii_digit()));
    if port_ok {
        host.to_string()
    } else {
        String::new()
    }
}

/// The refusal of a request that repeats its `Host` or its `Content-Type` header (which one
/// would a check read? none: refused), given how many of each it has.
pub fn repeated(hosts: usize, content_types: usize) -> Option<(u16, String)> {
    (hosts > 1 || content_types > 1).then(|| {
        let name = if hosts > 1 { "Host" } else { "Content-Type" };
        (
            400,
            format!(
                "a request has one {name} header, not {}",
                hosts.max(content_types)
            ),
        )
    })
}

/// The network location of an `Origin` as `urllib.parse.urlsplit` finds it; `None` where
/// urlsplit raises (unbalanced IPv6 brackets).
fn origin_netloc(value: &str) -> Option<&str> {
    let url = value.trim();
    let mut rest = url;
    if let Some((scheme, after)) = url.split_once(':') {
        let mut chars = scheme.chars();
        let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
            && chars.all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
        if valid {
            rest = after;
        }
    }
    let Some(after) = rest.strip_prefix("//") else {
        return Some("");
    };
    let end = after.find(['/', '?', '#']).unwrap_or(after.len());
    let netloc = &after[..end];
    if netloc.contains('[') != netloc.contains(']') {
        return None;
    }
    Some(netloc)
}

/// Whether a `Content-Type` value names JSON (its media type, parameters aside).
pub fn is_json(content_type: &str) -> bool {
    let media = content_type.split(';').next().unwrap_or("");
    media.trim().eq_ignore_ascii_case("application/json")
}

/// The key a call was sent: `Authorization: Bearer KEY`, else `x-api-key`.
pub fn api_key(authorization: Option<&str>, x_api_key: Option<&str>) -> Option<String> {
    if let Some(auth) = authorization {
        let mut chars = auth.char_indices();
        if let Some((at, _)) = chars.nth(7) {
            if auth[..at].eq_ignore_ascii_case("bearer ") {
                let key = py_strip(&auth[at..]);
                return (!key.is_empty()).then(|| key.to_string());
            }
        } else if auth.chars().count() == 7 && auth.eq_ignore_ascii_case("bearer ") {
            return None;
        }
    }
    x_api_key.filter(|k| !k.is_empty()).map(str::to_string)
}

/// `str.strip()`: Python's whitespace, which counts the separators 0x1c-0x1f too.
fn py_strip(text: &str) -> &str {
    text.trim_matches(|c: char| c.is_whitespace() || ('\x1c'..='\x1f').contains(&c))
}

/// A header's value as Starlette reads it (latin-1).
pub fn latin1(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| char::from(b)).collect()
}

/// `repr(text)` of a `str` (the characters a latin-1 header can hold, and beyond).
pub fn py_repr(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (0x80..=0xa0).contains(&(c as u32)) || c as u32 == 0xad => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `json.dumps(text, ensure_ascii=False)`.
pub fn json_str(text: &str, out: &mut String) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The error `type` the Python server gives a status.
fn error_kind(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        502 | 507 => "api_error",
        _ => "invalid_request_error",
    }
}

/// A refusal's body in the error shape of the route's API (`OpenAI`'s or `Anthropic`'s).
pub fn error_body(anthropic: bool, status: u16, reason: &str) -> String {
    let kind = error_kind(status);
    let mut out = String::with_capacity(reason.len() + 80);
    if anthropic {
        out.push_str("{\"type\":\"error\",\"error\":{\"type\":");
        json_str(kind, &mut out);
        out.push_str(",\"message\":");
        json_str(reason, &mut out);
        out.push_str("}}");
    } else {
        out.push_str("{\"error\":{\"message\":");
        json_str(reason, &mut out);
        out.push_str(",\"type\":");
        json_str(kind, &mut out);
        out.push_str(",\"param\":null,\"code\":null}}");
    }
    out
}

/// The refusal (status, reason) of a request no route may see: a `Host` or an `Origin` the
/// server does not answer, or a body not sent as JSON; `None` to let it through.
pub fn refusal(
    hosts: &Hosts,
    host: Option<&str>,
    origin: Option<&str>,
    content_type: Option<&str>,
) -> Option<(u16, String)> {
    if !hosts.host_allowed(host) {
        return Some((
            403,
            format!(
                "this server does not answer the Host {}: only its own names (a request \
                 through another name is refused against DNS rebinding); start it with \
                 --allow-host NAME to accept one",
                host.map_or_else(|| "None".to_string(), py_repr)
            ),
        ));
    }
    if !hosts.origin_allowed(origin) {
        return Some((
            403,
            format!(
                "requests from the web origin {} are refused (a page elsewhere); start the \
                 server with --allow-host NAME to accept that host",
                origin.map_or_else(|| "None".to_string(), py_repr)
            ),
        ));
    }
    match content_type {
        Some(kind) if !is_json(kind) => Some((
            415,
            format!(
                "the body must be sent as Content-Type: application/json, not {}",
                py_repr(kind)
            ),
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback() -> Hosts {
        Hosts::only(LOOPBACK_HOSTS.iter().map(|h| (*h).to_string()))
    }

    #[test]
    fn host_names_lose_their_port_and_case() {
        assert_eq!(host_name("LocalHost:8100"), "localhost");
        assert_eq!(host_name("[::1]:8100"), "[::1]");
        assert_eq!(host_name("[::1"), "");
        assert_eq!(host_name("::1"), "::1");
        assert_eq!(host_name(" 127.0.0.1 "), "127.0.0.1");
        assert_eq!(host_name("localhost:"), "localhost");
        // what follows the host must be a port
        assert_eq!(host_name("[::1]evil.example"), "");
        assert_eq!(host_name("[::1]:80x"), "");
        assert_eq!(host_name("localhost:http"), "");
    }

    #[test]
    fn a_repeated_host_or_content_type_is_refused() {
        assert_eq!(repeated(1, 1), None);
        assert_eq!(repeated(0, 0), None);
        assert_eq!(
            repeated(2, 1),
            Some((400, "a request has one Host header, not 2".into()))
        );
        assert_eq!(
            repeated(1, 3),
            Some((400, "a request has one Content-Type header, not 3".into()))
        );
    }

    #[test]
    fn only_the_servers_own_hosts_are_answered() {
        let hosts = loopback();
        assert!(hosts.host_allowed(Some("127.0.0.1:8100")));
        assert!(hosts.host_allowed(Some("localhost")));
        assert!(hosts.host_allowed(Some("[::1]:1")));
        assert!(!hosts.host_allowed(Some("evil.example:8100")));
        assert!(!hosts.host_allowed(None));
        assert!(!hosts.host_allowed(Some("127.0.0.1.evil.example")));
        assert!(Hosts::any().host_allowed(Some("evil.example")));
    }

    #[test]
    fn origins_are_checked_by_their_host() {
        let hosts = loopback();
        assert!(hosts.origin_allowed(None));
        assert!(hosts.origin_allowed(Some("http://localhost:3000")));
        assert!(!hosts.origin_allowed(Some("https://evil.example")));
        assert!(!hosts.origin_allowed(Some("null")));
        assert!(!hosts.origin_allowed(Some("http://[::1")));
        assert!(!hosts.origin_allowed(Some("http://user@localhost")));
    }

    #[test]
    fn refusals_read_as_the_python_servers() {
        let hosts = loopback();
        let (status, reason) = refusal(&hosts, Some("evil.example"), None, None).unwrap();
        assert_eq!(status, 403);
        assert!(reason.starts_with("this server does not answer the Host 'evil.example': "));
        let (status, reason) =
            refusal(&hosts, Some("localhost"), None, Some("text/plain")).unwrap();
        assert_eq!(status, 415);
        assert!(reason.ends_with("not 'text/plain'"));
        assert!(refusal(
            &hosts,
            Some("localhost"),
            None,
            Some("Application/JSON; x=1")
        )
        .is_none());
        let (_, reason) = refusal(&hosts, None, None, None).unwrap();
        assert!(reason.contains("the Host None:"));
    }

    #[test]
    fn repr_and_json_strings_match_python() {
        assert_eq!(py_repr("a'b"), "\"a'b\"");
        assert_eq!(py_repr("a'b\""), "'a\\'b\"'");
        assert_eq!(py_repr("t\x01\u{ad}\u{e9}"), "'t\\x01\\xad\u{e9}'");
        let mut out = String::new();
        json_str("q\"\\\n\u{1}\u{e9}", &mut out);
        assert_eq!(out, "\"q\\\"\\\\\\n\\u0001\u{e9}\"");
    }

    #[test]
    fn error_bodies_in_each_apis_shape() {
        assert_eq!(
            error_body(false, 401, "no"),
            r#"{"error":{"message":"no","type":"authentication_error","param":null,"code":null}}"#
        );
        assert_eq!(
            error_body(true, 413, "big"),
            r#"{"type":"error","error":{"type":"request_too_large","message":"big"}}"#
        );
    }

    #[test]
    fn keys_come_from_bearer_or_x_api_key() {
        assert_eq!(api_key(Some("Bearer  k1 "), None).as_deref(), Some("k1"));
        assert_eq!(
            api_key(Some("bearer k1"), Some("k2")).as_deref(),
            Some("k1")
        );
        assert_eq!(
            api_key(Some("Basic xyz"), Some("k2")).as_deref(),
            Some("k2")
        );
        assert_eq!(api_key(Some("Bearer "), Some("k2")), None);
        assert_eq!(api_key(None, Some("")), None);
    }
}
