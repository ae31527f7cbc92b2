"""The weight transports' parts that run anywhere, and the NCCL transport end to end on two GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m2po_cli.errors import RunError
from m2po_cli.learner.policy import Learner
from m2po_cli.models import resolve_model
from m2po_cli.rollout.nccl import learner_source, rank_offsets
from m2po_cli.rollout.transport import resolve_transport
from tests.conftest import recipe_for
from tests.steps import train_once

SEPARATE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart-separate.toml"


def test_each_server_gets_the_ranks_after_the_previous_ones():
    assert rank_offsets([2, 1, 4]) == [1, 3, 4]  # learner rank 0, then 2 + 1 + 4 workers: world 8
    assert rank_offsets([]) == []


@pytest.mark.parametrize("model", ["builtin:tiny-qwen3", "builtin:tiny-qwen3-untied"])
def test_learner_source_declares_what_it_sends(model, tmp_path):
    """vLLM sizes its receive buffers from `metadata()`: it must match the stream, tensor by tensor."""
    learner = Learner(resolve_model(model), recipe_for(tmp_path, f'model.path="{model}"'))
    source = learner_source(learner, torch.bfloat16)
    declared = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()]
    sent = [(name, t.dtype, tuple(t.shape)) for name, t in source]
    assert declared == sent and len(sent) > 0
    assert ("lm_head.weight" in {n for n, _, _ in sent}) == model.endswith("untied")
    assert [(n, s) for n, _, s in sent] == [(n, s) for n, s in learner.hf_shapes()]


def test_auto_picks_shm_without_cuda_and_nccl_needs_it():
    if torch.cuda.is_available():
        assert resolve_transport("auto") == "nccl"
        return
    assert resolve_transport("auto") == "shm"
    with pytest.raises(RunError, match="nccl needs CUDA"):
        resolve_transport("nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only error")
def test_nccl_on_a_cpu_stops_before_anything_starts(tmp_path):
    cmd = [sys.executable, "-m", "m2po_cli", "train", str(SEPARATE), "--set", f'run.output_dir="{tmp_path}"']
    cmd += ["--set", 'rollout.weight_transport="nccl"']
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # after the line that names the third-party log
    assert "rollout.weight_transport: nccl needs CUDA" in last, done.stderr
    assert not list(tmp_path.rglob("engine-*.log")), "an engine was started"


@pytest.mark.gpu(2)
@pytest.mark.slow
def test_nccl_sync_makes_server_match_learner(tmp_path):
    """Learner on GPU 0, `vllm serve` on GPU 1: after a sync the engine's logprobs are the learner's."""
    from m2po_cli.rollout.nccl import NcclWeightTransport
    from m2po_cli.rollout.server import EngineServer, swap_weights
    from tests.rollout.test_server import HTTPEngine, probe
    from tests.rollout.test_weight_sync import logprob_gap, sampled_batch

    model = "builtin:tiny-qwen3"
    recipe = recipe_for(
        tmp_path,
        f'model.path="{model}"',
        'rollout.mode="separate"',
        'rollout.weight_transport="nccl"',
        "rollout.prompts_per_step=4",
        "rollout.gpu_memory_utilization=0.3",
        "optim.lr=0.02",
        'loss={type="grpo"}',
    )
    model_dir = resolve_model(model)
    server = EngineServer.start(model_dir, recipe.rollout, "float32", 64, tmp_path / "engine.log", [1])
    try:
        learner = Learner(model_dir, recipe)
        swap = lambda load, version: swap_weights([server], load, version)  # noqa: E731
        transport = NcclWeightTransport(0, 1, torch.float32, swap, learner, [server])
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            engine, sequences = HTTPEngine(server, recipe, tokenizer), probe(tokenizer)
            transport.push(learner)
            assert logprob_gap(engine, learner, sequences) < 1e-4
            batch = sampled_batch(engine, tokenizer, recipe, learner.version)
            train_once(batch, learner, recipe)
            assert logprob_gap(engine, learner, sequences) > 1e-3  # no sync yet
            transport.after_update(learner)
            assert logprob_gap(engine, learner, sequences) < 1e-4
            assert server.weight_version() == str(learner.version)
        finally:
            transport.close()
    finally:
        server.close()


def test_the_rendezvous_address_is_one_the_engines_can_reach():
    from m2po_cli.rollout.nccl import rendezvous_address
    from m2po_cli.rollout.server import EngineError, EngineServer

    local = [EngineServer("http://127.0.0.1:8001"), EngineServer("http://localhost:8002")]
    remote = [EngineServer("http://127.0.0.1:8001"), EngineServer("http://gpu-node-7:8000")]
    assert rendezvous_address(local) == "127.0.0.1"
    assert rendezvous_address(remote, "10.0.0.5") == "10.0.0.5"
    with pytest.raises(
        EngineError,
        match=r"^rollout.transport_address 127.0.0.1, a loopback address the "
        r"engines on other hosts \(http://gpu-node-7:8000\) cannot reach",
    ):
        rendezvous_address(remote, "127.0.0.1")
