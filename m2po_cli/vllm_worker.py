"""Methods mixed into every vLLM worker (`worker_extension_cls`); they run in the engine's process."""

from __future__ import annotations

import torch
from safetensors.torch import load


class WeightSync:
    """Weight updates in place, called through `LLM.collective_rpc("m2po_load_weights", ...)`."""

    def m2po_load_weights(self, blob: bytes) -> None:
        weights = load(blob)
        self.reload_weights(weights_iterator=iter(weights.items()))
        model = self.model_runner.get_model()
        if self.model_runner.model_config.hf_config.tie_word_embeddings:
            # The reload repacks the embedding but leaves the tied output layer on the old one:
            # outputs would change, wrongly and silently. Re-derive the lm_head from the new weight.
            lm_head = model.lm_head
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def m2po_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
