"""bench/network_bytes.py: the 8B recipe's inter-node bytes per step, FSDP against HSDP, recomputed
here by hand from the parameter count and the recipe's batch."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "network_bytes.py"


def test_hsdp_sends_a_tenth_of_fsdp_on_two_nodes_and_the_figures_add_up():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--nodes", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.split("\n\n")[1].splitlines()[2:]:  # the 8B table's rows
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[1]] = [float(re.sub(r"[^\d.]", "", c)) for c in cells[4:8]]
    params, updates, micro = 8.19e9, 4, 8  # 512 rows an update over 16 ranks, 4 a micro-batch
    # FSDP over both nodes: each node sends half of every collective over all 16 ranks.
    gathers = updates * micro * 3 * 2 * params / 2  # global pass, forward, backward; bf16
    grads = updates * micro * 4 * params / 2  # fp32 reduce-scatter after every micro-batch
    push = 4 * params / 2  # fp32 master weights gathered once a step
    fsdp = rows["FSDP, dp_shard 16"]
    assert [round(x) for x in fsdp] == [round((gathers + grads + push) / 1e9), round(gathers / 1e9),
                                        round(grads / 1e9), round(push / 1e9)]  # fmt: skip
    # HSDP: nothing but one all-reduce of the fp32 gradients between the two replicas an update.
    hsdp = rows["HSDP, dp_replicate 2 x dp_shard 8"]
    assert hsdp == [
        round(updates * 2 * 4 * params / 2 / 1e9),
        0,
        round(updates * 2 * 4 * params / 2 / 1e9),
        0,
    ]
    assert hsdp[0] * 10 <= fsdp[0]
