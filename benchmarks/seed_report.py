"""The 12-turn seed workload: bytes retained by plain vs rollout_store, and how many image
strings each keeps (plain keeps one per re-sent image: 78; rollout_store should keep 12)."""

from __future__ import annotations

import gc
import json
import sys
import types

from measure import MiB, record_traced, targets_summary
from schemes import SCHEMES, available_schemes
from workloads import IMAGE_URL_LEN, SEED_TURNS, iter_texts, seed_workload, unique_content_bytes

EXPECTED_IMAGE_STRS = {"plain": 78, "rollout_store": 12}
LARGE = 32 * 1024  # no other value of the seed workload is this long
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)


def count_large_strings(root: object) -> tuple[int, int]:
    """Walk gc.get_referents from root (not into classes, modules or functions); return the
    number of distinct str objects of the image URL's length, and of distinct str/bytes
    objects of 32 KiB or more, counted by id."""
    seen: set[int] = {id(root)}
    stack = [root]
    image_strs = large = 0
    while stack:
        obj = stack.pop()
        if isinstance(obj, str | bytes | bytearray):
            image_strs += isinstance(obj, str) and len(obj) == IMAGE_URL_LEN
            large += len(obj) >= LARGE
            continue
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, _OPAQUE):
                seen.add(id(ref))
                stack.append(ref)
    return image_strs, large


def main() -> int:
    texts = list(iter_texts(seed_workload, SEED_TURNS))
    unique = unique_content_bytes(json.loads(t) for t in texts)
    print(f"seed workload: {SEED_TURNS} turns, unique content {unique / MiB:.2f} MiB")
    print(
        f"{'scheme':<14}{'retained MiB':>13}{'x unique':>10}{'image strs':>12}{'>=32KiB objs':>14}"
    )
    checks = []
    for scheme in [s for s in ("plain", "rollout_store") if s in available_schemes()]:
        recorder, retained = record_traced(SCHEMES[scheme], texts, [SEED_TURNS])
        image_strs, large = count_large_strings(recorder.root)
        recorder.close()
        size = retained[SEED_TURNS]
        print(f"{scheme:<14}{size / MiB:>13.2f}{size / unique:>9.2f}x{image_strs:>12}{large:>14}")
        expected = EXPECTED_IMAGE_STRS[scheme]
        verdict = "PASS" if image_strs == expected else "MISS"
        checks.append(f"{verdict}  {scheme} keeps {image_strs} image strings (expected {expected})")
    print("\n".join(checks))
    print(targets_summary(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
