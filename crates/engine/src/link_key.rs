//! The loose key of a chat message, read from its plain packing: what links a response to its
//! echo in the next request when the echo is not byte for byte the response.
//!
//! The library's linker compares `response_link_key(response) == link_key(message)` in
//! Python (`rollout_store/engine/messages.py`): role, text content and tool calls (name and
//! arguments, parsed when they are JSON text) must agree, null members of dicts aside. Here
//! each key is written as canonical bytes that are equal exactly when Python's `==` says the
//! keys are: numbers by value (`1 == 1.0 == True`, `-0.0 == 0`), dicts whatever their order,
//! lists apart from tuples. Where bytes cannot say what Python's `==` says (a NaN, a text part
//! whose text is not a string, a blob reference), the key is [`Undecided`] and the caller asks
//! Python. A message nested deeper than [`LINK_DEPTH`] has no key: it links only by an exact
//! echo, as in Python.

use std::borrow::Cow;

use crate::json::{self as ej, Value};
use crate::packed::{is_decimal, Item, Reader, EXT_BIGINT, EXT_SURROGATE};

/// How deeply a key's values may nest, the message counting as the first level (Python's
/// `LINK_DEPTH`).
pub const LINK_DEPTH: usize = 100;

/// Tool-call arguments whose JSON would nest deeper than this are compared as text (Python's
/// `LINK_DEPTH - 4`: the arguments are at the fifth level of their message).
const ARGUMENTS_ROOM: usize = LINK_DEPTH - 4;

/// The key cannot be told from bytes: the caller decides in Python.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Undecided;

/// A value as Python holds it after unpacking: lists and tuples apart, ints of any size.
#[derive(Clone, Debug)]
enum V<'a> {
    Nil,
    Bool(bool),
    Int(i128),
    /// decimal text of an int beyond 64 bits
    Big(Cow<'a, str>),
    Float(f64),
    /// generalized UTF-8 (a lone surrogate encoded on its own)
    Str(Cow<'a, [u8]>),
    List(Vec<V<'a>>),
    Tuple(Vec<V<'a>>),
    Map(Vec<(V<'a>, V<'a>)>),
}

/// Not the message's key: too deep (no key), or undecided.
enum Miss {
    TooDeep,
    Undecided,
}

impl From<Undecided> for Miss {
    fn from(_: Undecided) -> Self {
        Miss::Undecided
    }
}

fn read<'a>(reader: &mut Reader<'a>, depth: usize) -> Result<V<'a>, Undecided> {
    // (the packing's own nesting is bounded by the packer; this bound only keeps the
    // recursion finite on bytes that are not one of its packings)
    if depth > 1100 {
        return Err(Undecided);
    }
    Ok(match reader.next_item().map_err(|_| Undecided)? {
        Item::Nil => V::Nil,
        Item::Bool(b) => V::Bool(b),
        Item::Int(n) => V::Int(i128::from(n)),
        Item::UInt(n) => V::Int(i128::from(n)),
        Item::Float(f) => V::Float(f),
        Item::Str(s) => V::Str(Cow::Borrowed(s)),
        Item::Ext(code, payload) if code == EXT_SURROGATE => V::Str(Cow::Borrowed(payload)),
        // (Python reads other payloads its own way: `int(b"+5")` is 5)
        Item::Ext(code, payload) if code == EXT_BIGINT && is_decimal(payload) => V::Big(
            Cow::Borrowed(std::str::from_utf8(payload).map_err(|_| Undecided)?),
        ),
        Item::Array(n) => {
            let tuple = n > 0 && reader.peek_is_tuple_mark();
            if tuple {
                reader.next_item().map_err(|_| Undecided)?;
            }
            let count = if tuple { n - 1 } else { n };
            let items = (0..count)
                .map(|_| read(reader, depth + 1))
                .collect::<Result<Vec<_>, _>>()?;
            if tuple {
                V::Tuple(items)
            } else {
                V::List(items)
            }
        }
        Item::Map(n) => {
            let members = (0..n)
                .map(|_| Ok((read(reader, depth + 1)?, read(reader, depth + 1)?)))
                .collect::<Result<Vec<_>, Undecided>>()?;
            // keys Python's dict merges (a repeated key, `1` and `True`): its unpacking keeps
            // the last value, which a lookup or a dropped null here would not see
            let repeated = if let Some(mut texts) = members
                .iter()
                .map(|(key, _)| match key {
                    V::Str(text) => Some(text.as_ref()),
                    _ => None,
                })
                .collect::<Option<Vec<&[u8]>>>()
            {
                // (string keys, as a JSON object's: told apart by their bytes, no copy)
                texts.sort_unstable();
                texts.windows(2).any(|w| w[0] == w[1])
            } else {
                let mut keys = Vec::with_capacity(members.len());
                for (key, _) in &members {
                    let mut bytes = Vec::new();
                    canon(key, &mut bytes)?;
                    keys.push(bytes);
                }
                keys.sort_unstable();
                keys.windows(2).any(|w| w[0] == w[1])
            };
            if repeated {
                return Err(Undecided);
            }
            V::Map(members)
        }
        // bytes, blob references, echo placeholders: not a plain packing of a JSON value
        Item::Bin(_) | Item::Ext(..) => return Err(Undecided),
    })
}

fn from_json(value: &Value) -> V<'static> {
    match value {
        Value::Null => V::Nil,
        Value::Bool(b) => V::Bool(*b),
        Value::Int(n) => V::Int(i128::from(*n)),
        Value::BigInt(text) => V::Big(Cow::Owned(text.to_string())),
        Value::Float(f) => V::Float(*f),
        Value::Str(s) => V::Str(Cow::Owned(s.as_ref().bytes.to_vec())),
        Value::Array(items) => V::List(items.iter().map(from_json).collect()),
        Value::Object(members) => V::Map(
            members
                .iter()
                .map(|(k, v)| (V::Str(Cow::Owned(k.as_ref().bytes.to_vec())), from_json(v)))
                .collect(),
        ),
    }
}

impl<'a> V<'a> {
    fn is_str(&self, text: &[u8]) -> bool {
        matches!(self, V::Str(s) if s.as_ref() == text)
    }

    /// `dict.get(key)` for a str key (None: not a member).
    fn get(&self, key: &[u8]) -> Option<&V<'a>> {
        match self {
            V::Map(members) => members.iter().find(|(k, _)| k.is_str(key)).map(|(_, v)| v),
            _ => None,
        }
    }

    fn is_container(&self) -> bool {
        matches!(self, V::List(_) | V::Tuple(_) | V::Map(_))
    }

    /// Python's truth value.
    fn truthy(&self) -> bool {
        match self {
            V::Nil => false,
            V::Bool(b) => *b,
            V::Int(n) => *n != 0,
            V::Big(text) => text.bytes().any(|b| b.is_ascii_digit() && b != b'0'),
            V::Float(f) => *f != 0.0,
            V::Str(s) => !s.is_empty(),
            V::List(items) | V::Tuple(items) => !items.is_empty(),
            V::Map(members) => !members.is_empty(),
        }
    }
}

/// Python's `_without_nulls`: dicts without their null members, tuples as lists, strings
/// kept; too deep past `LINK_DEPTH` (`depth`: the levels around it).
fn without_nulls<'a>(value: &V<'a>, depth: usize) -> Result<V<'a>, Miss> {
    match value {
        V::Map(members) => {
            if depth >= LINK_DEPTH {
                return Err(Miss::TooDeep);
            }
            let mut kept = Vec::with_capacity(members.len());
            for (k, v) in members {
                if matches!(v, V::Nil) {
                    continue;
                }
                let v = if matches!(v, V::Str(_)) {
                    v.clone()
                } else {
                    without_nulls(v, depth + 1)?
                };
                kept.push((k.clone(), v));
            }
            Ok(V::Map(kept))
        }
        V::List(items) | V::Tuple(items) => {
            if depth >= LINK_DEPTH {
                return Err(Miss::TooDeep);
            }
            let items = items
                .iter()
                .map(|v| {
                    if matches!(v, V::Str(_)) {
                        Ok(v.clone())
                    } else {
                        without_nulls(v, depth + 1)
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(V::List(items))
        }
        other => Ok(other.clone()),
    }
}

/// Python's `_bounded`: the value itself, once it is known not to nest too deep.
fn bounded<'a>(value: &V<'a>, depth: usize) -> Result<V<'a>, Miss> {
    if value.is_container() {
        without_nulls(value, depth)?;
    }
    Ok(value.clone())
}

fn content_key<'a>(content: &V<'a>) -> Result<V<'a>, Miss> {
    match content {
        V::Nil => Ok(V::Str(Cow::Borrowed(b""))),
        V::List(items) | V::Tuple(items) => {
            let parts = items
                .iter()
                .map(|p| without_nulls(p, 2))
                .collect::<Result<Vec<_>, _>>()?;
            let all_text = parts.iter().all(|p| {
                matches!(p, V::Map(_)) && p.get(b"type").is_some_and(|t| t.is_str(b"text"))
            });
            if !all_text {
                return Ok(V::List(parts));
            }
            let mut joined = Vec::new();
            for part in &parts {
                match part.get(b"text") {
                    None => {}
                    Some(V::Str(s)) => joined.extend_from_slice(s),
                    // `str()` of another value: Python's repr, left to Python
                    Some(_) => return Err(Miss::Undecided),
                }
            }
            Ok(V::Str(Cow::Owned(joined)))
        }
        other => bounded(other, 1),
    }
}

fn arguments_key<'a>(arguments: Option<&V<'a>>, max_digits: usize) -> Result<V<'a>, Miss> {
    let tagged = |tag: &'static [u8], v: V<'a>| V::Tuple(vec![V::Str(Cow::Borrowed(tag)), v]);
    match arguments {
        Some(V::Str(text)) => {
            // json.loads of a str: no byte order mark, no encoding to detect (a NUL is never
            // JSON text: the engine's reader of bytes would take it for UTF-16 or 32)
            let plain = !text.starts_with("\u{feff}".as_bytes()) && !text.contains(&0);
            let parsed = if plain {
                ej::parse(text, ARGUMENTS_ROOM).ok()
            } else {
                None
            };
            match parsed {
                Some(value) => {
                    if too_many_digits(&value, max_digits) {
                        return Ok(tagged(b"text", V::Str(text.clone())));
                    }
                    Ok(tagged(b"json", from_json(&value)))
                }
                None => Ok(tagged(b"text", V::Str(text.clone()))),
            }
        }
        Some(other) => Ok(tagged(b"json", without_nulls(other, 4)?)),
        None => Ok(tagged(b"json", V::Nil)),
    }
}

fn too_many_digits(value: &Value, max_digits: usize) -> bool {
    match value {
        Value::BigInt(text) => max_digits > 0 && text.trim_start_matches('-').len() > max_digits,
        Value::Array(items) => items.iter().any(|v| too_many_digits(v, max_digits)),
        Value::Object(members) => members.iter().any(|(_, v)| too_many_digits(v, max_digits)),
        _ => false,
    }
}

fn tool_calls_key<'a>(calls: &V<'a>, max_digits: usize) -> Result<V<'a>, Miss> {
    let (V::List(items) | V::Tuple(items)) = calls else {
        return without_nulls(calls, 1);
    };
    let mut out = Vec::with_capacity(items.len());
    for call in items {
        match call.get(b"function") {
            Some(function @ V::Map(_)) => {
                let name = match function.get(b"name") {
                    Some(name @ V::Str(_)) => name.clone(),
                    Some(name) => bounded(name, 4)?,
                    None => V::Nil,
                };
                let arguments = arguments_key(function.get(b"arguments"), max_digits)?;
                out.push(V::Tuple(vec![name, arguments]));
            }
            _ => out.push(without_nulls(call, 2)?),
        }
    }
    Ok(V::Tuple(out))
}

fn key_of<'a>(message: &V<'a>, response: bool, max_digits: usize) -> Result<V<'a>, Miss> {
    if !matches!(message, V::Map(_)) {
        return Ok(V::Tuple(vec![
            V::Str(Cow::Borrowed(b"value")),
            bounded(message, 0)?,
        ]));
    }
    let role = match message.get(b"role") {
        // a response without a role is the assistant's
        None | Some(V::Nil) if response => V::Str(Cow::Borrowed(b"assistant")),
        Some(role @ V::Str(_)) => role.clone(),
        Some(role) => bounded(role, 1)?,
        None => V::Nil,
    };
    let content = match message.get(b"content") {
        Some(content @ V::Str(_)) => content.clone(),
        Some(content) => content_key(content)?,
        None => content_key(&V::Nil)?,
    };
    let calls = match message.get(b"tool_calls") {
        Some(calls) if calls.truthy() => tool_calls_key(calls, max_digits)?,
        _ => V::Tuple(Vec::new()),
    };
    Ok(V::Tuple(vec![role, content, calls]))
}

/// Canonical bytes of a value: equal exactly when Python's `==` says the values are.
fn canon(value: &V<'_>, out: &mut Vec<u8>) -> Result<(), Undecided> {
    match value {
        V::Nil => out.push(b'N'),
        V::Bool(b) => integer(&i128::from(*b).to_string(), out),
        V::Int(n) => integer(&n.to_string(), out),
        V::Big(text) => integer(text, out),
        V::Float(f) => {
            if f.is_nan() {
                return Err(Undecided); // equal only to itself, as an object: Python decides
            }
            if f.is_infinite() {
                out.extend_from_slice(if *f > 0.0 { b"I+" } else { b"I-" });
            } else if f.fract() == 0.0 {
                integer(&format!("{f:.0}"), out); // an integral float is that int
            } else {
                out.push(b'F');
                out.extend_from_slice(&f.to_bits().to_be_bytes());
            }
        }
        V::Str(s) => {
            out.push(b'S');
            out.extend_from_slice(&(s.len() as u64).to_be_bytes());
            out.extend_from_slice(s);
        }
        V::List(items) | V::Tuple(items) => {
            out.push(if matches!(value, V::List(_)) {
                b'L'
            } else {
                b'T'
            });
            out.extend_from_slice(&(items.len() as u64).to_be_bytes());
            for item in items {
                canon(item, out)?;
            }
        }
        V::Map(members) => {
            let mut pairs = Vec::with_capacity(members.len());
            for (k, v) in members {
                let (mut key, mut val) = (Vec::new(), Vec::new());
                canon(k, &mut key)?;
                canon(v, &mut val)?;
                pairs.push((key, val));
            }
            pairs.sort();
            if pairs.windows(2).any(|w| w[0].0 == w[1].0) {
                return Err(Undecided); // keys Python's dict would have merged
            }
            out.push(b'D');
            out.extend_from_slice(&(pairs.len() as u64).to_be_bytes());
            for (key, val) in pairs {
                out.extend_from_slice(&key);
                out.extend_from_slice(&val);
            }
        }
    }
    Ok(())
}

/// An int by its canonical decimal (`-0` is `0`, no leading zeros).
fn integer(text: &str, out: &mut Vec<u8>) {
    let (minus, digits) = match text.strip_prefix('-') {
        Some(digits) => (true, digits),
        None => (false, text),
    };
    let digits = digits.trim_start_matches('0');
    out.push(b'Z');
    if digits.is_empty() {
        out.push(b'0');
    } else {
        if minus {
            out.push(b'-');
        }
        out.extend_from_slice(digits.as_bytes());
    }
    out.push(b';');
}

/// The loose key of the message (or, `response`, of the response) whose plain packing is
/// `packed`: canonical bytes, equal for two messages exactly when their Python link keys are
/// equal; `Ok(None)` for a message nested too deep to have one. `max_digits`: the process's
/// int digit limit (0: none), past which `json.loads` refuses arguments' JSON.
///
/// # Errors
/// [`Undecided`] where bytes cannot say what Python's `==` would: the caller decides.
pub fn link_key(
    packed: &[u8],
    response: bool,
    max_digits: usize,
) -> Result<Option<Vec<u8>>, Undecided> {
    let mut reader = Reader::new(packed);
    let message = read(&mut reader, 0)?;
    if !reader.at_end() {
        return Err(Undecided);
    }
    match key_of(&message, response, max_digits) {
        Ok(key) => {
            let mut out = Vec::new();
            canon(&key, &mut out)?;
            Ok(Some(out))
        }
        Err(Miss::TooDeep) => Ok(None),
        Err(Miss::Undecided) => Err(Undecided),
    }
}

/// Whether `message` echoes `response` loosely (their keys equal; a message or response
/// without a key echoes nothing), or [`Undecided`].
///
/// # Errors
/// [`Undecided`] where either key is.
pub fn echoes(response: &[u8], message: &[u8], max_digits: usize) -> Result<bool, Undecided> {
    let response = link_key(response, true, max_digits)?;
    let message = link_key(message, false, max_digits)?;
    Ok(matches!((response, message), (Some(r), Some(m)) if r == m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::parse;
    use crate::packed::to_packed;

    fn packed(json: &str) -> Vec<u8> {
        to_packed(&parse(json.as_bytes(), 600).unwrap())
    }

    fn loose(response: &str, message: &str) -> Result<bool, Undecided> {
        echoes(&packed(response), &packed(message), 4300)
    }

    #[test]
    fn an_echo_that_drops_nulls_reorders_and_names_the_role_links() {
        let response = r#"{"content": "hi", "refusal": null, "tool_calls": null}"#;
        let message = r#"{"role": "assistant", "content": "hi"}"#;
        assert_eq!(loose(response, message), Ok(true));
        assert_eq!(
            loose(response, r#"{"role": "user", "content": "hi"}"#),
            Ok(false)
        );
        assert_eq!(
            loose(
                r#"{"role": "assistant", "content": null}"#,
                r#"{"role": "assistant", "content": ""}"#
            ),
            Ok(true)
        );
    }

    #[test]
    fn tool_call_arguments_compare_as_parsed_json() {
        let response = r#"{"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1, \"y\": [1.0, true]}"}}]}"#;
        let message = r#"{"role": "assistant", "tool_calls": [{"id": "b", "function": {"arguments": "{\"y\":[1,1],\"x\":1.0}", "name": "f"}}]}"#;
        assert_eq!(loose(response, message), Ok(true));
        let other = message.replace("\\\"x\\\":1.0", "\\\"x\\\":2");
        assert_eq!(loose(response, &other), Ok(false));
        // not JSON: compared as text
        let text = r#"{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}"#;
        assert_eq!(loose(text, text), Ok(true));
    }

    #[test]
    fn text_parts_join_and_numbers_compare_by_value() {
        let parts = r#"{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "x": null}]}"#;
        assert_eq!(
            loose(parts, r#"{"role": "assistant", "content": "ab"}"#),
            Ok(true)
        );
        assert_eq!(
            loose(
                r#"{"role": "assistant", "content": [{"type": "text", "text": 1}]}"#,
                parts
            ),
            Err(Undecided)
        );
        assert_eq!(loose("[1, 2.0, true]", "[1.0, 2, 1]"), Ok(true));
        assert_eq!(loose("[-0.0]", "[0]"), Ok(true));
        assert_eq!(loose("[NaN]", "[NaN]"), Err(Undecided));
        assert_eq!(loose("[1e400]", "[1e400]"), Ok(true));
        assert_eq!(
            loose("[9007199254740993]", "[9007199254740992.0]"),
            Ok(false)
        );
        assert_eq!(
            loose("[18446744073709551616]", "[1.8446744073709552e19]"),
            Ok(true)
        );
    }

    #[test]
    fn a_message_nested_too_deep_has_no_key() {
        let deep = format!(
            r#"{{"role": "assistant", "content": {}1{}}}"#,
            "[".repeat(LINK_DEPTH),
            "]".repeat(LINK_DEPTH)
        );
        assert_eq!(link_key(&packed(&deep), false, 0), Ok(None));
        assert_eq!(loose(&deep, &deep), Ok(false));
        let shallow = deep.replacen('[', "", 2).replacen(']', "", 2);
        assert!(link_key(&packed(&shallow), false, 0).unwrap().is_some());
    }

    #[test]
    fn keys_a_dict_merges_or_big_ints_python_reads_its_own_way_are_undecided() {
        use crate::packed::{write_bool, write_ext, write_int, write_map_header, write_str};
        let response = packed(r#"{"content": "hi"}"#);
        // `{"role": "user", "role": "assistant", "content": "hi"}`: Python's dict keeps the
        // last role, the assistant's
        let mut repeated = Vec::new();
        write_map_header(3, &mut repeated);
        for (key, value) in [("role", "user"), ("role", "assistant"), ("content", "hi")] {
            write_str(key.as_bytes(), &mut repeated);
            write_str(value.as_bytes(), &mut repeated);
        }
        assert_eq!(echoes(&response, &repeated, 0), Err(Undecided));
        // `{1: "x", True: None}` is `{1: None}` in Python: no member once nulls go
        let mut merged = Vec::new();
        write_map_header(1, &mut merged);
        write_str(b"content", &mut merged);
        write_map_header(2, &mut merged);
        write_int(1, &mut merged);
        write_str(b"x", &mut merged);
        write_bool(true, &mut merged);
        merged.push(0xc0);
        assert_eq!(link_key(&merged, false, 0), Err(Undecided));
        // `int(b"+5")` is 5, and `int(b"0")` is false
        let mut plus = Vec::new();
        write_ext(EXT_BIGINT, b"+5", &mut plus);
        assert_eq!(link_key(&plus, false, 0), Err(Undecided));
        let mut zero_calls = packed(r#"{"role": "assistant", "content": "hi"}"#);
        zero_calls[0] += 1; // one member more
        write_str(b"tool_calls", &mut zero_calls);
        write_ext(EXT_BIGINT, b"00", &mut zero_calls);
        assert_eq!(echoes(&response, &zero_calls, 0), Ok(true));
    }

    #[test]
    fn a_packing_that_is_no_plain_value_is_undecided() {
        let mut blob = Vec::new();
        crate::packed::write_blob_ref(3, &mut blob);
        assert_eq!(link_key(&blob, false, 0), Err(Undecided));
        assert_eq!(link_key(b"\x91", false, 0), Err(Undecided));
        assert_eq!(link_key(b"\x90\x90", false, 0), Err(Undecided));
    }
}
