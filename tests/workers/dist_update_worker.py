"""Run by tests/learner/test_policy.py, alone or under torchrun: m2po updates by both ways to the global mask.

Every rank builds the same 9-row batch and keeps its own rows (2 ranks: 6 and 3, an uneven split).
Before each update the behaviour logprobs are set to the learner's own logprobs at that moment plus
noise that depends on the row and position only (`update_noise`), plus one large outlier a row, so
every log-ratio is -noise by construction: which tokens M2PO masks, and which ones the provisional
mask of `correct_after` gets wrong, follow from the noise alone, never from how the model's numerics
round on a given CPU (`tests/learner/test_policy.py` checks that construction without a model). For each
case (a `global_pass`, and for `correct_after` the provisional threshold the first update starts
from) a fresh learner runs two updates; each rank writes the clipped gradient and full weights of
each update, the tokens its forwards ran over, and the metrics to OUT/rank<r>.pt. With `--idle-rank`
rank 0 keeps all nine rows and rank 1 none: a rank with nothing to train still joins every collective.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from m2po_cli.config import load_recipe
from m2po_cli.learner.batch import Batch
from m2po_cli.learner.policy import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import resolve_model

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"
CASES = {
    "score_first": None,
    "correct_after": None,
    "correct_after z0=0.05": 0.05,
    "auto z0=0.05": 0.05,
    "auto one-micro-batch": None,  # every rank's rows in one micro-batch: the mask from that forward
}
ONE_MICRO_BATCH = ["train.micro_batch_sequences=16"]
# Adam's eps at 1e-4, the size of a typical gradient entry here: with eps = 1e-8 an entry whose true
# gradient is ~0 takes a step of up to lr from its float32 rounding alone, so the two ways' weights
# could part by lr. The bound `adam_weight_tolerance` derives stays small.
OVERRIDES = [
    "train.micro_batch_sequences=2",
    "optim.lr=0.01",
    "optim.weight_decay=0.01",
    "optim.grad_clip=0.05",
    "optim.eps=1e-4",
]
# (seed, scale) of each update's Gaussian noise. Update 2's exact mask threshold (0.29 at the
# quickstart's tau) falls well below update 1's (0.41), the provisional threshold update 2 starts
# from, so three tokens between the two are provisionally kept and exactly masked: update 2 needs a
# correction by construction. `test_update_worker_forces_every_path` checks it and the margins.
NOISE = ((17, 0.3), (16, 0.6))


def whole_batch(vocab: int) -> Batch:
    """Nine rows of prompt then response (responses of 1-11 tokens), advantages of both signs and one 0."""
    g = torch.Generator().manual_seed(3)
    prompt_B = torch.randint(3, 7, (9,), generator=g)
    response_B = torch.randint(1, 12, (9,), generator=g)
    lengths_B = prompt_B + response_B
    tokens_BL = torch.randint(3, vocab, (9, int(lengths_B.max())), generator=g)
    columns_L = torch.arange(tokens_BL.shape[1])
    mask_BL = ((columns_L >= prompt_B[:, None]) & (columns_L < lengths_B[:, None])).float()
    advantages_B = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 1.5, -1.5])
    return Batch(tokens_BL, mask_BL, torch.zeros_like(mask_BL), advantages_B, lengths_B, torch.arange(9))


def update_noise(batch: Batch, update: int) -> torch.Tensor:
    """Behaviour minus current logprob before `update` (0-based): log r = -noise. Gaussian noise
    (`NOISE`), and on each row's last token z = 5 (r = e^5 with A > 0), above PROVISIONAL_MAX_LOG_RATIO."""
    seed, scale = NOISE[update]
    noise_BL = scale * torch.randn(batch.tokens_BL.shape, generator=torch.Generator().manual_seed(seed))
    noise_BL[torch.arange(batch.num_rows), batch.lengths_B - 1] = -5.0 * batch.advantages_B.sign()
    return noise_BL * batch.mask_BL


def main(out: Path, extra: list[str]) -> None:
    torch.set_num_threads(1)
    idle_rank = "--idle-rank" in extra
    extra = [e for e in extra if e != "--idle-rank"]
    loss_fn = build_loss(load_recipe(QUICKSTART, OVERRIDES).loss)
    results = {}
    for name, provisional_z in CASES.items():
        one = ONE_MICRO_BATCH if name.endswith("one-micro-batch") else []
        recipe = load_recipe(QUICKSTART, [*OVERRIDES, *one, *extra, f'train.global_pass="{name.split()[0]}"'])
        model_dir = resolve_model(recipe.model.path)
        learner = Learner(model_dir, recipe)
        if provisional_z is not None:
            learner._provisional_z = provisional_z
        whole = whole_batch(learner.arch.hf_config["vocab_size"])
        rows = torch.arange(whole.num_rows)
        if learner.world == 2:
            split = 9 if idle_rank else 6
            rows = torch.arange(split) if learner.rank == 0 else torch.arange(split, 9)
        batch = whole.take(rows)
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
        for update in range(2):
            noise_BL = update_noise(whole, update)[rows, : batch.tokens_BL.shape[1]]
            current_BL, _ = learner.score(batch)
            batch.behaviour_logprobs_BL = (current_BL + noise_BL) * batch.mask_BL
            forwarded[0] = 0
            metrics = learner.update(batch, loss_fn, int(num_tokens))
            # A copy: with one shard, `full_tensor` is the live parameter, which the next update moves.
            full = {k: v.full_tensor().clone() for k, v in learner.model.state_dict().items()}
            # its rows padded as one micro-batch
            one_forward = batch.num_rows * int(batch.lengths_B.max()) if batch.num_rows else 0
            steps.append(
                {
                    "metrics": metrics,
                    "state": full,
                    "grad": grads[-1],
                    "forwarded": forwarded[0],
                    "one_forward": one_forward,
                }
            )
        results[name] = steps
    torch.save(results, out / f"rank{learner.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])  # OUT [--idle-rank] [KEY=VALUE ...]: overrides (HSDP degrees)
