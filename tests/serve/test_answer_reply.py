"""The reply to a complete Chat Completions answer whose capture fields the server asked for
(`_chat_reply`): made by the engine from the answer's bytes (`answer_reply`, the edits a
streamed chunk gets), it reads as the reply the server made before did (the answer decoded,
`_strip_injected`, written anew), whatever the answer holds and however it is written."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_store._core import answer_reply
from rollout_store.serve.server import (
    _chat_reply,
    _decoded_answer,
    _plain_answer,
    _strip_injected,
    _written_anew,
)

_scalar = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=6)
_floats = st.floats(allow_nan=True, allow_infinity=True).map(json.dumps)
_value = (
    st.recursive(
        _scalar,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=6,
    ).map(lambda v: json.dumps(v, ensure_ascii=False))
    | _floats
)
_ids = st.lists(st.integers(0, 2**32 - 1), max_size=6).map(json.dumps)
_choice_keys = st.sampled_from(
    ["token_ids", "logprobs", "message", "index", "finish_reason", "logprob\\u0073"]
)
_answer_keys = st.sampled_from(["prompt_token_ids", "choices", "id", "x", "prompt_token_id\\u0073"])
_space = st.sampled_from(["", " ", "\n  ", "\t"])


@st.composite
def _object(draw: st.DrawFn, keys: st.SearchStrategy[str], values: st.SearchStrategy[str]) -> str:
    """An object text of members drawn (a key may repeat), spaced as drawn."""
    members = draw(st.lists(st.tuples(keys, values), max_size=6))
    sp = draw(_space)
    items = (f'"{key}"{sp}:{draw(_space)}{value}' for key, value in members)
    return "{" + sp + f",{draw(_space)}".join(items) + sp + "}"


_choice = _object(_choice_keys, _ids | _value | st.just("null")) | _value
_choices = st.lists(_choice, max_size=3).map(lambda c: "[" + ", ".join(c) + "]") | _value
_answer_values = st.one_of(_ids, _value, _choices)


def _old_reply(answer: bytes, token_ids: bool, logprobs: bool) -> bytes:
    """The reply as the server made it before: decoded, stripped, written anew."""
    response = _decoded_answer(answer)
    _strip_injected(response, token_ids, logprobs)
    return bytes(_written_anew(_plain_answer(response)).body)


@st.composite
def _answers(draw: st.DrawFn) -> bytes:
    members = draw(st.lists(st.tuples(_answer_keys, _answer_values), max_size=6))
    choices = draw(_choices)
    members.insert(draw(st.integers(0, len(members))), ("choices", choices))
    sp = draw(_space)
    text = "{" + sp + ", ".join(f'"{k}": {v}' for k, v in members) + sp + "}"
    return (draw(_space) + text + draw(_space)).encode()


@settings(max_examples=600, deadline=None)
@given(_answers(), st.sampled_from([(True, True), (True, False), (False, True)]))
def test_a_reply_made_of_the_answers_bytes_reads_as_the_reply_written_anew(
    answer: bytes, injected: tuple[bool, bool]
) -> None:
    old = _old_reply(answer, *injected)
    new = bytes(_chat_reply(_decoded_answer(answer), answer, *injected).body)
    assert json.dumps(json.loads(new)) == json.dumps(json.loads(old))
    made = answer_reply(answer, *injected)
    # (one with an escape, which may be in a key, or an int of many digits may be left to
    # Python)
    if b"\\" not in answer and not re.search(rb"[0-9]{19}", answer):
        assert made is not None
    if made is not None:
        assert made == new and b"\n" not in made  # (written compactly)


def test_an_answer_with_nothing_to_take_out_or_not_one_object_is_not_made_anew() -> None:
    answer = b'{\n "choices": [{"token_ids": [1], "logprobs": {}}]\n}'
    assert answer_reply(answer, False, False) is answer
    for odd in (
        b"<html>not json</html>",
        b"[1]",
        b'{"a": 1} x',
        b'{"n": 123456789012345678901234567890}',
        json.dumps({"choices": []}).encode("utf-16"),
    ):
        assert answer_reply(odd, True, True) is None
        assert answer_reply(odd, False, False) is None
