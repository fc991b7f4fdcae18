//! The upstream's server-sent events as the data plane passes them through: split into
//! events as they arrive, the stream's last event told apart (`--ack durable` holds it back
//! until the turn is recorded), and the capture fields the client did not ask for taken out
//! of a Chat Completions chunk (the rest of the event as the engine sent it); the same edits
//! make the reply to a complete answer ([`answer_reply`]).

use std::borrow::Cow;

use bytes::{Bytes, BytesMut};
use engine::json::reads_as_object;
use engine::json::scan::{object, skip_space, string_end, value_end, Member};

/// The events of a stream, split as its bytes arrive: an event ends with a blank line
/// (`\n\n`, `\r\n\r\n` or `\r\r`, as the SSE grammar allows).
#[derive(Default)]
pub struct Splitter {
    partial: BytesMut,
}

impl Splitter {
    /// The events `data` completes (each with its blank line), in order.
    pub fn push(&mut self, data: &[u8]) -> Vec<Bytes> {
        let scanned = self.partial.len().saturating_sub(3);
        self.partial.extend_from_slice(data);
        let mut events = Vec::new();
        let mut from = scanned;
        while let Some(end) = event_end(&self.partial[..], from) {
            events.push(self.partial.split_to(end).freeze());
            from = 0;
        }
        events
    }

    /// The bytes after the last complete event (an event the stream did not finish).
    pub fn rest(&mut self) -> Bytes {
        self.partial.split().freeze()
    }
}

/// Where the first event of `text` ends (past its blank line), looking from `from` on.
fn event_end(text: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i < text.len() {
        match text[i] {
            b'\n' if text.get(i + 1) == Some(&b'\n') => return Some(i + 2),
            b'\n' if text.get(i + 1) == Some(&b'\r') && text.get(i + 2) == Some(&b'\n') => {
                return Some(i + 3);
            }
            b'\r' if text.get(i + 1) == Some(&b'\r') => return Some(i + 2),
            b'\r'
                if text.get(i + 1) == Some(&b'\n')
                    && text.get(i + 2) == Some(&b'\r')
                    && text.get(i + 3) == Some(&b'\n') =>
            {
                return Some(i + 4);
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The lines of an event, without their line ends.
fn lines(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    event
        .split(|b| *b == b'\n' || *b == b'\r')
        .filter(|line| !line.is_empty())
}

/// A field's value (`name: value`, the one space after the colon not part of it).
fn field<'a>(line: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let value = line.strip_prefix(name)?.strip_prefix(b":")?;
    Some(value.strip_prefix(b" ").unwrap_or(value))
}

/// Whether `event` ends its stream: Chat Completions' `data: [DONE]`, or Anthropic's
/// `message_stop`.
pub fn is_last(event: &[u8], anthropic: bool) -> bool {
    lines(event).any(|line| {
        if anthropic {
            field(line, b"event") == Some(b"message_stop")
        } else {
            field(line, b"data") == Some(b"[DONE]")
        }
    })
}

/// What to take out of a Chat Completions chunk: the capture fields the server asked the
/// engine for and the client did not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Strip {
    /// vLLM's `prompt_token_ids` (top level) and each choice's `token_ids`.
    pub token_ids: bool,
    /// Each choice's `logprobs`, made `null`.
    pub logprobs: bool,
}

impl Strip {
    pub fn any(self) -> bool {
        self.token_ids || self.logprobs
    }
}

/// `event` with what `strip` names taken out of its `data:` chunk; the event as it came
/// when there is nothing to take out (or it is not one `data:` line holding an object).
pub fn strip(event: Bytes, strip: Strip) -> Bytes {
    if !strip.any() {
        return event;
    }
    let Some(start) = find(&event, b"data:") else {
        return event;
    };
    if start != 0 && !matches!(event[start - 1], b'\n' | b'\r') {
        return event;
    }
    let mut at = start + 5;
    if event.get(at) == Some(&b' ') {
        at += 1;
    }
    let Some(Edited { edits, .. }) = chunk_edits(&event, at, strip) else {
        return event;
    };
    if edits.is_empty() {
        return event;
    }
    let mut out = Vec::with_capacity(event.len());
    let mut from = 0;
    for (begin, end, with) in edits {
        out.extend_from_slice(&event[from..begin]);
        out.extend_from_slice(with);
        from = end;
    }
    out.extend_from_slice(&event[from..]);
    Bytes::from(out)
}

fn find(text: &[u8], what: &[u8]) -> Option<usize> {
    text.windows(what.len()).position(|w| w == what)
}

type Edit = (usize, usize, &'static [u8]);

/// The edits of a chunk: in order, not overlapping.
struct Edited {
    edits: Vec<Edit>,
    /// where the chunk ends
    end: usize,
    /// a key the edits looked at is written with an escape (its text is not its value: a
    /// field it names may have been left in)
    escaped: bool,
}

/// The edits that take `strip`'s fields out of the chunk at `at`; `None` when it is not a
/// JSON object.
fn chunk_edits(text: &[u8], at: usize, strip: Strip) -> Option<Edited> {
    let (members, end) = object(text, at)?;
    let mut drop = Vec::new();
    let mut edits = Vec::new();
    let escaped = |key: &[u8]| key.contains(&b'\\');
    let mut seen_escape = members.iter().any(|m| escaped(m.key));
    for (i, member) in members.iter().enumerate() {
        if strip.token_ids && member.key == b"prompt_token_ids" {
            drop.push(i);
        } else if member.key == b"choices" && text.get(member.value_start) == Some(&b'[') {
            for choice in array(text, member.value_start)? {
                if text[choice] != b'{' {
                    continue;
                }
                let (fields, _) = object(text, choice)?;
                seen_escape |= fields.iter().any(|f| escaped(f.key));
                let mut dropped = Vec::new();
                let mut nulled = Vec::new();
                for (j, f) in fields.iter().enumerate() {
                    if strip.token_ids && f.key == b"token_ids" {
                        dropped.push(j);
                    } else if strip.logprobs
                        && f.key == b"logprobs"
                        && &text[f.value_start..f.value_end] != b"null"
                    {
                        nulled.push((f.value_start, f.value_end, &b"null"[..]));
                    }
                }
                let mut inner = removals(&fields, &dropped);
                inner.extend(nulled);
                inner.sort_unstable_by_key(|e| e.0);
                edits.extend(merge(inner));
            }
        }
    }
    let mut all = removals(&members, &drop);
    all.extend(edits);
    all.sort_unstable_by_key(|e| e.0);
    Some(Edited {
        edits: merge(all),
        end,
        escaped: seen_escape,
    })
}

/// The reply to a complete (not streamed) answer the upstream sent with a 2xx status: the
/// answer itself when `strip` names nothing; else the answer with `strip`'s fields taken out
/// by the edits a chunk gets ([`strip`]), written compactly (the whitespace between its
/// tokens dropped, as a re-encoding with `(",", ":")` separators writes it; each token as
/// the upstream spelled it). `None` when the answer is not surely a JSON object that
/// `json.loads` reads ([`reads_as_object`]: strict UTF-8, within the library's depth bound,
/// no int of many digits), or a key the edits look at is written with an escape: the
/// control plane then decodes it itself, and says why it refuses it.
pub fn answer_reply(answer: &[u8], strip: Strip) -> Option<Cow<'_, [u8]>> {
    // (strict UTF-8 without a BOM: what json.detect_encoding finds UTF-8 and the engine's
    // own bytes can be handed on as)
    if !reads_as_object(answer) {
        return None;
    }
    let at = skip_space(answer, 0);
    if !strip.any() {
        return Some(Cow::Borrowed(answer));
    }
    let Edited {
        edits,
        end,
        escaped,
    } = chunk_edits(answer, at, strip)?;
    if escaped {
        return None; // (rare: decoded, as json.loads reads the key)
    }
    let mut out = Vec::with_capacity(end - at);
    let mut from = at;
    for (begin, stop, with) in edits {
        compact(&answer[from..begin], &mut out);
        out.extend_from_slice(with);
        from = stop;
    }
    compact(&answer[from..end], &mut out);
    Some(Cow::Owned(out))
}

/// `text` (whole tokens of JSON, no string cut) onto `out` without the whitespace between
/// its tokens.
fn compact(text: &[u8], out: &mut Vec<u8>) {
    let mut i = 0;
    while i < text.len() {
        match text[i] {
            b' ' | b'\t' | b'\r' | b'\n' => i += 1,
            b'"' => {
                let end = string_end(text, i).unwrap_or(text.len());
                out.extend_from_slice(&text[i..end]);
                i = end;
            }
            _ => {
                let end = text[i..]
                    .iter()
                    .position(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n' | b'"'))
                    .map_or(text.len(), |n| i + n);
                out.extend_from_slice(&text[i..end]);
                i = end;
            }
        }
    }
}

/// The edits removing members `drop` (indexes, ascending) of an object, with the commas
/// that separated them.
fn removals(members: &[Member<'_>], drop: &[usize]) -> Vec<Edit> {
    let mut edits = Vec::new();
    let kept: Vec<usize> = (0..members.len()).filter(|i| !drop.contains(i)).collect();
    if kept.is_empty() {
        // all of them, the commas between them too (a key may repeat)
        if let (Some(first), Some(last)) = (members.first(), members.last()) {
            edits.push((first.key_start, last.value_end, &b""[..]));
        }
        return edits;
    }
    for &i in drop {
        // from the end of the kept member before it (its comma with it), or, when none is
        // kept before it, up to the key of the next kept member
        let before = kept.iter().rev().find(|&&k| k < i);
        let after = kept.iter().find(|&&k| k > i);
        let (begin, end) = match (before, after) {
            (Some(&k), _) => (members[k].value_end, members[i].value_end),
            (None, Some(&k)) => (members[i].key_start, members[k].key_start),
            (None, None) => (members[i].key_start, members[i].value_end),
        };
        edits.push((begin, end, &b""[..]));
    }
    edits
}

/// Sorted edits with the overlapping ones (two removals of neighbours) joined.
fn merge(edits: Vec<Edit>) -> Vec<Edit> {
    let mut out: Vec<Edit> = Vec::with_capacity(edits.len());
    for edit in edits {
        if let Some(last) = out.last_mut() {
            if edit.0 < last.1 {
                last.1 = last.1.max(edit.1);
                continue;
            }
        }
        out.push(edit);
    }
    out
}

/// Where the items of the array at `i` begin.
fn array(text: &[u8], i: usize) -> Option<Vec<usize>> {
    let mut items = Vec::new();
    let mut j = skip_space(text, i + 1);
    if text.get(j) == Some(&b']') {
        return Some(items);
    }
    loop {
        items.push(j);
        j = skip_space(text, value_end(text, j)?);
        match text.get(j)? {
            b',' => j = skip_space(text, j + 1),
            b']' => return Some(items),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_wherever_the_bytes_break() {
        let stream = b"data: {\"a\": 1}\n\n: keep\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut splitter = Splitter::default();
            let mut events = splitter.push(&stream[..cut]);
            events.extend(splitter.push(&stream[cut..]));
            let events: Vec<&[u8]> = events.iter().map(|e| &e[..]).collect();
            assert_eq!(
                events,
                vec![
                    &b"data: {\"a\": 1}\n\n"[..],
                    &b": keep\n\n"[..],
                    &b"data: [DONE]\n\n"[..]
                ],
                "cut at {cut}"
            );
            assert!(splitter.rest().is_empty());
        }
        let mut splitter = Splitter::default();
        let events = splitter.push(b"event: a\r\ndata: 1\r\n\r\nevent: b\rdata: 2\r\rdata: 3");
        assert_eq!(events.len(), 2);
        assert_eq!(&splitter.rest()[..], b"data: 3");
    }

    #[test]
    fn the_last_event_is_told_apart() {
        assert!(is_last(b"data: [DONE]\n\n", false));
        assert!(is_last(b"data:[DONE]\n\n", false));
        assert!(!is_last(b"data: {\"x\": \"[DONE]\"}\n\n", false));
        assert!(is_last(
            b"event: message_stop\ndata: {\"type\": \"message_stop\"}\n\n",
            true
        ));
        assert!(!is_last(b"event: message_delta\ndata: {}\n\n", true));
        assert!(!is_last(b"data: [DONE]\n\n", true));
    }

    fn stripped(event: &str, token_ids: bool, logprobs: bool) -> String {
        let out = strip(
            Bytes::copy_from_slice(event.as_bytes()),
            Strip {
                token_ids,
                logprobs,
            },
        );
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[test]
    fn capture_fields_the_client_did_not_ask_for_are_taken_out() {
        let event = "data: {\"id\": \"c\", \"prompt_token_ids\": [1, 2], \"choices\": [{\"index\": 0, \
                     \"delta\": {\"content\": \"}\\\"\"}, \"logprobs\": {\"content\": [{\"t\": \"]\"}]}, \
                     \"token_ids\": [5], \"finish_reason\": null}]}\n\n";
        assert_eq!(
            stripped(event, true, true),
            "data: {\"id\": \"c\", \"choices\": [{\"index\": 0, \"delta\": {\"content\": \"}\\\"\"}, \
             \"logprobs\": null, \"finish_reason\": null}]}\n\n"
        );
        assert_eq!(
            stripped(event, false, true),
            event.replace("{\"content\": [{\"t\": \"]\"}]}", "null")
        );
        assert_eq!(
            stripped(event, true, false),
            event
                .replace(", \"prompt_token_ids\": [1, 2]", "")
                .replace(", \"token_ids\": [5]", "")
        );
        assert_eq!(stripped(event, false, false), event);
        // fields first, last, side by side, and alone
        assert_eq!(
            stripped(
                "data: {\"prompt_token_ids\":[1],\"choices\":[{\"token_ids\":[2]}]}\n\n",
                true,
                true
            ),
            "data: {\"choices\":[{}]}\n\n"
        );
        assert_eq!(
            stripped(
                "data: {\"choices\":[{\"a\":1,\"token_ids\":[2],\"logprobs\":{}},{\"logprobs\":null}]}\n\n",
                true,
                true
            ),
            "data: {\"choices\":[{\"a\":1,\"logprobs\":null},{\"logprobs\":null}]}\n\n"
        );
        // a repeated field, alone: no comma is left between what was taken out
        assert_eq!(
            stripped(
                "data: {\"choices\":[{\"token_ids\":[1], \"token_ids\":[2]}]}\n\n",
                true,
                false
            ),
            "data: {\"choices\":[{}]}\n\n"
        );
    }

    fn reply(answer: &str, token_ids: bool, logprobs: bool) -> Option<String> {
        let strip = Strip {
            token_ids,
            logprobs,
        };
        answer_reply(answer.as_bytes(), strip).map(|out| String::from_utf8(out.to_vec()).unwrap())
    }

    #[test]
    fn a_whole_answer_loses_what_a_chunk_loses_and_is_written_compactly() {
        let answer = "{\n \"id\": \"c\",\n \"prompt_token_ids\": [1, 2],\n \"choices\": [\n  {\"index\": 0, \
                      \"message\": {\"content\": \"a }\\\" b\\n\"},\n   \"logprobs\": {\"content\": [{\"t\": \"]\", \
                      \"logprob\": -1.5e-3}]}, \"token_ids\": [5], \"finish_reason\": null}\n ],\n \"u\": NaN\n}\n";
        assert_eq!(
            reply(answer, true, true).unwrap(),
            "{\"id\":\"c\",\"choices\":[{\"index\":0,\"message\":{\"content\":\"a }\\\" b\\n\"},\
             \"logprobs\":null,\"finish_reason\":null}],\"u\":NaN}"
        );
        assert_eq!(
            reply(answer, false, true).unwrap(),
            "{\"id\":\"c\",\"prompt_token_ids\":[1,2],\"choices\":[{\"index\":0,\"message\":\
             {\"content\":\"a }\\\" b\\n\"},\"logprobs\":null,\"token_ids\":[5],\"finish_reason\":null}],\
             \"u\":NaN}"
        );
        // nothing to take out: the answer's own bytes, not a copy
        let borrowed = answer_reply(answer.as_bytes(), Strip::default()).unwrap();
        assert!(matches!(borrowed, Cow::Borrowed(b) if b == answer.as_bytes()));
        // what json.loads reads, and no more
        assert_eq!(
            reply("{\"a\": \"\\ud800\", \"b\": -Infinity}", true, true).unwrap(),
            "{\"a\":\"\\ud800\",\"b\":-Infinity}"
        );
        assert_eq!(
            reply(
                "{\"prompt_token_ids\":[1],\"choices\":[{\"token_ids\":[2]}]}",
                true,
                true
            )
            .unwrap(),
            "{\"choices\":[{}]}"
        );
    }

    #[test]
    fn an_answer_that_is_not_one_json_object_is_left_to_the_control_plane() {
        for answer in [
            "<html>not json</html>",
            "[{\"choices\": []}]",
            "\"text\"",
            "{\"a\": tru}",
            "{\"a\": 1} {}",
            "{\"a\": 1,}",
            "{\"a\": \"\u{1}\"}",
            "{\"a\": 123456789012345678901234567890}",
            "\u{feff}{\"a\": 1}",
            "{\"a\": \"\\x\"}",
            "",
        ] {
            for (token_ids, logprobs) in [(false, false), (true, true)] {
                assert_eq!(reply(answer, token_ids, logprobs), None, "{answer:?}");
            }
        }
        assert_eq!(answer_reply(b"{\"a\":\"\xff\"}", Strip::default()), None);
        assert_eq!(answer_reply(b"{\0\"\0}\0", Strip::default()), None);
        let deep = format!("{{\"a\": {}1{}}}", "[".repeat(600), "]".repeat(600));
        assert_eq!(reply(&deep, true, true), None);
        // a field written with an escape in its key: json.loads reads its name, the edits not
        let escaped = "{\"prompt_token_id\\u0073\": [1], \"choices\": []}";
        assert_eq!(reply(escaped, true, true), None);
        assert_eq!(reply(escaped, false, false).unwrap(), escaped);
        let in_choice = "{\"choices\": [{\"logprob\\u0073\": {}}]}";
        assert_eq!(reply(in_choice, true, true), None);
    }

    #[test]
    fn what_is_not_a_chunk_passes_as_it_came() {
        for event in [
            "data: [DONE]\n\n",
            ": keep-alive\n\n",
            "data: {\"choices\": [1, {\"token_ids\": [\n\n",
            "data: not json\n\n",
            "event: x\ndata: \"text\"\n\n",
        ] {
            assert_eq!(stripped(event, true, true), event);
        }
    }
}
