"""A training sequence: one root-to-leaf path flattened into token ids, loss mask and logprobs.

The shape is the one trainers already read from the capture graph this library replaces:
attributes `input_ids`, `loss_mask`, `logprobs`, `node_ids`, `prompt_len`, `root_id` and
`n_turns`, plus `n_trainable` and `turn_lengths()`. `to_dict()` gives the same fields as a
plain dict, in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TrainingSequence"]


@dataclass
class TrainingSequence:
    """One path of the graph as a trainer consumes it.

    `loss_mask[i]` is 1 where `input_ids[i]` was sampled by the model and its logprob is
    known, 0 for context (prompt tokens, tool results, turns without aligned logprobs).
    `logprobs[i]` is that sampled token's logprob, 0.0 where the mask is 0.
    """

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[Any]
    node_ids: list[str]
    prompt_len: int
    root_id: str
    n_turns: int

    @property
    def n_trainable(self) -> int:
        """How many tokens carry a training signal (mask 1)."""
        return sum(self.loss_mask)

    def turn_lengths(self) -> list[int]:
        """The length of each run of mask-1 tokens, in order.

        One run per turn that sampled trainable tokens; two turns with no context tokens
        between them read as one run.
        """
        lengths: list[int] = []
        run = 0
        for bit in self.loss_mask:
            if bit:
                run += 1
            elif run:
                lengths.append(run)
                run = 0
        if run:
            lengths.append(run)
        return lengths

    def to_dict(self) -> dict[str, Any]:
        """The seven fields as a dict (the lists themselves, not copies)."""
        return {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "node_ids": self.node_ids,
            "prompt_len": self.prompt_len,
            "root_id": self.root_id,
            "n_turns": self.n_turns,
        }
