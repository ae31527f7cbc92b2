"""How often M2PO's stopping point falls inside a run of equal M2, on a run's recorded tokens.

For each recorded update and each tau: the tokens Algorithm 1 masks one at a time (what the loss
does), and the tokens a rule that lets equal M2 leave together would mask, both counted by a plain
loop over the recorded z = log r * sign(A); the updates where they differ are those whose stopping
point fell inside a tie. Then, at the run's own tau, `m2po inspect ratios`' count (through the
training loss) and the run's logged `m2po/num_masked` for each recorded update. docs/losses.md
keeps a run of the quickstart.

    .venv/bin/python bench/tie_frequency.py runs/quickstart [--taus 0.01,0.02,0.04,0.08]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from m2po_cli.config import load_recipe
from m2po_cli.inspection.ratios import acted_on
from m2po_cli.record import load_records


def one_at_a_time(m2_desc: list[float], tau: float) -> int:
    """Tokens that leave while the mean of the rest exceeds tau, the largest first."""
    n, total, gone = len(m2_desc), math.fsum(m2_desc), 0
    while gone < n and total / (n - gone) > tau:
        total -= m2_desc[gone]
        gone += 1
    return gone


def together(m2_desc: list[float], tau: float) -> int:
    """The same loop, with every token of the largest M2 leaving at once."""
    n, total, gone = len(m2_desc), math.fsum(m2_desc), 0
    while gone < n and total / (n - gone) > tau:
        value = m2_desc[gone]
        while gone < n and m2_desc[gone] == value:
            total -= m2_desc[gone]
            gone += 1
    return gone


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--taus", default="0.01,0.02,0.04,0.08")
    args = ap.parse_args()
    records = load_records(args.run)
    s = records.sample
    log_r_N = (s.logprobs_N - s.behaviour_logprobs_N).float()  # as the loss forms it
    sign_N = s.advantages_R.sign().repeat_interleave(s.lengths_R)
    z_N = (log_r_N * sign_N).double()
    update_N = s.update_R.repeat_interleave(s.lengths_R)
    updates = s.update_R.unique().tolist()
    m2 = {u: sorted((z_N[(update_N == u) & (z_N > 0)] ** 2).tolist(), reverse=True) for u in updates}
    print(
        f"{args.run}: {len(updates)} recorded updates, {len(z_N):,} tokens, "
        f"{sum(len(v) for v in m2.values()):,} in the trust region\n"
    )
    print(
        "| tau | Algorithm 1 (one at a time) | equal M2 together | extra | updates with a tie at the stop |"
    )
    print("|---|---|---|---|---|")
    for tau in (float(t) for t in args.taus.split(",")):
        ours = {u: one_at_a_time(v, tau) for u, v in m2.items()}
        tied = {u: together(v, tau) for u, v in m2.items()}
        fired = [u for u in updates if tied[u] != ours[u]]
        extra = sum(tied.values()) - sum(ours.values())
        share = f" ({100 * extra / max(sum(ours.values()), 1):.1f}%)" if extra else ""
        print(
            f"| {tau:g} | {sum(ours.values())} | {sum(tied.values())} | +{extra}{share} | "
            f"{len(fired)} of {len(updates)} |"
        )
    recipe = load_recipe(args.run / "config.toml")
    if recipe.loss.type == "m2po":
        _, per_update = acted_on(recipe.loss, records, recipe.algorithm.behaviour_logprobs)
        logged = {}
        for line in (args.run / "metrics.jsonl").read_text().splitlines():
            step = json.loads(line)
            logged[step["step"]] = step.get("m2po/num_masked")
        inspect = [u["acted"] for u in per_update]
        literal = [one_at_a_time(m2[u["update"]], recipe.loss.tau) for u in per_update]
        training = [logged.get(u["step"]) for u in per_update]
        same = inspect == literal == [round(t) if t is not None else None for t in training]
        print(
            f"\nat the run's tau {recipe.loss.tau:g}: inspect {sum(inspect)}, one at a time {sum(literal)}, "
            f"training's m2po/num_masked {sum(t or 0 for t in training):g} "
            f"(update by update: {'equal' if same else 'DIFFERENT'})"
        )
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
