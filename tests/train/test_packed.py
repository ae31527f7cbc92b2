"""Packed rollouts, their checkpoint, chunked logprobs and length-sorted micro-batches, on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from m2po_cli.learner import logprobs as logprobs_module
from m2po_cli.learner.batch import micro_batches
from m2po_cli.learner.logprobs import ScoreRequest, chunked_logprobs
from m2po_cli.learner.policy import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import resolve_model
from m2po_cli.rollout.episode import one_turn
from m2po_cli.rollout.types import Completion
from m2po_cli.schedule import Schedule
from m2po_cli.train.colocated import MISMATCH_SAMPLE_ROWS, engine_share, mismatch_sample
from m2po_cli.train.fifo import StalenessQueue
from m2po_cli.train.pack import pack_groups
from m2po_cli.train.packed import PackedRollouts, distribute, owners
from tests.conftest import recipe_for
from tests.tolerances import adam_weight_bounds, max_gap, within


def random_pack(seed: int, num_prompts: int = 5, n: int = 3, vocab: int = 50, first_row: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(num_prompts)
    ]
    groups = []
    for _ in prompts:
        lengths = torch.randint(0, 7, (n,), generator=g).tolist()
        groups.append(
            [
                Completion(
                    torch.randint(0, vocab, (k,), generator=g).tolist(),
                    torch.randn(k, generator=g).tolist(),
                    "text",
                    bool(torch.rand(1, generator=g) < 0.5),
                )
                for k in lengths
            ]
        )
    rewards_PG = torch.randint(0, 2, (num_prompts, n), generator=g).float()
    pack = pack_groups(3, first_row, prompts, one_turn(groups), rewards_PG, True, 1e-6)
    return pack, prompts, groups, rewards_PG


def test_the_mismatch_sample_is_one_prompt_group_in_turn():
    """Up to MISMATCH_SAMPLE_ROWS rows, all of one prompt (so they pack), a different prompt of the
    rank's own each step; a rank holding part of a group samples from what it holds."""
    n = 6
    pack, prompts, *_ = random_pack(4, num_prompts=3, n=n, first_row=12)  # prompts 2, 3, 4 of the batch
    tokens = pack.to_batch(torch.arange(pack.num_rows)).tokens_BL
    chosen = []
    for index in range(4):
        sample = mismatch_sample(pack, n, index)
        assert len(sample) == MISMATCH_SAMPLE_ROWS
        (group,) = (pack.row_B[sample] // n).unique().tolist()
        prompt = prompts[group - 2]
        assert all(tokens[int(b), : len(prompt)].tolist() == prompt for b in sample)
        chosen.append(group)
    assert chosen == [2, 3, 4, 2]
    part = pack.take(torch.arange(n + 4, pack.num_rows))  # two rows of prompt 3, then prompt 4
    assert (part.row_B[mismatch_sample(part, n, 0)] // n).tolist() == [3, 3]
    assert not mismatch_sample(pack.take(torch.zeros(0, dtype=torch.long)), n, 0).numel()


def reference_rows(prompts, groups, index: list[int]):
    """Literal loop: right-padded prompt + response rows, response mask, behaviour logprobs."""
    samples = [(p, c) for p, g in zip(prompts, groups, strict=True) for c in g]
    seqs = [samples[i][0] + samples[i][1].token_ids for i in index]
    length = max(len(s) for s in seqs)
    tokens, mask, behaviour = (torch.zeros(len(index), length) for _ in range(3))
    for j, i in enumerate(index):
        p, c = samples[i]
        for t, tok in enumerate(p + c.token_ids):
            tokens[j, t] = tok
        for t, lp in enumerate(c.logprobs):
            mask[j, len(p) + t] = 1.0
            behaviour[j, len(p) + t] = lp
    return tokens.long(), mask, behaviour


def test_pack_lays_rows_out_as_a_literal_loop():
    pack, prompts, groups, rewards_PG = random_pack(0)
    assert pack.row_B.tolist() == list(range(15))
    for index in ([0, 1, 2], [14, 3, 7, 7], list(range(15))):
        rows = pack.to_batch(torch.tensor(index))
        tokens, mask, behaviour = reference_rows(prompts, groups, index)
        assert torch.equal(rows.tokens_BL, tokens)
        assert torch.equal(rows.mask_BL, mask)
        assert torch.equal(rows.behaviour_logprobs_BL, behaviour)
    centred = rewards_PG - rewards_PG.mean(1, keepdim=True)
    expected = (centred / (rewards_PG.std(1, keepdim=True) + 1e-6)).flatten()
    assert torch.equal(pack.advantages_B, expected)
    assert pack.solved_B.tolist() == [bool(r.max() > 0) for r in rewards_PG for _ in range(3)]


def contiguous_owners(row_B: torch.Tensor, per_update: int, world: int) -> torch.Tensor:
    """Each update's rows in `world` contiguous parts (`torch.tensor_split`), regardless of length."""
    owner_B = torch.zeros_like(row_B)
    for u in range(int(row_B.max()) // per_update + 1):
        for rank, part in enumerate(
            torch.tensor_split(torch.arange(u * per_update, (u + 1) * per_update), world)
        ):
            owner_B[torch.isin(row_B, part)] = rank
    return owner_B


def rank_tokens(owner_B, lengths_B, update_B, u: int, world: int) -> torch.Tensor:
    mine = update_B == u
    return torch.zeros(world, dtype=torch.long).index_add_(0, owner_B[mine], lengths_B[mine])


@pytest.mark.parametrize("per_update, world", [(12, 2), (10, 3), (4, 8), (7, 7), (64, 8)])
def test_owners_balance_each_update_by_tokens(per_update, world):
    """Every row has one owner in its update; any two ranks' tokens differ by at most the longest
    row's length; the deal ignores the rows' order (ranks gather them in rank order)."""
    torch.manual_seed(per_update * world)
    row_B = torch.arange(3 * per_update)
    lengths_B = (torch.distributions.LogNormal(5.0, 1.0).sample((row_B.numel(),)).long() + 1).clamp(max=4096)
    lengths_B[: per_update // 2] = 100  # ties, broken by row number
    schedule = Schedule(3 * per_update, per_update, n=1)  # rows numbered as prompts of one sample
    owner_B = owners(row_B, lengths_B, schedule, world)
    assert owner_B.min() >= 0 and owner_B.max() < world
    update_B = row_B // per_update
    for u in range(3):
        tokens_W = rank_tokens(owner_B, lengths_B, update_B, u, world)
        if per_update >= world:
            assert int(tokens_W.max() - tokens_W.min()) <= int(lengths_B[update_B == u].max()), (u, tokens_W)
        assert int(tokens_W.sum()) == int(lengths_B[update_B == u].sum())
    shuffled = torch.randperm(row_B.numel())
    assert torch.equal(owners(row_B[shuffled], lengths_B[shuffled], schedule, world), owner_B[shuffled])


def test_owners_beat_contiguous_parts_on_a_long_tailed_batch():
    """The 8B recipe's update (64 prompts x 8 samples on 8 ranks) with response lengths sorted the
    way they come out of a long-tailed group: contiguous parts leave the slowest rank far above the
    mean, the deal within 1%."""
    per_update, world = 512, 8
    torch.manual_seed(0)
    lengths_B = torch.distributions.LogNormal(6.5, 0.8).sample((per_update,)).long().clamp(1, 2560) + 150
    lengths_B = lengths_B.sort(descending=True).values  # the worst order for contiguous parts
    row_B, update_B = torch.arange(per_update), torch.zeros(per_update, dtype=torch.long)
    mean = float(lengths_B.sum()) / world
    dealt = owners(row_B, lengths_B, Schedule(per_update, per_update, n=1), world)
    balanced = rank_tokens(dealt, lengths_B, update_B, 0, world)
    contiguous = rank_tokens(contiguous_owners(row_B, per_update, world), lengths_B, update_B, 0, world)
    assert float(contiguous.max()) / mean > 1.5
    assert float(balanced.max()) / mean < 1.01


def test_engine_shares_split_the_prompts_like_tensor_split():
    for num_prompts, world, tp in [(8, 2, 1), (7, 3, 1), (3, 8, 1), (10, 4, 2), (5, 8, 4), (4, 1, 1)]:
        parts = torch.tensor_split(torch.arange(num_prompts), world // tp)
        for rank in range(world):
            group, share = engine_share(rank, world, tp, num_prompts)
            assert group == rank // tp and list(share) == parts[group].tolist(), (
                num_prompts,
                world,
                tp,
                rank,
            )
    assert engine_share(0, 1, 1, 32) == (0, range(32))  # one process: one engine samples everything


def test_distribute_on_one_rank_keeps_everything():
    pack, *_ = random_pack(1)
    assert distribute(pack, torch.zeros(pack.num_rows, dtype=torch.long)) is pack


SCHEDULE = Schedule(6, 2, n=3)  # the spanned pack's 6 prompts of 3 samples, 2 prompts an update
DIST_WORKER = Path(__file__).resolve().parents[1] / "workers" / "dist_packed_worker.py"


def spanned_pack() -> PackedRollouts:
    """`random_pack` with untrained spans (every third response token) and tokens of mixed versions."""
    pack, *_ = random_pack(11, num_prompts=6, n=3)
    pack.trained_R = torch.arange(pack.trained_R.numel()) % 3 != 1
    pack.version_R = pack.version_R - torch.arange(pack.version_R.numel(), dtype=torch.int32) % 2
    return pack


def test_take_and_cat_carry_every_declared_field_as_a_literal_loop():
    """Each field moves with its axis: per row, per token, per response token; `cat` renumbers."""
    pack = spanned_pack()
    index = torch.tensor([7, 2, 2, 15, 0])
    taken = pack.take(index)
    assert set(PackedRollouts.columns()) == set(pack.tensors()) - {"offsets_B1"}
    for k, b in enumerate(index.tolist()):
        start, end = pack.offsets_B1[b], pack.offsets_B1[b + 1]
        assert torch.equal(
            taken.tokens_N[taken.offsets_B1[k] : taken.offsets_B1[k + 1]], pack.tokens_N[start:end]
        )
        mine = pack.response_index(torch.tensor([b]))
        theirs = taken.response_index(torch.tensor([k]))
        for name in PackedRollouts.columns("response"):
            if name != "learner_R":
                assert torch.equal(getattr(taken, name)[theirs], getattr(pack, name)[mine]), name
        for name in PackedRollouts.columns("row"):
            assert torch.equal(getattr(taken, name)[k], getattr(pack, name)[b]), name
        assert int(taken.trained_len_B[k]) == int(pack.trained_R[mine].sum())
    joined = PackedRollouts.cat([taken, pack.take(torch.tensor([3]))], torch.arange(6))
    assert joined.row_B.tolist() == list(range(6)) and not joined.learner_R.numel()
    assert_same(joined.take(torch.arange(5)), replace(taken, row_B=torch.arange(5)))
    scored = replace(taken, learner_R=torch.randn(taken.behaviour_R.shape))
    assert torch.equal(
        PackedRollouts.cat([scored, scored], torch.arange(10)).learner_R, scored.learner_R.repeat(2)
    )
    assert not PackedRollouts.cat([scored, taken], torch.arange(10)).learner_R.numel(), "one part unscored"


def test_distribute_on_two_ranks_gives_each_its_rows_bit_for_bit(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(DIST_WORKER.parents[2])}
    done = subprocess.run(
        [*command, str(DIST_WORKER), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pack = spanned_pack()
    owner_B = owners(pack.row_B, pack.lengths_B, SCHEDULE, 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        version, meta = got.pop("version"), got.pop("meta")
        want = pack.take((owner_B == rank).nonzero().squeeze(1))
        assert version == pack.version and meta == {"rank": float(rank)}
        assert_same(PackedRollouts.from_tensors(version, got, meta), replace(want, meta=meta))
    assert not all(pack.trained_R), "the spans must travel"


def assert_same(a: PackedRollouts, b: PackedRollouts):
    assert a.version == b.version and a.meta == b.meta
    for name, t in a.tensors().items():
        other = b.tensors()[name]
        assert t.dtype == other.dtype and torch.equal(t, other), name


def test_queue_round_trips_through_a_checkpoint_bit_for_bit(tmp_path):
    queue = StalenessQueue(3)
    first, *_ = random_pack(2)
    first.meta = {"time/generate": 0.125, "rollout/entropy": 1 / 3}
    second, *_ = random_pack(3, first_row=15)
    second.learner_R = torch.randn(second.behaviour_R.shape)
    for batch in (first, second, PackedRollouts.empty(7), first.take(torch.tensor([4, 1]))):
        queue.push(batch)
    queue.save(tmp_path, rank=1, world=2)
    restored = StalenessQueue(3)
    restored.load(tmp_path, rank=1, world=2)
    assert len(restored.queue) == 4
    for a, b in zip(queue.queue, restored.queue, strict=True):
        assert_same(a, b)
    with pytest.raises(ValueError, match="number of ranks"):
        StalenessQueue(3).load(tmp_path, rank=0, world=1)
    with pytest.raises(ValueError, match="staleness.s cannot change"):
        StalenessQueue(2).load(tmp_path, rank=1, world=2)


def reference_logprobs(logits_BLV, tokens_BL, temperature):
    """The full-vocabulary computation, literally: log_softmax over [B, L, V] in float32."""
    logp_BLV = torch.log_softmax(logits_BLV[:, :-1].float() / temperature, dim=-1)
    picked_BL = logp_BLV.gather(-1, tokens_BL[:, 1:, None]).squeeze(-1)
    entropy_BL = -(logp_BLV.exp() * logp_BLV).sum(-1)
    return torch.nn.functional.pad(picked_BL, (1, 0)), torch.nn.functional.pad(entropy_BL, (1, 0))


@pytest.mark.parametrize("chunk_logits", [1, 7 * 37, 2**24])
def test_chunked_logprobs_equal_the_full_softmax(monkeypatch, chunk_logits):
    monkeypatch.setattr(logprobs_module, "CHUNK_LOGITS", chunk_logits)
    g = torch.Generator().manual_seed(0)
    h_ND = torch.randn(23, 16, generator=g, requires_grad=True)
    weight_VD = torch.randn(37, 16, generator=g, requires_grad=True)
    targets_N = torch.randint(0, 37, (23,), generator=g)
    request = ScoreRequest(torch.arange(23), targets_N, 0.7, with_entropy=True)
    lp_N, ent_N = chunked_logprobs(h_ND, weight_VD, None, request)
    logits = (h_ND @ weight_VD.T)[None]
    tokens = torch.cat([torch.zeros(1, dtype=torch.long), targets_N])[None]
    ref_lp, ref_ent = reference_logprobs(torch.cat([logits, logits[:, :1]], dim=1), tokens, 0.7)
    assert torch.allclose(lp_N, ref_lp[0, 1:], atol=1e-5, rtol=0)
    assert torch.allclose(ent_N, ref_ent[0, 1:], atol=1e-5, rtol=0)
    upstream = torch.randn(23, generator=g)
    grads = torch.autograd.grad((lp_N * upstream).sum(), (h_ND, weight_VD))
    ref_grads = torch.autograd.grad((ref_lp[0, 1:] * upstream).sum(), (h_ND, weight_VD))
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    recipe = recipe_for(tmp_path_factory.mktemp("learner"), "train.micro_batch_sequences=4")
    return Learner(resolve_model(recipe.model.path), recipe)


def test_learner_logprobs_equal_the_full_softmax(learner, monkeypatch):
    monkeypatch.setattr(logprobs_module, "CHUNK_LOGITS", 3 * learner.arch.hf_config["vocab_size"])
    pack, *_ = random_pack(4, vocab=learner.arch.hf_config["vocab_size"])
    rows = pack.to_batch(torch.arange(pack.num_rows))
    with torch.no_grad():
        logits = learner.model(rows.tokens_BL)  # no request: the plain projection, [B, L, V]
    ref_lp, ref_ent = reference_logprobs(logits, rows.tokens_BL, learner.recipe.rollout.temperature)
    lp, ent = learner.score(rows, with_entropy=True)
    assert torch.allclose(lp, ref_lp * rows.mask_BL, atol=1e-5, rtol=0)
    assert torch.allclose(ent, ref_ent * rows.mask_BL, atol=1e-5, rtol=0)
    assert rows.mask_BL.sum() > 20


def test_micro_batches_cover_every_row_once_within_budget():
    lengths = torch.tensor([5, 30, 7, 7, 12, 3, 30, 1, 9])
    for max_rows, max_tokens in [(3, 0), (64, 40), (2, 25), (64, 10)]:
        parts = micro_batches(lengths, max_rows, max_tokens)
        assert sorted(torch.cat(parts).tolist()) == list(range(9))
        for part in parts:
            assert len(part) <= max_rows
            if len(part) > 1 and max_tokens:
                assert len(part) * int(lengths[part].max()) <= max_tokens
        flat = lengths[torch.cat(parts)].tolist()
        assert flat == sorted(flat, reverse=True), "rows of similar length share a micro-batch"


@pytest.mark.parametrize("global_pass", ["score_first", "correct_after"])
def test_update_does_not_depend_on_micro_batching(learner, global_pass):
    """Token budget or sequence count: the same token-mean loss, so the same update."""
    pack, *_ = random_pack(5, num_prompts=4, n=4, vocab=learner.arch.hf_config["vocab_size"])
    rows = pack.to_batch(torch.arange(pack.num_rows))
    start = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    schedule = learner.scheduler.state_dict()
    full = lambda: {k: v.full_tensor().clone() for k, v in learner.model.state_dict().items()}  # noqa: E731
    loss_fn = build_loss(learner.recipe.loss)
    num_tokens = int(rows.mask_BL.sum())
    results = []
    for train in [{"micro_batch_sequences": 16}, {"micro_batch_sequences": 3, "micro_batch_tokens": 24}]:
        learner.model.load_state_dict(start)
        learner.recipe = learner.recipe.model_copy(
            update={"train": learner.recipe.train.model_copy(update={**train, "global_pass": global_pass})}
        )
        learner.optimizer.state.clear()
        learner.scheduler.load_state_dict(schedule)  # the same learning rate for both
        for group, lr in zip(learner.optimizer.param_groups, schedule["_last_lr"], strict=True):
            group["lr"] = lr
        learner._provisional_z = -2.0  # the same provisional mask, one that needs correcting
        grads = []  # the gradient the optimizer applies (clipped)
        hook = learner.optimizer.register_step_pre_hook(
            lambda *_, grads=grads: grads.append(
                {k: p.grad.full_tensor().clone() for k, p in learner.model.named_parameters()}
            )
        )
        metrics = learner.update(rows, loss_fn, num_tokens)
        hook.remove()
        results.append((metrics, full(), grads[0]))
    (m_one, w_one, g_one), (m_many, w_many, g_many) = results
    assert m_one["loss/num_tokens"] == m_many["loss/num_tokens"] == num_tokens
    if global_pass == "correct_after":
        assert m_one["m2po/correction_frac"] > 0, "the correction ran"
    assert m_one["loss/loss"] == pytest.approx(m_many["loss/loss"], abs=1e-6)
    assert m_one["optim/grad_norm"] == pytest.approx(m_many["optim/grad_norm"], rel=1e-5)
    # The gradients differ by the order of float32 sums; the weights by what AdamW makes of that.
    gap = max_gap(g_many, g_one)
    assert gap <= 1e-5 * max(float(g.abs().max()) for g in g_one.values())
    (bounds,) = adam_weight_bounds([g_one], [gap], learner.recipe.optim)
    for name, w in w_one.items():
        assert within(w_many[name], w, bounds[name], 1), name
    assert not all(torch.equal(w, start[k].full_tensor()) for k, w in w_one.items()), (
        "the update moved nothing"
    )
