"""The colocated engine's sleep and wake on a GPU, in the order the vLLM RL API asks for, run here
against a recording stand-in for `vllm.LLM` (the CPU has no sleep mode): level 2 frees the weights,
the learner's cached blocks go back to the device before each wake, the push carries the learner's
tensors (never a reload from disk), and the prefix cache is reset after it."""

from __future__ import annotations

import pytest
import torch

from m2po_cli.config import RolloutConfig, load_recipe
from m2po_cli.config.tables import ConfigError
from m2po_cli.rollout.engine import VLLMEngine
from tests.conftest import QUICKSTART


class RecordingLLM:
    """The calls `VLLMEngine` makes, in order; workers report the pushed version."""

    def __init__(self, calls: list):
        self.calls = calls
        self.llm_engine = self

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, args=(), kwargs=None):
        if method == "m2po_push":
            names = [name for name, _ in kwargs["weights"]]  # consumed, as the worker does
            self.calls.append(("push", tuple(names)))
            return [kwargs["version"]]
        self.calls.append((method,))
        return [None]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def set_weight_version(self, version):
        self.calls.append(("set_weight_version", version))


@pytest.fixture
def gpu_engine(monkeypatch):
    """A `VLLMEngine` as a GPU builds it (sleep level 2), over `RecordingLLM`."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    free = iter([30e9, 12e9])  # what `mem_get_info` reports after each wake
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(next(free)), int(80e9)))
    engine = object.__new__(VLLMEngine)
    engine.cfg = RolloutConfig()
    engine.dtype, engine.version, engine.asleep, engine.free_at_wake = torch.bfloat16, 0, False, {}
    engine.sleep_level = engine.cfg.sleep_level
    engine.llm = RecordingLLM(calls)
    return engine, calls


def test_default_sleep_level_frees_the_weights():
    assert RolloutConfig().sleep_level == 2


def test_a_push_after_sleep_wakes_into_released_memory_then_loads_then_wakes_the_cache(gpu_engine):
    engine, calls = gpu_engine
    engine.sleep()
    engine.sleep()  # a second call is a no-op, not a second vLLM sleep
    weights = [("model.embed_tokens.weight", torch.zeros(2)), ("lm_head.weight", torch.zeros(2))]
    engine.push_weights(iter(weights), version=3)
    assert calls == [
        ("sleep", 2),
        ("empty_cache",),
        ("wake_up", ("weights",)),
        ("push", ("model.embed_tokens.weight", "lm_head.weight")),
        ("empty_cache",),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
        ("set_weight_version", "3"),
    ]
    assert not engine.asleep and engine.version == 3
    assert engine.free_at_wake == {"weights": int(30e9), "kv_cache": int(12e9)}
    assert all(call[0] != "reload_weights" for call in calls)


def test_an_awake_push_neither_wakes_nor_releases(gpu_engine):
    engine, calls = gpu_engine
    engine.push_weights(iter([("w", torch.zeros(1))]), version=1)
    assert [c[0] for c in calls] == ["push", "reset_prefix_cache", "set_weight_version"]


def test_an_asleep_engine_refuses_to_generate(gpu_engine):
    engine, _ = gpu_engine
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep; push the weights first"):
        engine.generate([[1, 2]], [0])


def test_sleep_level_1_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_recipe(QUICKSTART, ["rollout.sleep_level=1"])
    message = str(err.value)
    assert "\n" not in message
    assert "rollout.sleep_level: 1 keeps a pinned host copy" in message and "use 2" in message
