"""`rollout-store run`, `capture()` and the timeline of each call: the real OpenAI and
Anthropic SDKs recorded with no code change, a child that fails or is killed leaving a
durable session, timelines that are consistent against a stub engine that sleeps a known
time, stored compactly and read back from logs and snapshots."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from capture_support import ROOT, WAIT_S, serve_app

from rollout_store import (
    Capture,
    CaptureError,
    CorruptFileError,
    InvalidArgumentError,
    InvalidValueError,
    RolloutGraph,
    Timeline,
    TurnNode,
    UnknownNodeError,
    capture,
    iter_turn_records,
)
from rollout_store import cli as cli_module
from rollout_store.files.storage import TIMELINE_BATCH
from rollout_store.model.timeline import TIMELINE_SIZE
from rollout_store.serve import server as server_module
from rollout_store.serve.stub_engine import create_stub_app
from rollout_store.viewer.app import Viewer

LATENCY_S = 0.2  # the slow stub's generation time
TOOL_S = 0.3  # what the test's "tool" sleeps between two calls


@pytest.fixture(scope="module")
def slow_stub() -> Iterator[str]:
    with serve_app(create_stub_app(latency=LATENCY_S)) as url:
        yield url


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _run(folder: Path, upstream: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_store.cli", "run", "--upstream", upstream, *args],
        cwd=folder,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _log_named(stderr: str, folder: Path) -> Path:
    line = next(x for x in stderr.splitlines() if x.startswith("  export: rollout-store export"))
    return folder / line.split()[-1]


def _assert_consistent(t: Timeline, parent: Timeline | None = None) -> None:
    """`parent`: the timeline of the turn's parent, when it has a timed one."""
    assert t.received > 1_600_000_000 * 10**6  # microseconds since the epoch, now-ish
    assert 0 <= t.upstream_sent <= t.first_byte <= t.first_token <= t.last_byte <= t.reply_sent
    assert t.max_chunk_gap <= t.reply_sent
    if parent is None:
        assert t.gap_before is None
    else:  # the wait since the parent's reply: within the wall time between the two calls
        assert t.gap_before is not None
        assert 0 <= t.gap_before <= t.received - parent.received


SDK_CHILD = """
import os
import anthropic, openai

print(os.environ["OPENAI_BASE_URL"], os.environ["ANTHROPIC_BASE_URL"], flush=True)
client = openai.OpenAI(max_retries=0)
question = [{"role": "user", "content": "What is 2 + 2?"}]
answer = client.chat.completions.create(model="m", messages=question)
follow = [*question, {"role": "assistant", "content": answer.choices[0].message.content},
          {"role": "user", "content": "And then?"}]
chunks = list(client.chat.completions.create(model="m", messages=follow, stream=True))
assert chunks and answer.choices[0].message.content
claude = anthropic.Anthropic(max_retries=0)
said = claude.messages.create(model="m", max_tokens=16,
                              messages=[{"role": "user", "content": "hi"}])
with claude.messages.stream(model="m", max_tokens=16,
                            messages=[{"role": "user", "content": "yo"}]) as stream:
    text = stream.get_final_text()
assert said.content[0].text and text
"""


@pytest.mark.slow
def test_run_records_the_real_sdks_unchanged_and_says_where(tmp_path: Path, stub: str) -> None:
    (tmp_path / "agent.py").write_text(SDK_CHILD)
    proc = _run(
        tmp_path,
        stub,
        "--label",
        "a",
        "--label",
        "b",
        "--group",
        "g1",
        "--",
        sys.executable,
        "agent.py",
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    openai_url, anthropic_url = out.split()[:2]
    assert openai_url.startswith("http://127.0.0.1:") and openai_url.endswith("/v1")
    assert anthropic_url == openai_url[: -len("/v1")]  # the SDK adds /v1/messages itself
    assert "rollout-store run: session s-" in err and "(4 turns)" in err
    log = _log_named(err, tmp_path)
    graph = RolloutGraph.load(log)
    assert len(graph) == 4 and graph.labels == ["a", "b"] and graph.group == "g1"
    timed = graph.timelines()
    assert len(timed) == 4
    children = 0
    for node_id, t in timed.items():
        parent = graph.parent(node_id)
        children += parent is not None
        _assert_consistent(t, None if parent is None else timed[parent])
    assert children == 1  # the follow-up: its gap was checked against its parent
    chunks = [t.chunks for t in timed.values()]
    assert chunks[0] == 0 and chunks[1] > 2 and chunks[2] == 0 and chunks[3] > 2
    assert cli_module.main(["verify", str(log)]) == 0


RAW_CHILD = """
import json, os, signal, sys, time, urllib.request

request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    headers={"content-type": "application/json",
             "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
)
urllib.request.urlopen(request, timeout=30).read()
mode = sys.argv[1]
if mode == "fail":
    sys.exit(3)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
print("ready", flush=True)
for _ in range(600):  # until the signal rollout-store run forwards
    time.sleep(0.1)
sys.exit(0)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "status"),
    [("fail", 3), ("kill", 128 + signal.SIGKILL), ("term", 128 + signal.SIGTERM)],
)
def test_a_child_that_fails_or_is_killed_leaves_a_durable_session(
    tmp_path: Path, stub: str, mode: str, status: int
) -> None:
    (tmp_path / "agent.py").write_text(RAW_CHILD)
    proc = _run(tmp_path, stub, "--data", "logs", "--", sys.executable, "agent.py", mode)
    if mode == "term":
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)  # to rollout-store run, which forwards it
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    log = _log_named(err, tmp_path)
    assert log.parent.name == "logs"
    graph = RolloutGraph.load(log)  # closed: its last record intact, nothing torn
    assert len(graph) == 1 and graph.load_report.ok
    (timeline,) = graph.timelines().values()
    _assert_consistent(timeline)


def test_run_names_the_command_and_passes_127_for_a_missing_one(
    tmp_path: Path, stub: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_module.main(["run", "--upstream", stub, "--"]) == 1
    assert "name the command to run" in capsys.readouterr().err
    assert not (tmp_path / "rollouts").exists()  # refused before any server started
    missing = str(tmp_path / "no-such-program")
    assert cli_module.main(["run", "--upstream", stub, "--", missing]) == 127
    err = capsys.readouterr().err
    assert "no-such-program" in err and "(0 turns)" in err


def test_run_on_a_named_server(
    tmp_path: Path, stub: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_store.serve.server import create_app

    (tmp_path / "agent.py").write_text(RAW_CHILD)
    monkeypatch.chdir(tmp_path)
    with serve_app(create_app(stub)) as url:
        argv = ["run", "--server", url, "--label", "remote", "--", sys.executable, "agent.py"]
        assert cli_module.main([*argv, "fail"]) == 3
        err = capsys.readouterr().err
        assert f"(1 turn) on {url}" in err and "curl -H 'Authorization: Bearer " in err
    assert not (tmp_path / "rollouts").exists()  # the named server keeps it
    assert cli_module.main(["run", "--server", url, "--data", "d", "--", "true"]) == 1
    assert "--data is for a server started for the run" in capsys.readouterr().err


@pytest.mark.slow  # the anthropic SDK's import alone takes seconds
def test_capture_with_both_sdks_from_threads_and_metadata(stub: str) -> None:
    with capture(upstream=stub, labels=["x"], group="grp") as run:
        assert run.base_url.endswith("/v1") and run.anthropic_base_url + "/v1" == run.base_url
        assert run.env()["OPENAI_API_KEY"] == run.api_key == run.env()["ANTHROPIC_API_KEY"]
        client = run.openai_client(max_retries=0)
        errors: list[BaseException] = []

        def agent(k: int) -> None:
            try:
                for i in range(3):
                    client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"thread {k} call {i}"}]
                    )
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=agent, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert not errors
        said = run.anthropic_client(max_retries=0).messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
        assert said.content[0].text
        run.annotate(judge="unit", scores=[0.5, float("nan")])
        run.reward(1.0)
        run.label("y")
        live = run.export()
        assert len(live["turns"]) == 13
    graph = run.graph
    assert len(graph) == 13 and len(graph.timelines()) == 13
    assert graph.labels == ["x", "y"] and graph.reward == 1.0 and graph.group == "grp"
    assert json.dumps(graph.annotations) == json.dumps(
        {"judge": "unit", "scores": [0.5, float("nan")]}
    )
    # a real round trip to the engine: some time, and less than the whole call
    assert all(0 < t.engine <= t.reply_sent for t in graph.timelines().values())
    with pytest.raises(CaptureError, match="closed"):
        run.reward(0.0)


def test_async_capture_and_clear_errors(stub: str) -> None:
    async def main() -> int:
        async with capture(upstream=stub) as run:
            client = run.openai_client(asynchronous=True, max_retries=0)
            answers = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"task {k}"}]
                    )
                    for k in range(3)
                )
            )
            await client.close()
            assert all(a.choices[0].message.content for a in answers)
        return len(run.graph)

    assert asyncio.run(main()) == 3
    with pytest.raises(InvalidArgumentError, match=r"server= .* or upstream="):
        capture()
    with pytest.raises(CaptureError, match="inside `with capture"):
        capture(upstream=stub).export()


def test_timeline_is_consistent_streaming_and_not_against_a_slow_stub(slow_stub: str) -> None:
    with capture(upstream=slow_stub) as run:
        client = run.openai_client(max_retries=0)
        question = [{"role": "user", "content": "first question"}]
        answer = client.chat.completions.create(model="m", messages=question)
        time.sleep(TOOL_S)  # the agent's tool
        follow = [
            *question,
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "the tool said 4"},
        ]
        assert list(client.chat.completions.create(model="m", messages=follow, stream=True))
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="stub-500", messages=question)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "next"}])
        document = run.export()
    graph = run.graph
    first, second, third = (graph.timeline(n) for n in graph.node_ids())
    assert first is not None and second is not None and third is not None
    for t in (first, second, third):
        _assert_consistent(t, first if t is second else None)
        assert t.engine >= LATENCY_S * 1e6 * 0.95  # the stub slept this long
    assert graph.parent(graph.node_ids()[1]) == graph.node_ids()[0]
    assert first.gap_before is None and first.chunks == 0 and first.failed_attempts == 0
    assert second.gap_before is not None and second.gap_before >= TOOL_S * 1e6 * 0.95
    # the wait since the parent's reply: ends when this request arrives
    assert second.received - (first.received + first.reply_sent) == second.gap_before
    assert second.chunks >= 3 and second.max_chunk_gap < second.reply_sent
    assert third.failed_attempts == 1 and third.last_failed_status == 500
    assert third.gap_before is None  # a root
    records = list(iter_turn_records(graph))
    assert [r["timeline"] for r in records] == [t.document() for t in (first, second, third)]
    turn = document["turns"][1]["timeline"]
    assert turn["first_token_ms"] == turn["first_byte_ms"]  # the upstream answers unstreamed
    assert list(turn) == [
        "received",
        "upstream_sent_ms",
        "first_byte_ms",
        "first_token_ms",
        "last_byte_ms",
        "reply_sent_ms",
        "engine_ms",
        "chunks",
        "max_chunk_gap_ms",
        "gap_before_ms",
        "failed_attempts",
        "last_failed_status",
    ]


def _graph(n: int) -> RolloutGraph:
    graph = RolloutGraph()
    for i in range(n):
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": f"q{i}"}]))
    return graph


def _timeline(i: int, gap: int | None = None) -> Timeline:
    return Timeline(
        1_750_000_000_000_000 + i * 1000,
        5,
        100 + i,
        100 + i,
        200 + i,
        250 + i,
        i % 7,
        i,
        gap,
        i % 3,
        503 if i % 3 else None,
    )


def test_timelines_read_back_from_logs_and_snapshots(tmp_path: Path) -> None:
    n = TIMELINE_BATCH * 2 + 3  # full batches and a part written as the log closes
    graph = RolloutGraph.open(tmp_path / "log.rls")
    ids = [
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": f"q{i}"}])).node_id
        for i in range(n)
    ]
    for i, node_id in enumerate(ids):
        if i != 4:  # a turn without one has none
            graph.set_timeline(node_id, _timeline(i, None if i == 0 else i * 10))
    graph.set_timeline(ids[1], _timeline(99))  # set again: the last wins
    want = graph.timelines()
    graph.close()
    loaded = RolloutGraph.load(tmp_path / "log.rls")
    assert loaded.timelines() == want and loaded.timeline(ids[4]) is None
    assert loaded.timeline(ids[1]) == _timeline(99)
    loaded.save(tmp_path / "snap.rls")
    assert RolloutGraph.load(tmp_path / "snap.rls").timelines() == want
    records = list(iter_turn_records(loaded))
    assert "timeline" not in records[4] and records[5]["timeline"] == want[ids[5]].document()


def test_parent_replied_is_the_parents_reply_sent_as_its_timeline_says() -> None:
    graph = RolloutGraph()
    first = graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "q"}]))
    reply = {"role": "assistant", "content": "a"}
    messages = [{"role": "user", "content": "q"}, reply, {"role": "user", "content": "r"}]
    graph.add_turn(
        TurnNode(request_messages=[{"role": "user", "content": "q"}], response_message=reply)
    )
    second = graph.add_turn(TurnNode(request_messages=messages))
    parent = graph.parent(second.node_id)
    assert parent is not None and parent != first.node_id
    assert graph.parent_replied(second.node_id) is None  # the parent has no timeline yet
    assert graph.parent_replied(first.node_id) is None  # a root
    graph.set_timeline(parent, _timeline(3))
    want = graph.timeline(parent)
    assert want is not None
    assert graph.parent_replied(second.node_id) == want.received + want.reply_sent
    graph.set_timeline(parent, _timeline(5))  # set again: the last wins
    assert graph.parent_replied(second.node_id) == _timeline(5).received + 255
    with pytest.raises(UnknownNodeError):
        graph.parent_replied("turn-99")


def test_old_files_and_untimed_graphs_have_no_timeline_key() -> None:
    # every fixture but the store-backed one (read with its store elsewhere)
    fixtures = sorted((ROOT / "tests" / "data").glob("v[12]_*.rls"))
    fixtures = [path for path in fixtures if "store" not in path.name]
    checked = 0
    for path in fixtures:
        graph = RolloutGraph.load(path)
        assert len(graph) > 0, path
        assert graph.timelines() == {}
        assert all("timeline" not in r for r in iter_turn_records(graph))
        checked += 1
    assert checked == len(fixtures) >= 6


def test_bad_timelines_are_refused_naming_the_field_and_change_nothing(tmp_path: Path) -> None:
    with pytest.raises(InvalidValueError, match=r"timeline\.received"):
        Timeline(0, 0, 0, 0, 0, 0)
    with pytest.raises(InvalidValueError, match=r"timeline\.first_byte"):
        Timeline(10, 50, 40, 60, 70, 80)
    with pytest.raises(InvalidValueError, match=r"timeline\.last_failed_status"):
        Timeline(10, 0, 0, 0, 0, 0, failed_attempts=1)
    graph = _graph(2)
    graph.set_timeline("turn-0", _timeline(1))
    with pytest.raises(UnknownNodeError):
        graph.set_timeline("turn-9", _timeline(2))
    with pytest.raises(InvalidArgumentError, match="Timeline"):
        graph.set_timeline("turn-1", {"received": 1})  # type: ignore[arg-type]
    assert graph.timelines() == {"turn-0": _timeline(1)}
    # a record naming a turn the file does not hold before it is damage
    log = RolloutGraph.open(tmp_path / "bad.rls")
    log.add_turn(TurnNode(request_messages=[{"role": "user", "content": "q"}]))
    log._journal.timelines.append((5, _timeline(1).pack()))  # type: ignore[union-attr]
    log.close()
    with pytest.raises(CorruptFileError, match="names turn 5"):
        RolloutGraph.load(tmp_path / "bad.rls")


def test_timeline_costs_at_most_48_bytes_a_turn_in_memory_and_on_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = 2000
    graph = RolloutGraph.open(tmp_path / "t.rls", fsync="never")
    for i in range(n):
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": f"q{i}"}]))
    timelines = [_timeline(i, i) for i in range(n)]  # made before measuring
    size = os.path.getsize(tmp_path / "t.rls")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, t in enumerate(timelines):
        graph.set_timeline(f"turn-{i}", t)
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    graph.close()
    on_disk = os.path.getsize(tmp_path / "t.rls") - size
    with capsys.disabled():
        print(
            f"\ntimeline per turn: {kept / n:.1f} B in memory (tracemalloc), "
            f"{on_disk / n:.1f} B on disk, {TIMELINE_SIZE} B packed"
        )
    assert kept / n <= 48 and on_disk / n <= 48
    assert RolloutGraph.load(tmp_path / "t.rls").timeline(f"turn-{n - 1}") == timelines[-1]


def test_the_viewer_and_info_show_where_the_time_went(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = _graph(3)
    for i in range(3):
        graph.set_timeline(f"turn-{i}", _timeline(i, None if i == 0 else 1000 * i))
    viewer = Viewer(graph)
    figures = json.loads(viewer.respond("/api/figures").body)
    assert figures["timed"] == 3
    lanes = json.loads(viewer.respond("/api/timeline").body)
    assert lanes["calls"] == 3 and len(lanes["lanes"]) == 1
    calls = lanes["lanes"][0]["calls"]
    assert [c["id"] for c in calls] == ["turn-0", "turn-1", "turn-2"]
    assert all(
        c["start_ms"] <= c["engine_from_ms"] <= c["engine_to_ms"] <= c["end_ms"] for c in calls
    )
    turn = json.loads(viewer.respond("/api/turn", "id=turn-1").body)
    assert turn["timeline"] == _timeline(1, 1000).document()
    path = tmp_path / "timed.rls"
    graph.save(path)
    assert cli_module.main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "engine time p50 / p99" in out and "tools time p50 / p99" in out
    assert cli_module.main(["info", "--json", str(path)]) == 0
    timing: dict[str, Any] = json.loads(capsys.readouterr().out)["timing_us"]
    assert timing["calls"] == 3 and timing["engine_p50"] == _timeline(1).engine
    assert timing["tools_total"] == 3000


def test_an_export_right_after_a_call_has_its_timeline(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeline is recorded by a task after the reply: an export (or the end of the
    capture) right after the call waits for it."""
    timed = server_module._Server._timed

    async def late(self: Any, session: Any, clock: Any) -> None:
        await asyncio.sleep(0.3)  # a busy server: the task runs well after the reply
        await timed(self, session, clock)

    monkeypatch.setattr(server_module._Server, "_timed", late)
    with capture(upstream=stub, data=tmp_path / "logs") as run:
        client = run.openai_client(max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        assert "timeline" in run.export()["turns"][0]
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
    assert [("timeline" in t) for t in run.export()["turns"]] == [True, True]
    assert len(run.graph.timelines()) == 2


def test_capture_export_params_are_url_encoded_and_admin_key_needs_a_started_server(
    stub: str,
) -> None:
    with pytest.raises(InvalidArgumentError, match="admin_key="):
        capture(server="http://127.0.0.1:9", admin_key="k")
    with capture(upstream=stub) as run:
        run.openai_client(max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}]
        )
        # "&" and "=" inside a value stay in it: unencoded, the level would be cut at "&"
        with pytest.raises(CaptureError, match="capture_level must be one of"):
            run.export(capture_level="text&messages=1")
        assert "request_messages" in str(run.export(messages="1", capture_level="text"))


def test_capture_is_the_capture_class_so_its_options_are_defined_once() -> None:
    """`capture(...)` takes exactly `Capture`'s options, as one definition: the call makes a
    `Capture`, and a wrong combination is refused by the one check."""
    assert capture is Capture
    made = capture(server="http://127.0.0.1:9", labels="one")  # nothing is started yet
    assert type(made) is Capture
    with pytest.raises(InvalidArgumentError, match="data= is for a server started"):
        capture(server="http://127.0.0.1:9", data="rollouts")
