//! The depth check a model call's body passes before it goes upstream: a body holding a value
//! the graph would refuse as nested too deeply must not cost the engine a generation first.
//!
//! The limits are the Python server's (`_check_depth`): each message of `messages` may nest
//! `MAX_DEPTH` levels (the array adds one), `tools` `MAX_DEPTH`, Anthropic's `system` one less
//! (it is the content of the first message), every other recorded field one less (a value of
//! the sampling parameters); `model`, `stream` (and Chat Completions' `stream_options`) are
//! not recorded as sent. The body is read by the engine's exact parser (a repeated key keeps
//! its first position and last value, as the Python dict does); one too deep for the parser's
//! own bound is measured by a plain scan of its brackets.

use std::convert::Infallible;

use engine::json::{parse_with, ErrorKind, Failure, Key, Sink, Str};

/// The library's depth bound (`rollout_store.MAX_DEPTH`).
pub const MAX_DEPTH: u32 = 500;
/// The parser's bound: a body whose every field is within its limit nests at most
/// `MAX_DEPTH + 2` (the body, the messages array, a message).
const PARSE_BOUND: usize = MAX_DEPTH as usize + 3;

/// How deeply a field's value may nest, or `None` for a field not recorded as sent.
fn limit(field: &str, anthropic: bool) -> Option<u32> {
    match field {
        "messages" => Some(MAX_DEPTH + 1),
        "tools" => Some(MAX_DEPTH),
        "model" | "stream" => None,
        "stream_options" if !anthropic => None,
        _ => Some(MAX_DEPTH - 1),
    }
}

/// The depth of every value, and the members of the last object closed (the body's own,
/// when the body is an object).
#[derive(Default)]
struct Depths {
    members: Vec<(Option<String>, u32)>,
}

impl Sink for Depths {
    type Value = u32;
    type Error = Infallible;

    fn null(&mut self) -> Result<u32, Infallible> {
        Ok(0)
    }
    fn bool(&mut self, _: bool) -> Result<u32, Infallible> {
        Ok(0)
    }
    fn int(&mut self, _: i64) -> Result<u32, Infallible> {
        Ok(0)
    }
    fn big_int(&mut self, _: &str) -> Result<u32, Infallible> {
        Ok(0)
    }
    fn float(&mut self, _: f64) -> Result<u32, Infallible> {
        Ok(0)
    }
    fn string(&mut self, _: Str<'_>) -> Result<u32, Infallible> {
        Ok(0)
    }
    fn array(&mut self, items: Vec<u32>) -> Result<u32, Infallible> {
        Ok(1 + items.into_iter().max().unwrap_or(0))
    }
    fn object(&mut self, members: Vec<(Key<'_>, u32)>) -> Result<u32, Infallible> {
        let deepest = members.iter().map(|(_, d)| *d).max().unwrap_or(0);
        self.members.clear();
        self.members.extend(
            members
                .iter()
                .map(|(k, d)| (k.as_str().as_str().map(str::to_string), *d)),
        );
        Ok(1 + deepest)
    }
}

/// The first field (in the body's order) nested deeper than it may be, by name; `None` when
/// every field is within its limit, or the body is not a JSON object this check can read
/// (the Python control plane then reads and refuses it with its own reason).
pub fn too_deep(body: &[u8], anthropic: bool) -> Option<String> {
    let start = body.iter().position(|b| !b" \t\r\n".contains(b))?;
    if body[start] != b'{' {
        return None; // not an object (or not UTF-8 without a BOM): the control plane reads it
    }
    let mut depths = Depths::default();
    match parse_with(body, PARSE_BOUND, &mut depths) {
        Ok(_) => depths.members.into_iter().find_map(|(name, depth)| {
            let name = name?;
            (depth > limit(&name, anthropic)?).then_some(name)
        }),
        Err(Failure::Syntax(error)) if matches!(error.kind, ErrorKind::TooDeep(_)) => {
            scanned(body, anthropic)
        }
        Err(_) => None,
    }
}

/// `too_deep` for a body too deep for the parser: its brackets outside strings, member by
/// member of the outer object (a key with escapes is left to the control plane).
fn scanned(body: &[u8], anthropic: bool) -> Option<String> {
    let mut depth = 0u32;
    let mut deepest = 0u32;
    let mut key: Option<String> = None;
    let mut i = 0;
    let mut expecting_key = false;
    while i < body.len() {
        match body[i] {
            b'"' => {
                let from = i + 1;
                let mut j = from;
                while j < body.len() && body[j] != b'"' {
                    j += if body[j] == b'\\' { 2 } else { 1 };
                }
                if depth == 1 && expecting_key {
                    key = std::str::from_utf8(body.get(from..j)?)
                        .ok()
                        .filter(|k| !k.contains('\\'))
                        .map(str::to_string);
                    expecting_key = false;
                    deepest = 0;
                }
                i = j;
            }
            b'{' | b'[' => {
                depth += 1;
                if depth == 1 {
                    expecting_key = true;
                } else {
                    deepest = deepest.max(depth - 1);
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            b',' if depth == 1 => expecting_key = true,
            _ => {}
        }
        if depth == 1 || i + 1 == body.len() {
            if let Some(name) = &key {
                if limit(name, anthropic).is_some_and(|most| deepest > most) {
                    return Some(name.clone());
                }
            }
        }
        i += 1;
    }
    None
}

/// The Python server's refusal of a body whose field `field` nests too deeply.
pub fn reason(field: &str) -> String {
    format!(
        "the request cannot be recorded: {field} nests deeper than {MAX_DEPTH} levels \
         (refused before the call went upstream)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(n: usize) -> String {
        format!("{}1{}", "[".repeat(n), "]".repeat(n))
    }

    fn message_of(n: usize) -> String {
        // a message object nesting `n` levels: the object and n - 1 arrays in its content
        format!(r#"{{"role": "user", "content": {}}}"#, nested(n - 1))
    }

    #[test]
    fn fields_within_their_limits_pass() {
        let body = format!(
            r#"{{"model": "m", "messages": [{}], "tools": {}, "temperature": {}}}"#,
            message_of(500),
            nested(500),
            nested(499)
        );
        assert_eq!(too_deep(body.as_bytes(), false), None);
        let body = format!(r#"{{"messages": [], "system": {}}}"#, nested(499));
        assert_eq!(too_deep(body.as_bytes(), true), None);
    }

    #[test]
    fn each_field_is_refused_one_level_past_its_limit() {
        let body = format!(r#"{{"messages": [{}]}}"#, message_of(501));
        assert_eq!(
            too_deep(body.as_bytes(), false).as_deref(),
            Some("messages")
        );
        let body = format!(r#"{{"messages": [], "tools": {}}}"#, nested(501));
        assert_eq!(too_deep(body.as_bytes(), false).as_deref(), Some("tools"));
        let body = format!(r#"{{"messages": [], "system": {}}}"#, nested(500));
        assert_eq!(too_deep(body.as_bytes(), true).as_deref(), Some("system"));
        let body = format!(r#"{{"messages": [], "extra": {}}}"#, nested(500));
        assert_eq!(too_deep(body.as_bytes(), false).as_deref(), Some("extra"));
    }

    #[test]
    fn fields_not_recorded_are_not_measured() {
        let body = format!(r#"{{"messages": [], "stream_options": {}}}"#, nested(500));
        assert_eq!(too_deep(body.as_bytes(), false), None);
        assert_eq!(
            too_deep(body.as_bytes(), true).as_deref(),
            Some("stream_options")
        );
    }

    #[test]
    fn bodies_past_the_parsers_bound_name_their_field() {
        let body = format!(r#"{{"a": 1, "messages": [{}]}}"#, message_of(600));
        assert_eq!(
            too_deep(body.as_bytes(), false).as_deref(),
            Some("messages")
        );
        let body = format!(r#"{{"x": "[[[", "deep": {}}}"#, nested(2000));
        assert_eq!(too_deep(body.as_bytes(), false).as_deref(), Some("deep"));
    }

    #[test]
    fn brackets_inside_strings_do_not_count() {
        let body = format!(
            r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#,
            "[".repeat(900)
        );
        assert_eq!(too_deep(body.as_bytes(), false), None);
    }

    #[test]
    fn what_is_not_a_json_object_is_left_to_the_control_plane() {
        assert_eq!(too_deep(nested(900).as_bytes(), false), None);
        assert_eq!(too_deep(b"{\"messages\": [", false), None);
        assert_eq!(too_deep(b"", false), None);
        let deep_but_broken = format!(r#"{{"messages": {} x"#, nested(10));
        assert_eq!(too_deep(deep_but_broken.as_bytes(), false), None);
    }

    #[test]
    fn a_repeated_key_keeps_its_last_value() {
        let body = format!(r#"{{"tools": {}, "tools": []}}"#, nested(600 - 100));
        assert_eq!(too_deep(body.as_bytes(), false), None);
        let body = format!(r#"{{"tools": [], "tools": {}}}"#, nested(501));
        assert_eq!(too_deep(body.as_bytes(), false).as_deref(), Some("tools"));
    }
}
