"""Run by tests/test_learner.py, alone or under torchrun: m2po updates by both ways to the global mask.

Every rank builds the same 9-row batch and keeps its own rows (2 ranks: 6 and 3, an uneven split);
behaviour logprobs are the learner's own, perturbed by noise that depends on the row and position
only, plus one large outlier a row, so M2PO masks. For each case (a `global_pass`, and for
`correct_after` the provisional threshold the first update starts from) a fresh learner runs two
updates; each rank writes the clipped gradient and full weights of each update, the tokens its
forwards ran over, and the metrics to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from m2po_cli.config import load_recipe
from m2po_cli.learner import Batch, Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import resolve_model

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.toml"
CASES = {"score_first": None, "correct_after": None, "correct_after z0=0.05": 0.05, "auto z0=0.05": 0.05}


def whole_batch(vocab: int) -> tuple[Batch, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    prompt_B = torch.randint(3, 7, (9,), generator=g)
    response_B = torch.randint(1, 12, (9,), generator=g)
    lengths_B = prompt_B + response_B
    tokens_BL = torch.randint(3, vocab, (9, int(lengths_B.max())), generator=g)
    columns_L = torch.arange(tokens_BL.shape[1])
    mask_BL = ((columns_L >= prompt_B[:, None]) & (columns_L < lengths_B[:, None])).float()
    advantages_B = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 1.5, -1.5])
    # Behaviour = current logprob + noise: log r = -noise. Each row's last token gets z = 5 (r = e^5
    # with A > 0), above PROVISIONAL_MAX_LOG_RATIO.
    noise_BL = 0.3 * torch.randn(tokens_BL.shape, generator=g)
    noise_BL[torch.arange(9), lengths_B - 1] = -5.0 * advantages_B.sign()
    return Batch(tokens_BL, mask_BL, torch.zeros_like(mask_BL), advantages_B, lengths_B), noise_BL


def main(out: Path) -> None:
    torch.set_num_threads(1)
    recipe = load_recipe(
        QUICKSTART,
        ["train.micro_batch_sequences=2", "optim.lr=0.01", "optim.weight_decay=0.01", "optim.grad_clip=0.05"],
    )
    model_dir = resolve_model(recipe.model.path)
    loss_fn = build_loss(recipe.loss)
    results = {}
    for name, provisional_z in CASES.items():
        learner = Learner(model_dir, recipe)
        learner.global_pass = name.split()[0]
        if provisional_z is not None:
            learner._provisional_z = provisional_z
        batch, noise_BL = whole_batch(learner.arch.hf_config["vocab_size"])
        if learner.world == 2:
            rows = torch.arange(6) if learner.rank == 0 else torch.arange(6, 9)
            batch, noise_BL = batch.take(rows), noise_BL[rows, : int(batch.lengths_B[rows].max())]
        current_BL, _ = learner.score(batch)
        batch.behaviour_logprobs_BL = (current_BL + noise_BL) * batch.mask_BL
        num_tokens = torch.tensor([batch.mask_BL.sum()])
        torch.distributed.all_reduce(num_tokens)
        steps, grads = [], []
        # The gradient the optimizer applies (clipped), gathered whole on every rank.
        learner.optimizer.register_step_pre_hook(
            lambda *_, m=learner.model, g=grads: g.append(
                {k: p.grad.full_tensor() for k, p in m.named_parameters()}
            )
        )
        forwarded = [0]  # tokens through the model's forwards, padding included
        learner.model.register_forward_pre_hook(
            lambda _, args, n=forwarded: n.append(n.pop() + args[0].numel())
        )
        for _ in range(2):
            forwarded[0] = 0
            metrics = learner.update(batch, loss_fn, int(num_tokens))
            full = {k: v.full_tensor() for k, v in learner.model.state_dict().items()}
            steps.append({"metrics": metrics, "state": full, "grad": grads[-1], "forwarded": forwarded[0]})
        results[name] = steps
    torch.save(results, out / f"rank{learner.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
