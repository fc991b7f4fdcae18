//! The JSON parser: `CPython`'s `json.loads` grammar and values (its scanner in `_json.c`), on
//! bytes, with a depth bound and errors at byte offsets.
//!
//! The parser hands every value to a [`Sink`], so the same scan builds a [`super::Value`] tree
//! or, in the bindings, Python objects directly.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use super::encoding::{decode_text, push_code_point};
use super::value::Str;

/// The nesting bound used when none is given (`rollout_store.MAX_DEPTH`).
pub const DEFAULT_MAX_DEPTH: usize = 500;

/// What went wrong, in `json.loads`' words where it has some.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidUtf8,
    InvalidUtf16,
    InvalidUtf32,
    ExpectingValue,
    ExpectingPropertyName,
    ExpectingColon,
    ExpectingComma,
    UnterminatedString,
    InvalidControlCharacter,
    InvalidEscape,
    InvalidUnicodeEscape,
    ExtraData,
    /// nesting deeper than the bound (the bound)
    TooDeep(usize),
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorKind::InvalidUtf8 => f.write_str("invalid UTF-8"),
            ErrorKind::InvalidUtf16 => f.write_str("invalid UTF-16"),
            ErrorKind::InvalidUtf32 => f.write_str("invalid UTF-32"),
            ErrorKind::ExpectingValue => f.write_str("Expecting value"),
            ErrorKind::ExpectingPropertyName => {
                f.write_str("Expecting property name enclosed in double quotes")
            }
            ErrorKind::ExpectingColon => f.write_str("Expecting ':' delimiter"),
            ErrorKind::ExpectingComma => f.write_str("Expecting ',' delimiter"),
            ErrorKind::UnterminatedString => f.write_str("Unterminated string starting"),
            ErrorKind::InvalidControlCharacter => f.write_str("Invalid control character"),
            ErrorKind::InvalidEscape => f.write_str("Invalid \\escape"),
            ErrorKind::InvalidUnicodeEscape => f.write_str("Invalid \\uXXXX escape"),
            ErrorKind::ExtraData => f.write_str("Extra data"),
            ErrorKind::TooDeep(depth) => write!(f, "nesting deeper than {depth} levels"),
        }
    }
}

/// A syntax or encoding error at a byte offset of the input (of its UTF-8 text when the input
/// was UTF-16 or UTF-32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParseError {
    pub kind: ErrorKind,
    pub offset: usize,
}

impl ParseError {
    pub fn new(kind: ErrorKind, offset: usize) -> Self {
        Self { kind, offset }
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at byte {}", self.kind, self.offset)
    }
}

impl std::error::Error for ParseError {}

/// Why [`parse_with`] failed: the text, or the sink.
#[derive(Debug)]
pub enum Failure<E> {
    Syntax(ParseError),
    Sink(E),
}

/// An object key: borrowed from the input unless it held escapes.
#[derive(Debug)]
pub struct Key<'a> {
    pub bytes: Cow<'a, [u8]>,
    pub surrogates: bool,
}

impl Key<'_> {
    pub fn as_str(&self) -> Str<'_> {
        Str {
            bytes: &self.bytes,
            surrogates: self.surrogates,
        }
    }
}

/// Receives the values the parser reads, innermost first.
pub trait Sink {
    type Value;
    type Error;
    /// # Errors
    /// Whatever the sink cannot build.
    fn null(&mut self) -> Result<Self::Value, Self::Error>;
    /// # Errors
    /// Whatever the sink cannot build.
    fn bool(&mut self, value: bool) -> Result<Self::Value, Self::Error>;
    /// # Errors
    /// Whatever the sink cannot build.
    fn int(&mut self, value: i64) -> Result<Self::Value, Self::Error>;
    /// An int outside `i64`, as its decimal text (ASCII, canonical).
    /// # Errors
    /// Whatever the sink cannot build (Python refuses ints beyond its digit limit).
    fn big_int(&mut self, text: &str) -> Result<Self::Value, Self::Error>;
    /// # Errors
    /// Whatever the sink cannot build.
    fn float(&mut self, value: f64) -> Result<Self::Value, Self::Error>;
    /// # Errors
    /// Whatever the sink cannot build.
    fn string(&mut self, value: Str<'_>) -> Result<Self::Value, Self::Error>;
    /// # Errors
    /// Whatever the sink cannot build.
    fn array(&mut self, items: Vec<Self::Value>) -> Result<Self::Value, Self::Error>;
    /// Members in first-key order, each key once (a repeated key's last value).
    /// # Errors
    /// Whatever the sink cannot build.
    fn object(&mut self, members: Vec<(Key<'_>, Self::Value)>) -> Result<Self::Value, Self::Error>;
}

/// Parse `input` as `json.loads(input)` would, into a [`super::Value`].
///
/// # Errors
/// Text that is not JSON, or nested deeper than `max_depth`.
pub fn parse(input: &[u8], max_depth: usize) -> Result<super::Value, ParseError> {
    parse_with(input, max_depth, &mut super::ValueBuilder).map_err(|f| match f {
        Failure::Syntax(e) => e,
        Failure::Sink(never) => match never {},
    })
}

/// Parse `input` as `json.loads(input)` would, handing each value to `sink`.
///
/// # Errors
/// Text that is not JSON, nested deeper than `max_depth`, or the sink's own error.
pub fn parse_with<S: Sink>(
    input: &[u8],
    max_depth: usize,
    sink: &mut S,
) -> Result<S::Value, Failure<S::Error>> {
    let text = decode_text(input).map_err(Failure::Syntax)?;
    let mut parser = Parser {
        b: &text.bytes,
        pos: 0,
        surrogates: text.surrogates,
        max_depth,
        sink,
    };
    parser.run().map_err(|f| match f {
        Failure::Syntax(e) => Failure::Syntax(ParseError::new(e.kind, e.offset + text.skipped)),
        Failure::Sink(e) => Failure::Sink(e),
    })
}

struct Parser<'t, 's, S> {
    b: &'t [u8],
    pos: usize,
    /// the text holds surrogate code points somewhere (strings must be checked for them)
    surrogates: bool,
    max_depth: usize,
    sink: &'s mut S,
}

type Res<T, E> = Result<T, Failure<E>>;

fn syntax<T, E>(kind: ErrorKind, offset: usize) -> Res<T, E> {
    Err(Failure::Syntax(ParseError::new(kind, offset)))
}

fn hex_value(c: u8) -> Option<u32> {
    match c {
        b'0'..=b'9' => Some(u32::from(c - b'0')),
        b'a'..=b'f' => Some(u32::from(c - b'a' + 10)),
        b'A'..=b'F' => Some(u32::from(c - b'A' + 10)),
        _ => None,
    }
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Bytes of `word` below `n` (n <= 128) flagged in their high bit; the lowest flag is exact.
fn below(word: u64, n: u8) -> u64 {
    word.wrapping_sub(ONES * u64::from(n)) & !word & HIGHS
}

/// The first offset from `i` holding a quote, a backslash or a control character (the bytes
/// a string's plain run ends at), or `b.len()`; eight bytes a step.
fn run_end(b: &[u8], mut i: usize) -> usize {
    while i + 8 <= b.len() {
        let mut chunk = [0u8; 8];
        chunk.copy_from_slice(&b[i..i + 8]);
        let word = u64::from_le_bytes(chunk);
        let hits =
            below(word ^ (ONES * 0x22), 1) | below(word ^ (ONES * 0x5C), 1) | below(word, 0x20);
        if hits != 0 {
            return i + (hits.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < b.len() && !matches!(b[i], b'"' | b'\\' | 0..=0x1F) {
        i += 1;
    }
    i
}

/// Whether generalized UTF-8 bytes hold a surrogate (`ED A0..BF ..`).
fn holds_surrogate(bytes: &[u8]) -> bool {
    bytes
        .windows(2)
        .any(|w| w[0] == 0xED && (0xA0..=0xBF).contains(&w[1]))
}

impl<'t, S: Sink> Parser<'t, '_, S> {
    fn run(&mut self) -> Res<S::Value, S::Error> {
        self.skip_ws();
        let value = self.value(0)?;
        self.skip_ws();
        if self.pos != self.b.len() {
            return syntax(ErrorKind::ExtraData, self.pos);
        }
        Ok(value)
    }

    fn skip_ws(&mut self) {
        while let Some(&c) = self.b.get(self.pos) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                break;
            }
            self.pos += 1;
        }
    }

    fn sink<T>(result: Result<T, S::Error>) -> Res<T, S::Error> {
        result.map_err(Failure::Sink)
    }

    fn literal(&mut self, word: &[u8]) -> bool {
        if self.b[self.pos..].starts_with(word) {
            self.pos += word.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Res<S::Value, S::Error> {
        let at = self.pos;
        let Some(&c) = self.b.get(at) else {
            return syntax(ErrorKind::ExpectingValue, at);
        };
        match c {
            b'"' => {
                let (bytes, surrogates) = self.string()?;
                Self::sink(self.sink.string(Str {
                    bytes: &bytes,
                    surrogates,
                }))
            }
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'n' if self.literal(b"null") => Self::sink(self.sink.null()),
            b't' if self.literal(b"true") => Self::sink(self.sink.bool(true)),
            b'f' if self.literal(b"false") => Self::sink(self.sink.bool(false)),
            b'N' if self.literal(b"NaN") => Self::sink(self.sink.float(f64::NAN)),
            b'I' if self.literal(b"Infinity") => Self::sink(self.sink.float(f64::INFINITY)),
            b'-' if self.literal(b"-Infinity") => Self::sink(self.sink.float(f64::NEG_INFINITY)),
            b'-' | b'0'..=b'9' => self.number(),
            _ => syntax(ErrorKind::ExpectingValue, at),
        }
    }

    fn number(&mut self) -> Res<S::Value, S::Error> {
        let b = self.b;
        let start = self.pos;
        let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
        let mut i = start;
        if b[i] == b'-' {
            i += 1;
        }
        if !digit(i) {
            return syntax(ErrorKind::ExpectingValue, start);
        }
        if b[i] == b'0' {
            i += 1;
        } else {
            while digit(i) {
                i += 1;
            }
        }
        let mut is_float = false;
        if b.get(i) == Some(&b'.') && digit(i + 1) {
            i += 2;
            while digit(i) {
                i += 1;
            }
            is_float = true;
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            let mut j = i + 1;
            if matches!(b.get(j), Some(b'+' | b'-')) {
                j += 1;
            }
            if digit(j) {
                while digit(j) {
                    j += 1;
                }
                i = j;
                is_float = true;
            }
        }
        self.pos = i;
        // the scanned bytes are ASCII digits, signs, '.' and 'e'
        let text = std::str::from_utf8(&b[start..i]).unwrap_or_default();
        if is_float {
            // Rust's float parsing is correctly rounded and gives +-inf beyond the range
            let value = text.parse::<f64>().unwrap_or(f64::NAN);
            Self::sink(self.sink.float(value))
        } else if let Ok(value) = text.parse::<i64>() {
            Self::sink(self.sink.int(value))
        } else {
            Self::sink(self.sink.big_int(text))
        }
    }

    /// A string at `self.pos` (its opening quote): its bytes and whether they hold a surrogate.
    fn string(&mut self) -> Res<(Cow<'t, [u8]>, bool), S::Error> {
        let b = self.b;
        let open = self.pos;
        let start = open + 1;
        // the common case: no escape, borrowed from the input
        let i = run_end(b, start);
        match b.get(i) {
            Some(b'"') => {
                self.pos = i + 1;
                let bytes = &b[start..i];
                let surrogates = self.surrogates && holds_surrogate(bytes);
                return Ok((Cow::Borrowed(bytes), surrogates));
            }
            Some(b'\\') => {}
            Some(_) => return syntax(ErrorKind::InvalidControlCharacter, i),
            None => return syntax(ErrorKind::UnterminatedString, open),
        }
        let mut i = i;
        let mut out = Vec::with_capacity(i - start + 16);
        out.extend_from_slice(&b[start..i]);
        let mut surrogates = self.surrogates && holds_surrogate(&out);
        loop {
            let Some(&c) = b.get(i) else {
                return syntax(ErrorKind::UnterminatedString, open);
            };
            match c {
                b'"' => {
                    self.pos = i + 1;
                    return Ok((Cow::Owned(out), surrogates));
                }
                b'\\' => {
                    let Some(&e) = b.get(i + 1) else {
                        return syntax(ErrorKind::UnterminatedString, open);
                    };
                    let simple = match e {
                        b'"' => Some(b'"'),
                        b'\\' => Some(b'\\'),
                        b'/' => Some(b'/'),
                        b'b' => Some(8),
                        b'f' => Some(12),
                        b'n' => Some(b'\n'),
                        b'r' => Some(b'\r'),
                        b't' => Some(b'\t'),
                        b'u' => None,
                        _ => return syntax(ErrorKind::InvalidEscape, i),
                    };
                    if let Some(byte) = simple {
                        out.push(byte);
                        i += 2;
                    } else {
                        let (code, next, lone) = self.unicode_escape(i)?;
                        surrogates |= lone;
                        push_code_point(&mut out, code);
                        i = next;
                    }
                }
                c if c < 0x20 => return syntax(ErrorKind::InvalidControlCharacter, i),
                _ => {
                    // copy the run up to the next quote, backslash or control character
                    let end = run_end(b, i);
                    let run = &b[i..end];
                    surrogates |= self.surrogates && holds_surrogate(run);
                    out.extend_from_slice(run);
                    i = end;
                }
            }
        }
    }

    /// The `\uXXXX` escape at `at` (its backslash), joined with a following escaped low
    /// surrogate when it is a high one: the code point, the offset after it, whether it is a
    /// lone surrogate.
    fn unicode_escape(&self, at: usize) -> Res<(u32, usize, bool), S::Error> {
        let b = self.b;
        let hex4 = |from: usize| -> Option<u32> {
            let digits = b.get(from..from + 4)?;
            digits
                .iter()
                .try_fold(0u32, |acc, &d| Some(acc << 4 | hex_value(d)?))
        };
        let first = at + 2;
        // like json's scanner, four digits and at least one more character must follow
        if first + 4 >= b.len() {
            return syntax(ErrorKind::InvalidUnicodeEscape, at);
        }
        let Some(code) = hex4(first) else {
            return syntax(ErrorKind::InvalidUnicodeEscape, at);
        };
        let end = first + 4;
        if (0xD800..0xDC00).contains(&code)
            && end + 6 < b.len()
            && b[end] == b'\\'
            && b[end + 1] == b'u'
        {
            let Some(low) = hex4(end + 2) else {
                return syntax(ErrorKind::InvalidUnicodeEscape, end);
            };
            if (0xDC00..0xE000).contains(&low) {
                let joined = 0x1_0000 + ((code - 0xD800) << 10) + (low - 0xDC00);
                return Ok((joined, end + 6, false));
            }
        }
        Ok((code, end, (0xD800..0xE000).contains(&code)))
    }

    fn enter(&self, depth: usize) -> Res<(), S::Error> {
        if depth > self.max_depth {
            return syntax(ErrorKind::TooDeep(self.max_depth), self.pos);
        }
        Ok(())
    }

    fn array(&mut self, depth: usize) -> Res<S::Value, S::Error> {
        self.enter(depth)?;
        self.pos += 1;
        self.skip_ws();
        let mut items = Vec::new();
        if self.b.get(self.pos) == Some(&b']') {
            self.pos += 1;
            return Self::sink(self.sink.array(items));
        }
        loop {
            items.push(self.value(depth)?);
            self.skip_ws();
            match self.b.get(self.pos) {
                Some(b']') => {
                    self.pos += 1;
                    return Self::sink(self.sink.array(items));
                }
                Some(b',') => {
                    self.pos += 1;
                    self.skip_ws();
                }
                _ => return syntax(ErrorKind::ExpectingComma, self.pos),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Res<S::Value, S::Error> {
        self.enter(depth)?;
        self.pos += 1;
        self.skip_ws();
        let mut members: Vec<(Key<'t>, S::Value)> = Vec::new();
        if self.b.get(self.pos) == Some(&b'}') {
            self.pos += 1;
            return Self::sink(self.sink.object(members));
        }
        loop {
            if self.b.get(self.pos) != Some(&b'"') {
                return syntax(ErrorKind::ExpectingPropertyName, self.pos);
            }
            let (bytes, surrogates) = self.string()?;
            self.skip_ws();
            if self.b.get(self.pos) != Some(&b':') {
                return syntax(ErrorKind::ExpectingColon, self.pos);
            }
            self.pos += 1;
            self.skip_ws();
            let value = self.value(depth)?;
            members.push((Key { bytes, surrogates }, value));
            self.skip_ws();
            match self.b.get(self.pos) {
                Some(b'}') => {
                    self.pos += 1;
                    return Self::sink(self.sink.object(dedup(members)));
                }
                Some(b',') => {
                    self.pos += 1;
                    self.skip_ws();
                }
                _ => return syntax(ErrorKind::ExpectingComma, self.pos),
            }
        }
    }
}

/// Members as a Python dict keeps them: a repeated key stays at its first position and takes
/// its last value.
fn dedup<V>(members: Vec<(Key<'_>, V)>) -> Vec<(Key<'_>, V)> {
    let n = members.len();
    let repeated = if n < 2 {
        false
    } else if n <= 8 {
        (1..n).any(|j| (0..j).any(|i| members[i].0.bytes == members[j].0.bytes))
    } else {
        let mut seen = std::collections::HashSet::with_capacity(n);
        !members.iter().all(|(k, _)| seen.insert(&*k.bytes))
    };
    if !repeated {
        return members;
    }
    let firsts: Vec<usize> = {
        let mut first_at: HashMap<&[u8], usize> = HashMap::with_capacity(n);
        members
            .iter()
            .enumerate()
            .map(|(i, (k, _))| *first_at.entry(&*k.bytes).or_insert(i))
            .collect()
    };
    let mut slot = vec![0usize; n];
    let mut out: Vec<(Key<'_>, V)> = Vec::with_capacity(n);
    for (i, (member, first)) in members.into_iter().zip(firsts).enumerate() {
        if first == i {
            slot[i] = out.len();
            out.push(member);
        } else {
            out[slot[first]].1 = member.1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{JsonStr, Value};
    use super::*;

    fn ok(text: &str) -> Value {
        parse(text.as_bytes(), DEFAULT_MAX_DEPTH).unwrap()
    }

    fn err(text: &[u8]) -> (ErrorKind, usize) {
        let e = parse(text, DEFAULT_MAX_DEPTH).unwrap_err();
        (e.kind, e.offset)
    }

    fn s(text: &str) -> Value {
        Value::Str(JsonStr::from(text))
    }

    #[test]
    fn scalars_keep_their_types() {
        assert_eq!(ok("1"), Value::Int(1));
        assert_eq!(ok("1.0"), Value::Float(1.0));
        assert_eq!(ok("true"), Value::Bool(true));
        assert_eq!(ok("null"), Value::Null);
        assert_eq!(ok("-0"), Value::Int(0));
        assert_eq!(ok("-0.0"), Value::Float(-0.0));
        assert_ne!(ok("-0.0"), Value::Float(0.0));
        assert_eq!(ok(" \t\n\r\"a\" \n"), s("a"));
    }

    #[test]
    fn big_ints_keep_their_digits() {
        assert_eq!(ok("9223372036854775807"), Value::Int(i64::MAX));
        assert_eq!(ok("-9223372036854775808"), Value::Int(i64::MIN));
        assert_eq!(
            ok("9223372036854775808"),
            Value::BigInt("9223372036854775808".into())
        );
        let digits = format!("-{}", "7".repeat(5000));
        assert_eq!(ok(&digits), Value::BigInt(digits.as_str().into()));
    }

    #[test]
    fn floats_correctly_rounded_and_constants() {
        assert_eq!(ok("1e400"), Value::Float(f64::INFINITY));
        assert_eq!(ok("-1e400"), Value::Float(f64::NEG_INFINITY));
        assert_eq!(ok("1e-400"), Value::Float(0.0));
        assert_eq!(ok("0.1"), Value::Float(0.1));
        assert_eq!(
            ok("2.2250738585072011e-308"),
            Value::Float(2.225_073_858_507_201e-308)
        );
        assert_eq!(ok("1E+2"), Value::Float(100.0));
        assert_eq!(ok("Infinity"), Value::Float(f64::INFINITY));
        assert_eq!(ok("-Infinity"), Value::Float(f64::NEG_INFINITY));
        assert!(matches!(ok("NaN"), Value::Float(x) if x.is_nan()));
        assert_eq!(err(b"-NaN"), (ErrorKind::ExpectingValue, 0));
        assert_eq!(err(b"nan"), (ErrorKind::ExpectingValue, 0));
    }

    #[test]
    fn numbers_stop_where_json_stops() {
        assert_eq!(err(b"01"), (ErrorKind::ExtraData, 1));
        assert_eq!(err(b"1."), (ErrorKind::ExtraData, 1));
        assert_eq!(err(b"1e"), (ErrorKind::ExtraData, 1));
        assert_eq!(err(b"[1.]"), (ErrorKind::ExpectingComma, 2));
        assert_eq!(err(b"-"), (ErrorKind::ExpectingValue, 0));
        assert_eq!(err(b"+1"), (ErrorKind::ExpectingValue, 0));
    }

    #[test]
    fn escapes_and_surrogates() {
        assert_eq!(ok(r#""a\"\\\/\b\f\n\r\t""#), s("a\"\\/\u{8}\u{c}\n\r\t"));
        assert_eq!(ok(r#""\u00e9\uD83D\uDE00""#), s("é\u{1F600}"));
        let Value::Str(lone) = ok(r#""\ud800x""#) else {
            panic!("not a string")
        };
        assert!(lone.has_surrogates());
        assert_eq!(lone.bytes(), b"\xED\xA0\x80x");
        // a high surrogate followed by a non-low escape stays lone, the next escape read alone
        let Value::Str(two) = ok(r#""\ud800\u0041""#) else {
            panic!("not a string")
        };
        assert_eq!(two.bytes(), b"\xED\xA0\x80A");
        // an escaped low surrogate after raw high surrogate bytes is not joined
        let Value::Str(raw) = parse(b"\"\xED\xA0\x80\\udc00\"", 10).unwrap() else {
            panic!("not a string")
        };
        assert_eq!(raw.bytes(), b"\xED\xA0\x80\xED\xB0\x80");
        assert!(raw.has_surrogates());
        assert_eq!(err(br#""\x""#), (ErrorKind::InvalidEscape, 1));
        assert_eq!(err(br#""\u12""#), (ErrorKind::InvalidUnicodeEscape, 1));
        assert_eq!(err(br#""\uzzzz""#), (ErrorKind::InvalidUnicodeEscape, 1));
        assert_eq!(err(b"\"a\nb\""), (ErrorKind::InvalidControlCharacter, 2));
        assert_eq!(err(b"[\"abc"), (ErrorKind::UnterminatedString, 1));
        assert_eq!(err(b"\"a\\"), (ErrorKind::UnterminatedString, 0));
    }

    #[test]
    fn duplicate_keys_last_value_at_first_position() {
        let expected = Value::Object(vec![
            ("a".into(), Value::Int(3)),
            ("b".into(), Value::Int(2)),
        ]);
        assert_eq!(ok(r#"{"a": 1, "b": 2, "a": 3}"#), expected);
        // many members take the hashed path
        let text = format!(
            "{{{}, \"k0\": \"last\"}}",
            (0..20)
                .map(|i| format!("\"k{i}\": {i}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let Value::Object(members) = ok(&text) else {
            panic!("not an object")
        };
        assert_eq!(members.len(), 20);
        assert_eq!(members[0], ("k0".into(), s("last")));
        assert_eq!(members[19], ("k19".into(), Value::Int(19)));
        // an escaped key equals its plain spelling
        let Value::Object(members) = ok(r#"{"a": 1, "\u0061": 2}"#) else {
            panic!("not an object")
        };
        assert_eq!(members, vec![("a".into(), Value::Int(2))]);
    }

    #[test]
    fn structure_errors_name_their_offset() {
        assert_eq!(err(b""), (ErrorKind::ExpectingValue, 0));
        assert_eq!(err(b"  "), (ErrorKind::ExpectingValue, 2));
        assert_eq!(err(b"[1,]"), (ErrorKind::ExpectingValue, 3));
        assert_eq!(err(b"[1 2]"), (ErrorKind::ExpectingComma, 3));
        assert_eq!(err(br#"{"a" 1}"#), (ErrorKind::ExpectingColon, 5));
        assert_eq!(err(br#"{"a": 1,}"#), (ErrorKind::ExpectingPropertyName, 8));
        assert_eq!(err(b"{1: 2}"), (ErrorKind::ExpectingPropertyName, 1));
        assert_eq!(err(b"[] x"), (ErrorKind::ExtraData, 3));
        assert_eq!(err(b"tru"), (ErrorKind::ExpectingValue, 0));
        // offsets count the UTF-8 BOM
        assert_eq!(err(b"\xEF\xBB\xBF[x"), (ErrorKind::ExpectingValue, 4));
    }

    #[test]
    fn plain_runs_end_at_the_first_special_byte() {
        for len in 0..20 {
            for special in [b'"', b'\\', 0x00, 0x1F] {
                let mut text = vec![b'a'; len];
                text.extend_from_slice(&[0xC3, 0xA9, 0x7F, 0x20]);
                let at = text.len();
                text.push(special);
                text.extend_from_slice(b"\"\\x");
                assert_eq!(run_end(&text, 0), at);
                assert_eq!(run_end(&text, at + 1), at + 1);
            }
            assert_eq!(run_end(&vec![b'z'; len], 0), len);
        }
    }

    #[test]
    fn depth_is_bounded() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(parse(deep(5).as_bytes(), 5).is_ok());
        let e = parse(deep(6).as_bytes(), 5).unwrap_err();
        assert_eq!((e.kind, e.offset), (ErrorKind::TooDeep(5), 5));
        assert!(e.to_string().contains("deeper than 5 levels"));
        let e = parse(br#"{"a": {"b": 1}}"#, 1).unwrap_err();
        assert_eq!(e.kind, ErrorKind::TooDeep(1));
    }

    #[test]
    fn nested_values_and_empty_containers() {
        assert_eq!(
            ok(r#"{"": [], "x": {}, "y": [1, [2.5, "z"]]}"#),
            Value::Object(vec![
                ("".into(), Value::Array(vec![])),
                ("x".into(), Value::Object(vec![])),
                (
                    "y".into(),
                    Value::Array(vec![
                        Value::Int(1),
                        Value::Array(vec![Value::Float(2.5), s("z")])
                    ])
                ),
            ])
        );
    }
}
