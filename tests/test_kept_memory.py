"""The index of token roots is built at the first lookup that has a root to find: a graph of
one rollout keeps none, and a late ancestor still finds every root that waits for it."""

from __future__ import annotations

from pathlib import Path

from rollout_store import RolloutGraph, TurnNode


def _prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_one_rollout_keeps_no_index_of_its_root() -> None:
    graph = RolloutGraph()
    prompt = _prompt(200)
    for step in range(5):
        sampled = [7 + step, 8 + step]
        graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=sampled))
        prompt = [*prompt, *sampled, *_prompt(30, 5000 + 100 * step)]
    assert len(graph.root_ids()) == 1
    assert graph._linker.token_roots is None


def test_late_ancestors_find_roots_committed_before_the_index() -> None:
    """Two continuations arrive before their ancestors (long and short prompts): the first
    is committed before any index exists, the second is filed in the index its own lookup
    built; each ancestor finds its waiting root."""
    graph = RolloutGraph()
    long_head, short_head = _prompt(150), [5, 6, 7, 8, 9, 10]
    late_long = graph.add_turn(TurnNode(prompt_ids=[*long_head, 1, 2, 3, 4], sampled_ids=[9]))
    assert graph._linker.token_roots is None  # a root, but no lookup needed the index yet
    # a second root looks for roots it continues: the index is built, with the first
    late_short = graph.add_turn(TurnNode(prompt_ids=[*short_head, 11, 12, 13], sampled_ids=[1]))
    assert graph._linker.token_roots is not None
    first_long = graph.add_turn(TurnNode(prompt_ids=long_head[:-2], sampled_ids=long_head[-2:]))
    assert graph.parent(late_long.node_id) == first_long.node_id
    first_short = graph.add_turn(TurnNode(prompt_ids=short_head, sampled_ids=[11, 12]))
    assert graph.parent(late_short.node_id) == first_short.node_id
    assert sorted(graph.root_ids()) == sorted([first_long.node_id, first_short.node_id])


def test_a_graph_loaded_from_a_file_finds_its_waiting_root(tmp_path: Path) -> None:
    graph = RolloutGraph()
    head = _prompt(100)
    late = graph.add_turn(TurnNode(prompt_ids=[*head, 1, 2], sampled_ids=[3]))
    graph.save(tmp_path / "g.rls")
    loaded = RolloutGraph.load(tmp_path / "g.rls")
    first = loaded.add_turn(TurnNode(prompt_ids=head, sampled_ids=[1, 2]))
    assert loaded.parent(late.node_id) == first.node_id
