"""`rollout-store serve` whose recorder waits while a gate file exists, for the kill -9 tests
of the `--ack fast` ledger: the turns answered meanwhile stay queued, deterministically.

    python stalled_recorder.py GATE serve --upstream ... (the arguments of `rollout-store`)
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from rollout_store.cli import main
from rollout_store.serve.server import RustDataPlane, _Server

#: The longest a turn waits for the gate (the test kills the server long before).
STALL_S = 60.0


def stall_recorder(gate: Path) -> None:
    """Turns are recorded (on either data plane) only while `gate` does not exist: the
    Python plane's recorder waits in the event loop, the Rust plane's in its own thread."""
    record = _Server._record
    record_queued = RustDataPlane.record

    async def stalled(self: _Server, session: Any, node: Any) -> str:
        deadline = time.monotonic() + STALL_S
        while gate.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return await record(self, session, node)

    def stalled_queued(self: RustDataPlane, calls: Any) -> None:
        deadline = time.monotonic() + STALL_S
        while gate.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        record_queued(self, calls)

    _Server._record = stalled  # type: ignore[method-assign]
    RustDataPlane.record = stalled_queued  # type: ignore[method-assign]


if __name__ == "__main__":
    stall_recorder(Path(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
