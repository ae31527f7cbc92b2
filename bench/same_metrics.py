"""Do two runs write the same numbers? Compare two runs' metrics.jsonl step by step.

    python bench/same_metrics.py runs/before runs/after              # the default keys, exactly
    python bench/same_metrics.py A B --keys rollout/reward_mean loss/loss --rel 1e-6

For a change that should not move the numbers (a refactor of the loop, a new layout): run the same
recipe and seed before and after, then compare. The default keys are what a run learns and what its
loss did: the reward, the loss, the masked or clipped share and M2PO's mask size and second moments.
Prints one line per key (steps compared, largest relative difference); exits 1 if any step differs by
more than `--rel`, or if the runs have different steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEYS = (
    "rollout/reward_mean",
    "rollout/response_tokens_mean",
    "loss/loss",
    "loss/clip_frac",
    "m2po/num_masked",
    "m2po/m2_before",
    "m2po/m2_after",
    "optim/grad_norm",
)


def steps(run: Path) -> dict[int, dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    return {record["step"]: record for record in map(json.loads, path.read_text().splitlines())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--keys", nargs="+", default=list(KEYS))
    parser.add_argument("--rel", type=float, default=0.0, help="largest relative difference allowed")
    args = parser.parse_args()
    before, after = steps(args.before), steps(args.after)
    if before.keys() != after.keys():
        print(f"different steps: {sorted(before.keys() ^ after.keys())[:10]}")
        return 1
    failed = False
    for key in args.keys:
        pairs = [(s, before[s].get(key), after[s].get(key)) for s in sorted(before)]
        pairs = [(s, a, b) for s, a, b in pairs if a is not None or b is not None]
        if not pairs:
            print(f"{key:30s} in neither run")
            continue
        worst, where = 0.0, None
        for s, a, b in pairs:
            if a is None or b is None:
                worst, where = float("inf"), s
                break
            gap = abs(a - b) / max(abs(a), abs(b), 1e-30) if a != b else 0.0
            if gap > worst:
                worst, where = gap, s
        ok = worst <= args.rel
        failed |= not ok
        at = "" if where is None else f" (step {where})"
        print(
            f"{key:30s} {len(pairs):4d} steps  largest relative difference {worst:.3g}{at}  {'ok' if ok else 'DIFFERS'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
