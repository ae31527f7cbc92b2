"""The rollout data path at scale: before (the list-based baseline, kept here) and after, in one run.

Measured at small size on this machine, then extrapolated to the 8B recipe (256 prompts x 8 samples,
responses up to 2,560 tokens, s = 256 so K = 64 batches in the FIFO, 8 ranks):
- host bytes per response token of the staleness FIFO, per rank;
- seconds and bytes to checkpoint and reload the queue;
- forward passes per optimizer update for m2po and grpo (counted by a hook on the model);
- the full-update time ratio m2po / grpo on SmolLM2-135M;
- peak bytes of the logprob step (a fresh process each, peak RSS);
- padding overhead of the micro-batches.

"Baseline" below is the code this path replaced, kept in this file only: rollout rows as Python
lists broadcast whole to every rank and pickled into `loop.pt`; logprobs and entropies from the full
`[B, L, V]` logits; M2PO's global pass with entropies; every rank scoring every row at the behaviour
version; micro-batches of `micro_batch_sequences` rows in row order.

    PYTHONPATH=. .venv/bin/python bench/bench_scale.py [--rows 8] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The 8B recipe (recipes/qwen3-8b-s256.toml) and the sizes it implies.
PAPER = dict(prompts=256, n=8, max_response=2560, ranks=8, queue=64, updates=4, micro=8, vocab=151_936)
# Assumed for the extrapolation: mean response and prompt lengths of a DeepScaleR batch mid-run.
MEAN_RESPONSE, MEAN_PROMPT = 1_500, 150


# --- baseline: the replaced code, literally --------------------------------------------------------


@dataclass
class BaselineRolloutBatch:
    version: int
    problem_ids: list[int]
    answers: list[str]
    prompts: list[list[int]]
    responses: list[list[int]]
    behaviour_logprobs: list[list[float]]
    texts: list[str]
    finished: list[bool]
    rewards_PG: torch.Tensor
    learner_logprobs: list[list[float]] | None = None
    meta: dict = field(default_factory=dict)


def baseline_token_logprobs(logits_BLV, tokens_BL, temperature):
    logp_BLV = torch.log_softmax(logits_BLV[:, :-1].float() / temperature, dim=-1)
    picked_BL = logp_BLV.gather(-1, tokens_BL[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked_BL, (1, 0))


def baseline_token_entropy(logits_BLV, temperature):
    logp_BLV = torch.log_softmax(logits_BLV[:, :-1].float() / temperature, dim=-1)
    return torch.nn.functional.pad(-(logp_BLV.exp() * logp_BLV).sum(-1), (1, 0))


def baseline_forward(learner, batch, with_entropy=False):
    logits = learner.model(batch.tokens_BL)  # the head unrequested: full [B, L, V] logits
    t = learner.recipe.rollout.temperature
    lp = baseline_token_logprobs(logits, batch.tokens_BL, t)
    return lp, baseline_token_entropy(logits.detach(), t) if with_entropy else None


def _rows(batch, start, stop):
    return batch.take(torch.arange(start, stop))


@torch.no_grad()
def baseline_score(learner, batch):
    mb = learner.recipe.train.micro_batch_sequences
    lps, ents = [], []
    for start in range(0, batch.num_rows, mb):
        part = _rows(batch, start, min(start + mb, batch.num_rows))
        lp, ent = baseline_forward(learner, part, with_entropy=True)
        lps.append(torch.nn.functional.pad(lp, (0, batch.tokens_BL.shape[1] - lp.shape[1])))
        ents.append(torch.nn.functional.pad(ent, (0, batch.tokens_BL.shape[1] - ent.shape[1])))
    return torch.cat(lps), torch.cat(ents)


def baseline_update(learner, batch, loss_fn, num_tokens):

    mb = learner.recipe.train.micro_batch_sequences
    aux_BL = None
    if loss_fn.needs_global_pass:
        current_BL, _ = baseline_score(learner, batch)
        log_ratio_BL = (current_BL - batch.behaviour_logprobs_BL) * batch.mask_BL
        aux_BL, _ = loss_fn.prepare(log_ratio_BL, batch.advantages_BL, batch.mask_BL)
    for start in range(0, batch.num_rows, mb):
        stop = min(start + mb, batch.num_rows)
        part = _rows(batch, start, stop)
        lp, _ = baseline_forward(learner, part)
        aux = aux_BL[start:stop, : part.tokens_BL.shape[1]] if aux_BL is not None else None
        loss, _ = loss_fn(lp, part.behaviour_logprobs_BL, part.advantages_BL, part.mask_BL, aux, num_tokens)
        loss.backward()
    learner.optimizer.zero_grad(set_to_none=True)  # timing only: the weights stay put


# --- synthetic rollouts -------------------------------------------------------------------------


def synthetic_groups(prompts: int, n: int, max_response: int, vocab: int, seed: int = 0):
    """Completions with a wide length spread (log-normal, capped), random tokens and logprobs."""
    from m2po_cli.rollout.types import Completion

    g = torch.Generator().manual_seed(seed)
    prompt_ids, groups = [], []
    for _ in range(prompts):
        prompt_ids.append(
            torch.randint(300, vocab, (int(torch.randint(40, 80, (1,), generator=g)),), generator=g).tolist()
        )
        lengths = (torch.randn(n, generator=g) * 0.8).exp() * max_response / 3
        group = []
        for k in lengths.clamp(1, max_response).long().tolist():
            tokens = torch.randint(300, vocab, (k,), generator=g).tolist()
            group.append(
                Completion(tokens, (-torch.rand(k, generator=g)).tolist(), "x" * (4 * k), k < max_response)
            )
        groups.append(group)
    return prompt_ids, groups, torch.randint(0, 2, (prompts, n), generator=g).float()


def baseline_batch(prompt_ids, groups, rewards_PG) -> BaselineRolloutBatch:
    samples = [c for g in groups for c in g]
    return BaselineRolloutBatch(
        version=0,
        problem_ids=list(range(len(prompt_ids))),
        answers=["42"] * len(prompt_ids),
        prompts=[list(p) for p in prompt_ids],
        responses=[list(c.token_ids) for c in samples],
        behaviour_logprobs=[list(c.logprobs) for c in samples],
        texts=[str(c.text) for c in samples],
        finished=[c.finished for c in samples],
        rewards_PG=rewards_PG,
    )


def python_bytes(build) -> int:
    """Bytes the Python heap holds for what `build()` returns (tracemalloc)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build()
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del kept
    return size


# --- the measurements -----------------------------------------------------------------------------


def fifo_and_checkpoint(report) -> None:
    from m2po_cli.rollout.episode import one_turn
    from m2po_cli.train.fifo import StalenessQueue
    from m2po_cli.train.pack import pack_groups

    prompt_ids, groups, rewards_PG = synthetic_groups(32, 8, 1024, 49_152)
    response_tokens = sum(len(c.token_ids) for g in groups for c in g)

    blob = pickle.dumps(baseline_batch(prompt_ids, groups, rewards_PG))

    def old_with_python_ints():
        # What each rank held: broadcast_object_list unpickles a fresh copy of every list and number.
        return pickle.loads(blob)

    old_bytes = python_bytes(old_with_python_ints)
    pack = pack_groups(0, 0, prompt_ids, one_turn(groups), rewards_PG, True, 1e-6)
    old_per_token, new_per_token = old_bytes / response_tokens, pack.num_bytes / response_tokens
    report.row("FIFO bytes per response token, one batch", old_per_token, new_per_token, "B")
    p = PAPER
    tokens = p["prompts"] * p["n"] * MEAN_RESPONSE
    # Baseline: every rank holds the whole FIFO (K + 1 batches); now: its 1/8 of the rows.
    old_rank = old_per_token * tokens * (p["queue"] + 1)
    new_rank = new_per_token * tokens * (p["queue"] + 1) / p["ranks"]
    report.row("8B: FIFO host memory per rank (K + 1 = 65 batches)", old_rank / 1e9, new_rank / 1e9, "GB")

    queue_batches = 4
    old_queue = [old_with_python_ints() for _ in range(queue_batches)]
    queue = StalenessQueue(queue_batches)
    for _ in range(queue_batches):
        queue.push(pack_groups(0, 0, prompt_ids, one_turn(groups), rewards_PG, True, 1e-6))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        torch.save({"queue": old_queue}, folder / "loop.pt")
        t_old_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.load(folder / "loop.pt", weights_only=False)
        t_old_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        path = queue.save(folder, 0, 1)
        t_new_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        StalenessQueue(queue_batches).load(folder, 0, 1)
        t_new_load = time.perf_counter() - t0
        old_size, new_size = (folder / "loop.pt").stat().st_size, path.stat().st_size
    per_batch_tokens = response_tokens
    report.row(
        "queue checkpoint: save s per batch", t_old_save / queue_batches, t_new_save / queue_batches, "s"
    )
    report.row(
        "queue checkpoint: load s per batch", t_old_load / queue_batches, t_new_load / queue_batches, "s"
    )
    report.row(
        "queue checkpoint: bytes per response token",
        old_size / queue_batches / per_batch_tokens,
        new_size / queue_batches / per_batch_tokens,
        "B",
    )
    scale = tokens / per_batch_tokens * p["queue"] / queue_batches  # 64 batches of the 8B size
    # Baseline: rank 0 pickles every batch; now each rank writes its own 1/8 at the same time.
    report.row("8B: queue save s (slowest rank)", t_old_save * scale, t_new_save * scale / p["ranks"], "s")
    report.row("8B: queue bytes on disk (all ranks)", old_size * scale / 1e9, new_size * scale / 1e9, "GB")
    report.row(
        "8B: queue bytes read on resume per rank",
        old_size * scale / 1e9,
        new_size * scale / p["ranks"] / 1e9,
        "GB",
    )


class TokenCounter:
    """Tokens through the model's forward: `[B, L]` inputs, counted as B x L."""

    def __init__(self, model):
        self.tokens = 0
        model.register_forward_pre_hook(lambda module, args: self.add(args[0]))

    def add(self, tokens_BL):
        self.tokens += tokens_BL.numel()


def log_ratio_noise(shape, scale: float, seed: int) -> torch.Tensor:
    """Synthetic log r per token: 0.05 x normal + `scale` x Student-t(2) (a heavy tail, so a small
    share of tokens is masked; `scale` = 0.1 masks about 0.3%)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) / torch.empty(shape).exponential_(generator=g).sqrt()  # chi2(2) / 2
    return 0.05 * torch.randn(shape, generator=g) + scale * t


def passes_and_timing(report, args) -> None:
    from m2po_cli.config import load_recipe
    from m2po_cli.config.loss import GRPOLoss, M2POLoss
    from m2po_cli.learner.policy import Learner
    from m2po_cli.loss import build_loss
    from m2po_cli.models import resolve_model
    from m2po_cli.rollout.episode import one_turn
    from m2po_cli.train.colocated import MISMATCH_SAMPLE_ROWS, score_at_behaviour_version
    from m2po_cli.train.pack import pack_groups

    with tempfile.TemporaryDirectory() as tmp:
        quickstart = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.toml"
        overrides = [
            f'run.output_dir="{tmp}"',
            'model.path="builtin:smollm2-135m-instruct"',
            f"train.micro_batch_sequences={args.micro}",
            "optim.lr=1e-9",  # the weights stay put, so every update sees the same ratios
        ]
        recipe = load_recipe(quickstart, overrides)
        learner = Learner(resolve_model(recipe.model.path), recipe)
    vocab = learner.arch.hf_config["vocab_size"]
    prompt_ids, groups, rewards_PG = synthetic_groups(args.rows // 4, 4, args.max_response, vocab, seed=1)
    pack = pack_groups(0, 0, prompt_ids, one_turn(groups), rewards_PG, True, 1e-6)
    batch = pack.to_batch(torch.arange(pack.num_rows))
    current_BL, _ = learner.score(batch)
    num_tokens = int(batch.mask_BL.sum())
    real = int(batch.lengths_B.sum())
    counter = TokenCounter(learner.model)
    losses = {"m2po": build_loss(M2POLoss()), "grpo": build_loss(GRPOLoss())}
    seeds = iter(range(10**6))

    def run(which: str, name: str) -> dict:
        """One update: the baseline code, or the learner with `global_pass` = `which`; behaviour
        logprobs redrawn each time (the same distribution), as a new batch would be."""
        noise_BL = log_ratio_noise(batch.mask_BL.shape, args.noise, next(seeds))
        batch.behaviour_logprobs_BL = (current_BL - noise_BL) * batch.mask_BL
        if which == "baseline":
            return baseline_update(learner, batch, losses[name], num_tokens) or {}
        train = learner.recipe.train.model_copy(update={"global_pass": which})
        learner.recipe = learner.recipe.model_copy(update={"train": train})
        return learner.update(batch, losses[name], num_tokens)

    # The learner's two ways to M2PO's mask: `score_first` (a no-grad pass, then the training
    # passes) and `correct_after` (the mask from the training passes, then a correction).
    plan = [("baseline", "grpo"), ("baseline", "m2po"), ("auto", "grpo"), ("score_first", "m2po")]
    plan.append(("correct_after", "m2po"))
    run("correct_after", "m2po")  # sets the provisional threshold from a batch like the others
    # Forward passes per update, in units of the update's own tokens (one forward of every row = 1).
    counts, times, fracs, masked = {}, {key: [] for key in plan}, [], []
    for key in plan:
        counter.tokens = 0
        run(*key)
        counts[key] = counter.tokens / real
    for _ in range(args.repeats):
        for key in plan:
            t0 = time.perf_counter()
            metrics = run(*key)
            times[key].append(time.perf_counter() - t0)
            if key[0] == "correct_after":
                fracs.append(metrics["m2po/correction_frac"])
                masked.append(metrics["m2po/num_masked"] / num_tokens)
    counter.tokens = 0
    baseline_score(learner, batch)
    score_before = counter.tokens / real
    counter.tokens = 0
    score_at_behaviour_version(pack, learner, everything=False, group_size=4)
    score_after = counter.tokens / real
    for name, after in (("grpo", "auto"), ("m2po", "score_first")):
        report.row(
            f"forwards per update, {name} (this run, 1 rank)",
            counts[("baseline", name)],
            counts[(after, name)],
            "x",
        )
    report.row(
        f"forwards per update, m2po, score_first -> correct_after ({100 * statistics.mean(masked):.2f}% masked)",
        counts[("score_first", "m2po")],
        counts[("correct_after", "m2po")],
        "x",
    )
    report.row("behaviour-version scoring per rollout batch (1 rank)", score_before, score_after, "x")
    p = PAPER
    # At 8 ranks with 4 updates per batch: the baseline scored all 2,048 rows on each rank, 8x a rank's
    # share, once per 4 updates; now each rank scores a sample of MISMATCH_SAMPLE_ROWS of its rows.
    rows_per_rank = p["prompts"] * p["n"] // p["ranks"]
    old_scoring = p["ranks"] / p["updates"]
    new_scoring = MISMATCH_SAMPLE_ROWS / rows_per_rank / p["updates"]
    for name, global_pass in (("m2po", 1), ("grpo", 0)):
        report.row(
            f"8B: forwards per update per rank, {name} (incl. scoring, score_first)",
            1 + global_pass + old_scoring,
            1 + global_pass + new_scoring,
            "x",
        )
    median = {k: statistics.median(v) for k, v in times.items()}
    grpo_before, grpo_after = median[("baseline", "grpo")], median[("auto", "grpo")]
    report.row("SmolLM2-135M full update, grpo", grpo_before, grpo_after, "s")
    report.row(
        "SmolLM2-135M full update, m2po", median[("baseline", "m2po")], median[("score_first", "m2po")], "s"
    )
    report.row(
        "SmolLM2-135M full-update ratio m2po / grpo (baseline -> score_first)",
        median[("baseline", "m2po")] / grpo_before,
        median[("score_first", "m2po")] / grpo_after,
        "x",
    )
    report.row(
        f"SmolLM2-135M full-update ratio m2po / grpo (score_first -> correct_after, "
        f"correction {100 * statistics.mean(fracs):.1f}% of tokens)",
        median[("score_first", "m2po")] / grpo_after,
        median[("correct_after", "m2po")] / grpo_after,
        "x",
    )

    from m2po_cli.learner.batch import micro_batches, padding_overhead

    old_parts = [
        torch.arange(s, min(s + args.micro, len(batch.lengths_B)))
        for s in range(0, len(batch.lengths_B), args.micro)
    ]
    new_parts = micro_batches(batch.lengths_B, args.micro, 0)
    report.row(
        "padding overhead, this batch (padded / real tokens)",
        padding_overhead(batch.lengths_B, old_parts),
        padding_overhead(batch.lengths_B, new_parts),
        "x",
    )


def correction_at_paper_size(report, noise: float) -> None:
    """M2PO's update cost at the 8B recipe's sizes, from the mask on synthetic log-ratios.

    One update: 512 rows (64 per rank), responses of the length spread of `synthetic_groups`, log r
    from `log_ratio_noise`, consecutive updates drawing new ratios from the same distribution.
    With F = one forward over a rank's tokens (2 x 8e9 params x tokens FLOPs), backward = 2F:
    grpo costs 3F, `score_first` 4F (its no-grad pass: F, about 1/3 of forward + backward), and
    `correct_after` 3F + 3fF, f = the share of the rank's tokens its correction runs over (each row
    with a changed token, up to its last one). So m2po / grpo = 4/3 before and 1 + f after, taken
    at the slowest rank (collectives wait for it); `auto` falls back to `score_first` when f > 1/3.
    """
    from m2po_cli.config.loss import M2POLoss
    from m2po_cli.learner.mask_correction import correction_rows, provisional_keep
    from m2po_cli.loss import build_loss

    p, loss_fn = PAPER, build_loss(M2POLoss())
    rows = p["prompts"] * p["n"] // p["updates"]
    _, groups, _ = synthetic_groups(rows // p["n"], p["n"], p["max_response"], 1000, seed=3)
    response_B = torch.tensor([len(c.token_ids) for g in groups for c in g])
    lengths_B = MEAN_PROMPT + response_B
    columns_L = torch.arange(int(lengths_B.max()))
    mask_BL = ((columns_L >= MEAN_PROMPT) & (columns_L < lengths_B[:, None])).float()
    g = torch.Generator().manual_seed(4)
    advantages_B = torch.randn(rows, generator=g).sign()  # +-1, as 0/1 rewards give
    advantages_BL = advantages_B[:, None].expand_as(mask_BL)
    threshold, shares, masked = math.inf, {math.inf: [], "previous": []}, []
    for seed in range(6):
        log_ratio_BL = log_ratio_noise(mask_BL.shape, noise, 100 + seed) * mask_BL
        keep_BL, metrics = loss_fn.prepare(log_ratio_BL, advantages_BL, mask_BL)
        for key, limit in ((math.inf, math.inf), ("previous", threshold)):
            provisional_BL = provisional_keep(log_ratio_BL, advantages_BL, mask_BL.bool(), limit)
            rows_K, cut_K, _ = correction_rows(keep_BL, provisional_BL)
            cut_B = torch.zeros_like(lengths_B).index_put_((rows_K,), cut_K)
            by_rank = cut_B.view(p["ranks"], -1).sum(1) / lengths_B.view(p["ranks"], -1).sum(1)
            if seed:  # the first update has no previous threshold
                shares[key].append(float(by_rank.max()))
        if seed:
            masked.append(float(metrics["m2po/num_masked"] / mask_BL.sum()))
        threshold = float(metrics["m2po/threshold"])
    f = statistics.mean(shares["previous"])
    report.row(
        f"8B: correction share f, slowest rank ({100 * statistics.mean(masked):.2f}% masked), "
        "provisional: no threshold -> previous",
        statistics.mean(shares[math.inf]),
        f,
        "",
    )
    report.row("8B: m2po / grpo update FLOPs (4/3 -> 1 + f)", 4 / 3, 1 + f, "x")


def padding_at_paper_size(report) -> None:
    from m2po_cli.learner.batch import micro_batches, padding_overhead

    p = PAPER
    _, groups, _ = synthetic_groups(p["prompts"], p["n"], p["max_response"], 1000, seed=2)
    lengths = torch.tensor([MEAN_PROMPT + len(c.token_ids) for g in groups for c in g])
    rows_per_rank = p["prompts"] // p["updates"] * p["n"] // p["ranks"]
    old, new = [], []
    for start in range(0, len(lengths), rows_per_rank):  # each rank's rows of each update
        mine = lengths[start : start + rows_per_rank]
        old_parts = [torch.arange(s, min(s + p["micro"], len(mine))) for s in range(0, len(mine), p["micro"])]
        old.append(padding_overhead(mine, old_parts))
        new.append(padding_overhead(mine, micro_batches(mine, p["micro"], 0)))
    report.row(
        "8B: padding overhead (64 rows per rank per update, 8 per micro-batch)",
        statistics.mean(old),
        statistics.mean(new),
        "x",
    )


def peak_logprob_memory(report) -> None:
    """Peak RSS over a fresh process's baseline, for the logprob step of B x L positions."""
    b, length, vocab, dim = 2, 1024, 49_152, 576
    peaks = {}
    for which in ("baseline", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, "--peak-of", which, str(b), str(length), str(vocab), str(dim)],
            capture_output=True,
            text=True,
            check=True,
        )
        peaks[which] = int(out.stdout.split()[-1])
    logits = b * length * vocab * 4
    report.row(
        f"logprob step peak, {b}x{length} tokens, V={vocab} (fp32 logits {logits / 2**20:.0f} MiB)",
        peaks["baseline"] / 2**20,
        peaks["chunked"] / 2**20,
        "MiB",
    )
    from m2po_cli.learner.logprobs import CHUNK_LOGITS

    # 8B: 8 sequences of 2,710 tokens, V = 151,936. The baseline's peak scales with B x L x V (factor
    # measured above, relative to fp32 logits); the chunked one with the chunk alone.
    factor = peaks["baseline"] / logits
    big = 8 * 2710 * PAPER["vocab"] * 4
    chunk_factor = peaks["chunked"] / (CHUNK_LOGITS * 4)
    report.row(
        "8B: logprob step peak (8 x 2,710 tokens, V = 151,936)",
        factor * big / 2**30,
        chunk_factor * CHUNK_LOGITS * 4 / 2**30,
        "GiB",
    )


def measure_peak(which: str, b: int, length: int, vocab: int, dim: int) -> int:
    from m2po_cli.learner.logprobs import ScoreRequest, chunked_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(b, length, dim, generator=g, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=g, requires_grad=True) * 0.02
    tokens = torch.randint(0, vocab, (b, length), generator=g)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if which == "baseline":
        logits = h @ weight.T
        lp = baseline_token_logprobs(logits, tokens, 1.0)
        baseline_token_entropy(logits.detach(), 1.0)
    else:
        request = ScoreRequest(torch.arange(b * length - 1), tokens.view(-1)[1:], 1.0, with_entropy=True)
        lp, _ = chunked_logprobs(h.view(-1, dim), weight, None, request)
    lp.sum().backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024


class Report:
    def __init__(self):
        print(f"{'':78s} {'before':>12s} {'after':>12s} {'ratio':>8s}")

    def row(self, name: str, before: float, after: float, unit: str) -> None:
        ratio = before / after if after else float("inf")
        print(f"{name:78s} {before:>10.3g} {unit:<2s}{after:>10.3g} {unit:<2s}{ratio:>7.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="rows of the SmolLM2 update")
    parser.add_argument("--max-response", type=int, default=192)
    parser.add_argument("--micro", type=int, default=4, help="micro_batch_sequences")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.1, help="heavy-tail scale of the synthetic log r")
    parser.add_argument("--peak-of", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak_of:
        which, *sizes = args.peak_of
        print(measure_peak(which, *map(int, sizes)))
        return
    report = Report()
    fifo_and_checkpoint(report)
    padding_at_paper_size(report)
    correction_at_paper_size(report, args.noise)
    peak_logprob_memory(report)
    passes_and_timing(report, args)


if __name__ == "__main__":
    main()
