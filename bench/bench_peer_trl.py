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
    .venv/bin/python bench/bench_peer_trl.py [--seeds 4] [--first-seed 0] [--m2po-seeds 0] [--steps 8]
        [--checkpointing off|on ...] [--cores 1]

Both tools run the same way: on the cores `--cores` names (default: the machine's last; the bench
itself keeps to the others, so nothing else shares the tools' cores), with one compute thread bound
to each of them (m2po through vLLM's CPU binding, which its learner shares; TRL through OpenMP's
places), with activation checkpointing of the update off and then on (m2po's
`train.activation_checkpointing = "full"`, TRL's `gradient_checkpointing`), each setting's runs
alternating the tools. Nothing samples a run while it runs: its peak memory is the kernel's
high-water mark, read when it ends.

Prints per arm and setting, as mean ± standard error over seeds: seconds per step (all steps but
each run's first, which warms the kernels up) and of its parts (generation, the reward, and the
update, which for both tools is the rest of the step), generated tokens per second of generation,
trained tokens per second of the update, the peak resident memory of the run's largest process,
the share of the tools' cores that anything else used while it ran and the share the hypervisor
took (both near 0 on a quiet machine), and the mean reward of the first and the last fifth of the
steps; then the ratios m2po / TRL, and the last fifth's reward seed by seed with the difference of
the tools' means, its 95% bootstrap interval and a permutation test's p.

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
import time
from pathlib import Path

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


def cpu_ticks(cores: set[int]) -> tuple[int, int]:
    """The busy and the steal clock ticks of `cores` since boot (/proc/stat)."""
    busy = steal = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            user, nice, system, _idle, _iowait, irq, softirq, steal_ = map(int, fields[:8])
            busy += user + nice + system + irq + softirq
            steal += steal_
    return busy, steal


def pinned_env(tool: str, cores: set[int]) -> dict[str, str]:
    """Each tool's compute threads: one per core of `cores`, thread i bound to core i. m2po binds
    through vLLM's CPU binding (the learner shares the engine's process and its threads); TRL through
    OpenMP's places. Both processes, and all they start, may run on `cores` only (`run_measured`).
    Both allocate as m2po's package asks torch to: blocks of 2 MiB and more on huge pages."""
    listed = ",".join(map(str, sorted(cores)))
    env = dict(os.environ, OMP_NUM_THREADS=str(len(cores)), MKL_NUM_THREADS=str(len(cores)))
    env["THP_MEM_ALLOC_ENABLE"] = "1"
    if tool == "m2po":
        env |= {"VLLM_CPU_OMP_THREADS_BIND": listed, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    else:
        env |= {"OMP_PROC_BIND": "close", "OMP_PLACES": ",".join(f"{{{c}}}" for c in sorted(cores))}
    return env


# Starts the command from a bare interpreter and reports the command's own high-water mark. A process
# started straight from the bench would carry the bench's: the kernel's mark of a process is the
# largest resident set of every memory image it has had, the parent's copy before exec included.
_LAUNCH = """import os, sys
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(cmd: list[str], log: Path, env: dict[str, str], cores: set[int]) -> dict[str, float]:
    """Run `cmd` on `cores` to its end (output to `log`). Its peak memory is the kernel's high-water
    mark (`wait4`: the largest resident set of the process and of every descendant it waited for,
    GiB); nothing samples it while it runs. `other_cpu` is the share of `cores`' time that went to
    anything but the run, `steal` the share the hypervisor took: both near 0 on a quiet machine."""
    hz = os.sysconf("SC_CLK_TCK")
    peak = log.with_suffix(".peak")
    with log.open("w") as out:
        busy0, steal0 = cpu_ticks(cores)
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _LAUNCH, str(peak), *cmd],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)  # the launcher's, its child's CPU time included
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        busy1, steal1 = cpu_ticks(cores)
    if proc.returncode:
        sys.exit(f"{cmd[0]} ... exited with {proc.returncode}; see {log}:\n" + log.read_text()[-3000:])
    capacity = wall * len(cores)
    return {
        "peak_gib": int(peak.read_text()) / 2**20,  # KiB on Linux
        "other_cpu": max(0.0, (busy1 - busy0) / hz - usage.ru_utime - usage.ru_stime) / capacity,
        "steal": (steal1 - steal0) / hz / capacity,
    }


def run_m2po(
    recipe: Path,
    steps: int,
    seed: int,
    tmp: Path,
    staleness: int | None,
    checkpointing: bool,
    cores: set[int],
) -> dict:
    out = tmp / f"m2po-{recipe.stem}-{seed}-checkpointing-{'on' if checkpointing else 'off'}"
    sets = [f'run.output_dir="{out}"', 'run.name="bench"', f"run.steps={steps}", f"run.seed={seed}"]
    sets += ['logging.console="plain"', "checkpoint.every=0", "checkpoint.export_hf=false"]
    sets += [f'train.activation_checkpointing="{"full" if checkpointing else "none"}"']
    sets += [] if staleness is None else [f"staleness.s={staleness}"]
    cmd = [sys.executable, "-m", "m2po_cli", "train", str(recipe), *[a for s in sets for a in ("--set", s)]]
    measured = run_measured(cmd, tmp / f"{out.name}.log", pinned_env("m2po", cores), cores)
    metrics = [json.loads(line) for line in (out / "bench" / "metrics.jsonl").read_text().splitlines()]
    steps_ = [
        {
            "step_s": m["time/step"],
            "generate_s": m["time/generate"],
            "reward_s": m["time/grade"],
            "generated_tokens": m["rollout/generated_tokens"],
            "trained_tokens": m["perf/learner_tokens_per_s"] * m["time/update"],
            "reward": m["rollout/reward_mean"],
        }
        for m in metrics
    ]
    return {"steps": steps_, **measured}


def run_trl(work_path: Path, work: dict, seed: int, tmp: Path, checkpointing: bool, cores: set[int]) -> dict:
    setting = "on" if checkpointing else "off"
    out = tmp / f"trl-{seed}-checkpointing-{setting}.json"
    worker = ROOT / "bench" / "peer_trl_worker.py"
    cmd = [str(TRL_PYTHON), str(worker), str(work_path), str(seed), str(out), "--checkpointing", setting]
    measured = run_measured(cmd, out.with_suffix(".log"), pinned_env("trl", cores), cores)
    result = json.loads(out.read_text())
    assert result["gradient_checkpointing"] == checkpointing and result["torch_threads"] == len(cores), result
    for i, (batch, step) in enumerate(zip(result["steps"], work["steps"], strict=True)):
        if batch["prompt_ids"] != [p["token_ids"] for p in step]:
            sys.exit(f"step {i}: TRL trained on other prompt token ids than m2po")
    return {"steps": result["steps"], **measured}


def summary(run: dict) -> dict[str, float]:
    """One run's numbers: steady-state speed (all steps but the first) and the reward fifths. Both
    tools' update is counted alike: the step's time less generation and the reward, so it holds
    everything else a step does (m2po: the update, its metrics pass and the weight push; TRL: the
    update, its logprob pass and its bookkeeping)."""
    steps, steady = run["steps"], run["steps"][1:]
    k = max(1, round(len(steps) / 5))
    update_s = [s["step_s"] - s["generate_s"] - s["reward_s"] for s in steady]
    return {
        "s/step": statistics.mean(s["step_s"] for s in steady),
        "generate s": statistics.mean(s["generate_s"] for s in steady),
        "reward s": statistics.mean(s["reward_s"] for s in steady),
        "update s": statistics.mean(update_s),
        "gen tok/s": sum(s["generated_tokens"] for s in steady) / sum(s["generate_s"] for s in steady),
        "update tok/s": sum(s["trained_tokens"] for s in steady) / sum(update_s),
        "peak GiB": run["peak_gib"],
        "other CPU %": 100 * run["other_cpu"],
        "steal %": 100 * run["steal"],
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


def report(results: dict[str, list[dict]], trl: str, grpo: str) -> None:
    """A table of `results` (arm: one summary per seed), each arm's speed over `trl`'s, and the
    learning comparison of `grpo` against `trl`."""
    names = list(next(iter(results.values()))[0])
    print("| arm | seeds | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    means = {}
    for arm, runs in results.items():
        cells = []
        for name in names:
            m, se = mean_se([r[name] for r in runs])
            means[arm, name] = m
            cells.append(f"{m:.3f} ± {se:.3f}" if "reward" in name else f"{m:.2f} ± {se:.2f}")
        print(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    print()
    speed = [name for name in names if "reward" not in name and "%" not in name]
    for arm in results:
        if arm != trl:
            print(f"{arm} / {trl}: " + ", ".join(f"{n} {means[arm, n] / means[trl, n]:.2f}x" for n in speed))
    mine, theirs = ([r["reward last 1/5"] for r in results[arm]] for arm in (grpo, trl))
    print(f"last-fifth reward by seed, {grpo}: " + " ".join(f"{v:.3f}" for v in mine))
    print(f"last-fifth reward by seed, {trl}: " + " ".join(f"{v:.3f}" for v in theirs))
    if len(mine) > 1 and len(theirs) > 1:
        d = difference(mine, theirs)
        print(
            f"last-fifth reward, m2po GRPO - TRL: {d['difference']:+.3f}, 95% interval [{d['low']:+.3f}, "
            f"{d['high']:+.3f}] (bootstrap), permutation p = {d['p']:.3f} ({len(mine)} against {len(theirs)} seeds)"
        )


def parse_cores(text: str) -> set[int]:
    """ "1", "0,1" or "0-1" (as vLLM's CPU binding writes them): the cores the tools run on."""
    from m2po_cli.rollout.launch import bound_cores

    cores = bound_cores(text)
    if not cores or not cores <= os.sched_getaffinity(0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: this process may run on cores {sorted(os.sched_getaffinity(0))} only"
        )
    return cores


def main() -> int:
    everywhere = os.sched_getaffinity(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4, help="seeds of m2po GRPO and of TRL, alternated")
    ap.add_argument("--first-seed", type=int, default=0, help="the seeds are first-seed, first-seed + 1, ...")
    ap.add_argument("--m2po-seeds", type=int, default=0, help="seeds of the default M2PO recipe (speed)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--checkpointing", choices=["off", "on"], action="append",
        help="activation (gradient) checkpointing of both tools' update; repeat for both (default: off, on)",
    )  # fmt: skip
    ap.add_argument(
        "--cores", type=parse_cores, default={max(everywhere)},
        help="the cores both tools run on, a compute thread bound to each (default: the last one; "
        "the bench itself runs on the others)",
    )  # fmt: skip
    ap.add_argument("--keep", type=Path, help="keep the runs' logs and metrics in this folder")
    args = ap.parse_args()
    if not TRL_PYTHON.exists():
        sys.exit(f"no TRL venv at {TRL_PYTHON.parent.parent}; run: bash scripts/trl_venv.sh")
    settings = args.checkpointing or ["off", "on"]
    if everywhere - args.cores:
        os.sched_setaffinity(0, everywhere - args.cores)
    print(
        f"cores {sorted(args.cores)} for the tools (a bound compute thread on each), "
        f"{sorted(everywhere - args.cores) or 'none'} for the bench; load average "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True
    )  # fmt: skip
    work = work_for(GRPO, args.steps)
    results: dict[str, list[dict]] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as tmp_name:
        tmp = args.keep or Path(tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        work_path = tmp / "work.json"
        work_path.write_text(json.dumps(work))
        turn = 0
        for k, seed in enumerate(range(args.first_seed, args.first_seed + args.seeds)):
            for setting in settings:
                on = setting == "on"
                arms = [M2PO_GRPO, TRL_GRPO] if turn % 2 == 0 else [TRL_GRPO, M2PO_GRPO]
                arms += [M2PO_DEFAULT] if k < args.m2po_seeds else []
                turn += 1
                for arm in arms:
                    if arm == TRL_GRPO:
                        run = run_trl(work_path, work, seed, tmp, on, args.cores)
                    elif arm == M2PO_GRPO:
                        run = run_m2po(GRPO, args.steps, seed, tmp, 0, on, args.cores)
                    else:
                        run = run_m2po(M2PO, args.steps, seed, tmp, None, on, args.cores)
                    name = f"{arm}, checkpointing {setting}"
                    results.setdefault(name, []).append(summary(run))
                    line = json.dumps({key: round(v, 4) for key, v in results[name][-1].items()})
                    print(f"seed {seed} {name}: {line}", flush=True)
    print(
        f"\n{args.steps} steps a run, {time.perf_counter() - t_start:.0f} s in all; load average "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    for setting in settings:
        print(f"\ncheckpointing {setting}:")
        arms = {k: v for k, v in results.items() if k.endswith(f"checkpointing {setting}")}
        report(arms, f"{TRL_GRPO}, checkpointing {setting}", f"{M2PO_GRPO}, checkpointing {setting}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
