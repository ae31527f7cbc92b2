"""A LoRA run's outputs: the PEFT adapter, the merged export, and what `m2po eval` makes of each."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from m2po_cli.eval.targets import export_step, resolve_targets
from m2po_cli.train.loop import train
from tests.conftest import recipe_for

pytestmark = pytest.mark.slow


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_the_adapter_the_merged_export_and_their_eval_conversions_agree(tmp_path):
    sets = ["run.steps=3", "checkpoint.every=3", "lora.rank=8", "optim.lr=0.01", "lora.export_merged=true"]
    run = train(recipe_for(tmp_path, "rollout.prompts_per_step=8", *sets))
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 32.0)
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 7 * 2 and all(k.startswith("base_model.model.model.layers.") for k in adapter)
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k), "the adapter never trained"
    merged = weights(run / "export")
    # `m2po eval RUN` takes the merged export; the adapter folder and the saved step are merged into
    # the base model by the conversion, to the same weights.
    (target,) = resolve_targets([str(run)], all_checkpoints=False)
    assert target.kind == "model"
    (from_adapter,) = resolve_targets([str(run / "adapter")], all_checkpoints=False)
    (from_step,) = resolve_targets([str(run / "checkpoints" / "step-000003")], all_checkpoints=False)
    assert (from_adapter.kind, from_step.kind) == ("adapter", "step")
    for converted in (export_step(run / "adapter"), export_step(run / "checkpoints" / "step-000003")):
        other = weights(converted)
        assert other.keys() == merged.keys()
        for name, value in merged.items():
            torch.testing.assert_close(other[name], value, atol=1e-6, rtol=1e-6, msg=name)
    # Without the merged export the run directory stands for its adapter.
    (run / "export" / "config.json").unlink()
    (target,) = resolve_targets([str(run)], all_checkpoints=False)
    assert target.kind == "adapter" and target.label.endswith("/adapter")
