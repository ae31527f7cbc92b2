"""`m2po eval`: benchmark definitions, pass@k, checkpoint resolution and conversion, grading of
adversarial outputs through the eval path, caching and resume, and the CLI end to end on vLLM."""

from __future__ import annotations

import itertools
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from m2po_cli import checkpoint
from m2po_cli.cli import main
from m2po_cli.config import PAPER_PROMPT_TEMPLATE, ConfigError
from m2po_cli.config.tables import to_toml
from m2po_cli.eval.config import EVALS_DIR, load_benchmarks, load_eval_config
from m2po_cli.eval.data import BenchPlan, EvalProblem, Job, load_problems
from m2po_cli.eval.evaluate import grade_and_append, plan_target, read_records, target_episodes
from m2po_cli.eval.report import pass_at_k, pass_ks
from m2po_cli.eval.targets import Target, TargetError, export_step, resolve_targets
from m2po_cli.grader import Grader
from m2po_cli.models import resolve_model
from tests.conftest import recipe_for
from tests.tolerances import forward_atol

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT.parent / "shared" / "benchmarks"
COUNTS = {
    "aime24": 30,
    "aime25": 30,
    "amc23": 40,
    "amc24": 45,
    "math500": 500,
    "gaokao2023en": 385,
    "minerva": 272,
    "olympiadbench": 675,
}
needs_data = pytest.mark.skipif(not BENCHMARKS.is_dir(), reason=f"no benchmark files in {BENCHMARKS}")


# --- benchmark definitions and protocol files ----------------------------------------------------


def test_the_eight_benchmarks_in_table_order():
    specs = load_benchmarks()
    assert {s.name: s.num_problems for s in specs} == COUNTS
    assert list(COUNTS) == [s.name for s in specs]
    assert {s.name: s.samples for s in specs} == {n: 16 if n.startswith("aime") else 4 for n in COUNTS}
    assert all(s.hub is not None for s in specs)


@pytest.mark.parametrize("path", sorted(EVALS_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_every_evals_toml_loads_through_its_typed_loader(path):
    if path.name == "benchmarks.toml":
        assert load_benchmarks(path=path)
    else:
        load_eval_config(path)


@needs_data
@pytest.mark.parametrize("name", list(COUNTS))
def test_local_files_exist_with_the_benchmark_counts(name):
    (spec,) = load_benchmarks([name])
    problems = load_problems(spec, BENCHMARKS)
    assert len(problems) == spec.num_problems == COUNTS[name]


def test_prompts_are_the_papers_with_the_gaokao_quirk():
    specs = {s.name: s for s in load_benchmarks()}
    gaokao = specs.pop("gaokao2023en").prompt_template.format(problem="P")
    assert all(s.prompt_template == PAPER_PROMPT_TEMPLATE for s in specs.values())
    assert r"Return the final answer in \boxed{{}} tags, for example \boxed{{1}}." in gaokao
    assert gaokao.endswith("step by step.")  # no trailing space
    assert PAPER_PROMPT_TEMPLATE.format(problem="P").endswith(r"\boxed{1}. Let's solve this step by step. ")


def test_protocol_defaults_are_the_papers():
    p = load_eval_config().protocol
    assert (p.temperature, p.top_p, p.max_new_tokens, p.prompt_template, p.samples) == (
        1.0,
        0.7,
        2560,
        None,
        None,
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["protocol.top_p=1.5"], "protocol.top_p: must be <= 1.0 (got 1.5)"),
        (
            ["protocol.tmperature=1"],
            "protocol.tmperature: unknown key; expected one of prompt_template, temperature, top_p, "
            "max_new_tokens, max_prompt_tokens, samples, seed",
        ),
        (["data.dri=1"], "data.dri: unknown key; expected one of dir"),
        (['protocol.prompt_template="no slot"'], "protocol.prompt_template: must contain {problem}"),
        (["protocol.samples=0"], "protocol.samples: must be >= 1 (got 0)"),
    ],
)
def test_eval_config_errors_name_the_key(overrides, message):
    """The loader recipes use: the same one-line errors for eval configs."""
    with pytest.raises(ConfigError) as e:
        load_eval_config(None, overrides)
    assert str(e.value) == f"eval defaults (--set): {message}"


# --- pass@k --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 5, 16])
def test_pass_at_k_equals_enumeration_of_all_k_subsets(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_reported_ks():
    assert pass_ks(16) == [1, 2, 4, 8, 16]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(5) == [1, 2, 4, 5]
    assert pass_ks(1) == [1]


# --- CLI errors: one line, exit code 2, nothing heavy started -------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["does/not/exist"], "does/not/exist: checkpoint not found"),
        (
            [str(ROOT), "--benchmarks", "aime24,nope"],
            "--benchmarks: unknown benchmark 'nope'; choose from aime24",
        ),
        (
            [str(ROOT)],
            "neither an HF model directory (config.json), a PEFT adapter (adapter_config.json), a run "
            "directory (config.toml) nor a saved step",
        ),
        (["builtin:tiny-qwen3", "--data-dir", str(ROOT)], f"{ROOT}/aime24.jsonl: benchmark file not found"),
        (["builtin:tiny-qwen3", "--set", "grader.workers=0"], "grader.workers: must be >= 1 (got 0)"),
    ],
)
def test_cli_errors_are_one_line_with_exit_code_2(args, message):
    result = CliRunner().invoke(main, ["eval", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


# --- a run directory, built from the learner (the layout `m2po train` writes) ----------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """runs/tiny with checkpoints/step-000001 and step-000002 (distinct weights) and export/ (= step 2).

    Made by the learner, `checkpoint.save` and `export_hf`, as `m2po train` makes them, but without
    rollouts: seconds instead of a minute.
    """
    from m2po_cli.learner.policy import Learner

    tmp = tmp_path_factory.mktemp("eval")
    base = resolve_model("builtin:tiny-qwen3")  # from the user's cache: built once
    recipe = recipe_for(tmp, 'run.name="tiny"', f'model.path="{base}"')
    run = tmp / "tiny"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(recipe))
    learner = Learner(base, recipe)
    gen = torch.Generator().manual_seed(0)
    for step in (1, 2):
        with torch.no_grad():
            for p in learner.model.parameters():
                local = p.to_local()  # one rank: the whole tensor
                local.add_(0.2 * torch.randn(local.shape, generator=gen))
        checkpoint.save(run, step, learner, {"step": step, "mode": "colocated"}, keep=5)
    learner.export_hf(run / "export", base)
    return run


@pytest.fixture
def export_cache(run_dir, monkeypatch):
    """Conversions of saved steps go to the test's `$M2PO_CACHE`, not the user's."""
    monkeypatch.setenv("M2PO_CACHE", str(run_dir.parent / "cache"))


def test_resolution_of_each_kind_of_checkpoint(run_dir):
    tiny = resolve_model("builtin:tiny-qwen3")
    steps = [run_dir / "checkpoints" / f"step-00000{i}" for i in (1, 2)]
    (export,) = resolve_targets([str(run_dir)], all_checkpoints=False)
    assert (export.kind, export.label, export.path) == ("model", "tiny/export", str(run_dir / "export"))
    every = resolve_targets([str(run_dir)], all_checkpoints=True)
    assert [(t.kind, t.label, t.path) for t in every] == [("step", f"tiny/{p.name}", str(p)) for p in steps]
    (one,) = resolve_targets([str(steps[0])], all_checkpoints=False)
    assert one == every[0]
    (hf,) = resolve_targets([str(tiny)], all_checkpoints=False)
    assert (hf.kind, hf.model_dir()) == ("model", tiny)
    (builtin,) = resolve_targets(["builtin:tiny-qwen3"], all_checkpoints=False)
    assert builtin.kind == "hub"
    assert builtin.identity() == hf.identity(), "the same files: the same checkpoint"
    assert len({t.identity() for t in [export, *every, hf]}) == 4


def test_unusable_checkpoints_are_errors(run_dir, tmp_path):
    incomplete = tmp_path / "run" / "checkpoints" / "step-000003"
    incomplete.mkdir(parents=True)
    (tmp_path / "run" / "config.toml").write_text((run_dir / "config.toml").read_text())
    with pytest.raises(TargetError, match="incomplete checkpoint"):
        resolve_targets([str(incomplete)], all_checkpoints=False)
    with pytest.raises(TargetError, match="the run has no export/"):
        resolve_targets([str(tmp_path / "run")], all_checkpoints=False)
    with pytest.raises(TargetError, match="no complete checkpoint"):
        resolve_targets([str(tmp_path / "run")], all_checkpoints=True)


def test_a_step_converts_once_into_the_cache_and_leaves_the_run_alone(run_dir, export_cache):
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    step1, step2 = (run_dir / "checkpoints" / f"step-00000{i}" for i in (1, 2))
    out2 = export_step(step2)
    assert out2.parent.name == "exports" and run_dir not in out2.parents
    converted, exported = (load_file(str(d / "model.safetensors")) for d in (out2, run_dir / "export"))
    assert converted.keys() == exported.keys()
    assert all(torch.equal(converted[k], exported[k]) for k in converted), (
        "step 2 should equal the final export"
    )
    first = load_file(str(export_step(step1) / "model.safetensors"))
    assert not all(torch.equal(first[k], converted[k]) for k in first)
    mtime = (out2 / "model.safetensors").stat().st_mtime_ns
    assert export_step(step2) == out2 and (out2 / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before


# --- planning, grading and the cache (no engine) --------------------------------------------------


def test_prompts_that_do_not_fit_are_skipped_and_long_responses_clamped(tmp_path):
    # The tiny builtin (one token per character) with a context of 256 positions.
    tiny = tmp_path / "tiny-256"
    shutil.copytree(resolve_model("builtin:tiny-qwen3"), tiny)
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    problems = {
        "aime24": [
            EvalProblem("short", "1+1", "2"),
            EvalProblem("mid", "x" * 200, "1"),
            EvalProblem("long", "x" * 300, "1"),
        ]
    }
    (spec,) = load_benchmarks(["aime24"])
    cfg = load_eval_config(None, ['protocol.prompt_template="{problem}"', "protocol.max_new_tokens=64"])
    (plan,) = plan_target(
        Target("tiny", "model", str(tiny)),
        tiny,
        [spec],
        problems,
        cfg,
        tmp_path,
        None,
        target_episodes(cfg, tiny, "tiny"),
    )
    assert plan.skipped == ["long"] and plan.clamped == 1
    short, mid = plan.jobs
    assert short.max_tokens == 64 and short.samples == list(range(16))
    assert len(mid.prompt_ids) + mid.max_tokens == 256


@dataclass
class FakeCompletion:
    """What `grade_and_append` reads of a vLLM CompletionOutput."""

    text: str
    token_ids: list[int]
    finish_reason: str = "stop"


ADVERSARIAL = {
    "no box": ("the answer is 4", False),
    "right": (r"so \boxed{4}", True),
    "nested": (r"\boxed{\frac{\sqrt{16}}{1}}", True),
    "unbalanced": (r"\boxed{4} and then \boxed{5", True),
    "stray closers": (r"}}}} \boxed{{4}} }}", True),
    "100k characters": ("x" * 100_000 + r"\boxed{" + "9" * 100_000 + "}", False),
    "100k braces": ("{" * 100_000, False),
    "unicode": ("答案 \\boxed{４} ✓ \U0001f600", False),
    "sympy slow": (r"\boxed{9^{9^{9^{9}}}}", False),
    "factorial": (r"\boxed{100000000!}", False),
    "lone backslash": ("\\boxed{4}\\", True),
}


def test_adversarial_outputs_never_crash_or_hang_the_eval_path(tmp_path):
    (spec,) = load_benchmarks(["amc23"])
    plan = BenchPlan(spec, [], 1, tmp_path / "amc23.jsonl")
    finished = [
        (Job("amc23", EvalProblem(name, "p", "4"), [1], [0], 8), 0, FakeCompletion(text, [1] * 7))
        for name, (text, _) in ADVERSARIAL.items()
    ]
    graded = []
    start = time.monotonic()
    with Grader(num_workers=2, timeout_s=1.0) as grader:
        grade_and_append(grader, finished, {"amc23": plan}, graded.append)
    assert time.monotonic() - start < 60  # two 1 s time-outs, plus the workers' start-up
    assert graded == [len(ADVERSARIAL)]
    records = read_records(plan.cache)
    assert {pid: r["correct"] for (pid, _), r in records.items()} == {
        n: ok for n, (_, ok) in ADVERSARIAL.items()
    }
    assert records[("100k characters", 0)]["answer"] == "9" * 100_000
    assert records[("no box", 0)]["answer"] is None
    assert all(r["tokens"] == 7 and r["finished"] for r in records.values())


def test_a_line_torn_by_a_kill_is_dropped(tmp_path):
    path = tmp_path / "b.jsonl"
    good = {"problem_id": "a", "sample": 0, "answer": "1", "correct": True, "tokens": 3, "finished": True}
    path.write_text(json.dumps(good) + "\n" + '{"problem_id": "a", "sam')
    assert read_records(path) == {("a", 0): good}
    assert path.read_text() == json.dumps(good) + "\n"


# --- end to end on vLLM ---------------------------------------------------------------------------


def _eval(out: Path, *args: str):
    cmd = ["eval", *args, "--protocol", str(EVALS_DIR / "short-context.toml"), "--data-dir", str(BENCHMARKS)]
    result = CliRunner().invoke(main, [*cmd, "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def evaluated(run_dir, tmp_path_factory):
    """One engine for three checkpoints of one architecture: the export, then each step reloaded in."""
    out = tmp_path_factory.mktemp("eval-out")
    steps = [str(run_dir / "checkpoints" / f"step-00000{i}") for i in (1, 2)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("M2PO_CACHE", str(run_dir.parent / "cache"))
        start = time.monotonic()
        output = _eval(out, str(run_dir), *steps, "--limit", "4")
        seconds = time.monotonic() - start
    print(f"eval of 3 checkpoints x 8 benchmarks, --limit 4: {seconds:.0f} s")
    return out, output


@pytest.mark.slow
@needs_data
def test_eval_cli_end_to_end(evaluated):
    out, output = evaluated
    results = json.loads((out / "results.json").read_text())
    assert [t["label"] for t in results["targets"]] == ["tiny/export", "tiny/step-000001", "tiny/step-000002"]
    assert results["limit"] == 4 and results["config"]["protocol"]["top_p"] == 0.7
    for target in results["targets"]:
        assert list(target["benchmarks"]) == list(COUNTS)
        generated = 0
        for name, b in target["benchmarks"].items():
            assert b["problems"] == 4 and b["evaluated"] + b["skipped"] == 4
            assert b["samples"] == (16 if name.startswith("aime") else 4)
            if b["evaluated"]:
                assert 0.0 <= b["avg@n"] <= 1.0 and list(b["pass@k"]) == [
                    str(k) for k in pass_ks(b["samples"])
                ]
                assert b["pass@k"]["1"] == pytest.approx(b["avg@n"])
            lines = (out / _target_dir(out, target) / b["samples_file"]).read_text().splitlines()
            assert len(lines) == b["evaluated"] * b["samples"]
            generated += len(lines)
            for line in lines:
                assert set(json.loads(line)) == {
                    "problem_id",
                    "sample",
                    "answer",
                    "correct",
                    "tokens",
                    "finished",
                }
        assert generated > 0, "every prompt was skipped: the test no longer exercises generation"
    assert "tiny/step-000002" in output and "Avg." in output
    assert (out / "results.md").read_text().startswith("| checkpoint | AIME24 | AIME25 | AMC23 |")


def _target_dir(out: Path, target: dict) -> Path:
    (d,) = [
        p
        for p in out.iterdir()
        if p.is_dir() and json.loads((p / "target.json").read_text())["path"] == target["path"]
    ]
    return d


@pytest.mark.slow
@needs_data
def test_rerun_generates_nothing_and_all_checkpoints_hits_the_cache(evaluated, run_dir):
    out, _ = evaluated
    files = {p: p.read_text() for p in out.rglob("*.jsonl")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("M2PO_CACHE", str(run_dir.parent / "cache"))
        output = _eval(out, str(run_dir), "--all-checkpoints", "--limit", "4")
    assert output.count("0 samples to generate") == 2
    assert {p: p.read_text() for p in out.rglob("*.jsonl")} == files
    results = json.loads((out / "results.json").read_text())
    assert [t["label"] for t in results["targets"]] == ["tiny/step-000001", "tiny/step-000002"]


@pytest.mark.slow
def test_weights_reloaded_into_the_engine_are_the_ones_used(run_dir):
    """The engine kept across checkpoints samples from the new weights: greedy equals transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from m2po_cli.eval.evaluate import EvalEngine

    base, export = resolve_model("builtin:tiny-qwen3"), run_dir / "export"
    ids = AutoTokenizer.from_pretrained(str(base)).apply_chat_template(
        [{"role": "user", "content": "3+4"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    engine = EvalEngine(load_eval_config(EVALS_DIR / "short-context.toml").engine)
    try:
        outputs = []
        for model_dir in (base, export):
            engine.load(model_dir, 256)
            (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)
            outputs.append(list(out.outputs[0].token_ids))
        llm = engine.llm
        engine.load(base, 256)
        assert engine.llm is llm, "same architecture: the engine should have been kept"
    finally:
        engine.close()
    for model_dir, tokens in zip((base, export), outputs, strict=True):
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        assert len(tokens) > 0, model_dir
        assert_same_greedy(hf, ids, tokens, model_dir)
    assert outputs[0] != outputs[1]


def assert_same_greedy(hf, ids: list[int], tokens: list[int], where) -> None:
    """vLLM's greedy tokens are HF's, up to the first step whose two best logits are closer than
    two float32 implementations may differ (`forward_atol`, either side): there vLLM's token must be
    one of the near-tied best, and after it the two continuations may part."""
    out = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=len(tokens),
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    expected = out.sequences[0, len(ids) :].tolist()
    for t, (logits_V, token) in enumerate(zip(out.logits, tokens, strict=False)):
        logits_V = logits_V[0]
        tie = 2 * forward_atol(logits_V, hf.config.num_hidden_layers)
        if float(logits_V.max() - logits_V.topk(2).values[1]) > tie:
            assert token == expected[t], f"{where}: step {t}"
            continue
        assert float(logits_V.max() - logits_V[token]) <= tie, (
            f"{where}: step {t}, not a near-tied best token"
        )
        return


def test_benchmark_file_errors_name_the_item(tmp_path):
    text = (EVALS_DIR / "benchmarks.toml").read_text()
    bad = tmp_path / "benchmarks.toml"
    bad.write_text(text.replace("\n[benchmark.hub]\n", "\n[benchmark.hub]\nsplt = 1\n", 1))
    with pytest.raises(
        ConfigError, match=r"benchmarks\.toml: benchmark\.0\.hub\.splt: unknown key; expected one of path"
    ):
        load_benchmarks(path=bad)
