"""What a weight sync carries to an engine: every weight, or a LoRA adapter, each with its version.

`FullWeights` streams HF-named tensors; the engine loads them in place, and its tokens carry the
version of the weights it holds (one policy per engine). `Adapter` is a PEFT folder on disk; the
engine loads it under a name that carries its version (`adapter_name`), and each request names the
adapter it samples with, so a token's version is that of the adapter its request named, whatever
else the engine holds (several versions may be loaded at once). A version's folder must outlive
every request that names it: an engine reloads an evicted adapter from its folder.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER_PREFIX = "m2po-v"


def adapter_name(version: int) -> str:
    """The name an engine serves version `version`'s adapter under (unique per version, so no prefix-cache
    block or loaded copy of an older version is ever reused for it)."""
    return f"{ADAPTER_PREFIX}{version}"


def lora_slots(max_staleness: int, sync_every: int) -> int:
    """Adapters an engine may hold at once when requests of older versions are still in flight: every
    version pushed within the staleness bound (one a push, a push every `sync_every` updates), the one
    being loaded, and one spare."""
    return -(-max_staleness // sync_every) + 2


@dataclass(frozen=True)
class FullWeights:
    tensors: Iterable[tuple[str, torch.Tensor]]  # HF names, whole tensors, consumed once
    version: int


@dataclass(frozen=True)
class Adapter:
    folder: Path  # PEFT format (`lora.write_adapter`)
    version: int

    @property
    def name(self) -> str:
        return adapter_name(self.version)

    @property
    def lora_id(self) -> int:
        """vLLM's integer id of the adapter (> 0; 0 means none)."""
        return self.version + 1


Payload = FullWeights | Adapter


def swap_adapter(servers: list, load, version: int) -> None:
    """A separate-mode sync of an adapter (`RolloutProducer.swap`): `load(servers)`, with no pause, no
    KV-cache reset and no engine-wide version: a request in flight goes on with the adapter it named,
    and a token's version is its request's adapter's (the producer sets it, not the engine's spans)."""
    load(servers)
