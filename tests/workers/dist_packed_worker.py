"""Run by tests/train/test_packed.py under `torchrun --nproc-per-node 2`: `distribute` on two ranks.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/dist_packed_worker.py OUT

Rank r holds the rows of `tests.train.test_packed.spanned_pack` with r == row % 2 (a rank may hold
rows another trains); every rank writes the rows it receives, field by field, to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from m2po_cli.train.packed import distribute
from tests.train.test_packed import SCHEDULE, spanned_pack


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pack = spanned_pack()
    mine = pack.take((pack.row_B % 2 == rank).nonzero().squeeze(1))
    mine.meta = {"rank": float(rank)}
    received = distribute(mine, SCHEDULE)
    torch.save(
        {"version": received.version, "meta": received.meta, **received.tensors()},
        Path(sys.argv[1]) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
