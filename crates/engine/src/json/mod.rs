//! Exact JSON: the value model, a parser with `json.loads`' semantics on bytes and a writer of
//! `json.dumps`' bytes.
//!
//! Strings are kept as generalized UTF-8: every code point encoded on its own, surrogates
//! included (what Python's `str.encode("utf-8", "surrogatepass")` gives), so a lone surrogate
//! that `json.loads` accepts survives, and a string with one is flagged.

mod encoding;
mod float;
mod ids;
mod parse;
pub mod scan;
mod valid;
mod value;
mod write;

pub use encoding::{decode_text, Text};
pub use float::write_float;
pub use ids::{member_ids, u32_ids, MemberIds};
pub use parse::{parse, parse_with, ErrorKind, Failure, Key, ParseError, Sink, DEFAULT_MAX_DEPTH};
pub use valid::reads_as_object;
pub use value::{JsonStr, Str, Value, ValueBuilder};
pub use write::{
    to_json, write_bool, write_code_points, write_int, write_null, write_str, write_value,
};
