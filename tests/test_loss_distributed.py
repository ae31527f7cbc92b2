"""The global M2PO mask across data-parallel ranks: 2 processes under torchrun (gloo, CPU).

tests/workers/dist_loss_worker.py does the work on each rank; this test starts it and reads its reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "workers" / "dist_loss_worker.py"


@pytest.mark.slow
def test_two_ranks_match_one_process_holding_the_whole_batch(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}
    done = subprocess.run(
        [*command, str(WORKER), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    reports = {r: json.loads(p.read_text()) for r, p in enumerate(sorted(tmp_path.glob("rank*.json")))}
    assert len(reports) == 2, done.stdout + done.stderr
    for report in reports.values():
        for case in report["cases"]:
            assert all(case["checks"].values()), (report["rank"], case)
    assert done.returncode == 0, done.stdout + done.stderr
    m2po = next(case for case in reports[0]["cases"] if case["name"] == "m2po bins1024")
    # The batch exercises the mask: some trust-region tokens masked, not all.
    assert 0 < m2po["prepared"]["m2po/num_masked"] < m2po["prepared"]["m2po/num_trust_region"]
    assert reports[0]["cases"] == reports[1]["cases"]  # the global metrics agree on both ranks

    # The tied batch stops inside a run of equal M2 (leaving together would mask more), and both
    # ranks mask what the literal one-at-a-time loop masks.
    from tests.test_loss import algorithm1, values_together
    from tests.workers.dist_loss_worker import tied_batch

    x, a, v = (t.tolist() for t in tied_batch()[:3])
    inside = 0
    for tau in (0.01, 0.04):
        one_at_a_time = len(algorithm1(x, a, v, tau)[0])
        inside += one_at_a_time < len(values_together(x, a, v, tau))
        for bins in (1024, 1):
            case = next(c for c in reports[0]["cases"] if c["name"] == f"m2po ties tau={tau} bins{bins}")
            assert case["prepared"]["m2po/num_masked"] == one_at_a_time, (tau, bins)
    assert inside >= 1
