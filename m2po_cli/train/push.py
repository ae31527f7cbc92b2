"""The learner's policy into this rank's engine after its updates, and the check that it arrived.

Full fine-tuning streams every weight (`FullWeights`). With LoRA the push is the adapter alone
(`Adapter`): each rank writes it as a PEFT folder under `<run>/adapters/rank-RRRRR/` and its engine
loads it under the version's name; the previous version's folder goes once the new one is in (colocated,
nothing is in flight across a push).

After every push the engine samples `PROBE_TOKENS` tokens after a fixed probe prompt and the learner
scores them at the version it pushed: both must give the same logprobs. An engine that kept the old
weights, or serves the base model under an adapter it did not apply (vLLM only logs at debug level when
an adapter's module names match nothing), differs by what the training changed; the run stops in one
line when the mean difference exceeds `rollout.push_check_tolerance`.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from m2po_cli.distributed import all_reduce
from m2po_cli.errors import RunError
from m2po_cli.learner.batch import Batch
from m2po_cli.learner.policy import Learner
from m2po_cli.lora import write_adapter
from m2po_cli.rollout.engine import RolloutEngine
from m2po_cli.rollout.payload import Adapter, FullWeights, Payload, adapter_name
from m2po_cli.rollout.types import Completion

PROBE_PROMPT = 16  # prompt tokens of the probe
PROBE_TOKENS = 8  # tokens the engine samples after it
PROBE_SEED = 20251  # the probe's sampling seed: the same tokens for the same weights
ADAPTERS = "adapters"
PUSH_MISMATCH = (
    "rollout/push_check_mismatch"  # the metric: the last check's mean gap, the largest of any rank
)


def probe_prompt(vocab: int) -> list[int]:
    """A fixed prompt of `PROBE_PROMPT` token ids below `vocab` (any ids do: the check compares the two
    sides' logprobs, not what the text says)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (PROBE_PROMPT,), generator=generator).tolist()


class Pusher:
    """Pushes the learner's policy to this rank's engine and checks it (`push`). A collective."""

    def __init__(self, learner: Learner, engine: RolloutEngine, run_dir: Path, base_model: str, vocab: int):
        self.learner, self.engine, self.base_model = learner, engine, base_model
        self.folder = run_dir / ADAPTERS / f"rank-{learner.rank:05d}"
        shutil.rmtree(self.folder, ignore_errors=True)  # a killed run's
        self.probe = probe_prompt(vocab)
        self.mismatch = 0.0  # the last check's mean |engine - learner| logprob

    def push(self) -> None:
        payload = self.payload()
        self.engine.push(payload)
        self.check(payload)
        if isinstance(payload, Adapter):
            for old in self.folder.iterdir():
                if old != payload.folder:
                    shutil.rmtree(old, ignore_errors=True)

    def payload(self) -> Payload:
        learner, dtype = self.learner, self.engine.dtype
        if learner.lora is None:
            return FullWeights(learner.hf_weights(dtype), learner.version)
        folder = self.folder / adapter_name(learner.version)
        write_adapter(folder, learner.adapter_tensors(dtype), learner.lora, self.base_model)
        return Adapter(folder, learner.version)

    def check(self, payload: Payload) -> None:
        """The engine's logprobs of the probe's sampled tokens against the learner's; every rank its own
        engine, and all stop together (the largest mean difference of any rank decides)."""
        completions = self.engine.generate([self.probe], [PROBE_SEED], max_tokens=[PROBE_TOKENS])[0]
        gap = torch.tensor([probe_gap(self.learner, self.probe, completions)], dtype=torch.float64)
        self.mismatch = float(all_reduce(gap, dist.ReduceOp.MAX)[0])
        require_agreement(self.mismatch, self.learner.recipe.rollout.push_check_tolerance, payload)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # `adapters/`, once no rank has a folder there
            self.folder.parent.rmdir()


def probe_gap(learner: Learner, probe: list[int], completions: list[Completion]) -> float:
    """The largest, over `completions` of `probe`, of the mean |learner - engine| logprob of their
    tokens, the learner scoring at its current version. A collective (`Learner.score`)."""
    length = len(probe) + max(len(c.token_ids) for c in completions)
    tokens_BL, mask_BL = (
        torch.zeros(len(completions), length, dtype=torch.long),
        torch.zeros(len(completions), length),
    )
    engine_BL = torch.zeros(len(completions), length, dtype=torch.float64)
    for i, c in enumerate(completions):
        end = len(probe) + len(c.token_ids)
        tokens_BL[i, :end] = torch.tensor(probe + c.token_ids)
        mask_BL[i, len(probe) : end] = 1.0
        engine_BL[i, len(probe) : end] = torch.tensor(c.logprobs, dtype=torch.float64)
    lengths_B = mask_BL.sum(1).long() + len(probe)
    batch = Batch(tokens_BL, mask_BL, torch.zeros_like(mask_BL), torch.zeros(len(completions)), lengths_B)
    learner_BL, _ = learner.score(batch)
    gaps_B = ((learner_BL.double() - engine_BL).abs() * mask_BL).sum(1) / mask_BL.sum(1)
    return float(gaps_B.max())


def require_agreement(gap: float, tolerance: float, payload: Payload) -> None:
    """Stop the run in one line when the engine's probe logprobs are `gap` from the learner's."""
    if gap <= tolerance:
        return
    what = f"adapter {payload.name}" if isinstance(payload, Adapter) else "weights"
    raise RunError(
        f"weight push {payload.version}: the engine's logprobs of the probe's tokens differ from the "
        f"learner's by {gap:.3g} on average (rollout.push_check_tolerance {tolerance:g}): the engine is "
        f"not sampling the {what} it was sent"
    )
