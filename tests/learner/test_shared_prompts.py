"""Shared prompts: a packed group shows every token the context of its own row, and the learner's
logprobs and gradients through the packed layout equal the rows'."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from m2po_cli.learner import shared_prompts
from m2po_cli.learner.batch import micro_batches
from m2po_cli.learner.policy import Learner
from m2po_cli.models import resolve_model
from tests.conftest import recipe_for
from tests.train.test_packed import random_pack


def test_each_packed_token_sees_exactly_its_rows_prefix():
    pack, *_ = random_pack(7, num_prompts=4, n=3)
    rows = pack.to_batch(torch.randperm(pack.num_rows, generator=torch.Generator().manual_seed(1)))
    packed = shared_prompts.pack(rows.tokens_BL, rows.lengths_B, rows.prompt_lengths_B)
    tokens_N, positions_N = packed.tokens_GT.flatten(), packed.positions_GT.flatten()
    length = packed.tokens_GT.shape[1]
    checked = 0
    for b in range(rows.num_rows):
        for c in range(int(rows.lengths_B[b])):
            at = int(packed.where_BL[b, c])
            g, t = divmod(at, length)
            keys = packed.allowed_G1TT[g, 0, t].nonzero()[:, 0] + g * length
            seen = sorted(zip(positions_N[keys].tolist(), tokens_N[keys].tolist(), strict=True))
            assert seen == list(enumerate(rows.tokens_BL[b, : c + 1].tolist())), (b, c)
            checked += 1
    assert checked == int(rows.lengths_B.sum())
    assert packed.tokens_GT.shape[0] == 4, "one packed sequence per prompt"


def test_groups_stay_whole_within_the_micro_batch_budget():
    pack, *_ = random_pack(3, num_prompts=6, n=4)
    rows = pack.to_batch(torch.arange(pack.num_rows))
    groups = shared_prompts.prompt_groups(rows.tokens_BL, rows.prompt_lengths_B)
    lengths_G = shared_prompts.packed_lengths(rows.lengths_B, rows.prompt_lengths_B, groups)
    group_of = {b: g for g, members in enumerate(groups) for b in members.tolist()}
    for max_rows, max_tokens in [(4, 0), (8, 0), (64, 40), (5, 20)]:
        parts = micro_batches(lengths_G, max_rows, max_tokens, groups)
        assert sorted(torch.cat(parts).tolist()) == list(range(rows.num_rows))
        for part in parts:
            held = {group_of[b] for b in part.tolist()}
            assert sum(len(groups[g]) for g in held) == len(part), "a group was split"
            if len(held) > 1:
                assert len(part) <= max_rows
                if max_tokens:
                    assert len(held) * max(int(lengths_G[g]) for g in held) <= max_tokens


def test_auto_shares_where_prompts_dominate():
    def batch_of(prompt: int, responses: list[int], groups: int):
        lengths = torch.tensor([prompt + r for r in responses] * groups)
        members = [torch.arange(g * len(responses), (g + 1) * len(responses)) for g in range(groups)]
        return lengths, torch.full_like(lengths, prompt), members

    assert shared_prompts.worth_sharing(*batch_of(55, [20] * 8, 4))  # the CPU recipes: 3x fewer
    assert not shared_prompts.worth_sharing(*batch_of(200, [2300] * 8, 2))  # the 8B recipe: 7%
    assert not shared_prompts.worth_sharing(*batch_of(6000, [400] * 8, 1))  # a mask too large


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    recipe = recipe_for(tmp_path_factory.mktemp("shared"), 'train.share_prompts="on"')
    return Learner(resolve_model(recipe.model.path), recipe)


def test_packed_logprobs_and_gradients_equal_the_rows(learner):
    vocab = learner.arch.hf_config["vocab_size"]
    pack, *_ = random_pack(11, num_prompts=5, n=4, vocab=vocab)
    rows = pack.to_batch(torch.arange(pack.num_rows))
    weights_BL = torch.randn(rows.mask_BL.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for batch in (rows, replace(rows, prompt_lengths_B=None)):
        learner.optimizer.zero_grad(set_to_none=True)
        lp_BL, ent_BL = learner.forward_logprobs(batch, with_entropy=True)
        (lp_BL.cpu() * weights_BL).sum().backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in learner.model.named_parameters()}
        results.append((lp_BL.detach().cpu(), ent_BL.cpu(), grads))
    learner.optimizer.zero_grad(set_to_none=True)
    (lp, ent, grads), (lp_ref, ent_ref, grads_ref) = results
    assert rows.mask_BL.sum() > 30
    assert torch.equal(lp != 0, rows.mask_BL.bool() & (lp_ref != 0))
    assert torch.allclose(lp, lp_ref, atol=1e-5, rtol=0)
    assert torch.allclose(ent, ent_ref, atol=1e-5, rtol=0)
    scale = max(float(g.abs().max()) for g in grads_ref.values())
    for name, ref in grads_ref.items():
        assert torch.allclose(grads[name], ref, atol=1e-5 * scale, rtol=0), name


def test_a_response_never_sees_another(learner):
    vocab = learner.arch.hf_config["vocab_size"]
    pack, *_ = random_pack(5, num_prompts=2, n=3, vocab=vocab)
    rows = pack.to_batch(torch.arange(pack.num_rows))
    first = int(rows.lengths_B.argmax())  # a row with a response; change its response tokens
    changed = rows.tokens_BL.clone()
    p, end = int(rows.prompt_lengths_B[first]), int(rows.lengths_B[first])
    changed[first, p:end] = (changed[first, p:end] + 1) % vocab
    with torch.no_grad():
        before, _ = learner.forward_logprobs(rows)
        after, _ = learner.forward_logprobs(replace(rows, tokens_BL=changed))
    others = torch.arange(rows.num_rows) != first
    assert torch.allclose(before[others], after[others], atol=1e-6, rtol=0)
    assert not torch.allclose(before[first], after[first], atol=1e-3, rtol=0)


def test_the_learner_packs_whole_groups_when_sharing(learner):
    pack, *_ = random_pack(4, num_prompts=6, n=4, vocab=learner.arch.hf_config["vocab_size"])
    rows = pack.to_batch(torch.arange(pack.num_rows))
    parts = learner.micro_batches(rows)
    assert sorted(torch.cat([index for index, _ in parts]).tolist()) == list(range(rows.num_rows))
    for index, part in parts:
        assert part.prompt_lengths_B is not None, "share_prompts = on packs every micro-batch"
        prompts = {tuple(rows.tokens_BL[b, : int(rows.prompt_lengths_B[b])].tolist()) for b in index.tolist()}
        whole = [
            b
            for b in range(rows.num_rows)
            if tuple(rows.tokens_BL[b, : int(rows.prompt_lengths_B[b])].tolist()) in prompts
        ]
        assert sorted(index.tolist()) == whole, "a group was split across micro-batches"
    assert all(
        p.prompt_lengths_B is None for _, p in learner.micro_batches(replace(rows, prompt_lengths_B=None))
    )


def test_the_heads_gradient_is_the_same_on_every_run_though_positions_repeat():
    """A shared prompt's last position feeds every sample of its group, so the head reads some of
    `h` many times. The backward must add those repeats in a fixed order: advanced indexing's
    backward adds them with parallel atomic float adds on the CPU, which differ in the last bits
    from run to run (with these sizes, nearly every run; `TEST_THREADS` threads)."""
    from m2po_cli.learner.logprobs import LogprobHead, ScoreRequest

    gen = torch.Generator().manual_seed(0)
    head = LogprobHead(64, 32, bias=False)
    h_BLD = torch.randn(30, 100, 64, generator=gen, requires_grad=True)
    source_N = torch.randint(0, 300, (2700,), generator=gen)  # 2,700 reads of 300 positions
    head.request = ScoreRequest(source_N, torch.randint(0, 32, (2700,), generator=gen), 1.0, False)
    weight_N = torch.randn(2700, generator=gen)

    def gradient() -> torch.Tensor:
        h_BLD.grad = None
        logprobs_N, _ = head(h_BLD)
        (logprobs_N * weight_N).sum().backward()
        return h_BLD.grad.clone()

    first = gradient()
    assert all(torch.equal(gradient(), first) for _ in range(30))
