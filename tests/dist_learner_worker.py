"""Run by tests/test_learner.py, alone or under torchrun: 3 steps of real training on a fixed batch.

Every rank writes its gathered HF state dict and its metrics to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from m2po_cli.config import load_recipe
from m2po_cli.learner import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import resolve_model
from m2po_cli.staleness import RolloutBatch
from m2po_cli.train import _score_at_behaviour_version, train_on

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.toml"


def fixed_batch(step: int, num_prompts: int, n: int, vocab: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(100 + step)
    prompts = [
        torch.randint(3, vocab, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(num_prompts)
    ]
    responses = [
        torch.randint(3, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(num_prompts * n)
    ]
    return RolloutBatch(
        version=0,
        problem_ids=list(range(num_prompts)),
        answers=["0"] * num_prompts,
        prompts=prompts,
        responses=responses,
        behaviour_logprobs=[[0.0] * len(r) for r in responses],
        texts=[""] * len(responses),
        finished=[True] * len(responses),
        rewards_PG=torch.randint(0, 2, (num_prompts, n), generator=g).float(),
    )


def main(out: Path) -> None:
    torch.set_num_threads(1)
    recipe = load_recipe(
        QUICKSTART,
        [
            "rollout.prompts_per_step=4",
            "train.mini_batch_prompts=2",
            "train.micro_batch_sequences=3",
            "staleness.s=0",
            "optim.lr=0.002",
            "optim.weight_decay=0.01",
        ],
    )
    learner = Learner(resolve_model(recipe.model.path), recipe)
    loss_fn = build_loss(recipe.loss)
    metrics = []
    for step in range(3):
        batch = fixed_batch(step, 4, recipe.rollout.n, learner.arch.hf_config["vocab_size"])
        _score_at_behaviour_version(batch, learner)
        # Behaviour = the learner's own logprobs, perturbed: ratios away from 1, so M2PO masks.
        g = torch.Generator().manual_seed(7 + step)
        batch.behaviour_logprobs = [
            [x + 0.3 * float(torch.randn(1, generator=g)) for x in lp] for lp in batch.learner_logprobs
        ]
        metrics.append(train_on(batch, learner, loss_fn, None, recipe))
    # Every rank gathers the full weights itself, so ranks can be compared with each other.
    full = {k: v.full_tensor() for k, v in learner.model.state_dict().items()}
    state = learner.arch.adapter.to_hf(full)
    torch.save({"state": state, "metrics": metrics}, out / f"rank{learner.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
