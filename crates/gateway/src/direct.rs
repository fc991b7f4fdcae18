//! The direct lane of `--ack fast`: a Chat Completions call the data plane sends upstream by
//! itself, with no Python on the way there, when the control plane could make nothing else
//! of it.
//!
//! The control plane's `prepare` checks a body and makes its upstream body; for most calls
//! that is one check of fields the depth check read already, then the client's bytes with
//! `"stream": false` (and the capture fields the server asks for) appended before the closing
//! brace (`upstream_parts` in the Python server). [`upstream_tail`] says when a body is such a
//! call, and makes the same bytes: only a body the control plane would accept as it is, and
//! forward as those bytes, takes the lane. Any other (a field to drop or replace, a value the
//! control plane refuses or reads its own way) goes through `prepare` as before, so the
//! refusals and the bodies sent upstream stay the control plane's.

use crate::depth::Checked;

/// JSON whitespace, as `json.loads` skips it.
const SPACE: &[u8] = b" \t\r\n";

/// Where the JSON whitespace before `end` in `raw` begins (`end` when there is none).
fn end_of_text(raw: &[u8], end: usize) -> usize {
    raw[..end]
        .iter()
        .rposition(|b| !SPACE.contains(b))
        .map_or(0, |at| at + 1)
}

/// The model route of a call, as the lane sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `/v1/chat/completions`; `capture_tokens`: the server asks for token ids and logprobs.
    Chat { capture_tokens: bool },
    /// Anthropic's `/v1/messages` (no capture field is asked for).
    Messages,
}

impl Route {
    /// The upstream path.
    #[must_use]
    pub fn path(self) -> &'static str {
        match self {
            Route::Chat { .. } => "/v1/chat/completions",
            Route::Messages => "/v1/messages",
        }
    }

    /// The capture fields the reply has taken out (those the server asked for).
    #[must_use]
    pub fn strip(self) -> crate::sse::Strip {
        let capture = self
            == Route::Chat {
                capture_tokens: true,
            };
        crate::sse::Strip {
            token_ids: capture,
            logprobs: capture,
        }
    }
}

/// The upstream body of a call that takes the direct lane, as `(head, tail)`: the client's
/// `raw[..head]`, then `tail`; `None` when the call is to be prepared by the control plane.
///
/// A call takes the lane when its body was read whole as strict UTF-8 (no byte order mark)
/// with every field within its depth limit, `messages` of the required shape and no int
/// longer than `max_digits` (0: no limit), its top-level keys are plain and distinct, it
/// names none of the fields the upstream body sets or drops (`stream`, `stream_options`, and
/// for Chat Completions with `capture_tokens` `return_token_ids` and `logprobs`), and its
/// `model` (if any) is a string, its `tools` an array, a Chat Completions call's `n` `1`
/// and an Anthropic call's `system` a string or an array. The tail is `, "stream": false`
/// (and `, "return_token_ids": true, "logprobs": true` when the server asks for them) and
/// the brace, exactly as `json.dumps` of the extra members writes them.
#[must_use]
pub fn upstream_tail(
    raw: &[u8],
    checked: &Checked,
    fields: Option<&[(String, usize, usize)]>,
    route: Route,
    max_digits: usize,
) -> Option<(usize, Vec<u8>)> {
    // the capture fields the server asks for (Chat Completions only)
    let capture = route
        == Route::Chat {
            capture_tokens: true,
        };
    if !(checked.depth && checked.shape && checked.utf8) || raw.first() != Some(&b'{') {
        return None;
    }
    if !checked
        .digits
        .is_some_and(|d| max_digits == 0 || d <= max_digits)
    {
        return None;
    }
    let fields = fields?;
    for (i, (key, start, end)) in fields.iter().enumerate() {
        if fields[..i].iter().any(|(other, _, _)| other == key) {
            return None; // a repeated key: json.loads keeps the last value
        }
        let value = raw.get(*start..*end)?;
        let fits = match (key.as_str(), route) {
            ("stream" | "stream_options", _) => false,
            ("return_token_ids" | "logprobs", _) => !capture,
            ("n", Route::Chat { .. }) => value == b"1",
            ("model", _) => value.first() == Some(&b'"'),
            ("tools", _) => value.first() == Some(&b'['),
            ("system", Route::Messages) => matches!(value.first(), Some(b'"' | b'[')),
            _ => true,
        };
        if !fits {
            return None;
        }
    }
    let end = end_of_text(raw, raw.len());
    if end == 0 || raw[end - 1] != b'}' {
        return None;
    }
    let head = end_of_text(raw, end - 1);
    let mut tail = Vec::with_capacity(64);
    if raw[head - 1] != b'{' {
        tail.extend_from_slice(b", ");
    }
    tail.extend_from_slice(b"\"stream\": false");
    if capture {
        tail.extend_from_slice(b", \"return_token_ids\": true, \"logprobs\": true");
    }
    tail.push(b'}');
    Some((head, tail))
}

/// [`upstream_tail`] of a body, read as the data plane reads a call's body
/// (its depth check, then its top-level fields when it is strict UTF-8).
#[must_use]
pub fn body_tail(raw: &[u8], route: Route, max_digits: usize) -> Option<(usize, Vec<u8>)> {
    let checked = crate::depth::check(raw, route == Route::Messages).ok()?;
    let fields: Option<Vec<(String, usize, usize)>> = if checked.utf8 {
        engine::json::scan::fields(raw).map(|found| {
            found
                .into_iter()
                .map(|(k, s, e)| (k.to_string(), s, e))
                .collect()
        })
    } else {
        None
    };
    upstream_tail(raw, &checked, fields.as_deref(), route, max_digits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail(raw: &[u8], capture_tokens: bool) -> Option<String> {
        let (head, tail) = body_tail(raw, Route::Chat { capture_tokens }, 4300)?;
        let mut sent = raw[..head].to_vec();
        sent.extend_from_slice(&tail);
        Some(String::from_utf8(sent).unwrap())
    }

    const MESSAGES: &str = r#""messages": [{"role": "user", "content": "hi"}]"#;

    #[test]
    fn a_plain_call_gets_the_fields_appended_before_its_brace() {
        let raw = format!("{{\"model\": \"m\", {MESSAGES}}} \n");
        assert_eq!(
            tail(raw.as_bytes(), true).unwrap(),
            format!(
                "{{\"model\": \"m\", {MESSAGES}, \"stream\": false, \"return_token_ids\": true, \
                 \"logprobs\": true}}"
            )
        );
        let raw = format!("{{{MESSAGES} }}");
        assert_eq!(
            tail(raw.as_bytes(), false).unwrap(),
            format!("{{{MESSAGES}, \"stream\": false}}")
        );
    }

    #[test]
    fn a_call_the_control_plane_reads_its_own_way_is_prepared_by_it() {
        for body in [
            format!("{{{MESSAGES}, \"stream\": false}}"),
            format!("{{{MESSAGES}, \"stream_options\": {{}}}}"),
            format!("{{{MESSAGES}, \"logprobs\": false}}"),
            format!("{{{MESSAGES}, \"return_token_ids\": true}}"),
            format!("{{{MESSAGES}, \"n\": 2}}"),
            format!("{{{MESSAGES}, \"n\": 1.0}}"),
            format!("{{{MESSAGES}, \"model\": 3}}"),
            format!("{{{MESSAGES}, \"tools\": {{}}}}"),
            format!("{{{MESSAGES}, \"x\": 1, \"x\": 2}}"),
            format!("{{{MESSAGES}, \"x\\u0041\": 1}}"),
            format!("{{{MESSAGES}, \"x\": 1{}}}", "0".repeat(4301)),
            format!("\u{feff}{{{MESSAGES}}}"),
            r#"{"messages": []}"#.to_string(),
            r#"{"messages": [{"role": 1}]}"#.to_string(),
            r#"{"model": "m"}"#.to_string(),
            format!("[{{{MESSAGES}}}]"),
            format!("{{{MESSAGES}"),
        ] {
            assert_eq!(tail(body.as_bytes(), true), None, "{body}");
        }
        // without capture_tokens the capture fields are the client's own
        let raw = format!("{{{MESSAGES}, \"logprobs\": false}}");
        assert!(tail(raw.as_bytes(), false).is_some());
        let raw = format!("{{{MESSAGES}, \"n\": 1}}");
        assert!(tail(raw.as_bytes(), true).is_some());
    }

    #[test]
    fn an_anthropic_call_gets_the_stream_field_only() {
        let anthropic = |raw: &str| {
            let (head, tail) = body_tail(raw.as_bytes(), Route::Messages, 4300)?;
            Some(format!(
                "{}{}",
                &raw[..head],
                String::from_utf8(tail).unwrap()
            ))
        };
        let raw = format!("{{\"system\": \"be brief\", {MESSAGES}, \"n\": 2, \"logprobs\": 1}}");
        assert_eq!(
            anthropic(&raw).unwrap(),
            format!("{{\"system\": \"be brief\", {MESSAGES}, \"n\": 2, \"logprobs\": 1, \"stream\": false}}")
        );
        for body in [
            format!("{{\"system\": 1, {MESSAGES}}}"),
            format!("{{{MESSAGES}, \"stream\": false}}"),
        ] {
            assert_eq!(anthropic(&body), None, "{body}");
        }
    }
}
