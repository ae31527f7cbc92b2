"""The learner's policy into this rank's engine after its updates, and the check that it arrived.

Full fine-tuning streams every weight (`FullWeights`). With LoRA the push is the adapter alone
(`Adapter`): each rank writes it as a PEFT folder under `<run>/adapters/rank-RRRRR/` and its engine
loads it under the version's name; the previous version's folder goes once the new one is in (colocated,
nothing is in flight across a push).

After every push the engine samples one token after a fixed probe prompt, with the logprobs of its
`PROBE_TOP` most likely next tokens (one prefill: the check does not wait for decode steps of a busy
engine), and the learner scores the same next tokens at the version it pushed, at the rollouts'
temperature: both must give the same logprobs. An engine that kept the old weights, or serves the
base model under an adapter it did not apply (vLLM only logs at debug level when an adapter's module
names match nothing), differs by what the training changed; the run stops in one line when the mean
difference exceeds `rollout.push_check_tolerance`.
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

PROBE_PROMPT = 16  # prompt tokens of the probe
PROBE_TOP = 16  # next tokens whose logprobs are compared (the engine's most likely, and the one sampled)
PROBE_SEED = 20251  # the probe's sampling seed: the same token for the same weights
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
        """The engine's logprobs of the probe's next tokens against the learner's; every rank its own
        engine, and all stop together (the largest mean difference of any rank decides)."""
        scored = self.engine.next_logprobs(self.probe, PROBE_SEED, PROBE_TOP)
        gap = torch.tensor([probe_gap(self.learner, self.probe, [scored])], dtype=torch.float64)
        self.mismatch = float(all_reduce(gap, dist.ReduceOp.MAX)[0])
        require_agreement(self.mismatch, self.learner.recipe.rollout.push_check_tolerance, payload)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # `adapters/`, once no rank has a folder there
            self.folder.parent.rmdir()


def probe_gap(learner: Learner, probe: list[int], engines: list[dict[int, float]]) -> float:
    """The largest, over `engines` (each one's logprobs of some next tokens after `probe`), of the mean
    |learner - engine| logprob of those tokens, the learner scoring at its current version and the
    rollouts' temperature. A collective (`Learner.score`)."""
    rows = [(i, token) for i, scored in enumerate(engines) for token in scored]
    tokens_BL = torch.tensor([probe + [token] for _, token in rows])
    mask_BL = torch.zeros(tokens_BL.shape)
    mask_BL[:, -1] = 1.0
    lengths_B = torch.full((len(rows),), tokens_BL.shape[1])
    batch = Batch(tokens_BL, mask_BL, torch.zeros_like(mask_BL), torch.zeros(len(rows)), lengths_B)
    learner_B = learner.score(batch)[0][:, -1].double()
    gaps = [[] for _ in engines]
    for (i, token), value in zip(rows, learner_B.tolist(), strict=True):
        gaps[i].append(abs(value - engines[i][token]))
    return max(sum(g) / len(g) for g in gaps)


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
