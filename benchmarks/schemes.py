"""The three ways of recording turns that the benchmarks compare, behind one interface.

Each recorder has `add(body, session_id=...)` and `close()`; `root` is the object that holds it all.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

INTERN_MIN_LEN = 1024
SHARE_THRESHOLD = 1024


class PlainRecorder:
    """The well-known capture graph: keeps each decoded body as is (token ids as lists of ints)
    and finds a parent by comparing the new turn against every stored turn: the longest stored
    turn whose prompt_ids + sampled_ids prefix the new prompt_ids, or, without token ids, whose
    messages + response prefix the new messages."""

    def __init__(self) -> None:
        self.nodes: list[dict] = []

    @property
    def root(self) -> object:
        return self

    def _store(self, body: dict) -> dict:
        return body

    def add(self, body: dict, session_id: str = "s") -> str:
        body = self._store(body)
        parent = self._token_parent(body) if body.get("prompt_ids") is not None else None
        if parent is None:
            parent = self._message_parent(body)
        node_id = f"turn-{len(self.nodes)}"
        self.nodes.append(
            {"node_id": node_id, "parent_id": parent, "session_id": session_id, "body": body}
        )
        return node_id

    def _token_parent(self, body: dict) -> str | None:
        prompt = body["prompt_ids"]
        best, best_len = None, -1
        for node in self.nodes:
            prev_prompt = node["body"].get("prompt_ids")
            if prev_prompt is None:
                continue
            prev_sampled = node["body"].get("sampled_ids") or []
            split, end = len(prev_prompt), len(prev_prompt) + len(prev_sampled)
            if end <= best_len or end > len(prompt):
                continue
            if prompt[:split] == prev_prompt and prompt[split:end] == prev_sampled:
                best, best_len = node["node_id"], end
        return best

    def _message_parent(self, body: dict) -> str | None:
        messages = body["messages"]
        best, best_len = None, -1
        for node in self.nodes:
            prev_messages, response = node["body"]["messages"], node["body"].get("response")
            split = len(prev_messages)
            end = split + (response is not None)
            if end <= best_len or end > len(messages):
                continue
            if messages[:split] == prev_messages and (
                response is None or messages[split] == response
            ):
                best, best_len = node["node_id"], end
        return best

    def close(self) -> None:
        pass


class InterningRecorder(PlainRecorder):
    """The known partial fix: one graph-local dict interns strings of 1024 characters or more;
    dicts and lists are still rebuilt per turn and token lists kept in full per turn."""

    _TOKEN_KEYS = ("prompt_ids", "sampled_ids", "sampled_logprobs")

    def __init__(self) -> None:
        super().__init__()
        self.strings: dict[str, str] = {}

    def _intern(self, value: object) -> object:
        if isinstance(value, str):
            if len(value) < INTERN_MIN_LEN:
                return value
            return self.strings.setdefault(value, value)
        if isinstance(value, dict):
            return {key: self._intern(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self._intern(item) for item in value]
        return value

    def _store(self, body: dict) -> dict:
        stored = {}
        for key, value in body.items():
            if key in self._TOKEN_KEYS:
                stored[key] = None if value is None else list(value)
            else:
                stored[key] = self._intern(value)
        return stored


def _import_rollout_store():
    """Import the library, from the repository this folder belongs to when not installed."""
    try:
        import rollout_store
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import rollout_store
    return rollout_store


def turn_node(body: dict, session_id: str = "s", **fields: object) -> object:
    """The `TurnNode` of a workload body (token fields may be absent); `fields` replace
    what the body gives (e.g. `request_messages=RawJSON(...)`)."""
    node = {
        "request_messages": body["messages"],
        "request_tools": body["tools"],
        "response_message": body["response"],
        "sampling_params": body["sampling_params"],
        "prompt_ids": body.get("prompt_ids"),
        "sampled_ids": body.get("sampled_ids"),
        "sampled_logprobs": body.get("sampled_logprobs"),
        "model": body["model"],
        "finish_reason": body["finish_reason"],
        "harness_session_id": session_id,
    }
    node.update(fields)
    return _import_rollout_store().TurnNode(**node)


class RolloutStoreRecorder:
    """rollout_store: `RolloutGraph(share_threshold=1024).add_turn(TurnNode(...))`."""

    def __init__(self) -> None:
        rs = _import_rollout_store()
        self._turn_node = rs.TurnNode
        self.graph = rs.RolloutGraph(share_threshold=SHARE_THRESHOLD)

    @property
    def root(self) -> object:
        return self.graph

    def add(self, body: dict, session_id: str = "s") -> object:
        # the node built in place (as `turn_node` does, without its dict and keyword
        # unpacking): the timed add is add_turn's, not the harness's
        get = body.get
        node = self._turn_node(
            request_messages=body["messages"],
            request_tools=body["tools"],
            response_message=body["response"],
            sampling_params=body["sampling_params"],
            prompt_ids=get("prompt_ids"),
            sampled_ids=get("sampled_ids"),
            sampled_logprobs=get("sampled_logprobs"),
            model=body["model"],
            finish_reason=body["finish_reason"],
            harness_session_id=session_id,
        )
        return self.graph.add_turn(node)

    def close(self) -> None:
        close = getattr(self.graph, "close", None)
        if close is not None:
            close()


SCHEMES: dict[str, Callable[[], object]] = {
    "plain": PlainRecorder,
    "interning": InterningRecorder,
    "rollout_store": RolloutStoreRecorder,
}


def available_schemes() -> list[str]:
    """Scheme names whose code can be imported here (rollout_store may not be yet)."""
    try:
        _import_rollout_store()
    except ImportError as exc:
        print(f"rollout_store is not importable ({exc}): its scheme is skipped", file=sys.stderr)
        return [name for name in SCHEMES if name != "rollout_store"]
    return list(SCHEMES)
