"""Raw token id fields (a long context's ids, as an engine wrote them) are read straight into
packed ids: the turn, its errors and its exports are those of the same ids decoded by
`json.loads`, whatever the text holds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_store import RawJSON, RolloutGraph, TurnNode, export_session
from rollout_store.engine.intake import PackedIds, packed_ids

_ids = st.lists(st.integers(0, 2**32 - 1), max_size=40)
_odd_items = st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.booleans() | st.none()
_id_texts = st.one_of(
    _ids.map(json.dumps),
    _ids.map(lambda ids: json.dumps(ids, separators=(",", ":"))),
    _ids.map(lambda ids: " \n[ " + " ,\t".join(map(str, ids)) + " ]\r\n"),
    st.lists(_ids.map(list) | st.just([]), max_size=1).map(lambda x: json.dumps(x)),
    st.lists(st.integers(0, 2**32 - 1) | _odd_items, max_size=8).map(json.dumps),
    st.sampled_from(["[01]", "[-0]", "[1.0]", "[1e3]", "[1,]", "[", "[1] x", "null", "7", "{}"]),
)


def _turn(graph: RolloutGraph, prompt: Any, sampled: Any) -> tuple[str, Any]:
    node = TurnNode(
        request_messages=[{"role": "user", "content": "hi"}],
        response_message={"role": "assistant", "content": "yo"},
        prompt_ids=prompt,
        sampled_ids=sampled,
    )
    try:
        view = graph.add_turn(node)
    except Exception as exc:  # the same refusal, class and message, is what is compared
        return ("refused", (type(exc).__name__, str(exc)))
    got = graph.get(view.node_id)
    return ("added", (json.dumps(got.prompt_ids), json.dumps(got.sampled_ids), len(graph)))


@settings(max_examples=300, deadline=None)
@given(_id_texts, _id_texts)
def test_a_raw_id_field_makes_the_turn_its_decoded_ids_make(prompt: str, sampled: str) -> None:
    raw, decoded = RolloutGraph(), RolloutGraph()

    def value(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return RawJSON(text)  # not JSON: both graphs get the same text to refuse

    got = _turn(raw, RawJSON(prompt.encode()), RawJSON(sampled.encode()))
    expected = _turn(decoded, value(prompt), value(sampled))
    assert got == expected
    assert json.dumps(export_session(raw)) == json.dumps(export_session(decoded))


@pytest.mark.parametrize(
    ("text", "ids"),
    [("[]", []), ("[0, 4294967295]", [0, 2**32 - 1]), (" [1,\n2] ", [1, 2])],
)
def test_ids_written_as_json_writes_ints_are_packed(text: str, ids: list[int]) -> None:
    packed = packed_ids(text.encode())
    assert type(packed) is PackedIds and packed.tolist() == ids and len(packed) == len(ids)


@pytest.mark.parametrize("text", ["[4294967296]", "[-1]", "[1.5]", "[true]", "[01]", '["1"]'])
def test_other_texts_are_left_to_the_decoder(text: str) -> None:
    assert packed_ids(text.encode()) is None
