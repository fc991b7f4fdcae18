"""The session document and the JSONL trace, as dicts or streamed to a file.

`export_session` builds the document a trainer reads, in the capture graph's own layout:

    session_id, metadata, budget_stop_count
    turns        every turn in arrival order, discarded retries flagged; a turn the capture
                 server timed also has `timeline` (`Timeline.document`)
    stats        graph shape (n_turns, n_roots, n_leaves, n_forks, n_discarded) and
                 n_sequences, n_trainable_sequences, n_trainable_tokens
    sequences    one row per root-to-leaf path, labelled agent / auxiliary / discarded,
                 each with its findings and whether it is trainable
    validation   findings about the whole rollout; when no row is trainable, first the
                 FATAL findings of the agent rows (each naming its row), so why is seen
                 at once
    trainable    the one gate: some agent row survived and nothing about the rollout is fatal
    capture_level  what the engine returned: "tokens" (token ids: trainable), "logprobs",
                 "text" or "messages"; by default what the graph holds ("tokens" when some
                 turn carries token ids, else "text", as the capture server decides)
    rollout_type "train" when the document is trainable, else "eval" (kept to read and
                 evaluate, nothing to train on)
    group, labels, annotations, reward, rewards
                 the graph's training metadata (see `metadata`), when it has any; each
                 row then also carries its `reward` (its leaf's own, else the graph's)
    drift        the drift audit (`Graph.drift()`: roots whose messages continue a turn
                 their token ids do not extend), when it recorded any

Row roles. A row (one root-to-leaf path) is the *agent*'s when it is the work the rollout is
about: when some live path's turns were sent tools, the paths with tools are the agent's and
those without are *auxiliary* (side calls of the harness: a title generator, a summarizer,
a classifier), never trained on. When no path was sent tools, every live path is the agent's
(with a "tokens" capture, those with trainable tokens). A path ending in a retry the harness
dropped is *discarded*. Each turn's `n_tools` (the number of tools sent, counted by the graph
unless the caller gave it) decides.

A graph without metadata, drift or timelines gives the document of the capture graph, key for key.

`write_session_json` writes the same bytes as `json.dumps(export_session(...))`, holding one
turn's or one sequence's values at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from ..errors import InvalidArgumentError
from ..graph import Graph
from ..model.training import TrainingSequence
from .checks import Report, check_rollout, check_sequence
from .jsonstream import Streamed, write_document, writer_for

__all__ = [
    "AGENT",
    "AUXILIARY",
    "CAPTURE_LEVELS",
    "DISCARDED",
    "PURPOSES",
    "held_capture_level",
    "export_session",
    "iter_turn_records",
    "summarise",
    "write_session_json",
    "write_trace_jsonl",
]

AGENT, AUXILIARY, DISCARDED = "agent", "auxiliary", "discarded"

#: The capture levels an export takes, most to least: only "tokens" is trainable.
CAPTURE_LEVELS = ("tokens", "logprobs", "text", "messages")
#: What a rollout is for: "auto" (trainable when the capture is), "train" or "eval".
PURPOSES = ("auto", "train", "eval")


def held_capture_level(graph: Graph) -> str:
    """The capture level a graph's turns support: "tokens" when some turn carries the
    engine's token ids (the rows without them are flagged, the others trainable), else
    "text"."""
    return "tokens" if any(graph.summary(n)["n_prompt"] > 0 for n in graph.node_ids()) else "text"


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`, else `InvalidArgumentError` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


#: The graph-shape counts of `RolloutGraph.stats()` that the document carries.
SHAPE_KEYS = ("n_turns", "n_roots", "n_leaves", "n_forks", "n_discarded")

_UNSET: Any = object()


@dataclass
class _Session:
    """What the document needs beyond the graph."""

    graph: Graph
    session_id: Any
    metadata: Any
    budget_stop_count: Any
    findings: list[Any]
    purpose: Any


def _session(
    source: Any,
    session_id: Any,
    metadata: Any,
    budget_stop_count: Any,
    findings: Any,
    purpose: Any,
) -> _Session:
    """Keyword arguments win; a session-like object (one with a `graph`) fills the rest."""
    holder: Any = None
    if isinstance(source, Graph):
        graph = source
    else:
        found = getattr(source, "graph", None)
        if not isinstance(found, Graph):
            raise InvalidArgumentError(
                "export_session expects a RolloutGraph or a session object whose `graph` is "
                f"one, got {type(source).__name__}"
            )
        graph, holder = found, source

    def pick(value: Any, name: str, default: Any) -> Any:
        if value is not _UNSET:
            return value
        return getattr(holder, name, default) if holder is not None else default

    return _Session(
        graph,
        pick(session_id, "session_id", None),
        pick(metadata, "metadata", None),
        pick(budget_stop_count, "budget_stop_count", 0),
        list(pick(findings, "findings", None) or []),
        pick(purpose, "purpose", "auto"),
    )


def _plan(
    graph: Graph, discarded: set[str], trainable: bool
) -> list[tuple[str, str, bool, int, list[str]]]:
    """Each leaf's (leaf, role, trainable, n_trainable, fatal findings of an agent row),
    building one sequence at a time.

    Roles are structural: a path ending in a dropped retry is discarded; a path whose turns
    carry tools is the agent working, one without is auxiliary (a title generator, a
    summarizer). Tools tell them apart only when some live paths have them: when none has
    any, every live path is the agent's (with a trainable capture, those with trainable
    tokens).
    """
    leaves = graph.leaf_ids()
    paths = [graph.path_ids(leaf) for leaf in leaves]
    tools = {nid: (graph.summary(nid)["n_tools"] or 0) > 0 for path in paths for nid in path}
    live = [path for leaf, path in zip(leaves, paths, strict=True) if leaf not in discarded]
    any_tools = any(tools[nid] for path in live for nid in path)
    plan = []
    for leaf, path in zip(leaves, paths, strict=True):
        seq = graph.sequence_for(leaf)
        n_trainable = seq.n_trainable if trainable else 0
        if leaf in discarded:
            role = DISCARDED
        elif any_tools:
            role = AGENT if any(tools[nid] for nid in path) else AUXILIARY
        elif trainable:
            role = AGENT if n_trainable else AUXILIARY
        else:
            role = AGENT
        fatal: list[str] = []
        if trainable and role == AGENT:
            fatal = [str(f) for f in check_sequence(seq).fatal]
        plan.append((leaf, role, trainable and role == AGENT and not fatal, n_trainable, fatal))
    return plan


def _row(
    seq: TrainingSequence,
    role: str,
    report: Report | None,
    trainable: bool,
    reward: Any,
) -> dict[str, Any]:
    return {
        "role": role,
        "root_id": seq.root_id,
        "node_ids": seq.node_ids,
        "n_turns": seq.n_turns,
        "prompt_len": seq.prompt_len,
        "n_trainable": seq.n_trainable if trainable else 0,
        "turn_lengths": seq.turn_lengths(),
        "input_ids": seq.input_ids,
        "loss_mask": seq.loss_mask if trainable else [0] * len(seq.input_ids),
        "logprobs": seq.logprobs,
        "trainable": bool(report is not None and report.ok and role == AGENT),
        "validation": report.lines() if report is not None else [],
        **({} if reward is _UNSET else {"reward": reward}),
    }


def _root_ids(graph: Graph) -> dict[str, str]:
    """Each turn's root, in one pass (walking up from every turn would be quadratic)."""
    roots: dict[str, str] = {}
    for node_id in graph.node_ids():
        chain = []
        current: str | None = node_id
        while current is not None and current not in roots:
            chain.append(current)
            current = graph.parent(current)
        top = roots[current] if current is not None else chain[-1]
        for member in chain:
            roots[member] = top
    return roots


def _turn_record(
    graph: Graph,
    node_id: str,
    root_id: str,
    discarded: bool,
    include_messages: bool,
    stream: bool,
    timelines: dict[str, Any],
) -> dict[str, Any]:
    node = graph.get(node_id)  # a view: each field below is rebuilt as it is read
    info = graph.summary(node_id)
    record: dict[str, Any] = {
        "node_id": node_id,
        "index": info["index"],
        "root_id": root_id,
        "n_sampled": info["n_sampled"],
        "n_prompt": info["n_prompt"],
        "n_tools": info["n_tools"],
        "finish_reason": info["finish_reason"],
        "harness_session_id": info["harness_session_id"],
        "sampling_params": node.sampling_params,
        "requested_sampling_params": node.requested_sampling_params,
        "sampled_logprobs": node.sampled_logprobs,
        "discarded": discarded,
    }
    if include_messages:
        messages = node.request_messages
        # streamed one message at a time: a long conversation's JSON is never whole in memory
        record["request_messages"] = (
            Streamed(messages) if stream and isinstance(messages, list | tuple) else messages
        )
        record["request_tools"] = node.request_tools
        record["response_message"] = node.response_message
    if node_id in timelines:
        record["timeline"] = timelines[node_id].document()
    return record


def _parts(
    session: _Session,
    include_messages: bool,
    include_discarded: bool,
    capture_level: str | None,
    stream: bool,
) -> tuple[dict[str, Any], Iterator[dict[str, Any]], Iterator[dict[str, Any]], dict[str, Any]]:
    """The document's head, its turns and rows (lazy), and its tail (stats first)."""
    graph = session.graph
    if capture_level is None:
        capture_level = held_capture_level(graph)
    check_choice(capture_level, "capture_level", CAPTURE_LEVELS)
    check_choice("auto" if session.purpose is None else session.purpose, "purpose", PURPOSES)
    trainable_capture = capture_level == "tokens" and session.purpose != "eval"
    rollout = check_rollout(
        graph, capture_level=capture_level, budget_stop_count=session.budget_stop_count
    )
    discarded = set(graph.discarded_ids())
    meta, drift = graph.meta, graph.drift()
    plan = [
        entry
        for entry in _plan(graph, discarded, trainable_capture)
        if include_discarded or entry[1] != DISCARDED
    ]

    def rows() -> Iterator[dict[str, Any]]:
        for leaf, role, _, _, _ in plan:
            seq = graph.sequence_for(leaf)
            report = check_sequence(seq) if trainable_capture else None
            reward = _UNSET if meta.empty else meta.reward_for(leaf)
            yield _row(seq, role, report, trainable_capture, reward)

    trainable_rows = [entry for entry in plan if entry[2]]
    shape = graph.stats()
    stats = {
        **{key: shape[key] for key in SHAPE_KEYS},
        "n_sequences": len(plan),
        "n_trainable_sequences": len(trainable_rows),
        "n_trainable_tokens": sum(entry[3] for entry in trainable_rows),
    }
    head = {
        "session_id": session.session_id,
        "metadata": session.metadata,
        "budget_stop_count": session.budget_stop_count,
    }
    roots = _root_ids(graph)
    timelines = graph.timelines()
    turns = (
        _turn_record(graph, nid, roots[nid], nid in discarded, include_messages, stream, timelines)
        for nid in graph.node_ids()
    )
    trainable = bool(trainable_rows) and rollout.ok
    # when no row trains, why is said first, not only inside each agent row
    surfaced = [
        f"{line[: line.index(']') + 1]} row {i} ({role}, ending at {leaf}): "
        f"{line[line.index(']') + 2 :]}"
        for i, (leaf, role, _, _, fatal) in enumerate(plan)
        for line in fatal
        if not trainable
    ]
    tail = {
        "validation": surfaced + rollout.lines() + session.findings,
        "trainable": trainable,
        "capture_level": capture_level,
        "rollout_type": "train" if trainable else "eval",
        **({} if meta.empty else meta.document()),
        **({"drift": drift} if drift else {}),
    }
    return head, turns, rows(), {"stats": stats, **tail}


def export_session(
    session: Any,
    *,
    include_discarded: bool = False,
    include_messages: bool = False,
    capture_level: str | None = None,
    session_id: Any = _UNSET,
    metadata: Any = _UNSET,
    budget_stop_count: Any = _UNSET,
    findings: Any = _UNSET,
    purpose: Any = _UNSET,
) -> dict[str, Any]:
    """The rollout as one JSON-ready dict (see the module docstring for its layout).

    `session` is a `RolloutGraph`, or any object with a `graph` attribute holding one (a
    capture session): its `session_id`, `metadata`, `budget_stop_count`, `findings` and
    `purpose` are read when present. Keyword arguments given here win over them.

    Every turn is listed, discarded retries flagged; `include_discarded` also keeps their
    rows. `include_messages` adds each turn's request messages, tools and response.
    `capture_level` (one of `CAPTURE_LEVELS`) defaults to what the graph holds
    (`held_capture_level`). Any other than "tokens" (or `purpose="eval"`) makes an eval
    document: the structure is all there, no row is trainable and every loss mask is zero.
    An unknown `capture_level` or `purpose` raises `InvalidArgumentError` listing the valid
    ones.
    """
    state = _session(session, session_id, metadata, budget_stop_count, findings, purpose)
    with state.graph.lock:  # one consistent snapshot, even while other threads add turns
        head, turns, rows, tail = _parts(
            state, include_messages, include_discarded, capture_level, stream=False
        )
        stats = tail.pop("stats")
        return {**head, "turns": list(turns), "stats": stats, "sequences": list(rows), **tail}


def write_session_json(
    session: Any,
    fp: IO[Any],
    *,
    include_discarded: bool = False,
    include_messages: bool = False,
    capture_level: str | None = None,
    session_id: Any = _UNSET,
    metadata: Any = _UNSET,
    budget_stop_count: Any = _UNSET,
    findings: Any = _UNSET,
    purpose: Any = _UNSET,
) -> None:
    """Write exactly `json.dumps(export_session(session, ...))`, one turn in memory at a time."""
    state = _session(session, session_id, metadata, budget_stop_count, findings, purpose)
    with state.graph.lock:  # one consistent snapshot: add_turn in other threads waits
        head, turns, rows, tail = _parts(
            state, include_messages, include_discarded, capture_level, stream=True
        )
        stats = tail.pop("stats")
        document = {
            **head,
            "turns": Streamed(turns),
            "stats": stats,
            "sequences": Streamed(rows),
            **tail,
        }
        write_document(fp, document)


def iter_turn_records(graph: Graph) -> Iterator[dict[str, Any]]:
    """Each turn in arrival order as a flat record for training pipelines.

    `discarded` says whether the turn is a retry that was dropped (see `discarded_ids`). A
    turn the drift audit recorded also has `drift` (its entry of `Graph.drift()`, without
    `node_id`), a turn given a reward of its own (`set_reward(value, leaf=...)`) `reward`,
    and a turn with a timeline (`Graph.set_timeline`) `timeline`.
    A generator: turns added while it runs may re-link turns not yet yielded. For one
    consistent snapshot under concurrent recording use `write_trace_jsonl`, which holds the
    graph's lock throughout.
    """
    discarded = set(graph.discarded_ids())
    drift = {entry.pop("node_id"): entry for entry in graph.drift()}
    rewards = graph.rewards
    timelines = graph.timelines()
    for node_id in graph.node_ids():
        turn = graph.get(node_id)
        record: dict[str, Any] = {
            "node_id": turn.node_id,
            "parent_id": turn.parent_id,
            "index": turn.index,
            "model": turn.model,
            "finish_reason": turn.finish_reason,
            "harness_session_id": turn.harness_session_id,
            "request_messages": turn.request_messages,
            "request_tools": turn.request_tools,
            "sampling_params": turn.sampling_params,
            "requested_sampling_params": turn.requested_sampling_params,
            "response_message": turn.response_message,
            "prompt_ids": turn.prompt_ids,
            "sampled_ids": turn.sampled_ids,
            "sampled_logprobs": turn.sampled_logprobs,
            "discarded": node_id in discarded,
        }
        if node_id in drift:
            record["drift"] = drift[node_id]
        if node_id in rewards:
            record["reward"] = rewards[node_id]
        if node_id in timelines:
            record["timeline"] = timelines[node_id].document()
        yield record


def trace_trailer(graph: Graph) -> dict[str, Any] | None:
    """The trace's last line when the graph carries training metadata:
    `{"graph": {group, labels, annotations, reward, rewards}}`; else None (the trace is
    then one line per turn, as it always was)."""
    meta = graph.meta
    return None if meta.empty else {"graph": meta.document()}


def write_trace_jsonl(graph: Graph, fp: IO[Any], findings: Sequence[str] = ()) -> None:
    """One JSON line per turn (request, response, token ids, logprobs, discarded), then,
    for a graph with training metadata, one `{"graph": ...}` line (`trace_trailer`), then,
    when there are `findings` (the session's own, as an export's `validation` holds them),
    one `{"validation": [...]}` line."""
    write = writer_for(fp)
    with graph.lock:
        for record in iter_turn_records(graph):
            write(json.dumps(record))
            write("\n")
        trailer = trace_trailer(graph)
        if trailer is not None:
            write(json.dumps(trailer))
            write("\n")
    if findings:
        write(json.dumps({"validation": list(findings)}))
        write("\n")


def summarise(document: dict[str, Any]) -> str:
    """A few lines to read after a rollout, returned as one string (print it): shape,
    training totals, each row, the findings.

    `document` is what `export_session` returns. Findings at INFO level are left out of the
    per-row lines.
    """
    stats = document["stats"]
    out = [
        f"session {document['session_id']}  {document.get('rollout_type', 'train')}  "
        f"trainable={document['trainable']}",
        f"  graph: {stats['n_turns']} turns, {stats['n_roots']} roots, "
        f"{stats['n_forks']} forks, {stats['n_discarded']} discarded",
        f"  training: {stats['n_trainable_sequences']} sequence(s), "
        f"{stats['n_trainable_tokens']} trainable tokens",
    ]
    for row in document["sequences"]:
        out.append(
            f"  [{row['role']:<10}] turns={row['n_turns']:<3} prompt={row['prompt_len']:<6} "
            f"len={len(row['input_ids']):<6} trainable={row['n_trainable']:<5} "
            f"turn_lengths={row['turn_lengths']}"
        )
        out.extend(f"      {f}" for f in row["validation"] if not f.startswith("[INFO]"))
    out.extend(f"  {f}" for f in document["validation"])
    return "\n".join(out)
