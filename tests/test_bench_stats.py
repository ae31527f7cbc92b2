"""bench/bench_peer_trl.py's learning comparison: the difference of the tools' mean rewards, its
permutation test and interval, against the test written out over every split of the pooled seeds."""

import importlib.util
import itertools
import random
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
