"""Run by tests/learner/test_policy.py, alone or under torchrun: 3 steps of real training on a fixed batch.

    python tests/workers/dist_learner_worker.py OUT [KEY=VALUE ...]   (recipe overrides, e.g. HSDP degrees)

Rank 0 packs the batch and `distribute` gives each rank its rows, as in `m2po train`. Every rank
writes its gathered trained parameters, its metrics, the gradient of each update and its rows'
behaviour-version scores (sharded, and every row scored by every rank) to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from m2po_cli.config import load_recipe
from m2po_cli.learner.policy import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import resolve_model
from m2po_cli.record import Recorder
from m2po_cli.rollout.episode import one_turn
from m2po_cli.rollout.types import Completion
from m2po_cli.schedule import Schedule
from m2po_cli.train.colocated import score_at_behaviour_version
from m2po_cli.train.pack import pack_groups
from m2po_cli.train.packed import PackedRollouts, distribute
from m2po_cli.train.reuse import plan_passes
from m2po_cli.train.updates import train_on

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"
OVERRIDES = [
    "rollout.prompts_per_step=4",
    # One update a step, on-policy but for the noise added below: every M2PO mask is then decided by
    # that noise alone, the same in every layout, not by weights the layouts round apart.
    "train.mini_batch_prompts=4",
    "train.micro_batch_sequences=3",
    # Rows, not packed groups: a rank holds only some of a group's rows, so packing would round each
    # layout's sums differently by design, and AdamW carries such gaps on to later updates (the packed
    # layout is held to the rows' in test_shared_prompts).
    'train.share_prompts="off"',
    "staleness.s=0",
    "optim.lr=0.002",
    "optim.weight_decay=0.01",
    'algorithm.behaviour_logprobs="learner"',
]


def fixed_batch(step: int, num_prompts: int, n: int, vocab: int) -> PackedRollouts:
    """The whole batch, packed; in this test rank 0 holds all of it and `distribute` spreads it."""
    g = torch.Generator().manual_seed(100 + step)
    prompts = [
        torch.randint(3, vocab, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(num_prompts)
    ]
    groups = []
    for _ in prompts:
        lengths = torch.randint(1, 7, (n,), generator=g).tolist()
        groups.append(
            [
                Completion(torch.randint(3, vocab, (k,), generator=g).tolist(), [0.0] * k, "", True)
                for k in lengths
            ]
        )
    rewards_PG = torch.randint(0, 2, (num_prompts, n), generator=g).float()
    return pack_groups(0, 0, prompts, one_turn(groups), rewards_PG, normalize_std=True, std_eps=1e-6)


def applied_gradients(learner: Learner) -> list[dict[str, torch.Tensor]]:
    """A list that gets the gradient the optimizer applies at each update (clipped) to each trained
    parameter (all of them, or a LoRA adapter), gathered whole, on every rank."""
    grads: list[dict[str, torch.Tensor]] = []
    learner.optimizer.register_step_pre_hook(
        lambda *_: grads.append(
            {k: p.grad.full_tensor() for k, p in learner.model.named_parameters() if p.requires_grad}
        )
    )
    return grads


def main(out: Path, extra: list[str]) -> None:
    torch.set_num_threads(1)
    recipe = load_recipe(QUICKSTART, OVERRIDES + extra)
    learner = Learner(resolve_model(recipe.model.path), recipe)
    loss_fn = build_loss(recipe.loss)
    # Step 0 is recorded (quickstart: every 10th step, every row): each rank scores the rows it holds.
    recorder = Recorder(out, recipe.inspect, recipe.run.seed, learner.rank, learner.world)
    metrics, scored, grads = [], [], applied_gradients(learner)
    for step in range(3):
        vocab = learner.arch.hf_config["vocab_size"]
        batch = fixed_batch(step, 4, recipe.rollout.n, vocab)
        if learner.rank != 0:
            batch = PackedRollouts.empty(batch.version)
        batch = distribute(batch, Schedule.of(recipe))
        score_at_behaviour_version(batch, learner, everything=True, group_size=recipe.rollout.n)
        # Every row scored on every rank by the same weights: what the rank's own rows' scores must be.
        whole = fixed_batch(step, 4, recipe.rollout.n, vocab)
        rows = whole.to_batch(torch.arange(whole.num_rows))
        whole_BL = learner.score(rows)[0]
        scored.append(
            {
                "row_B": batch.row_B,
                "learner_R": batch.learner_R,
                "offsets": batch.response_offsets(),
                "whole_R": whole_BL[rows.mask_BL.bool()],
                "whole_offsets": whole.response_offsets(),
            }
        )
        # Behaviour = the learner's own logprobs, perturbed: ratios away from 1, so M2PO masks. The
        # noise of a token depends on its row and position only, not on which rank holds it.
        noise_R = torch.cat(
            [
                0.3 * torch.randn(int(k), generator=torch.Generator().manual_seed(7 + step * 1000 + int(row)))
                for row, k in zip(batch.row_B, batch.response_len_B, strict=True)
            ]
        )
        batch.learner_R = batch.learner_R + noise_R
        metrics.append(
            train_on(plan_passes(batch, Schedule.of(recipe)), learner, loss_fn, None, recipe, recorder, step)
        )
    # Every rank gathers the trained weights itself, so ranks can be compared with each other.
    state = {k: p.full_tensor() for k, p in learner.model.named_parameters() if p.requires_grad}
    torch.save(
        {"state": state, "metrics": metrics, "scored": scored, "grads": grads}, out / f"rank{learner.rank}.pt"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
