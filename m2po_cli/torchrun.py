"""The launch this process is part of, as torchrun's environment describes it, read in one place.

Without torchrun a process is a one-rank launch on one node. torchrun sets all four variables; a
launcher that sets `WORLD_SIZE` alone puts every process on one node. Imports nothing heavy: the CLI
checks a launch against the recipe before torch loads.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Launch:
    rank: int
    world: int
    local_rank: int
    local_world: int  # processes on this node
    torchrun: bool  # started by torchrun (or a launcher that sets RANK): join its process group

    @property
    def nodes(self) -> int:
        return self.world // self.local_world


def launch() -> Launch:
    env = os.environ
    world = int(env.get("WORLD_SIZE", 1))
    return Launch(
        rank=int(env.get("RANK", 0)),
        world=world,
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world=int(env.get("LOCAL_WORLD_SIZE", world)),
        torchrun="RANK" in env,
    )
