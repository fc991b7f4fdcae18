"""`rollout-store serve` whose sessions cannot record a turn (every `add_turn` fails as a full
disk does), for the kill -9 tests of the `--ack fast` ledger: each turn answered is dropped
with `record_error`, on either data plane.

    python failing_recorder.py serve --upstream ... (the arguments of `rollout-store`)
"""

from __future__ import annotations

import errno
import sys
from typing import Any

from rollout_store.cli import main
from rollout_store.files.storage import RolloutGraph


def fail_recording() -> None:
    """Every turn added to a graph fails with ENOSPC."""

    def add_turn(self: RolloutGraph, node: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    RolloutGraph.add_turn = add_turn  # type: ignore[method-assign]


if __name__ == "__main__":
    fail_recording()
    sys.exit(main(sys.argv[1:]))
