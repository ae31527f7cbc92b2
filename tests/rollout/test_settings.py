"""The engine settings are written once: the in-process engine and `vllm serve` take the same ones."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from m2po_cli.config import RolloutConfig, load_recipe
from m2po_cli.rollout.launch import serve_command
from m2po_cli.rollout.payload import lora_slots
from m2po_cli.rollout.server import sampling_body
from m2po_cli.rollout.settings import (
    cli_flags,
    cpu_threads,
    engine_args,
    is_finished,
    request_seed,
    rollout_sampling,
)

ROOT = Path(__file__).resolve().parents[2]


def test_flags_spell_every_argument_the_way_vllm_serve_reads_it():
    args = {"max_model_len": 64, "enable_prefix_caching": True, "enforce_eager": False, "seed": 0}
    assert cli_flags(args) == [
        "--max-model-len", "64", "--enable-prefix-caching", "--no-enforce-eager", "--seed", "0"
    ]  # fmt: skip


def test_a_started_server_takes_every_setting_of_the_in_process_engine():
    cfg = load_recipe(ROOT / "recipes" / "quickstart-separate.toml").rollout
    args = engine_args(
        Path("/models/policy"),
        cfg,
        dtype="float32",
        max_model_len=96,
        on_gpu=torch.cuda.is_available(),  # as `serve_command` decides
        behaviour_logprobs=True,
    )
    assert args["logprobs_mode"] == "processed_logprobs" and args["seed"] == 0
    cmd = serve_command(Path("/models/policy"), cfg, "float32", 96, port=8123)
    flags = cli_flags(args)
    starts = [i for i in range(len(cmd)) if cmd[i : i + len(flags)] == flags]
    assert starts, f"vllm serve lacks some engine settings: {sorted(set(flags) - set(cmd))}"


def test_rollout_requests_sample_as_the_in_process_engine_does():
    cfg = load_recipe(ROOT / "recipes" / "quickstart.toml").rollout
    params = sampling_body([1, 2, 3], cfg, seed=17)["sampling_params"]
    assert {k: params[k] for k in rollout_sampling(cfg, 17)} == rollout_sampling(cfg, 17)
    assert params["seed"] == 17
    assert (params["top_p"], params["top_k"], params["min_p"]) == (1.0, 0, 0.0), (
        "sampling must be untruncated"
    )


def test_cpu_engines_on_one_host_bind_disjoint_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    binds = [cpu_threads(rank, 4)["VLLM_CPU_OMP_THREADS_BIND"] for rank in range(4)]
    assert binds == ["0-1", "2-3", "4-5", "6-7"]
    assert cpu_threads(0, 1)["VLLM_CPU_OMP_THREADS_BIND"] == "0-7"


def test_only_a_response_that_stopped_by_itself_is_finished():
    assert (
        is_finished("stop")
        and not is_finished("length")
        and not is_finished("abort")
        and not is_finished(None)
    )


def test_every_engine_names_the_worker_extension_that_exists():
    """vLLM imports the extension by name in each worker: the name must resolve to the class."""
    import importlib

    from m2po_cli.rollout.settings import WORKER_EXTENSION
    from m2po_cli.rollout.worker import WeightSync

    module, name = WORKER_EXTENSION.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is WeightSync


def test_each_request_seed_is_fixed_by_its_place_and_its_n_seeds_overlap_no_others():
    """vLLM seeds sample i of a request with seed + i: the seeds of different requests must be
    further apart than any n (and within vLLM's int64)."""
    seeds = sorted(
        request_seed(run, step, prompt) for run in range(4) for step in range(50) for prompt in range(64)
    )
    assert seeds[0] >= 0 and seeds[-1] < 2**62
    assert min(b - a for a, b in itertools.pairwise(seeds)) > 2**20
    assert request_seed(3, 7, 1) == request_seed(3, 7, 1) != request_seed(3, 1, 7)
    assert request_seed(0, 12) != request_seed(0, 0, 12)  # a separate-mode place is not a colocated one


def rollout_engine_args(on_gpu: bool, dtype: str = "float32", max_model_len: int = 64, **keys) -> dict:
    """A rollout engine's arguments for a placeholder model, as `build_llm` gets them; `keys` are
    `[rollout]`'s engine keys."""
    engine = RolloutConfig(cuda_graphs=on_gpu, **keys)
    return engine_args(
        Path("/models/policy"),
        engine,
        dtype=dtype,
        max_model_len=max_model_len,
        on_gpu=on_gpu,
        behaviour_logprobs=True,
    )


def test_a_cpu_engine_prefills_every_prompt_in_one_step():
    """The CPU runner cannot roll a per-request generator back after a partial prefill chunk."""
    args = rollout_engine_args(on_gpu=False, max_model_len=6000)
    assert args["enable_chunked_prefill"] is False and args["max_num_batched_tokens"] == 6000
    assert "--no-enable-chunked-prefill" in cli_flags(args)


@pytest.mark.parametrize("rank, vllm_rank", [(1, 1), (12, 16), (16, 16), (17, 32), (512, 512)])
def test_a_lora_engine_holds_adapters_of_the_rank_in_the_slots_the_bound_needs(rank, vllm_rank):
    """vLLM takes a max rank from its own list; device slots are capped, host slots are not."""
    cfg = load_recipe(ROOT / "recipes" / "quickstart-separate.toml").rollout
    slots = lora_slots(max_staleness=20, sync_every=1)
    assert slots == 22 and lora_slots(max_staleness=20, sync_every=3) == 9
    args = engine_args(Path("/m"), cfg, dtype="float32", max_model_len=96, on_gpu=False,
                       behaviour_logprobs=True, lora_rank=rank, lora_slots=slots)  # fmt: skip
    assert args["enable_lora"] and args["max_lora_rank"] == vllm_rank
    assert (args["max_loras"], args["max_cpu_loras"]) == (8, 22)
    cmd = serve_command(Path("/m"), cfg, "float32", 96, port=8123, lora=(rank, slots))
    assert cmd[cmd.index("--max-lora-rank") + 1] == str(vllm_rank) and "--enable-lora" in cmd
    assert "enable_lora" not in engine_args(Path("/m"), cfg, dtype="float32", max_model_len=96,
                                            on_gpu=False, behaviour_logprobs=True)  # fmt: skip
