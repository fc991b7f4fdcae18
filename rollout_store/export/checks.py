"""Checks of what a rollout hands a trainer: each training sequence, and the graph's shape.

Findings are graded: FATAL (the row or rollout must not be trained on), WARN (trainable, but
worth understanding) and INFO (recorded for the record). Each prints as
``[LEVEL] code: detail``; the codes are those of the capture graph's own validation, so
consumers that filter on ``[FATAL`` or on a code keep working. Nothing here raises: the export
document carries the findings next to the data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..model.training import TrainingSequence

__all__ = ["FATAL", "INFO", "WARN", "Finding", "Report", "check_rollout", "check_sequence"]

FATAL, WARN, INFO = "FATAL", "WARN", "INFO"


@dataclass
class Finding:
    """One graded observation: `level`, a stable `code`, and a human `detail`."""

    level: str
    code: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.level}] {self.code}: {self.detail}"


@dataclass
class Report:
    """The findings of one check; `ok` while none is FATAL."""

    findings: list[Finding] = field(default_factory=list)

    def add(self, level: str, code: str, detail: str) -> None:
        self.findings.append(Finding(level, code, detail))

    @property
    def fatal(self) -> list[Finding]:
        return [f for f in self.findings if f.level == FATAL]

    @property
    def ok(self) -> bool:
        return not self.fatal

    def lines(self) -> list[str]:
        """Every finding as its ``[LEVEL] code: detail`` line."""
        return [str(f) for f in self.findings]


class _HasStats(Protocol):
    def stats(self) -> Mapping[str, Any]: ...


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _finite(x: float) -> bool:
    """`math.isfinite`, False for an int no float holds (-10**400) rather than raising."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _turn_problems(prompt: list[Any], sampled: list[Any], logprobs: list[Any]) -> list[str]:
    """What makes a flattened prompt + completion unusable as one training example."""
    problems: list[str] = []
    for name, ids in (("prompt", prompt), ("sampled", sampled)):
        if any(type(t) is not int or t < 0 for t in ids):
            problems.append(f"invalid_token_id: {name} token ids are not all non-negative ints")
    if any(not _is_real(lp) or not _finite(lp) for lp in logprobs):
        problems.append("invalid_logprob: some logprobs are not finite numbers")
    elif any(lp > 0 for lp in logprobs):
        problems.append("positive_logprob: some logprobs are above 0")
    if not prompt:
        problems.append("no_prompt_ids: the sequence has no prompt tokens (no token ids came back)")
    if len(logprobs) != len(sampled):
        problems.append(
            f"logprob_misalign: {len(logprobs)} logprobs for {len(sampled)} sampled tokens"
        )
    return problems


def check_sequence(seq: TrainingSequence, *, min_trainable: int = 1) -> Report:
    """The invariants a trainer assumes of one row and never checks again."""
    report = Report()
    n = len(seq.input_ids)
    if len(seq.loss_mask) != n or len(seq.logprobs) != n:
        report.add(
            FATAL,
            "length_mismatch",
            f"{n} input ids, {len(seq.loss_mask)} mask bits, {len(seq.logprobs)} logprobs",
        )
        return report
    start = seq.prompt_len
    problems = _turn_problems(seq.input_ids[:start], seq.input_ids[start:], seq.logprobs[start:])
    if any(type(bit) is not int or bit not in (0, 1) for bit in seq.loss_mask):
        problems.append("invalid_loss_mask: mask bits must be the ints 0 and 1")
    elif any(seq.loss_mask[:start]):
        problems.append("trainable_prompt: a prompt token has mask 1")
    if problems:
        report.add(FATAL, "invalid_training_sequence", "; ".join(problems))
        return report

    trainable = sum(seq.loss_mask)
    if trainable < min_trainable:
        report.add(
            FATAL,
            "nothing_trainable",
            f"{trainable} of {n} tokens have mask 1: the row gives no gradient",
        )
    scored_context = sum(
        1 for m, lp in zip(seq.loss_mask, seq.logprobs, strict=True) if not m and lp
    )
    if scored_context:
        report.add(FATAL, "masked_has_logprob", f"{scored_context} context tokens have a logprob")
    if start >= n:
        report.add(FATAL, "empty_response", f"the prompt ({start} tokens) is the whole sequence")
    certain = sum(1 for m, lp in zip(seq.loss_mask, seq.logprobs, strict=True) if m and lp == 0)
    if certain:
        report.add(
            INFO, "certain_tokens", f"{certain} of {trainable} trainable tokens have logprob 0"
        )
    return report


def check_rollout(
    graph: _HasStats,
    *,
    capture_level: str = "tokens",
    budget_stop_count: int = 0,
    expect_single_root: bool = False,
) -> Report:
    """The graph's shape: no turns, one root per turn, several roots, one turn, discards."""
    report = Report()
    stats = graph.stats()
    turns, roots = stats["n_turns"], stats["n_roots"]
    if turns == 0:
        report.add(FATAL, "no_turns", "no model call was recorded")
        return report
    if turns > 1 and roots == turns:
        if capture_level == "tokens":
            report.add(
                WARN,
                "per_turn_capture_only",
                f"each of the {turns} turns is its own root: the harness re-renders its prompt, "
                "so every row is single-turn",
            )
        else:
            report.add(
                INFO,
                "per_turn_trace_only",
                f"each of the {turns} turns is its own root: their messages do not extend "
                "each other",
            )
    elif roots > 1:
        report.add(WARN, "multiple_roots", f"{roots} roots across {turns} turns")
    elif expect_single_root and roots != 1:
        report.add(FATAL, "root_count", f"expected 1 root, found {roots}")
    if turns == 1 and budget_stop_count <= 0:
        report.add(
            FATAL,
            "degenerate_rollout",
            "one model call for the whole task: the agent stopped after its first response",
        )
    if stats["n_discarded"]:
        report.add(
            WARN,
            "discarded_turns",
            f"{stats['n_discarded']} sampled turn(s) were retried and dropped; "
            "they are left out of training rows",
        )
    if stats["n_forks"]:
        report.add(INFO, "forks", f"{stats['n_forks']} turn(s) have more than one child")
    if stats.get("n_drift"):
        report.add(
            WARN,
            "token_drift",
            f"{stats['n_drift']} turn(s) continue a turn by their messages but not by their "
            "token ids (retokenization drift): each became a root; see the document's `drift`",
        )
    return report
