"""Bytes each node sends between nodes per rollout step, FSDP against HSDP, from the code's own sizes.

A colocated step of a recipe runs, per optimizer update, the no-grad global pass (M2PO's
`score_first`) and the training forwards and backwards over every micro-batch, then pushes the
weights into each rank's engine once per step (`HFWeights.stream`: one `full_tensor()` per
parameter, fp32 master weights). FSDP2 gathers a layer's bf16 parameters before its forward and
again before its backward (resharded after forward), reduce-scatters its fp32 gradients after each
micro-batch's backward; with replicas (HSDP), gathers and reduce-scatters stay in the shard group
and the gradients cross between replicas once per backward pass (`Learner._backward`: all-reduced at
the pass's last micro-batch).

What crosses the network is the collectives over groups that span nodes. For a group over `n` nodes,
each node sends at least (n - 1) / n of an all-gather's or reduce-scatter's whole size and twice that
for an all-reduce (ring or tree, as NCCL runs them); those lower bounds are what the table shows. The
rollout rows' all-to-all (token ids and logprobs, ~1 MB a node a step at the 8B recipe) is left out.
Parameter counts come from torchtitan's build of the model on the meta device, micro-batch counts
from the recipe.

    .venv/bin/python bench/network_bytes.py [--recipe R] [--gpus-per-node 8] [--nodes 2 4]

Prints a markdown table per model (docs/cluster.md keeps them).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from local_model import QWEN3_8B, QWEN25_32B, Qwen3Shape
from memory_budget import model_sizes

from m2po_cli.config import Recipe, load_recipe

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
PARAM_BYTES, GRAD_BYTES, MASTER_BYTES = 2, 4, 4  # bf16 gathers, fp32 gradient reduce, fp32 push
STATE_BYTES = 16  # fp32 master weights, two AdamW moments and gradients, sharded over a shard group
NODE_BANDWIDTH = 400 * GB  # 8 x 400 Gb/s InfiniBand NICs, a common 8-GPU node (an assumption)


@dataclass(frozen=True)
class Layout:
    nodes: int
    shard_nodes: int  # nodes one shard group spans (whole nodes: `[parallel]` holds a group to them)

    @property
    def replicate(self) -> int:
        return self.nodes // self.shard_nodes


def micro_batches(recipe: Recipe, world: int) -> int:
    """Micro-batches per rank per optimizer update (every rank runs the busiest rank's count)."""
    rows = recipe.prompts_per_update * recipe.rollout.n
    return math.ceil(math.ceil(rows / world) / recipe.train.micro_batch_sequences)


def step_bytes(recipe: Recipe, params: int, gpus_per_node: int, layout: Layout) -> dict[str, float]:
    """Bytes each node sends to other nodes in one rollout step, by kind."""
    m, updates = micro_batches(recipe, layout.nodes * gpus_per_node), recipe.updates_per_step
    span = layout.shard_nodes
    across_shard = (span - 1) / span  # share of a shard group's collective that leaves the node
    gather, reduce = PARAM_BYTES * params * across_shard, GRAD_BYTES * params * across_shard
    global_pass = recipe.loss.type == "m2po"
    out = {
        "global pass gathers": updates * m * gather if global_pass else 0.0,
        "training gathers": updates * m * 2 * gather,
        "gradient reduce-scatters": updates * m * reduce,
        "weight push gathers": MASTER_BYTES * params * across_shard,
    }
    r = layout.replicate
    # Replicas: one all-reduce of each node's fp32 gradients per update (one backward pass).
    out["gradient all-reduce (replicas)"] = updates * 2 * GRAD_BYTES * params / span * (r - 1) / r
    return out


def table(recipe: Recipe, shape: Qwen3Shape, name: str, gpus_per_node: int, nodes: list[int]) -> str:
    params = model_sizes(shape).total
    lines = [
        f"{name}: {params / 1e9:.2f} B parameters, {recipe.updates_per_step} updates a step, "
        f"{gpus_per_node} GPUs a node",
        "",
        "| nodes | layout | learner state a GPU | micro-batches a rank an update | sent by each node a step | "
        f"gathers | gradients | weight push | at {NODE_BANDWIDTH / GB:.0f} GB/s a node |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in nodes:
        world = n * gpus_per_node
        layouts = [(f"FSDP, dp_shard {world}", Layout(n, n))]
        for span in (1, 2):
            if n % span == 0 and n // span > 1:
                layouts.append(
                    (f"HSDP, dp_replicate {n // span} x dp_shard {span * gpus_per_node}", Layout(n, span))
                )
        for label, layout in layouts:
            b = step_bytes(recipe, params, gpus_per_node, layout)
            gathers = b["global pass gathers"] + b["training gathers"]
            grads = b["gradient reduce-scatters"] + b["gradient all-reduce (replicas)"]
            total = sum(b.values())
            state = STATE_BYTES * params / (layout.shard_nodes * gpus_per_node)
            lines.append(
                f"| {n} | {label} | {state / GB:.1f} GB | {micro_batches(recipe, world)} | {total / GB:,.0f} GB | "
                f"{gathers / GB:,.0f} GB | {grads / GB:,.0f} GB | {b['weight push gathers'] / GB:,.0f} GB | "
                f"{total / NODE_BANDWIDTH:,.1f} s |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "qwen3-8b-s256.toml")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    recipe = load_recipe(args.recipe)
    print(table(recipe, QWEN3_8B, f"{args.recipe.name}", args.gpus_per_node, args.nodes))
    print()
    # The 32B model on the same batch, two sequences a micro-batch (docs/cluster.md: what fits).
    big = load_recipe(args.recipe, ["train.micro_batch_sequences=2"])
    name = "Qwen2.5-32B shapes (without its q/k/v biases), micro_batch_sequences = 2"
    print(table(big, QWEN25_32B, name, args.gpus_per_node, args.nodes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
