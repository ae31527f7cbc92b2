"""Separate mode end to end: a real `vllm serve` beside the learner, killed with SIGKILL and resumed."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from m2po_cli.checkpoint import STEP_PREFIX, complete_steps
from m2po_cli.train.separate import SETTLED, engine_devices

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart-separate.toml"
TOOLS = RECIPE.with_name("tools-quickstart.toml")
NUM_PROBLEMS, PER_STEP, STEPS, MAX_STALENESS = 48, 8, 10, 2


def command(out: Path, *extra: str, recipe: Path = RECIPE) -> list[str]:
    sets = [
        *extra,
        'run.name="run"',
        f'run.output_dir="{out}"',
        f"run.steps={STEPS}",
        f"rollout.prompts_per_step={PER_STEP}",
        "rollout.n=4",
        f"data.synthetic.num_problems={NUM_PROBLEMS}",
        f"staleness.max_staleness={MAX_STALENESS}",
        "rollout.sync_every=1",
        "checkpoint.every=3",
        "checkpoint.keep=5",
        "checkpoint.export_hf=false",
        'logging.console="plain"',
    ]
    return [sys.executable, "-m", "m2po_cli", "train", str(recipe), *(a for s in sets for a in ("--set", s))]


def group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return members


def records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(condition, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run exited early with code {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def killed_at(
    tmp_path: Path, step: int, extra: tuple[str, ...] = (), recipe: Path = RECIPE, until=lambda: True
) -> None:
    """Start the run (resuming what is there) and SIGKILL its process group once step `step` has
    taken its rollouts and `until()` holds; check that nothing of it survives."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(RECIPE.parents[1]))
    with open(tmp_path / f"killed-at-{step}.log", "wb") as log:
        run = subprocess.Popen(command(tmp_path, *extra, recipe=recipe), stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)  # fmt: skip
        try:
            wait_for(
                lambda: any(r["step"] >= step for r in records(run_dir, "trained_prompts.jsonl")) and until(),
                900,
                run,
            )
            members = group_members(run.pid)
            assert any("api_server" in " ".join(p.cmdline()) for p in members), "no engine in the run's group"
        finally:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    deadline = time.monotonic() + 10
    while group_members(run.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_members(run.pid), "processes of the killed run are still alive"


def check_every_prompt_trained_once(run_dir: Path) -> None:
    steps_recorded = [r["step"] for r in records(run_dir, "trained_prompts.jsonl")]
    assert steps_recorded == list(range(STEPS)), "the resumed run kept records of steps it trained again"
    last_per_step = {r["step"]: r for r in records(run_dir, "trained_prompts.jsonl")}
    trained = [
        (e, i) for r in last_per_step.values() for e, i in zip(r["epochs"], r["problem_ids"], strict=True)
    ]
    assert len(trained) == len(set(trained)) == STEPS * PER_STEP, "a prompt was trained twice"
    assert {(0, i) for i in range(NUM_PROBLEMS)} <= set(trained), "a prompt of the first epoch was lost"
    for r in last_per_step.values():  # version-ordered, and within the bound
        trained_at = [r["version"] + j // PER_STEP for j in range(PER_STEP)]
        assert all(0 <= t - v <= MAX_STALENESS for t, v in zip(trained_at, r["versions"], strict=True))
    steps = records(run_dir, "metrics.jsonl")
    assert all(m["staleness/max"] <= MAX_STALENESS for m in steps)  # every trained token's own version
    assert sum(m["rollout/regenerated"] for m in steps) == 0, "a weight sync threw work away"


def stale_settled(run_dir: Path) -> dict[tuple[int, int], int]:
    """The groups the newest checkpoint kept settled that were submitted before its policy version
    (one update a step here), {(epoch, problem): version}: a resumed run, which submits at that
    version or later, cannot have generated them again."""
    done = complete_steps(run_dir)
    if not done or not (done[-1] / SETTLED).exists():
        return {}
    table = load_file(str(done[-1] / SETTLED))
    version = int(done[-1].name.removeprefix(STEP_PREFIX))
    columns = [table[f"table/{name}_G"].tolist() for name in ("epoch", "problem", "version")]
    return {(e, i): v for e, i, v in zip(*columns, strict=True) if v < version}


def test_sigkill_then_resume_trains_every_prompt_once_and_the_settled_groups_as_they_were(tmp_path):
    # Killed mid-step, after a checkpoint that kept settled groups as stale as they can be. One row
    # per micro-batch makes the learner the slower side, so the engine runs ahead to the bound.
    run_dir, slow = tmp_path / "run", "train.micro_batch_sequences=1"
    killed_at(tmp_path, 4, (slow,), until=lambda: bool(stale_settled(run_dir)))
    kept = stale_settled(run_dir)
    env = dict(os.environ, PYTHONPATH=str(RECIPE.parents[1]))
    second = subprocess.run(command(tmp_path, slow), capture_output=True, text=True, env=env, timeout=900)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert re.search(
        r"kept [1-9]\d* settled groups of the checkpoint, trained as they were; regenerating", out
    )
    check_every_prompt_trained_once(run_dir)
    trained = {
        (e, i): v
        for r in records(run_dir, "trained_prompts.jsonl")
        for e, i, v in zip(r["epochs"], r["problem_ids"], r["versions"], strict=True)
    }
    assert {k: trained[k] for k in kept} == kept, "a kept group was generated again"


def test_a_lora_run_killed_and_resumed_trains_every_prompt_once_on_checked_adapters(tmp_path):
    """LoRA: each sync loads the adapter under its version's name (no pause), requests name the
    adapter of their submission, and every push passes the probe check; adapters older than the bound
    are unloaded, and a killed run's adapter folder in shared memory is swept by the next start."""
    from m2po_cli.rollout.transport import PREFIX, shm_root

    lora = ("lora.rank=8", "optim.lr=0.005")
    killed_at(tmp_path, 4, lora)
    assert list(shm_root().glob(f"{PREFIX}run-adapters-pid*")), "the killed run left no adapter folder"
    env = dict(os.environ, PYTHONPATH=str(RECIPE.parents[1]))
    second = subprocess.run(command(tmp_path, *lora), capture_output=True, text=True, env=env, timeout=900)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    run_dir = tmp_path / "run"
    check_every_prompt_trained_once(run_dir)
    steps = records(run_dir, "metrics.jsonl")
    assert all(m["rollout/push_check_mismatch"] < 1e-4 for m in steps)
    # One version a sync (sync_every 1) within the bound is held, never more: MAX_STALENESS + 1.
    assert all(1 <= m["rollout/adapters_loaded"] <= MAX_STALENESS + 1 for m in steps)
    assert steps[-1]["rollout/adapters_loaded"] == MAX_STALENESS + 1
    # A request's tokens all carry its submission version: a token is as stale as its group.
    assert all(m["staleness/mean"] == m["staleness/max"] for m in steps)
    assert all(0 < m["perf/weight_sync_bytes"] < 200_000 for m in steps)  # the adapter, not the model
    assert not list(shm_root().glob(f"{PREFIX}run-adapters-pid*")), "an adapter folder was left behind"


def test_the_tools_recipe_killed_twice_mid_episode_resumes_with_every_prompt_trained_once(tmp_path):
    # Two-turn episodes with the calculator tool, killed while groups are in the middle of their
    # episodes, twice; every token's staleness stays within the bound.
    episodes = ('rollout.mode="separate"', "data.synthetic.max_operand=999")
    killed_at(tmp_path, 4, episodes, TOOLS)
    killed_at(tmp_path, 7, episodes, TOOLS)
    env = dict(os.environ, PYTHONPATH=str(RECIPE.parents[1]))
    last = subprocess.run(
        command(tmp_path, *episodes, recipe=TOOLS), capture_output=True, text=True, env=env, timeout=900
    )
    assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
    run_dir = tmp_path / "run"
    check_every_prompt_trained_once(run_dir)
    steps = records(run_dir, "metrics.jsonl")
    assert all(m["env/tool_calls_mean"] > 0.2 and m["env/turns_mean"] > 1.2 for m in steps)
    assert all(m["env/env_tokens_mean"] > 0 for m in steps)


def test_an_engine_synced_every_few_updates_lags_and_the_bound_still_holds(tmp_path):
    """With a sync every 3 updates the engine's weights lag the learner's by up to 2 updates: the
    tokens trained at a version 2 past a sync are all at least 2 stale, and none beyond the bound."""
    bound, every = 3, 3
    cmd = command(tmp_path) + [
        "--set",
        f"rollout.sync_every={every}",
        "--set",
        f"staleness.max_staleness={bound}",
    ]
    env = dict(os.environ, PYTHONPATH=str(RECIPE.parents[1]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "run"
    versions = {r["step"]: r["version"] for r in records(run_dir, "trained_prompts.jsonl")}
    steps = records(run_dir, "metrics.jsonl")
    assert [m["step"] for m in steps] == list(range(STEPS))
    assert all(m["staleness/max"] <= bound for m in steps)
    lagging = [m for m in steps if versions[m["step"]] % every == every - 1]
    assert lagging and all(m["staleness/min"] >= every - 1 for m in lagging), [
        (m["step"], versions[m["step"]], m["staleness/min"]) for m in steps
    ]
    assert sum(m["perf/weight_syncs"] for m in steps) == STEPS // every


@pytest.mark.parametrize(
    "reuse", ['{mode="epochs", epochs=2}', '{mode="replay", buffer=2, replay=1.0, max_age=3}']
)
def test_reuse_in_separate_mode_keeps_both_bounds(tmp_path, reuse):
    """Epochs: two passes a step, and admission keeps the second pass within max_staleness too.
    Replay: every update replays as many groups as it trains fresh, none older than max_age."""
    cmd = command(tmp_path) + ["--set", f"reuse={reuse}"]
    env = dict(os.environ, PYTHONPATH=str(RECIPE.parents[1]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = records(tmp_path / "run", "metrics.jsonl")
    assert [m["step"] for m in steps] == list(range(STEPS))
    assert all(m["staleness/max"] <= MAX_STALENESS for m in steps)
    if "epochs" in reuse:
        assert [m["optim/version"] for m in steps] == [2 * (k + 1) for k in range(STEPS)]
        assert all(m["staleness/max"] >= 1 for m in steps), "the second pass is one update later"
    else:
        assert all(0.3 < m["reuse/replayed_token_frac"] < 0.7 for m in steps[1:])
        assert all(1 <= m["reuse/age_min"] and m["reuse/age_max"] <= 3 for m in steps[1:])


def test_an_attached_server_that_refuses_connections_stops_the_run_at_once_in_one_line(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cmd = command(tmp_path) + ["--set", f'rollout.servers=["{url}"]']  # server_start_timeout_s: 600
    env = dict(os.environ, PYTHONPATH=str(RECIPE.parents[1]))
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert f"checking the rollout server(s): {url}" in out
    assert out.rstrip().endswith(f"rollout server {url} refused the connection: is vllm serve running there?")
    assert "Traceback" not in out
    assert time.monotonic() - t0 < 200, "the run waited for a server that refuses connections"


def started_run(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path, list[psutil.Process]]:
    """A separate-mode run in its own session, once it has trained a step; and its engine's processes."""
    env = dict(os.environ, PYTHONPATH=str(RECIPE.parents[1]))
    log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (the run writes it until it ends)
    run = subprocess.Popen(
        command(tmp_path), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    run_dir = tmp_path / "run"
    wait_for(lambda: records(run_dir, "trained_prompts.jsonl"), 900, run)
    servers = [p for p in group_members(run.pid) if "api_server" in " ".join(p.cmdline())]
    assert len(servers) == 1, "one vllm serve in the run's group"
    return run, tmp_path / f"{name}.log", [servers[0], *servers[0].children(recursive=True)]


def gone(procs: list[psutil.Process], timeout_s: float = 30) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_sigterm_stops_the_run_like_ctrl_c_and_leaves_nothing_in_shared_memory(tmp_path):
    """A scheduler's preemption: the run's own process gets SIGTERM."""
    from m2po_cli.rollout.transport import PREFIX, shm_root

    run, log, engine = started_run(tmp_path, "sigterm")
    try:
        assert list(shm_root().glob(f"{PREFIX}*-pid{run.pid}-*")), (
            "the run keeps its weights in shared memory"
        )
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert not list(shm_root().glob(f"{PREFIX}*-pid{run.pid}-*")), "the run left its weights in shared memory"
    assert gone(engine), "a process of the run's server is still running"


@pytest.mark.parametrize(
    "index, tp, local_world, expected",
    [(0, 1, 4, [4]), (3, 1, 4, [7]), (1, 2, 4, [6, 7]), (0, 1, 6, [6])],
)
def test_started_engines_take_the_gpus_after_this_nodes_learner_ranks(index, tp, local_world, expected):
    """Engine devices come from the node's own ranks, not the world's: 2 nodes of 4 learner ranks on
    8-GPU nodes put the engines on GPUs 4-7 of rank 0's node (the world size, 8, asked for GPU 8+)."""
    assert engine_devices(index, tp, local_world, num_gpus=8) == expected


def test_engines_that_do_not_fit_beside_the_nodes_learner_ranks_are_named():
    with pytest.raises(
        ValueError, match=r"needs GPUs 4\.\.8 beside the 4 of this node's learner ranks, but this node has 8"
    ):
        engine_devices(4, 1, 4, num_gpus=8)
