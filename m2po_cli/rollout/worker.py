"""Methods mixed into every vLLM worker (`worker_extension_cls`); they run in the engine's process.

The rollout engine is always in-process (one engine per learner rank), so `collective_rpc` calls
these methods directly: the weights arrive as an iterator of HF-named tensors that the learner
gathers one parameter at a time, and nothing is serialized.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from m2po_cli.rollout.weights import load_in_place


class WeightSync:
    """Weight updates in place, called through `LLM.collective_rpc("m2po_push" | "m2po_reload", ...)`.

    While tensors are going in the version is -1, so a load that fails part-way leaves no version."""

    m2po_weight_version: int = 0

    def m2po_reload(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Load HF-named full tensors as they come (the iterator may gather each one on demand)
        through vLLM's layerwise reload; stamp and return the weight version once every tensor is in.

        vLLM only logs a warning for a parameter the reload did not write, which after a level-2
        sleep holds whatever the memory held: here that stops the run, naming the parameters."""
        self.m2po_weight_version = -1
        model = self.model_runner.get_model()
        with recording_loads(model) as written:
            self.reload_weights(weights_iterator=iter(weights))
        require_written(model, written, version)
        if self.model_runner.model_config.hf_config.tie_word_embeddings:
            # The reload repacks the embedding but leaves the tied output layer on the old one:
            # outputs would change, wrongly and silently. Re-derive the lm_head from the new weight.
            lm_head = model.lm_head
            lm_head.quant_method.process_weights_after_loading(lm_head)
        self.m2po_weight_version = version
        return version

    def m2po_push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """The in-process push: on CPU, straight into the engine's storage (`rollout/weights.py`); on a
        GPU, vLLM's layerwise reload (no repacking there). Stamps and returns the version."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return self.m2po_reload(weights, version)
        self.m2po_weight_version = -1
        load_in_place(self.model_runner.get_model(), weights)
        self.m2po_weight_version = version
        return version

    def m2po_load_weights_from(self, model_dir: str, version: int = 0) -> int:
        """Load the `*.safetensors` files of an HF model directory (same architecture as the engine's),
        one tensor at a time, as `m2po_push` loads a stream: in place on the CPU (a shared-memory sync
        costs the engine the copy, not vLLM's layerwise reload: 25 ms -> 15 ms at the quickstart's
        model), through the reload on a GPU."""
        return self.m2po_push(safetensors_items(Path(model_dir)), version)

    def m2po_reach(self, address: str, port: str, timeout_s: str) -> str:
        """Open a TCP connection from this worker to `address:port` (where the learner waits for the
        weight transport's rendezvous): '' when it connects within `timeout_s`, else why not."""
        try:
            with socket.create_connection((address, int(port)), timeout=float(timeout_s)):
                return ""
        except OSError as e:
            return f"{type(e).__name__}: {e}"

    def m2po_version(self) -> int:
        """The version stamped by the last completed reload (0: the weights the engine started with;
        -1: a load that failed part-way)."""
        return self.m2po_weight_version

    def m2po_signature(self) -> dict:
        """The served model's shape (`model_signature` of its HF config), to check it is the learner's."""
        return model_signature(self.model_runner.model_config.hf_config.to_dict())


@contextmanager
def recording_loads(model: nn.Module) -> Iterator[set[str]]:
    """The names of the parameters `model.load_weights` reports written while inside: vLLM's reload
    calls it once with the whole stream and returns that set."""
    written: set[str] = set()
    load = model.load_weights

    def record(weights):
        names = load(weights)
        written.update(names)
        return names

    model.load_weights = record  # an instance attribute, over the class's method
    try:
        yield written
    finally:
        del model.load_weights


def require_written(model: nn.Module, written: set[str], version: int) -> None:
    """Raise, naming them, if a parameter of `model` (vLLM's names, as its reload counts them) was
    not among those written."""
    from m2po_cli.errors import RunError

    missing = sorted({name for name, _ in model.named_parameters()} - written)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise RunError(
            f"weight push {version}: the engine's {shown} received nothing from the learner "
            "(HF names the model did not take?); the engine's weights are not the policy's"
        )


SIGNATURE_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def model_signature(hf_config: dict) -> dict:
    """What two models must share for one's weights to load into the other."""
    return {key: hf_config.get(key) for key in SIGNATURE_KEYS}


def safetensors_items(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
