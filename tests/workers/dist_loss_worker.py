"""One rank of tests/test_loss_distributed.py; run with `torchrun --nproc-per-node 2` (gloo, CPU).

Each rank holds some rows of one optimizer batch (an uneven slice, or every other row of a batch
whose samples share prefixes, so tied M2 straddle the stopping point), calls `prepare` with the
process group and the rows' numbers, then one loss call + backward per micro-batch. Mask, summed
loss, all-reduced gradient and metrics must equal those of this same process holding the whole
batch alone. Writes `rank<r>.json` to the folder given as the only argument; exits 1 on any
mismatch.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from m2po_cli import second_moment
from m2po_cli.config.loss import M2POCapLoss, M2POLoss
from m2po_cli.loss import build_loss

ROWS, COLS = 13, 40
RANK_ROWS = [torch.arange(0, 4), torch.arange(4, ROWS)]  # uneven on purpose
RANK_MICRO_BATCHES = [[3, 1], [2, 2, 5]]
# Tied: 4 prompts x 4 samples sharing prefixes; the ranks take every other row.
TIED_RANK_ROWS = [torch.arange(0, 16, 2), torch.arange(1, 16, 2)]
TIED_MICRO_BATCHES = [[3, 5], [1, 1, 6]]


def tied_batch(seed: int = 5) -> tuple[torch.Tensor, ...]:
    """As `tests/test_loss.py`'s `tied_batch`: a grid of 1/8, shared prefixes, A of both signs."""
    from tests.test_loss import tied_batch as make

    log_ratio, advantages, valid = make(seed, 4, 4, COLS)
    behaviour = -3 * torch.rand(log_ratio.shape, generator=torch.Generator().manual_seed(seed))
    return log_ratio, advantages, valid, behaviour


def batch(seed: int = 11) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shape = (ROWS, COLS)
    log_ratio = 0.15 * torch.randn(shape, generator=g) / torch.randn(shape, generator=g).abs().clamp(min=0.05)
    log_ratio[:, ::5] = torch.round(log_ratio[:, ::5] * 4) / 4  # ties, on both ranks
    advantages = (torch.randn(ROWS, 1, generator=g) * (torch.rand(ROWS, 1, generator=g) > 0.2)).expand(shape)
    valid = torch.arange(COLS) < torch.randint(0, COLS + 1, (ROWS, 1), generator=g)
    behaviour = -3 * torch.rand(shape, generator=g)
    return log_ratio, advantages, valid, behaviour


def run(cfg, whole: tuple, rows: torch.Tensor, micro_batches: list[int], group) -> dict:
    """prepare over this process's rows (with `group`), then the micro-batches; sums and the gradient."""
    log_ratio, advantages, valid, behaviour = (t[rows] for t in whole)
    num_tokens = int(whole[2].sum())  # the whole optimizer batch, every rank
    loss_fn = build_loss(cfg)
    logprobs = (behaviour + log_ratio).requires_grad_()
    aux, prepared = loss_fn.prepare(log_ratio, advantages, valid, group, rows_B=rows)
    loss_sum, metrics, start = torch.zeros(()), {}, 0
    for size in micro_batches:
        mb = slice(start, start + size)
        loss, mb_metrics = loss_fn(
            logprobs[mb], behaviour[mb], advantages[mb], valid[mb], aux[mb], num_tokens
        )
        loss.backward()
        loss_sum += loss.detach()
        for name, value in mb_metrics.items():
            metrics[name] = metrics.get(name, 0.0) + value.double()
        start += size
    return {"loss": loss_sum, "grad": logprobs.grad, "aux": aux, "metrics": metrics, "prepared": prepared}


def all_sum(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def compare(name: str, cfg, rank: int, tied: bool = False) -> dict:
    data = tied_batch() if tied else batch()
    rows = (TIED_RANK_ROWS if tied else RANK_ROWS)[rank]
    num_rows = len(data[0])
    mine = run(cfg, data, rows, (TIED_MICRO_BATCHES if tied else RANK_MICRO_BATCHES)[rank], dist.group.WORLD)
    whole = run(cfg, data, torch.arange(num_rows), [num_rows], None)
    # FSDP sums gradients over ranks: place this rank's rows, sum over ranks.
    grad = torch.zeros(num_rows, COLS)
    grad[rows] = mine["grad"]
    checks = {
        "mask": torch.equal(mine["aux"], whole["aux"][rows]),
        "gradient": torch.equal(all_sum(grad), whole["grad"]),
        "loss": math.isclose(float(all_sum(mine["loss"])), float(whole["loss"]), rel_tol=1e-6, abs_tol=1e-9),
        "call metrics": all(
            math.isclose(float(all_sum(value)), float(whole["metrics"][key]), rel_tol=1e-6, abs_tol=1e-9)
            for key, value in mine["metrics"].items()
        )
        and mine["metrics"].keys() == whole["metrics"].keys(),
        "prepare metrics": mine["prepared"].keys() == whole["prepared"].keys()
        and all(
            math.isclose(float(value), float(whole["prepared"][key]), rel_tol=1e-12)
            for key, value in mine["prepared"].items()
        ),
    }
    prepared = {key: float(value) for key, value in whole["prepared"].items()}
    return {"name": name, "checks": checks, "prepared": prepared, "loss": float(whole["loss"])}


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = []
    for num_bins in (1024, 1):  # 1: one bin, the search sorts every value above sqrt(tau)
        with mock.patch.object(second_moment, "NUM_BINS", num_bins):
            cases.append(compare(f"m2po bins{num_bins}", M2POLoss(), rank))
            cases.append(compare(f"m2po tau=0.01 bins{num_bins}", M2POLoss(tau=0.01), rank))
            cases.append(compare(f"m2po_cap global bins{num_bins}", M2POCapLoss(scope="global"), rank))
            for tau in (0.01, 0.04):
                cases.append(
                    compare(f"m2po ties tau={tau} bins{num_bins}", M2POLoss(tau=tau), rank, tied=True)
                )
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({"rank": rank, "cases": cases}, indent=1))
    dist.destroy_process_group()
    return 0 if all(all(case["checks"].values()) for case in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
