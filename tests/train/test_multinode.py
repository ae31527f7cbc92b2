"""Many nodes, on one machine: two torchrun "nodes" on the loopback interface (one process each,
gloo) against one node of two processes, resumes across node counts, and the SLURM job scripts'
launch logic with `srun` and `scontrol` replaced by local stand-ins (tests/slurm/).

The recipe replicates the model over the two ranks (HSDP, `parallel.dp_replicate = 2`), so each
"node" holds a whole replica and only gradients cross between them, as on a cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from m2po_cli.rollout.settings import cpu_threads

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.toml"
STAND_INS = Path(__file__).resolve().parents[1] / "slurm"
SETS = [
    "rollout.prompts_per_step=8",
    "staleness.s=2",  # two batches in each rank's FIFO: a resume must re-read them all
    "checkpoint.every=2",
    "parallel.dp_replicate=2",
    "parallel.dp_shard=1",
    # Every update replays as many groups as it trains fresh: each rank trains its own rows of the
    # drawn groups, and the buffer's shards must resume on another layout too.
    'reuse={mode="replay", buffer=2, replay=1.0, max_age=4}',
    'logging.console="plain"',
]
# Metrics that time the run or its memory, not its data or its updates.
TIMING = ("time/", "perf/", "mem/")


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_sets(out: Path, steps: int) -> list[str]:
    """The `--set` arguments of the test recipe's runs."""
    return as_sets([*SETS, f"run.steps={steps}", f'run.output_dir="{out}"'])


def as_sets(sets: list[str]) -> list[str]:
    return [a for kv in sets for a in ("--set", kv)]


def torchrun(nodes: int, procs_per_node: int, out: Path, steps: int) -> Path:
    """`m2po train` of the test recipe on `nodes` loopback nodes (one torchrun agent each, as a
    cluster starts one per node) of `procs_per_node` processes; the run directory.

    Nodes of one process each bind their engine to the cores that engine would have as a local rank
    of one node (`cpu_threads`): on loopback they share the host, and the same thread count keeps
    vLLM's sums in the same order as the one-node reference's."""
    port, env = free_port(), {**os.environ, "PYTHONPATH": str(ROOT)}

    def node_env(node: int) -> dict[str, str]:
        if procs_per_node > 1 or nodes == 1:
            return env
        return {**env, **cpu_threads(node, nodes)}

    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--nproc-per-node",
                str(procs_per_node),
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "m2po-test",
                "-m",
                "m2po_cli",
                "train",
                str(QUICKSTART),
                *train_sets(out, steps),
            ],  # fmt: skip
            cwd=ROOT,
            env=node_env(node),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(nodes)
    ]
    outputs = [agent.communicate(timeout=900)[0] for agent in agents]
    for agent, output in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, output[-4000:]
    return out / "quickstart"


def sbatch(
    script: str, nodes: int, args: list[str], recipe: Path = QUICKSTART, **extra_env: str
) -> subprocess.CompletedProcess:
    """A job script run as SLURM runs it on the first node of a `nodes`-node job: SLURM's variables
    set, `srun` and `scontrol` the local stand-ins, every node the loopback address."""
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(STAND_INS), os.environ["PATH"]]),
        "PYTHONPATH": str(ROOT),
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * nodes),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "M2PO_PROCS_PER_NODE": "1",
        "M2PO_RDZV_PORT": str(free_port()),
        **extra_env,
    }
    cmd = ["bash", str(ROOT / "scripts" / "slurm" / script), str(recipe), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def assert_same_run(run: Path, reference: Path) -> None:
    """Every step's data and update metrics, and the exported weights, equal the reference run's."""
    ours, theirs = metrics(run), metrics(reference)
    assert [m["step"] for m in ours] == [m["step"] for m in theirs], "a step was lost or repeated"
    for a, b in zip(ours, theirs, strict=True):
        keys = {k for k in b if not k.startswith(TIMING)}
        assert keys <= set(a), sorted(keys - set(a))
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    weights, reference_weights = (
        load_file(str(r / "export" / "model.safetensors")) for r in (run, reference)
    )
    assert weights.keys() == reference_weights.keys()
    for name, tensor in reference_weights.items():
        assert (weights[name] - tensor).abs().max() <= 1e-6 * max(1.0, float(tensor.abs().max())), name


def launches(run: Path) -> list[tuple[int, int]]:
    return [(s["world_size"], s["nodes"]) for s in json.loads((run / "meta.json").read_text())["launches"]]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The reference: 4 steps on one node of two processes."""
    return torchrun(1, 2, tmp_path_factory.mktemp("one-node"), steps=4)


def test_two_nodes_equal_one_and_resume_on_one(one_node, tmp_path):
    """Two nodes started by the colocated job script, stopped after the step-2 checkpoint, resumed on
    one node: the same run, step for step, weight for weight."""
    done = sbatch("colocated.sbatch", 2, train_sets(tmp_path, steps=2))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "m2po: 2 node(s) x 1 process(es), rendezvous 127.0.0.1:" in done.stderr
    run = tmp_path / "quickstart"
    for m in metrics(run):  # each node's engine sampled its share of every batch
        assert (
            0
            < m["rollout/engine_tokens_min"]
            <= m["rollout/engine_tokens_max"]
            < m["rollout/generated_tokens"]
        )
    torchrun(1, 2, tmp_path, steps=4)
    assert launches(run) == [(2, 2), (2, 1)]
    assert_same_run(run, one_node)
    assert all(0.3 < m["reuse/replayed_token_frac"] < 0.7 for m in metrics(one_node)[1:])


def test_one_node_resumes_on_two(one_node, tmp_path):
    """The reference stopped after its step-2 checkpoint (its newer one removed), resumed on two
    nodes: the same run again."""
    run = tmp_path / "quickstart"
    shutil.copytree(one_node, run)
    shutil.rmtree(run / "checkpoints" / "step-000004")
    shutil.rmtree(run / "export")  # the resumed run must write its own
    torchrun(2, 1, tmp_path, steps=4)
    assert launches(run) == [(2, 1), (2, 2)]
    assert_same_run(run, one_node)


def test_the_separate_job_script_attaches_an_engine_node_to_a_learner_node(tmp_path):
    """Node 0 trains, node 1 serves (`m2po serve`); the run waits for the engine, attaches it (it
    starts none of its own), trains, and the script stops the engine when the run ends."""
    recipe, port = ROOT / "recipes" / "quickstart-separate.toml", free_port()
    sets = [
        "run.steps=3",
        "rollout.prompts_per_step=8",
        'logging.console="plain"',
        f'run.output_dir="{tmp_path}"',
    ]
    done = sbatch("separate.sbatch", 2, as_sets(sets), recipe=recipe, M2PO_SERVE_PORT=str(port))
    assert done.returncode == 0, done.stderr[-4000:]
    url = f"http://127.0.0.1:{port}"
    assert f'engines at "{url}"' in done.stderr
    run = tmp_path / "quickstart-separate"
    assert [m["step"] for m in metrics(run)] == [0, 1, 2]
    assert not list(run.glob("engine-*.log")), "the run started an engine of its own"
    assert f"checking the rollout server(s): {url}" in (run / "third-party.log").read_text() + done.stderr
    with socket.socket() as s, pytest.raises(OSError):
        s.connect(("127.0.0.1", port))  # the engine is gone with the job


def test_a_job_with_no_node_left_for_an_engine_stops_in_one_line(tmp_path):
    recipe = ROOT / "recipes" / "quickstart-separate.toml"
    done = sbatch("separate.sbatch", 1, as_sets([f'run.output_dir="{tmp_path}"']), recipe=recipe)
    assert done.returncode == 2
    assert (
        done.stderr.strip() == "separate.sbatch: 1 node(s) leave none for an engine after 1 learner node(s)"
    )
