"""Intake at the floor: requests found by the digest of their whole prefix, buckets that stay
small on shapes many rollouts share, and turns read from a file confirmed once by bytes."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rollout_store import RolloutGraph, TurnNode
from rollout_store.engine import linking
from rollout_store.engine.stored import Turn


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def test_shared_observation_text_does_not_share_a_bucket() -> None:
    """Rollouts whose observations are the same short text at the same position: each turn
    finds its own parent, and request keys hold one turn each."""
    graph = RolloutGraph()
    for r in range(30):
        history = [_user(f"task {r}")]
        for step in range(4):
            view = graph.add_turn(
                TurnNode(request_messages=list(history), response_message=_assistant(f"{r}.{step}"))
            )
            if step:
                assert graph.parent(view.node_id) == f"turn-{r * 4 + step - 1}"
            history += [_assistant(f"{r}.{step}"), _user("OK")]
    requests = graph._requests
    assert len(requests.table) == 120 and not requests.groups  # no key holds two turns


def test_one_prompt_sampled_many_times_then_continued() -> None:
    """200 samples of one request by messages; a continuation of sample 137 hangs under it,
    and the identical requests keep their parents in their bucket (no scan for twins)."""
    graph = RolloutGraph()
    request = [{"role": "system", "content": "s"}, _user("solve")]
    for i in range(200):
        graph.add_turn(TurnNode(request_messages=request, response_message=_assistant(f"s{i}")))
    child = graph.add_turn(
        TurnNode(request_messages=[*request, _assistant("s137"), _user("go on")])
    )
    assert graph.parent(child.node_id) == "turn-137"
    (bucket,) = graph._requests.groups.values()
    assert len(bucket) == 200 and [t.node_id for t in bucket.parents] == ["turn-137"]
    again = graph.add_turn(TurnNode(request_messages=request, response_message=_assistant("x")))
    assert graph.parent(again.node_id) is None


def test_short_token_roots_found_without_a_scan() -> None:
    """A continuation of a 6-token call that arrived first moves under the call when it
    arrives, found by a 4-token head (prompts under 16 tokens no longer scan every root)."""
    graph = RolloutGraph()
    for i in range(50):  # unrelated short roots
        graph.add_turn(TurnNode(prompt_ids=[900 + i, 1, 2], sampled_ids=[3]))
    late = graph.add_turn(TurnNode(prompt_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13], sampled_ids=[1]))
    first = graph.add_turn(TurnNode(prompt_ids=[5, 6, 7, 8, 9, 10], sampled_ids=[11, 12]))
    assert graph.parent(late.node_id) == first.node_id


def test_turns_read_from_a_file_are_confirmed_once_by_bytes(tmp_path: Any) -> None:
    graph = RolloutGraph()
    history = [{"role": "system", "content": "s"}]
    for i in range(5):
        history = [*history, _user(f"q{i}")]
        graph.add_turn(TurnNode(request_messages=history, response_message=_assistant(f"a{i}")))
        history = [*history, _assistant(f"a{i}")]
    path = tmp_path / "g.rls"
    graph.save(path)
    loaded = RolloutGraph.load(path)
    assert all(t.digest is None for t in loaded._turns)
    view = loaded.add_turn(TurnNode(request_messages=[*history, _user("q5")]))
    assert loaded.parent(view.node_id) == "turn-4"
    assert loaded._turns[4].digest == graph._turns[4].digest  # learnt from the comparison
    assert loaded.stats()["message_bytes_stored"] == graph.stats()["message_bytes_stored"] + len(
        loaded._turns[5].tail
    )


def test_token_parent_beyond_the_digest_window() -> None:
    """A continuation that adds more than TOKEN_WINDOW blocks of tokens still finds its
    parent (the earlier blocks are digested when the window holds none)."""
    from rollout_store.engine.linking import TOKEN_WINDOW
    from rollout_store.engine.tokens import BLOCK

    graph = RolloutGraph()
    first = graph.add_turn(TurnNode(prompt_ids=list(range(100)), sampled_ids=[7, 8]))
    extra = list(range(1000, 1000 + (TOKEN_WINDOW + 3) * BLOCK))
    child = graph.add_turn(TurnNode(prompt_ids=[*range(100), 7, 8, *extra], sampled_ids=[1]))
    assert graph.parent(child.node_id) == first.node_id
    near = graph.add_turn(TurnNode(prompt_ids=[*range(100), 7, 8, *extra, 1, 5], sampled_ids=[2]))
    assert graph.parent(near.node_id) == child.node_id


@pytest.mark.parametrize("n_tokens", [0, 63, 64, 65, 130, 64 * 5 + 3, 64 * 70, 64 * 140 + 5])
@pytest.mark.parametrize("window", [1, 2, 3, 64])
def test_block_digests_deepest_first_are_the_block_digests(n_tokens: int, window: int) -> None:
    """The lazy digests a parent is looked up by are those of every whole-block prefix,
    deepest first, whichever stage of them (deepest two, window, before it) computes each."""
    from array import array

    from rollout_store.engine.tokens import block_digests, deep_block_digests

    data = array("I", random.Random(n_tokens).choices(range(1 << 32), k=n_tokens)).tobytes()
    every = block_digests(data)
    expected = [(j, every[j]) for j in range(len(every) - 1, 0, -1)]
    assert list(deep_block_digests(data, window)) == expected
    # with a bitmap of the block counts some turn fills: those alone, in the same order
    filed = bytearray(random.Random(window).randbytes(n_tokens // 64 // 8 + 2))
    wanted = [(j, d) for j, d in expected if filed[j >> 3] >> (j & 7) & 1]
    assert list(deep_block_digests(data, window, filed)) == wanted
    assert list(deep_block_digests(data, window, bytes(1))) == []


def test_a_token_parent_is_looked_up_only_at_block_counts_some_turn_fills(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt that re-sends its parent's tokens and a tool output of many blocks is looked
    up at the blocks where filed turns end (its parent's), not at each block in between."""
    from rollout_store import RolloutGraph, TurnNode
    from rollout_store.engine import linking

    lookups: list[int] = []
    real = linking.Linker._token_parent_in

    def counting(self: Any, data: bytes, buckets: Any, n: int) -> Any:
        def counted() -> Any:
            for bucket in buckets:
                lookups.append(bucket[1])
                yield bucket

        return real(self, data, counted(), n)

    monkeypatch.setattr(linking.Linker, "_token_parent_in", counting)
    rng = random.Random(7)
    graph = RolloutGraph()
    prompt: list[int] = rng.choices(range(50000), k=3000)
    for _ in range(6):
        sampled = rng.choices(range(50000), k=50)
        graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=sampled))
        prompt = prompt + sampled + rng.choices(range(50000), k=1000)  # a tool output
    ids = graph.node_ids()
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]
    assert len(lookups) <= 2 * 5, lookups  # (each block in between: 16 lookups a turn)


@pytest.mark.parametrize("order", [0, 1, 2, 3, 4, 5])
def test_token_parent_is_the_deepest_match_of_a_bucket_in_any_filing_order(order: int) -> None:
    """Turns whose tokens end in one block are one bucket: the parent is the deepest whose
    tokens start the prompt (not a deeper sibling branch, nor a shallower ancestor), whatever
    order they were filed in; of two as deep, the one that sampled over a failed call."""
    import itertools

    base = list(range(1000, 1070))
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="root", prompt_ids=base, sampled_ids=[1, 2, 3]))
    full = [*base, 1, 2, 3]
    kept = {  # each a continuation of the root's run, its tokens ending in block 1
        "deep": ([*full, 10, 11, 12, 13, 14], [15, 16, 17]),
        "sibling": ([*full, 20, 21, 22, 23, 24, 25, 26], [27, 28]),  # deeper, other tokens
        "failed": ([*full, 10, 11, 12, 13, 14, 15, 16, 17], []),  # as deep as `deep`'s run
    }
    names = list(itertools.permutations(kept))[order]
    for name in names:
        prompt, sampled = kept[name]
        graph.add_turn(TurnNode(node_id=name, prompt_ids=prompt, sampled_ids=sampled))
    deep_full = [*kept["deep"][0], *kept["deep"][1]]
    child = graph.add_turn(TurnNode(node_id="child", prompt_ids=[*deep_full, 30], sampled_ids=[31]))
    assert child.parent_id == "deep"
    shallow = graph.add_turn(TurnNode(node_id="shallow", prompt_ids=[*full, 40], sampled_ids=[41]))
    assert shallow.parent_id == "root"


def _visited(graph: RolloutGraph) -> int:
    """Stored turns the graph's token lookups have handed out so far (the engine counts)."""
    linker = graph._linker
    indexes = (linker.token_index, linker.token_roots)
    return sum(index.visited for index in indexes if index is not None)


def test_one_prompt_sampled_thousands_of_times_costs_each_turn_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One 300-token prompt sampled 1,600 times, 100 distinct completions: every turn files
    its tokens under one key, yet a turn's token lookups (its parent, the roots it may
    adopt) visit as many stored turns and compare as many runs at turn 1,600 as at turn 100
    (a large key's turns are grouped by length, and no group lies in those lookups' range).
    Linking is as before: every sample is a root, and a continuation of completion 7 hangs
    under the first turn that sampled it."""
    rng = random.Random(5)
    prompt = [rng.randrange(150_000) for _ in range(300)]
    answers = [[rng.randrange(150_000) for _ in range(8)] for _ in range(100)]
    work = [0]

    def counted(name: str) -> None:
        real = getattr(linking, name)

        def call(*args: Any) -> Any:
            work[0] += 1
            return real(*args)

        monkeypatch.setattr(linking, name, call)

    counted("sampled_any")
    counted("run_matches")
    graph = RolloutGraph()
    per_turn = []
    first_of_7 = None
    for turn in range(1600):
        k = rng.randrange(100) if turn else 7
        before = work[0] + _visited(graph)
        view = graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=answers[k]))
        per_turn.append(work[0] + _visited(graph) - before)
        assert graph.parent(view.node_id) is None
        if k == 7 and first_of_7 is None:
            first_of_7 = view.node_id
    early, late = per_turn[90:110], per_turn[1580:1600]
    assert max(late) <= max(early), (early, late)
    child = graph.add_turn(TurnNode(prompt_ids=[*prompt, *answers[7], 1, 2], sampled_ids=[3]))
    assert graph.parent(child.node_id) == first_of_7


def test_many_roots_under_one_key_move_under_their_late_ancestor() -> None:
    """Twelve roots whose prompts share their first block (a key grouped by length) all move
    under the turn they continue when it arrives, and leave the roots' index."""
    base = list(range(1000, 1070))
    graph = RolloutGraph()
    early = [
        graph.add_turn(TurnNode(prompt_ids=[*base, i], sampled_ids=[5])).node_id for i in range(12)
    ]
    graph.add_turn(TurnNode(prompt_ids=[1, 2, 3], sampled_ids=[4]))  # a lookup builds the index
    roots = graph._linker.token_roots
    assert roots is not None
    key, held = max(roots.items(), key=lambda item: len(item[1]))
    assert len(held) == 12
    assert roots.members(key, 10**6) == []  # held by length: no group in that range
    ancestor = graph.add_turn(TurnNode(prompt_ids=base[:60], sampled_ids=base[60:]))
    assert [graph.parent(node_id) for node_id in early] == [ancestor.node_id] * 12
    left = {graph._turns[n].node_id for _, numbers in roots.items() for n in numbers}
    assert not left & set(early)


def _count_reads(monkeypatch: pytest.MonkeyPatch, work: list[int], *names: str) -> None:
    """Count reads of these properties of stored turns (what linking asks of each sibling)."""
    for name in names:
        prop = getattr(Turn, name)

        def read(turn: Turn, _get: Any = prop.fget) -> Any:
            work[0] += 1
            return _get(turn)

        monkeypatch.setattr(Turn, name, property(read, prop.fset))


@pytest.mark.parametrize("tokens", [False, True])
def test_one_call_sampled_thousands_of_times_at_one_step_costs_each_sample_the_same(
    monkeypatch: pytest.MonkeyPatch, tokens: bool
) -> None:
    """A conversation's 4th call sampled 1,200 times, 40 distinct completions: the samples are
    siblings under the 3rd turn, yet linking a sample asks as much of stored turns at sample
    1,200 as at sample 100 (a parent's many children are grouped by the lengths of their
    requests and prompts, and no sibling's lengths let it continue another sample). Linking
    is as before: a continuation that arrives before the sample it continues moves under it
    when that sample arrives, however many siblings there are."""
    rng = random.Random(8)
    history: list[Any] = [{"role": "user", "content": "task"}]
    prompt = [rng.randrange(150_000) for _ in range(100)]
    graph = RolloutGraph()

    def node(messages: list[Any], response: str, sampled: list[int]) -> TurnNode:
        fields: dict[str, Any] = {}
        if tokens:
            fields = {"prompt_ids": list(prompt), "sampled_ids": sampled}
        return TurnNode(
            request_messages=list(messages),
            response_message={"role": "assistant", "content": response},
            **fields,
        )

    for step in range(3):
        sampled = [rng.randrange(150_000) for _ in range(20)]
        parent = graph.add_turn(node(history, f"step {step}", sampled))
        history += [
            {"role": "assistant", "content": f"step {step}"},
            {"role": "user", "content": "go"},
        ]
        prompt += [*sampled, 5, 6]
    answers = [(f"answer {k}", [rng.randrange(150_000) for _ in range(8)]) for k in range(40)]
    work = [0]
    _count_reads(monkeypatch, work, "n_rest", "prompt", "link")
    per_sample = []
    for _ in range(1200):
        before = work[0]
        view = graph.add_turn(node(history, *rng.choice(answers)))
        per_sample.append(work[0] - before)
        assert graph.parent(view.node_id) == parent.node_id
    early, late = per_sample[90:110], per_sample[1180:1200]
    assert max(late) <= max(early), (early, late)
    # a continuation of a sample yet to come waits as a sibling, then moves under it
    fresh, fresh_ids = "a new answer", [7, 7, 7]
    later = [*history, {"role": "assistant", "content": fresh}, {"role": "user", "content": "more"}]
    saved = list(prompt)
    prompt += [*fresh_ids, 9]
    early_child = graph.add_turn(node(later, "done", [1]))
    prompt = saved
    sample = graph.add_turn(node(history, fresh, fresh_ids))
    assert graph.parent(early_child.node_id) == sample.node_id
    assert len(graph.children(parent.node_id)) == 1201


@pytest.mark.parametrize("echo", ["exact", "loose", "tokens"])
def test_a_large_group_of_rollouts_links_each_turn_at_the_same_cost(
    monkeypatch: pytest.MonkeyPatch, echo: str
) -> None:
    """600 rollouts sampled from one request, each continued before the next is sampled: a
    continuation finds the sample it continues (by the response it echoes, exactly or
    loosely, or by its tokens), and a new sample looks for continuations it may take from
    its twins, asking as much of stored turns at rollout 600 as at rollout 50 (a large
    bucket of one request holds its turns by their responses, and keeps its turns' children
    linked by a loose echo, the only ones a twin may take; a large group of one token
    length holds its turns by their tokens)."""
    rng = random.Random(11)
    task = [{"role": "user", "content": "task"}]
    prompt = [rng.randrange(150_000) for _ in range(100)]
    graph = RolloutGraph()
    work = [0]
    _count_reads(monkeypatch, work, "n_rest", "prompt", "link", "response", "full")
    per_turn: list[int] = []
    per_sample: list[int] = []
    for k in range(600):
        response = {"content": f"answer {k}"}  # no role: a loose echo names it
        if echo != "loose":
            response = {"role": "assistant", **response}
        sampled = [rng.randrange(150_000) for _ in range(10)]
        tokens: dict[str, Any] = {}
        if echo == "tokens":
            tokens = {"prompt_ids": prompt, "sampled_ids": sampled}
        before = work[0]
        sample = graph.add_turn(
            TurnNode(request_messages=task, response_message=response, **tokens)
        )
        per_sample.append(work[0] - before)
        if echo == "tokens":
            tokens = {"prompt_ids": [*prompt, *sampled, 1], "sampled_ids": [2]}
        echoed = {"role": "assistant", **response}
        before = work[0]
        view = graph.add_turn(
            TurnNode(request_messages=[*task, echoed, {"role": "user", "content": "go"}], **tokens)
        )
        per_turn.append(work[0] - before)
        assert graph.parent(view.node_id) == sample.node_id
    for counts in (per_turn, per_sample):
        early, late = counts[40:60], counts[580:600]
        assert max(late) <= max(early), (early, late)


def test_a_prompt_sampled_many_times_lists_no_group_per_turn() -> None:
    """A request sampled hundreds of times is one group of the request table: filing a
    sample, or finding the base and the parent of a continuation, asks the table for a
    handful of its turns, never for a list of the whole group (a list a turn made the cost
    of each turn grow with the group: 20,000 samples were 20 times slower than 100)."""
    graph = RolloutGraph()
    table = graph._requests.table
    listed: list[int] = []  # turns the table listed, per call

    class Counting:
        def __len__(self) -> int:
            return len(table)

        def __getattr__(self, name: str) -> Any:
            found = getattr(table, name)
            if name not in ("filed_under", "prefixes"):
                return found

            def counted(*args: Any, **kwargs: Any) -> Any:
                out = found(*args, **kwargs)
                listed.append(sum(len(p[2]) for p in out) if name == "prefixes" else len(out))
                return out

            return counted

    graph._requests.table = Counting()  # type: ignore[assignment]
    request = [{"role": "system", "content": "s"}, _user("solve")]
    for i in range(600):
        graph.add_turn(TurnNode(request_messages=request, response_message=_assistant(f"s{i}")))
    for i in (5, 300, 599):
        child = graph.add_turn(
            TurnNode(request_messages=[*request, _assistant(f"s{i}"), _user("go on")])
        )
        assert graph.parent(child.node_id) == f"turn-{i}"
    assert len(graph._requests.groups[graph._turns[0].rkey]) == 600
    assert sum(listed) <= 4 * len(graph) and max(listed) <= 2, (sum(listed), max(listed))
