"""The findings the export document carries: per training row and per rollout."""

from __future__ import annotations

import math

import pytest

from rollout_store.export.checks import (
    FATAL,
    INFO,
    WARN,
    Finding,
    check_rollout,
    check_sequence,
)
from rollout_store.model.training import TrainingSequence


def seq(ids, mask, logprobs, prompt_len=2) -> TrainingSequence:
    return TrainingSequence(list(ids), list(mask), list(logprobs), ["a"], prompt_len, "a", 1)


def codes(report) -> list[str]:
    return [f.code for f in report.findings]


def test_a_well_formed_row_passes():
    report = check_sequence(seq([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.1]))
    assert report.ok and report.findings == []


@pytest.mark.parametrize(
    ("row", "code", "detail"),
    [
        (seq([1, 2, 3], [0, 0], [0.0, 0.0, -1.0]), "length_mismatch", "3 input ids"),
        (seq([1, 2, 3], [0, 0, 2], [0.0, 0.0, -1.0]), "invalid_training_sequence", "mask"),
        (seq([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0]), "invalid_training_sequence", "prompt"),
        (seq([1, 2, 3], [0, 0, 1], [0.0, 0.0, 0.5]), "invalid_training_sequence", "positive"),
        (seq([1, 2, 3], [0, 0, 1], [0.0, 0.0, math.nan]), "invalid_training_sequence", "finite"),
        (seq([1, -2, 3], [0, 0, 1], [0.0, 0.0, -1.0]), "invalid_training_sequence", "token"),
        (seq([1, 2, 3], [0, 0, 1], [0.0, 0.0, -1.0], 0), "invalid_training_sequence", "prompt"),
        (seq([1, 2, 3], [0, 0, 0], [0.0, 0.0, 0.0]), "nothing_trainable", "0 of 3"),
        (seq([1, 2, 3], [0, 0, 1], [0.0, -0.3, -1.0]), "masked_has_logprob", "1 context"),
        (seq([1, 2], [0, 0], [0.0, 0.0]), "empty_response", "whole sequence"),
    ],
)
def test_bad_rows_are_fatal(row, code, detail):
    report = check_sequence(row)
    assert not report.ok
    (found,) = [f for f in report.fatal if f.code == code]
    assert detail in found.detail
    assert str(found).startswith(f"[FATAL] {code}: ")


def test_certain_tokens_are_info_only():
    report = check_sequence(seq([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, 0, -0.5]))
    assert report.ok and codes(report) == ["certain_tokens"]
    assert report.findings[0].level == INFO


class Shape:
    def __init__(self, **stats: int) -> None:
        self._stats = {"n_turns": 0, "n_roots": 0, "n_forks": 0, "n_discarded": 0, **stats}

    def stats(self) -> dict[str, int]:
        return self._stats


def test_rollout_shapes():
    assert codes(check_rollout(Shape())) == ["no_turns"]
    assert codes(check_rollout(Shape(n_turns=1, n_roots=1))) == ["degenerate_rollout"]
    assert check_rollout(Shape(n_turns=1, n_roots=1), budget_stop_count=1).findings == []
    per_turn = Shape(n_turns=3, n_roots=3)
    assert codes(check_rollout(per_turn)) == ["per_turn_capture_only"]
    assert check_rollout(per_turn).findings[0].level == WARN
    assert codes(check_rollout(per_turn, capture_level="text")) == ["per_turn_trace_only"]
    assert codes(check_rollout(Shape(n_turns=4, n_roots=2))) == ["multiple_roots"]
    forked = Shape(n_turns=4, n_roots=1, n_forks=1, n_discarded=1)
    assert codes(check_rollout(forked)) == ["discarded_turns", "forks"]
    assert check_rollout(forked).ok
    assert check_rollout(Shape(n_turns=2, n_roots=1), expect_single_root=True).ok


def test_finding_prints_level_code_detail():
    assert str(Finding(FATAL, "x", "y")) == "[FATAL] x: y"
