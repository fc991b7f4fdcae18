//! The JSON value model: ints, big ints, floats and bools kept apart, object members in order.

use std::convert::Infallible;

use super::parse::{Key, Sink};

/// A borrowed JSON string: generalized UTF-8 bytes, `surrogates` set when they hold a lone
/// surrogate (so they are not valid UTF-8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Str<'a> {
    pub bytes: &'a [u8],
    pub surrogates: bool,
}

impl<'a> Str<'a> {
    /// The text as `&str` when it holds no surrogate.
    pub fn as_str(&self) -> Option<&'a str> {
        if self.surrogates {
            None
        } else {
            // generalized UTF-8 without surrogates is UTF-8; checked once more to stay safe
            std::str::from_utf8(self.bytes).ok()
        }
    }
}

/// An owned JSON string (see [`Str`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct JsonStr {
    bytes: Box<[u8]>,
    surrogates: bool,
}

impl JsonStr {
    pub fn new(s: Str<'_>) -> Self {
        Self {
            bytes: s.bytes.into(),
            surrogates: s.surrogates,
        }
    }

    pub fn as_ref(&self) -> Str<'_> {
        Str {
            bytes: &self.bytes,
            surrogates: self.surrogates,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn has_surrogates(&self) -> bool {
        self.surrogates
    }
}

impl From<&str> for JsonStr {
    fn from(s: &str) -> Self {
        Self {
            bytes: s.as_bytes().into(),
            surrogates: false,
        }
    }
}

/// A JSON value as `json.loads` gives it: `1`, `1.0` and `true` stay apart, a float keeps its
/// bits (`-0.0`, NaN), an int beyond 64 bits keeps its decimal text, members keep their order.
#[derive(Clone, Debug)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    /// decimal text of an int outside `i64` (canonical: no leading zeros, no `+`)
    BigInt(Box<str>),
    Float(f64),
    Str(JsonStr),
    Array(Vec<Value>),
    /// members in first-key order, each key once
    Object(Vec<(JsonStr, Value)>),
}

impl PartialEq for Value {
    /// Exact identity: floats compare by bits, so `NaN == NaN` and `0.0 != -0.0`.
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Value::Null, Value::Null) => true,
            (Value::Bool(a), Value::Bool(b)) => a == b,
            (Value::Int(a), Value::Int(b)) => a == b,
            (Value::BigInt(a), Value::BigInt(b)) => a == b,
            (Value::Float(a), Value::Float(b)) => a.to_bits() == b.to_bits(),
            (Value::Str(a), Value::Str(b)) => a == b,
            (Value::Array(a), Value::Array(b)) => a == b,
            (Value::Object(a), Value::Object(b)) => a == b,
            _ => false,
        }
    }
}

/// Builds [`Value`] trees from the parser.
#[derive(Default, Debug, Clone, Copy)]
pub struct ValueBuilder;

impl Sink for ValueBuilder {
    type Value = Value;
    type Error = Infallible;

    fn null(&mut self) -> Result<Value, Infallible> {
        Ok(Value::Null)
    }

    fn bool(&mut self, value: bool) -> Result<Value, Infallible> {
        Ok(Value::Bool(value))
    }

    fn int(&mut self, value: i64) -> Result<Value, Infallible> {
        Ok(Value::Int(value))
    }

    fn big_int(&mut self, text: &str) -> Result<Value, Infallible> {
        Ok(Value::BigInt(text.into()))
    }

    fn float(&mut self, value: f64) -> Result<Value, Infallible> {
        Ok(Value::Float(value))
    }

    fn string(&mut self, value: Str<'_>) -> Result<Value, Infallible> {
        Ok(Value::Str(JsonStr::new(value)))
    }

    fn array(&mut self, items: Vec<Value>) -> Result<Value, Infallible> {
        Ok(Value::Array(items))
    }

    fn object(&mut self, members: Vec<(Key<'_>, Value)>) -> Result<Value, Infallible> {
        Ok(Value::Object(
            members
                .into_iter()
                .map(|(k, v)| {
                    let key = JsonStr {
                        bytes: k.bytes.into_owned().into_boxed_slice(),
                        surrogates: k.surrogates,
                    };
                    (key, v)
                })
                .collect(),
        ))
    }
}
