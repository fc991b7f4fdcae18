//! The packed form of recorded JSON values: msgpack plus the library's extension types.
//!
//! Bytes are those `msgpack.Packer(use_bin_type=True)` writes: the smallest int form (`uint`
//! forms for values from 0), floats as float64, `str8` for strings of 32-255 bytes, the
//! smallest container headers. Extension types carry what msgpack cannot say by itself:
//! tuples (an empty ext as an array's first item), ints beyond 64 bits (decimal text),
//! strings with lone surrogates (generalized UTF-8), blob references (4-byte big-endian index)
//! and the echo placeholder. The primitives come from `rmp`; this module fixes the forms and
//! reads them back with every length checked against the bytes left.

use std::fmt;

use rmp::Marker;

use crate::json::{JsonStr, Str, Value};

/// First item of an array that is a tuple; empty payload.
pub const EXT_TUPLE: i8 = 1;
/// An int outside 64 bits; payload: ASCII decimal text.
pub const EXT_BIGINT: i8 = 2;
/// A string holding a lone surrogate; payload: generalized UTF-8 (`surrogatepass`).
pub const EXT_SURROGATE: i8 = 3;
/// A reference to a long string in a blob table; payload: its index, 4 bytes big-endian.
pub const EXT_BLOB: i8 = 4;
/// The response of the turn a message segment extends; empty payload.
pub const EXT_ECHO: i8 = 5;

/// Nesting the unpacker follows at most (msgpack's own unpacker stops at 1024 too).
pub const MAX_UNPACK_DEPTH: usize = 1024;

// Writing to a Vec cannot fail: rmp's io results are dropped on purpose below.

pub fn write_nil(out: &mut Vec<u8>) {
    let _ = rmp::encode::write_nil(out);
}

pub fn write_bool(value: bool, out: &mut Vec<u8>) {
    let _ = rmp::encode::write_bool(out, value);
}

/// An int in its smallest form (a non-negative one in the `uint` forms, as msgpack-python).
pub fn write_int(value: i64, out: &mut Vec<u8>) {
    let _ = rmp::encode::write_sint(out, value);
}

pub fn write_uint(value: u64, out: &mut Vec<u8>) {
    let _ = rmp::encode::write_uint(out, value);
}

pub fn write_float(value: f64, out: &mut Vec<u8>) {
    let _ = rmp::encode::write_f64(out, value);
}

/// A string's header and bytes (`bytes` must be UTF-8: a surrogate goes in `EXT_SURROGATE`).
pub fn write_str(bytes: &[u8], out: &mut Vec<u8>) {
    write_str_header(bytes.len(), out);
    out.extend_from_slice(bytes);
}

pub fn write_str_header(len: usize, out: &mut Vec<u8>) {
    let _ = rmp::encode::write_str_len(out, len_u32(len));
}

pub fn write_array_header(len: usize, out: &mut Vec<u8>) {
    let _ = rmp::encode::write_array_len(out, len_u32(len));
}

pub fn write_map_header(len: usize, out: &mut Vec<u8>) {
    let _ = rmp::encode::write_map_len(out, len_u32(len));
}

pub fn write_ext(code: i8, payload: &[u8], out: &mut Vec<u8>) {
    let _ = rmp::encode::write_ext_meta(out, len_u32(payload.len()), code);
    out.extend_from_slice(payload);
}

/// A reference to blob `index`.
pub fn write_blob_ref(index: u32, out: &mut Vec<u8>) {
    write_ext(EXT_BLOB, &index.to_be_bytes(), out);
}

/// The mark that makes the array it begins a tuple.
pub fn write_tuple_mark(out: &mut Vec<u8>) {
    write_ext(EXT_TUPLE, &[], out);
}

/// A string as the packer writes it: plain when it is UTF-8, else `EXT_SURROGATE`.
pub fn write_json_str(s: Str<'_>, out: &mut Vec<u8>) {
    if s.surrogates {
        write_ext(EXT_SURROGATE, s.bytes, out);
    } else {
        write_str(s.bytes, out);
    }
}

fn len_u32(len: usize) -> u32 {
    // msgpack lengths are 32 bits; the library never packs a string or container this long
    // (its files bound records far below it)
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// The packing of a JSON value with every string inline (the canonical plain packing).
pub fn pack(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => write_nil(out),
        Value::Bool(b) => write_bool(*b, out),
        Value::Int(n) => write_int(*n, out),
        Value::BigInt(text) => match text.parse::<u64>() {
            Ok(n) => write_uint(n, out),
            Err(_) => write_ext(EXT_BIGINT, text.as_bytes(), out),
        },
        Value::Float(f) => write_float(*f, out),
        Value::Str(s) => write_json_str(s.as_ref(), out),
        Value::Array(items) => {
            write_array_header(items.len(), out);
            for item in items {
                pack(item, out);
            }
        }
        Value::Object(members) => {
            write_map_header(members.len(), out);
            for (key, item) in members {
                write_json_str(key.as_ref(), out);
                pack(item, out);
            }
        }
    }
}

/// `pack` into a new buffer.
pub fn to_packed(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    pack(value, &mut out);
    out
}

/// One msgpack item as the reader meets it (a container: its header only).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Item<'a> {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext(i8, &'a [u8]),
}

/// Why bytes are not one packed value, and the byte offset where that was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnpackError {
    pub offset: usize,
    pub reason: &'static str,
}

impl fmt::Display for UnpackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (at byte {})", self.reason, self.offset)
    }
}

impl std::error::Error for UnpackError {}

/// Reads msgpack items in order, each length checked against the bytes left.
#[derive(Clone)]
pub struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    /// The offset of the next item.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Whether the next item is the tuple mark (an array's first item then makes it a tuple).
    pub fn peek_is_tuple_mark(&self) -> bool {
        self.data.get(self.pos..self.pos + 3) == Some(&[0xC7, 0, EXT_TUPLE.to_be_bytes()[0]][..])
    }

    /// Whether every byte has been read.
    pub fn at_end(&self) -> bool {
        self.pos == self.data.len()
    }

    fn take(&mut self, n: usize, at: usize) -> Result<&'a [u8], UnpackError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or_else(|| fail(at, "the value is cut short"))?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn fixed<const N: usize>(&mut self, at: usize) -> Result<[u8; N], UnpackError> {
        let bytes = self.take(N, at)?;
        let mut out = [0; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn length(&mut self, width: usize, at: usize) -> Result<usize, UnpackError> {
        Ok(match width {
            1 => usize::from(self.fixed::<1>(at)?[0]),
            2 => usize::from(u16::from_be_bytes(self.fixed(at)?)),
            _ => u32::from_be_bytes(self.fixed(at)?) as usize,
        })
    }

    /// A container's item count, refused when its items cannot fit in the bytes left
    /// (each takes one byte at least, a map's pairs two).
    fn count(&mut self, n: usize, pairs: bool, at: usize) -> Result<usize, UnpackError> {
        let needed = if pairs { n.saturating_mul(2) } else { n };
        if needed > self.data.len() - self.pos {
            return Err(fail(
                at,
                "a container claims more items than bytes are left",
            ));
        }
        Ok(n)
    }

    /// The next item.
    ///
    /// # Errors
    /// When the bytes end inside it, or its type byte is not msgpack.
    pub fn next_item(&mut self) -> Result<Item<'a>, UnpackError> {
        let at = self.pos;
        let byte = self.fixed::<1>(at)?[0];
        Ok(match Marker::from_u8(byte) {
            Marker::FixPos(n) => Item::Int(i64::from(n)),
            Marker::FixNeg(n) => Item::Int(i64::from(n)),
            Marker::Null => Item::Nil,
            Marker::True => Item::Bool(true),
            Marker::False => Item::Bool(false),
            Marker::U8 => Item::Int(i64::from(self.fixed::<1>(at)?[0])),
            Marker::U16 => Item::Int(i64::from(u16::from_be_bytes(self.fixed(at)?))),
            Marker::U32 => Item::Int(i64::from(u32::from_be_bytes(self.fixed(at)?))),
            Marker::U64 => {
                let n = u64::from_be_bytes(self.fixed(at)?);
                i64::try_from(n).map_or(Item::UInt(n), Item::Int)
            }
            Marker::I8 => Item::Int(i64::from(i8::from_be_bytes(self.fixed(at)?))),
            Marker::I16 => Item::Int(i64::from(i16::from_be_bytes(self.fixed(at)?))),
            Marker::I32 => Item::Int(i64::from(i32::from_be_bytes(self.fixed(at)?))),
            Marker::I64 => Item::Int(i64::from_be_bytes(self.fixed(at)?)),
            Marker::F32 => Item::Float(f64::from(f32::from_be_bytes(self.fixed(at)?))),
            Marker::F64 => Item::Float(f64::from_be_bytes(self.fixed(at)?)),
            Marker::FixStr(n) => Item::Str(self.take(usize::from(n), at)?),
            Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                let width = width_of(byte, 0xD9);
                let n = self.length(width, at)?;
                Item::Str(self.take(n, at)?)
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let width = width_of(byte, 0xC4);
                let n = self.length(width, at)?;
                Item::Bin(self.take(n, at)?)
            }
            Marker::FixArray(n) => Item::Array(self.count(usize::from(n), false, at)?),
            Marker::Array16 | Marker::Array32 => {
                let n = self.length(if byte == 0xDC { 2 } else { 4 }, at)?;
                Item::Array(self.count(n, false, at)?)
            }
            Marker::FixMap(n) => Item::Map(self.count(usize::from(n), true, at)?),
            Marker::Map16 | Marker::Map32 => {
                let n = self.length(if byte == 0xDE { 2 } else { 4 }, at)?;
                Item::Map(self.count(n, true, at)?)
            }
            Marker::FixExt1
            | Marker::FixExt2
            | Marker::FixExt4
            | Marker::FixExt8
            | Marker::FixExt16 => {
                let n = 1usize << (byte - 0xD4);
                let code = i8::from_be_bytes(self.fixed(at)?);
                Item::Ext(code, self.take(n, at)?)
            }
            Marker::Ext8 | Marker::Ext16 | Marker::Ext32 => {
                let n = self.length(width_of(byte, 0xC7), at)?;
                let code = i8::from_be_bytes(self.fixed(at)?);
                Item::Ext(code, self.take(n, at)?)
            }
            Marker::Reserved => return Err(fail(at, "a type byte that is not msgpack")),
        })
    }
}

fn fail(at: usize, reason: &'static str) -> UnpackError {
    UnpackError { offset: at, reason }
}

/// The width of the length field of the 8/16/32-bit form starting at `first`.
fn width_of(byte: u8, first: u8) -> usize {
    1 << (byte - first)
}

/// Whether an `EXT_BIGINT` payload is an optional minus and ASCII digits.
pub fn is_decimal(text: &[u8]) -> bool {
    let digits = text.strip_prefix(b"-").unwrap_or(text);
    !digits.is_empty() && digits.iter().all(u8::is_ascii_digit)
}

/// Rebuild a packed value with no blob reference or echo in it as a [`Value`] (a tuple as an
/// array: JSON does not tell them apart).
///
/// # Errors
/// Malformed or trailing bytes, nesting beyond [`MAX_UNPACK_DEPTH`], bytes, an extension
/// type the plain packing does not hold, a non-string key, a string that is not UTF-8.
pub fn unpack(data: &[u8]) -> Result<Value, UnpackError> {
    let mut reader = Reader::new(data);
    let value = unpack_item(&mut reader, 0)?;
    if !reader.at_end() {
        return Err(fail(reader.pos(), "bytes after the value"));
    }
    Ok(value)
}

fn unpack_item(reader: &mut Reader<'_>, depth: usize) -> Result<Value, UnpackError> {
    let at = reader.pos();
    Ok(match reader.next_item()? {
        Item::Nil => Value::Null,
        Item::Bool(b) => Value::Bool(b),
        Item::Int(n) => Value::Int(n),
        Item::UInt(n) => Value::BigInt(n.to_string().into()),
        Item::Float(f) => Value::Float(f),
        Item::Str(bytes) => Value::Str(utf8(bytes, at)?),
        Item::Bin(_) => return Err(fail(at, "bytes, which JSON cannot carry")),
        Item::Ext(EXT_BIGINT, text) if is_decimal(text) => {
            Value::BigInt(String::from_utf8_lossy(text).into())
        }
        Item::Ext(EXT_SURROGATE, bytes) => Value::Str(JsonStr::new(Str {
            bytes,
            surrogates: true,
        })),
        Item::Ext(..) => return Err(fail(at, "an extension type not allowed here")),
        Item::Array(n) => {
            if depth >= MAX_UNPACK_DEPTH {
                return Err(fail(at, "nested too deeply"));
            }
            let mut items = Vec::with_capacity(n);
            for i in 0..n {
                if i == 0 && reader.peek_is_tuple_mark() {
                    reader.pos += 3;
                    continue;
                }
                items.push(unpack_item(reader, depth + 1)?);
            }
            Value::Array(items)
        }
        Item::Map(n) => {
            if depth >= MAX_UNPACK_DEPTH {
                return Err(fail(at, "nested too deeply"));
            }
            let mut members: Vec<(JsonStr, Value)> = Vec::with_capacity(n);
            for _ in 0..n {
                let key_at = reader.pos();
                let key = match reader.next_item()? {
                    Item::Str(bytes) => utf8(bytes, key_at)?,
                    _ => return Err(fail(key_at, "a dict key that is not a string")),
                };
                let item = unpack_item(reader, depth + 1)?;
                // a repeated key keeps its first position and its last value, as a dict does
                match members.iter_mut().find(|(k, _)| *k == key) {
                    Some(member) => member.1 = item,
                    None => members.push((key, item)),
                }
            }
            Value::Object(members)
        }
    })
}

fn utf8(bytes: &[u8], at: usize) -> Result<JsonStr, UnpackError> {
    std::str::from_utf8(bytes)
        .map(JsonStr::from)
        .map_err(|_| UnpackError {
            offset: at,
            reason: "a string that is not UTF-8",
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::parse;

    fn packed(text: &str) -> Vec<u8> {
        to_packed(&parse(text.as_bytes(), 500).unwrap())
    }

    #[test]
    fn ints_take_the_smallest_form() {
        assert_eq!(packed("0"), [0x00]);
        assert_eq!(packed("127"), [0x7F]);
        assert_eq!(packed("128"), [0xCC, 0x80]);
        assert_eq!(packed("-32"), [0xE0]);
        assert_eq!(packed("-33"), [0xD0, 0xDF]);
        assert_eq!(packed("65536"), [0xCE, 0, 1, 0, 0]);
        assert_eq!(
            packed("18446744073709551615"),
            [0xCF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
        );
        let mut big = vec![0xC7, 20, 2];
        big.extend_from_slice(b"18446744073709551616");
        assert_eq!(packed("18446744073709551616"), big);
    }

    #[test]
    fn strings_and_containers() {
        assert_eq!(packed(r#"{"a": [1.0, null, true]}"#), {
            let mut v = vec![0x81, 0xA1, b'a', 0x93, 0xCB];
            v.extend_from_slice(&1.0f64.to_be_bytes());
            v.extend_from_slice(&[0xC0, 0xC3]);
            v
        });
        let long = "x".repeat(40);
        let mut expected = vec![0xD9, 40];
        expected.extend_from_slice(long.as_bytes());
        assert_eq!(packed(&format!("\"{long}\"")), expected);
        let mut surrogate = vec![0xD6, 3];
        surrogate.extend_from_slice(&[0xED, 0xA0, 0x80, b'a']);
        assert_eq!(packed(r#""\ud800a""#), surrogate);
    }

    #[test]
    fn unpack_round_trips() {
        for text in [
            r#"{"a": [1, -0.0, "\ud800", 123456789012345678901234567890, {}, []], "b": NaN}"#,
            "[18446744073709551615, -9223372036854775808, 1e300]",
        ] {
            let value = parse(text.as_bytes(), 500).unwrap();
            let back = unpack(&to_packed(&value)).unwrap();
            assert_eq!(to_packed(&back), to_packed(&value));
        }
    }

    #[test]
    fn tuples_read_as_arrays() {
        let mut data = vec![0x92];
        write_tuple_mark(&mut data);
        write_int(7, &mut data);
        assert_eq!(to_packed(&unpack(&data).unwrap()), [0x91, 0x07]);
    }

    #[test]
    fn bad_bytes_are_refused_with_an_offset() {
        assert_eq!(
            unpack(&[0x92, 0x01]).unwrap_err().reason,
            "a container claims more items than bytes are left"
        );
        assert_eq!(unpack(&[0x01, 0x02]).unwrap_err().offset, 1);
        assert_eq!(
            unpack(&[0xC1]).unwrap_err().reason,
            "a type byte that is not msgpack"
        );
        assert_eq!(
            unpack(&[0xA2, 0xFF, 0xFE]).unwrap_err().reason,
            "a string that is not UTF-8"
        );
        assert_eq!(
            unpack(&[0xDB, 0xFF, 0xFF, 0xFF, 0xFF]).unwrap_err().reason,
            "the value is cut short"
        );
        // (debug builds' frames are large: a thread with room for the deepest value)
        let deep = std::thread::Builder::new()
            .stack_size(64 << 20)
            .spawn(|| {
                let mut deep = vec![0x91; MAX_UNPACK_DEPTH + 1];
                deep.push(0xC0);
                unpack(&deep).unwrap_err().reason
            })
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(deep, "nested too deeply");
    }

    #[test]
    fn blob_refs_and_marks_have_fixed_bytes() {
        let mut out = Vec::new();
        write_blob_ref(258, &mut out);
        write_tuple_mark(&mut out);
        write_ext(EXT_ECHO, &[], &mut out);
        assert_eq!(out, [0xD6, 4, 0, 0, 1, 2, 0xC7, 0, 1, 0xC7, 0, 5]);
    }
}
