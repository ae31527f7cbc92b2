"""A real `vllm serve` process: sampling over HTTP, the shared-memory weight transport, version checks."""

from __future__ import annotations

import functools

import httpx
import psutil
import pytest
import torch

from m2po_cli.config import SyntheticConfig
from m2po_cli.data import PromptBatches, encode_prompt, synthetic_arithmetic
from m2po_cli.learner import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import resolve_model
from m2po_cli.rollout.producer import RolloutProducer
from m2po_cli.rollout.server import EngineError, EngineServer, parse_completions, sampling_body, swap_weights
from m2po_cli.rollout.transport import ShmWeightTransport
from m2po_cli.train.packed import pack_groups
from m2po_cli.train.updates import train_on
from tests.conftest import no_record, recipe_for
from tests.test_weight_sync import logprob_gap, sampled_batch

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-qwen3"  # tied embeddings: the reload must re-derive the output layer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    recipe = recipe_for(
        tmp,
        f'model.path="{MODEL}"',
        'rollout.mode="separate"',
        'staleness.mode="bounded"',
        "rollout.prompts_per_step=4",
        "optim.lr=0.02",
        'loss={type="grpo"}',
    )
    model_dir = resolve_model(MODEL)
    server = EngineServer.start(model_dir, recipe.rollout, "float32", 64, tmp / "engine.log")
    learner = Learner(model_dir, recipe)
    yield recipe, server, learner
    pid = server.proc.pid
    server.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))


class HTTPEngine:
    """The two calls `sampled_batch` and `logprob_gap` make, served over HTTP."""

    def __init__(self, server: EngineServer, recipe):
        self.server, self.recipe = server, recipe

    def generate(self, prompts, seed):
        return [self._sample(p) for p in prompts]

    def _sample(self, prompt):
        body = sampling_body(prompt, self.recipe.rollout)
        return parse_completions(
            httpx.post(f"{self.server.url}/v1/completions", json=body, timeout=60).json()
        )

    def prompt_logprobs(self, sequences):
        return self.server.prompt_logprobs(sequences)


def probe(tokenizer):
    return [
        encode_prompt(tokenizer, "{problem}", p) + tokenizer.encode(a, add_special_tokens=False)
        for p, a in [("3+4", "\\boxed{7}"), ("12+30", "\\boxed{42}"), ("0+0", "\\boxed{1}")]
    ]


def test_samples_carry_tokens_and_behaviour_logprobs(served, tokenizer):
    recipe, server, learner = served
    engine = HTTPEngine(server, recipe)
    batch = sampled_batch(engine, tokenizer, recipe, learner.version)
    assert batch.num_rows == 4 * recipe.rollout.n
    responses_B = batch.response_len_B
    assert bool((responses_B > 0).all()) and batch.behaviour_R.numel() == int(responses_B.sum())
    # The engine's logprobs of its own samples are the learner's at the same weights (processed mode).
    offsets, starts = batch.offsets_B1.tolist(), batch.response_offsets().tolist()
    sequences = [batch.tokens_N[offsets[b] : offsets[b + 1]].tolist() for b in range(batch.num_rows)]
    from_server = server.prompt_logprobs(sequences)
    for b, seq_lp in enumerate(from_server):
        k = int(responses_B[b])
        behaviour = batch.behaviour_R[starts[b] : starts[b + 1]].tolist()
        assert max(abs(x - y) for x, y in zip(seq_lp[-k:], behaviour, strict=True)) < 1e-4


def test_shm_sync_makes_server_match_learner(served, tokenizer, tmp_path):
    recipe, server, learner = served
    engine = HTTPEngine(server, recipe)
    sequences = probe(tokenizer)
    transport = ShmWeightTransport(0, 1, torch.float32, functools.partial(swap_weights, [server]), tag="test")
    try:
        transport.push(learner)
        assert logprob_gap(engine, learner, sequences) < 1e-4
        for _ in range(2):
            batch = sampled_batch(engine, tokenizer, recipe, learner.version)
            train_on(batch, learner, build_loss(recipe.loss), None, recipe, no_record(tmp_path, learner), 0)
            stale = logprob_gap(engine, learner, sequences)
            assert stale > 1e-3, f"a skipped sync moved the probe by only {stale:.2e}"
            transport.after_update(learner)
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


def test_each_group_was_sampled_by_the_version_it_records(served, tokenizer, tmp_path):
    """max_staleness = 0: every group is trained at the version it records, so its behaviour logprobs
    must be the learner's own, through syncs that abort and regenerate requests in flight."""
    recipe, server, learner = served
    problems = synthetic_arithmetic(SyntheticConfig(max_operand=4, num_problems=64), seed=0)
    prompts = PromptBatches(problems, tokenizer, recipe.data, 4)
    producer = RolloutProducer([server], prompts, recipe.rollout, 4, 0, learner.version)
    record = no_record(tmp_path, learner)
    transport = ShmWeightTransport(0, 1, torch.float32, producer.swap, tag="test-producer")
    transport.push(learner)
    producer.start()
    try:
        for _ in range(3):
            groups = producer.take(4, learner.version)
            assert {g.version for g in groups} == {learner.version}
            assert server.weight_version() == str(learner.version)
            batch = pack_groups(
                learner.version,
                0,
                [g.prompt.token_ids for g in groups],
                [g.completions for g in groups],
                torch.randint(0, 2, (4, recipe.rollout.n)).float(),
                True,
                1e-6,
            )
            rows = batch.to_batch(torch.arange(batch.num_rows))
            learner_BL, _ = learner.score(rows)
            gap = float(((learner_BL - rows.behaviour_logprobs_BL).abs() * rows.mask_BL).max())
            assert gap < 1e-4, f"samples recorded as version {learner.version} differ from it by {gap:.2e}"
            train_on(batch, learner, build_loss(recipe.loss), transport.after_update, recipe, record, 0)
        metrics = producer.take_metrics()
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
