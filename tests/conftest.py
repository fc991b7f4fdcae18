"""Hypothesis profiles for the suite: pick one with HYPOTHESIS_PROFILE (default, ci, long)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# the Redis and S3 servers of the store tests (fixtures redis_url, s3_url, own_redis)
pytest_plugins = ["services"]

settings.register_profile(
    "default",
    max_examples=100,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=300,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=5000,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# ---------------------------------------------------------------- every graph round-trips
# Each graph a test builds is saved and loaded back when the test ends, and must come back
# the same: export (messages, discarded turns), token fields, stats and links.

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from rollout_store import RolloutGraph, export_session  # noqa: E402
from rollout_store.blobs import content_digest  # noqa: E402


def graph_snapshot(graph: RolloutGraph) -> str:
    doc = export_session(graph, include_messages=True, include_discarded=True)
    turns = [graph.get(n) for n in graph.node_ids()]
    tokens = [(t.prompt_ids, t.sampled_ids, t.sampled_logprobs) for t in turns]
    links = [(graph.parent(n), graph.link_kind(n)) for n in graph.node_ids()]
    return json.dumps(doc) + repr(tokens) + repr(links) + repr(graph.stats())


@pytest.fixture(autouse=True)
def every_graph_round_trips(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
):
    built: list[RolloutGraph] = []
    original = RolloutGraph.__init__

    def recording_init(self: RolloutGraph, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(RolloutGraph, "__init__", recording_init)
    yield
    monkeypatch.undo()
    # a graph may hold ints a default process cannot write as text (read from a file written
    # where the limit was raised): the comparison below writes them, so it lifts the limit
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        _round_trip(built, tmp_path_factory)
    finally:
        sys.set_int_max_str_digits(limit)


def _round_trip(built: list[RolloutGraph], tmp_path_factory: pytest.TempPathFactory) -> None:
    folder: Path | None = None
    for graph in built:
        # graphs read from files, empty ones, and ones with an injected (colliding) hasher
        # whose digests a file cannot verify are left out
        if graph.load_report is not None or not len(graph):
            continue
        if graph.blobs._hasher is not content_digest:
            continue
        folder = folder or tmp_path_factory.mktemp("roundtrip")
        path = folder / f"{len(list(folder.iterdir()))}.rls"
        graph.save(path)
        assert graph_snapshot(RolloutGraph.load(path)) == graph_snapshot(graph)
