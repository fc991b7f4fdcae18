//! Arbitrary texts of messages through the request table, one after another: reading a text
//! from a raw tip never panics and reads what reading it whole reads (the same packings of
//! its new messages, the same refusal), and finds the base its packings find.
//!
//! The input is split at 0xff bytes (never in a UTF-8 text) into pieces; a piece starting
//! with 0x01 is appended to the previous text up to where its last item ends, so that texts
//! extend one another as a conversation's do. Every other text is read under a low depth
//! bound, so that a tip read under the default is re-sent under a lower one. Reading whole is
//! `json.loads`: an int over the digit limit refused where it is read, before a later fault
//! and where a repeated key replaces it. The base found is also checked against brute force
//! (the longest filed request the packings start with, the first filed of twins), and
//! against a table where every other turn is filed by its key alone and confirmed when asked.
#![no_main]

use engine::json::{parse_with, Failure, Key, Sink, Str, Value, ValueBuilder, DEFAULT_MAX_DEPTH};
use engine::packed::to_packed;
use engine::requests::{digest_key, Found, RawError, Requests, TurnNo};
use libfuzzer_sys::fuzz_target;

/// Where the last item of an array text ends (as the table finds it), or the text's length.
fn item_end(text: &[u8]) -> usize {
    let ws = |b: u8| matches!(b, b' ' | b'\t' | b'\r' | b'\n');
    let mut end = text.len();
    while end > 0 && ws(text[end - 1]) {
        end -= 1;
    }
    if end > 0 && text[end - 1] == b']' {
        end -= 1;
        while end > 0 && ws(text[end - 1]) {
            end -= 1;
        }
    }
    end
}

const DIGITS: usize = 40;

/// Builds values as the parser's own builder does, refusing an int of more than `DIGITS`
/// digits as `json.loads` does: where it reads it, a repeated key's replaced value too.
struct Limited;

impl Sink for Limited {
    type Value = Value;
    type Error = RawError;
    fn null(&mut self) -> Result<Value, RawError> {
        Ok(Value::Null)
    }
    fn bool(&mut self, value: bool) -> Result<Value, RawError> {
        Ok(Value::Bool(value))
    }
    fn int(&mut self, value: i64) -> Result<Value, RawError> {
        Ok(Value::Int(value))
    }
    fn big_int(&mut self, text: &str) -> Result<Value, RawError> {
        let digits = text.trim_start_matches('-').len();
        if digits > DIGITS {
            return Err(RawError::Digits {
                digits,
                limit: DIGITS,
            });
        }
        ValueBuilder.big_int(text).map_err(|never| match never {})
    }
    fn float(&mut self, value: f64) -> Result<Value, RawError> {
        Ok(Value::Float(value))
    }
    fn string(&mut self, value: Str<'_>) -> Result<Value, RawError> {
        ValueBuilder.string(value).map_err(|never| match never {})
    }
    fn array(&mut self, items: Vec<Value>) -> Result<Value, RawError> {
        Ok(Value::Array(items))
    }
    fn object(&mut self, members: Vec<(Key<'_>, Value)>) -> Result<Value, RawError> {
        ValueBuilder.object(members).map_err(|never| match never {})
    }
}

/// The base brute force finds among `filed` (turn by turn, their packings).
fn brute(filed: &[(TurnNo, Vec<Vec<u8>>)], plains: &[Vec<u8>]) -> Option<TurnNo> {
    let mut best: Option<(usize, TurnNo)> = None;
    for (turn, row) in filed {
        if row.len() <= plains.len()
            && row[..] == plains[..row.len()]
            && best.is_none_or(|(len, _)| row.len() > len)
        {
            best = Some((row.len(), *turn));
        }
    }
    best.map(|(_, turn)| turn)
}

/// `find` on a table holding rows filed by their key, confirming each it asks about by
/// comparing with what was filed.
fn find_confirming(
    keyed: &mut Requests,
    filed: &[(TurnNo, Vec<Vec<u8>>)],
    plains: &[Vec<u8>],
) -> Found {
    let mut refuted = Vec::new();
    loop {
        let found = keyed.find_past(plains, &refuted);
        let Some(ask) = found.ask else {
            return found;
        };
        let (_, row) = filed.iter().find(|(turn, _)| *turn == ask.turn).unwrap();
        if row[..] == plains[..ask.len] {
            assert_eq!(keyed.confirm(ask.turn, &ask.digest), Some(true));
        } else {
            refuted.push(ask.turn);
        }
    }
}

/// The depth bound the odd texts are read under.
const LOW_DEPTH: usize = 4;

fuzz_target!(|data: &[u8]| {
    let mut tipped = Requests::new();
    let mut whole = Requests::new();
    let mut keyed = Requests::new();
    let mut filed: Vec<(TurnNo, Vec<Vec<u8>>)> = Vec::new();
    let mut previous: Vec<u8> = Vec::new();
    for (turn, piece) in data.split(|&b| b == 0xff).take(16).enumerate() {
        let text: Vec<u8> = match piece.split_first() {
            Some((0x01, rest)) => {
                let mut text = previous[..item_end(&previous)].to_vec();
                text.extend_from_slice(rest);
                text
            }
            _ => piece.to_vec(),
        };
        let depth = if turn % 2 == 1 {
            LOW_DEPTH
        } else {
            DEFAULT_MAX_DEPTH
        };
        let read = tipped.find_raw(&text, depth, DIGITS);
        let expected = match parse_with(&text, depth, &mut Limited) {
            Err(Failure::Syntax(e)) => Err(RawError::Syntax(e)),
            Err(Failure::Sink(e)) => Err(e),
            Ok(Value::Array(items)) => Ok(items),
            Ok(_) => Err(RawError::NotArray),
        };
        match (read, expected) {
            (Ok(read), Ok(items)) => {
                let plains: Vec<Vec<u8>> = items.iter().map(to_packed).collect();
                assert!(read.first <= plains.len());
                assert_eq!(read.plains, plains[read.first..]);
                let found = whole.find(&plains);
                assert_eq!(read.found, found);
                assert_eq!(found.base, brute(&filed, &plains));
                assert_eq!(find_confirming(&mut keyed, &filed, &plains), found);
                let turn = turn as u32;
                let response = plains.last().cloned();
                tipped.file_raw(turn, &read, response.as_deref()).unwrap();
                whole
                    .file(turn, plains.len(), found.digest, response.as_deref())
                    .unwrap();
                if turn % 2 == 0 {
                    let key = digest_key(&found.digest);
                    keyed.file_key(turn, plains.len(), key, response.as_deref())
                } else {
                    keyed.file(turn, plains.len(), found.digest, response.as_deref())
                }
                .unwrap();
                filed.push((turn, plains));
            }
            (Err(got), Err(want)) => assert_eq!(got, want),
            (got, want) => panic!("read {got:?}, whole {want:?}"),
        }
        previous = text;
    }
});
