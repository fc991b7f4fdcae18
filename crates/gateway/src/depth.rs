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
//!
//! The same reading says whether `messages` has the shape the control plane requires (a
//! non-empty array of objects with a string `role`), whether the body was read whole, and
//! the most digits of any int in it (json.loads refuses one past Python's digit limit, and
//! the raw messages are not decoded before they go upstream): the control plane then checks
//! none of these again (see [`check`]).

use std::collections::HashMap;
use std::convert::Infallible;

use engine::json::{decode_text, parse_with, ErrorKind, Failure, Key, Sink, Str};

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

/// What the shape check of `messages` needs of a value.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Other,
    /// A string (a `str`: no lone surrogate).
    Text,
    /// An object whose `role` is a string.
    Message,
    /// A non-empty array of such objects.
    Messages,
}

/// A value's depth and kind.
#[derive(Clone, Copy)]
struct Measure {
    depth: u32,
    kind: Kind,
}

const SCALAR: Measure = Measure {
    depth: 0,
    kind: Kind::Other,
};

/// The depth and kind of every value, and the members of the last object closed (the
/// body's own, when the body is an object).
#[derive(Default)]
struct Depths {
    members: Vec<(Option<String>, Measure)>,
    /// A string or key holds a surrogate code point (escaped, or in the body's bytes).
    surrogates: bool,
    /// The most digits of any int read (a repeated key's replaced values too, which
    /// json.loads converts all the same).
    digits: usize,
}

impl Sink for Depths {
    type Value = Measure;
    type Error = Infallible;

    fn null(&mut self) -> Result<Measure, Infallible> {
        Ok(SCALAR)
    }
    fn bool(&mut self, _: bool) -> Result<Measure, Infallible> {
        Ok(SCALAR)
    }
    fn int(&mut self, _: i64) -> Result<Measure, Infallible> {
        Ok(SCALAR)
    }
    fn big_int(&mut self, text: &str) -> Result<Measure, Infallible> {
        // (the text as written: no leading zero, no fraction, no exponent)
        self.digits = self.digits.max(text.trim_start_matches('-').len());
        Ok(SCALAR)
    }
    fn float(&mut self, _: f64) -> Result<Measure, Infallible> {
        Ok(SCALAR)
    }
    fn string(&mut self, text: Str<'_>) -> Result<Measure, Infallible> {
        let kind = if text.surrogates {
            self.surrogates = true;
            Kind::Other
        } else {
            Kind::Text
        };
        Ok(Measure { depth: 0, kind })
    }
    fn array(&mut self, items: Vec<Measure>) -> Result<Measure, Infallible> {
        let messages = !items.is_empty() && items.iter().all(|m| m.kind == Kind::Message);
        Ok(Measure {
            depth: 1 + items.iter().map(|m| m.depth).max().unwrap_or(0),
            kind: if messages {
                Kind::Messages
            } else {
                Kind::Other
            },
        })
    }
    fn object(&mut self, members: Vec<(Key<'_>, Measure)>) -> Result<Measure, Infallible> {
        let deepest = members.iter().map(|(_, m)| m.depth).max().unwrap_or(0);
        self.surrogates |= members.iter().any(|(k, _)| k.surrogates);
        // (members come deduplicated: a repeated `role` is its last value, as in a dict)
        let message = members
            .iter()
            .any(|(k, m)| k.as_str().as_str() == Some("role") && m.kind == Kind::Text);
        self.members.clear();
        self.members.extend(
            members
                .iter()
                .map(|(k, m)| (k.as_str().as_str().map(str::to_string), *m)),
        );
        Ok(Measure {
            depth: 1 + deepest,
            kind: if message { Kind::Message } else { Kind::Other },
        })
    }
}

/// What the depth check made of a body.
#[derive(Debug, PartialEq, Eq)]
pub enum Depth {
    /// Read as a JSON object whose every field is within its limit: the control plane need
    /// not measure it again. `shaped`: its `messages` is a non-empty array of objects with a
    /// string `role` (the shape the control plane checks); `utf8`: the body is strict UTF-8
    /// (no byte order mark, no surrogate code point), as `bytes.decode("utf-8")` reads it.
    Within { shaped: bool, utf8: bool },
    /// The first field (in the body's order) nested deeper than it may be, by name.
    TooDeep(String),
    /// Not a JSON object this check can read whole (the control plane reads it, refuses it
    /// with its own reason or measures it itself).
    Unread,
}

/// What a body read whole was found to be, that the control plane need not check again
/// (all false: not known).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checked {
    /// Every field is within its depth limit.
    pub depth: bool,
    /// `messages` is a non-empty array of objects with a string `role`.
    pub shape: bool,
    /// The body is strict UTF-8.
    pub utf8: bool,
    /// The most digits of any int in the body (as json.loads counts them for its digit
    /// limit: the digits of a literal with no fraction and no exponent); `None`: not known.
    pub digits: Option<usize>,
}

/// The depth check of a body (see [`Depth`]).
pub fn measure(body: &[u8], anthropic: bool) -> Depth {
    read(body, anthropic).0
}

/// What one reading of a body found that the control plane need not check again, or the
/// first field (in the body's order) nested deeper than it may be, by name.
///
/// # Errors
/// The field too deep: the body is refused for that ([`reason`]) before anything else.
pub fn check(body: &[u8], anthropic: bool) -> Result<Checked, String> {
    match read(body, anthropic) {
        (Depth::TooDeep(field), _) => Err(field),
        (Depth::Within { shaped, utf8 }, digits) => Ok(Checked {
            depth: true,
            shape: shaped,
            utf8,
            digits: Some(digits),
        }),
        (Depth::Unread, _) => Ok(Checked::default()),
    }
}

/// [`measure`], and the most digits of any int the body holds (meaningful for a body read
/// whole).
fn read(body: &[u8], anthropic: bool) -> (Depth, usize) {
    let Some(start) = body.iter().position(|b| !b" \t\r\n".contains(b)) else {
        return (Depth::Unread, 0);
    };
    if body[start] != b'{' {
        return (Depth::Unread, 0); // not an object (or not UTF-8 without a BOM)
    }
    let mut depths = Depths::default();
    match parse_with(body, PARSE_BOUND, &mut depths) {
        Ok(_) => {
            // a key no `str` holds (a lone surrogate) is left to the control plane: when its
            // field is the first too deep (it names it), or none is
            let unread = depths.members.iter().any(|(name, _)| name.is_none());
            let shaped = depths
                .members
                .iter()
                .any(|(name, m)| name.as_deref() == Some("messages") && m.kind == Kind::Messages);
            let deep = depths.members.into_iter().find(|(name, m)| {
                // (no field of a limit of its own has a surrogate in its name)
                let most = name
                    .as_deref()
                    .map_or(Some(MAX_DEPTH - 1), |n| limit(n, anthropic));
                most.is_some_and(|most| m.depth > most)
            });
            let depth = match deep {
                Some((Some(name), _)) => Depth::TooDeep(name),
                Some((None, _)) => Depth::Unread,
                None if unread => Depth::Unread,
                None => Depth::Within {
                    shaped,
                    // UTF-16 and UTF-32 hold a NUL in the first two bytes (json.loads reads
                    // them); outside strings, the text parsed is ASCII
                    utf8: body.get(1) != Some(&0) && !depths.surrogates,
                },
            };
            (depth, depths.digits)
        }
        Err(Failure::Syntax(error)) if matches!(error.kind, ErrorKind::TooDeep(_)) => {
            let depth = scanned(body, anthropic).map_or(Depth::Unread, Depth::TooDeep);
            (depth, 0)
        }
        Err(_) => (Depth::Unread, 0),
    }
}

/// The first field (in the body's order) nested deeper than it may be, by name; `None` when
/// every field is within its limit, or the body is not a JSON object this check can read
/// (the Python control plane then reads and refuses it with its own reason).
pub fn too_deep(body: &[u8], anthropic: bool) -> Option<String> {
    match measure(body, anthropic) {
        Depth::TooDeep(name) => Some(name),
        Depth::Within { .. } | Depth::Unread => None,
    }
}

/// `too_deep` for a body too deep for the parser: the brackets outside strings of each
/// member of the outer object, in its text (UTF-16 and UTF-32 decoded first, as json.loads
/// reads them). A repeated key counts with its last value, at its first place (as json.loads
/// keeps it). Left to the control plane (`None`): a body with a key written with an escape (it
/// may repeat another key), and one that is not a whole object with only whitespace after it.
fn scanned(body: &[u8], anthropic: bool) -> Option<String> {
    let text = decode_text(body).ok()?;
    let body: &[u8] = &text.bytes;
    // each member's key (`None`: escaped, or not a `str`) and its value's depth
    let mut members: Vec<(Option<&str>, u32)> = Vec::new();
    let mut depth = 0u32;
    let mut end = None;
    let mut i = 0;
    let mut expecting_key = false;
    while i < body.len() && end.is_none() {
        match body[i] {
            b'"' => {
                let from = i + 1;
                let mut j = from;
                while j < body.len() && body[j] != b'"' {
                    j += if body[j] == b'\\' { 2 } else { 1 };
                }
                if depth == 1 && expecting_key {
                    let key = std::str::from_utf8(body.get(from..j)?)
                        .ok()
                        .filter(|k| !k.contains('\\'));
                    members.push((key, 0));
                    expecting_key = false;
                }
                i = j;
            }
            b'{' | b'[' => {
                depth += 1;
                if depth == 1 {
                    expecting_key = true;
                } else if let Some((_, deepest)) = members.last_mut() {
                    *deepest = (*deepest).max(depth - 1);
                }
            }
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    end = Some(i + 1);
                }
            }
            b',' if depth == 1 => expecting_key = true,
            _ => {}
        }
        i += 1;
    }
    let whole = end.is_some_and(|end| body[end..].iter().all(|b| b" \t\r\n".contains(b)));
    if !whole {
        return None;
    }
    let mut last = HashMap::with_capacity(members.len());
    for &(key, deepest) in &members {
        last.insert(key?, deepest);
    }
    // (taken out at its first place: a repeated key is judged there, once)
    members.iter().find_map(|&(key, _)| {
        let key = key?;
        let deepest = last.remove(key)?;
        limit(key, anthropic)
            .is_some_and(|most| deepest > most)
            .then(|| key.to_string())
    })
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
    fn past_the_parsers_bound_a_repeated_key_is_its_last_value() {
        let deep = nested(600);
        let body = format!(r#"{{"x": {deep}, "messages": [], "x": 1}}"#);
        assert_eq!(measure(body.as_bytes(), false), Depth::Unread);
        let body = format!(r#"{{"x": 1, "messages": [], "x": {deep}}}"#);
        assert_eq!(too_deep(body.as_bytes(), false).as_deref(), Some("x"));
        let body = format!(r#"{{"x": {deep}, "y": {deep}, "x": 1}}"#);
        assert_eq!(too_deep(body.as_bytes(), false).as_deref(), Some("y"));
        // a key with an escape may be another's repeat: left to the control plane
        let body = format!(r#"{{"tools": {deep}, "t\u006fols": []}}"#);
        assert_eq!(measure(body.as_bytes(), false), Depth::Unread);
    }

    #[test]
    fn past_the_parsers_bound_only_a_whole_object_is_named() {
        let deep = nested(600);
        let cut = format!(r#"{{"messages": [], "tools": {}"#, "[".repeat(600));
        assert_eq!(measure(cut.as_bytes(), false), Depth::Unread);
        let more = format!(r#"{{"tools": {deep}}} x"#);
        assert_eq!(measure(more.as_bytes(), false), Depth::Unread);
        let spaced = format!("{{\"tools\": {deep}}} \r\n");
        assert_eq!(too_deep(spaced.as_bytes(), false).as_deref(), Some("tools"));
    }

    #[test]
    fn past_the_parsers_bound_utf16_and_utf32_are_read_as_their_text() {
        let body = format!(r#"{{"messages": [], "tools": {}}}"#, nested(600));
        for bytes in [utf16le(&body), utf32le(&body)] {
            assert_eq!(too_deep(&bytes, false).as_deref(), Some("tools"));
        }
    }

    fn utf16le(text: &str) -> Vec<u8> {
        text.encode_utf16().flat_map(u16::to_le_bytes).collect()
    }

    fn utf32le(text: &str) -> Vec<u8> {
        text.chars()
            .flat_map(|c| u32::from(c).to_le_bytes())
            .collect()
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

    #[test]
    fn a_body_read_whole_says_whether_its_messages_have_their_shape() {
        let within = |body: &str| measure(body.as_bytes(), false);
        assert_eq!(
            within(r#"{"messages": [{"role": "user", "content": "[["}], "n": 1}"#),
            Depth::Within {
                shaped: true,
                utf8: true
            }
        );
        for body in [
            r#"{"messages": []}"#,
            r#"{"messages": [{"role": 1}]}"#,
            r#"{"messages": [{"role": "user"}, "x"]}"#,
            r#"{"messages": {"role": "user"}}"#,
            r#"{"messages": [{"content": "user"}]}"#,
            r#"{"model": "m"}"#,
        ] {
            assert_eq!(
                within(body),
                Depth::Within {
                    shaped: false,
                    utf8: true
                },
                "{body}"
            );
        }
        // a repeated key is its last value, as json.loads reads it
        assert_eq!(
            within(r#"{"messages": [{"role": "user", "r\u006fle": 2}]}"#),
            Depth::Within {
                shaped: false,
                utf8: true
            }
        );
        assert_eq!(
            within(r#"{"messages": [{"role": 2, "role": "user"}]}"#),
            Depth::Within {
                shaped: true,
                utf8: true
            }
        );
    }

    #[test]
    fn a_body_read_whole_says_whether_it_is_strict_utf8() {
        let utf8 = |body: &[u8]| match measure(body, false) {
            Depth::Within { utf8, .. } => utf8,
            other => panic!("{other:?}"),
        };
        assert!(utf8(
            "{\"messages\": [{\"role\": \"caf\u{e9}\"}]}".as_bytes()
        ));
        assert!(utf8(br#"{"a": "\u00e9\ud83d\ude00"}"#));
        assert!(!utf8(br#"{"a": ["\ud800"]}"#));
        assert!(!utf8(br#"{"a": {"\udfff": 1}}"#));
        assert!(!utf8(b"{\"a\": \"\xed\xa0\x80\"}"));
        assert!(!utf8(b"{\x00}\x00"));
    }

    #[test]
    fn a_body_read_whole_gives_the_most_digits_of_any_int_in_it() {
        let digits = |body: &str| check(body.as_bytes(), false).map(|c| c.digits);
        let big = "7".repeat(5000);
        assert_eq!(digits(r#"{"messages": [{"role": "user"}]}"#), Ok(Some(0)));
        // inside the messages, a tool, a repeated key's replaced value (json.loads converts
        // it too), a negative int: its digits, not its sign
        for body in [
            format!(r#"{{"messages": [{{"role": "user", "n": [1, {big}]}}]}}"#),
            format!(r#"{{"messages": [], "tools": [{{"a": {{"b": -{big}}}}}]}}"#),
            format!(r#"{{"x": {big}, "messages": [], "x": 1}}"#),
        ] {
            assert_eq!(digits(&body), Ok(Some(5000)), "{body}");
        }
        // an int of 19 digits or fewer is no big int; a float, a string are no int
        let body = format!(
            r#"{{"a": 9223372036854775807, "b": 18446744073709551616, "c": 1{big}.5,
                "d": 1{big}e2, "e": "{big}"}}"#
        );
        assert_eq!(digits(&body), Ok(Some(20)));
        let checked = check(
            format!(r#"{{"messages": [{{"role": "u", "n": {big}}}]}}"#).as_bytes(),
            false,
        );
        assert_eq!(
            checked,
            Ok(Checked {
                depth: true,
                shape: true,
                utf8: true,
                digits: Some(5000)
            })
        );
    }

    #[test]
    fn a_body_not_read_whole_gives_no_digits() {
        let big = "7".repeat(5000);
        // too deep: refused for that first
        let body = format!(r#"{{"n": {big}, "tools": {}}}"#, nested(501));
        assert_eq!(check(body.as_bytes(), false), Err("tools".to_string()));
        let body = format!(r#"{{"n": {big}, "d\u0065ep": {}}}"#, nested(2000));
        assert_eq!(check(body.as_bytes(), false), Ok(Checked::default()));
        // not read whole: the control plane reads it (and its ints)
        for body in [
            format!(r#"{{"\ud800": 1, "n": {big}}}"#),
            format!(r#"{{"n": {big}, "x": "#),
            format!("[{big}]"),
        ] {
            assert_eq!(
                check(body.as_bytes(), false),
                Ok(Checked::default()),
                "{body}"
            );
        }
    }

    #[test]
    fn what_the_check_cannot_read_whole_is_left_unread() {
        assert_eq!(measure(b"[1]", false), Depth::Unread);
        assert_eq!(measure(b"{\"messages\": [", false), Depth::Unread);
        assert_eq!(measure(b"  ", false), Depth::Unread);
        let surrogate_key = r#"{"\ud800": 1, "messages": [{"role": "user"}]}"#;
        assert_eq!(measure(surrogate_key.as_bytes(), false), Depth::Unread);
        // its field the first too deep: the control plane names it
        let body = format!(r#"{{"\ud800": {}, "x": {}}}"#, nested(500), nested(500));
        assert_eq!(measure(body.as_bytes(), false), Depth::Unread);
        let body = format!(r#"{{"x": {}, "\ud800": {}}}"#, nested(500), nested(500));
        assert_eq!(
            measure(body.as_bytes(), false),
            Depth::TooDeep("x".to_string())
        );
        // past the parser's bound with no field named too deep: an escaped key
        let body = format!(r#"{{"d\u0065ep": {}}}"#, nested(2000));
        assert_eq!(measure(body.as_bytes(), false), Depth::Unread);
        let body = format!(r#"{{"messages": [{}]}}"#, message_of(600));
        assert_eq!(
            measure(body.as_bytes(), false),
            Depth::TooDeep("messages".to_string())
        );
    }
}
