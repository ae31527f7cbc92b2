"""`m2po train` in separate mode: engines in their own processes generate while the learner trains.

Rank 0 owns the rollout servers (started here or attached), the producer thread and the grader;
every rank trains its slice of each optimizer batch and takes part in the weight transport. One
step takes `prompts_per_step` finished groups, oldest version first, and trains them in
`updates_per_step` updates; the engines get the weights every `rollout.sync_every` updates. How
stale each group is stays visible: `staleness/*` is computed per group from its recorded version.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from m2po_cli import checkpoint
from m2po_cli.config import Recipe
from m2po_cli.data import Problem, PromptBatches, load_problems
from m2po_cli.device import resolve_dtype, torch_dtype
from m2po_cli.errors import RunError
from m2po_cli.grader import Grader, grader_workers
from m2po_cli.learner import Learner
from m2po_cli.loss import build_loss
from m2po_cli.models import check_model_dir, load_tokenizer, resolve_model
from m2po_cli.packed import PackedRollouts, distribute, owners, pack_groups
from m2po_cli.producer import Group, RolloutProducer
from m2po_cli.record import Recorder
from m2po_cli.runlog import RunLog
from m2po_cli.server import EngineServer
from m2po_cli.train import (
    checkpoint_due,
    rollout_metrics,
    rows_per_update,
    train_on,
)
from m2po_cli.weight_transport import ShmWeightTransport, WeightTransport, resolve_transport

TRAINED_LOG = "trained_prompts.jsonl"


def train_separate(recipe: Recipe, problems: list[Problem] | None = None) -> Path:
    """Run a separate-mode recipe to completion (resuming from the run's last checkpoint)."""
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    model_dir = resolve_model(recipe.model.path)
    check_model_dir(model_dir)
    resolve_transport(recipe.rollout.weight_transport)  # nccl without CUDA stops here, before anything starts
    prompts = PromptBatches(  # cheap checks first: the model's files, the prompt set and its template
        load_problems(recipe.data) if problems is None else problems,
        load_tokenizer(model_dir),
        recipe.data,
        recipe.rollout.prompts_per_step,
    )
    learner = Learner(model_dir, recipe)
    torch.manual_seed(recipe.run.seed)
    loss_fn = build_loss(recipe.loss)
    rank = learner.rank
    first_step, carried, skipped = resume(run_dir, recipe, learner, prompts)
    recorder = Recorder(run_dir, recipe.inspect, recipe.run.seed, rank, learner.world)
    recorder.start(first_step)
    log = producer = grader = None
    stack = ExitStack()  # closes what set-up started, whichever step fails
    try:
        if rank == 0:
            log = RunLog(run_dir, recipe, learner.world)
            stack.callback(log.close)
            log.start(first_step)
            for path, problem in skipped:
                log.message(f"skipping damaged checkpoint {path}: {problem}")
            _forget_steps_from(run_dir, first_step)
            servers = start_servers(recipe, model_dir, run_dir, learner.world, log.message)
            for server in servers:
                stack.callback(server.close)
            producer = RolloutProducer(
                servers,
                prompts,
                recipe.rollout,
                recipe.prompts_per_update,
                recipe.staleness.max_staleness,
                learner.version,
                **carried,
            )
            stack.callback(producer.stop)
            grader = stack.enter_context(Grader(num_workers=grader_workers(1)))  # rank 0 grades alone
            if first_step:
                log.message(
                    f"resumed at step {first_step}, policy version {learner.version}; regenerating "
                    f"{len(carried['in_flight'])} prompts that were in flight"
                )
        transport = make_transport(recipe, learner, producer)
        stack.callback(transport.close)
        if log is not None and transport.swept:
            log.message(f"removed {len(transport.swept)} weight folders of killed runs from shared memory")
        transport.push(learner)  # the engines start from the learner's weights, whatever they held
        transport.take_metrics()
        if producer is not None:
            producer.start()
        for step in range(first_step, recipe.run.steps):
            run_step(step, recipe, learner, loss_fn, producer, grader, transport, recorder, log, run_dir)
            if checkpoint_due(recipe, step):
                loop_state = {"step": step + 1, **(producer.snapshot() if producer else {})}
                checkpoint.save(run_dir, step + 1, learner, loop_state, recipe.checkpoint.keep)
        if recipe.checkpoint.export_hf:
            learner.export_hf(run_dir / "export", model_dir)
    finally:
        stack.close()
    if log is not None:
        log.message(log.summary())
    return run_dir


def resume(
    run_dir: Path, recipe: Recipe, learner: Learner, prompts: PromptBatches
) -> tuple[int, dict, list[tuple[Path, str]]]:
    """Restore the newest checkpoint that verifies, if any.

    Returns (steps done, prompts to carry into the producer, newer checkpoints skipped and why)."""
    nothing = {"in_flight": [], "fresh": []}
    if recipe.checkpoint.resume != "auto":
        return 0, nothing, []
    last, skipped = checkpoint.choose(run_dir)
    if last is None:
        return 0, nothing, skipped
    if "in_flight" not in checkpoint.read_loop(last):
        raise RunError(f"{last}: checkpoint of a colocated run; resume it with rollout.mode = colocated")
    loop = checkpoint.load(last, learner)
    prompts.load_state_dict(loop["data"])
    carried = {k: [(epoch, prompts.prompt_of(i)) for epoch, i in loop[k]] for k in ("in_flight", "fresh")}
    return loop["step"], carried, skipped


def make_transport(recipe: Recipe, learner: Learner, producer: RolloutProducer | None) -> WeightTransport:
    """The recipe's weight transport (every rank builds it; only rank 0 has the producer)."""
    cfg, dtype = recipe.rollout, torch_dtype(recipe.model.dtype)
    swap = producer.swap if producer is not None else None
    if resolve_transport(cfg.weight_transport) == "nccl":
        from m2po_cli.nccl_transport import NcclWeightTransport

        servers = producer.servers if producer is not None else None
        return NcclWeightTransport(learner.rank, cfg.sync_every, dtype, swap, learner, servers)
    return ShmWeightTransport(learner.rank, cfg.sync_every, dtype, swap, recipe.run.name)


def start_servers(
    recipe: Recipe, model_dir: Path, run_dir: Path, world: int, say: Callable[[str], None]
) -> list[EngineServer]:
    """Attach to `rollout.servers`, or start `num_engines` servers beside the learner; `say` tells
    the user what the run is waiting for.

    On GPUs, started engines take the devices after the learner's `world` ranks, in order."""
    cfg = recipe.rollout
    wait = f"{cfg.server_start_timeout_s:.0f} s"
    if cfg.servers:
        say(f"waiting for the rollout server(s) to answer /health (at most {wait}): {', '.join(cfg.servers)}")
        servers = [EngineServer(url) for url in cfg.servers]
        for s in servers:
            s.wait_ready(cfg.server_start_timeout_s)
        return servers
    say(f"starting {cfg.num_engines} vllm serve engine(s) (at most {wait}); output: {run_dir}/engine-*.log")
    servers: list[EngineServer] = []
    try:
        for i in range(cfg.num_engines):
            dtype = resolve_dtype(recipe.model.dtype)
            log_path = run_dir / f"engine-{i}.log"
            devices = (
                _engine_devices(i, cfg.tensor_parallel_size, world) if torch.cuda.is_available() else None
            )
            servers.append(EngineServer.start(model_dir, cfg, dtype, recipe.max_model_len, log_path, devices))
    except BaseException:
        for s in servers:
            s.close()
        raise
    return servers


def run_step(step, recipe, learner, loss_fn, producer, grader, transport, recorder, log, run_dir) -> None:
    """Take one step's groups, train on them (syncing the engines), log."""
    t0 = time.perf_counter()
    batch, versions = PackedRollouts.empty(learner.version), []
    if producer is not None:
        groups = producer.take(recipe.rollout.prompts_per_step, learner.version)
        batch = pack_rollouts(groups, grader, recipe)
        versions = [g.version for g in groups]
        _record_trained(run_dir, step, learner.version, groups)
    batch = distribute(batch, owners(batch.row_B, rows_per_update(recipe), learner.world))
    t1 = time.perf_counter()
    metrics = train_on(batch, learner, loss_fn, transport.after_update, recipe, recorder, step)
    metrics.update(rollout_metrics(batch, 0))  # its staleness keys are replaced below
    if versions:
        metrics.update(staleness_metrics(versions, learner.version - recipe.updates_per_step, recipe))
    metrics.update(transport.take_metrics())
    if producer is not None:
        metrics.update(producer.take_metrics())
    metrics.update({"time/rollout": t1 - t0, "time/train": time.perf_counter() - t1})
    metrics["time/step"] = time.perf_counter() - t0
    if log is not None:
        log.log(step, metrics)


def pack_rollouts(groups: list[Group], grader: Grader, recipe: Recipe) -> PackedRollouts:
    """Grade a step's groups and pack them; each row keeps the version that generated its group."""
    n = recipe.rollout.n
    golds = [g.prompt.problem.answer for g in groups for _ in range(n)]
    t0 = time.perf_counter()
    rewards = grader.grade_many([c.text for g in groups for c in g.completions], golds)
    a = recipe.algorithm
    batch = pack_groups(
        min(g.version for g in groups),
        0,
        [g.prompt.token_ids for g in groups],
        [g.completions for g in groups],
        torch.tensor(rewards, dtype=torch.float32).view(len(groups), n),
        a.normalize_std,
        a.std_eps,
    )
    batch.version_B = torch.tensor([g.version for g in groups], dtype=torch.long).repeat_interleave(n)
    batch.meta = {"time/grade": time.perf_counter() - t0}
    return batch


def staleness_metrics(versions: list[int], first_version: int, recipe: Recipe) -> dict[str, float]:
    """Per-group staleness: the update that trained the group minus the version that generated it."""
    per_update = recipe.prompts_per_update
    staleness = [first_version + j // per_update - v for j, v in enumerate(versions)]
    m = {
        "staleness/min": float(min(staleness)),
        "staleness/mean": sum(staleness) / len(staleness),
        "staleness/max": float(max(staleness)),
    }
    for k in range(recipe.staleness.max_staleness + 1):
        m[f"staleness/hist_{k}"] = float(sum(s == k for s in staleness))
    return m


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


def _engine_devices(index: int, tensor_parallel_size: int, world: int) -> list[int]:
    first = world + index * tensor_parallel_size
    needed = first + tensor_parallel_size
    if needed > torch.cuda.device_count():
        raise ValueError(
            f"rollout.num_engines x rollout.tensor_parallel_size needs GPUs {world}..{needed - 1} beside the "
            f"learner's {world}, but this node has {torch.cuda.device_count()}"
        )
    return list(range(first, needed))


def _forget_steps_from(run_dir: Path, first_step: int) -> None:
    """Drop the records of steps a resumed run will train again, as RunLog does for metrics."""
    path = run_dir / TRAINED_LOG
    if path.exists():
        whole = path.read_text().split("\n")[:-1]  # a line cut short by a kill has no newline yet
        kept = [line for line in whole if json.loads(line)["step"] < first_step]
        path.write_text("".join(line + "\n" for line in kept))
