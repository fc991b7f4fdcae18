"""A stream's events made its complete response again: the stub's replayed streams add up to
the answers they were made of, deltas in pieces join, and an event that cannot be read is
named."""

from __future__ import annotations

import sys

import pytest

from rollout_store.errors import InvalidValueError
from rollout_store.serve.assemble import assembled, events_of, holds_error
from rollout_store.serve.sse import anthropic_events, chat_chunks, sse_data, sse_event
from rollout_store.serve.stub_engine import chat_response, messages_response

TOOLS = [{"type": "function", "function": {"name": "look"}}]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["text", "tool call"])
def test_a_chat_stream_adds_up_to_its_answer(tools: list[object] | None) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi there"}]}
    if tools:
        body["tools"] = tools
    answer = chat_response({**body, "logprobs": True, "return_token_ids": True})
    stream = b"".join(chat_chunks(answer, include_usage=True, token_ids=True))
    whole = assembled(stream, anthropic=False)
    (choice,) = whole["choices"]
    expected = answer["choices"][0]
    assert choice["message"] == expected["message"]
    assert list(choice["message"]) == list(expected["message"])  # key order too
    assert choice["logprobs"] == expected["logprobs"]
    assert choice["token_ids"] == expected["token_ids"]
    assert choice["finish_reason"] == expected["finish_reason"]
    assert whole["prompt_token_ids"] == answer["prompt_token_ids"]
    assert whole["usage"] == answer["usage"]


def test_chat_deltas_in_pieces_join() -> None:
    def chunk(delta: dict[str, object], **choice: object) -> bytes:
        return sse_data({"choices": [{"index": 0, "delta": delta, **choice}]})

    stream = b"".join(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning_content": "a "}),
            chunk({"reasoning_content": "b", "content": None}),
            chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function"}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '{"x"'}}]}),
            chunk(
                {
                    "tool_calls": [
                        {"index": 0, "type": "function", "function": {"arguments": ": 1}"}}
                    ]
                }
            ),
            chunk({}, finish_reason="tool_calls"),
            b"data: [DONE]\n\n",
        ]
    )
    (choice,) = assembled(stream, anthropic=False)["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "a b",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        ],
    }
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["text", "tool use"])
def test_an_anthropic_stream_adds_up_to_its_answer(tools: list[object] | None) -> None:
    body: dict[str, object] = {"model": "c", "messages": [{"role": "user", "content": "hi"}]}
    if tools:
        body["tools"] = tools
    answer = messages_response(body)
    answer["content"].insert(0, {"type": "thinking", "thinking": "hm", "signature": "s"})
    whole = assembled(b"".join(anthropic_events(answer)), anthropic=True)
    assert whole["content"] == answer["content"]
    assert [list(b) for b in whole["content"]] == [list(b) for b in answer["content"]]
    assert whole["stop_reason"] == answer["stop_reason"]
    assert whole["usage"] == answer["usage"]


@pytest.mark.parametrize(
    ("stream", "anthropic", "where"),
    [
        (b"data: {}\n\ndata: not json\n\n", False, "event 1"),
        (b'data: {"choices": [1]}\n\n', False, "event 0.choices[0]"),
        (
            b'data: {"choices": [{"delta": {"tool_calls": [{"index": 3}]}}]}\n\n',
            False,
            "tool_calls[0]",
        ),
        (b"data: [DONE]\n\n", False, "choices"),
        (b'event: ping\ndata: {"type": "ping"}\n\n', True, "message_start"),
        (
            sse_event(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {}}
            ),
            True,
            "event 0 (content_block_delta)",
        ),
    ],
)
def test_an_event_that_cannot_be_read_is_named(stream: bytes, anthropic: bool, where: str) -> None:
    with pytest.raises(InvalidValueError) as caught:
        assembled(stream, anthropic=anthropic)
    assert where in caught.value.path


@pytest.mark.parametrize("anthropic", [False, True])
def test_an_event_nesting_deeper_than_python_reads_is_named(anthropic: bool) -> None:
    depth = sys.getrecursionlimit() + 100
    deep = b"data: " + b"[" * depth + b"]" * depth + b"\n\n"
    with pytest.raises(InvalidValueError, match="nests too deeply") as caught:
        assembled(deep, anthropic=anthropic)
    assert caught.value.path == "event 0"
    assert not holds_error(deep, anthropic=False)  # not an error event: no RecursionError


def test_a_tool_input_nesting_deeper_than_python_reads_is_named() -> None:
    """Each piece of a tool input is shallow; the input they join to is not."""
    depth = sys.getrecursionlimit() + 100
    start = {"type": "message_start", "message": {"role": "assistant", "content": []}}
    block = {"type": "tool_use", "id": "t", "name": "look", "input": {}}
    stream = sse_event("message_start", start) + sse_event(
        "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}
    )
    for part in ("[" * depth, "]" * depth):
        delta = {"type": "input_json_delta", "partial_json": part}
        stream += sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )
    stream += sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
    with pytest.raises(InvalidValueError, match="nests too deeply") as caught:
        assembled(stream, anthropic=True)
    assert caught.value.path == "event 4 (content_block_stop)"


def test_events_and_errors_are_read_as_the_sse_grammar_says() -> None:
    stream = b": comment\r\nevent: x\r\ndata: 1\r\ndata: 2\r\n\r\ndata:3\n\n"
    assert list(events_of(stream)) == [("x", "1\n2"), ("message", "3")]
    assert holds_error(b'data: {"error": {"message": "overloaded"}}\n\n', anthropic=False)
    assert not holds_error(b'data: {"choices": [], "x": "\\"error\\""}\n\n', anthropic=False)
    assert holds_error(b'event: error\ndata: {"type": "error"}\n\n', anthropic=True)
