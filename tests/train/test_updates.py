"""What a row trains is data: a response token whose `trained_R` flag is off (a span an environment
wrote) is context for the learner and nothing else. Random episodes (model turns and environment
spans between them) go through one real update (`train_on`, the tiny model) and every count is held
to a literal count of the trained tokens: the loss's token count, M2PO's second moment and mask, the
masked share, the staleness and replay ages, the recorded tokens `m2po inspect` reads, and the
rollout metrics; the M2PO loss is held to Algorithm 1 and the loss over the trained tokens alone."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from m2po_cli.learner.policy import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import resolve_model
from m2po_cli.record import Recorder, step_path
from m2po_cli.rollout.episode import Episode
from m2po_cli.rollout.types import Completion
from m2po_cli.train.pack import pack_groups
from m2po_cli.train.packed import PackedRollouts
from m2po_cli.train.reuse import StepPlan
from m2po_cli.train.updates import rollout_metrics, train_on
from tests.conftest import recipe_for
from tests.test_loss import algorithm1, literal_loss

NOISE = 0.5  # behaviour logprobs off the learner's by up to this: M2PO masks some trained tokens
FAR = 40.0  # the untrained tokens' behaviour logprobs: were they counted, M2's mean would explode
UNTRAINED_VERSION = -5  # and their staleness would be 5


def random_episode(vocab: int, g: torch.Generator) -> Episode:
    """One to three model turns of 2-6 tokens with an environment span of 2-6 tokens between each two."""

    def tokens() -> list[int]:
        return torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()

    turns = int(torch.randint(1, 4, (1,), generator=g))
    segments: list = []
    for t in range(turns):
        if t:
            segments.append(tokens())
        sampled = tokens()
        segments.append(Completion(sampled, [0.0] * len(sampled), "", True))
    return Episode(segments)


def packed_rows(vocab: int, learner: Learner) -> tuple[PackedRollouts, torch.Tensor]:
    """Four prompts x 4 random episodes; rows 0-7 fresh, 8-15 stand for replayed ones. The
    environment's spans are untrained, and one row is untrained whole. Returns the rows and the
    learner's current logprob of every response token (`[R]`)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (5,), generator=g).tolist() for _ in range(4)]
    groups = [[random_episode(vocab, g) for _ in range(4)] for _ in prompts]
    rewards_PG = torch.tensor(
        [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0, 1, 0, 1.0]]
    )
    pack = pack_groups(0, 0, prompts, groups, rewards_PG, True, 1e-6)
    flags = [
        isinstance(s, Completion)
        for group in groups
        for e in group
        for s in e.segments
        for _ in (s.token_ids if isinstance(s, Completion) else s)
    ]
    assert pack.trained_R.tolist() == flags
    assert pack.turns_B.tolist() == [len(e.turns) for group in groups for e in group]
    pack.trained_R = torch.ones_like(pack.trained_R)  # the learner scores every response token once
    everything = pack.to_batch(torch.arange(pack.num_rows))
    current_R = learner.score(everything)[0][everything.mask_BL.bool()]
    pack.trained_R = torch.tensor(flags)
    pack.trained_R[pack.response_index(torch.tensor([5]))] = False
    noise_R = NOISE * (2 * torch.rand(current_R.shape, generator=g) - 1)
    pack.behaviour_R = torch.where(pack.trained_R, current_R + noise_R, current_R - FAR)
    # Trained tokens were sampled at version 0 (fresh rows) or -1 (replayed: age 1).
    replayed_R = torch.zeros_like(pack.trained_R)
    replayed_R[pack.response_index(torch.arange(8, 16))] = True
    pack.version_R = torch.where(pack.trained_R, -replayed_R.int(), UNTRAINED_VERSION).int()
    return pack, current_R


@pytest.fixture(scope="module")
def updated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    recipe = recipe_for(
        tmp,
        "rollout.prompts_per_step=4",
        "rollout.n=4",
        "train.mini_batch_prompts=4",
        "staleness.s=0",
        "loss.tau=0.01",
        "inspect.every=1",
        "inspect.tokens=0",
        'reuse={mode="replay", buffer=2, replay=1.0, max_age=8}',
    )
    learner = Learner(resolve_model(recipe.model.path), recipe)
    pack, current_R = packed_rows(learner.arch.hf_config["vocab_size"], learner)
    split_B = (torch.arange(pack.num_rows) >= 8).long()  # class 1: replayed at age 1
    recorder = Recorder(recipe.run_dir, recipe.inspect, recipe.run.seed, learner.rank, learner.world)
    plan = StepPlan(pack, [torch.arange(pack.num_rows)], split_B)
    metrics = train_on(plan, learner, build_loss(recipe.loss), None, recipe, recorder, 0)
    return recipe, pack, current_R, metrics


def literal_rows(pack: PackedRollouts, current_R: torch.Tensor):
    """Per row, the trained tokens' log r and advantage, as Python lists (untrained: not valid)."""
    log_ratio, advantages, valid = [], [], []
    for b in range(pack.num_rows):
        index = pack.response_index(torch.tensor([b]))
        log_ratio.append((current_R[index] - pack.behaviour_R[index]).tolist())
        advantages.append([float(pack.advantages_B[b])] * index.numel())
        valid.append(pack.trained_R[index].tolist())
    return log_ratio, advantages, valid


def test_the_loss_counts_and_masks_only_trained_tokens(updated):
    recipe, pack, current_R, metrics = updated
    num_trained = int(pack.trained_R.sum())
    assert 0 < num_trained < pack.trained_R.numel() - 20
    assert metrics["loss/num_tokens"] == num_trained
    log_ratio, advantages, valid = literal_rows(pack, current_R)
    masked, before, after = algorithm1(log_ratio, advantages, valid, recipe.loss.tau, pack.row_B.tolist())
    assert masked, "M2PO masked nothing: the check below could not tell"
    assert metrics["m2po/num_masked"] == len(masked)
    assert metrics["m2po/m2_before"] == pytest.approx(before, rel=1e-5)
    assert metrics["m2po/m2_after"] == pytest.approx(after, rel=1e-5)
    assert metrics["loss/clip_frac"] == pytest.approx(len(masked) / num_trained)
    expected = literal_loss(log_ratio, advantages, valid, lambda b, t, r: 0.0 if (b, t) in masked else r)
    assert metrics["loss/loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_staleness_ages_and_replay_shares_count_only_trained_tokens(updated):
    _, pack, _, metrics = updated
    assert (metrics["staleness/min"], metrics["staleness/max"]) == (0, 0)
    assert metrics["reuse/age_min"] == metrics["reuse/age_max"] == 1
    replayed = int(pack.trained_R[pack.response_index(torch.arange(8, 16))].sum())
    assert metrics["reuse/replayed_token_frac"] == pytest.approx(replayed / int(pack.trained_R.sum()))


def test_the_records_and_rollout_metrics_count_only_trained_tokens(updated):
    recipe, pack, current_R, _ = updated
    record = load_file(str(step_path(recipe.run_dir, 0)))
    rows = record["row_R"].tolist()
    assert sorted(rows) == list(range(pack.num_rows)), "every row recorded"
    for b, length in zip(rows, record["lengths_R"].tolist(), strict=True):
        assert length == int(pack.trained_R[pack.response_index(torch.tensor([b]))].sum())
    trained = torch.cat([pack.trained_index(torch.tensor([b])) for b in rows])
    assert torch.equal(record["behaviour_logprobs_N"], pack.behaviour_R[trained])
    turns = []  # literal: the model turn of each trained token, row after row
    for b in rows:
        flags = pack.trained_R[pack.response_index(torch.tensor([b]))].tolist()
        turn = -1
        for k, flag in enumerate(flags):
            turn += flag and (k == 0 or not flags[k - 1])
            if flag:
                turns.append(turn)
    assert record["turn_N"].tolist() == turns and max(turns) == 2
    assert torch.allclose(record["logprobs_N"], current_R[trained], atol=1e-5)
    assert (record["staleness_N"] <= 1).all()
    means = rollout_metrics(pack)
    assert means["rollout/response_tokens_mean"] == int(pack.trained_R.sum()) / pack.num_rows
    assert math.isfinite(means["rollout/reward_mean"])
