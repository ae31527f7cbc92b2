"""`m2po eval` with an environment: every sample an episode, seeded per request, so two evaluations
agree sample for sample; the accuracy with the environment and without it are two caches of one
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from m2po_cli.cli import main
from m2po_cli.eval.config import EVALS_DIR
from m2po_cli.models import resolve_model

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[3] / "shared" / "benchmarks"
RETRY = ['env.name="builtin:retry"', "env.max_turns=2", "env.max_tokens=400"]


def evaluate(out: Path, *sets: str) -> list[dict]:
    args = ["eval", str(resolve_model("builtin:tiny-qwen3-untied")), "--benchmarks", "amc23", "--limit", "3"]
    args += [
        "--protocol",
        str(EVALS_DIR / "short-context.toml"),
        "--data-dir",
        str(BENCHMARKS),
        "--out",
        str(out),
    ]
    for s in ["protocol.samples=2", *sets]:
        args += ["--set", s]
    before = set(out.glob("*/amc23-*.jsonl"))
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (cache,) = set(out.glob("*/amc23-*.jsonl")) - before
    return [json.loads(line) for line in cache.read_text().splitlines()]


@pytest.mark.skipif(not BENCHMARKS.is_dir(), reason=f"no benchmark files in {BENCHMARKS}")
def test_eval_runs_the_environment_seeded_per_sample(tmp_path):
    once = evaluate(tmp_path / "a", *RETRY)
    again = evaluate(tmp_path / "b", *RETRY)
    assert once == again and len(once) == 6  # every sample its own seeded request
    for r in once:
        assert r["turns"] in (1, 2) and r["tool_calls"] == 0
        assert r["turns"] == 2 or r["correct"] or not r["finished"]  # a wrong finished answer is retried
    assert any(r["turns"] == 2 for r in once), "no sample was retried: nothing was tested"
    plain = evaluate(tmp_path / "a")  # the same checkpoint without the environment: its own cache
    assert len(plain) == 6 and all("turns" not in r for r in plain)
    assert len(list((tmp_path / "a").glob("*/amc23-*.jsonl"))) == 2
