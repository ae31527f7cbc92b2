"""Run by tests/rollout/test_engine_per_rank.py under torchrun: every rank's own engine, pushes, probes.

Each rank builds its in-process engine (`external_launcher`). First the train loop's own rollout
step (`train.colocated.rollout`, with a grader on each rank) samples one batch: the record keeps the prompts
and responses this rank's engine was asked for and the rows the rank holds afterwards. Then, with
random rewards so the weights move, each rank generates its share of the prompts, packs it, trains
on the rows `distribute` gives it with the other ranks, and after each update first checks that a
skipped push is caught (version check, probe gap), then pushes and probes again. Writes
OUT/rank<r>.json.

With a second argument TP > 1, groups of TP ranks share one tensor-parallel engine (each rank holds
its slices of the weights and loads its slices at every push); the `train.colocated.rollout` record is left
out, the pushes and probes are the same.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from m2po_cli.config import load_recipe
from m2po_cli.data import PromptBatches, encode_prompt, load_problems
from m2po_cli.grader import Grader, grader_workers
from m2po_cli.learner.policy import Learner
from m2po_cli.models import resolve_model
from m2po_cli.rollout.engine import VLLMEngine
from m2po_cli.rollout.episode import Episodes, one_turn
from m2po_cli.rollout.settings import request_seed
from m2po_cli.rollout.types import Completion
from m2po_cli.schedule import Schedule
from m2po_cli.train.colocated import Sampler, engine_share, rollout
from m2po_cli.train.pack import pack_groups
from m2po_cli.train.packed import PackedRollouts, distribute
from m2po_cli.train.push import Pusher
from tests.probes import require_version
from tests.rollout.test_weight_sync import logprob_gap, no_record
from tests.steps import train_once

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"
PROBLEMS = [(1, 2), (3, 4), (2, 2), (4, 0)]


class SeenEngine(VLLMEngine):
    """The real engine; it also remembers what it was asked to sample and what it answered."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[dict] = []

    def generate(self, prompts: list[list[int]], seeds: list[int], max_tokens=None) -> list[list[Completion]]:
        groups = super().generate(prompts, seeds, max_tokens)
        answers = [[c.token_ids for c in group] for group in groups]
        self.asked.append({"prompts": prompts, "seeds": seeds, "responses": answers})
        return groups


def train_rollout(engine: SeenEngine, tokenizer, learner) -> dict:
    """One batch of 4 prompts x 8 through `train.colocated.rollout`, 2 updates per batch, so rank 0 trains
    prompts 0 and 2 and rank 1 prompts 1 and 3, whoever sampled them."""
    recipe = load_recipe(
        QUICKSTART,
        ['model.path="builtin:tiny-qwen3"', "rollout.prompts_per_step=4", "train.mini_batch_prompts=2"],
    )
    problems = load_problems(recipe.data)
    prompts = PromptBatches(problems, tokenizer, recipe.data, recipe.rollout.prompts_per_step)
    expected = [p.token_ids for p in next(PromptBatches(problems, tokenizer, recipe.data, 4))]
    engine.asked = []
    with Grader(grader_workers(1)) as grader:
        sampler = Sampler(engine, grader, Episodes.one_turn(recipe))
        batch = rollout(sampler, prompts, learner, recipe, no_record(recipe, learner), 0)
    tokens = [t.tolist() for t in batch.tokens_N.split(batch.lengths_B.tolist())]
    return {
        "batch_prompts": expected,
        "asked": list(engine.asked),  # a copy: the engine goes on sampling
        "rows": batch.row_B.tolist(),
        "row_tokens": tokens,
        "prompt_len": batch.prompt_len_B.tolist(),
        "meta": batch.meta,
    }


def gathered_batch(engine, tokenizer, recipe, learner, seed: int) -> tuple[PackedRollouts, list]:
    """Each engine samples its share of PROBLEMS, its group's first rank packs it; `distribute`
    gives each rank its rows."""
    prompts = [encode_prompt(tokenizer, "{problem}", f"{a}+{b}") for a, b in PROBLEMS]
    tp = recipe.rollout.tensor_parallel_size
    share = list(engine_share(learner.rank, learner.world, tp, len(prompts))[1])
    groups = engine.generate([prompts[i] for i in share], [request_seed(seed, i) for i in share])
    n, a = recipe.rollout.n, recipe.algorithm
    gen = torch.Generator().manual_seed(seed)
    rewards_PG = torch.randint(0, 2, (len(prompts), n), generator=gen).float()
    pack = PackedRollouts.empty(learner.version)
    if learner.rank % tp == 0:
        mine = [prompts[i] for i in share]
        pack = pack_groups(
            learner.version,
            share[0] * n,
            mine,
            one_turn(groups),
            rewards_PG[share],
            a.normalize_std,
            a.std_eps,
        )
    batch = distribute(pack, Schedule.of(recipe))
    return batch, [(i, [c.token_ids for c in g]) for i, g in zip(share, groups, strict=True)]


def embedding_rows(worker) -> tuple[int, int]:
    """(rows of the input embedding this rank's engine holds, vocabulary size); run in the worker."""
    rows = worker.model_runner.get_model().model.embed_tokens.weight.shape[0]
    return rows, worker.model_runner.model_config.get_vocab_size()


def main(out: Path, tp: int) -> None:
    torch.set_num_threads(1)
    recipe = load_recipe(
        QUICKSTART,
        [
            'model.path="builtin:tiny-qwen3"',
            "optim.lr=0.02",
            "rollout.prompts_per_step=4",
            'loss={type="grpo"}',
            f"rollout.tensor_parallel_size={tp}",
        ],
    )
    model_dir = resolve_model(recipe.model.path)
    learner = Learner(model_dir, recipe)
    engine = SeenEngine(model_dir, recipe.rollout, "float32", 64, world=learner.world)
    tokenizer = engine.tokenizer
    probe = [
        encode_prompt(tokenizer, "{problem}", p) + tokenizer.encode(a, add_special_tokens=False)
        for p, a in [("3+4", "\\boxed{7}"), ("12+30", "\\boxed{42}"), ("0+0", "\\boxed{1}")]
    ]
    record = {"rank": learner.rank, "world": learner.world, "generated": [], "gaps": [], "stale": []}
    record["skips_caught"] = 0
    pusher = Pusher(learner, engine, out, recipe.model.path, len(tokenizer))
    record["embedding_rows"], record["vocab"] = engine.llm.collective_rpc(embedding_rows)[0]
    try:
        if tp == 1:
            t0 = time.perf_counter()
            record["rollout"] = train_rollout(engine, tokenizer, learner)
            record["rollout"]["seconds"] = time.perf_counter() - t0
        record["gaps"].append(logprob_gap(engine, learner, probe))
        for step in range(2):
            batch, mine = gathered_batch(engine, tokenizer, recipe, learner, seed=step)
            record["generated"].append(mine)
            train_once(batch, learner, recipe)  # no engine: the push is skipped
            record["stale"].append(logprob_gap(engine, learner, probe))
            try:
                require_version(engine, learner.version)
            except RuntimeError:
                record["skips_caught"] += 1
            pusher.push()  # and its check
            require_version(engine, learner.version)
            record["gaps"].append(logprob_gap(engine, learner, probe))
    finally:
        engine.close()
    (out / f"rank{record['rank']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
