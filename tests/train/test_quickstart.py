"""The quickstart, as a newcomer runs it: the real CLI, the real engine and learner, and it learns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_learns(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "m2po_cli",
        "train",
        "recipes/quickstart.toml",
        "--set",
        f'run.output_dir="{tmp_path}"',
    ]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=1200)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-4000:]
    rewards = [
        json.loads(line)["rollout/reward_mean"] for line in (tmp_path / "quickstart" / "metrics.jsonl").open()
    ]
    k = len(rewards) // 5
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"quickstart: {elapsed:.0f} s, reward {first:.3f} -> {last:.3f}")
    assert last - first >= 0.3, f"reward of the first fifth {first:.3f}, of the last fifth {last:.3f}"
    assert "reward, mean over the first" in done.stderr.splitlines()[-1]
    assert (tmp_path / "quickstart" / "export" / "model.safetensors").exists()
    # The console shows the run, not third-party noise: that is in the run's third-party.log.
    lines = (done.stdout + done.stderr).splitlines()
    print(f"quickstart console: {len(lines)} lines")
    assert len(lines) < 40, "\n".join(lines)
    noise = (tmp_path / "quickstart" / "third-party.log").read_text()
    assert "RotaryEmbedding" in noise or "vllm" in noise, "vLLM's logs did not reach the log file"
    assert not any("WARNING" in line or "Warning" in line for line in lines), "\n".join(lines)

    # The quickstart's output goes straight into `m2po eval`, as docs/quickstart.md shows.
    benchmarks = ROOT.parent / "shared" / "benchmarks"
    if not benchmarks.is_dir():
        pytest.skip(f"no benchmark data at {benchmarks}")
    out = tmp_path / "eval"
    cmd = [
        sys.executable,
        "-m",
        "m2po_cli",
        "eval",
        str(tmp_path / "quickstart"),
        "--limit",
        "4",
        "--protocol",
        "evals/short-context.toml",
        "--data-dir",
        str(benchmarks),
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert list(out.rglob("results.json"))
