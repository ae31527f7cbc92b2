"""The torchtitan FSDP2 learner: sharded updates equal single-process ones; the HF export reloads."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from m2po_cli.config import load_recipe
from m2po_cli.learner.mask_correction import provisional_keep
from m2po_cli.learner.policy import Learner
from m2po_cli.loss import toward_advantage
from m2po_cli.models import resolve_model
from tests.conftest import recipe_for
from tests.steps import train_once
from tests.tolerances import adam_weight_bounds, forward_atol, max_gap, within
from tests.workers.dist_learner_worker import OVERRIDES as WORKER_OVERRIDES
from tests.workers.dist_learner_worker import QUICKSTART as WORKER_RECIPE

WORKER = Path(__file__).resolve().parents[1] / "workers" / "dist_learner_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def run_worker(out: Path, nproc: int, *overrides: str) -> None:
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), str(out), *overrides]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(WORKER),
            str(out),
            *overrides,
        ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        [],  # FSDP: the model sharded over both ranks
        ["parallel.dp_replicate=2"],  # HSDP: two whole replicas, gradients summed across them
        ["lora.rank=4"],  # FSDP with a LoRA adapter: only the adapter trains (both layouts)
    ],
    ids=["fsdp", "hsdp", "lora"],
)
def test_two_ranks_equal_one_process(tmp_path, layout):
    run_worker(tmp_path / "one", 1, *[k for k in layout if k.startswith("lora.")])
    run_worker(tmp_path / "two", 2, *layout)
    single = torch.load(tmp_path / "one" / "rank0.pt")
    rank0 = torch.load(tmp_path / "two" / "rank0.pt")
    rank1 = torch.load(tmp_path / "two" / "rank1.pt")

    # Sharded and single gradients differ by the order of float32 sums; the weights by at most what
    # AdamW makes of those gaps (`adam_weight_bounds`).
    # The first update starts from equal weights: its gradients differ by the order of sums alone.
    assert len(single["grads"]) == len(rank0["grads"]) == 3
    gaps_U = [max_gap(two, one) for two, one in zip(rank0["grads"], single["grads"], strict=True)]
    assert gaps_U[0] <= 1e-5 * max(float(g.abs().max()) for g in single["grads"][0].values())
    optim = load_recipe(WORKER_RECIPE, WORKER_OVERRIDES).optim
    bounds = adam_weight_bounds(single["grads"], gaps_U, optim)[-1]
    for name, ref in single["state"].items():
        assert torch.equal(rank0["state"][name], rank1["state"][name]), f"ranks differ on {name}"
        assert within(rank0["state"][name], ref, bounds[name], 6), f"sharded != single on {name}"
    # The weights moved, so equality above is not trivial.
    for step, (m_single, m_two) in enumerate(zip(single["metrics"], rank0["metrics"], strict=True)):
        assert m_two["loss/num_tokens"] == m_single["loss/num_tokens"]
        # Each update's log-ratios are the worker's noise (on-policy but for it): the same mask and
        # second moments in both layouts.
        assert m_two["m2po/num_masked"] == m_single["m2po/num_masked"]
        for key in ("m2po/m2_before", "m2po/m2_after"):
            assert m_two[key] == pytest.approx(m_single[key], rel=1e-4), key
        # After the first update the weights may differ by what AdamW makes of float-order gaps
        # (`bounds`: entries with a near-zero gradient move by up to ~lr either way), so later
        # gradient norms agree to a percent, not to rounding; a norm of one rank's shard alone is
        # off by far more.
        rel = 1e-4 if step == 0 else 1e-2
        assert m_two["optim/grad_norm"] == pytest.approx(m_single["optim/grad_norm"], rel=rel)
    assert any(m.get("m2po/num_masked", 0) > 0 for m in single["metrics"]), "nothing masked: a weak test"
    # Scoring at the behaviour version is sharded: each rank scored only its own rows, and together
    # they scored every row. At every step each row's scores are those of the run's weights (every
    # rank also scored every row), and at step 0, where the weights are the same, one process's.
    for step, ref in enumerate(single["scored"]):
        parts = [rank0["scored"][step], rank1["scored"][step]]
        assert sorted(r for p in parts for r in p["row_B"].tolist()) == ref["row_B"].tolist()
        assert all(0 < p["row_B"].numel() < ref["row_B"].numel() for p in parts), "a rank scored every row"
        for part in parts:
            for j, row in enumerate(part["row_B"].tolist()):
                mine = part["learner_R"][part["offsets"][j] : part["offsets"][j + 1]]
                whole = part["whole_R"][part["whole_offsets"][row] : part["whole_offsets"][row + 1]]
                assert torch.allclose(mine, whole, atol=1e-5, rtol=0), f"row {row} of step {step}"
                if step == 0:
                    theirs = ref["learner_R"][ref["offsets"][row] : ref["offsets"][row + 1]]
                    assert torch.allclose(mine, theirs, atol=1e-5, rtol=0), f"row {row}, one process"


def test_hf_export_reloads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    recipe = recipe_for(tmp_path)
    model_dir = resolve_model(recipe.model.path)
    learner = Learner(model_dir, recipe)
    with torch.no_grad():  # move away from the source weights so the test can tell them apart
        for p in learner.model.parameters():
            p.mul_(1.05)
    learner.export_hf(tmp_path / "export", model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = learner.model(tokens)
        theirs = hf(tokens).logits
        source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(tokens).logits
    atol = forward_atol(theirs, hf.config.num_hidden_layers)
    assert torch.allclose(ours, theirs, rtol=0, atol=atol)
    assert not torch.allclose(source, theirs, rtol=0, atol=100 * atol), (
        "the export still holds the source weights"
    )


UPDATE_WORKER = Path(__file__).resolve().parents[1] / "workers" / "dist_update_worker.py"


def run_update_worker(out: Path, nproc: int, *overrides: str) -> list[dict]:
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    )
    done = subprocess.run(
        [*launch, str(UPDATE_WORKER), str(out), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(nproc)]


def update_recipe():
    from tests.workers.dist_update_worker import OVERRIDES, QUICKSTART

    return load_recipe(QUICKSTART, OVERRIDES)


def test_update_worker_forces_every_path():
    """The update worker's batch, from its noise alone (no model): every `correct_after` update has
    tokens whose provisional mask is wrong, and each mask decision is far from its boundary, so a
    logprob rounded differently on another CPU (~1e-6) cannot change any of them.

    Margins: the provisional threshold is >= 1e-3 from every z; the exact stopping point has its
    kept and masked neighbours >= 1e-3 apart and mean M2 >= 2% of tau on either side of tau."""
    from tests.workers.dist_update_worker import CASES, update_noise, whole_batch

    tau = update_recipe().loss.tau
    batch = whole_batch(vocab=64)
    advantages_BL = batch.advantages_B[:, None].expand_as(batch.mask_BL)
    valid_BL = batch.mask_BL.bool()
    for name, first_z in CASES.items():
        provisional_z = math.inf if first_z is None else first_z
        for update in range(2):
            log_ratio_BL = -update_noise(batch, update)
            z_BL = toward_advantage(log_ratio_BL, advantages_BL)
            # The paper's loop, literally: the largest M2 leaves while the mean over the rest is > tau.
            m2_T = sorted((float(z) ** 2 for z in z_BL[valid_BL] if z > 0), reverse=True)
            means = [sum(m2_T[i:]) / (len(m2_T) - i) for i in range(len(m2_T))]
            cut = next(i for i, mean in enumerate(means) if mean <= tau)
            assert 0 < cut < len(m2_T) - 1, f"{name}, update {update + 1}: the mask is empty or total"
            assert means[cut - 1] - tau > 0.02 * tau and tau - means[cut] > 0.02 * tau, (name, update)
            assert math.sqrt(m2_T[cut - 1]) - math.sqrt(m2_T[cut]) > 1e-3, (name, update)
            threshold = math.sqrt(m2_T[cut])
            keep_BL = valid_BL & (z_BL <= threshold)
            if name.startswith("correct_after") or update == 0:
                if provisional_z < math.inf:
                    assert (z_BL[valid_BL] - provisional_z).abs().min() > 1e-3, (name, update)
                provisional_BL = provisional_keep(log_ratio_BL, advantages_BL, valid_BL, provisional_z)
                changed = int((provisional_BL != keep_BL).sum())
                assert changed >= 3, f"{name}, update {update + 1}: {changed} tokens to correct"
            provisional_z = threshold


def assert_correct_after_equals_score_first(results: dict, recipe) -> None:
    """`correct_after` (mask from the training forwards, then a correction) gives the weights and
    metrics of `score_first` (mask from a no-grad pass first) after one and two updates; the
    gradients (after the clip) to float32 rounding.

    The log-ratios are the worker's noise by construction, so the masks agree exactly and every
    metric computed from log-ratios agrees to rounding. Update 1's gradients differ only by the
    order of float32 sums (1e-5 of the largest entry is ~100 ulps); update 2 starts from weights
    that differ by at most `adam_weight_bounds`, so its gradient and its norm agree to 1e-3."""
    reference = results["score_first"]
    grads_U = [step["grad"] for step in reference]
    for name in ("correct_after", "correct_after z0=0.05", "auto z0=0.05", "auto one-micro-batch"):
        gaps_U = []
        for step, (ref, got) in enumerate(zip(reference, results[name], strict=True)):
            where = f"{name}, update {step + 1}"
            rel = 1e-5 if step == 0 else 1e-3
            if name.startswith("correct_after"):
                assert got["metrics"]["m2po/correction_frac"] > 0, f"{where}: nothing corrected"
            if name == "correct_after":  # no no-grad pass: fewer tokens through the model
                assert got["forwarded"] < ref["forwarded"], where
            if name == "auto one-micro-batch":  # one forward of the rank's rows, nothing else
                assert got["forwarded"] == got["one_forward"], where
            assert ref["metrics"]["optim/grad_norm"] > 0.05, f"{where}: the gradient clip did not act"
            assert got["metrics"].keys() == ref["metrics"].keys(), where
            for key, value in ref["metrics"].items():
                if key != "m2po/correction_frac":
                    tol = rel if key == "optim/grad_norm" else 1e-5
                    assert got["metrics"][key] == pytest.approx(value, rel=tol, abs=1e-7), f"{where}: {key}"
            scale = max(float(value.abs().max()) for value in ref["grad"].values())
            for key, value in ref["grad"].items():
                assert torch.allclose(got["grad"][key], value, rtol=0, atol=rel * scale), f"{where}: {key}"
            gaps_U.append(max_gap(got["grad"], ref["grad"]))
        bounds = adam_weight_bounds(grads_U, gaps_U, recipe.optim)
        for step, (ref, got) in enumerate(zip(reference, results[name], strict=True)):
            for key, value in ref["state"].items():
                assert within(got["state"][key], value, bounds[step][key], step + 1), (
                    f"{name}, update {step + 1}: {key}"
                )


def assert_auto_bounds_the_correction(results: dict) -> None:
    """`auto`: a correction over more than a third of the tokens (here the provisional threshold
    0.05 makes most tokens change) costs more than the no-grad pass, so the next update scores first."""
    first, second = results["auto z0=0.05"]
    assert first["metrics"]["m2po/correction_frac"] > 1 / 3
    assert first["forwarded"] == results["correct_after z0=0.05"][0]["forwarded"]
    assert second["forwarded"] == results["score_first"][1]["forwarded"]


def test_correct_after_equals_score_first(tmp_path):
    (results,) = run_update_worker(tmp_path / "one", 1)
    assert_correct_after_equals_score_first(results, update_recipe())
    assert_auto_bounds_the_correction(results)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [[], ["parallel.dp_replicate=2"]],  # HSDP: the correction's pass crosses between replicas too
    ids=["fsdp", "hsdp"],
)
def test_correct_after_equals_score_first_two_ranks_uneven(tmp_path, layout):
    rank0, rank1 = run_update_worker(tmp_path / "two", 2, *layout)
    assert_correct_after_equals_score_first(rank0, update_recipe())
    assert_auto_bounds_the_correction(rank0)
    for name, steps in rank0.items():
        for mine, theirs in zip(steps, rank1[name], strict=True):
            assert mine["metrics"] == theirs["metrics"], name
            assert all(torch.equal(v, theirs["state"][k]) for k, v in mine["state"].items()), name


@pytest.mark.slow
def test_a_rank_without_rows_takes_every_path_with_the_others(tmp_path):
    """Fewer rows in an update than ranks: rank 1 holds none. Every way to the global mask still
    runs (no collective left waiting), and both ranks end with one process's weights and metrics."""
    (single,) = run_update_worker(tmp_path / "one", 1)
    rank0, rank1 = run_update_worker(tmp_path / "two", 2, "--idle-rank")
    assert_correct_after_equals_score_first(rank0, update_recipe())
    for name, steps in rank0.items():
        for step, (mine, theirs, one) in enumerate(zip(steps, rank1[name], single[name], strict=True)):
            where = f"{name}, update {step + 1}"
            assert mine["metrics"] == theirs["metrics"], where
            assert all(torch.equal(v, theirs["state"][k]) for k, v in mine["state"].items()), where
            assert mine["metrics"]["loss/num_tokens"] == one["metrics"]["loss/num_tokens"], where
            assert mine["metrics"]["m2po/num_masked"] == one["metrics"]["m2po/num_masked"], where
            assert mine["metrics"]["loss/loss"] == pytest.approx(one["metrics"]["loss/loss"], rel=1e-5), where
        first, one = steps[0]["grad"], single[name][0]["grad"]  # the same weights: float order alone
        scale = max(float(value.abs().max()) for value in one.values())
        assert max_gap(first, one) <= 1e-5 * scale, name


def literal_grpo_updates(model_dir: Path, rows: list[tuple[list[int], int, float]], updates, recipe):
    """The standard GRPO update, written out row by row on the HF model (TRL's and verl's formula):
    behaviour = the starting policy's logprobs at the sampling temperature; per token
    -min(r A, clip(r, 1 - eps, 1 + eps) A) summed over the update's response tokens and divided by
    their count; the gradient norm clipped; AdamW on every parameter. `rows`: (tokens, prompt
    length, advantage); `updates`: the row numbers of each update. Returns the clipped gradient and
    the norm before the clip of each update, and the final weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    o, cfg, temperature = recipe.optim, recipe.loss, recipe.rollout.temperature
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)

    def response_logprobs(tokens: list[int], prompt_len: int) -> torch.Tensor:
        ids = torch.tensor([tokens])
        logits = model(ids).logits[0, :-1] / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        return lp[prompt_len - 1 :]

    with torch.no_grad():
        behaviour = [response_logprobs(tokens, p) for tokens, p, _ in rows]
    grads, norms = [], []
    for update in updates:
        num_tokens = sum(len(rows[b][0]) - rows[b][1] for b in update)
        loss = torch.zeros(())
        for b in update:
            tokens, prompt_len, advantage = rows[b]
            ratio = torch.exp(response_logprobs(tokens, prompt_len) - behaviour[b])
            clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
            loss = loss - torch.minimum(ratio * advantage, clipped * advantage).sum()
        (loss / num_tokens).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, o.grad_clip)))
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grads, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def literal_advantages(rewards: list[float]) -> list[float]:
    """GRPO's advantage of a group: (r - mean) / (unbiased std + 1e-6), as verl computes it."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + 1e-6) for r in rewards]


@pytest.mark.slow
def test_grpo_updates_equal_the_standard_update_written_out(tmp_path):
    """The learner's GRPO updates (advantages, temperature, token mean, clip, gradient clip, AdamW)
    are the standard ones: two updates on one batch, the second off-policy by one update so the clip
    acts, against `literal_grpo_updates` on the HF model."""
    from m2po_cli.train.colocated import score_at_behaviour_version
    from tests.workers.dist_learner_worker import applied_gradients, fixed_batch

    recipe = recipe_for(
        tmp_path,
        'model.path="builtin:tiny-qwen3"',  # tied embeddings, as SmolLM2's
        'loss={type="grpo", eps_low=0.2, eps_high=0.2}',
        "rollout.prompts_per_step=4",
        "rollout.temperature=0.7",
        "train.mini_batch_prompts=2",
        "train.micro_batch_sequences=5",
        "staleness.s=0",
        "optim.lr=0.01",
        "optim.weight_decay=0.01",
        "optim.grad_clip=0.5",
        'algorithm.behaviour_logprobs="learner"',
    )
    model_dir = resolve_model(recipe.model.path)
    learner = Learner(model_dir, recipe)
    batch = fixed_batch(0, 4, recipe.rollout.n, learner.arch.hf_config["vocab_size"])
    n, offsets, starts = recipe.rollout.n, batch.offsets_B1.tolist(), batch.prompt_len_B.tolist()
    rewards = batch.rewards_B.tolist()
    rows = []
    for b in range(batch.num_rows):
        group = rewards[b - b % n : b - b % n + n]
        rows.append(
            (
                batch.tokens_N[offsets[b] : offsets[b + 1]].tolist(),
                starts[b],
                literal_advantages(group)[b % n],
            )
        )
    assert torch.allclose(batch.advantages_B, torch.tensor([a for _, _, a in rows]), atol=1e-6)
    grads_U = applied_gradients(learner)
    # Each update's norm before the clip. Only the first is compared: the second is taken at
    # weights that AdamW may have moved apart by ~lr on entries with a near-zero gradient.
    norms_U, clip = [], learner._clip
    learner._clip = lambda: norms_U.append(clip()) or norms_U[-1]
    score_at_behaviour_version(batch, learner, everything=True, group_size=n)
    metrics = train_once(batch, learner, recipe)
    state = learner.arch.adapter.to_hf({k: v.full_tensor() for k, v in learner.model.state_dict().items()})
    half = batch.num_rows // 2
    ref_grads_U, ref_norms_U, ref_state = literal_grpo_updates(
        model_dir, rows, [range(half), range(half, 2 * half)], recipe
    )

    grads_U = [learner.arch.adapter.to_hf(g) for g in grads_U]  # HF names, as the reference's
    assert len(grads_U) == 2 and metrics["loss/clip_frac"] > 0, "the second update's clip never acted"
    # The gradient's scale (the token mean), which the clip would hide: the norms before the clip.
    assert min(ref_norms_U) > recipe.optim.grad_clip, "the gradient clip never acted"
    assert norms_U[0] == pytest.approx(ref_norms_U[0], rel=1e-5)
    shared = [k for k in ref_grads_U[0] if k in grads_U[0]]
    assert "model.embed_tokens.weight" in shared
    grads_U = [{k: g[k] for k in shared} for g in grads_U]
    ref_grads_U = [{k: g[k] for k in shared} for g in ref_grads_U]
    # Update 1 starts from the same weights: the gradients differ by two implementations' rounding.
    scale = max(float(g.abs().max()) for g in ref_grads_U[0].values())
    gaps_U = [max_gap(got, ref) for got, ref in zip(grads_U, ref_grads_U, strict=True)]
    assert gaps_U[0] <= 1e-5 * scale, (gaps_U[0], scale)
    bounds = adam_weight_bounds(ref_grads_U, gaps_U, recipe.optim)[-1]
    for name in shared:
        assert within(state[name], ref_state[name], bounds[name], 2), name
    # The weights moved far beyond the bounds, so the equality above is not trivial.
    start = load_file(str(model_dir / "model.safetensors"))
    assert any(bool(((state[k] - start[k]).abs() > 10 * bounds[k]).any()) for k in shared if k in start)
