"""bench/bench_peer_trl.py's numbers: the learning comparison (the difference of the tools' mean
rewards, its permutation test and interval, against the test written out over every split of the
pooled seeds) and the measurement of a run (its cores, its kernel high-water mark, its update)."""

import argparse
import importlib.util
import itertools
import os
import random
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_peer_trl", ROOT / "bench" / "bench_peer_trl.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def literal_p(a: list[float], b: list[float]) -> float:
    """Two-sided: the share of all ways to split the pooled values into groups of len(a) and len(b)
    whose difference of means is at least as far from 0 as the observed one."""
    pooled, observed = a + b, abs(statistics.mean(a) - statistics.mean(b))
    splits = list(itertools.combinations(range(len(pooled)), len(a)))
    extreme = 0
    for chosen in splits:
        x = [pooled[i] for i in chosen]
        y = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        extreme += abs(statistics.mean(x) - statistics.mean(y)) >= observed - 1e-12
    return extreme / len(splits)


@pytest.mark.parametrize("seed", range(5))
def test_the_permutation_p_and_the_difference_are_the_literal_ones(seed):
    rng = random.Random(seed)
    a = [round(rng.random(), 3) for _ in range(rng.randint(3, 8))]
    b = [round(rng.random() + 0.2 * seed, 3) for _ in range(rng.randint(3, 8))]
    d = bench.difference(a, b)
    assert d["difference"] == pytest.approx(statistics.mean(a) - statistics.mean(b), abs=1e-12)
    assert d["p"] == pytest.approx(literal_p(a, b), abs=1e-12)
    assert d["low"] < d["difference"] < d["high"]


def test_tools_that_never_overlap_are_told_apart_and_equal_ones_are_not():
    apart = bench.difference(
        [0.9, 0.8, 0.85, 0.95, 0.88, 0.92, 0.83, 0.9], [0.1, 0.2, 0.15, 0.05, 0.12, 0.2, 0.1, 0.18]
    )
    assert apart["p"] == pytest.approx(2 / 12870) and apart["low"] > 0.5
    same = bench.difference([0.1, 0.5, 0.9, 0.3], [0.1, 0.5, 0.9, 0.3])
    assert same["p"] == 1.0 and same["low"] < 0 < same["high"]


def test_a_run_is_measured_on_its_cores_by_the_kernels_high_water_mark(tmp_path):
    """A child that touches 400 MiB and prints the cores it may use: its peak is those 400 MiB (the
    interpreter adds tens of MiB, not hundreds), read when it ends, and it ran on the given core. The
    bench holds 700 MiB meanwhile: a process started from it carries its mark until exec, which
    must not count."""
    core = max(os.sched_getaffinity(0))
    touch = "import os; b = b'x' * (400 * 2**20); print(sorted(os.sched_getaffinity(0)))"
    log = tmp_path / "child.log"
    ballast = b"y" * (700 * 2**20)
    measured = bench.run_measured([sys.executable, "-c", touch], log, dict(os.environ), {core})
    del ballast
    assert log.read_text().strip() == f"[{core}]"
    assert 400 / 1024 < measured["peak_gib"] < 520 / 1024, measured
    assert 0 <= measured["other_cpu"] <= 1 and 0 <= measured["steal"] <= 1


def test_a_failed_run_stops_the_bench_and_names_its_log(tmp_path):
    log = tmp_path / "child.log"
    cmd = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    with pytest.raises(SystemExit, match=r"exited with 3; see .*child\.log:\nno such model"):
        bench.run_measured(cmd, log, dict(os.environ), os.sched_getaffinity(0))


def test_the_update_is_the_rest_of_the_step_for_both_tools():
    rng = random.Random(0)
    steps = [
        {
            "step_s": rng.uniform(10, 20),
            "generate_s": rng.uniform(2, 4),
            "reward_s": rng.uniform(0, 0.2),
            "generated_tokens": rng.randint(300, 600),
            "trained_tokens": rng.randint(2000, 2600),
            "reward": rng.random(),
        }
        for _ in range(10)
    ]
    got = bench.summary({"steps": steps, "peak_gib": 6.0, "other_cpu": 0.001, "steal": 0.0})
    steady = steps[1:]  # the first step warms the kernels up
    rest = [s["step_s"] - s["generate_s"] - s["reward_s"] for s in steady]
    assert got["update s"] == pytest.approx(sum(rest) / 9)
    assert got["s/step"] == pytest.approx(got["generate s"] + got["reward s"] + got["update s"])
    assert got["update tok/s"] == pytest.approx(sum(s["trained_tokens"] for s in steady) / sum(rest))
    assert got["reward first 1/5"] == pytest.approx((steps[0]["reward"] + steps[1]["reward"]) / 2)
    assert got["reward last 1/5"] == pytest.approx((steps[8]["reward"] + steps[9]["reward"]) / 2)


def test_cores_are_read_as_vllm_writes_them_and_must_be_this_processs():
    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    assert bench.parse_cores(f"{first}") == {first}
    assert bench.parse_cores(f"{first}-{first}") == {first}
    assert bench.parse_cores(",".join(map(str, sorted(allowed)))) == allowed
    with pytest.raises(argparse.ArgumentTypeError, match="may run on cores"):
        bench.parse_cores(str(max(allowed) + 1))
