"""Separate mode's admission and version bound, without a server: the producer's own bookkeeping.

The producer admits a prompt only while `admitted < (engine version + max_staleness + 1) * B`, a sync
bumps the engine version, a request that spans a sync is submitted again, and the learner takes the
oldest groups first. Driven here by hand (`admit`, `finish`, `swap`, `take`) in orders a real run
would produce only by chance.
"""

from __future__ import annotations

import random

import pytest

from m2po_cli.config import DataConfig, RolloutConfig, SyntheticConfig
from m2po_cli.data import PromptBatches, load_problems
from m2po_cli.rollout.engine import Completion
from m2po_cli.rollout.producer import RolloutProducer

PER_UPDATE = 2  # prompts per optimizer update (B)


def producer(char_tokenizer, max_staleness: int, version: int = 0, **carried) -> RolloutProducer:
    data = DataConfig(source="synthetic:arithmetic", synthetic=SyntheticConfig(num_problems=64))
    prompts = PromptBatches(load_problems(data), char_tokenizer, data, PER_UPDATE)
    return RolloutProducer([], prompts, RolloutConfig(n=2), PER_UPDATE, max_staleness, version, **carried)


def answer(n: int = 2) -> list[Completion]:
    return [Completion([5, 6], [-0.5, -0.5], "x", True) for _ in range(n)]


def admit_all(p: RolloutProducer) -> list[tuple]:
    requests = []
    while (request := p.admit()) is not None:
        requests.append(request)
    return requests


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_admission_stops_at_the_bound_and_a_sync_opens_it(char_tokenizer, max_staleness):
    p = producer(char_tokenizer, max_staleness)
    first = admit_all(p)
    assert len(first) == (max_staleness + 1) * PER_UPDATE
    assert {version for _, _, version, _ in first} == {0}
    p.swap(lambda servers: None, 1)
    more = admit_all(p)
    assert len(more) == PER_UPDATE and {version for _, _, version, _ in more} == {1}


def test_a_request_across_a_sync_is_submitted_again_and_keeps_no_old_version(char_tokenizer):
    p = producer(char_tokenizer, max_staleness=1)
    (key, ticket, version, sync), *rest = admit_all(p)
    p.swap(lambda servers: None, 1)
    p.finish(key, ticket, version, sync, answer())  # it finished, but a sync began meanwhile
    assert not p.done and p.snapshot()["in_flight"].count([ticket[0], ticket[1].problem.index]) == 1
    key2, ticket2, version2, sync2 = p.admit()
    assert ticket2 is ticket and version2 == 1, "the same prompt, sent again under the new weights"
    p.finish(key2, ticket2, version2, sync2, answer())
    assert [g.version for g in p.done] == [1]


@pytest.mark.parametrize("seed", range(5))
# The smallest bounds the recipe allows: max_staleness >= updates_per_step - 1 + sync_every - 1.
@pytest.mark.parametrize("max_staleness,sync_every", [(1, 1), (3, 1), (2, 2), (3, 3)])
def test_no_group_is_trained_past_the_bound(char_tokenizer, seed, max_staleness, sync_every):
    """Requests finish in a random order, some across syncs; the learner trains 2 updates a step
    and syncs every `sync_every` updates. Every group is trained within `max_staleness` updates of
    the version that generated it, and no prompt is trained twice or lost."""
    rng = random.Random(seed)
    p = producer(char_tokenizer, max_staleness)
    running, trained, learner_version = [], [], 0
    updates_per_step = 2
    for _ in range(10_000):
        if len(trained) >= 40 * PER_UPDATE:
            break
        running += admit_all(p)
        rng.shuffle(running)
        for request in running[: rng.randint(0, len(running))]:
            running.remove(request)
            p.finish(*request, answer())
        if len(p.done) < updates_per_step * PER_UPDATE:
            continue
        groups = p.take(updates_per_step * PER_UPDATE, learner_version)
        for j, g in enumerate(groups):
            staleness = learner_version + j // PER_UPDATE - g.version
            assert 0 <= staleness <= max_staleness
        trained += [(g.epoch, g.prompt.problem.index) for g in groups]
        for _ in range(updates_per_step):
            learner_version += 1
            if learner_version % sync_every == 0:
                p.swap(lambda servers: None, learner_version)
    assert len(trained) == 40 * PER_UPDATE, "the producer stalled"
    assert len(trained) == len(set(trained)), "a prompt was trained twice"


def test_carried_prompts_go_first_and_count_as_admitted(char_tokenizer):
    """A resumed producer regenerates what a checkpoint had in flight before anything new, and those
    prompts count against the bound at the learner's version."""
    first = producer(char_tokenizer, max_staleness=1)
    carried = [ticket for _, ticket, _, _ in admit_all(first)][:3]
    p = producer(char_tokenizer, max_staleness=1, version=5, in_flight=carried)
    requests = admit_all(p)
    assert [ticket for _, ticket, _, _ in requests[:3]] == carried
    assert len(requests) == (1 + 1) * PER_UPDATE, "the carried prompts used up part of the bound"
