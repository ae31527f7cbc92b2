"""`m2po eval` mistakes: one line, exit code 2, before anything heavy starts, and nothing written
before is lost; a target that fails late leaves the others' combined results written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from m2po_cli.cli import main
from m2po_cli.eval.config import EVALS_DIR, load_benchmarks, load_eval_config
from m2po_cli.eval.data import load_problems
from m2po_cli.eval.evaluate import plan_target, slug, target_episodes
from m2po_cli.eval.targets import resolve_targets
from m2po_cli.models import resolve_model

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT.parent / "shared" / "benchmarks"
needs_data = pytest.mark.skipif(not BENCHMARKS.is_dir(), reason=f"no benchmark files in {BENCHMARKS}")
# One cheap benchmark, one problem, one sample: a target whose samples are all cached never starts vLLM.
CHEAP = ["--benchmarks", "aime24", "--limit", "1", "--set", "protocol.samples=1"]
SHORT = EVALS_DIR / "short-context.toml"


@pytest.fixture
def model(tmp_path) -> Path:
    """A private copy of the tiny builtin, free to damage."""
    copy = tmp_path / "tiny"
    shutil.copytree(resolve_model("builtin:tiny-qwen3"), copy)
    return copy


def _eval(*args: str, env: dict[str, str] | None = None):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in (env or {}).items():
            mp.setenv(k, v)
        return CliRunner().invoke(main, ["eval", *args])


def _one_line(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert expected in result.output, result.output


def test_a_typo_under_a_local_folder_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    _one_line(_eval("runs/typo"), "runs/typo: checkpoint not found (runs/ is a local folder)")


def test_a_corrupt_safetensors_file_is_caught_before_the_engine(model):
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    _one_line(_eval(str(model)), f"{weights}: corrupt safetensors file")
    weights.write_bytes(b"\x00" * 4)
    _one_line(_eval(str(model)), f"{weights}: corrupt safetensors file")


def test_a_model_without_tokenizer_or_chat_template(model):
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    _one_line(_eval(str(model)), "the tokenizer has no chat template")
    (model / "tokenizer.json").unlink()
    _one_line(_eval(str(model)), f"{model}: no tokenizer files")


@pytest.mark.parametrize("where", ["under a file", "unwritable"])
def test_an_unwritable_out_folder(model, tmp_path, where):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "results" if where == "under a file" else Path("/sys/m2po-eval-results")
    _one_line(_eval(str(model), "--out", str(out)), f"--out: {out}: cannot write there")


def test_offline_without_benchmark_data_says_where_it_looked(model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "M2PO_BENCHMARKS"}
    env.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(ROOT)
    )
    cmd = [sys.executable, "-m", "m2po_cli", "eval", str(model), "--benchmarks", "aime24"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "aime24: no local folder is set and the hub did not provide HuggingFaceH4/aime_2024"
    )
    assert "--data-dir DIR" in line and "data.dir" in line and "$M2PO_BENCHMARKS=DIR" in line
    assert "aime24.jsonl" in line


def test_the_benchmark_folder_can_be_set_once(model, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    expected = f"{empty}/aime24.jsonl: benchmark file not found (folder from $M2PO_BENCHMARKS)"
    _one_line(_eval(str(model), *CHEAP, env={"M2PO_BENCHMARKS": str(empty)}), expected)
    other = tmp_path / "other"
    other.mkdir()
    result = _eval(str(model), *CHEAP, "--set", f'data.dir="{other}"', env={"M2PO_BENCHMARKS": str(empty)})
    _one_line(result, f"{other}/aime24.jsonl: benchmark file not found (folder from data.dir)")
    result = _eval(str(model), *CHEAP, "--data-dir", str(empty), "--set", f'data.dir="{other}"')
    _one_line(result, f"{empty}/aime24.jsonl: benchmark file not found (folder from --data-dir)")


def _cache_every_sample(model: Path, out: Path) -> Path:
    """Write graded samples for every job `CHEAP` asks of `model`, as a finished eval leaves them."""
    cfg = load_eval_config(SHORT, ["protocol.samples=1"])
    specs = load_benchmarks(["aime24"])
    problems = {"aime24": load_problems(specs[0], BENCHMARKS)}
    (target,) = resolve_targets([str(model)], all_checkpoints=False)
    target_dir = out / f"{slug(target.label)}-{target.identity()[:8]}"
    target_dir.mkdir(parents=True)
    (plan,) = plan_target(
        target,
        target.model_dir(),
        specs,
        problems,
        cfg,
        target_dir,
        1,
        target_episodes(cfg, target.model_dir(), target.path),
    )
    records = [
        {
            "problem_id": job.problem.id,
            "sample": i,
            "answer": "7",
            "correct": False,
            "tokens": 3,
            "finished": True,
        }
        for job in plan.jobs
        for i in job.samples
    ]
    plan.cache.write_text("".join(json.dumps(r) + "\n" for r in records))
    return plan.cache


@needs_data
def test_a_target_failing_late_leaves_the_others_results_written(model, tmp_path):
    out = tmp_path / "out"
    good = _cache_every_sample(model, out)
    damaged_model = tmp_path / "tiny-2"
    shutil.copytree(model, damaged_model)
    damaged = _cache_every_sample(damaged_model, out)
    damaged.write_text("{not json\n" + damaged.read_text())
    before = {p: p.read_bytes() for p in (good, damaged)}

    args = [str(model), str(damaged_model), *CHEAP, "--protocol", str(SHORT), "--data-dir", str(BENCHMARKS)]
    result = _eval(*args, "--out", str(out))
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1].startswith(f"{damaged}: line 1 is not a sample record")
    assert result.output.count("is not a sample record") == 1 and "Traceback" not in result.output
    assert "│ tiny " in result.stdout, "the table of the targets evaluated goes to stdout"
    assert {p: p.read_bytes() for p in before} == before, "a results file was changed"
    results = json.loads((out / "results.json").read_text())
    assert [t["label"] for t in results["targets"]] == ["tiny"]
    assert results["targets"][0]["benchmarks"]["aime24"]["evaluated"] == 1
    assert "| tiny |" in (out / "results.md").read_text()


@needs_data
def test_a_hub_id_the_hub_cannot_provide_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "m2po_cli",
        "eval",
        "nobody/no-such-model",
        *CHEAP,
        "--data-dir",
        str(BENCHMARKS),
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("nobody/no-such-model: not a local directory, and the hub did not provide it"), (
        last
    )
