"""One step's updates as the loop runs them without reuse, for the tests and their workers (no pytest
fixtures here: a worker under torchrun imports it too)."""

from __future__ import annotations


def train_once(batch, learner, recipe, sync=None, recorder=None) -> dict[str, float]:
    """Step 0's updates of `batch` (one pass) with the recipe's loss: `train_on` as the loop calls it
    without reuse, recording nothing unless given a `recorder`; `sync(learner)` after each update."""
    from m2po_cli.config import InspectConfig
    from m2po_cli.loss import build_loss
    from m2po_cli.record import Recorder
    from m2po_cli.schedule import Schedule
    from m2po_cli.train.reuse import plan_passes
    from m2po_cli.train.updates import train_on

    if recorder is None:
        recorder = Recorder(recipe.run_dir, InspectConfig(every=0), 0, learner.rank, learner.world)
    plan = plan_passes(batch, Schedule.of(recipe))
    return train_on(plan, learner, build_loss(recipe.loss), sync, recipe, recorder, 0)
