"""Methods mixed into every vLLM worker (`worker_extension_cls`); they run in the engine's process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load


class WeightSync:
    """Weight updates in place, called through `LLM.collective_rpc("m2po_load_weights", ...)`."""

    def m2po_load_weights(self, blob: bytes) -> None:
        """Load HF-named weights sent as safetensors bytes."""
        self._m2po_reload(iter(load(blob).items()))

    def m2po_load_weights_from(self, model_dir: str) -> None:
        """Load the `*.safetensors` files of an HF model directory (same architecture as the engine's)."""
        self._m2po_reload(_safetensors_items(Path(model_dir)))

    def _m2po_reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.reload_weights(weights_iterator=weights)
        model = self.model_runner.get_model()
        if self.model_runner.model_config.hf_config.tie_word_embeddings:
            # The reload repacks the embedding but leaves the tied output layer on the old one:
            # outputs would change, wrongly and silently. Re-derive the lm_head from the new weight.
            lm_head = model.lm_head
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def m2po_seed(self, seed: int) -> None:
        torch.manual_seed(seed)


def _safetensors_items(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
