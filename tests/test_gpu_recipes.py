"""The GPU recipes: their colocated-run settings resolve as the comments say, and the comments state
what the code does with them (device settings are checked through the functions the learner uses)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.attention import SDPBackend

from m2po_cli.config import load_recipe
from m2po_cli.learner.parallelize import mixed_precision
from m2po_cli.titan import attention_backends

ROOT = Path(__file__).resolve().parents[1]
# The colocated GPU recipes (the `-separate` twins run engines beside the learner: docs/staleness.md).
GPU_RECIPES = sorted(p for p in (ROOT / "recipes").glob("qwen*.toml") if not p.stem.endswith("-separate"))


def comment_above(text: str, key: str) -> str:
    """The comment lines right above the line that sets `key`, joined with spaces."""
    lines = text.splitlines()
    (index,) = [i for i, line in enumerate(lines) if re.match(rf"{key}\s*=", line)]
    block = []
    for line in reversed(lines[:index]):
        if not line.startswith("#"):
            break
        block.insert(0, line.lstrip("# "))
    return " ".join(block)


def test_gpu_recipes_found():
    assert len(GPU_RECIPES) == 6


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_colocated_settings_match_their_comments(path: Path):
    recipe, text = load_recipe(path), path.read_text()
    r = recipe.rollout
    ranks = int(re.search(r"--nproc-per-node (\d+)", text)[1])
    assert ranks == 8  # the paper's 8 GPUs

    engine = comment_above(text, "gpu_memory_utilization")
    assert "every rank builds its own vLLM engine" in engine
    share = f"samples its share of each rollout batch ({r.prompts_per_step} / {ranks} = "
    assert share + f"{r.prompts_per_step // ranks} prompts)" in engine
    assert "half of the GPU" in engine and r.gpu_memory_utilization == 0.5
    assert f"sleeps (level {r.sleep_level}:" in engine and r.sleep_level == 2
    assert "CUDA graphs" in engine and r.cuda_graphs
    assert r.tensor_parallel_size == 1 and "One GPU per engine" in comment_above(text, "tensor_parallel_size")

    updates = re.search(r"(\d+) / (\d+) = (\d+) optimizer updates", comment_above(text, "mini_batch_prompts"))
    assert tuple(map(int, updates.groups())) == (
        r.prompts_per_step,
        recipe.train.mini_batch_prompts,
        recipe.updates_per_step,
    )
    fifo = re.search(r"K = (\d+) / (\d+) = (\d+)", comment_above(text, "s"))
    assert tuple(map(int, fifo.groups())) == (
        recipe.staleness.s,
        recipe.updates_per_step,
        recipe.queue_batches,
    )

    timeout = comment_above(text, "collective_timeout_minutes")
    assert f"{r.prompts_per_step} x {r.n} responses of up to {r.max_new_tokens:,} tokens" in timeout
    assert f"over {ranks} engines: {r.prompts_per_step // ranks} prompts x {r.n} each" in timeout
    assert recipe.run.collective_timeout_minutes == 60

    micro = comment_above(text, "micro_batch_sequences")
    m = recipe.train.micro_batch_sequences
    assert micro.startswith(
        f"{m} sequences of up to {recipe.data.max_prompt_tokens} + {r.max_new_tokens} tokens"
    )
    assert f"{m * (recipe.data.max_prompt_tokens + r.max_new_tokens) // 1024}k tokens" in micro

    assert recipe.model.dtype == "bfloat16"
    dtype = comment_above(text, "dtype")
    assert "fp32 master weights" in dtype and "bf16" in dtype and "fused attention" in dtype


def test_device_settings_the_recipes_describe():
    """bf16 recipes on a GPU: fp32 master weights with bf16 compute and fp32 reduce, fused attention
    only; fp32 (the CPU's `auto`) has no mixed precision, and the CPU keeps PyTorch's SDPA choice."""
    policy = mixed_precision("bfloat16")
    assert policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert mixed_precision("float32") is None
    fused = attention_backends("cuda", bf16=True)
    assert fused and SDPBackend.MATH not in fused
    assert attention_backends("cpu", bf16=False) is None and attention_backends("cuda", bf16=False) is None


def test_collective_timeout_comes_from_the_recipe(tmp_path):
    """The learner's process group waits `run.collective_timeout_minutes` in any collective."""
    script = (
        "import torch, torch.distributed as dist\n"
        "from tests.conftest import recipe_for\n"
        "from m2po_cli.learner.policy import Learner\n"
        "from m2po_cli.models import resolve_model\n"
        "from pathlib import Path\n"
        f"recipe = recipe_for(Path({str(tmp_path)!r}), 'run.collective_timeout_minutes=7.5')\n"
        "Learner(resolve_model(recipe.model.path), recipe)\n"
        "print(dist.group.WORLD._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) == 450.0
