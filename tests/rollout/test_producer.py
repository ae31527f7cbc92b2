"""Separate mode's admission and version bound, without a server: the producer's own bookkeeping.

The producer admits a prompt only while `admitted < (engine version + max_staleness + 1) * B`, a sync
bumps the engine version, a request that spans a sync is kept (its later tokens carry the new
version), and the learner takes groups in admission order. Driven here by hand (`admit`, `finish`, `swap`, `take`) in orders a real run
would produce only by chance.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from m2po_cli.config import DataConfig, RolloutConfig, SyntheticConfig
from m2po_cli.data import PromptBatches, load_problems
from m2po_cli.rollout.episode import Episode
from m2po_cli.rollout.producer import RolloutProducer
from m2po_cli.rollout.server import EngineError, EngineServer
from m2po_cli.rollout.types import Completion
from m2po_cli.schedule import Schedule

PER_UPDATE = 2  # prompts per optimizer update (B)


def producer(char_tokenizer, max_staleness: int, version: int = 0, **carried) -> RolloutProducer:
    data = DataConfig(source="synthetic:arithmetic", synthetic=SyntheticConfig(num_problems=64))
    prompts = PromptBatches(load_problems(data), char_tokenizer, data, PER_UPDATE)
    schedule = Schedule(PER_UPDATE, PER_UPDATE, 2)
    return RolloutProducer([], prompts, RolloutConfig(n=2), schedule, max_staleness, version, **carried)


def answer(n: int = 2, versions: list[int] | None = None) -> list[Episode]:
    return [Episode.of(Completion([5, 6], [-0.5, -0.5], "x", True, versions)) for _ in range(n)]


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


def test_idle_time_is_split_by_why(char_tokenizer, monkeypatch):
    """`perf/engine_idle_frac` is the sum of three parts: paused for a sync, held by the staleness
    bound with nothing in flight, and nothing in flight otherwise; time with requests in flight and
    no sync is busy."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    p = producer(char_tokenizer, max_staleness=0)  # t = 0: nothing asked yet

    def at(t: float) -> None:
        clock[0] = t

    at(1.0)
    requests = admit_all(p)  # starved 0-1, busy from 1
    at(3.0)
    for key, ticket, version, _ in requests:
        p.finish(key, ticket, version, answer())  # all answered and the bound reached: held from 3
    at(4.0)
    p.swap(lambda servers: at(4.5), 1)  # bound 3-4, sync 4-4.5, then starved until admission
    at(5.0)
    admit_all(p)  # busy from 5
    at(6.0)
    m = p.take_metrics()
    assert m["perf/engine_idle_starved_frac"] == pytest.approx(1.5 / 6)
    assert m["perf/engine_idle_bound_frac"] == pytest.approx(1.0 / 6)
    assert m["perf/engine_idle_sync_frac"] == pytest.approx(0.5 / 6)
    assert m["perf/engine_idle_frac"] == pytest.approx(3.0 / 6)
    at(7.0)
    assert p.take_metrics()["perf/engine_idle_frac"] == 0.0  # busy the whole second since


def test_a_request_across_a_sync_is_kept_with_the_version_of_its_submission(char_tokenizer):
    p = producer(char_tokenizer, max_staleness=1)
    (key, ticket, version, url), *rest = admit_all(p)
    p.swap(lambda servers: None, 1)
    p.finish(key, ticket, version, answer(versions=[0, 1]))  # one token before the sync, one after
    assert [(g.prompt, g.version) for g in p.done.values()] == [(ticket[1], 0)], "nothing is thrown away"
    assert p.take_metrics()["rollout/regenerated"] == 0
    assert p.snapshot()["in_flight"].count([ticket[0], ticket[1].problem.index]) == 1, "until trained"


@pytest.mark.parametrize("versions", [[0, 0], [1, 3]], ids=["older-than-submitted", "newer-than-the-engine"])
def test_token_versions_the_run_never_had_stop_it(char_tokenizer, versions):
    p = producer(char_tokenizer, max_staleness=2, version=1)
    key, ticket, version, _ = p.admit()
    p.swap(lambda servers: None, 2)
    p.finish(key, ticket, version, answer(versions=versions))
    with pytest.raises(EngineError, match="another trainer may be updating this server"):
        p.take(1, 1)


def test_requests_in_flight_are_capped_per_server_and_balanced(char_tokenizer):
    """Admission sends at most twice an engine's concurrency in sequences to each server (here
    max_num_seqs 8, n 2: 8 requests), to the least loaded one; a finished request frees a place."""
    servers = [EngineServer("http://127.0.0.1:9"), EngineServer("http://127.0.0.1:10")]
    for s in servers:
        s.max_num_seqs = 8
    data = DataConfig(source="synthetic:arithmetic", synthetic=SyntheticConfig(num_problems=64))
    prompts = PromptBatches(load_problems(data), char_tokenizer, data, PER_UPDATE)
    p = RolloutProducer(servers, prompts, RolloutConfig(n=2), Schedule(PER_UPDATE, PER_UPDATE, 2), 100, 0)
    requests = admit_all(p)
    assert len(requests) == 16
    assert Counter(url for *_, url in requests) == {servers[0].url: 8, servers[1].url: 8}
    key, ticket, version, url = requests[3]
    p.finish(key, ticket, version, answer())
    (*_, next_url) = p.admit()
    assert next_url == url and p.admit() is None


@pytest.mark.parametrize("seed", range(5))
# The smallest bounds the recipe allows: max_staleness >= updates_per_step - 1 + sync_every - 1.
@pytest.mark.parametrize("max_staleness,sync_every", [(1, 1), (3, 1), (2, 2), (3, 3)])
def test_no_group_is_trained_past_the_bound(char_tokenizer, seed, max_staleness, sync_every):
    """Requests finish in a random order, some across syncs (their last token sampled by the
    engine's version when they finish); the learner trains 2 updates a step and syncs every
    `sync_every` updates. Every token is trained within `max_staleness` updates of the version
    that sampled it, and no prompt is trained twice or lost."""
    rng = random.Random(seed)
    p = producer(char_tokenizer, max_staleness)
    running, trained, learner_version = [], [], 0
    updates_per_step = 2
    for _ in range(10_000):
        if len(trained) >= 40 * PER_UPDATE:
            break
        running += admit_all(p)
        rng.shuffle(running)
        for key, ticket, version, _ in running[: rng.randint(0, len(running))]:
            running.remove((key, ticket, version, _))
            p.finish(key, ticket, version, answer(versions=[version, p.engine_version]))
        if not p.ready(updates_per_step * PER_UPDATE):
            continue
        groups = p.take(updates_per_step * PER_UPDATE, learner_version)
        for j, g in enumerate(groups):
            for version in g.rows[0].versions(g.version):
                assert 0 <= learner_version + j // PER_UPDATE - version <= max_staleness
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


def test_the_learner_takes_groups_in_admission_order_so_slow_ones_are_not_overtaken(char_tokenizer):
    """The first prompt's request finishes last (a long response): the learner waits for it rather
    than train the short ones first, which would bias each step's sample towards short responses."""
    p = producer(char_tokenizer, max_staleness=1)
    requests = admit_all(p)
    for key, ticket, version, _ in requests[1:]:
        p.finish(key, ticket, version, answer())
    assert not p.ready(PER_UPDATE), "the first group is still generating"
    key, ticket, version, _ = requests[0]
    p.finish(key, ticket, version, answer())
    taken = p.take(PER_UPDATE, 0)
    assert [g.prompt for g in taken] == [t[1] for _, t, _, _ in requests[:PER_UPDATE]]
