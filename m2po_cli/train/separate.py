"""Separate rollouts: vLLM engines in their own processes generate while the learner trains.

Rank 0 owns the rollout servers (started here or attached), the producer's threads and the
grader, which grades each group as it finishes and packs it into tensors; every rank trains its
slice of each optimizer batch and takes part in the weight transport. One step takes
`prompts_per_step` finished groups in admission order; the engines get the weights every
`rollout.sync_every` updates, without stopping the requests in flight. No token is trained more
than `staleness.max_staleness` updates after the policy that sampled it (the producer's admission
keeps the bound).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from m2po_cli.checkpoint import Restored
from m2po_cli.config import Recipe
from m2po_cli.data import PromptBatches
from m2po_cli.device import resolve_dtype, torch_dtype
from m2po_cli.grader import Grader, grader_workers, recipe_grader
from m2po_cli.learner.policy import Learner
from m2po_cli.record import Recorder
from m2po_cli.rollout.deadline import SyncWatch
from m2po_cli.rollout.episode import Episodes
from m2po_cli.rollout.payload import lora_slots
from m2po_cli.rollout.producer import RolloutProducer
from m2po_cli.rollout.server import EngineServer, Load
from m2po_cli.rollout.transport import ShmWeightTransport, WeightTransport, resolve_transport
from m2po_cli.rollout.types import Finished, Group, Ticket
from m2po_cli.rollout.worker import model_signature
from m2po_cli.schedule import Schedule
from m2po_cli.torchrun import launch
from m2po_cli.train.adapter_sync import AdapterTransport
from m2po_cli.train.fifo import unshared
from m2po_cli.train.pack import grade_and_pack
from m2po_cli.train.packed import PackedRollouts, distribute
from m2po_cli.train.runlog import RunLog, forget_steps_from

TRAINED_LOG = "trained_prompts.jsonl"
SETTLED = "settled_groups.safetensors"  # rank 0's, in each checkpoint folder


class SeparateSource:
    """Rollouts from `vllm serve` engines through the producer (`RolloutSource` of `train`)."""

    mode = "separate"

    @staticmethod
    def check(recipe: Recipe, world: int) -> None:
        """Cheap checks before anything starts: nccl without CUDA stops here."""
        resolve_transport(recipe.rollout.weight_transport)

    def __init__(
        self,
        model_dir: Path,
        recipe: Recipe,
        learner: Learner,
        prompts: PromptBatches,
        episodes: Episodes,
        recorder: Recorder,
        log: RunLog | None,
        restored: Restored | None,
    ):
        self.recipe, self.learner, self.log = recipe, learner, log
        self.episodes = episodes
        self.run_dir = recipe.run_dir
        self.producer: RolloutProducer | None = None
        self.grader: Grader | None = None
        self._stack = ExitStack()  # closes what set-up started, whichever step fails
        try:
            if log is not None:
                self._start_producer(model_dir, prompts, restored)
            self.transport = make_transport(recipe, learner, self.producer, len(prompts.tokenizer))
            self._stack.callback(self.transport.close)
            if log is not None and self.transport.swept:
                log.message(
                    f"removed {len(self.transport.swept)} weight folders of killed runs from shared memory"
                )
        except BaseException:
            self._stack.close()
            raise

    def _start_producer(self, model_dir: Path, prompts: PromptBatches, restored: Restored | None) -> None:
        """Rank 0: the servers, the producer (with the prompts a checkpoint had in flight) and the grader."""
        recipe, log = self.recipe, self.log
        loop = restored.loop if restored is not None else {"step": 0, "in_flight": [], "fresh": []}
        carried = {
            k: [Ticket(epoch, prompts.prompt_of(i)) for epoch, i in loop[k]] for k in ("in_flight", "fresh")
        }
        settled = load_settled(restored.path) if restored is not None else {}
        carried["in_flight"] = [  # a settled group keeps its rows; its admission index comes later
            Group(t.epoch, t.prompt, *kept, index=-1)
            if (kept := settled.get((t.epoch, t.prompt.problem.index)))
            else t
            for t in carried["in_flight"]
        ]
        regenerate = sum(isinstance(t, Ticket) for t in carried["in_flight"])
        if carried["in_flight"]:
            log.message(
                f"kept {len(carried['in_flight']) - regenerate} settled groups of the checkpoint, trained as they "
                f"were; regenerating {regenerate} prompts that were in flight (partial responses are not kept)"
            )
        forget_steps_from(self.run_dir / TRAINED_LOG, loop["step"])
        servers = start_servers(recipe, model_dir, self.run_dir, log.message)
        for server in servers:
            self._stack.callback(server.close)
        self.grader = self._stack.enter_context(
            recipe_grader(recipe, grader_workers(1))
        )  # rank 0 grades alone
        self.producer = RolloutProducer(
            servers,
            prompts,
            recipe.rollout,
            Schedule.of(recipe),
            recipe.staleness.max_staleness,
            self.learner.version,
            **carried,
            settle=lambda finished: settle(finished, self.grader, recipe),
            run_seed=recipe.run.seed,
            episodes=self.episodes,
            adapters=recipe.lora.enabled,
        )
        self._stack.callback(self.producer.stop)

    def start(self, first_step: int) -> None:
        """The engines start from the learner's weights, whatever they held; then generation starts."""
        self.transport.push(self.learner)
        self.transport.wait()
        self.transport.take_metrics()
        if self.producer is not None:
            self.producer.start()

    def next_batch(self, step: int) -> PackedRollouts:
        """This step's groups (rank 0 takes them from the producer and grades them), dealt to the ranks."""
        batch = PackedRollouts.empty(self.learner.version)
        if self.producer is not None:
            groups = self.producer.take(self.recipe.rollout.prompts_per_step, self.learner.version)
            batch = PackedRollouts.cat(
                [g.rows for g in groups], torch.arange(len(groups) * self.recipe.rollout.n)
            )
            _record_trained(self.run_dir, step, self.learner.version, groups)
        return distribute(batch, Schedule.of(self.recipe))

    def after_update(self, learner: Learner) -> None:
        self.transport.after_update(learner)

    def state(self) -> dict:
        """Rank 0's producer: the data position and the prompts not yet trained."""
        return self.producer.snapshot() if self.producer is not None else {}

    def save(self, folder: Path) -> None:
        """Rank 0: the settled groups not yet trained, rows and all (`save_settled`); the prompts in
        flight travel in the loop state."""
        if self.producer is not None:
            with self.producer.cond:
                groups = [self.producer.done[i] for i in sorted(self.producer.done)]
            save_settled(folder, groups)

    def take_metrics(self) -> dict[str, float]:
        metrics = self.transport.take_metrics()
        if self.producer is not None:
            metrics.update(self.producer.take_metrics())
        return metrics

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SeparateSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_transport(
    recipe: Recipe, learner: Learner, producer: RolloutProducer | None, vocab: int
) -> WeightTransport:
    """The recipe's weight transport (every rank builds it; only rank 0 has the producer, and there
    every sync runs under a `SyncWatch` whose abort stops the engines and removes the transport's
    files before the process ends); a LoRA run's sends the adapter (`adapter_sync`)."""
    cfg, dtype = recipe.rollout, torch_dtype(recipe.model.dtype)
    swap, transport, lora = None, None, recipe.lora.enabled
    if producer is not None:
        abort = abort_run(producer.servers, lambda: transport is not None and transport.remove_files())
        swap = watched(producer.swap, SyncWatch(producer.servers, cfg.sync_timeout_s, abort))
    if lora:
        servers = producer.servers if producer is not None else None
        transport = AdapterTransport(recipe, learner, dtype, swap, servers, vocab)
    elif resolve_transport(cfg.weight_transport) == "nccl":
        from m2po_cli.rollout.nccl import NcclWeightTransport

        servers = producer.servers if producer is not None else None
        transport = NcclWeightTransport(
            learner.rank,
            cfg.sync_every,
            dtype,
            swap,
            learner,
            servers,
            cfg.transport_address,
            cfg.rendezvous_timeout_s,
        )
    else:
        transport = ShmWeightTransport(learner.rank, cfg.sync_every, dtype, swap, recipe.run.name)
    return transport


def watched(swap: Callable[[Load, int], None], watch: SyncWatch) -> Callable[[Load, int], None]:
    def run(load: Load, version: int) -> None:
        with watch.watching(version):
            swap(load, version)

    return run


def abort_run(servers: list[EngineServer], remove_files: Callable[[], object]) -> Callable[[str], None]:
    """How a `SyncWatch` ends the run from its own thread while the main one may be stuck in a
    collective: the line (last on the console), the engines stopped, the files removed, exit code 2
    (a user error's); torchrun then stops the other ranks."""

    def abort(line: str) -> None:
        sys.stdout.flush()
        for server in servers:
            server.close(grace_s=5.0)
        remove_files()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(2)

    return abort


def start_servers(
    recipe: Recipe, model_dir: Path, run_dir: Path, say: Callable[[str], None]
) -> list[EngineServer]:
    """Attach to `rollout.servers`, or start `num_engines` servers beside the learner; `say` tells
    the user what the run is waiting for.

    On GPUs, started engines take the devices of this node after its learner ranks', in order
    (`engine_devices`)."""
    cfg = recipe.rollout
    signature = model_signature(AutoConfig.from_pretrained(str(model_dir)).to_dict())
    if cfg.servers:
        say(f"checking the rollout server(s): {', '.join(cfg.servers)}")
        servers = [EngineServer(url) for url in cfg.servers]
        for s in servers:
            if cfg.attach_wait_s:  # started by a job script at the same time as the run
                s.wait_ready(cfg.attach_wait_s)
            s.check(signature, recipe.max_model_len, recipe.lora.rank)
        return servers
    wait = f"{cfg.server_start_timeout_s:.0f} s"
    say(f"starting {cfg.num_engines} vllm serve engine(s) (at most {wait}); output: {run_dir}/engine-*.log")
    servers: list[EngineServer] = []
    try:
        t0, windows = time.monotonic(), []
        for i in range(cfg.num_engines):  # all spawned, then all waited for: they load at once
            devices = None
            if torch.cuda.is_available():
                tp, local = cfg.tensor_parallel_size, launch().local_world
                devices = engine_devices(i, tp, local, torch.cuda.device_count())
            dtype, log_path = resolve_dtype(recipe.model.dtype), run_dir / f"engine-{i}.log"
            windows.append(time.monotonic() - t0)
            lora = (recipe.lora.rank, lora_slots(recipe.staleness.max_staleness, cfg.sync_every))
            servers.append(
                EngineServer.spawn(model_dir, cfg, dtype, recipe.max_model_len, log_path, devices, lora)
            )
        ready = wait_all(servers, cfg.server_start_timeout_s, t0)
        for s in servers:
            s.check(signature, recipe.max_model_len, recipe.lora.rank)
    except BaseException:
        for s in servers:
            s.close()
        raise
    shown = ", ".join(
        f"engine-{i} {a:.1f}-{b:.1f} s" for i, (a, b) in enumerate(zip(windows, ready, strict=True))
    )
    say(f"vllm serve engine(s) ready, from spawn to /health: {shown}")
    return servers


def wait_all(servers: list[EngineServer], timeout_s: float, t0: float) -> list[float]:
    """Wait for every spawned server at once; each one's ready time since `t0`. The first to fail
    stops the others (their waits then end at once) and its error is raised."""

    def wait(server: EngineServer) -> float:
        server.wait_ready(timeout_s)
        return time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = [pool.submit(wait, s) for s in servers]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for s in servers:
                s.close(grace_s=5.0)
            raise


def settle(finished: list[Finished], grader: Grader, recipe: Recipe) -> list[PackedRollouts]:
    """Grade finished groups and pack each into its `n` rows (the producer's settling thread): rows
    keep their group's submission version and each token's own."""
    return grade_and_pack(
        grader,
        [f.ticket.prompt.problem for f in finished],
        [f.ticket.prompt.token_ids for f in finished],
        [f.episodes for f in finished],
        [f.version for f in finished],
        recipe.algorithm,
    )


def save_settled(folder: Path, groups: list[Group]) -> None:
    """The groups the producer has settled and the learner not yet taken, to `SETTLED`: their rows
    are tensors already, so a resume trains them as they were (their tokens as stale) instead of
    generating them again. At the 8B recipe's admission bound that is up to ~16,000 groups, about
    200 M tokens at ~13 bytes each (token, behaviour logprob, version, trained flag): ~2.6 GB, once
    per checkpoint, against 1.4-1.7 hours of 4 engines to regenerate them."""
    if not groups:
        return
    rows = PackedRollouts.cat([g.rows for g in groups], torch.arange(sum(g.rows.num_rows for g in groups)))
    table = {
        "table/epoch_G": torch.tensor([g.epoch for g in groups]),
        "table/problem_G": torch.tensor([g.prompt.problem.index for g in groups]),
        "table/version_G": torch.tensor([g.version for g in groups]),
        "table/rows_G": torch.tensor([g.rows.num_rows for g in groups]),
    }
    save_file(unshared(rows.tensors() | table), str(folder / SETTLED))


def load_settled(folder: Path) -> dict[tuple[int, int], tuple[PackedRollouts, int]]:
    """What `save_settled` wrote, by (epoch, problem index): each group's rows and submission
    version; nothing for a checkpoint without it."""
    path = folder / SETTLED
    if not path.exists():
        return {}
    tensors = load_file(str(path))
    table = {
        k.removeprefix("table/"): tensors.pop(k).tolist() for k in list(tensors) if k.startswith("table/")
    }
    rows = PackedRollouts.from_tensors(min(table["version_G"]), tensors, {})
    starts = [0, *itertools.accumulate(table["rows_G"])]
    return {
        (epoch, problem): (replace(rows.take(torch.arange(a, b)), version=version), version)
        for epoch, problem, version, a, b in zip(
            table["epoch_G"], table["problem_G"], table["version_G"], starts[:-1], starts[1:], strict=True
        )
    }


def _record_trained(run_dir: Path, step: int, version: int, groups: list[Group]) -> None:
    record = {
        "step": step,
        "version": version,
        "problem_ids": [g.prompt.problem.index for g in groups],
        "epochs": [g.epoch for g in groups],
        "versions": [g.version for g in groups],
    }
    with open(run_dir / TRAINED_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


def engine_devices(index: int, tensor_parallel_size: int, local_world: int, num_gpus: int) -> list[int]:
    """The GPUs of started engine `index` on the node of rank 0: after the node's `local_world`
    learner ranks (GPUs 0..local_world - 1, whatever the number of nodes), `tensor_parallel_size`
    each. Raises ValueError naming the GPUs needed when the node's `num_gpus` are too few."""
    first = local_world + index * tensor_parallel_size
    needed = first + tensor_parallel_size
    if needed > num_gpus:
        raise ValueError(
            f"rollout.num_engines x rollout.tensor_parallel_size needs GPUs {local_world}..{needed - 1} beside "
            f"the {local_world} of this node's learner ranks, but this node has {num_gpus}"
        )
    return list(range(first, needed))
