"""Demo: record a synthetic 50-turn multimodal rollout (one new 64 KiB screenshot per turn) with
the plain capture graph and with rollout_store, and print the memory each retains per turn."""

from __future__ import annotations

import json
import sys

from measure import MiB, retained_bytes, targets_summary
from schemes import SCHEMES
from workloads import UniqueContent, iter_texts, multimodal

TURNS = 50
EVERY = 5
MAX_OVER_UNIQUE = 1.10  # rollout_store retains at most this x the unique content


def main() -> int:
    texts = list(iter_texts(multimodal, TURNS))
    checkpoints = range(EVERY, TURNS + 1, EVERY)
    unique, content = {}, UniqueContent()
    for turn, text in enumerate(texts, 1):
        content.add(json.loads(text))
        unique[turn] = content.bytes
    plain = retained_bytes(SCHEMES["plain"], texts, checkpoints)
    ours = retained_bytes(SCHEMES["rollout_store"], texts, checkpoints)
    print(f"{TURNS}-turn multimodal rollout, memory retained after each turn (MiB)")
    print(f"{'turn':>5}{'plain':>10}{'rollout_store':>15}{'unique':>10}")
    for turn in checkpoints:
        mib = [plain[turn] / MiB, ours[turn] / MiB, unique[turn] / MiB]
        print(f"{turn:>5}{mib[0]:>10.1f}{mib[1]:>15.2f}{mib[2]:>10.2f}")
    print(
        f"after {TURNS} turns plain keeps {plain[TURNS] / unique[TURNS]:.1f}x the unique content,"
        f" rollout_store {ours[TURNS] / unique[TURNS]:.2f}x"
    )
    over = ours[TURNS] / unique[TURNS]
    checks = [
        f"{'PASS' if over <= MAX_OVER_UNIQUE else 'MISS'}  rollout_store {over:.2f}x unique"
        f" <= {MAX_OVER_UNIQUE}"
    ]
    print("\n".join(checks))
    print(targets_summary(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
