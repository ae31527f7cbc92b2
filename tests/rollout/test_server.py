"""A real `vllm serve` process: sampling over HTTP, the shared-memory weight transport, version checks."""

from __future__ import annotations

import functools
import json

import httpx
import psutil
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from m2po_cli.config import SyntheticConfig
from m2po_cli.data import PromptBatches, encode_prompt, synthetic_arithmetic
from m2po_cli.learner.policy import Learner
from m2po_cli.models import resolve_model
from m2po_cli.rollout.episode import one_turn
from m2po_cli.rollout.producer import RolloutProducer
from m2po_cli.rollout.server import (
    GENERATE,
    EngineError,
    EngineServer,
    parse_completions,
    sampling_body,
    swap_weights,
    token_versions,
)
from m2po_cli.rollout.transport import ShmWeightTransport
from m2po_cli.rollout.types import Completion
from m2po_cli.schedule import Schedule
from m2po_cli.train.pack import pack_groups
from tests.conftest import no_record, recipe_for
from tests.probes import server_prompt_logprobs
from tests.rollout.test_weight_sync import logprob_gap, sampled_batch
from tests.steps import train_once

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-qwen3"  # tied embeddings: the reload must re-derive the output layer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    recipe = recipe_for(
        tmp,
        f'model.path="{MODEL}"',
        'rollout.mode="separate"',
        "rollout.prompts_per_step=4",
        "optim.lr=0.02",
        'loss={type="grpo"}',
    )
    model_dir = resolve_model(MODEL)
    server = EngineServer.start(model_dir, recipe.rollout, "float32", 256, tmp / "engine.log")
    learner = Learner(model_dir, recipe)
    server.set_version(learner.version)  # the weights it loaded are the learner's first
    yield recipe, server, learner
    pid = server.proc.pid
    server.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))


class HTTPEngine:
    """`generate` served over HTTP, for `sampled_batch`; `logprob_gap` reads its `server`."""

    def __init__(self, server: EngineServer, recipe, tokenizer):
        self.server, self.recipe = server, recipe
        self.decode = functools.partial(tokenizer.decode, skip_special_tokens=True)

    def generate(self, prompts, seeds):
        return [self._sample(p, seed) for p, seed in zip(prompts, seeds, strict=True)]

    def _sample(self, prompt, seed):
        body = sampling_body(prompt, self.recipe.rollout, seed)
        response = httpx.post(f"{self.server.url}{GENERATE}", json=body, timeout=60).json()
        return parse_completions(response, self.decode)


def probe(tokenizer):
    return [
        encode_prompt(tokenizer, "{problem}", p) + tokenizer.encode(a, add_special_tokens=False)
        for p, a in [("3+4", "\\boxed{7}"), ("12+30", "\\boxed{42}"), ("0+0", "\\boxed{1}")]
    ]


def test_samples_carry_tokens_and_behaviour_logprobs(served, tokenizer):
    recipe, server, learner = served
    engine = HTTPEngine(server, recipe, tokenizer)
    batch = sampled_batch(engine, tokenizer, recipe, learner.version)
    assert batch.num_rows == 4 * recipe.rollout.n
    responses_B = batch.response_len_B
    assert bool((responses_B > 0).all()) and batch.behaviour_R.numel() == int(responses_B.sum())
    # The server returns tokens only; the text the grader reads is decoded on the run's side.
    completions = engine.generate([encode_prompt(tokenizer, "{problem}", "3+4")], [0])[0]
    assert sum(c.text.startswith("\\boxed{") for c in completions) >= len(completions) // 2, completions
    # The engine's logprobs of its own samples are the learner's at the same weights (processed mode).
    offsets, starts = batch.offsets_B1.tolist(), batch.response_offsets().tolist()
    sequences = [batch.tokens_N[offsets[b] : offsets[b + 1]].tolist() for b in range(batch.num_rows)]
    from_server = server_prompt_logprobs(server, sequences)
    for b, seq_lp in enumerate(from_server):
        k = int(responses_B[b])
        behaviour = batch.behaviour_R[starts[b] : starts[b + 1]].tolist()
        assert max(abs(x - y) for x, y in zip(seq_lp[-k:], behaviour, strict=True)) < 1e-4


def test_shm_sync_makes_server_match_learner(served, tokenizer, tmp_path):
    recipe, server, learner = served
    engine = HTTPEngine(server, recipe, tokenizer)
    sequences = probe(tokenizer)
    transport = ShmWeightTransport(0, 1, torch.float32, functools.partial(swap_weights, [server]), tag="test")
    try:
        transport.push(learner)
        transport.wait()
        assert logprob_gap(engine, learner, sequences) < 1e-4
        for _ in range(2):
            batch = sampled_batch(engine, tokenizer, recipe, learner.version)
            train_once(batch, learner, recipe)
            stale = logprob_gap(engine, learner, sequences)
            assert stale > 1e-3, f"a skipped sync moved the probe by only {stale:.2e}"
            transport.after_update(learner)
            transport.wait()
            assert logprob_gap(engine, learner, sequences) < 1e-4
            assert server.weight_version() == str(learner.version)
        m = transport.take_metrics()
        assert m["perf/weight_syncs"] == 3
        num_params = sum(p.numel() for p in learner.model.parameters())
        assert m["perf/weight_sync_bytes"] == 3 * 4 * num_params
    finally:
        transport.close()
    assert not transport.folder.exists()


def test_version_mismatch_stops_with_a_clear_message(served):
    _, server, learner = served
    server.set_version(learner.version + 7)
    with pytest.raises(EngineError, match=f"reports weight version '{learner.version + 7}'"):
        server.check_version(learner.version)
    server.set_version(learner.version)
    server.check_version(learner.version)


def test_an_engine_that_cannot_reach_the_rendezvous_is_named_before_the_first_sync(served):
    from m2po_cli.rollout.nccl import check_rendezvous

    _, server, _ = served
    check_rendezvous([server], "127.0.0.1", 5.0)  # its worker connects to the learner's listener
    # TEST-NET-1 (RFC 5737) is never assigned to a host: the connection cannot succeed.
    with pytest.raises(EngineError) as caught:
        check_rendezvous([server], "192.0.2.1", 1.0)
    message = str(caught.value)
    assert message.startswith(f"rollout server(s) {server.url} (")
    assert "could not reach the weight transport's rendezvous at 192.0.2.1 within 1 s" in message
    assert "\n" not in message


class Versions:
    """The learner's weights at each version it pushed, to score tokens under the version that
    sampled them."""

    def __init__(self, learner):
        self.learner, self.states = learner, {}

    def keep(self):
        state = get_model_state_dict(self.learner.model)
        self.states[self.learner.version] = {k: v.detach().clone() for k, v in state.items()}

    def score(self, version: int, rows):
        now = {k: v.detach().clone() for k, v in get_model_state_dict(self.learner.model).items()}
        set_model_state_dict(self.learner.model, self.states[version])
        try:
            return self.learner.score(rows)[0]
        finally:
            set_model_state_dict(self.learner.model, now)


def move_weights(learner: Learner, seed: int) -> None:
    """Stand in for an optimizer update whose size is forced: seeded noise (std 0.2) on every
    weight, and the version an update would give."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.model.parameters():
            local = p.to_local()  # one rank: the whole tensor
            local.add_(0.2 * torch.randn(local.shape, generator=gen))
    learner.version += 1


def behaviour_gap(versions: Versions, batch, use_version=None) -> float:
    """Largest |engine - learner| logprob over the batch's response tokens, each token scored under
    its recorded version (or under `use_version` for all of them)."""
    rows = batch.to_batch(torch.arange(batch.num_rows))
    mask_BL = rows.mask_BL.bool()
    version_BL = torch.zeros(mask_BL.shape, dtype=torch.long)
    version_BL[mask_BL] = batch.version_R.long()
    gap = 0.0
    for v in version_BL[mask_BL].unique().tolist() if use_version is None else [use_version]:
        at_v = mask_BL & ((version_BL == v) | (use_version is not None))
        learner_BL = versions.score(v, rows)
        gap = max(gap, float((learner_BL - rows.behaviour_logprobs_BL).abs()[at_v].max()))
    return gap


def stream_until(server, body, num_tokens, then):
    """Stream one generate request; after its first `num_tokens` tokens call `then()`, then read
    it to the end. Returns the completion, with per-token versions."""
    body = {**body, "stream": True}
    tokens, logprobs, spans, started = [], [], None, False
    with httpx.stream("POST", f"{server.url}{GENERATE}", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            tokens += choice.get("token_ids") or []
            logprobs += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or []]
            spans = choice.get("weight_versions") or spans
            if len(tokens) >= num_tokens and not started:
                started = True
                then()
    return Completion(tokens, logprobs, "", False, token_versions(spans, len(tokens)))


def test_a_sync_mid_response_keeps_the_request_and_each_token_is_its_versions(served, tokenizer):
    """A weight sync while a response is being sampled: the request goes on (no abort), its tokens
    before the sync carry the old version and match the old weights, those after carry the new one
    and match the new weights, their KV cache recomputed (not the old weights' reused)."""
    recipe, server, learner = served
    versions = Versions(learner)
    transport = ShmWeightTransport(0, 1, torch.float32, functools.partial(swap_weights, [server]), tag="mid")
    try:
        transport.push(learner)
        transport.wait()
        versions.keep()
        before = learner.version
        # A new version far from the old one (the sync below sends it mid-response): noise ten times
        # the initial weights' scale, so the two versions score any token apart, whatever they sampled.
        move_weights(learner, seed=0)
        versions.keep()
        prompt = probe(tokenizer)[0]
        body = sampling_body(prompt, recipe.rollout, seed=0)
        body["sampling_params"] |= {"n": 1, "max_tokens": 160, "ignore_eos": True}
        completion = stream_until(server, body, 24, lambda: (transport.push(learner), transport.wait()))
    finally:
        transport.close()
    v = completion.versions
    assert v[0] == before and v[-1] == learner.version, f"versions {v[0]}..{v[-1]}"
    switch = v.index(learner.version)
    assert 24 <= switch < len(v) - 24 and v == [before] * switch + [learner.version] * (len(v) - switch)
    one = pack_groups(before, 0, [prompt], one_turn([[completion]]), torch.zeros(1, 1), False, 1e-6)
    assert behaviour_gap(versions, one) < 1e-4
    # The test tells the versions apart: under one version for all tokens, the others differ.
    assert behaviour_gap(versions, one, use_version=before) > 1e-3
    assert behaviour_gap(versions, one, use_version=learner.version) > 1e-3


def test_each_token_was_sampled_by_the_version_it_records(served, tokenizer, tmp_path):
    """Separate mode's producer through one sync per update: nothing is regenerated, groups are
    trained in admission order (the trained sample is the generated one, long responses included),
    every token's staleness is within the bound, and every token's behaviour logprob is the
    learner's under the weights of the version it records."""
    recipe, server, learner = served
    max_staleness, per_update = 2, 4
    problems = synthetic_arithmetic(SyntheticConfig(max_operand=4, num_problems=64), seed=0)
    prompts = PromptBatches(problems, tokenizer, recipe.data, per_update)
    schedule = Schedule(per_update, per_update, recipe.rollout.n)
    producer = RolloutProducer([server], prompts, recipe.rollout, schedule, max_staleness, learner.version)
    record, versions = no_record(tmp_path, learner), Versions(learner)
    transport = ShmWeightTransport(0, 1, torch.float32, producer.swap, tag="test-producer")

    def sync(learner):
        transport.after_update(learner)
        versions.keep()

    sync(learner)
    transport.wait()
    start, versions_before = producer.consumed, learner.version  # the learner trained before this test
    producer.start()
    try:
        for _ in range(4):
            groups = producer.take(per_update, learner.version)
            # Taken in admission order, whatever finished first: no selection by response length.
            first = (learner.version - versions_before) * per_update + start
            assert [g.index for g in groups] == list(range(first, first + per_update))
            batch = pack_groups(
                min(g.version for g in groups),
                0,
                [g.prompt.token_ids for g in groups],
                [g.rows for g in groups],
                torch.randint(0, 2, (per_update, recipe.rollout.n)).float(),
                True,
                1e-6,
            )
            staleness_R = learner.version - batch.version_R
            assert int(staleness_R.min()) >= 0 and int(staleness_R.max()) <= max_staleness
            gap = behaviour_gap(versions, batch)
            assert gap < 1e-4, f"tokens differ from the weights of the version they record by {gap:.2e}"
            train_once(batch, learner, recipe, sync, record)
        metrics = producer.take_metrics()
        assert metrics["rollout/regenerated"] == 0
        assert 0 <= metrics["perf/engine_idle_frac"] <= 1
    finally:
        producer.stop()
        transport.close()


def test_weight_folders_of_killed_runs_are_swept(tmp_path):
    """Shared memory is RAM: a folder whose run is gone is removed, a live run's is kept."""
    import os
    import subprocess
    import sys

    from m2po_cli.rollout.transport import PREFIX, sweep_orphans

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{PREFIX}run-pid{dead.pid}-abc123"
    live = tmp_path / f"{PREFIX}run-pid{os.getpid()}-def456"
    other = tmp_path / "m2po-weights-without-a-pid"
    for folder in (orphan, live, other):
        (folder / "v00000001").mkdir(parents=True)
    assert sweep_orphans(tmp_path) == [orphan]
    assert not orphan.exists() and live.exists() and other.exists()


# A server that drops the first connection, then takes a while to die of SIGKILL: the window in
# which the connection is gone while the process still runs (its sockets close first when killed).
DYING_SERVER = """
import os, signal, socket, sys, time
sock = socket.create_server(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
conn, _ = sock.accept()
conn.recv(65536)
conn.close()
time.sleep(float(sys.argv[1]))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("route", ["/pause", "/get_world_size"])
def test_a_server_killed_mid_request_is_named_as_exited_not_as_a_dropped_connection(tmp_path, route):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", DYING_SERVER, "1.0"], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    server = EngineServer(f"http://127.0.0.1:{port}", proc, tmp_path / "engine-0.log")
    with pytest.raises(EngineError) as failed:
        server.post(route) if route == "/pause" else server.world_size()
    assert str(failed.value) == (
        f"rollout server http://127.0.0.1:{port} (vllm serve, pid {proc.pid}) exited with code -9; "
        f"see {tmp_path / 'engine-0.log'}"
    )
