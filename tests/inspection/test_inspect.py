"""`m2po inspect ratios` on real runs: it shows what the loss did in training, from the same code.

Two short quickstart runs (M2PO and GRPO, s = 2, one update per step) record every sequence of every
update; the command then runs as a whole process. Its numbers are checked against training's own
metrics and against literal computations on the recorded tensors.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from m2po_cli.config import InspectConfig
from m2po_cli.config.loss import GRPOLoss, GSPOLoss, M2POCapLoss, M2POLoss, NoTRLoss
from m2po_cli.inspection.ratios import WHAT_IF, analyse
from m2po_cli.loss import build_loss
from m2po_cli.record import Recorder, Sample, load_records, step_path
from m2po_cli.train.runlog import RunLog

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "rollout.prompts_per_step=16",
    "rollout.n=4",
    "run.steps=4",
    "staleness.s=2",
    "inspect.every=1",
    "inspect.tokens=0",
    "checkpoint.export_hf=false",
]


def m2po(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "m2po_cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An M2PO run (tau 0.001, so it masks) and a GRPO run (eps 0.1, so it clips), under tmp/runs.

    Two updates of staleness put the trust region's mean M2 at about 0.006 (measured: 0.0061, 0.0115,
    0.0060 over steps 1-3), six times tau, so the run masks whatever the machine's rounding; the
    GRPO run's ratios leave 1 +- 0.1 on 14-30 tokens a step."""
    from m2po_cli.train.loop import train
    from tests.conftest import recipe_for

    tmp = tmp_path_factory.mktemp("inspect")
    out = f'run.output_dir="{tmp / "runs"}"'
    return {
        "m2po": train(recipe_for(tmp, *SHORT, out, "run.name=m2po", "loss.tau=0.001")),
        "grpo": train(
            recipe_for(tmp, *SHORT, out, "run.name=grpo", 'loss={type="grpo", eps_low=0.1, eps_high=0.1}')
        ),
    }


@pytest.fixture(scope="module")
def reports(runs) -> dict[str, dict]:
    """`m2po inspect ratios RUN --json` of each run, as a whole process."""
    out = {}
    for name, run in runs.items():
        done = m2po("inspect", "ratios", str(run), "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = json.loads(done.stdout)
    return out


def in_process(*args: str):
    """The CLI in this process (torch already imported): for the cheap option checks."""
    from click.testing import CliRunner

    from m2po_cli.cli import main

    threads = torch.get_num_threads()  # the command sets one thread: not for the tests that follow
    try:
        return CliRunner().invoke(main, list(args))
    finally:
        torch.set_num_threads(threads)


def logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_rule(report: dict) -> dict:
    return next(rule for rule in report["rules"] if rule["run_loss"])


# --- the same numbers training logged ------------------------------------------------------------


@pytest.mark.slow
def test_m2po_masks_what_training_masked(runs, reports):
    rule, metrics = run_rule(reports["m2po"]), logged(runs["m2po"])
    assert [u["step"] for u in rule["per_update"]] == [m["step"] for m in metrics]
    for u in rule["per_update"]:
        assert u["num_tokens"] == metrics[u["step"]]["loss/num_tokens"]
        assert u["acted"] == metrics[u["step"]]["m2po/num_masked"], u["step"]
    assert sum(u["acted"] for u in rule["per_update"]) > 0, "the run masked nothing: the check is empty"


@pytest.mark.slow
def test_clip_clips_what_training_clipped(runs, reports):
    rule, metrics = run_rule(reports["grpo"]), logged(runs["grpo"])
    assert rule["rule"] == "grpo clip 0.1"
    for u in rule["per_update"]:
        m = metrics[u["step"]]
        assert u["num_tokens"] == m["loss/num_tokens"]
        assert u["acted"] == round(m["loss/clip_frac"] * m["loss/num_tokens"]), u["step"]
        assert u["pos"] == round(m["loss/clip_frac_pos"] * m["loss/num_tokens"]), u["step"]
    assert sum(u["acted"] for u in rule["per_update"]) > 0, "the run clipped nothing: the check is empty"


# --- the same numbers, computed literally from the recorded tensors ------------------------------


def recorded(run: Path) -> list[dict]:
    """Every recorded sequence as a dict of plain Python values."""
    rows = []
    for path in sorted((run / "inspect").glob("step-*.safetensors")):
        t = load_file(str(path))
        start = 0
        for i, n in enumerate(t["lengths_R"].tolist()):
            tok = {
                k: t[k][start : start + n].tolist() for k in ("behaviour_logprobs_N", "learner_logprobs_N")
            }
            tok |= {k: t[k][start : start + n].tolist() for k in ("logprobs_N", "entropy_N", "staleness_N")}
            row = {k: t[k][i].item() for k in ("advantages_R", "update_R")}
            rows.append(tok | row)
            start += n
    return rows


def float32_difference(a: float, b: float) -> float:
    """a - b rounded to float32, as torch subtracts two float32 tensors."""
    return float(torch.tensor(a, dtype=torch.float32) - torch.tensor(b, dtype=torch.float32))


def m2po_literal(z: list[float], tau: float) -> int:
    """Algorithm 1, one token at a time (of equal M2 too): how many trust-region tokens go."""
    m2 = sorted((x * x for x in z if x > 0), reverse=True)
    gone = 0
    while gone < len(m2) and sum(m2[gone:]) / (len(m2) - gone) > tau:
        gone += 1
    return gone


@pytest.mark.slow
def test_numbers_match_the_recorded_tensors(runs, reports):
    report = reports["m2po"]
    rows = recorded(runs["m2po"])
    # log r in float32, as the loss and `analyse` form it: a ratio at a rule's edge then falls on the
    # same side here, whatever the machine rounded the logprobs to.
    tokens = [
        (float32_difference(lp, b), a, e, lb - b, lp - lb, r["update_R"])
        for r in rows
        for lp, b, lb, e, a in zip(
            r["logprobs_N"],
            r["behaviour_logprobs_N"],
            r["learner_logprobs_N"],
            r["entropy_N"],
            [r["advantages_R"]] * len(r["logprobs_N"]),
            strict=True,
        )
    ]
    log_r = [t[0] for t in tokens]
    n = len(log_r)
    assert report["num_tokens"] == n and report["num_sequences"] == len(rows)
    ordered = sorted(log_r)
    for name, q in {"p01": 0.01, "p50": 0.5, "p99": 0.99, "min": 0.0, "max": 1.0}.items():
        assert report["quantiles"][name] == pytest.approx(ordered[math.floor(q * (n - 1))], abs=1e-6)

    ratio = [math.exp(x) for x in log_r]
    everything = report["all"]
    assert everything["ess_frac"] == pytest.approx(sum(ratio) ** 2 / (n * sum(x * x for x in ratio)))
    z = [x * math.copysign(1, a) if a else 0.0 for x, a, *_ in tokens]
    assert everything["m2_trust_region"] == pytest.approx(
        sum(x * x for x in z if x > 0) / sum(x > 0 for x in z)
    )
    assert everything["rms_mismatch"] == pytest.approx(math.sqrt(sum(t[3] ** 2 for t in tokens) / n))
    assert everything["rms_drift"] == pytest.approx(math.sqrt(sum(t[4] ** 2 for t in tokens) / n))

    rules = {rule["rule"]: rule for rule in report["rules"]}
    ratio32 = torch.tensor(log_r, dtype=torch.float32).exp().tolist()  # the clip's r, as the loss forms it
    clipped = [
        (a > 0 and r > 1.2) or (a < 0 and r < 0.8) for r, (_, a, *_) in zip(ratio32, tokens, strict=True)
    ]
    assert rules["grpo clip 0.2"]["frac"] == pytest.approx(sum(clipped) / n)
    positive = sum(c for c, t in zip(clipped, tokens, strict=True) if t[1] > 0)
    assert rules["grpo clip 0.2"]["frac_pos"] == pytest.approx(positive / sum(t[1] > 0 for t in tokens))
    entropy = [t[2] for c, t in zip(clipped, tokens, strict=True) if c]
    if entropy:
        assert rules["grpo clip 0.2"]["entropy_acted"] == pytest.approx(sum(entropy) / len(entropy), rel=1e-5)

    for tau in (0.01, 0.02, 0.04, 0.08):
        for u in rules[f"m2po tau {tau:g}"]["per_update"]:
            z_u = [zz for zz, t in zip(z, tokens, strict=True) if t[5] == u["update"]]
            assert u["acted"] == m2po_literal(z_u, tau), (tau, u["update"])

    for bucket in report["entropy_by_ratio"]:
        inside = [
            t[2] for r, t in zip(ratio, tokens, strict=True) if bucket["lo"] <= abs(r - 1) < bucket["hi"]
        ]
        assert bucket["frac"] == pytest.approx(len(inside) / n)
        if inside:
            assert bucket["entropy"] == pytest.approx(sum(inside) / len(inside), rel=1e-5)


# --- the command as a user runs it ---------------------------------------------------------------

WITHOUT_VLLM = """
import sys
from m2po_cli.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print("vllm modules loaded:", loaded, file=sys.stderr)
"""


@pytest.mark.slow
def test_command_prints_tables_and_writes_plots_without_vllm(runs, tmp_path):
    plots = tmp_path / "plots"
    start = time.monotonic()
    # No RUN_DIR: the newest run under ./runs, the GRPO one.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM, "inspect", "ratios", "--plot", str(plots)],
        cwd=runs["grpo"].parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - start
    print(f"m2po inspect ratios --plot: {elapsed:.1f} s as a whole process (bench/bench_inspect.py times it)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vllm modules loaded: []" in done.stderr
    assert done.stdout.startswith(str(Path("runs") / "grpo"))
    for title in ("log r by staleness", "quantiles of the importance ratio", "tokens each rule clips"):
        assert title in done.stdout
    assert "grpo clip 0.1 *" in done.stdout and "grpo clip 0.1, as trained" in done.stdout
    names = ["entropy_vs_log_ratio.png", "log_ratio_by_staleness.png", "rules_over_training.png"]
    assert sorted(p.name for p in plots.iterdir()) == names
    for p in plots.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


@pytest.mark.slow
def test_steps_selects_a_range(runs):
    done = in_process("inspect", "ratios", str(runs["m2po"]), "--steps", "2:", "--json")
    assert json.loads(done.stdout)["steps"] == [2, 3]
    for steps, message in [("10:20", "no recorded tokens in steps 10:20"), ("x", "--steps: expected A:B")]:
        done = in_process("inspect", "ratios", str(runs["m2po"]), "--steps", steps)
        assert done.exit_code == 2 and message in done.output, done.output


@pytest.mark.slow
def test_bad_run_directories_get_one_line_and_exit_2(runs, tmp_path):
    def fails(run: Path, expected: str, *extra: str) -> None:
        done = m2po("inspect", "ratios", str(run), *extra)
        assert done.returncode == 2, done.stderr[-2000:]
        assert expected in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr

    fails(tmp_path, "not a run directory")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.toml").write_text((runs["m2po"] / "config.toml").read_text())
    fails(bare, "no recorded tokens")
    partial = tmp_path / "partial"
    (partial / "inspect").mkdir(parents=True)
    (partial / "config.toml").write_text((runs["m2po"] / "config.toml").read_text())
    whole = step_path(runs["m2po"], 1).read_bytes()
    (partial / "inspect" / "step-000001.safetensors").write_bytes(whole[: len(whole) // 2])
    fails(partial, "partly written")


# --- the recorder, on the CPU --------------------------------------------------------------------


def sample(update: int, lengths: list[int]) -> Sample:
    n, r = sum(lengths), len(lengths)
    g = torch.Generator().manual_seed(update)
    return Sample(
        behaviour_logprobs_N=-torch.rand(n, generator=g),
        learner_logprobs_N=-torch.rand(n, generator=g),
        logprobs_N=-torch.rand(n, generator=g),
        entropy_N=torch.rand(n, generator=g),
        lengths_R=torch.tensor(lengths),
        advantages_R=torch.randn(r, generator=g),
        staleness_N=torch.full((n,), 3),
        turn_N=torch.zeros(n, dtype=torch.long),
        update_R=torch.full((r,), update),
        row_R=torch.arange(r),
        scored_R=torch.ones(r, dtype=torch.bool),
    )


def test_records_round_trip_and_a_resumed_run_drops_what_it_redoes(tmp_path):
    recorder = Recorder(tmp_path, InspectConfig(every=1, tokens=0), seed=0, rank=0, world=1)
    for step in range(4):
        assert recorder.pick(step, step, [0, 1, 2], [3, 1, 4]) == ([0, 1, 2], True)  # as the trainer does
        recorder.add(sample(step, [3, 1, 4]), {"loss/clip_frac": 0.25, "loss/num_tokens": 8.0})
        recorder.write(step)
    (tmp_path / "inspect" / ".step-000004.safetensors.tmp").write_bytes(b"half")  # killed mid-write
    records = load_records(tmp_path)
    assert records.step_R.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert torch.equal(records.sample.entropy_N[8:16], sample(1, [3, 1, 4]).entropy_N)
    assert records.updates[2] == {"update": 2, "step": 2, "loss/clip_frac": 0.25, "loss/num_tokens": 8.0}
    Recorder(tmp_path, InspectConfig(every=1), seed=0, rank=0, world=1).start(first_step=2)
    assert sorted(p.name for p in (tmp_path / "inspect").iterdir()) == [
        "step-000000.safetensors",
        "step-000001.safetensors",
    ]


def test_records_of_the_first_format_give_each_token_its_rows_staleness(tmp_path):
    """Records written before tokens carried their own staleness (format 1, `staleness_R` per
    sequence) still load: each token gets the staleness of its sequence."""
    from safetensors.torch import save_file

    old = sample(5, [3, 1, 2]).tensors()
    del old["staleness_N"]
    old["staleness_R"] = torch.tensor([4, 6, 5])
    path = step_path(tmp_path, 5)
    path.parent.mkdir(parents=True)
    save_file(old, str(path), metadata={"format": "m2po-inspect-1", "step": "5", "updates": "[]"})
    assert load_records(tmp_path).sample.staleness_N.tolist() == [4, 4, 4, 6, 5, 5]


def test_pick_is_seeded_bounded_and_equal_across_ranks():
    rows, lengths = list(range(100, 164)), [10] * 64
    shares = [
        Recorder(Path("."), InspectConfig(tokens=95), seed=1, rank=rank, world=4).pick(3, 7, rows, lengths)
        for rank in range(4)
    ]
    assert [len(s) for s, _ in shares] == [2, 2, 2, 2]  # 9 rows fit in 95 tokens: 8, a multiple of 4
    assert all(keep for _, keep in shares)
    chosen = [r for s, _ in shares for r in s]
    assert chosen == sorted(chosen) and set(chosen) <= set(rows)
    again = Recorder(Path("."), InspectConfig(tokens=95), seed=1, rank=0, world=4).pick(3, 7, rows, lengths)
    assert again == shares[0]
    every = Recorder(Path("."), InspectConfig(tokens=0), seed=1, rank=0, world=1).pick(3, 7, rows, lengths)
    assert every == (rows, True)
    few = [
        Recorder(Path("."), InspectConfig(tokens=25), seed=1, rank=rank, world=4).pick(3, 7, rows, lengths)
        for rank in range(4)
    ]  # two rows for four ranks: ranks 2 and 3 score a copy and drop it
    assert [keep for _, keep in few] == [True, True, False, False]
    assert [s for s, _ in few[2:]] == [s for s, _ in few[:2]] and few[0] != few[1]
    assert Recorder(Path("."), InspectConfig(every=5), seed=1, rank=0, world=1).due(10)
    assert not Recorder(Path("."), InspectConfig(every=0), seed=1, rank=0, world=1).due(0)


def test_console_headline_shows_the_share_the_loss_masked():
    g = torch.Generator().manual_seed(0)
    behaviour_BT = -torch.rand(4, 50, generator=g)
    logprobs_BT = behaviour_BT + 0.5 * torch.randn(4, 50, generator=g)
    advantages_BT, mask_BT = torch.randn(4, 1, generator=g).expand(4, 50), torch.ones(4, 50)
    loss = build_loss(M2POLoss(tau=0.04))
    aux_BT, metrics = loss.prepare(logprobs_BT - behaviour_BT, advantages_BT, mask_BT)
    _, call_metrics = loss(logprobs_BT, behaviour_BT, advantages_BT, mask_BT, aux_BT, 200)
    m = {k: float(v) for k, v in (metrics | call_metrics).items()}
    assert m["m2po/num_masked"] > 0
    assert f"masked {100 * m['m2po/num_masked'] / 200:.2f}%" in RunLog._headline(m)
    m.pop("m2po/num_masked")
    assert f"clipped {100 * m['loss/clip_frac']:.2f}%" in RunLog._headline(m)


@pytest.mark.parametrize(
    "run_loss",
    [
        NoTRLoss(),
        GSPOLoss(),
        M2POCapLoss(tau=0.04),
        GRPOLoss(eps_low=0.1, eps_high=0.3, dual_clip=2.0),
        M2POLoss(tau=0.04),
    ],
    ids=lambda cfg: cfg.type,
)
@pytest.mark.parametrize("behaviour", ["engine", "learner"])
def test_every_loss_type_can_be_the_run_loss(tmp_path, run_loss, behaviour):
    recorder = Recorder(tmp_path, InspectConfig(every=1), seed=0, rank=0, world=1)
    for step in range(3):
        recorder.pick(step, step, [0, 1, 2, 3], [5, 2, 7, 1])
        recorder.add(sample(step, [5, 2, 7, 1]), {"loss/clip_frac": 0.0, "loss/num_tokens": 15.0})
        recorder.write(step)
    records = load_records(tmp_path)
    report, acted = analyse(records, run_loss, behaviour)
    ours = [rule for rule in report["rules"] if rule["run_loss"]]
    assert len(ours) == 1 and ours[0]["config"] == run_loss.model_dump()
    assert len(report["rules"]) == len(WHAT_IF) + (run_loss not in WHAT_IF)
    assert [u["step"] for u in ours[0]["per_update"]] == [0, 1, 2]
    assert sum(u["num_tokens"] for u in ours[0]["per_update"]) == report["num_tokens"] == 45
    if isinstance(run_loss, NoTRLoss):
        assert not acted["no_tr"].any()
    # log r is formed from the behaviour logprobs the run's loss used.
    s = records.sample
    behaviour_N = s.behaviour_logprobs_N if behaviour == "engine" else s.learner_logprobs_N
    assert report["quantiles"]["max"] == pytest.approx(float((s.logprobs_N - behaviour_N).max()), abs=1e-6)


def test_replayed_tokens_are_bucketed_by_age_apart_from_fresh_ones():
    from m2po_cli.inspection.ratios import staleness_buckets

    staleness_N = torch.tensor([0, 0, 4, 1, 4, 5, 20])
    replayed_N = torch.tensor([False, False, False, True, True, True, True])
    bucket_N, names = staleness_buckets(staleness_N, replayed_N)
    assert names == ["0", "4", "replayed 1", "replayed 4-5", "replayed 20"]
    assert bucket_N.tolist() == [0, 0, 1, 2, 3, 3, 4]
    assert staleness_buckets(staleness_N)[1] == ["0", "1", "4-5", "20"]


def test_episodes_of_several_turns_are_split_by_turn(tmp_path):
    """Each model turn's tokens get their own log r row and each rule its share per turn, counted
    literally; records written before episodes load with every token in the first turn."""
    from rich.console import Console

    from m2po_cli.inspection.report import show

    recorder = Recorder(tmp_path, InspectConfig(every=1, tokens=0), seed=0, rank=0, world=1)
    recorder.pick(0, 0, [0, 1, 2], [5, 2, 7])
    turns = sample(0, [5, 2, 7])
    turns.turn_N = torch.tensor([0, 0, 1, 1, 1] + [0, 0] + [0, 1, 1, 2, 2, 2, 2])
    recorder.add(turns, {"loss/clip_frac": 0.0, "loss/num_tokens": 14.0})
    recorder.write(0)
    report, acted = analyse(load_records(tmp_path), M2POLoss(tau=0.01), "engine")
    assert [(t["bucket"], t["num_tokens"]) for t in report["turns"]] == [("1", 5), ("2", 5), ("3", 4)]
    log_ratio = turns.logprobs_N - turns.behaviour_logprobs_N
    in_2 = turns.turn_N == 1
    assert report["turns"][1]["rms_log_ratio"] == pytest.approx(float(log_ratio[in_2].square().mean().sqrt()))
    for rule in report["rules"]:
        done = acted[rule["rule"]]
        for t in range(3):
            where = turns.turn_N == t
            assert rule["frac_by_turn"][str(t + 1)] == int((done & where).sum()) / int(where.sum())
    console = Console(record=True, width=200)
    show(report, str(tmp_path), "m2po", console)
    text = console.export_text()
    assert "log r by the episode's model turn" in text and "the same, by model turn" in text

    from safetensors.torch import save_file

    before = sample(0, [5, 2, 7]).tensors()  # written before episodes: format 2, no turn_N
    del before["turn_N"]
    path = step_path(tmp_path / "old", 0)
    path.parent.mkdir(parents=True)
    save_file(before, str(path), metadata={"format": "m2po-inspect-2", "step": "0", "updates": "[]"})
    records = load_records(tmp_path / "old")
    assert records.sample.turn_N.tolist() == [0] * 14
    report, _ = analyse(records, M2POLoss(tau=0.01), "engine")
    assert "turns" not in report  # one turn: no turn table
