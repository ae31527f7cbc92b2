"""Recipe schema contracts: every TOML file in the repository loads, malformed recipes fail with one
line naming the file and key, `--set` overrides win, `--dry-run` round-trips without torch or vLLM,
and `docs/recipes.md` matches the schema."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from functools import reduce
from pathlib import Path

import pytest
from click.testing import CliRunner

from m2po_cli.cli import main
from m2po_cli.config import PAPER_PROMPT_TEMPLATE, Recipe, Table, load_recipe
from m2po_cli.config.docs import render
from m2po_cli.config.tables import ConfigError, to_toml

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.toml"
# Build, run and tool outputs, not part of the repository (see .gitignore).
SKIP_DIRS = {".venv", ".git", "runs", "wandb", "build", "dist", ".pytest_cache", ".ruff_cache"}
TOML_FILES = sorted(p for p in ROOT.rglob("*.toml") if not SKIP_DIRS & set(p.relative_to(ROOT).parts))
RECIPES = [p for p in TOML_FILES if p.parent == ROOT / "recipes"]
GPU_TWINS = ["qwen3-8b-s256", "qwen3-1.7b-s256", "qwen2.5-math-7b-s256"]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- every TOML file in the repository -----------------------------------------------------------


def test_recipes_found():
    assert QUICKSTART in RECIPES
    assert {f"{name}{twin}.toml" for name in GPU_TWINS for twin in ("", "-grpo")} <= {p.name for p in RECIPES}


@pytest.mark.parametrize("path", TOML_FILES, ids=_id)
def test_toml_file_loads(path: Path):
    if path in RECIPES:
        recipe = load_recipe(path)
        assert recipe.run.name == path.stem, "run.name should match the recipe's file name"
    else:
        tomllib.loads(path.read_text())


def grpo_twin(m2po_recipe: Path) -> Path:
    """`NAME-grpo.toml`, or `NAME-grpo-separate.toml` for `NAME-separate.toml`."""
    stem = m2po_recipe.stem
    twin = f"{stem.removesuffix('-separate')}-grpo-separate" if stem.endswith("-separate") else f"{stem}-grpo"
    return m2po_recipe.with_name(f"{twin}.toml")


M2PO_RECIPES = [p for p in RECIPES if "-grpo" not in p.stem]


def test_every_recipe_has_its_grpo_twin():
    assert len(M2PO_RECIPES) == 11
    assert sorted(RECIPES) == sorted(M2PO_RECIPES + [grpo_twin(p) for p in M2PO_RECIPES])


REPRODUCE = sorted((ROOT / "recipes" / "reproduce").glob("*.toml"))


def test_the_reproduction_arms_differ_only_in_loss_and_staleness():
    """The paper's four arms: GRPO on- and off-policy, no trust region and M2PO at the same s."""
    trees = {p.stem: tomllib.loads(p.read_text()) for p in REPRODUCE}
    assert sorted(trees) == ["grpo-s0", "grpo-s32", "m2po-s32", "no-tr-s32"]
    for name, tree in trees.items():
        recipe = load_recipe(ROOT / "recipes" / "reproduce" / f"{name}.toml")
        assert (recipe.run.name, recipe.loss.type) == (name, name.rsplit("-s", 1)[0].replace("-", "_"))
        assert recipe.staleness.s == int(name.rsplit("-s", 1)[1])
        for key in ("loss", "staleness"):
            tree.pop(key)
        tree["run"].pop("name")
    first, *rest = trees.values()
    assert all(tree == first for tree in rest)


STALENESS = ROOT / "recipes" / "staleness"


def test_the_staleness_arms_differ_only_in_loss_and_train_long_past_s256():
    """The staleness curve's three losses: the same run but for [loss]; each rollout batch trained in
    several updates, so s = 256 is a FIFO of whole batches, and several times 256 updates after the
    FIFO's warm-up (its K batches from the initial policy)."""
    trees = {p.stem: tomllib.loads(p.read_text()) for p in sorted(STALENESS.glob("*.toml"))}
    assert sorted(trees) == ["grpo", "m2po", "no-tr"]
    for name, tree in trees.items():
        recipe = load_recipe(STALENESS / f"{name}.toml", ["staleness.s=256"])
        assert (recipe.run.name, recipe.loss.type) == (name, name.replace("-", "_"))
        assert recipe.updates_per_step > 1 and recipe.queue_batches * recipe.updates_per_step == 256
        assert recipe.run.steps * recipe.updates_per_step - 256 >= 3 * 256
        tree.pop("loss")
        tree["run"].pop("name")
    first, *rest = trees.values()
    assert all(tree == first for tree in rest)


REUSE_SETS = {
    "quickstart": (ROOT / "recipes" / "reuse", 200),
    "smollm2": (ROOT / "recipes" / "reuse" / "smollm2", 24),
}
# What a reuse arm may change against its set's on-policy `grpo.toml`: how it reuses, what it
# generates to do so, and its loss.
REUSE_KNOBS = {"reuse", "loss", "rollout.prompts_per_step", "run.steps", "run.name"}


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("name", sorted(REUSE_SETS))
def test_the_reuse_arms_differ_only_in_how_they_reuse(name: str):
    """Every arm of a reuse sweep makes the same updates of the same size as on-policy GRPO; only
    its reuse, its loss and what it generates for them differ, so the sweep compares reuse alone."""
    folder, updates = REUSE_SETS[name]
    paths = sorted(folder.glob("*.toml"))
    base = _leaves(tomllib.loads((folder / "grpo.toml").read_text()))
    base_recipe = load_recipe(folder / "grpo.toml")
    assert base_recipe.reuse.mode == "off" and base_recipe.staleness.s == 0
    size = base_recipe.rollout.prompts_per_step
    modes = set()
    for path in paths:
        recipe = load_recipe(path)
        leaves = _leaves(tomllib.loads(path.read_text()))
        changed = {k for k in base.keys() | leaves.keys() if base.get(k) != leaves.get(k)}
        assert {
            k for k in changed if not any(k == c or k.startswith(c + ".") for c in REUSE_KNOBS)
        } == set(), path
        assert recipe.run.steps * recipe.updates_per_step == updates, path
        fresh = recipe.rollout.prompts_per_step // recipe.mini_batches
        replayed = round(fresh * recipe.reuse.replay) if recipe.reuse.mode == "replay" else 0
        assert fresh + replayed == size // base_recipe.mini_batches, path
        modes.add(recipe.reuse.mode)
    assert modes == {"off", "epochs", "replay"}


@pytest.mark.parametrize("m2po_path", M2PO_RECIPES, ids=lambda p: p.stem)
def test_grpo_twin_differs_only_in_loss(m2po_path: Path):
    grpo_path = grpo_twin(m2po_path)
    m2po_tree, grpo_tree = (tomllib.loads(p.read_text()) for p in (m2po_path, grpo_path))
    for tree in (m2po_tree, grpo_tree):
        tree.pop("loss")
        tree["run"].pop("name")
    assert m2po_tree == grpo_tree

    _check_values(load_recipe(m2po_path), {"loss.type": "m2po", "loss.tau": 0.04, "run.name": m2po_path.stem})
    _check_values(
        load_recipe(grpo_path),
        {"loss.type": "grpo", "loss.eps_low": 0.2, "loss.eps_high": 0.2, "loss.dual_clip": None},
    )


# The paper's training setup (M2PO_FACTS.md, from the released Qwen2.5-Math-7B scripts).
PAPER_SETTINGS = {
    "data.source": "agentica-org/DeepScaleR-Preview-Dataset",
    "data.prompt_key": "problem",
    "data.answer_key": "answer",
    "data.shuffle_seed": 42,
    "data.prompt_template": PAPER_PROMPT_TEMPLATE,
    "data.max_prompt_tokens": 1536,
    "optim.lr": 1e-6,
    "optim.weight_decay": 0.01,
    "optim.grad_clip": 1.0,
    "optim.warmup_updates": 0,
    "optim.schedule": "constant",
    "rollout.prompts_per_step": 256,
    "rollout.n": 8,
    "rollout.max_new_tokens": 2560,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "train.mini_batch_prompts": 64,
    "updates_per_step": 4,
    "staleness.s": 256,
    "queue_batches": 64,
    "run.steps": 1200,
    "model.dtype": "bfloat16",
    "train.activation_checkpointing": "full",
    "checkpoint.every": 50,
    "logging.wandb": True,
    "logging.wandb_mode": "online",
}


@pytest.mark.parametrize("name", GPU_TWINS)
def test_gpu_recipe_has_paper_settings(name: str):
    _check_values(load_recipe(ROOT / f"recipes/{name}.toml"), PAPER_SETTINGS)


def _check_values(recipe: Recipe, expected: dict[str, object]) -> None:
    """Each dotted attribute path of `recipe` has its expected value."""
    actual = {key: reduce(getattr, key.split("."), recipe) for key in expected}
    assert actual == expected


# --- malformed recipes: one line on stderr, exit 2 -----------------------------------------------

# (id, key path the error must name or None for a TOML syntax error, {text in quickstart: replacement})
MALFORMED = [
    ("unknown_table", "bogus", {"[run]\n": "[bogus]\nx = 1\n\n[run]\n"}),
    ("unknown_key", "run.bogus", {"steps = 200\n": "steps = 200\nbogus = 1\n"}),
    ("unknown_loss_key", "loss.eps_low", {"tau = 0.04\n": "tau = 0.04\neps_low = 0.2\n"}),
    ("unknown_subtable_key", "data.synthetic.bogus", {"num_operands = 2\n": "num_operands = 2\nbogus = 1\n"}),
    ("string_for_int", "run.steps", {"steps = 200": 'steps = "200"'}),
    ("float_for_int", "run.steps", {"steps = 200": "steps = 1.5"}),
    ("float_for_bool", "train.compile", {"[train]\n": "[train]\ncompile = 1.5\n"}),
    ("string_for_float", "optim.lr", {"lr = 5e-4": 'lr = "fast"'}),
    (
        "scalar_for_table",
        "optim",
        {"[run]\n": "optim = 3\n\n[run]\n", "[optim]\nlr = 5e-4\nweight_decay = 0.0\n": ""},
    ),
    ("bad_literal", "model.dtype", {"[model]\n": '[model]\ndtype = "fp16"\n'}),
    ("betas_length", "optim.betas", {"weight_decay = 0.0": "weight_decay = 0.0\nbetas = [0.9]"}),
    ("negative_lr", "optim.lr", {"lr = 5e-4": "lr = -5e-4"}),
    ("zero_lr", "optim.lr", {"lr = 5e-4": "lr = 0.0"}),
    ("int_out_of_range", "data.synthetic.max_operand", {"max_operand = 4": "max_operand = 0"}),
    ("missing_model_dir", "model.path", {'path = "builtin:tiny-qwen3-untied"': 'path = "/nonexistent/dir"'}),
    ("unknown_builtin", "model.path", {'path = "builtin:tiny-qwen3-untied"': 'path = "builtin:nope"'}),
    ("n_1_with_std", "rollout.n", {"n = 8": "n = 1"}),
    ("unknown_loss_type", "loss.type", {'type = "m2po"': 'type = "ppo"'}),
    ("missing_loss_type", "loss.type", {'type = "m2po"\n': ""}),
    ("tau_zero", "loss.tau", {"tau = 0.04": "tau = 0.0"}),
    ("tau_negative", "loss.tau", {"tau = 0.04": "tau = -0.04"}),
    ("top_p_below_1", "rollout.top_p", {"n = 8\n": "n = 8\ntop_p = 0.9\n"}),
    # 32 / 8 = 4 updates per rollout batch, so s must be a multiple of 4.
    (
        "staleness_not_multiple",
        "staleness.s",
        {"[train]\n": "[train]\nmini_batch_prompts = 8\n", "s = 4": "s = 6"},
    ),
    (
        "mini_batch_not_dividing",
        "train.mini_batch_prompts",
        {"[train]\n": "[train]\nmini_batch_prompts = 5\n"},
    ),
    ("data_file_missing", "data.source", {'"synthetic:arithmetic"': '"/nonexistent/prompts.jsonl"'}),
    (
        "template_without_problem",
        "data.prompt_template",
        {'prompt_template = "{problem}"': 'prompt_template = "x"'},
    ),
    (
        "template_with_an_unknown_field",
        "data.prompt_template",
        {'prompt_template = "{problem}"': 'prompt_template = "{problem} {x}"'},
    ),
    (
        "reuse_unknown_rule",
        "reuse.rule",
        {"[checkpoint]\n": '[reuse]\nmode = "replay"\nrule = "lifo"\n\n[checkpoint]\n'},
    ),
    (
        "reuse_unknown_key",
        "reuse.buffr",
        {"[checkpoint]\n": '[reuse]\nmode = "replay"\nbuffr = 3\n\n[checkpoint]\n'},
    ),
    ("reuse_unknown_mode", "reuse.mode", {"[checkpoint]\n": '[reuse]\nmode = "ppo"\n\n[checkpoint]\n'}),
    ("reuse_replay_zero", "reuse.replay", {"[checkpoint]\n": "[reuse]\nreplay = 0.0\n\n[checkpoint]\n"}),
    (
        "reuse_one_epoch",
        "reuse.epochs",
        {"[checkpoint]\n": '[reuse]\nmode = "epochs"\nepochs = 1\n\n[checkpoint]\n'},
    ),
    # 3 passes of one update each: s = 4 is not a multiple of the 3 updates per rollout batch.
    (
        "reuse_epochs_staleness",
        "staleness.s",
        {"[checkpoint]\n": '[reuse]\nmode = "epochs"\nepochs = 3\n\n[checkpoint]\n'},
    ),
    ("invalid_toml", None, {"steps = 200": "steps = = 200"}),
    ("missing_model", "model", {'[model]\npath = "builtin:tiny-qwen3-untied"\n': ""}),
]


def _malformed(edits: dict[str, str]) -> str:
    text = QUICKSTART.read_text()
    for old, new in edits.items():
        assert text.count(old) == 1, f"{old!r} is not exactly once in {QUICKSTART.name}"
        text = text.replace(old, new)
    return text


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "m2po_cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env=None if env is None else {**os.environ, **env},
    )


def _one_line_problem(proc: subprocess.CompletedProcess, prefix: str) -> str | None:
    """What is wrong with a failed run's output, or None when it is the expected one-line error."""
    lines = proc.stderr.splitlines()
    if proc.returncode != 2:
        return f"exit {proc.returncode}, stderr {proc.stderr!r}"
    if "Traceback" in proc.stderr or len(lines) != 1:
        return f"expected one line, got {proc.stderr!r}"
    if proc.stdout:
        return f"unexpected stdout {proc.stdout!r}"
    if not lines[0].startswith(prefix):
        return f"{lines[0]!r} does not start with {prefix!r}"
    return None


def test_malformed_recipes_fail_with_one_line(tmp_path: Path):
    def check(case: tuple[str, str | None, dict[str, str]]) -> str | None:
        case_id, key, edits = case
        path = tmp_path / f"{case_id}.toml"
        path.write_text(_malformed(edits))
        proc = _cli("train", str(path))
        prefix = f"{path}: invalid TOML: " if key is None else f"{path}: {key}: "
        problem = _one_line_problem(proc, prefix)
        return f"{case_id}: {problem}" if problem else None

    with ThreadPoolExecutor(max_workers=4) as pool:
        failures = [f for f in pool.map(check, MALFORMED) if f]
    assert not failures, "\n".join(failures)


def test_error_messages_show_the_bad_value(tmp_path: Path):
    path = tmp_path / "r.toml"
    path.write_text(QUICKSTART.read_text().replace("steps = 200", 'steps = "200"'))
    with pytest.raises(Exception, match=r"run\.steps: must be an integer \(got '200'\)$"):
        load_recipe(path)
    path.write_text(QUICKSTART.read_text().replace("tau = 0.04", "tau = -1.0"))
    with pytest.raises(Exception, match=r"loss\.tau: must be > 0(\.0)? \(got -1\.0\)$"):
        load_recipe(path)


BAD_DATA = {
    "prompts.jsonl": (
        '{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": \n',
        "line 2: invalid JSON",
    ),
    "missing.jsonl": ('{"question": "1+1", "answer": "2"}\n', "record 0: missing field 'problem'"),
    "list.json": ('{"problem": "1+1"}', "expected a JSON list of records"),
    "broken.json": ("[{", "invalid JSON"),
    "binary.jsonl": (b"\xff\xfe\x00", "not UTF-8 text"),
    "broken.parquet": ("not parquet", "not a readable parquet file"),
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("name", list(BAD_DATA))
@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
def test_bad_data_fails_in_seconds_before_anything_starts(tmp_path: Path, name: str, dry_run: bool):
    content, message = BAD_DATA[name]
    data = tmp_path / name
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    args = [
        "train",
        str(QUICKSTART),
        "--set",
        f'data.source="{data}"',
        "--set",
        f'run.output_dir="{tmp_path}"',
    ]
    start, cpu = time.monotonic(), _children_cpu_s()
    proc = _cli(*args, *(["--dry-run"] if dry_run else []))
    elapsed, cpu = time.monotonic() - start, _children_cpu_s() - cpu
    assert _one_line_problem(proc, f"{data}: ") is None, _one_line_problem(proc, f"{data}: ")
    assert message in proc.stderr
    # About 1 s on an idle machine. CPU time is what the command costs; the wall clock of a loaded
    # machine is bounded too, well below an engine start (importing vLLM alone takes 8-10 s).
    assert cpu < 5, f"{cpu:.1f} s of CPU"
    assert elapsed < 30, f"{elapsed:.1f} s"
    assert not (tmp_path / "quickstart").exists(), "the run started before the data was checked"


def test_tensor_parallel_size_that_does_not_divide_the_launch_fails_before_anything_starts(tmp_path: Path):
    out = f'run.output_dir="{tmp_path}"'
    for tp, world in [(2, None), (3, "4")]:
        sets = ["--set", f"rollout.tensor_parallel_size={tp}", "--set", out]
        proc = _cli("train", str(QUICKSTART), *sets, env=None if world is None else {"WORLD_SIZE": world})
        prefix = f"{QUICKSTART}: rollout.tensor_parallel_size: {tp} does not divide the {world or 1} process"
        assert _one_line_problem(proc, prefix) is None, _one_line_problem(proc, prefix)
    # 2 nodes of 3 processes: TP 2 divides the 6 ranks but an engine would straddle the nodes.
    sets = ["--set", "rollout.tensor_parallel_size=2", "--set", out]
    proc = _cli("train", str(QUICKSTART), *sets, env={"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3"})
    prefix = f"{QUICKSTART}: rollout.tensor_parallel_size: 2 does not divide the 3 process(es) on each node"
    assert _one_line_problem(proc, prefix) is None, _one_line_problem(proc, prefix)
    assert not (tmp_path / "quickstart").exists(), "the run started before the launch was checked"
    # A dry run checks the recipe alone: the launch that will run it is not known yet.
    dry = _cli("train", str(QUICKSTART), "--set", "rollout.tensor_parallel_size=2", "--dry-run")
    assert dry.returncode == 0, dry.stderr


@pytest.mark.parametrize(
    "sets, env, problem",
    [
        # 3 replicas of 4 ranks: 2 nodes of 4 processes hold 8.
        (
            ["parallel.dp_replicate=3"],
            {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
            "parallel.dp_replicate: 3 does not divide the 8 process(es) of this launch (WORLD_SIZE)",
        ),
        (
            ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
            {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
            "parallel: dp_replicate 2 x dp_shard 2 = 4 ranks, but this launch has 8 process(es) (WORLD_SIZE)",
        ),
        # Groups of 3 consecutive ranks over nodes of 2: the second group holds half of two nodes.
        (
            ["parallel.dp_replicate=2", "parallel.dp_shard=3"],
            {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"},
            "parallel.dp_shard: a shard group of 3 ranks would split the 2 process(es) of a node unevenly",
        ),
    ],
)
def test_parallel_degrees_that_do_not_fit_the_launch_fail_before_anything_starts(
    tmp_path, sets, env, problem
):
    args = [a for kv in sets for a in ("--set", kv)] + ["--set", f'run.output_dir="{tmp_path}"']
    proc = _cli("train", str(QUICKSTART), *args, env=env)
    assert _one_line_problem(proc, f"{QUICKSTART}: {problem}") is None, _one_line_problem(proc, problem)
    assert not (tmp_path / "quickstart").exists(), "the run started before the launch was checked"


def test_parallel_degrees_that_fit():
    recipe = load_recipe(QUICKSTART)
    assert recipe.parallel.degrees(8) == (1, 8)  # the default: FSDP over every rank
    hsdp = load_recipe(QUICKSTART, ["parallel.dp_replicate=2"]).parallel
    assert hsdp.degrees(8) == (2, 4) and hsdp.launch_problem(8, 4) is None
    # A shard group may span whole nodes (a model too large for one), or a node hold several groups.
    assert (
        load_recipe(QUICKSTART, ["parallel.dp_replicate=2", "parallel.dp_shard=8"]).launch_problem(16, 4)
        is None
    )
    assert (
        load_recipe(QUICKSTART, ["parallel.dp_replicate=4", "parallel.dp_shard=2"]).launch_problem(8, 4)
        is None
    )
    with pytest.raises(ConfigError, match="parallel.dp_shard: must be >= 1, or -1"):
        load_recipe(QUICKSTART, ["parallel.dp_shard=0"])


def test_fsdp_over_nodes_gets_the_hsdp_suggestion():
    """Qwen3-8B's 8.19 B parameters on 2 nodes of 8 GPUs: 16 bytes a parameter over 8 GPUs (a
    replica a node) or over 16 (FSDP). Suggested, never taken: one node, or replicas already, say
    nothing."""
    fsdp = load_recipe(QUICKSTART).parallel
    assert fsdp.layout_advice(16, 8, 8_190_000_000) == (
        "parallel.dp_replicate is 1 on 2 nodes: FSDP gathers every layer across nodes in each forward and "
        "backward; HSDP (parallel.dp_replicate = 2, dp_shard = -1) keeps them within a node and sends only "
        "gradients between nodes, at 16.4 GB of learner state a GPU instead of 8.2 GB"
    )
    assert fsdp.layout_advice(8, 8, 8_190_000_000) is None
    hsdp = load_recipe(QUICKSTART, ["parallel.dp_replicate=2"]).parallel
    assert hsdp.layout_advice(16, 8, 8_190_000_000) is None


# --- --set overrides -----------------------------------------------------------------------------


def test_override_precedence_and_types():
    assert load_recipe(QUICKSTART).run.steps == 200  # file beats the default of 100
    r = load_recipe(
        QUICKSTART,
        ["optim.lr=1e-4", "run.name=foo", "rollout.n=4", "logging.wandb=true", "run.steps=7", "run.steps=9"],
    )
    assert r.optim.lr == 1e-4 and type(r.optim.lr) is float
    assert r.run.name == "foo"
    assert r.rollout.n == 4 and type(r.rollout.n) is int
    assert r.logging.wandb is True
    assert r.run.steps == 9  # the last override wins
    assert load_recipe(QUICKSTART, ["optim.betas=[0.8, 0.9]"]).optim.betas == (0.8, 0.9)
    assert load_recipe(QUICKSTART, ['loss={type = "grpo"}']).loss.type == "grpo"


def test_setting_the_loss_type_switches_the_loss_and_says_what_it_dropped():
    notes: list[str] = []
    r = load_recipe(QUICKSTART, ["loss.type=grpo", "loss.eps_high=0.28"], notes)
    assert (r.loss.type, r.loss.eps_low, r.loss.eps_high) == ("grpo", 0.2, 0.28)
    assert notes == [f'{QUICKSTART} (--set): loss.type = "grpo" drops loss.tau, which grpo does not take']
    notes.clear()
    r = load_recipe(QUICKSTART, ["loss.type=m2po_cap", "loss.type=m2po"], notes)
    assert (r.loss.type, r.loss.tau) == ("m2po", 0.04) and notes == [], "tau is a key of both"
    with pytest.raises(ConfigError, match="loss.tau"):  # set after the switch: the new type lacks it
        load_recipe(QUICKSTART, ["loss.type=grpo", "loss.tau=0.02"])


def test_the_cli_says_what_a_loss_switch_dropped():
    proc = _cli("train", str(QUICKSTART), "--set", "loss.type=no_tr", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith('loss.type = "no_tr" drops loss.tau, which no_tr does not take')
    )
    assert '[loss]\ntype = "no_tr"\n' in proc.stdout


def test_bad_overrides_fail_with_one_line():
    cases = [
        (["--set", "optim.bogus=1"], "optim.bogus"),
        (["--set", "optim.lr=-1"], "optim.lr"),
        (["--set", "no_equals_sign"], "no_equals_sign"),
        (["--set", "run.name.x=1"], "run.name.x"),
        (["--set", "lora.rank=8", "--set", 'lora.target_modules=["q_proj","k_proj"]'], "lora.target_modules"),
        (["--set", "lora.rank=8", "--set", 'lora.target_modules=["qkv"]'], "lora.target_modules"),
        (["--set", "lora.rank=1000"], "lora.rank"),
        (["--set", "lora.dropout=1.0"], "lora.dropout"),
    ]

    def check(case: tuple[list[str], str]) -> str | None:
        args, key = case
        proc = _cli("train", str(QUICKSTART), *args)
        problem = _one_line_problem(proc, f"{QUICKSTART} (--set): {key}: ")
        return f"{args}: {problem}" if problem else None

    with ThreadPoolExecutor(max_workers=4) as pool:
        failures = [f for f in pool.map(check, cases) if f]
    assert not failures, "\n".join(failures)


# --- --dry-run -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_dry_run_round_trips(path: Path, tmp_path: Path):
    result = CliRunner().invoke(main, ["train", str(path), "--dry-run", "--set", "run.seed=3"])
    assert result.exit_code == 0, result.output
    assert result.stdout == to_toml(load_recipe(path, ["run.seed=3"]))
    printed = tmp_path / "resolved.toml"
    printed.write_text(result.stdout)
    assert load_recipe(printed) == load_recipe(path, ["run.seed=3"])


def test_dry_run_imports_neither_torch_nor_vllm():
    code = (
        "import sys\n"
        "from m2po_cli.cli import main\n"
        f"main(['train', {str(QUICKSTART)!r}, '--dry-run'], standalone_mode=False)\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[run]")


def test_train_makes_idle_openmp_threads_sleep_unless_the_user_chose():
    # The engine and the learner share one process's OpenMP threads: spinning ones stall on a busy machine.
    code = (
        "import os, sys\n"
        "from m2po_cli.cli import idle_threads_sleep\n"
        "idle_threads_sleep()\n"
        "assert 'torch' not in sys.modules\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, expected in [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")]:
        run_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=run_env, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == expected


# --- docs/recipes.md -----------------------------------------------------------------------------


def test_every_key_has_a_description():
    def walk(table: type[Table], path: str) -> list[str]:
        missing = []
        for key, info in table.model_fields.items():
            if not info.description:
                missing.append(f"{path}{key}")
            ann = info.annotation
            members = getattr(ann, "__args__", (ann,))
            for member in members:
                if isinstance(member, type) and issubclass(member, Table):
                    missing += walk(member, f"{path}{key}.")
        return missing

    assert walk(Recipe, "") == []


def test_recipe_docs_are_current():
    assert (ROOT / "docs/recipes.md").read_text() == render(), (
        "docs/recipes.md is out of date with m2po_cli/config/; regenerate it with "
        "`python -m m2po_cli.config.docs > docs/recipes.md`"
    )
