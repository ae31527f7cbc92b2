"""The first GPU run in one call: what the 8B colocated recipe does, at its shapes with few layers.

On a GPU it builds a Qwen3 locally (random weights, no hub) with Qwen3-8B's shapes but 4 layers
(hidden 4,096, MLP 12,288, 32/8 heads, vocabulary 151,936, untied: 2.0 B parameters) and runs:
1. `m2po train recipes/qwen3-8b-s256.toml` on it for 3 steps of one M2PO update each (staleness 1,
   the synthetic task, 32 prompts x 8 samples of up to 512 tokens, a reward that varies within a
   group whatever the model says: `check_reward.py`): the engine sleeps (level 2)
   while the learner trains and wakes for every push. The run's own metrics give the learner's
   tokens/s and MFU, the weight-sync seconds against the bytes pushed, the engine-vs-learner
   logprob gap right after each push (every row is scored by the learner at the version that
   sampled it), and the device memory free after each wake (`mem_get_info`);
   Before it, `bench/memory_budget.py` on the check's recipe and this GPU, AdamW state counted: a
   recipe whose wakes would not fit stops here, before any engine starts;
2. generation tokens/s of one fresh engine alone, with CUDA graphs (eager on the CPU);
3. with 2 or more GPUs: the same run under `torchrun --nproc-per-node 2`, and the separate-mode
   NCCL weight-transport test (`tests/rollout/test_transport.py`).
Where vLLM is not installed (or with `--learner-only`) it runs the learner alone instead of 1-3: three
M2PO updates of the recipe's learner on one synthetic batch of the same sizes, trained at versions 0,
1 and 2 (staleness 0 to 2), with the learner's tokens/s, MFU and peak device memory.
It prints each row as it is measured and writes the table to docs/performance.md (`--write-doc`, on
by default on a GPU) and to `--report FILE` after every phase, so a check killed at its time limit
leaves the rows of the phases it finished.
Without a GPU the same steps run at tiny size (a Qwen3 of 0.14 M parameters), and what needs a GPU (MFU,
sleep mode, device memory, CUDA graphs, NCCL) is listed as not applicable. Exits 1 if a check
fails: the run stops, a loss is not finite or never changes, the mean logprob gap after a push is
over 0.05 (GPU, bf16) or 1e-4 (CPU, fp32), or under 5 GB is free after a wake.

    .venv/bin/python bench/gpu_check.py [--out DIR] [--write-doc | --no-write-doc] [--report FILE]
                                        [--learner-only]
    (scripts/gpu_check.sh runs it)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from local_model import TINY, Qwen3Shape, write_qwen3

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen3-8b-s256.toml"
DOC = ROOT / "docs" / "performance.md"
ON_GPU = torch.cuda.is_available()
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# Qwen3-8B's shapes with 4 of its 36 layers.
QWEN3_8B_4_LAYERS = Qwen3Shape(4096, 4, 32, 8, 128, 12_288, 151_936, tie_word_embeddings=False)
# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, by device-name substring.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}
MIN_FREE_GB = 5.0


class Check:
    """Rows of the table, what does not apply, and the failed checks. After each phase the table so
    far is written out (`save`), so a check killed at its time limit leaves what it measured."""

    def __init__(self, save: Callable[[str], None] = lambda text: None):
        self.rows: list[tuple[str, str]] = []
        self.not_applicable: list[str] = []
        self.failed: list[str] = []
        self.save = save
        self.running: str | None = "start"  # the phase under way; None once the check has ended

    def phase(self, name: str) -> None:
        """The phase `name` starts: what came before is written out."""
        self.running = name
        self.save(self.markdown())

    def end(self) -> None:
        self.running = None
        self.save(self.markdown())

    def row(self, name: str, value: str) -> None:
        self.rows.append((name, value))
        print(f"  {name}: {value}", flush=True)

    def require(self, ok: bool, what: str) -> None:
        if not ok:
            self.failed.append(what)
            print(f"  FAILED: {what}", flush=True)

    def markdown(self) -> str:
        lines = ["| | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in self.rows]
        lines += [""] + [f"- not applicable: {item}" for item in self.not_applicable]
        if self.running is not None:
            end = f"Incomplete: these rows were written when the phase '{self.running}' began."
        else:
            end = "All checks passed."
        lines += ["", "FAILED: " + "; ".join(self.failed) if self.failed else end]
        return "\n".join(lines) + "\n"


def count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def sizes() -> dict:
    """The run's sizes on this machine (GPU: the 8B shapes with 4 layers; CPU: tiny)."""
    if ON_GPU:
        return dict(shape=QWEN3_8B_4_LAYERS, prompts=32, n=8, tokens=512, gen_prompts=64, dtype="bfloat16")
    return dict(shape=TINY, prompts=4, n=4, tokens=16, gen_prompts=8, dtype="float32")


def train_overrides(model_dir: Path, out: Path, size: dict) -> list[str]:
    """The 8B recipe, cut to 3 steps of one update on the local model and the synthetic task."""
    cpu = [] if ON_GPU else ['model.dtype="auto"', "rollout.kv_cache_gib=0.25"]
    return [
        f'model.path="{model_dir}"',
        f'run.output_dir="{out}"',
        'run.name="gpu-check"',
        "run.steps=3",
        'data.source="synthetic:arithmetic"',
        f"rollout.prompts_per_step={size['prompts']}",
        f"rollout.n={size['n']}",
        f"rollout.max_new_tokens={size['tokens']}",
        f"train.mini_batch_prompts={size['prompts']}",
        "staleness.s=1",
        "checkpoint.every=0",
        "checkpoint.export_hf=false",
        "logging.wandb=false",
        'logging.console="plain"',
        "inspect.every=0",
        'reward.function="check_reward:text_parity"',  # random weights solve nothing (check_reward.py)
        *cpu,
    ]


def run_train(model_dir: Path, out: Path, size: dict, nproc: int) -> tuple[list[dict], float, str]:
    """`m2po train` (under torchrun for nproc > 1); its metrics lines, wall seconds, and output tail."""
    sets = [arg for o in train_overrides(model_dir, out, size) for arg in ("--set", o)]
    launch = [sys.executable, "-m"] + (
        ["torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"] if nproc > 1 else []
    )
    t0 = time.perf_counter()
    done = subprocess.run(
        [*launch, "m2po_cli", "train", str(RECIPE), *sets],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    seconds = time.perf_counter() - t0
    tail = (done.stdout + done.stderr)[-3000:]
    metrics = out / "gpu-check" / "metrics.jsonl"
    if done.returncode or not metrics.exists():
        return [], seconds, tail
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()], seconds, tail


def child_env() -> dict[str, str]:
    """The environment of a child process: the caller's, with the project and bench/ ahead on
    `PYTHONPATH` (packages a machine without network brings through it stay visible)."""
    paths = [
        str(ROOT),
        str(ROOT / "bench"),
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def peak_bf16_tflops() -> float | None:
    """This GPU's dense bf16 peak (`PEAK_BF16_TFLOPS`); None on the CPU or an unlisted GPU."""
    if not ON_GPU:
        return None
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in torch.cuda.get_device_name()), None)


def report_updates(check: Check, steps: list[dict], shape: Qwen3Shape, label: str, nproc: int) -> None:
    """The updates' losses (each finite, not all equal), the learner's tokens/s (median) and MFU."""
    losses = [s["loss/loss"] for s in steps]
    check.row(f"{label}: M2PO loss per update", ", ".join(f"{x:.4g}" for x in losses))
    check.require(all(math.isfinite(x) for x in losses), f"{label}: a loss is not finite")
    check.require(len(set(losses)) > 1, f"{label}: the loss never changed")
    tokens_per_s = statistics.median(s["perf/learner_tokens_per_s"] for s in steps)
    check.row(
        f"{label}: learner tokens/s (global pass, fwd+bwd, AdamW)", f"{tokens_per_s:,.0f} (median of 3)"
    )
    peak = peak_bf16_tflops()
    if peak is not None:
        mfu = 6 * shape.num_params() * tokens_per_s / (nproc * peak * 1e12)
        check.row(
            f"{label}: learner MFU (6N FLOPs a token, bf16 dense peak)",
            f"{100 * mfu:.1f}% of {peak:.0f} TFLOP/s a GPU",
        )


def report_train(check: Check, steps: list[dict], seconds: float, size: dict, label: str, nproc: int) -> None:
    shape: Qwen3Shape = size["shape"]
    check.require(len(steps) == 3, f"{label}: {len(steps)} of 3 steps logged")
    if len(steps) != 3:
        return
    check.row(
        f"{label}: wall time, start to end",
        f"{seconds:.0f} s (3 steps, {nproc} {'rank' if nproc == 1 else 'ranks'})",
    )
    # Medians over the 3 steps: the first step's batch was sampled by the engine's first call.
    report_updates(check, steps, shape, label, nproc)
    generated = statistics.median(s["rollout/generated_tokens"] for s in steps)
    rollout_rate = statistics.median(s["rollout/generated_tokens"] / s["time/generate"] for s in steps)
    check.row(
        f"{label}: rollout tokens/s in training",
        f"{rollout_rate:,.0f} ({generated:,.0f} tokens a step; median of 3)",
    )
    pushed = shape.num_params() * (2 if size["dtype"] == "bfloat16" else 4)
    sync = [s["time/weight_sync"] for s in steps]
    check.row(
        f"{label}: weight sync (wake, push, wake)",
        f"{min(sync):.2f}-{max(sync):.2f} s for {pushed / 1e6:,.1f} MB = {pushed / min(sync) / 1e9:.2f} GB/s at best",
    )
    gap_mean, gap_max = (
        max(s["rollout/logprob_mismatch_mean"] for s in steps),
        max(s["rollout/logprob_mismatch_max"] for s in steps),
    )
    limit = 0.05 if ON_GPU else 1e-4
    check.row(
        f"{label}: engine vs learner logprob after a push (mean, max abs diff)",
        f"{gap_mean:.2e}, {gap_max:.2e} (mean limit {limit:g})",
    )
    check.require(gap_mean < limit, f"{label}: mean logprob gap {gap_mean:.2e} >= {limit:g}")
    if ON_GPU:
        for tag in ("weights", "kv_cache"):
            free = [s[f"mem/free_after_wake_{tag}_gb"] for s in steps if f"mem/free_after_wake_{tag}_gb" in s]
            check.require(bool(free), f"{label}: no memory figure after the {tag} wake")
            if free:
                total = torch.cuda.mem_get_info()[1] / 1e9
                check.row(
                    f"{label}: free after the {tag} wake (least rank)",
                    f"{min(free):.1f} GB of {total:.0f} GB",
                )
                check.require(
                    min(free) >= MIN_FREE_GB, f"{label}: {min(free):.1f} GB free after the {tag} wake"
                )


def generate_alone(model_dir: Path, graphs: bool, size: dict) -> dict:
    """Tokens and seconds of one `generate` call of a fresh engine (run in a child process)."""
    from m2po_cli.config import load_recipe
    from m2po_cli.rollout.engine import VLLMEngine

    recipe = load_recipe(
        RECIPE,
        [
            f"rollout.cuda_graphs={str(graphs).lower()}",
            f"rollout.n={size['n']}",
            f"rollout.max_new_tokens={size['tokens']}",
            "rollout.kv_cache_gib=0.25",
        ],
    )
    engine = VLLMEngine(model_dir, recipe.rollout, size["dtype"], 64 + size["tokens"])
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(5, size["shape"].vocab_size, (64,), generator=g).tolist()
        for _ in range(size["gen_prompts"])
    ]
    engine.generate(prompts[:2], [1, 2])  # warm-up
    t0 = time.perf_counter()
    groups = engine.generate(prompts, list(range(len(prompts))))
    seconds = time.perf_counter() - t0
    engine.close()
    return {"tokens": sum(len(c.token_ids) for group in groups for c in group), "seconds": seconds}


def report_generation(check: Check, model_dir: Path, size: dict) -> None:
    """Generation alone, in one fresh engine: with CUDA graphs on a GPU (the recipe's setting; the
    train run's own rollout rate is the eager-free figure in training), eager on the CPU."""
    mode, name = (
        ("graphs", "generation alone, CUDA graphs") if ON_GPU else ("eager", "generation alone, eager")
    )
    args = [sys.executable, __file__, "--generate", mode, "--model", str(model_dir)]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=child_env())
    check.require(done.returncode == 0, f"{name}: {(done.stderr or done.stdout)[-300:]}")
    if done.returncode == 0:
        r = json.loads(done.stdout.strip().splitlines()[-1])
        check.row(
            f"{name} (tokens/s)",
            f"{r['tokens'] / r['seconds']:,.0f} ({size['gen_prompts']} prompts x {size['n']}, {r['tokens']:,} tokens in {r['seconds']:.1f} s)",
        )


def report_transport(check: Check) -> None:
    """The separate-mode NCCL transport test (`tests/rollout/test_transport.py`), which needs pytest (the
    `--dev` install); without it the row says how to get it."""
    if importlib.util.find_spec("pytest") is None:
        check.not_applicable.append(
            "the NCCL weight-transport test: pytest is missing (scripts/install.sh --gpu --dev)"
        )
        return
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "tests/rollout/test_transport.py",
            "-k",
            "nccl_sync_makes_server_match_learner",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    check.row("separate mode: NCCL weight transport test", last)
    check.require(done.returncode == 0 and "passed" in last, f"NCCL transport test: {last}")


def learner_alone(model_dir: Path, size: dict) -> dict:
    """Three M2PO updates of the 8B recipe's learner, alone, on one synthetic batch (run in a child
    process): `size`'s prompts x n samples of 64 prompt and `tokens` response tokens, random, with
    rewards that vary within every group; the batch is scored at version 0 and trained at versions
    0, 1 and 2. Each update's metrics, and the peak device memory (GPU)."""
    from m2po_cli.config import InspectConfig, load_recipe
    from m2po_cli.learner.policy import Learner
    from m2po_cli.loss import build_loss
    from m2po_cli.record import Recorder
    from m2po_cli.rollout.episode import one_turn
    from m2po_cli.rollout.types import Completion
    from m2po_cli.schedule import Schedule
    from m2po_cli.train.colocated import score_at_behaviour_version
    from m2po_cli.train.pack import pack_groups
    from m2po_cli.train.reuse import plan_passes
    from m2po_cli.train.updates import train_on

    with tempfile.TemporaryDirectory(prefix="m2po-gpu-check-learner-") as out:
        overrides = [o for o in train_overrides(model_dir, Path(out), size) if not o.startswith("reward.")]
        recipe = load_recipe(RECIPE, overrides + ['algorithm.behaviour_logprobs="learner"'])
        learner = Learner(model_dir, recipe)
        g = torch.Generator().manual_seed(0)
        vocab, n = size["shape"].vocab_size, size["n"]
        prompts = [torch.randint(5, vocab, (64,), generator=g).tolist() for _ in range(size["prompts"])]
        groups = [
            [
                Completion(ids, [0.0] * len(ids), "", True)
                for ids in torch.randint(5, vocab, (n, size["tokens"]), generator=g).tolist()
            ]
            for _ in prompts
        ]
        rewards_PG = (torch.arange(n) % 2).float().repeat(len(prompts), 1)
        batch = pack_groups(0, 0, prompts, one_turn(groups), rewards_PG, normalize_std=True, std_eps=1e-6)
        score_at_behaviour_version(batch, learner, everything=True, group_size=n)
        recorder = Recorder(Path(out), InspectConfig(every=0), 0, learner.rank, learner.world)
        loss_fn = build_loss(recipe.loss)
        if ON_GPU:
            torch.cuda.reset_peak_memory_stats()
        steps = [
            train_on(plan_passes(batch, Schedule.of(recipe)), learner, loss_fn, None, recipe, recorder, step)
            for step in range(3)
        ]
        peak = torch.cuda.max_memory_allocated() / 1e9 if ON_GPU else None
    return {"steps": steps, "peak_gb": peak, "tokens": int(batch.offsets_B1[-1])}


def report_learner_alone(check: Check, model_dir: Path, size: dict) -> None:
    done = subprocess.run(
        [sys.executable, __file__, "--learner", "--model", str(model_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    check.require(done.returncode == 0, f"learner alone: {(done.stderr or done.stdout)[-600:]}")
    if done.returncode:
        return
    r = json.loads(done.stdout.strip().splitlines()[-1])
    steps = r["steps"]
    check.row(
        "learner alone: batch",
        f"{size['prompts']} prompts x {size['n']} samples of 64 + {size['tokens']} tokens "
        f"({r['tokens']:,} tokens), trained at versions 0, 1, 2",
    )
    report_updates(check, steps, size["shape"], "learner alone", nproc=1)
    check.row(
        "learner alone: masked share per update",
        ", ".join(f"{100 * s['loss/clip_frac']:.2f}%" for s in steps),
    )
    check.row("learner alone: seconds per update", ", ".join(f"{s['time/update']:.2f}" for s in steps))
    if r["peak_gb"] is not None:
        total = torch.cuda.mem_get_info()[1] / 1e9
        check.row("learner alone: peak device memory allocated", f"{r['peak_gb']:.1f} GB of {total:.0f} GB")


def write_doc(table: str, heading: str) -> None:
    """Replace this mode's section of docs/performance.md (or append it)."""
    text = DOC.read_text()
    section = f"## {heading}\n\n{table}"
    start = text.find(f"## {heading}\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    DOC.write_text(text)


def saver(heading: str, doc: bool, report: Path | None) -> Callable[[str], None]:
    """Where the table goes after every phase: docs/performance.md's section, and `report`."""

    def save(table: str) -> None:
        if doc:
            write_doc(table, heading)
        if report is not None:
            report.write_text(f"# m2po gpu check, {heading}\n\n{table}")

    return save


def report_memory_budget(check: Check, model_dir: Path, size: dict) -> bool:
    """`bench/memory_budget.py` on the check's recipe and this GPU, before any engine starts: the
    learner's fp32 master shard and AdamW state counted, so a recipe that cannot wake its KV cache
    after the first update stops here, not at the first wake."""
    from memory_budget import GB, budget, verdict

    from m2po_cli.config import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(RECIPE, train_overrides(model_dir, Path(tmp), size))
    gpu = torch.cuda.mem_get_info()[1]
    rows, figures = budget(recipe, size["shape"], 1, gpu)
    problem, least = verdict(rows, figures, gpu, MIN_FREE_GB * GB)
    check.row(
        "memory budget before the engine starts (AdamW state counted)",
        f"least free at a wake or the push ~{least / GB:.1f} GB of {gpu / GB:.0f} GB; "
        f"KV cache ~{figures['kv'] / GB:.1f} GB",
    )
    check.require(problem is None, f"memory budget: {problem}")
    return problem is None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="folder for the model and the runs (default: temporary)"
    )
    ap.add_argument(
        "--write-doc", action=argparse.BooleanOptionalAction, default=ON_GPU, help="write docs/performance.md"
    )
    ap.add_argument("--report", type=Path, default=None, help="also write the table here, after every phase")
    ap.add_argument(
        "--learner-only",
        action=argparse.BooleanOptionalAction,
        default=not HAVE_VLLM,
        help="run the learner alone, no engine (the default where vLLM is not installed)",
    )
    ap.add_argument("--generate", choices=["graphs", "eager"], help=argparse.SUPPRESS)
    ap.add_argument("--learner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = sizes()
    if args.generate:  # the child process of `report_generation`
        print(json.dumps(generate_alone(args.model, args.generate == "graphs", size)))
        return 0
    if args.learner:  # the child process of `report_learner_alone`
        print(json.dumps(learner_alone(args.model, size)))
        return 0
    device = torch.cuda.get_device_name() if ON_GPU else "CPU"
    gpus = torch.cuda.device_count()
    heading = f"GPU mode: {gpus} x {device}" if ON_GPU else "CPU mode (tiny size)"
    if args.learner_only:
        heading += ", learner alone"
    check = Check(saver(heading, args.write_doc, args.report))
    print(f"m2po gpu check, {heading}", flush=True)
    if not ON_GPU:
        check.not_applicable += [
            "Qwen3-8B shapes (CPU mode runs a Qwen3 of the same layout with 0.14 M parameters)",
            "MFU (no peak-FLOPs figure for a CPU); sleep mode, device memory and its budget (vLLM has "
            "neither on CPU)",
            "CUDA graphs; the 2-GPU run and the NCCL weight transport",
        ]
    elif gpus < 2:
        check.not_applicable.append("the 2-rank run and the NCCL weight transport (one GPU visible)")
    if args.learner_only:
        check.not_applicable.append(
            "the engine: generation, weight sync, the logprob gap after a push, sleep and wake "
            + ("(--learner-only)" if HAVE_VLLM else "(vLLM is not installed)")
        )
    with tempfile.TemporaryDirectory(prefix="m2po-gpu-check-") as tmp:
        out = args.out or Path(tmp)
        shape: Qwen3Shape = size["shape"]
        t0 = time.perf_counter()
        check.phase("model")
        model_dir = write_qwen3(out / "model", shape)
        check.row(
            "model",
            f"Qwen3, hidden {shape.hidden_size}, {shape.num_layers} layers, vocabulary {shape.vocab_size:,}: "
            f"{count(shape.num_params())} parameters, built in {time.perf_counter() - t0:.0f} s",
        )
        if args.learner_only:
            check.phase("learner alone")
            report_learner_alone(check, model_dir, size)
        elif not ON_GPU or report_memory_budget(check, model_dir, size):
            check.phase("1-rank train")
            steps, seconds, tail = run_train(model_dir, out / "one", size, nproc=1)
            check.require(bool(steps), f"m2po train did not finish: {tail[-600:]}")
            report_train(check, steps, seconds, size, "1 rank", nproc=1)
            check.phase("generation alone")
            report_generation(check, model_dir, size)
            if ON_GPU and gpus >= 2:
                check.phase("2-rank train")
                steps, seconds, tail = run_train(model_dir, out / "two", size, nproc=2)
                check.require(bool(steps), f"2-rank m2po train did not finish: {tail[-600:]}")
                report_train(check, steps, seconds, size, "2 ranks", nproc=2)
                check.phase("NCCL transport")
                report_transport(check)
    check.end()
    print("\n" + check.markdown())
    if args.write_doc:
        print(f"wrote {DOC.relative_to(ROOT)}: {heading}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
