"""The `rollout-store` command: info, verify, export, and damaged files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_store import RolloutGraph, TurnNode, export_session, iter_turn_records
from rollout_store.cli import main


@pytest.fixture
def rollout_file(tmp_path: Path) -> Path:
    path = tmp_path / "r.rls"
    with RolloutGraph.open(path) as graph:
        messages: list = [{"role": "system", "content": "s" * 2000}]
        for k in range(4):
            messages.append({"role": "user", "content": f"question {k}"})
            response = {"role": "assistant", "content": f"answer {k}"}
            graph.add_turn(
                TurnNode(
                    request_messages=list(messages),
                    response_message=response,
                    prompt_ids=list(range(10 * (k + 1))),
                    sampled_ids=[1, 2],
                    sampled_logprobs=[-0.5, -0.25],
                )
            )
            messages.append(response)
    return path


def test_info(rollout_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(rollout_file)]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line.split("  ")[-1].strip() for line in out.splitlines()}
    assert lines["turns"] == "4"
    assert lines["roots"] == "4"  # token prompts do not extend each other here
    export = len(json.dumps(export_session(RolloutGraph.load(rollout_file), include_messages=True)))
    size = rollout_file.stat().st_size
    assert lines["bytes received (plain export)"] == str(export)
    assert lines["bytes stored (this file)"] == str(size)
    assert lines["saving over the plain export"] == f"{export / size:.1f}x"
    assert lines["long strings stored (unique)"] == "2000"


def test_verify_ok_and_damaged(rollout_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(rollout_file)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    data = bytearray(rollout_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rollout_file.write_bytes(bytes(data))
    assert main(["verify", str(rollout_file)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rollout-store: {rollout_file}: damaged: ")
    assert "offset" in err and "recover" in err
    assert len(err.splitlines()) == 1


def test_export_json_equals_export_session(rollout_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert main(["export", str(rollout_file), "--messages", "-o", str(out)]) == 0
    graph = RolloutGraph.load(rollout_file)
    assert out.read_text() == json.dumps(export_session(graph, include_messages=True)) + "\n"


def test_export_jsonl(rollout_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert main(["export", str(rollout_file), "--jsonl", "-o", str(out)]) == 0
    graph = RolloutGraph.load(rollout_file)
    lines = out.read_text().splitlines()
    assert lines == [json.dumps(record) for record in iter_turn_records(graph)]


def test_export_of_truncated_file_fails_with_one_line(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rollout_file.write_bytes(rollout_file.read_bytes()[:-7])
    assert main(["export", str(rollout_file)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "ends inside" in err


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "nope.rls")]) == 1
    assert "nope.rls" in capsys.readouterr().err


def test_console_script_runs(rollout_file: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_store.cli", "--progress", "verify", str(rollout_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: ")


# ---------------------------------------------------------------- files that cannot be read


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_missing_empty_foreign_and_damaged_files_say_different_things(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.rls"
    empty.write_bytes(b"")
    zeros = tmp_path / "zeros.rls"
    zeros.write_bytes(bytes(4096))
    foreign = tmp_path / "export.json"
    foreign.write_text('{"turns": []}')
    damaged = tmp_path / "damaged.rls"
    damaged.write_bytes(rollout_file.read_bytes()[:-7])
    for command in ("info", "verify", "export", "view"):
        missing = _err(capsys, [command, str(tmp_path / "nope.rls")])
        assert missing.endswith("nope.rls: no such file")
        assert "empty file (0 bytes)" in _err(capsys, [command, str(empty)])
        assert "holds only zero bytes (4096)" in _err(capsys, [command, str(zeros)])
        text = _err(capsys, [command, str(foreign)])
        assert "not a rollout_store file" in text and "looks like JSON" in text
        assert "damaged" not in text
        text = _err(capsys, [command, str(damaged)])
        assert "damaged" in text and "repair" in text and "recover" in text


def test_damage_in_the_middle_points_to_recover_not_repair(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = bytearray(rollout_file.read_bytes())
    data[len(data) * 8 // 10] ^= 0xFF  # inside the third turn's record; the fourth follows
    rollout_file.write_bytes(bytes(data))
    text = _err(capsys, ["info", str(rollout_file)])
    assert "saves the 2 complete turns before it to a new file" in text
    assert f"rollout-store recover {rollout_file} -o OUT" in text
    assert "repair does not apply: intact records follow it" in text
    before = rollout_file.read_bytes()
    text = _err(capsys, ["repair", str(rollout_file)])
    assert "repair does not apply" in text
    assert rollout_file.read_bytes() == before  # repair refused: the file is untouched


def test_recover_saves_the_turns_before_the_damage(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = RolloutGraph.load(rollout_file)
    rollout_file.write_bytes(rollout_file.read_bytes()[:-7])  # the last turn is cut
    out = tmp_path / "recovered.rls"
    assert main(["recover", str(rollout_file), "-o", str(out)]) == 0
    assert capsys.readouterr().out.startswith("recovered 3 turns from before the damage")
    recovered = RolloutGraph.load(out)
    assert recovered.node_ids() == whole.node_ids()[:3]
    for node_id in recovered.node_ids():
        assert json.dumps(recovered.request_messages(node_id)) == json.dumps(
            whole.request_messages(node_id)
        )
    assert _err(capsys, ["recover", str(rollout_file), "-o", str(rollout_file)]).endswith(
        "recover never writes over its input"
    )


def test_repair_cuts_a_torn_tail_in_place(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = rollout_file.read_bytes()
    rollout_file.write_bytes(whole[:-7])
    assert main(["repair", str(rollout_file)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"repaired {rollout_file}: cut ") and "3 turns kept" in out
    assert main(["verify", str(rollout_file)]) == 0
    assert whole.startswith(rollout_file.read_bytes())
    capsys.readouterr()
    assert main(["repair", str(rollout_file)]) == 0
    assert "nothing to repair" in capsys.readouterr().out


def test_recover_of_a_file_without_damage_copies_it(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "copy.rls"
    assert main(["recover", str(rollout_file), "-o", str(out)]) == 0
    assert "is not damaged" in capsys.readouterr().out
    assert RolloutGraph.load(out).node_ids() == RolloutGraph.load(rollout_file).node_ids()


# ---------------------------------------------------------------- options, pipes, entry points


def test_progress_before_and_after_the_command(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (
        ["--progress", "verify", str(rollout_file)],
        ["verify", str(rollout_file), "--progress"],
    ):
        assert main(argv) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("ok: ")
        assert "reading" in captured.err  # the bar, drawn although stderr is not a terminal
    assert main(["--progress", "verify", "--no-progress", str(rollout_file)]) == 0
    assert "reading" not in capsys.readouterr().err  # the last one given wins


def test_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--messages include each turn's request messages, tools and response message" in text
    assert "--progress draw a progress bar" in text
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command in ("info", "verify", "export", "recover", "repair", "view"):
        assert command in text


def test_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    path = tmp_path / "big.rls"
    graph = RolloutGraph()
    for k in range(30):  # an export much larger than a pipe's buffer
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": f"{k}" * 50_000}]))
    graph.save(path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_store", "export", str(path), "--messages"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10) == b'{"session_'
    proc.stdout.close()  # what `| head -c 10` does
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0
    assert err == b""


def test_python_dash_m_and_version() -> None:
    import rollout_store

    assert isinstance(rollout_store.__version__, str) and rollout_store.__version__[0].isdigit()
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_store", "--version"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"rollout-store {rollout_store.__version__}"


def test_view_serves_the_file_on_loopback(rollout_file: Path) -> None:
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_store", "view", str(rollout_file), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"viewing {rollout_file} at http://127.0.0.1:"), line
        url = line.split(" at ", 1)[1].split()[0]
        with urllib.request.urlopen(url + "api/figures", timeout=10) as response:
            figures = json.loads(response.read())
        assert figures["turns"] == 4 and figures["title"] == "r.rls"
        assert figures["file_bytes"] == rollout_file.stat().st_size
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_view_on_a_busy_port_says_so(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["view", str(rollout_file), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"port {port} is in use: pass --port N" in err


def test_recover_with_nothing_before_the_damage_writes_nothing(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = bytearray(rollout_file.read_bytes())
    data[len(data) * 6 // 10] ^= 0xFF  # inside the first turn's records
    rollout_file.write_bytes(bytes(data))
    out = tmp_path / "out.rls"
    text = _err(capsys, ["recover", str(rollout_file), "-o", str(out)])
    assert "nothing" in text and not out.exists()


# ---------------------------------------------------------------- files over a content store


@pytest.fixture
def store_file(tmp_path: Path) -> tuple[Path, str]:
    """A log that keeps its long strings in a directory store, and that store's name."""
    from rollout_store import DirectoryStore

    objects = tmp_path / "objects"
    path = tmp_path / "refs.rls"
    store = DirectoryStore(objects)
    with RolloutGraph.open(path, store=store, blobs="store") as graph:
        messages: list = [{"role": "system", "content": "long system prompt " * 200}]
        for k in range(3):
            messages.append({"role": "user", "content": f"question {k} " + "x" * 1500})
            response = {"role": "assistant", "content": f"answer {k}"}
            graph.add_turn(TurnNode(request_messages=list(messages), response_message=response))
            messages.append(response)
    assert b"long system prompt long" not in path.read_bytes()  # references only
    return path, f"dir:{objects}"


def test_commands_read_a_file_of_store_references_with_store(
    store_file: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollout_store import DirectoryStore

    path, spec = store_file
    want = RolloutGraph.load(path, store=DirectoryStore(spec[4:]))
    assert main(["verify", str(path), "--store", spec]) == 0
    assert "ok: format version" in capsys.readouterr().out
    assert main(["info", str(path), "--store", spec]) == 0
    assert "turns" in capsys.readouterr().out
    out = tmp_path / "export.json"
    assert main(["export", str(path), "--messages", "--store", spec, "-o", str(out)]) == 0
    got = json.loads(out.read_text())
    assert json.dumps(got["turns"][2]["request_messages"]) == json.dumps(
        want.request_messages(want.node_ids()[2])
    )
    # recover writes a self-contained copy: it reads back without the store
    copy = tmp_path / "copy.rls"
    assert main(["recover", str(path), "-o", str(copy), "--store", spec]) == 0
    capsys.readouterr()
    assert b"long system prompt long" in copy.read_bytes()
    assert RolloutGraph.load(copy).node_ids() == want.node_ids()


def test_a_file_of_store_references_without_store_says_to_pass_one(
    store_file: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = store_file
    for command in (["info"], ["verify"], ["export"], ["repair"]):
        assert main([*command, str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"rollout-store: {path}: ") and "pass --store NAME" in err


def test_repair_of_a_torn_log_of_store_references(
    store_file: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, spec = store_file
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])
    assert main(["repair", str(path), "--store", spec]) == 0
    assert "2 turns kept" in capsys.readouterr().out
    assert main(["verify", str(path), "--store", spec]) == 0


def test_a_store_that_misses_an_object_is_named(
    store_file: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = store_file
    empty = tmp_path / "empty-store"
    assert main(["export", str(path), "--store", f"dir:{empty}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"rollout-store: {path}: ") and "key" in err


def test_store_option_takes_the_names_serve_takes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "x.rls", "--store", "ftp://somewhere"])
    assert exit_info.value.code == 2
    assert "expected memory, dir:PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    assert "--store NAME" in capsys.readouterr().out


@pytest.mark.slow
def test_export_reads_a_file_of_references_from_redis(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollout_store import RedisStore

    path = tmp_path / "redis.rls"
    graph = RolloutGraph(store=RedisStore(redis_url))
    graph.add_turn(
        TurnNode(
            request_messages=[{"role": "user", "content": "kept in redis " * 200}],
            response_message={"role": "assistant", "content": "ok"},
        )
    )
    graph.save(path, blobs="store")
    assert b"kept in redis kept" not in path.read_bytes()
    out = tmp_path / "export.json"
    assert main(["export", str(path), "--messages", "--store", redis_url, "-o", str(out)]) == 0
    turn = json.loads(out.read_text())["turns"][0]
    assert turn["request_messages"][0]["content"] == "kept in redis " * 200


# ---------------------------------------------------------------- what a new user meets first


def test_a_wrong_store_says_not_found_never_damaged_and_creates_nothing(
    store_file: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = store_file
    before = path.read_bytes()
    typo = tmp_path / "typo"
    for spec in (f"dir:{typo}", "memory"):
        for command in ("info", "verify", "export", "repair", "recover"):
            extra = ["-o", str(tmp_path / "out.rls")] if command == "recover" else []
            err = _err(capsys, [command, str(path), "--store", spec, *extra])
            assert err.startswith(f"rollout-store: {path}: object "), err
            assert f"not found in store {spec} (is it the right store?)" in err
            assert "damaged" not in err and "recovered" not in err
    assert not typo.exists()  # nothing created for a store that was only read
    assert not (tmp_path / "out.rls").exists()
    assert path.read_bytes() == before


def test_a_self_contained_file_read_with_a_store_puts_nothing_into_it(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = tmp_path / "objects"
    assert main(["info", str(rollout_file), "--store", f"dir:{objects}"]) == 0
    assert "turns" in capsys.readouterr().out and not objects.exists()


def test_info_shows_human_sizes_and_json_the_exact_bytes(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", str(rollout_file)]) == 0
    lines = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    size = rollout_file.stat().st_size
    assert f"{size / 1024:.2f} KiB  {size}" in lines["bytes stored (this file)"]
    assert "1.95 KiB  2000" in lines["long strings stored (unique)"]
    assert main(["info", str(rollout_file), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["bytes_stored"] == size and document["turns"] == 4
    assert document["unique_blob_bytes"] == 2000


def test_info_shows_the_long_strings_every_request_sent(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 2,000-character system prompt is sent by each of the four turns, kept once."""
    assert main(["info", str(rollout_file)]) == 0
    lines = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "7.81 KiB  8000" in lines["long strings sent (each request whole)"]
    assert main(["info", str(rollout_file), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["blob_bytes_sent"] == 4 * 2000 and document["unique_blob_bytes"] == 2000


def test_a_foreign_file_is_named_without_a_bytes_repr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello")
    text = _err(capsys, ["verify", str(foreign)])
    assert text.startswith(f"rollout-store: {foreign}: not a rollout_store file")
    assert "b'" not in text and "RLSTORE magic" in text


def test_verify_of_a_torn_log_says_the_bytes_repair_cuts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path) as graph:
        messages: list = []
        for k in range(4):
            messages.append({"role": "user", "content": f"q{k} " + "y" * 3000})
            response = {"role": "assistant", "content": f"a{k}"}
            graph.add_turn(TurnNode(request_messages=list(messages), response_message=response))
            messages.append(response)
    data = path.read_bytes()
    path.write_bytes(data[:-40])  # inside the last turn record: its blob records are whole
    said = _err(capsys, ["verify", str(path)])
    assert said.startswith(f"rollout-store: {path}: damaged: ")
    assert main(["repair", str(path)]) == 0
    cut = len(data) - 40 - path.stat().st_size
    assert cut > 3000  # the unfinished turn's blob went too, not only the torn record
    assert f"cuts its last {cut} bytes" in said
    assert f"cut its last {cut} bytes" in capsys.readouterr().out


def test_a_flipped_byte_names_no_offset_recover_would_use(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = bytearray(rollout_file.read_bytes())
    data[len(data) * 8 // 10] ^= 0xFF
    rollout_file.write_bytes(bytes(data))
    said = _err(capsys, ["verify", str(rollout_file)])
    assert "next intact frame starts at offset" in said
    assert "but no turn from there on can be kept" in said
    out = tmp_path / "out.rls"
    assert main(["recover", str(rollout_file), "-o", str(out)]) == 0
    recovered = capsys.readouterr().out
    assert recovered.startswith("recovered 2 turns from before the damage")
    assert len(RolloutGraph.load(out)) == 2


def test_unknown_choices_are_refused_with_the_valid_ones(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(rollout_file), "--capture-level", "bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err
    assert all(level in err for level in ("tokens", "logprobs", "text", "messages"))


def test_export_of_a_text_rollout_says_text(
    store_file: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, spec = store_file  # recorded without token ids
    out = tmp_path / "export.json"
    assert main(["export", str(path), "--store", spec, "-o", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["capture_level"] == "text" and document["rollout_type"] == "eval"


def test_samples_of_several_files_names_the_missing_or_empty_one(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty, missing = tmp_path / "empty.rls", tmp_path / "missing.rls"
    empty.write_bytes(b"")
    out = tmp_path / "out.jsonl"
    for bad, words in ((missing, "no such file"), (empty, "empty file")):
        assert main(["samples", str(rollout_file), str(bad), "-o", str(out)]) == 1
        assert f"rollout-store: {bad}: {words}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_samples_failing_midway_leaves_the_output_as_it_was(
    rollout_file: Path, tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if suffix == "parquet":
        pytest.importorskip("pyarrow")
    damaged = tmp_path / "damaged.rls"
    data = bytearray(rollout_file.read_bytes())
    data[len(data) // 2] ^= 0x40
    damaged.write_bytes(bytes(data))
    out = tmp_path / f"out.{suffix}"
    assert main(["samples", str(rollout_file), "-o", str(out)]) == 0
    capsys.readouterr()
    assert out.stat().st_mode & 0o777 == 0o600  # a new output file is its owner's only
    before = out.read_bytes()
    out.chmod(0o640)
    assert main(["samples", str(rollout_file), str(damaged), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{damaged}: damaged" in err
    assert out.read_bytes() == before and out.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
