//! Writing `json.dumps(value)`'s bytes: separators `", "` and `": "`, `ensure_ascii` escapes
//! (`\uXXXX` in lower case, astral code points as surrogate pairs, lone surrogates as
//! themselves), floats as `float.__repr__`.

use super::float::write_float;
use super::value::{Str, Value};

/// `json.dumps(value)` as bytes (ASCII).
pub fn to_json(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write_value(value, &mut out);
    out
}

/// Append `json.dumps(value)`.
pub fn write_value(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => write_null(out),
        Value::Bool(b) => write_bool(*b, out),
        Value::Int(i) => write_int(*i, out),
        Value::BigInt(text) => out.extend_from_slice(text.as_bytes()),
        Value::Float(f) => write_float(*f, out),
        Value::Str(s) => write_str(s.as_ref(), out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.extend_from_slice(b", ");
                }
                write_value(item, out);
            }
            out.push(b']');
        }
        Value::Object(members) => {
            out.push(b'{');
            for (i, (key, item)) in members.iter().enumerate() {
                if i > 0 {
                    out.extend_from_slice(b", ");
                }
                write_str(key.as_ref(), out);
                out.extend_from_slice(b": ");
                write_value(item, out);
            }
            out.push(b'}');
        }
    }
}

pub fn write_null(out: &mut Vec<u8>) {
    out.extend_from_slice(b"null");
}

pub fn write_bool(value: bool, out: &mut Vec<u8>) {
    out.extend_from_slice(if value { b"true" } else { b"false" });
}

pub fn write_int(value: i64, out: &mut Vec<u8>) {
    let mut buffer = itoa::Buffer::new();
    out.extend_from_slice(buffer.format(value).as_bytes());
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn push_u_escape(out: &mut Vec<u8>, unit: u32) {
    out.extend_from_slice(&[
        b'\\',
        b'u',
        HEX[(unit >> 12 & 0xF) as usize],
        HEX[(unit >> 8 & 0xF) as usize],
        HEX[(unit >> 4 & 0xF) as usize],
        HEX[(unit & 0xF) as usize],
    ]);
}

/// Append one code point as `json.dumps` escapes it inside a string.
fn push_escaped(out: &mut Vec<u8>, c: u32) {
    match c {
        0x22 => out.extend_from_slice(b"\\\""),
        0x5C => out.extend_from_slice(b"\\\\"),
        0x0A => out.extend_from_slice(b"\\n"),
        0x0D => out.extend_from_slice(b"\\r"),
        0x09 => out.extend_from_slice(b"\\t"),
        0x08 => out.extend_from_slice(b"\\b"),
        0x0C => out.extend_from_slice(b"\\f"),
        0x20..=0x7E => out.push(c as u8),
        0x1_0000.. => {
            let v = c - 0x1_0000;
            push_u_escape(out, 0xD800 | (v >> 10));
            push_u_escape(out, 0xDC00 | (v & 0x3FF));
        }
        _ => push_u_escape(out, c),
    }
}

fn plain_ascii(c: u8) -> bool {
    (0x20..0x7F).contains(&c) && c != b'"' && c != b'\\'
}

/// Append a string given as code points (Python's str storage), quoted and escaped.
pub fn write_code_points<I: IntoIterator<Item = u32>>(code_points: I, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in code_points {
        push_escaped(out, c);
    }
    out.push(b'"');
}

/// Append a string of generalized UTF-8, quoted and escaped.
pub fn write_str(s: Str<'_>, out: &mut Vec<u8>) {
    let b = s.bytes;
    out.push(b'"');
    let mut i = 0;
    while i < b.len() {
        let run = b[i..].iter().take_while(|&&c| plain_ascii(c)).count();
        out.extend_from_slice(&b[i..i + run]);
        i += run;
        if i >= b.len() {
            break;
        }
        let lead = b[i];
        let (len, init) = match lead {
            0xC0..=0xDF => (2, u32::from(lead & 0x1F)),
            0xE0..=0xEF => (3, u32::from(lead & 0x0F)),
            0xF0..=0xF7 => (4, u32::from(lead & 0x07)),
            // ASCII, or not generalized UTF-8: the byte's own code point, never a panic
            _ => (1, u32::from(lead)),
        };
        let len = if i + len <= b.len() { len } else { 1 };
        let c = b[i + 1..i + len]
            .iter()
            .fold(init, |acc, &cont| acc << 6 | u32::from(cont & 0x3F));
        push_escaped(out, if len == 1 { u32::from(lead) } else { c });
        i += len;
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::super::{parse, JsonStr, DEFAULT_MAX_DEPTH};
    use super::*;

    fn dumps(value: &Value) -> String {
        String::from_utf8(to_json(value)).unwrap()
    }

    #[test]
    fn separators_and_scalars_as_json_dumps() {
        let value = Value::Object(vec![
            ("a".into(), Value::Int(1)),
            ("b".into(), Value::Float(1.0)),
            ("c".into(), Value::Bool(true)),
            ("d".into(), Value::Null),
            ("e".into(), Value::Array(vec![])),
            ("f".into(), Value::Object(vec![])),
            (
                "g".into(),
                Value::BigInt("123456789012345678901234567890".into()),
            ),
            (
                "h".into(),
                Value::Array(vec![Value::Float(-0.0), Value::Float(f64::INFINITY)]),
            ),
        ]);
        assert_eq!(
            dumps(&value),
            r#"{"a": 1, "b": 1.0, "c": true, "d": null, "e": [], "f": {}, "g": 123456789012345678901234567890, "h": [-0.0, Infinity]}"#
        );
    }

    #[test]
    fn ascii_escapes_as_json_dumps() {
        let s = Value::Str(JsonStr::from(
            "q\"b\\n\n\r\t\u{8}\u{c}\u{1}\u{7f}é\u{2028}\u{1F600}/",
        ));
        assert_eq!(
            dumps(&s),
            r#""q\"b\\n\n\r\t\b\f\u0001\u007f\u00e9\u2028\ud83d\ude00/""#
        );
        let lone = parse(br#""\udc00\ud800""#, DEFAULT_MAX_DEPTH).unwrap();
        assert_eq!(dumps(&lone), r#""\udc00\ud800""#);
    }

    #[test]
    fn code_points_escape_like_str() {
        let mut out = Vec::new();
        write_code_points([0x61, 0xD800, 0x1F600, 0x22], &mut out);
        assert_eq!(out, br#""a\ud800\ud83d\ude00\"""#);
    }

    #[test]
    fn parse_then_write_is_stable() {
        let text =
            r#"{"x": [1, 2.5, "\u00e9", {"y": null}], "z": -1e-07, "w": 12345678901234567890}"#;
        let value = parse(text.as_bytes(), DEFAULT_MAX_DEPTH).unwrap();
        assert_eq!(dumps(&value), text);
    }

    #[test]
    fn invalid_bytes_do_not_panic() {
        let mut out = Vec::new();
        write_str(
            Str {
                bytes: b"\xFF\xE0",
                surrogates: false,
            },
            &mut out,
        );
        assert_eq!(out, br#""\u00ff\u00e0""#);
    }
}
