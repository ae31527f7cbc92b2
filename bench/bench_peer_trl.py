"""Side by side with TRL's `GRPOTrainer`: the same GRPO work, tool against tool, seeds alternated.

The work (both tools): SmolLM2-135M-Instruct (`builtin:smollm2-135m-instruct`), the prompts of
`recipes/smollm2-135m-cpu-grpo.toml` in m2po's order (`PromptBatches`; TRL is given the same user
turns, and the token ids it trained on are checked equal to m2po's), 4 prompts x 8 samples a step,
32 new tokens at temperature 0.7 with no top-k/top-p, the project's grader as the reward, one
optimizer update a step (lr 4e-5 constant, AdamW betas, epsilon and weight decay of the recipe,
gradient clip 1.0), GRPO advantages with the group std, PPO clip 0.2, the token mean over the batch,
fp32, no KL. m2po runs that recipe at s = 0 (on-policy, as TRL), and its default M2PO recipe
(`smollm2-135m-cpu.toml`, s = 2) for speed. TRL runs in a venv of its own (`scripts/trl_venv.sh`)
with the project's torch and transformers, generating with HF `generate`.

    bash scripts/trl_venv.sh                    # once
    .venv/bin/python bench/bench_peer_trl.py [--seeds 4] [--first-seed 0] [--m2po-seeds 2] [--steps 8]

Prints per tool, as mean ± standard error over seeds: seconds per step (all steps but each run's
first, which warms the kernels up), generated tokens per second of generation, trained tokens per
second of the update, the peak memory of the run's process tree (PSS), and the mean reward of the
first and the last fifth of the steps; then the ratios m2po / TRL, and the last fifth's reward seed by
seed with the difference of the tools' means, its 95% bootstrap interval and a permutation test's p.

What one step costs: 32 rows of ~55 prompt + up to 32 response tokens through a 134.5M-parameter
model, ~2.6k tokens x ~0.27 GFLOP forward, about 2.1 TFLOP for the update's forward and backward as
TRL runs it; m2po computes each group's prompt once (`train.share_prompts`), ~850 tokens, about
0.7 TFLOP. Generation is ~500 tokens. m2po adds a pass over 4 rows of one prompt group at the
behaviour version (metrics, ~120 tokens) and a 0.54 GB weight push into the engine. "update tok/s"
counts the rows' tokens for both tools.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "recipes" / "smollm2-135m-cpu-grpo.toml"
M2PO = ROOT / "recipes" / "smollm2-135m-cpu.toml"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
M2PO_GRPO, M2PO_DEFAULT, TRL_GRPO = "m2po GRPO s=0", "m2po M2PO s=2 (default)", "TRL GRPO"


def work_for(recipe_path: Path, steps: int) -> dict:
    """The model folder, each step's prompts (user turn, m2po's token ids, answer) and the settings."""
    from m2po_cli.config import load_recipe
    from m2po_cli.data import PromptBatches, load_problems
    from m2po_cli.models import load_tokenizer, resolve_model

    recipe = load_recipe(str(recipe_path), [f"run.steps={steps}", "staleness.s=0"])
    model_dir = resolve_model(recipe.model.path)
    batches = PromptBatches(
        load_problems(recipe.data), load_tokenizer(model_dir), recipe.data, recipe.rollout.prompts_per_step
    )
    template = recipe.data.prompt_template
    steps_ = [
        [
            {
                "content": template.format(problem=p.problem.problem),
                "token_ids": p.token_ids,
                "answer": p.problem.answer,
            }
            for p in next(batches)
        ]
        for _ in range(steps)
    ]
    r, o, loss = recipe.rollout, recipe.optim, recipe.loss
    assert loss.type == "grpo" and loss.eps_low == loss.eps_high and r.top_p == 1.0
    assert recipe.algorithm.normalize_std and recipe.updates_per_step == 1
    settings = {
        "prompts": r.prompts_per_step,
        "n": r.n,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "lr": o.lr,
        "weight_decay": o.weight_decay,
        "betas": list(o.betas),
        "adam_eps": o.eps,
        "grad_clip": o.grad_clip,
        "clip": loss.eps_low,
    }
    return {"model_dir": str(model_dir), "steps": steps_, "settings": settings}


class PeakMemory:
    """The largest PSS of a process and its descendants, sampled every `every_s` seconds."""

    def __init__(self, pid: int, every_s: float = 0.5):
        self.root, self.every_s, self.peak = psutil.Process(pid), every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            total = 0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**30


def run_tracked(cmd: list[str], log: Path) -> float:
    """Run `cmd` to its end (output to `log`); the peak memory of its process tree in GiB."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ)
        peak = PeakMemory(proc.pid)
        rc = proc.wait()
        gib = peak.stop()
    if rc:
        sys.exit(f"{cmd[0]} ... exited with {rc}; see {log}:\n" + log.read_text()[-3000:])
    return gib


def run_m2po(recipe: Path, steps: int, seed: int, tmp: Path, staleness: int | None) -> dict:
    out = tmp / f"m2po-{recipe.stem}-{seed}"
    sets = [f'run.output_dir="{out}"', 'run.name="bench"', f"run.steps={steps}", f"run.seed={seed}"]
    sets += ['logging.console="plain"', f"checkpoint.every={steps}"]
    sets += [] if staleness is None else [f"staleness.s={staleness}"]
    cmd = [sys.executable, "-m", "m2po_cli", "train", str(recipe), *[a for s in sets for a in ("--set", s)]]
    gib = run_tracked(cmd, tmp / f"{out.name}.log")
    metrics = [json.loads(line) for line in (out / "bench" / "metrics.jsonl").read_text().splitlines()]
    steps_ = [
        {
            "step_s": m["time/step"],
            "generate_s": m["time/generate"],
            "update_s": m["time/update"],
            "generated_tokens": m["rollout/generated_tokens"],
            "trained_tokens": m["perf/learner_tokens_per_s"] * m["time/update"],
            "reward": m["rollout/reward_mean"],
        }
        for m in metrics
    ]
    return {"steps": steps_, "peak_gib": gib}


def run_trl(work_path: Path, work: dict, seed: int, tmp: Path) -> dict:
    out = tmp / f"trl-{seed}.json"
    cmd = [str(TRL_PYTHON), str(ROOT / "bench" / "peer_trl_worker.py"), str(work_path), str(seed), str(out)]
    gib = run_tracked(cmd, tmp / f"trl-{seed}.log")
    result = json.loads(out.read_text())
    for i, (batch, step) in enumerate(zip(result["steps"], work["steps"], strict=True)):
        if batch["prompt_ids"] != [p["token_ids"] for p in step]:
            sys.exit(f"step {i}: TRL trained on other prompt token ids than m2po")
    steps_ = [{**s, "update_s": s["step_s"] - s["generate_s"] - s["reward_s"]} for s in result["steps"]]
    return {"steps": steps_, "peak_gib": gib}


def summary(run: dict) -> dict[str, float]:
    """One run's numbers: steady-state speed (all steps but the first) and the reward fifths."""
    steps, steady = run["steps"], run["steps"][1:]
    k = max(1, round(len(steps) / 5))
    return {
        "s/step": statistics.mean(s["step_s"] for s in steady),
        "gen tok/s": sum(s["generated_tokens"] for s in steady) / sum(s["generate_s"] for s in steady),
        "update tok/s": sum(s["trained_tokens"] for s in steady) / sum(s["update_s"] for s in steady),
        "peak GiB": run["peak_gib"],
        "reward first 1/5": statistics.mean(s["reward"] for s in steps[:k]),
        "reward last 1/5": statistics.mean(s["reward"] for s in steps[-k:]),
    }


def mean_se(values: list[float]) -> tuple[float, float]:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.mean(values), se


EXACT_SPLITS = 200_000


def difference(a: list[float], b: list[float]) -> dict[str, float]:
    """mean(a) - mean(b) with its 95% bootstrap interval (BCa, 10,000 resamples of each side) and
    the two-sided p-value of a permutation test of equal means (exact, every split of the pooled
    values, up to `EXACT_SPLITS` splits: 10 seeds a side; beyond, that many random ones)."""
    import numpy as np
    from scipy import stats

    def diff(x, y, axis=-1):
        return np.mean(x, axis=axis) - np.mean(y, axis=axis)

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)

    def distance(x, y, axis=-1):  # two-sided: a split counts if its means are as far apart
        return np.abs(diff(x, y, axis))

    exact = math.comb(len(x) + len(y), len(x)) <= EXACT_SPLITS
    test = stats.permutation_test(
        (x, y),
        distance,
        permutation_type="independent",
        n_resamples=np.inf if exact else EXACT_SPLITS,
        vectorized=True,
        alternative="greater",
        batch=10_000,  # splits evaluated at a time: bounded memory
        rng=np.random.default_rng(0),
    )
    interval = stats.bootstrap(
        (x, y), diff, n_resamples=10_000, batch=1_000, vectorized=True, rng=np.random.default_rng(0)
    )
    low, high = interval.confidence_interval
    return {"difference": float(diff(x, y)), "low": float(low), "high": float(high), "p": float(test.pvalue)}


def report(results: dict[str, list[dict]]) -> None:
    names = list(next(iter(results.values()))[0])
    print("| tool | seeds | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    means = {}
    for tool, runs in results.items():
        cells = []
        for name in names:
            m, se = mean_se([r[name] for r in runs])
            means[tool, name] = m
            cells.append(f"{m:.3f} ± {se:.3f}" if "reward" in name else f"{m:.2f} ± {se:.2f}")
        print(f"| {tool} | {len(runs)} | " + " | ".join(cells) + " |")
    print()
    for tool in results:
        if tool == TRL_GRPO:
            continue
        ratios = ", ".join(
            f"{name} {means[tool, name] / means[TRL_GRPO, name]:.2f}x"
            for name in names
            if "reward" not in name
        )
        print(f"{tool} / TRL GRPO: {ratios}")
    mine, theirs = ([r["reward last 1/5"] for r in results[t]] for t in (M2PO_GRPO, TRL_GRPO))
    print("last-fifth reward by seed, m2po GRPO: " + " ".join(f"{v:.3f}" for v in mine))
    print("last-fifth reward by seed, TRL GRPO:  " + " ".join(f"{v:.3f}" for v in theirs))
    if len(mine) > 1 and len(theirs) > 1:
        d = difference(mine, theirs)
        print(
            f"last-fifth reward, m2po GRPO - TRL: {d['difference']:+.3f}, 95% interval [{d['low']:+.3f}, "
            f"{d['high']:+.3f}] (bootstrap), permutation p = {d['p']:.3f} ({len(mine)} against {len(theirs)} seeds)"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4, help="seeds of m2po GRPO and of TRL, alternated")
    ap.add_argument("--first-seed", type=int, default=0, help="the seeds are first-seed, first-seed + 1, ...")
    ap.add_argument("--m2po-seeds", type=int, default=2, help="seeds of the default M2PO recipe (speed)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--keep", type=Path, help="keep the runs' logs and metrics in this folder")
    args = ap.parse_args()
    if not TRL_PYTHON.exists():
        sys.exit(f"no TRL venv at {TRL_PYTHON.parent.parent}; run: bash scripts/trl_venv.sh")
    work = work_for(GRPO, args.steps)
    results: dict[str, list[dict]] = {M2PO_GRPO: [], M2PO_DEFAULT: [], TRL_GRPO: []}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as tmp_name:
        tmp = args.keep or Path(tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        work_path = tmp / "work.json"
        work_path.write_text(json.dumps(work))
        for k, seed in enumerate(range(args.first_seed, args.first_seed + args.seeds)):
            arms = [M2PO_GRPO, TRL_GRPO] if k % 2 == 0 else [TRL_GRPO, M2PO_GRPO]
            arms += [M2PO_DEFAULT] if k < args.m2po_seeds else []
            for arm in arms:
                if arm == TRL_GRPO:
                    run = run_trl(work_path, work, seed, tmp)
                elif arm == M2PO_GRPO:
                    run = run_m2po(GRPO, args.steps, seed, tmp, staleness=0)
                else:
                    run = run_m2po(M2PO, args.steps, seed, tmp, staleness=None)
                results[arm].append(summary(run))
                print(f"seed {seed} {arm}: {json.dumps(results[arm][-1])}", flush=True)
    print(
        f"\n{args.steps} steps a run, {time.perf_counter() - t_start:.0f} s in all; load average "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    report({k: v for k, v in results.items() if v})
    return 0


if __name__ == "__main__":
    sys.exit(main())
