"""An upstream answer's top-level `prompt_token_ids` is read straight into packed ids
(`_decoded_answer`): the answer then reads as json.loads reads it, key order and duplicate
keys too, whatever else it holds and however it is written."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_store.engine.intake import PackedIds
from rollout_store.serve.server import _decoded_answer, _plain_answer

_ids = st.lists(st.integers(0, 2**32 - 1), max_size=20).map(json.dumps)
_odd = st.sampled_from(
    ["null", "[]", "[-1]", "[1.5]", "[4294967296]", '"[1]"', "[[1]]", '{"ids": [1]}', " [ 7 ] "]
)
_other = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
).map(json.dumps)
_keys = st.sampled_from(["prompt_token_ids", "prompt_token_id\\u0073", "choices", "x", "id"])
_members = st.lists(st.tuples(_keys, _ids | _odd | _other), min_size=1, max_size=6)


@settings(max_examples=400, deadline=None)
@given(_members, st.sampled_from([", ", ",", ",\n  "]))
def test_an_answer_reads_as_json_loads_reads_it(members: list[tuple[str, str]], sep: str) -> None:
    text = ("{" + sep.join(f'"{key}": {value}' for key, value in members) + "}").encode()
    decoded = _decoded_answer(text)
    assert json.dumps(_plain_answer(decoded)) == json.dumps(json.loads(text))
    last = [value for key, value in members if key == "prompt_token_ids"][-1:]
    if last and type(decoded.get("prompt_token_ids")) is PackedIds:
        assert json.loads(last[0]) == decoded["prompt_token_ids"].tolist()


def test_long_ids_are_packed_and_the_rest_decoded() -> None:
    ids = list(range(0, 2**32, 2**20))
    answer = {"id": "c", "prompt_token_ids": ids, "choices": [{"token_ids": [1]}], "n": 1.5}
    decoded = _decoded_answer(json.dumps(answer).encode())
    assert type(decoded["prompt_token_ids"]) is PackedIds
    assert list(decoded) == list(answer) and _plain_answer(decoded) == answer
